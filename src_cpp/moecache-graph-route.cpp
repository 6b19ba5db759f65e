// moecache-graph-route.cpp - the two ggml custom ops that route a MoE layer (the graph puts them in,
// moecache-graph.cpp): the selection of each token's experts through the routing policy
// (moecache-route.cpp), and the routing weights of what was selected.

#include "moecache-impl.h"

#include "ggml.h"
#include "llama-hparams.h" // llama_expert_gating_func_type

#include <algorithm>

#include <cmath>
#include <cstring>

// dst: I32 [K + 2, n_tokens], per token: the K selected experts, then how many of them run
// (n_active) and SWAP_RANK's replaced expert whose weight the last slot takes (or -1); the
// graph hands the first K rows to llama.cpp and the whole tensor to op_weights.
// src: stock top-K, logits, probs, selection score
void moecache_op_select(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    moecache_layer & L  = *(moecache_layer *) userdata;
    moecache       & mc = *L.mc;
    const ggml_tensor * stock = dst->src[0];
    const ggml_tensor * z     = dst->src[1];
    const ggml_tensor * p     = dst->src[2];
    const ggml_tensor * s     = dst->src[3];
    const int64_t K        = dst->ne[0] - 2;
    const int64_t n_tokens = dst->ne[1];

    const moecache_routing_params rp = mc.rparams; // one consistent set for the whole ubatch
    const bool decode = L.graph.decode;            // (a prompt's last layer routes one token too: its output row)
    const bool single = decode && n_tokens == 1;   // (a batch of sequences reads nothing ahead)
    const bool apply  = rp.scope == MOECACHE_SCOPE_ALL || decode;
    const bool update = decode || mc.cparams.update_on_prompt;
    if (!single && moecache_counts_ahead(mc)) { // (a prediction is for the next decoded token, not a prompt)
        std::fill(L.pf.ahead.begin(), L.pf.ahead.end(), 0);
    }

    const bool    timeline = mc.timeline.on.load(std::memory_order_relaxed);
    const int64_t t0 = decode || timeline ? moecache_time_us() : 0;
    int8_t hit[MOECACHE_MAX_USED];
    // batch_share: a first pass learns what each token of the step selects, the second routes each token
    // with the others' selections preferred as if cached (moecache-route.cpp)
    const bool share = decode && apply && update && moecache_route_shares(rp, n_tokens);
    const moecache_routing_params rs = share ? moecache_route_share_params(rp) : rp; // (batch_prior)
    if (share) {
        std::vector<const float *>   zr(n_tokens), pr(n_tokens), sr(n_tokens);
        std::vector<const int32_t *> str(n_tokens);
        for (int64_t t = 0; t < n_tokens; t++) {
            zr[t]  = moecache_row_f32(z, t);
            pr[t]  = moecache_row_f32(p, t);
            sr[t]  = moecache_row_f32(s, t);
            str[t] = (const int32_t *) ((const char *) stock->data + t * stock->nb[1]);
        }
        moecache_route_share_first(mc, L, rs, n_tokens, zr.data(), pr.data(), sr.data(), str.data());
    }
    if (decode && L.il == mc.first_routed && (int64_t) mc.step_hits.size() != n_tokens) { // (a step's first layer)
        mc.step_hits.assign(n_tokens, 0);
        mc.step_misses.assign(n_tokens, 0);
    }
    const bool rows = decode && update && (int64_t) mc.step_hits.size() == n_tokens;
    std::vector<uint8_t> seen; // [n_expert] the step's union so far (decoded tokens)
    for (int64_t t = 0; t < n_tokens; t++) {
        int32_t * out = (int32_t *) ((char *) dst->data + t * dst->nb[1]);
        const int32_t * st = (const int32_t *) ((const char *) stock->data + t * stock->nb[1]);
        if (share) {
            moecache_route_share_token(mc, L, t);
        }
        if (L.n_rec < mc.cparams.router_record) { // the router's outputs, for offline replay (pymoecache.simulate)
            for (const ggml_tensor * x : { z, p, s }) {
                L.router_rec.insert(L.router_rec.end(), moecache_row_f32(x, t), moecache_row_f32(x, t) + mc.n_expert);
            }
            if (L.graph.src_input >= 0 && (L.n_rec == 0 || L.n_embd_in > 0)) { // (and its input, for fitting predictors)
                const ggml_tensor * x = dst->src[L.graph.src_input];
                L.n_embd_in = (int32_t) x->ne[0];
                L.router_in.insert(L.router_in.end(), moecache_row_f32(x, t), moecache_row_f32(x, t) + x->ne[0]);
            } else {
                L.n_embd_in = 0; // (rows without an input: none is kept)
                L.router_in.clear();
            }
            L.n_rec += 1;
        }
        const int32_t n = moecache_route_token(mc, L, rs, moecache_row_f32(z, t), moecache_row_f32(p, t), moecache_row_f32(s, t), st,
                                               apply, update, out, hit);
        // dropped slots run an expert that runs anyway, with weight 0 (moecache_hook_weights)
        for (int64_t i = n; i < K; i++) {
            out[i] = out[0];
        }
        for (int32_t i = 0; i < n && rows; i++) {
            mc.step_hits[t]   += hit[i] == 1 ? 1 : 0;
            mc.step_misses[t] += hit[i] == 0 ? 1 : 0;
        }
        if (decode && update) {
            moecache_route_count_union(mc, seen, out, n, n_tokens);
        }
        if (single && L.low.n > 0) { // the selections' router probabilities, for lowbit_max_p
            const float * pr = moecache_row_f32(p, t);
            for (int64_t i = 0; i < K && i < MOECACHE_MAX_USED; i++) {
                L.low.tok_p[i] = i < n ? pr[out[i]] : 0.0f;
            }
        }
        out[K]     = n;
        out[K + 1] = L.scratch.swapped_from; // the replacement is the last slot: it is outside r[0:K]
    }
    moecache_route_share_end(L);
    if (decode) {
        L.decode_tokens      += n_tokens;
        L.decode_steps       += 1;
        mc.t_route_decode_us += moecache_time_us() - t0;
    }
    if (single) {
        if (L.il == mc.first_routed && mc.cparams.prefetch_spare > 0 && mc.cparams.prefetch != MOECACHE_PREFETCH_OFF) {
            mc.ahead.pending.target = -1; // (a token's first layer: nothing left from an interrupted one)
            if (mc.cparams.prefetch_adaptive) {
                moecache_ahead_trial_token(mc, t0);
            }
            mc.rst.prefetch_tokens_on += mc.ahead.trial.on;
        }
        if (update && mc.cparams.prefetch != MOECACHE_PREFETCH_OFF) {
            const int32_t * out = (const int32_t *) dst->data;
            moecache_layer_prefetch_outcome(L, out, out[K]);
            const int64_t t1 = moecache_time_us();
            moecache_ahead_prefetch(mc, L, dst->src[4]);
            if (mc.cparams.residency == MOECACHE_RESIDENCY_STREAM) {
                mc.t_io_decode_us += moecache_time_us() - t1; // (a slot taken back waits for its stale read)
            }
        }
    } else if (decode && update && L.graph.predicts) { // a step of several sequences (moecache_ahead_predict_router)
        if (L.il == mc.first_routed) {
            mc.ahead.pending.target = -1;
        }
        std::vector<int32_t> & sel = L.scratch.step_sel; // every row's selections, for the prediction's outcome
        sel.clear();
        for (int64_t t = 0; t < n_tokens; t++) {
            const int32_t * out = (const int32_t *) ((const char *) dst->data + t * dst->nb[1]);
            sel.insert(sel.end(), out, out + out[K]);
        }
        moecache_layer_prefetch_outcome(L, sel.data(), (int32_t) sel.size());
        moecache_ahead_prefetch_step(mc, L, dst->src[4], n_tokens);
    }
    if (timeline) {
        moecache_graph_event(mc, MOECACHE_EVENT_ROUTE, L.il, -1, (int32_t) n_tokens, t0, t0, moecache_time_us());
    }
}

// dst: F32 [1, K, n_tokens] = weights, with the slots a policy dropped set to 0
// (-inf for SOFTMAX_WEIGHT gating, whose weights are softmaxed afterwards), and SWAP_RANK's
// replacement given the weight of the expert it replaced. src[1]: op_select's [K + 2, n_tokens],
// src[2]: probs [1, n_expert, n_tokens]
void moecache_op_weights(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const moecache_layer & L = *(const moecache_layer *) userdata;
    const ggml_tensor * w     = dst->src[0];
    const ggml_tensor * route = dst->src[1];
    const ggml_tensor * p     = dst->src[2];
    const int64_t K        = dst->ne[1];
    const int64_t n_tokens = dst->ne[2];
    const float dropped = L.graph.dropped_weight;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int32_t * r = (const int32_t *) ((const char *) route->data + t * route->nb[1]);
        const int32_t n_active = r[K], weight_from = r[K + 1];
        for (int64_t i = 0; i < K; i++) {
            const float v = *(const float *) ((const char *) w->data + i * w->nb[1] + t * w->nb[2]);
            float * o = (float *) ((char *) dst->data + i * dst->nb[1] + t * dst->nb[2]);
            *o = i < n_active ? v : dropped;
        }
        if (weight_from >= 0) {
            *(float *) ((char *) dst->data + (K - 1) * dst->nb[1] + t * dst->nb[2]) =
                *(const float *) ((const char *) p->data + weight_from * p->nb[1] + t * p->nb[2]);
        }
    }
}
