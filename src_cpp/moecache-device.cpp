// moecache-device.cpp - the device path where the cache only counts: every expert resident
// (residency NONE), the routing top-k or the prior.
//
// The routing op of moecache-graph.cpp is CPU code. Beside GPU layers it puts a CPU split in every
// MoE layer: the router's outputs come to the host, the scheduler waits for them, and the result
// goes back (two splits and a synchronization per layer). Here a decoded token's graph keeps the
// selection on the device: llama.cpp's own top-k, or the prior as ggml ops on the router's outputs
// (device_prior_select: the boosts of the cache and Delta before the token, uploaded once per token
// before it computes). Per MoE layer it copies what the counting reads into a ring of rows in one
// persistent buffer on that layer's device, one row per token (ggml_set_rows at the rows `pos` names;
// a decode step of several sequences under top-k: one row per sequence):
//
//     ring [MOECACHE_DEVICE_RING rows] of
//          [ per layer: stock ids K | ids run K (the prior's) | pad | z N | p N | s N (absent where s is p) ]
//
// After each graph the next step's row numbers are written to `pos` behind it (asynchronously, in the
// device's order); when the ring has no room for another step (the prior: after each token, whose counting its next boosts
// need), one read per device is queued behind the graph, and its tokens are counted when it has
// arrived (at the next ubatch). Before the cache is next looked at or changed (every API entry calls
// moecache_device_flush), and before a graph is built, the rows not yet read are read at once. So no
// wait is added to a decode, and under top-k a device is read once per MOECACHE_DEVICE_RING tokens
// instead of once per token (over RPC, a round trip each). Each layer of each token is counted by
// moecache_route_token, in token order, exactly as op_select counts it (same inputs, same code: the
// hits, misses, evictions, Delta and trace of the CPU op), and the prior's choice is checked against
// it. A graph with any other routing policy, reads ahead, router recording or a prompt of several
// tokens keeps the CPU op.

#include "moecache-impl.h"
#include "moecache-hook.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-context.h"
#include "llama-model.h"

#include <algorithm>
#include <cstring>

// a layer's block in elements (4 bytes each), padded so every block starts 64-byte aligned: the stock
// top-K ids, the ids that ran (the prior's; top-k: the same, not copied), z, p, s
static int64_t device_block(const moecache & mc, int64_t * z_off) {
    const int64_t k_pad = (2 * mc.n_expert_used + 15) / 16 * 16;
    *z_off = k_pad;
    return (k_pad + 3 * (int64_t) mc.n_expert + 15) / 16 * 16;
}

// the device a layer's router runs on: the one its router weight lives on
static ggml_backend_dev_t layer_device(const moecache & mc, int il) {
    ggml_backend_buffer_type_t buft = moecache_layer_buft(mc.model, il); // (moecache-vram.cpp)
    if (!buft) {
        return nullptr;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev && ggml_backend_buft_is_host(buft)) { // (ggml's CPU buffer types name no device)
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    return dev;
}

// the persistent buffers, one per device holding MoE layers; false when one cannot be had
static bool device_alloc(moecache & mc) {
    moecache_device & d = mc.dev;
    if (d.ready || d.failed) {
        return d.ready;
    }
    d.failed = true; // until it succeeds below
    int64_t z_off = 0;
    const int64_t block = device_block(mc, &z_off);
    d.layer_group.assign(mc.n_layer, -1);
    d.layer_slot.assign(mc.n_layer, -1);
    std::vector<int32_t> n_in;
    for (int il = 0; il < mc.n_layer; il++) {
        ggml_backend_dev_t dev = layer_device(mc, il);
        if (!dev) {
            continue;
        }
        int32_t g = (int32_t) (std::find(d.devs.begin(), d.devs.end(), dev) - d.devs.begin());
        if (g == (int32_t) d.devs.size()) {
            d.devs.push_back(dev);
            n_in.push_back(0);
        }
        d.layer_group[il] = g;
        d.layer_slot[il]  = n_in[g]++;
    }
    d.row_index.resize(MOECACHE_DEVICE_RING);
    for (int64_t r = 0; r < MOECACHE_DEVICE_RING; r++) {
        d.row_index[r] = r;
    }
    ggml_init_params ip = { ggml_tensor_overhead() * (3 * d.devs.size() + 1), nullptr, true };
    d.ctx = ggml_init(ip);
    if (!d.ctx) {
        return false;
    }
    for (size_t g = 0; g < d.devs.size(); g++) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(d.devs[g]);
        ggml_tensor * ring = ggml_new_tensor_2d(d.ctx, GGML_TYPE_F32, block * n_in[g], MOECACHE_DEVICE_RING);
        ggml_tensor * pos  = ggml_new_tensor_1d(d.ctx, GGML_TYPE_I64, MOECACHE_DEVICE_RING);
        ggml_tensor * bias = ggml_new_tensor_1d(d.ctx, GGML_TYPE_F32, ((int64_t) mc.n_expert + mc.n_expert_used) * n_in[g]);
        const size_t align = buft ? ggml_backend_buft_get_alignment(buft) : 64;
        const size_t ring_size = GGML_PAD(ggml_nbytes(ring), align);
        const size_t pos_size  = GGML_PAD(ggml_nbytes(pos), align);
        ggml_backend_buffer_t buf = buft ? ggml_backend_buft_alloc_buffer(buft, ring_size + pos_size + ggml_nbytes(bias))
                                         : nullptr;
        if (!buf) {
            return false;
        }
        d.bufs.push_back(buf);
        d.ring.push_back(ring);
        d.pos.push_back(pos);
        d.bias.push_back(bias);
        d.bias_host.emplace_back(ggml_nelements(bias), 0.0f);
        // pinned host memory where the device has it: a read into pageable memory would wait for the graph
        ggml_backend_buffer_type_t hbt = ggml_backend_dev_host_buffer_type(d.devs[g]);
        ggml_backend_buffer_t hbuf = hbt ? ggml_backend_buft_alloc_buffer(hbt, ggml_nbytes(ring)) : nullptr;
        d.host_bufs.push_back(hbuf);
        d.host_vec.emplace_back(hbuf ? 0 : ggml_nbytes(ring));
        d.host.push_back(hbuf ? (char *) ggml_backend_buffer_get_base(hbuf) : d.host_vec.back().data());
        char * base = (char *) ggml_backend_buffer_get_base(buf);
        if (ggml_backend_tensor_alloc(buf, ring, base) != GGML_STATUS_SUCCESS ||
            ggml_backend_tensor_alloc(buf, pos, base + ring_size) != GGML_STATUS_SUCCESS ||
            ggml_backend_tensor_alloc(buf, bias, base + ring_size + pos_size) != GGML_STATUS_SUCCESS) {
            return false;
        }
        ggml_backend_tensor_set(pos, d.row_index.data(), 0, ggml_nbytes(pos));
    }
    d.n_ring = 0;
    d.n_read = 0;
    d.ready  = true;
    d.failed = false;
    return true;
}

void moecache_device_free(moecache & mc) {
    moecache_device_flush(mc);
    moecache_device & d = mc.dev;
    for (ggml_backend_event_t e : d.events) {
        if (e) {
            ggml_backend_event_free(e);
        }
    }
    for (ggml_backend_buffer_t b : d.bufs) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_backend_buffer_t b : d.host_bufs) {
        if (b) {
            ggml_backend_buffer_free(b);
        }
    }
    d.host_bufs.clear();
    d.host_vec.clear();
    d.host.clear();
    if (d.ctx) {
        ggml_free(d.ctx);
    }
    d.events.clear();
    d.bufs.clear();
    d.ring.clear();
    d.pos.clear();
    d.bias.clear();
    d.bias_host.clear();
    d.ctx   = nullptr;
    d.ready = false;
}

void moecache_device_graph_begin(moecache & mc) {
    moecache_device_flush(mc); // (before a graph that may route another way)
    mc.dev.n_deferred = 0;
    mc.dev.n_prior    = 0;
    mc.dev.step_n     = 1;
    mc.dev.deferred.assign(mc.n_layer, 0);
    mc.dev.s_is_p.assign(mc.n_layer, 0);
    mc.dev.prior.assign(mc.n_layer, 0);
}

// the routing a decoded token's layer can take on its device: top-k (any device), or the prior on the
// logit scale (not on the CPU, whose op is as cheap and the reference itself), where nothing else
// changes the cache during the token (no reads ahead). Not prior-p: a boost of lambda on probabilities
// near 0 rounds many of them to the same value, and ggml's sort breaks such ties otherwise than r
// A decode step of several sequences (a batch, one token each) takes top-k only: the prior routes a
// step's tokens in order, each seeing the cache the ones before it left (and batch_share's two passes)
static bool device_routes(const moecache & mc, int64_t n_tokens, bool * prior) {
    const moecache_routing_params & rp = mc.rparams;
    *prior = rp.policy == MOECACHE_POLICY_PRIOR && rp.prior_lambda > 0.0f && !rp.prior_on_probs;
    return mc.cparams.residency == MOECACHE_RESIDENCY_NONE && (rp.policy == MOECACHE_POLICY_TOPK || *prior) &&
           mc.cparams.prefetch == MOECACHE_PREFETCH_OFF && mc.cparams.router_record == 0 && mc.model != nullptr &&
           n_tokens >= 1 && n_tokens <= MOECACHE_DEVICE_RING && mc.build_n_ubatch == n_tokens &&
           (n_tokens == 1 || (mc.build_decode && !*prior));
}

// layer il's boosts for its next token, into the host copy of its device's bias: b for each expert the
// prior's mask holds (moecache_route_preferred: cached), then K copies of b (the router's top J get it
// too, whatever the cache: Top-J); b as moecache_route_token computes it
static void device_prior_boosts(moecache & mc, int il) {
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
static void device_prior_upload(moecache & mc) {
    moecache_device & d = mc.dev;
    for (int il = 0; il < mc.n_layer; il++) {
        if (d.prior[il]) {
            device_prior_boosts(mc, il);
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
static ggml_tensor * device_prior_select(moecache & mc, ggml_context * ctx, int il, ggml_tensor * selected,
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

ggml_tensor * moecache_device_defer(moecache & mc, ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * selected,
                                    ggml_tensor * logits, ggml_tensor * probs, ggml_tensor * selection) {
    bool prior = false;
    if (!gf || !device_routes(mc, selected->ne[1], &prior) || !device_alloc(mc) || mc.dev.layer_group[il] < 0 ||
        !ggml_is_contiguous(logits) || !ggml_is_contiguous(probs) || !ggml_is_contiguous(selection) ||
        (prior && !ggml_is_contiguous(selected))) {
        return nullptr;
    }
    moecache_device & d = mc.dev;
    const int32_t g = d.layer_group[il];
    ggml_backend_dev_t dev = d.devs[g];
    if (prior && (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU ||
                  (mc.layers[il].graph.rank_on_logits && selection != probs))) {
        return nullptr; // (the CPU: its op; a softmax router whose s is not p: masked experts, which u does not show)
    }
    ggml_tensor * ran = prior ? device_prior_select(mc, ctx, il, selected, logits, selection) : selected;
    if (!ran) {
        return nullptr;
    }
    const int64_t N = mc.n_expert;
    const int64_t K = mc.n_expert_used;
    const int64_t T = selected->ne[1]; // tokens: 1, or one per sequence of a batch
    const bool s_is_p = selection == probs;
    int64_t z_off = 0;
    const size_t at = (size_t) d.layer_slot[il] * device_block(mc, &z_off) * sizeof(float);
    ggml_tensor * ring = d.ring[g];
    ggml_tensor * rows = ggml_view_1d(ctx, d.pos[g], T, 0);
    auto row_of = [&](ggml_tensor * src, int64_t n, int64_t off) { // src [n, T] into the step's rows of the ring
        ggml_tensor * dst = ggml_view_2d(ctx, ring, n, MOECACHE_DEVICE_RING, ring->nb[1], at + off * sizeof(float));
        return ggml_set_rows(ctx, dst, ggml_reshape_2d(ctx, src, n, T), rows);
    };
    ggml_tensor * ids = ggml_cast(ctx, selected, GGML_TYPE_F32); // [K, T] (expert ids are exact as floats)
    ggml_tensor * ids_ran = prior ? ggml_cast(ctx, ran, GGML_TYPE_F32) : nullptr;
    ggml_tensor * set[5] = {
        row_of(ids,    K, 0),
        prior ? row_of(ids_ran, K, K) : nullptr,
        row_of(logits, N, z_off),
        row_of(probs,  N, z_off + N),
        s_is_p ? nullptr : row_of(selection, N, z_off + 2 * N),
    };
    if (!ggml_backend_dev_supports_op(dev, ids)) {
        return nullptr; // (left out of the graph: the CPU op routes this layer)
    }
    for (ggml_tensor * c : set) {
        if (c && !ggml_backend_dev_supports_op(dev, c)) {
            return nullptr;
        }
    }
    for (ggml_tensor * c : set) {
        if (c) {
            ggml_format_name(c, "moecache_counted-%d", il);
            ggml_build_forward_expand(gf, c);
        }
    }
    d.deferred[il] = 1;
    d.s_is_p[il]   = s_is_p;
    d.prior[il]    = prior;
    d.n_deferred  += 1;
    d.n_prior     += prior;
    d.step_n       = (int32_t) T;
    if (prior) { // (this token's boosts: the cache is counted up to the token before, graph_begin flushed)
        std::lock_guard<std::mutex> lock(d.mutex);
        device_prior_boosts(mc, il);
        const size_t bytes = (size_t) (N + K) * sizeof(float);
        ggml_backend_tensor_set(d.bias[g], d.bias_host[g].data() + (size_t) d.layer_slot[il] * (N + K),
                                (size_t) d.layer_slot[il] * bytes, bytes);
    }
    return ran;
}

// the backend of the scheduler that runs `dev`
static ggml_backend_t sched_backend(ggml_backend_sched_t sched, ggml_backend_dev_t dev) {
    const int n = ggml_backend_sched_get_n_backends(sched);
    for (int i = 0; i < n; i++) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(b) == dev) {
            return b;
        }
    }
    return nullptr;
}

// Counts the first n tokens of the rings as read to the host, step by step in order (a step: step_n
// tokens, one per sequence), each deferred layer in layer order and within it the step's tokens in
// order, as the graph runs the CPU op, with the routing of the tokens (the graph's deferred layers are
// still theirs: moecache_device_graph_begin flushes before it changes them); the last step's hits and
// misses per row, as op_select keeps them
static void device_count(moecache & mc, int32_t n) {
    moecache_device & d = mc.dev;
    const bool    timeline = mc.timeline.on.load(std::memory_order_relaxed);
    const int64_t t0 = moecache_time_us();
    int64_t z_off = 0;
    const int64_t block = device_block(mc, &z_off);
    const int64_t N = mc.n_expert;
    const int64_t K = mc.n_expert_used;
    const int32_t T = std::max(1, d.step_n);
    int32_t ids[MOECACHE_MAX_USED];
    int32_t ran[MOECACHE_MAX_USED];
    int32_t sel[MOECACHE_MAX_USED];
    int8_t  hit[MOECACHE_MAX_USED];
    for (int32_t t0_step = 0; t0_step + T <= n; t0_step += T) {
        if ((int32_t) mc.step_hits.size() != T) {
            mc.step_hits.assign(T, 0);
            mc.step_misses.assign(T, 0);
        }
        for (int il = 0; il < mc.n_layer; il++) {
            if (!d.deferred[il]) {
                continue;
            }
            moecache_layer & L = mc.layers[il];
            const int32_t g = d.layer_group[il];
            const int64_t t1 = moecache_time_us();
            for (int32_t t = 0; t < T; t++) {
                const float * at = (const float *) (d.host[g] + (size_t) (t0_step + t) * d.ring[g]->nb[1]) +
                                   d.layer_slot[il] * block;
                for (int64_t k = 0; k < K; k++) {
                    ids[k] = (int32_t) at[k];
                    ran[k] = (int32_t) at[K + k];
                }
                const float * z = at + z_off;
                const float * p = z + N;
                const float * s = d.s_is_p[il] ? p : p + N;
                const int32_t n_sel = moecache_route_token(mc, L, d.read_rp, z, p, s, ids, true, true, sel, hit);
                if (d.prior[il]) {
                    mc.rst.device_routed += 1;
                    // a tie of boosted scores that ggml's sort broke otherwise (the cache follows the reference)
                    mc.rst.device_route_differs += n_sel != K || !std::equal(sel, sel + K, ran);
                }
                for (int32_t i = 0; i < n_sel; i++) {
                    mc.step_hits[t]   += hit[i] == 1 ? 1 : 0;
                    mc.step_misses[t] += hit[i] == 0 ? 1 : 0;
                }
            }
            L.decode_tokens += T;
            L.decode_steps  += 1;
            if (timeline) {
                moecache_graph_event(mc, MOECACHE_EVENT_ROUTE, L.il, -1, T, t1, t1, moecache_time_us());
            }
        }
    }
    mc.t_route_decode_us += moecache_time_us() - t0;
}

// the read queued when the rings were full, counted once it has arrived (waiting for it alone where the
// device has events); caller holds d.mutex
static void device_count_read(moecache & mc) {
    moecache_device & d = mc.dev;
    if (d.n_read == 0) {
        return;
    }
    for (size_t g = 0; g < d.devs.size(); g++) {
        if (d.events[g]) {
            ggml_backend_event_synchronize(d.events[g]);
        } else if (d.read_backends[g]) {
            ggml_backend_synchronize(d.read_backends[g]);
        }
    }
    const int32_t n = d.n_read;
    d.n_read = 0;
    device_count(mc, n);
}

void moecache_device_flush(moecache & mc) {
    moecache_device & d = mc.dev;
    std::lock_guard<std::mutex> lock(d.mutex);
    device_count_read(mc);
    if (d.n_ring == 0) {
        return;
    }
    // the rows not yet read: read now, once their graphs are done, and the ring starts again
    for (size_t g = 0; g < d.devs.size(); g++) {
        if (d.read_backends[g]) {
            ggml_backend_synchronize(d.read_backends[g]);
        }
        ggml_backend_tensor_get(d.ring[g], d.host[g], 0, (size_t) d.n_ring * d.ring[g]->nb[1]);
        ggml_backend_tensor_set(d.pos[g], d.row_index.data(), 0, ggml_nbytes(d.pos[g]));
        mc.rst.device_reads += 1;
    }
    const int32_t n = d.n_ring;
    d.n_ring = 0;
    device_count(mc, n);
}

void moecache_device_ubatch_begin(moecache & mc) {
    moecache_device & d = mc.dev;
    std::lock_guard<std::mutex> lock(d.mutex);
    device_count_read(mc); // (under the prior: the token before, whose graph is done when its logits were read)
    if (d.n_prior > 0 && d.n_ring == 0) {
        device_prior_upload(mc);
    }
}

void moecache_device_ubatch_computed(moecache & mc, ggml_backend_sched_t sched) {
    moecache_device & d = mc.dev;
    std::lock_guard<std::mutex> lock(d.mutex);
    device_count_read(mc); // the read before: it arrived while this token's graph was queued
    if (d.n_deferred == 0 || !sched) {
        return;
    }
    d.events.resize(d.devs.size(), nullptr);
    d.read_backends.assign(d.devs.size(), nullptr);
    d.read_rp = mc.rparams; // (the layers are the graph's: a graph is built only after a flush)
    const int32_t T = d.step_n;
    d.n_ring += T;
    // full: no room for the next step; the prior's next boosts need this token counted first: read at once
    const bool full = d.n_prior > 0 || d.n_ring + T > MOECACHE_DEVICE_RING;
    const int64_t * next = &d.row_index[full ? 0 : d.n_ring]; // (row_index outlives the copies)
    for (size_t g = 0; g < d.devs.size(); g++) {
        ggml_backend_t b = sched_backend(sched, d.devs[g]);
        d.read_backends[g] = b;
        if (!b) { // (no backend of the scheduler runs the device: the graph has run, read it plainly)
            if (full) {
                ggml_backend_tensor_get(d.ring[g], d.host[g], 0, (size_t) d.n_ring * d.ring[g]->nb[1]);
                mc.rst.device_reads += 1;
            }
            ggml_backend_tensor_set(d.pos[g], next, 0, (size_t) T * sizeof(int64_t));
            continue;
        }
        if (full) {
            // one read of the ring's rows, queued behind the graph; no wait here: its tokens are counted at the
            // next ubatch or when the cache is next looked at, by when the application's own wait for the
            // logits has brought it in. An event where the copy lands in the device's pinned memory, or where
            // the device has none (RPC: its client writes the answer in place); a device that copies into
            // pageable memory only when it synchronizes (Vulkan) is waited for whole. NULL where the device
            // has no events: the CPU
            if (!d.events[g] && (d.host_bufs[g] || !ggml_backend_dev_host_buffer_type(d.devs[g]))) {
                d.events[g] = ggml_backend_event_new(d.devs[g]);
            }
            ggml_backend_tensor_get_async(b, d.ring[g], d.host[g], 0, (size_t) d.n_ring * d.ring[g]->nb[1]);
            if (d.events[g]) {
                ggml_backend_event_record(d.events[g], b);
            }
            mc.rst.device_reads += 1;
        }
        // the next step's rows, written behind this graph in the device's order
        ggml_backend_tensor_set_async(b, d.pos[g], next, 0, (size_t) T * sizeof(int64_t));
    }
    if (full) {
        d.n_read = d.n_ring;
        d.n_ring = 0;
    }
}
