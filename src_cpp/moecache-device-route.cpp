// moecache-device-route.cpp - the routing of the device path on the device (moecache-device.cpp): the prior
// as ggml ops on the router's outputs, its boosts uploaded once per token, and the router's gating computed
// again for the counting, so that llama.cpp's routing ops keep no use outside themselves.

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstring>

// layer il's boosts for its next token, into the host copy of its device's bias: b for each expert the
// prior's mask holds (moecache_route_preferred: cached), then K copies of b (the router's top J get it
// too, whatever the cache: Top-J); b as moecache_route_token computes it
void moecache_device_prior_boosts(moecache & mc, int il) {
    moecache_device & d = mc.dev;
    const moecache_layer & L = mc.layers[il];
    const moecache_routing_params & rp = mc.rparams;
    const int64_t N = mc.n_expert;
    const int64_t K = mc.n_expert_used;
    const float b = rp.prior_lambda > 0.0f && L.prior_scale > 0.0f ? moecache_layer_boost(L, rp.prior_lambda) : 0.0f;
    float * at = d.bias_host[d.layer_group[il]].data() + (size_t) d.layer_slot[il] * (N + K);
    for (int64_t e = 0; e < N; e++) {
        at[e] = b != 0.0f && moecache_route_preferred(L, (int32_t) e) ? b : 0.0f;
    }
    for (int64_t k = 0; k < K; k++) {
        at[N + k] = b;
    }
}

// the boosts of every layer the prior routes on a device, uploaded (before a token computes)
void moecache_device_prior_upload(moecache & mc) {
    moecache_device & d = mc.dev;
    for (int il = 0; il < mc.n_layer; il++) {
        if (d.prior[il]) {
            moecache_device_prior_boosts(mc, il);
        }
    }
    for (size_t g = 0; g < d.devs.size(); g++) {
        ggml_backend_tensor_set(d.bias[g], d.bias_host[g].data(), 0, ggml_nbytes(d.bias[g]));
    }
}

// the prior as ggml ops on the router's outputs, on their device ([N] per token, one token):
//     u       = z (softmax router) or s                              // the scale the prior boosts
//     bias    = the layer's boosts, with b at r[0:J] (set_rows)      // r[0:J]: llama.cpp's top-J
//     ranked  = u + bias                                             // as moecache_route_token adds
//     chosen  = top-K of ranked, then ordered by s (r order)         // the experts that run
// moecache_route_token's choice is r[0:J] and the first K - J others of ranked's order; r[0:J] are
// the first J of that order (the largest u, each boosted), so the two are the same K experts, in the
// same order, but where two boosted scores tie exactly (ggml's sort breaks ties its own way)
ggml_tensor * moecache_device_prior_select(moecache & mc, ggml_context * ctx, int il, ggml_tensor * selected,
                                         ggml_tensor * logits, ggml_tensor * selection) {
    moecache_device & d = mc.dev;
    const moecache_layer & L = mc.layers[il];
    const moecache_routing_params & rp = mc.rparams;
    const int32_t g = d.layer_group[il];
    const int64_t N = mc.n_expert;
    const int64_t K = mc.n_expert_used;
    const int64_t J = std::min<int64_t>(rp.top_j, K);
    ggml_tensor * u = L.graph.rank_on_logits ? logits : selection; // (z for a softmax router, else s)
    const size_t at = (size_t) d.layer_slot[il] * (N + K) * sizeof(float);
    ggml_tensor * bias = ggml_view_2d(ctx, d.bias[g], 1, N, sizeof(float), at); // [1, N]: a row per expert
    if (J > 0) {
        ggml_tensor * b_j = ggml_view_2d(ctx, d.bias[g], 1, J, sizeof(float), at + N * sizeof(float)); // [1, J]
        ggml_tensor * top = ggml_view_1d(ctx, selected, J, 0);                                          // r[0:J]
        bias = ggml_set_rows(ctx, ggml_dup(ctx, bias), b_j, top);
    }
    ggml_tensor * ranked = ggml_add(ctx, ggml_reshape_2d(ctx, u, N, 1), ggml_reshape_2d(ctx, bias, N, 1)); // [N, 1]
    ggml_tensor * sorted = ggml_argsort(ctx, ranked, GGML_SORT_ORDER_DESC);                                // [N, 1]
    ggml_tensor * chosen = ggml_cont(ctx, ggml_view_2d(ctx, sorted, K, 1, sorted->nb[1], 0));              // [K, 1]
    ggml_tensor * s_of   = ggml_get_rows(ctx, ggml_reshape_3d(ctx, selection, 1, N, 1), chosen);          // [1, K, 1]
    ggml_tensor * order  = ggml_argsort(ctx, ggml_reshape_2d(ctx, s_of, K, 1), GGML_SORT_ORDER_DESC);     // [K, 1]
    ggml_tensor * out    = ggml_get_rows(ctx, ggml_reshape_3d(ctx, chosen, 1, K, 1), order);              // [1, K, 1]
    out = ggml_reshape_2d(ctx, out, K, 1);
    ggml_backend_dev_t dev = d.devs[g];
    for (ggml_tensor * t : { bias, ranked, sorted, chosen, s_of, order, out->src[0] }) {
        if (t->op != GGML_OP_NONE && t->op != GGML_OP_VIEW && t->op != GGML_OP_RESHAPE &&
            !ggml_backend_dev_supports_op(dev, t)) {
            return nullptr;
        }
    }
    if (J > 0 && !ggml_backend_dev_supports_op(dev, bias->src[2])) { // (the dup set_rows writes into)
        return nullptr;
    }
    ggml_format_name(out, "moecache_prior-%d", il);
    return out;
}

// t, one of the router's outputs, computed again from the logits by the same ops (llama.cpp's gating:
// softmax, sigmoid, softplus and sqrt, a bias added), `from` replaced by `to` on the way; nullptr where
// the chain is another. The counting reads these copies, so that llama.cpp's routing ops are used by
// nothing outside them and a device can fuse them into one kernel as it does without us (ggml-cuda's
// and ggml-vulkan's top-k MoE kernels take softmax -> argsort -> get_rows only where the softmax has
// no other use). The same op on the same input and device: the same values as the outputs it copies.
ggml_tensor * moecache_device_regate(ggml_context * ctx, ggml_tensor * t, ggml_tensor * logits, ggml_tensor * from,
                                   ggml_tensor * to, int depth) {
    if (t == logits) {
        return logits;
    }
    if (t == from) {
        return to;
    }
    const bool gating = t->op == GGML_OP_SOFT_MAX || t->op == GGML_OP_UNARY || t->op == GGML_OP_SQRT ||
                        t->op == GGML_OP_ADD;
    if (depth >= 4 || !gating || t->view_src || !ggml_is_contiguous(t) || !t->src[0]) {
        return nullptr;
    }
    for (int j = 1; j < GGML_MAX_SRC; j++) {
        if (t->src[j] && t->src[j]->op != GGML_OP_NONE) { // (a mask, sinks or a bias: weights only)
            return nullptr;
        }
    }
    ggml_tensor * src = moecache_device_regate(ctx, t->src[0], logits, from, to, depth + 1);
    if (!src || !ggml_are_same_shape(src, t->src[0])) {
        return nullptr;
    }
    ggml_tensor * c = ggml_dup_tensor(ctx, t);
    c->op = t->op;
    memcpy(c->op_params, t->op_params, sizeof(t->op_params));
    c->src[0] = src;
    for (int j = 1; j < GGML_MAX_SRC; j++) {
        c->src[j] = t->src[j];
    }
    return c;
}
