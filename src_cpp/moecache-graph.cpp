// moecache-graph.cpp - what patched llama.cpp calls (moecache-hook.h): which moecache belongs
// to which llama_context, the two ggml custom ops that route a MoE layer, and the op in front of
// a layer's expert matmuls that makes the residency follow the cache.
//
// Graph reuse: llama.cpp reuses a built graph for later ubatches of the same shape. The ops
// keep only a pointer to their moecache_layer and read the routing parameters when they run,
// so a reused graph follows moecache_set_routing at once. Attaching or detaching marks the
// context dirty, and the next ubatch builds a fresh graph with (or without) the ops.

#include "moecache-impl.h"
#include "moecache-hook.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "llama.h"
#include "llama-context.h" // llama_context::get_sched: our ops stay on the CPU beside GPU layers
#include "llama-hparams.h" // llama_expert_gating_func_type
#include "llama-impl.h"    // LLAMA_LOG_WARN: llama.cpp's logger, which the application controls
#include "llama-model.h"   // llama_layer: the router of layer il + d (prefetch)

#include <algorithm>

#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

struct ctx_entry {
    moecache * mc    = nullptr; // attached moecache, or nullptr after detach
    bool       dirty = true;    // the current graph does not match `mc`: rebuild
};

std::mutex                                               g_mutex;
std::unordered_map<const llama_context *, ctx_entry>     g_ctx;
thread_local moecache *                                  g_building = nullptr; // set between graph_begin/end
// the graph's scheduler and its CPU backend while a graph with another backend beside the CPU
// (GPU layers, n_gpu_layers > 0) is built; nullptr otherwise
thread_local ggml_backend_sched_t                        g_sched    = nullptr;
thread_local ggml_backend_t                              g_cpu      = nullptr;

const float * row_f32(const ggml_tensor * t, int64_t i1) {
    return (const float *) ((const char *) t->data + i1 * t->nb[1]);
}

// How many experts to predict: the stock router runs its top K; a cache-aware policy keeps the
// cached experts it can and must run only its top J (Top-J) whatever the cache holds: those are
// the reads to start early
int32_t prefetch_width(const moecache & mc) {
    const moecache_routing_params & rp = mc.rparams;
    const int32_t K = mc.n_expert_used;
    return rp.policy == MOECACHE_POLICY_TOPK || rp.top_j == 0 ? K : std::min(rp.top_j, K);
}

// ids/score = the n largest of v[0:N] (NaN last, ties by the lower id) whose predicted probability
// is at least min_p, score = that probability: from logits, their softmax over all N; otherwise
// their share of the sum of the positive values, zeros left out. (A distribution that cannot be
// normalised, e.g. all NaN, gives score 1 and no threshold.) order: [N] scratch. Returns how many.
int32_t top_predicted(const float * v, int32_t N, int32_t n, bool logits, float min_p, std::vector<int32_t> & order,
                      int32_t * ids, float * score) {
    for (int32_t e = 0; e < N; e++) {
        order[e] = e;
    }
    std::partial_sort(order.begin(), order.begin() + n, order.begin() + N, [v](int32_t a, int32_t b) {
        return v[a] > v[b] || (v[a] == v[b] && a < b) || (std::isnan(v[b]) && !std::isnan(v[a]));
    });
    const double top = (double) v[order[0]];
    auto weight = [&](int32_t e) -> double {
        const double x = logits ? std::exp((double) v[e] - top) : (double) v[e];
        return x > 0.0 && std::isfinite(x) ? x : 0.0;
    };
    double sum = 0.0;
    for (int32_t e = 0; e < N; e++) {
        sum += weight(e);
    }
    const bool normal = std::isfinite(sum) && sum > 0.0;
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        const double x = weight(order[i]);
        if (!logits && !(x > 0.0)) {
            break;
        }
        const float p = normal ? (float) (x / sum) : 1.0f;
        if (p < min_p) {
            break; // (sorted: the rest are less likely still)
        }
        ids[m]     = order[i];
        score[m++] = p;
    }
    return m;
}

// GATE under PRIOR: what T's policy will select given T's cache as it is now (T routes this token
// next, and only T's own routing changes its cache): the top J of the predicted logits z [N], then
// the best K - J others after the prior's boost of T's cached experts, as moecache_route_token ranks
// them. The reads worth starting are the predicted misses; the stock top K would name experts the
// prior then swaps for cached ones. ids/score as top_predicted (score: softmax of z); order,
// boosted: [N] scratch. Returns how many (K, fewer with min_p).
int32_t prior_predicted(const moecache & mc, const moecache_layer & T, const float * z, float min_p,
                        std::vector<int32_t> & order, std::vector<float> & boosted, int32_t * ids, float * score) {
    const int32_t N = mc.n_expert;
    const int32_t K = mc.n_expert_used;
    const int32_t J = std::min(mc.rparams.top_j, K);
    const float boost = moecache_layer_boost(T, mc.rparams.prior_lambda);
    int32_t top[MOECACHE_MAX_USED];
    float   p_top[MOECACHE_MAX_USED];
    const int32_t n_top = top_predicted(z, N, K, true, 0.0f, order, top, p_top); // (fills order with r)
    for (int32_t e = 0; e < N; e++) {
        boosted[e] = std::isnan(z[e]) ? -INFINITY : (T.last_use[e] >= 0 ? z[e] + boost : z[e]);
    }
    for (int32_t i = 0; i < J && i < n_top; i++) {
        boosted[top[i]] = INFINITY; // Top-J: selected whatever the cache holds
    }
    std::partial_sort(order.begin(), order.begin() + K, order.begin() + N, [&boosted](int32_t a, int32_t b) {
        return boosted[a] > boosted[b] || (boosted[a] == boosted[b] && a < b);
    });
    double zmax = -INFINITY;
    for (int32_t e = 0; e < N; e++) {
        zmax = std::isfinite(z[e]) ? std::max(zmax, (double) z[e]) : zmax;
    }
    double sum = 0.0;
    for (int32_t e = 0; e < N; e++) {
        sum += std::isfinite(z[e]) ? std::exp((double) z[e] - zmax) : 0.0;
    }
    int32_t m = 0;
    for (int32_t i = 0; i < K; i++) {
        const int32_t e = order[i];
        const float p = sum > 0.0 && std::isfinite(z[e]) ? (float) (std::exp((double) z[e] - zmax) / sum) : 0.0f;
        if (p < min_p && boosted[e] != INFINITY) {
            continue;
        }
        ids[m]     = e;
        score[m++] = p;
    }
    return m;
}

#define MOECACHE_SPEC_WINDOW 16   // decoded tokens of the trial on each side: with the reads ahead, and without
#define MOECACHE_SPEC_RUN    96   // decoded tokens the winner then runs for
#define MOECACHE_SPEC_MARGIN 0.02 // the reads ahead win only if their median token is this much faster

static int64_t median_of(std::vector<int64_t> & v) {
    if (v.empty()) {
        return 0;
    }
    std::nth_element(v.begin(), v.begin() + (std::ptrdiff_t) (v.size() / 2), v.end());
    return v[v.size() / 2];
}

// prefetch_spare with prefetch_adaptive, at the start of each decoded token: the time of the
// token before goes to the side of the trial it ran on. A trial is 2 x MOECACHE_SPEC_WINDOW
// tokens with the reads ahead on and off in turn, so both sides see the same disk and machine
// (on a shared host either drifts by more than the difference being measured within a few
// tokens); then the winner runs MOECACHE_SPEC_RUN tokens, and a new trial starts. The reads
// ahead must win by MOECACHE_SPEC_MARGIN of the median token: without them a token reads fewer
// bytes and spends less CPU on reading, so a tie goes to off.
void spec_ctl_token(moecache & mc, int64_t now) {
    auto & c = mc.spec_ctl;
    if (c.t_last > 0 && c.phase == 0 && c.left > 0) { // (c.on and c.phase are still the previous token's)
        (c.on ? c.dt_on : c.dt_off).push_back(now - c.t_last);
    }
    c.t_last = now;
    if (c.left > 0) {
        c.left -= 1;
    }
    if (c.left > 0) {
        if (c.phase == 0) {
            c.on = !c.on; // the trial alternates
        }
        return;
    }
    if (c.phase == 0 && !c.dt_on.empty() && !c.dt_off.empty()) {
        c.on    = (double) median_of(c.dt_on) < (1.0 - MOECACHE_SPEC_MARGIN) * (double) median_of(c.dt_off);
        c.phase = 1;
        c.left  = MOECACHE_SPEC_RUN;
    } else {
        c.phase = 0;
        c.left  = 2 * MOECACHE_SPEC_WINDOW;
        c.on    = true;
        c.dt_on.clear();
        c.dt_off.clear();
    }
}

// During layer L's decode: predict what layer L + d will select and prefetch it (GATE: from pred,
// that layer's router logits for this layer's FFN input, [n_expert, 1]; TRACE: from the request's
// expert counts against past requests; PREVIOUS: what it selected for the previous token)
void prefetch_ahead(moecache & mc, moecache_layer & L, const ggml_tensor * pred) {
    const int32_t target = L.il + mc.cparams.prefetch_distance;
    if (target >= mc.n_layer) {
        return;
    }
    moecache_layer & T = mc.layers[target];
    int32_t ids[MOECACHE_MAX_USED] = {}; // (zeroed: gcc cannot see that n <= K <= MOECACHE_MAX_USED)
    float   score[MOECACHE_MAX_USED];
    int32_t n = 0;
    // (the scratch of layer L is free once L has routed its token)
    if (mc.cparams.prefetch == MOECACHE_PREFETCH_GATE) {
        if (!pred || !L.graph.predicts) {
            return;
        }
        if (mc.rparams.policy == MOECACHE_POLICY_PRIOR && mc.rparams.prior_lambda > 0.0f && T.graph.rank_on_logits &&
            !mc.rparams.prior_on_probs) {
            n = prior_predicted(mc, T, row_f32(pred, 0), mc.cparams.prefetch_min_p, L.scratch.order,
                                L.scratch.boosted, ids, score);
        } else {
            n = top_predicted(row_f32(pred, 0), mc.n_expert, prefetch_width(mc), true, mc.cparams.prefetch_min_p,
                              L.scratch.order, ids, score);
        }
    } else if (mc.cparams.prefetch == MOECACHE_PREFETCH_TRACE) {
        float * sc = L.scratch.boosted.data();
        if (!moecache_trace_predict(mc, L.il, target, sc)) {
            return;
        }
        n = top_predicted(sc, mc.n_expert, prefetch_width(mc), false, mc.cparams.prefetch_min_p, L.scratch.order, ids,
                          score);
    } else {
        n = T.pf.n_last_sel;
        for (int32_t i = 0; i < n; i++) {
            ids[i]   = T.pf.last_sel[i];
            score[i] = 1.0f;
        }
    }
    if (n == 0) {
        return;
    }
    // spare slots: T's cache is left as it is, the predicted experts it does not cache are read;
    // otherwise they are inserted into it (evicting by its policy) and read
    const bool spare = mc.cparams.prefetch_spare > 0;
    if (spare && !mc.spec_ctl.on) {
        return; // (prefetch_adaptive: off while it loses, or during its trial without)
    }
    int32_t read[MOECACHE_MAX_USED];
    float   read_score[MOECACHE_MAX_USED];
    const int32_t m = spare ? moecache_layer_speculate(T, ids, n, read) : moecache_layer_prefetch(T, ids, n, read);
    for (int32_t i = 0, j = 0; i < n && j < m; i++) { // (read[] keeps the order of ids[])
        if (ids[i] == read[j]) {
            read_score[j++] = score[i] / (float) mc.cparams.prefetch_distance;
        }
    }
    if (m > 0 && mc.cparams.residency == MOECACHE_RESIDENCY_STREAM && mc.io) {
        if (spare) { // queued by this layer's residency op once its own reads are (they must not wait behind these)
            mc.spec_pending.target = T.il;
            mc.spec_pending.n      = m;
            std::copy(read, read + m, mc.spec_pending.ids);
            std::copy(read_score, read_score + m, mc.spec_pending.score);
        } else {
            moecache_slots_prefetch(mc, T, read, read_score, m, false);
        }
    }
    moecache_vram_ahead(mc, T, ids, n); // (the VRAM tier: those its host cache holds, copied up ahead)
}

// dst: I32 [K + 2, n_tokens], per token: the K selected experts, then how many of them run
// (n_active) and SWAP_RANK's replaced expert whose weight the last slot takes (or -1); the
// graph hands the first K rows to llama.cpp and the whole tensor to op_weights.
// src: stock top-K, logits, probs, selection score
void op_select(ggml_tensor * dst, int ith, int nth, void * userdata) {
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
    const bool decode = L.graph.n_ubatch == 1;     // (a prompt's last layer routes one token too: its output row)
    const bool apply  = rp.scope == MOECACHE_SCOPE_ALL || decode;
    const bool update = decode || mc.cparams.update_on_prompt;

    const bool    timeline = mc.timeline.on.load(std::memory_order_relaxed);
    const int64_t t0 = decode || timeline ? moecache_time_us() : 0;
    int8_t hit[MOECACHE_MAX_USED];
    for (int64_t t = 0; t < n_tokens; t++) {
        int32_t * out = (int32_t *) ((char *) dst->data + t * dst->nb[1]);
        const int32_t * st = (const int32_t *) ((const char *) stock->data + t * stock->nb[1]);
        if (L.n_rec < mc.cparams.router_record) { // the router's outputs, for offline replay (pymoecache.simulate)
            for (const ggml_tensor * x : { z, p, s }) {
                L.router_rec.insert(L.router_rec.end(), row_f32(x, t), row_f32(x, t) + mc.n_expert);
            }
            if (L.graph.src_input >= 0 && (L.n_rec == 0 || L.n_embd_in > 0)) { // (and its input, for fitting predictors)
                const ggml_tensor * x = dst->src[L.graph.src_input];
                L.n_embd_in = (int32_t) x->ne[0];
                L.router_in.insert(L.router_in.end(), row_f32(x, t), row_f32(x, t) + x->ne[0]);
            } else {
                L.n_embd_in = 0; // (rows without an input: none is kept)
                L.router_in.clear();
            }
            L.n_rec += 1;
        }
        const int32_t n = moecache_route_token(mc, L, rp, row_f32(z, t), row_f32(p, t), row_f32(s, t), st,
                                               apply, update, out, hit);
        // dropped slots run an expert that runs anyway, with weight 0 (moecache_hook_weights)
        for (int64_t i = n; i < K; i++) {
            out[i] = out[0];
        }
        out[K]     = n;
        out[K + 1] = L.scratch.swapped_from; // the replacement is the last slot: it is outside r[0:K]
    }
    if (decode) {
        L.decode_tokens      += 1;
        mc.t_route_decode_us += moecache_time_us() - t0;
        if (L.il == mc.first_routed && mc.cparams.prefetch_spare > 0 && mc.cparams.prefetch != MOECACHE_PREFETCH_OFF) {
            mc.spec_pending.target = -1; // (a token's first layer: nothing left from an interrupted one)
            if (mc.cparams.prefetch_adaptive) {
                spec_ctl_token(mc, t0);
            }
            mc.rst.prefetch_tokens_on += mc.spec_ctl.on;
        }
        if (update && mc.cparams.prefetch != MOECACHE_PREFETCH_OFF) {
            const int32_t * out = (const int32_t *) dst->data;
            moecache_layer_prefetch_outcome(L, out, out[K]);
            const int64_t t1 = moecache_time_us();
            prefetch_ahead(mc, L, dst->src[4]);
            if (mc.cparams.residency == MOECACHE_RESIDENCY_STREAM) {
                mc.t_io_decode_us += moecache_time_us() - t1; // (a slot taken back waits for its stale read)
            }
        }
    }
    if (timeline) {
        moecache_graph_event(mc, MOECACHE_EVENT_ROUTE, L.il, -1, (int32_t) n_tokens, t0, t0, moecache_time_us());
    }
}

// dst: F32 [1, K, n_tokens] = weights, with the slots a policy dropped set to 0
// (-inf for SOFTMAX_WEIGHT gating, whose weights are softmaxed afterwards), and SWAP_RANK's
// replacement given the weight of the expert it replaced. src[1]: op_select's [K + 2, n_tokens],
// src[2]: probs [1, n_expert, n_tokens]
void op_weights(ggml_tensor * dst, int ith, int nth, void * userdata) {
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

} // namespace

// GATE prefetch, decode graphs: layer il + d's router applied to layer il's FFN input (the input
// of this layer's router matmul), [n_expert, 1]; nullptr when there is nothing to predict
static ggml_tensor * predict_router(moecache & mc, ggml_context * ctx, ggml_tensor * logits, int il, int64_t n_tokens) {
    if (mc.cparams.prefetch != MOECACHE_PREFETCH_GATE || !mc.model || n_tokens != 1) {
        return nullptr;
    }
    const int target = il + mc.cparams.prefetch_distance;
    if (target >= mc.n_layer || target >= (int) mc.model->layers.size()) {
        return nullptr;
    }
    const llama_layer & here = mc.model->layers[il];
    const llama_layer & next = mc.model->layers[target];
    ggml_tensor * mm = logits->op == GGML_OP_ADD ? logits->src[0] : logits;
    if (mm->op != GGML_OP_MUL_MAT || mm->src[0] != here.ffn_gate_inp || !next.ffn_gate_inp ||
        next.ffn_gate_inp->ne[0] != mm->src[1]->ne[0] || next.ffn_gate_inp->ne[1] != mc.n_expert) {
        return nullptr; // a router of another shape (or none: a dense layer), or an input we do not recognize
    }
    const bool fitted = (size_t) target < mc.pred_on.size() && mc.pred_on[target];
    ggml_tensor * pred = ggml_mul_mat(ctx, fitted ? mc.pred_w[target] : next.ffn_gate_inp, mm->src[1]);
    if (next.ffn_gate_inp_b) {
        pred = ggml_add(ctx, pred, next.ffn_gate_inp_b);
    }
    ggml_format_name(pred, "moecache_predict-%d", target);
    return pred;
}

bool moecache_hook_graph_reusable(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_ctx.find(lctx);
    return it == g_ctx.end() || !it->second.dirty;
}

void moecache_hook_graph_begin(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_ctx.find(lctx);
    g_building = nullptr;
    if (it != g_ctx.end()) {
        g_building       = it->second.mc;
        it->second.dirty = false;
        if (g_building) {
            moecache_residency_graph_begin(*g_building);
        }
    }
    g_sched = nullptr;
    g_cpu   = nullptr;
    if (g_building) {
        ggml_backend_sched_t sched = lctx->get_sched();
        const int n = sched ? ggml_backend_sched_get_n_backends(sched) : 0;
        for (int i = 0; i < n && n > 1; i++) {
            ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
            ggml_backend_dev_t dev = ggml_backend_get_device(b);
            if (dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
                g_sched = sched;
                g_cpu   = b;
            }
        }
    }
}

void moecache_hook_graph_end(const llama_context * lctx) {
    (void) lctx;
    g_building = nullptr;
    g_sched    = nullptr;
    g_cpu      = nullptr;
}

// Our ops are CPU code: they read and write their tensors' data in host memory. Beside GPU
// layers the scheduler would run an op on the backend of its inputs when that backend claims it
// (RPC claims every op), so each of ours is placed on the CPU backend; the scheduler copies the
// router's outputs over and the results back.
ggml_tensor * moecache_graph_on_cpu(ggml_tensor * t) {
    if (g_sched && g_cpu) {
        ggml_backend_sched_set_tensor_backend(g_sched, t, g_cpu);
    }
    return t;
}

void moecache_hook_context_free(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_ctx.find(lctx);
    if (it != g_ctx.end()) {
        if (it->second.mc) {
            it->second.mc->ctx = nullptr;
        }
        g_ctx.erase(it);
    }
}

ggml_tensor * moecache_hook_select(ggml_context * ctx, ggml_tensor * selected, ggml_tensor * logits,
                                   ggml_tensor * probs, ggml_tensor * selection, int il, int gating_op,
                                   bool has_bias, bool warmup) {
    moecache * mc = g_building;
    if (!mc || warmup || il < 0 || il >= mc->n_layer) {
        return selected;
    }
    const int64_t N = logits->ne[0];
    const int64_t K = selected->ne[0];
    if (N != mc->n_expert || K != mc->n_expert_used || K > MOECACHE_MAX_USED ||
        logits->type != GGML_TYPE_F32 || probs->type != GGML_TYPE_F32 || selection->type != GGML_TYPE_F32 ||
        probs->ne[0] != N || selection->ne[0] != N) {
        LLAMA_LOG_WARN("moecache: warning: layer %d (N = %lld, K = %lld) does not match the model's N = %d, K = %d; "
                        "routed without the cache\n", il, (long long) N, (long long) K, mc->n_expert, mc->n_expert_used);
        return selected;
    }
    moecache_layer & L = mc->layers[il];
    if (mc->build_n_ubatch == 0) {
        mc->build_n_ubatch = selected->ne[1];
        mc->first_routed   = il;
    }
    L.graph.n_ubatch = mc->build_n_ubatch;
    L.graph.rank_on_logits = gating_op == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX && !has_bias; // softmax keeps the logits' order

    ggml_tensor * pred = predict_router(*mc, ctx, logits, il, selected->ne[1]);
    L.graph.predicts = pred != nullptr;
    ggml_tensor * args[6] = { selected, logits, probs, selection, pred, nullptr };
    int32_t n_args = pred ? 5 : 4;
    L.graph.src_input = -1;
    ggml_tensor * mm = logits->op == GGML_OP_ADD ? logits->src[0] : logits;
    if (mc->cparams.router_record > 0 && mc->cparams.router_record_input && mm->op == GGML_OP_MUL_MAT && mc->model &&
        mm->src[0] == mc->model->layers[il].ffn_gate_inp && mm->src[1]->type == GGML_TYPE_F32 &&
        mm->src[1]->ne[1] == selected->ne[1]) {
        L.graph.src_input = n_args; // the router's input rows, recorded with its outputs
        args[n_args++]    = mm->src[1];
    }
    L.graph.route_out = ggml_custom_4d(ctx, GGML_TYPE_I32, K + 2, selected->ne[1], 1, 1, args, n_args,
                                       op_select, 1, &L);
    ggml_format_name(moecache_graph_on_cpu(L.graph.route_out), "moecache_select-%d", il);
    // llama.cpp gets the K selected experts per token, contiguous as its own top-K
    L.graph.select_out = ggml_cont(ctx, ggml_view_2d(ctx, L.graph.route_out, K, selected->ne[1], L.graph.route_out->nb[1], 0));
    ggml_format_name(L.graph.select_out, "moecache_selected-%d", il);
    return L.graph.select_out;
}

ggml_tensor * moecache_hook_weights(ggml_context * ctx, ggml_tensor * weights, ggml_tensor * selected,
                                    int il, int gating_op) {
    moecache * mc = g_building;
    if (!mc || il < 0 || il >= mc->n_layer || mc->layers[il].graph.select_out != selected) {
        return weights;
    }
    moecache_layer & L = mc->layers[il];
    L.graph.dropped_weight = gating_op == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT ? -INFINITY : 0.0f;
    // weights = get_rows(probs, selected): its src[0] is probs
    ggml_tensor * args[3] = { weights, L.graph.route_out, weights->src[0] };
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, weights->ne[0], weights->ne[1], weights->ne[2], 1,
                                       args, 3, op_weights, 1, &L);
    ggml_format_name(moecache_graph_on_cpu(out), "moecache_weights-%d", il);
    L.graph.select_out = nullptr;
    L.graph.route_out  = nullptr;
    return out;
}

ggml_tensor * moecache_hook_mul_mat_id(ggml_context * ctx, ggml_tensor * as, ggml_tensor * b, ggml_tensor * ids) {
    moecache * mc = g_building;
    ggml_tensor * res = mc ? moecache_residency_mul_mat_id(*mc, ctx, as, b, ids) : nullptr;
    return res ? res : ggml_mul_mat_id(ctx, as, b, ids);
}

// the layer runs a decode: a ubatch of one token (not the output row of a prompt's last layer);
// n_tokens: what the layer sees, for a layer the routing hook did not see (n_ubatch 0)
static bool moecache_layer_decodes(const moecache_layer & L, int64_t n_tokens) {
    return (L.graph.n_ubatch > 0 ? L.graph.n_ubatch : n_tokens) == 1;
}

// dst: I32 [K, n_tokens] = slot ids (STREAM decode) or the expert ids; src[0]: the expert ids.
// Reads or locks what the layer's experts need first (moecache-residency.cpp).
static void op_experts(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    moecache_layer & L = *(moecache_layer *) userdata;
    moecache_residency_sync(L, (const int32_t *) dst->src[0]->data, (int32_t *) dst->data, ggml_nelements(dst),
                            moecache_layer_decodes(L, dst->ne[1]));
}

// --- residency: the op in front of a layer's expert matmuls ---------------------------------

void moecache_residency_graph_begin(moecache & mc) {
    mc.build_n_ubatch = 0;
    for (moecache_layer & L : mc.layers) {
        L.graph.ids_in   = nullptr;
        L.graph.ids_out  = nullptr;
        L.graph.arrival  = nullptr;
        L.graph.ready    = nullptr;
        L.graph.vram_ids = nullptr;
        L.graph.n_ubatch = 0;
    }
}

ggml_tensor * moecache_residency_mul_mat_id(moecache & mc, ggml_context * ctx, ggml_tensor * as,
                                            ggml_tensor * b, ggml_tensor * ids) {
    if (mc.cparams.residency == MOECACHE_RESIDENCY_NONE) {
        return nullptr;
    }
    auto it = mc.xt_layer.find(as);
    if (it == mc.xt_layer.end() || ids->type != GGML_TYPE_I32) {
        return nullptr;
    }
    moecache_layer & L = mc.layers[it->second];
    if (L.graph.ids_in != ids) {
        L.graph.ids_in  = ids;
        L.graph.ids_out = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], 1, 1, &ids, 1, op_experts, 1, &L);
        L.graph.arrival = nullptr;
        L.graph.ready   = nullptr;
        ggml_format_name(moecache_graph_on_cpu(L.graph.ids_out), "moecache_experts-%d", L.il);
    }
    if (mc.cparams.residency == MOECACHE_RESIDENCY_STREAM) {
        const bool decodes = moecache_layer_decodes(L, ids->ne[1]);
        for (const moecache_expert_tensor & x : L.res.xt) {
            if (x.model_t != as) {
                continue;
            }
            if (!L.uni.t.empty() && (decodes || L.res.all_in_slots)) { // on the device, in place (moecache-unified.cpp)
                return moecache_unified_mul_mat_id(L, ctx, x, b, decodes ? moecache_matmul_ready(L, ctx) : L.graph.ids_out);
            }
            if (decodes) { // on the slots (moecache-matmul.cpp), and those of the VRAM tier
                return moecache_vram_mul_mat_id(L, ctx, x, b, moecache_matmul_stream_decode(mc, L, ctx, x, b));
            }
            if (L.res.all_in_slots) {
                return ggml_mul_mat_id(ctx, x.slots_t, b, L.graph.ids_out); // a prompt, every expert in a slot
            }
        }
    }
    return ggml_mul_mat_id(ctx, as, b, L.graph.ids_out);
}

// --- model loading ---------------------------------------------------------------------------

static thread_local int g_load_residency = MOECACHE_RESIDENCY_NONE;

void moecache_graph_set_load_residency(enum moecache_residency residency) {
    g_load_residency = residency;
}

ggml_backend_buffer_type_t moecache_hook_weight_buft(const char * name, ggml_backend_buffer_type_t buft) {
    if (g_load_residency == MOECACHE_RESIDENCY_NONE || !strstr(name, "_exps.")) {
        return buft; // (blk.N.ffn_{gate,up,down,gate_up}_exps.weight: the routed experts)
    }
    // not repacked (a CPU extra type) and not on a GPU layer's device: in host memory, in the file's
    // layout, read from the file into slots or locked in the mapping (as llama.cpp's --cpu-moe places them)
    return ggml_backend_cpu_buffer_type();
}

bool moecache_hook_mmap_prefetch(void) {
    return g_load_residency == MOECACHE_RESIDENCY_NONE; // experts are read when a token needs them
}

// --- fitted predictors (moecache_set_predictor) --------------------------------------------

void moecache_graph_mark_dirty(moecache * mc) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (mc->ctx) {
        auto it = g_ctx.find(mc->ctx);
        if (it != g_ctx.end()) {
            it->second.dirty = true;
        }
    }
}

void moecache_graph_free_predictors(moecache & mc) {
    if (mc.pred_buf) {
        ggml_backend_buffer_free(mc.pred_buf);
    }
    if (mc.pred_ctx) {
        ggml_free(mc.pred_ctx);
    }
    mc.pred_buf = nullptr;
    mc.pred_ctx = nullptr;
    mc.pred_w.clear();
    mc.pred_on.clear();
}

int32_t moecache_graph_set_predictor(moecache & mc, int32_t il, const float * w, int32_t n_embd) {
    const ggml_tensor * router = mc.model ? mc.model->layers[il].ffn_gate_inp : nullptr;
    if (!router || router->ne[1] != mc.n_expert) {
        moecache_set_error("moecache_set_predictor: layer " + std::to_string(il) + " has no router to stand in for");
        return MOECACHE_ERR_INVALID;
    }
    if (!w) {
        if ((size_t) il < mc.pred_on.size()) {
            mc.pred_on[il] = 0;
        }
        moecache_graph_mark_dirty(&mc);
        return MOECACHE_OK;
    }
    if (n_embd != router->ne[0]) {
        moecache_set_error("moecache_set_predictor: layer " + std::to_string(il) + "'s router takes " +
                           std::to_string(router->ne[0]) + " inputs, the predictor " + std::to_string(n_embd));
        return MOECACHE_ERR_INVALID;
    }
    const size_t n = (size_t) n_embd * (size_t) mc.n_expert;
    for (size_t i = 0; i < n; i++) {
        if (!std::isfinite(w[i])) {
            moecache_set_error("moecache_set_predictor: the predictor has a value that is not finite");
            return MOECACHE_ERR_INVALID;
        }
    }
    if (!mc.pred_ctx) { // one [n_embd, N] F32 tensor per layer with a router, in one CPU buffer
        struct ggml_init_params ip = { (size_t) (mc.n_layer + 1) * ggml_tensor_overhead(), nullptr, true };
        mc.pred_ctx = ggml_init(ip);
        mc.pred_w.assign(mc.n_layer, nullptr);
        mc.pred_on.assign(mc.n_layer, 0);
        for (int32_t l = 0; l < mc.n_layer && mc.pred_ctx; l++) {
            const ggml_tensor * r = mc.model->layers[l].ffn_gate_inp;
            if (r && r->ne[1] == mc.n_expert) {
                mc.pred_w[l] = ggml_new_tensor_2d(mc.pred_ctx, GGML_TYPE_F32, r->ne[0], mc.n_expert);
                ggml_format_name(mc.pred_w[l], "moecache.predictor-%d", l);
            }
        }
        mc.pred_buf = mc.pred_ctx ? ggml_backend_alloc_ctx_tensors_from_buft(mc.pred_ctx, ggml_backend_cpu_buffer_type())
                                  : nullptr;
        if (!mc.pred_buf) {
            moecache_graph_free_predictors(mc);
            moecache_set_error("moecache_set_predictor: out of memory");
            return MOECACHE_ERR_NO_MEMORY;
        }
        ggml_backend_buffer_set_usage(mc.pred_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // (its matmul runs where it is)
    }
    ggml_backend_tensor_set(mc.pred_w[il], w, 0, n * sizeof(float));
    mc.pred_on[il] = 1;
    moecache_graph_mark_dirty(&mc);
    return MOECACHE_OK;
}

// --- attach / detach (the registry; the API is in moecache.cpp) ---------------------------

void moecache_hook_detach(moecache * mc) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!mc->ctx) {
        return;
    }
    auto it = g_ctx.find(mc->ctx);
    if (it != g_ctx.end()) {
        it->second.mc    = nullptr;
        it->second.dirty = true;
    }
    if (mc->cparams.residency != MOECACHE_RESIDENCY_NONE) {
        llama_set_abort_callback(mc->ctx, nullptr, nullptr);
    }
    mc->ctx = nullptr;
}

int32_t moecache_graph_attach(moecache * mc, llama_context * ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (mc->ctx == ctx) {
        return MOECACHE_OK;
    }
    if (mc->ctx) {
        moecache_set_error("this moecache is attached to another context; detach it first");
        return MOECACHE_ERR_STATE;
    }
    auto it = g_ctx.find(ctx);
    if (it == g_ctx.end()) {
        try {
            it = g_ctx.emplace(ctx, ctx_entry()).first;
        } catch (const std::exception &) {
            moecache_set_error("moecache_attach: out of memory");
            return MOECACHE_ERR_NO_MEMORY;
        }
    }
    ctx_entry & e = it->second;
    if (e.mc) {
        moecache_set_error("another moecache is attached to this context; detach it first");
        return MOECACHE_ERR_STATE;
    }
    e.mc    = mc;
    e.dirty = true;
    mc->ctx = ctx;
    if (mc->cparams.residency != MOECACHE_RESIDENCY_NONE) {
        llama_set_abort_callback(ctx, moecache_residency_abort, mc); // a failed expert read stops the decode
    }
    return MOECACHE_OK;
}
