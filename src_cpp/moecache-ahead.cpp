// moecache-ahead.cpp - reads ahead of the layer that needs them: during layer il's decode, what
// layer il + d will select is predicted (GATE: that layer's router, or a fitted predictor standing in
// for it, applied to this layer's input; TRACE: past requests' expert counts; PREVIOUS: its last
// token's selection) and the predicted misses are read. With spare slots the reads ahead spend a
// budget that the tokens' use of them refills (prefetch_budget, the default), or are on only while
// a running trial shows that they win (prefetch_adaptive).

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "llama-model.h"   // llama_layer: the router of layer il + d

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

const float * moecache_row_f32(const ggml_tensor * t, int64_t i1) {
    return (const float *) ((const char *) t->data + i1 * t->nb[1]);
}

// How many experts to predict: the stock router runs its top K; a cache-aware policy keeps the
// cached experts it can and must run only its top J (Top-J) whatever the cache holds: those are
// the reads to start early
static int32_t prefetch_width(const moecache & mc) {
    const moecache_routing_params & rp = mc.rparams;
    const int32_t K = mc.n_expert_used;
    return rp.policy == MOECACHE_POLICY_TOPK || rp.top_j == 0 ? K : std::min(rp.top_j, K);
}

// ids/score = the n largest of v[0:N] (NaN last, ties by the lower id) whose predicted probability
// is at least min_p, score = that probability: from logits, their softmax over all N; otherwise
// their share of the sum of the positive values, zeros left out. (A distribution that cannot be
// normalised, e.g. all NaN, gives score 1 and no threshold.) order: [N] scratch. Returns how many.
static int32_t top_predicted(const float * v, int32_t N, int32_t n, bool logits, float min_p, std::vector<int32_t> & order,
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
static int32_t prior_predicted(const moecache & mc, const moecache_layer & T, const float * z, float min_p,
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

// prefetch_spare with prefetch_adaptive, at the start of each decoded token: the time of the
// token before goes to the side of the trial it ran on. A trial is 2 x MOECACHE_SPEC_WINDOW
// tokens with the reads ahead on and off in turn, so both sides see the same disk and machine
// (on a shared host either drifts by more than the difference being measured within a few
// tokens); then the winner runs MOECACHE_SPEC_RUN tokens, and a new trial starts. The reads
// ahead must win by MOECACHE_SPEC_MARGIN of the median token: without them a token reads fewer
// bytes and spends less CPU on reading, so a tie goes to off.
void moecache_ahead_trial_token(moecache & mc, int64_t now) {
    auto & c = mc.ahead.trial;
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
        c.on    = (double) moecache_median_us(c.dt_on) <
                  (1.0 - MOECACHE_SPEC_MARGIN) * (double) moecache_median_us(c.dt_off);
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

static void ahead_read(moecache & mc, moecache_layer & T, const int32_t * ids, const float * score, int32_t n);

// During layer L's decode: predict what layer L + d will select and prefetch it (GATE: from pred,
// that layer's router logits for this layer's FFN input, [n_expert, 1]; TRACE: from the request's
// expert counts against past requests; PREVIOUS: what it selected for the previous token)
void moecache_ahead_prefetch(moecache & mc, moecache_layer & L, const ggml_tensor * pred) {
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
            n = prior_predicted(mc, T, moecache_row_f32(pred, 0), mc.cparams.prefetch_min_p, L.scratch.order,
                                L.scratch.boosted, ids, score);
        } else {
            n = top_predicted(moecache_row_f32(pred, 0), mc.n_expert, prefetch_width(mc), true, mc.cparams.prefetch_min_p,
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
    ahead_read(mc, T, ids, score, n);
}

// A decode step of several sequences: layer L + d's router applied to each row of L's FFN input (pred:
// [n_expert, n_tokens]); the experts the rows predict, each with its best probability, are read into T's
// spare slots as one token's are (what T caches is not: those are there). Without it a step's reads all
// wait in its own layer, while one sequence alone has its misses read during the layer before.
void moecache_ahead_prefetch_step(moecache & mc, moecache_layer & L, const ggml_tensor * pred, int64_t n_tokens) {
    const int32_t target = L.il + mc.cparams.prefetch_distance;
    if (!pred || !L.graph.predicts || target >= mc.n_layer || mc.cparams.prefetch_spare <= 0 ||
        mc.cparams.prefetch != MOECACHE_PREFETCH_GATE) {
        return;
    }
    std::vector<float> & best = L.scratch.boosted; // [N] scratch, free once L has routed its tokens
    std::fill(best.begin(), best.end(), 0.0f);
    int32_t ids[MOECACHE_MAX_USED];
    float   score[MOECACHE_MAX_USED];
    for (int64_t t = 0; t < n_tokens; t++) {
        const int32_t n = top_predicted(moecache_row_f32(pred, t), mc.n_expert, prefetch_width(mc), true,
                                        mc.cparams.prefetch_min_p, L.scratch.order, ids, score);
        for (int32_t i = 0; i < n; i++) {
            best[ids[i]] = std::max(best[ids[i]], score[i]);
        }
    }
    int32_t n = 0; // (by probability: the most likely first, as many as a token's ids hold)
    for (int32_t e = 0; e < mc.n_expert; e++) {
        L.scratch.order[e] = e;
    }
    std::stable_sort(L.scratch.order.begin(), L.scratch.order.end(),
                     [&best](int32_t a, int32_t b) { return best[a] > best[b]; });
    for (; n < std::min<int32_t>(mc.n_expert, MOECACHE_MAX_USED) && best[L.scratch.order[n]] > 0.0f; n++) {
        ids[n]   = L.scratch.order[n];
        score[n] = best[ids[n]];
    }
    ahead_read(mc, mc.layers[target], ids, score, n);
}

// the reads ahead of T's predicted experts ids[0:n] (most likely first)
static void ahead_read(moecache & mc, moecache_layer & T, const int32_t * ids, const float * score, int32_t n) {
    if (n == 0) {
        return;
    }
    // spare slots: T's cache is left as it is, the predicted experts it does not cache are read;
    // otherwise they are inserted into it (evicting by its policy) and read
    const bool spare = mc.cparams.prefetch_spare > 0;
    if (spare && !mc.ahead.trial.on) {
        return; // (prefetch_adaptive: off while it loses, or during its trial without)
    }
    int32_t read[MOECACHE_MAX_USED];
    float   read_score[MOECACHE_MAX_USED];
    int32_t m = spare ? moecache_layer_speculate(T, ids, n, read) : moecache_layer_prefetch(T, ids, n, read);
    if (moecache_budgets_ahead(mc)) { // (the most likely first; each costs one, read or already in a slot)
        m = std::min(m, (int32_t) T.pf.credit);
        for (int32_t i = 0; i < m; i++) {
            T.pf.spent[read[i]] = 1;
        }
        T.pf.credit -= (float) m;
    }
    if (moecache_counts_ahead(mc)) { // what these reads fill T's spare slots with, for T's prior to count as cached
        for (int32_t i = 0; i < m; i++) {
            T.pf.ahead[read[i]] = 1;
        }
    }
    for (int32_t i = 0, j = 0; i < n && j < m; i++) { // (read[] keeps the order of ids[])
        if (ids[i] == read[j]) {
            read_score[j++] = score[i] / (float) mc.cparams.prefetch_distance;
        }
    }
    if (m > 0 && mc.cparams.residency == MOECACHE_RESIDENCY_STREAM && mc.res.io) {
        if (spare) { // queued by this layer's residency op once its own reads are (they must not wait behind these)
            mc.ahead.pending.target = T.il;
            mc.ahead.pending.n      = m;
            std::copy(read, read + m, mc.ahead.pending.ids);
            std::copy(read_score, read_score + m, mc.ahead.pending.score);
        } else {
            moecache_slots_prefetch(mc, T, read, read_score, m, false);
        }
    }
    moecache_vram_ahead(mc, T, ids, n); // (the VRAM tier: those its host cache holds, copied up ahead)
}

// GATE prefetch, decode graphs: layer il + d's router applied to layer il's FFN input (the input
// of this layer's router matmul), [n_expert, n_tokens] (a step of several sequences: where their misses are read
// into host slots only); nullptr when there is nothing to predict
ggml_tensor * moecache_ahead_predict_router(moecache & mc, ggml_context * ctx, ggml_tensor * logits, int il, int64_t n_tokens) {
    const moecache_layer & L = mc.layers[il]; // (a step of several sequences: their misses on the host slots alone)
    const bool step = mc.build_decode && n_tokens > 1 && n_tokens == mc.build_n_ubatch &&
                      mc.cparams.prefetch_spare > 0 && L.vram.n == 0 && L.low.n == 0 && !L.uni.dev;
    if (mc.cparams.prefetch != MOECACHE_PREFETCH_GATE || !mc.model || (n_tokens != 1 && !step)) {
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
    const bool fitted = (size_t) target < mc.ahead.pred_on.size() && mc.ahead.pred_on[target];
    ggml_tensor * pred = ggml_mul_mat(ctx, fitted ? mc.ahead.pred_w[target] : next.ffn_gate_inp, mm->src[1]);
    if (next.ffn_gate_inp_b) {
        pred = ggml_add(ctx, pred, next.ffn_gate_inp_b);
    }
    ggml_format_name(pred, "moecache_predict-%d", target);
    return pred;
}

// --- fitted predictors (moecache_set_predictor) --------------------------------------------

void moecache_ahead_free_predictors(moecache & mc) {
    if (mc.ahead.pred_buf) {
        ggml_backend_buffer_free(mc.ahead.pred_buf);
    }
    if (mc.ahead.pred_ctx) {
        ggml_free(mc.ahead.pred_ctx);
    }
    mc.ahead.pred_buf = nullptr;
    mc.ahead.pred_ctx = nullptr;
    mc.ahead.pred_w.clear();
    mc.ahead.pred_on.clear();
}

int32_t moecache_ahead_set_predictor(moecache & mc, int32_t il, const float * w, int32_t n_embd) {
    const ggml_tensor * router = mc.model ? mc.model->layers[il].ffn_gate_inp : nullptr;
    if (!router || router->ne[1] != mc.n_expert) {
        moecache_set_error("moecache_set_predictor: layer " + std::to_string(il) + " has no router to stand in for");
        return MOECACHE_ERR_INVALID;
    }
    if (!w) {
        if ((size_t) il < mc.ahead.pred_on.size()) {
            mc.ahead.pred_on[il] = 0;
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
    if (!mc.ahead.pred_ctx) { // one [n_embd, N] F32 tensor per layer with a router, in one CPU buffer
        struct ggml_init_params ip = { (size_t) (mc.n_layer + 1) * ggml_tensor_overhead(), nullptr, true };
        mc.ahead.pred_ctx = ggml_init(ip);
        mc.ahead.pred_w.assign(mc.n_layer, nullptr);
        mc.ahead.pred_on.assign(mc.n_layer, 0);
        for (int32_t l = 0; l < mc.n_layer && mc.ahead.pred_ctx; l++) {
            const ggml_tensor * r = mc.model->layers[l].ffn_gate_inp;
            if (r && r->ne[1] == mc.n_expert) {
                mc.ahead.pred_w[l] = ggml_new_tensor_2d(mc.ahead.pred_ctx, GGML_TYPE_F32, r->ne[0], mc.n_expert);
                ggml_format_name(mc.ahead.pred_w[l], "moecache.predictor-%d", l);
            }
        }
        mc.ahead.pred_buf = mc.ahead.pred_ctx ? ggml_backend_alloc_ctx_tensors_from_buft(mc.ahead.pred_ctx, ggml_backend_cpu_buffer_type())
                                  : nullptr;
        if (!mc.ahead.pred_buf) {
            moecache_ahead_free_predictors(mc);
            moecache_set_error("moecache_set_predictor: out of memory");
            return MOECACHE_ERR_NO_MEMORY;
        }
        ggml_backend_buffer_set_usage(mc.ahead.pred_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // (its matmul runs where it is)
    }
    ggml_backend_tensor_set(mc.ahead.pred_w[il], w, 0, n * sizeof(float));
    mc.ahead.pred_on[il] = 1;
    moecache_graph_mark_dirty(&mc);
    return MOECACHE_OK;
}
