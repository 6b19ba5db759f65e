// moecache-route.cpp - the routing decision for one token of one layer (the cache it consults:
// moecache-cache.cpp).
//
// Specification: docs/method.md. pymoecache/reference.py is the same algorithm in numpy;
// tests/test_route_property.py checks that both choose the same experts. Change them together.
//
// Determinism: the router's ranking r sorts by the selection score s, descending, ties by
// lower expert id; when the graph passes the model's own top-K (stock), r starts with it, so
// ties are broken exactly as the model breaks them. Every re-ranking below is stable with
// respect to r. The selected experts are returned in r order, which keeps the stock order,
// and so the stock float sums, whenever a policy leaves the set unchanged.

#include "moecache-impl.h"

#include <algorithm>
#include <cmath>

static bool is_allowed(float s) {
    return s > -INFINITY && !std::isnan(s);
}

// r: the router's ranking (L.scratch.rank) and its inverse (L.scratch.pos). Masked experts (s = -inf) go last.
static void rank_experts(moecache_layer & L, const float * s, const int32_t * stock, int32_t K) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    int32_t n = 0;
    std::fill(L.scratch.chosen.begin(), L.scratch.chosen.end(), 0); // marks the stock experts here
    if (stock) {
        for (int32_t i = 0; i < K; i++) {
            L.scratch.rank[n++]         = stock[i];
            L.scratch.chosen[stock[i]] = 1;
        }
    }
    const int32_t n_stock = n;
    for (int32_t e = 0; e < N; e++) {
        if (!L.scratch.chosen[e]) {
            L.scratch.rank[n++] = e;
        }
    }
    // allowed first, then score descending, then lower id: a total order, so std::sort is deterministic
    std::sort(L.scratch.rank.begin() + n_stock, L.scratch.rank.end(), [s](int32_t a, int32_t b) {
        const bool aa = is_allowed(s[a]);
        const bool ab = is_allowed(s[b]);
        if (aa != ab) {
            return aa;
        }
        if (aa && s[a] != s[b]) {
            return s[a] > s[b];
        }
        return a < b;
    });
    for (int32_t i = 0; i < N; i++) {
        L.scratch.pos[L.scratch.rank[i]] = i;
    }
}

// what the routing prefers: the experts the cache holds; where the cache holds every expert of the
// layer and a VRAM tier holds some (every expert in host memory, the hot ones on the device: the
// scenario MoE-Infinity, ProMoE and HOBBIT solve), the experts in device memory, which the device
// computes. The tier's contents before the token routes (moecache-vram.cpp updates them after).
static bool preferred(const moecache_layer & L, int32_t e) {
    if (!L.scratch.others.empty() && L.scratch.others[e]) { // (batch_share: read for another sequence anyway)
        return true;
    }
    if (moecache_layer_routes_to_vram(L)) {
        const int32_t s = L.vram.expert_slot[e];
        return s >= 0 && L.vram.slot_expert[s] == e;
    }
    return L.last_use[e] >= 0;
}

bool moecache_route_preferred(const moecache_layer & L, int32_t e) {
    return preferred(L, e);
}

// moves the members of r[0:m] that are cached (and not masked) to the front, in r order
static void promote_cached(moecache_layer & L, const float * s, int32_t m) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    m = std::min(m, N);
    int32_t n = 0;
    for (int32_t i = 0; i < N; i++) {
        const int32_t e = L.scratch.rank[i];
        if (i < m && preferred(L, e) && is_allowed(s[e])) {
            L.scratch.order[n++] = e;
        }
    }
    for (int32_t i = 0; i < N; i++) {
        const int32_t e = L.scratch.rank[i];
        if (!(i < m && preferred(L, e) && is_allowed(s[e]))) {
            L.scratch.order[n++] = e;
        }
    }
}

// cumsum(tau): the smallest m with p[r0] + ... + p[r(m-1)] >= tau * sum(p over allowed experts)
static int32_t cumsum_rank(const moecache_layer & L, const float * p, const float * s, float tau) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    double total = 0.0;
    int32_t n_allowed = 0;
    for (int32_t i = 0; i < N; i++) {
        if (is_allowed(s[L.scratch.rank[i]])) {
            total += (double) p[L.scratch.rank[i]];
            n_allowed++;
        }
    }
    if (tau <= 0.0f) {
        return 0;
    }
    const double target = (double) tau * total;
    double acc = 0.0;
    for (int32_t i = 0; i < n_allowed; i++) {
        acc += (double) p[L.scratch.rank[i]];
        if (acc >= target) {
            return i + 1;
        }
    }
    return n_allowed;
}

// Delta_l: running mean over tokens of max(u) - min(u) (allowed experts, finite values only)
static void update_delta(moecache_layer & L, const float * u, const float * s) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    float lo = INFINITY;
    float hi = -INFINITY;
    for (int32_t e = 0; e < N; e++) {
        if (is_allowed(s[e]) && std::isfinite(u[e])) {
            lo = std::min(lo, u[e]);
            hi = std::max(hi, u[e]);
        }
    }
    if (hi >= lo) {
        L.delta_sum += (double) hi - (double) lo;
        L.delta_n   += 1;
    }
}

// prior(lambda): r' = argsort(u + lambda * Delta * mask), stable w.r.t. r
static void prior_order(moecache_layer & L, const float * u, const float * s, int32_t J, float boost) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    for (int32_t e = 0; e < N; e++) {
        const bool mask = preferred(L, e) || L.pf.ahead[e] || L.scratch.pos[e] < J; // (ahead: prefetch_route)
        const float b = mask ? u[e] + boost : u[e];
        // NaN (a NaN logit) ranks last like a masked expert: the comparator below needs a total order
        L.scratch.boosted[e] = !is_allowed(s[e]) || std::isnan(b) ? -INFINITY : b;
    }
    for (int32_t i = 0; i < N; i++) {
        L.scratch.order[i] = L.scratch.rank[i];
    }
    std::sort(L.scratch.order.begin(), L.scratch.order.end(), [&L](int32_t a, int32_t b) {
        if (L.scratch.boosted[a] != L.scratch.boosted[b]) {
            return L.scratch.boosted[a] > L.scratch.boosted[b];
        }
        return L.scratch.pos[a] < L.scratch.pos[b];
    });
}

// prefetch_route: which selected experts only the mark of a read ahead made the prior pick (it
// boosted them as if cached; without the mark fewer than n_keep - J others outrank them). Those
// reads earn no budget back (moecache_layer_prefetch_outcome): the token took an expert that is not
// cached over one that is, a miss the routing without the reads would not have had.
static void marked_picks(moecache_layer & L, const float * u, const float * s, int32_t J, int32_t n_keep) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    auto unmarked = [&](int32_t f) { // f's boosted score without a mark of its own
        const bool marked = L.pf.ahead[f] && L.last_use[f] < 0 && L.scratch.pos[f] >= J;
        if (!marked) {
            return L.scratch.boosted[f];
        }
        return !is_allowed(s[f]) || std::isnan(u[f]) ? -INFINITY : u[f];
    };
    for (int32_t e = 0; e < N; e++) {
        L.pf.by_mark[e] = 0;
        if (!L.scratch.chosen[e] || !L.pf.ahead[e] || L.last_use[e] >= 0 || L.scratch.pos[e] < J) {
            continue;
        }
        const float ue = unmarked(e);
        int32_t above = 0;
        for (int32_t f = 0; f < N; f++) {
            if (f == e || L.scratch.pos[f] < J) {
                continue; // (r[0:J] is selected whatever the order)
            }
            const float uf = unmarked(f);
            above += uf > ue || (uf == ue && L.scratch.pos[f] < L.scratch.pos[e]) ? 1 : 0;
        }
        L.pf.by_mark[e] = above >= n_keep - J ? 1 : 0;
    }
}

// splitmix64: a fixed, portable hash for SWAP_RANK's random choice
static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// drop-rank / swap-rank (analysis): r' = r with r[i] moved to the end; for a swap, the
// replacement (a hashed pick among the allowed experts outside r[0:K]) moved to rank i
static void analysis_order(moecache_layer & L, const float * s, const moecache_routing_params & rp, int32_t K,
                           bool swap) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    const int32_t i_drop = rp.analysis_rank;
    int32_t n_allowed = 0;
    for (int32_t i = 0; i < N; i++) {
        n_allowed += is_allowed(s[L.scratch.rank[i]]) ? 1 : 0; // masked experts are last in r
    }
    int32_t repl = -1;
    if (swap && n_allowed > K) {
        const uint64_t h = mix64(mix64(((uint64_t) rp.analysis_seed << 32) ^ (uint64_t) L.il) ^ (uint64_t) L.st.tokens);
        repl = L.scratch.rank[K + (int32_t) (h % (uint64_t) (n_allowed - K))];
    }
    int32_t n = 0;
    for (int32_t i = 0; i < N; i++) {
        if (i == i_drop && repl >= 0) {
            L.scratch.order[n++] = repl;
        }
        if (i != i_drop && L.scratch.rank[i] != repl) {
            L.scratch.order[n++] = L.scratch.rank[i];
        }
    }
    L.scratch.order[n++] = L.scratch.rank[i_drop];
    L.scratch.swapped_from = repl >= 0 ? L.scratch.rank[i_drop] : -1;
}

int32_t moecache_route_token(
        moecache                             & mc,
        moecache_layer                       & L,
        const struct moecache_routing_params & rp,
        const float                          * z,
        const float                          * p,
        const float                          * s,
        const int32_t                        * stock,
        bool                                   apply,
        bool                                   update,
        int32_t                              * sel,
        int8_t                               * hit) {
    const int32_t N = (int32_t) L.scratch.rank.size();
    const int32_t K = mc.n_expert_used;
    const bool analysis = apply && (rp.policy == MOECACHE_POLICY_DROP_RANK || rp.policy == MOECACHE_POLICY_SWAP_RANK);
    const int32_t J = analysis ? 0 : std::min(rp.top_j, K);
    const float * u = L.graph.rank_on_logits ? z : s; // the scale PRIOR boosts and Delta measures

    rank_experts(L, s, stock, K);

    // 1. the final ranking r' (L.scratch.order) and how many experts run
    int32_t n_keep = K;
    const float * prior_u = nullptr; // PRIOR: the scale it boosted (L.scratch.boosted), for by_mark below
    L.scratch.swapped_from = -1;
    const enum moecache_policy policy = apply ? rp.policy : MOECACHE_POLICY_TOPK;
    switch (policy) {
        case MOECACHE_POLICY_PRUNE:
            n_keep = std::min(K, std::max(rp.prune_rank, J));
            promote_cached(L, s, 0);
            break;
        case MOECACHE_POLICY_MAX_RANK:
            promote_cached(L, s, rp.max_rank);
            break;
        case MOECACHE_POLICY_CUMSUM:
            promote_cached(L, s, cumsum_rank(L, p, s, rp.cumsum_tau));
            break;
        case MOECACHE_POLICY_PRIOR:
            if (rp.prior_lambda > 0.0f && L.prior_scale > 0.0f && rp.prior_on_probs) {
                // the probability scale: p for softmax routers, the selection score s (p + bias) otherwise
                prior_u = L.graph.rank_on_logits ? p : s;
                prior_order(L, prior_u, s, J, (float) ((double) rp.prior_lambda * (double) L.prior_scale));
            } else if (rp.prior_lambda > 0.0f && L.prior_scale > 0.0f) {
                prior_u = u;
                prior_order(L, u, s, J, moecache_layer_boost(L, rp.prior_lambda));
            } else {
                promote_cached(L, s, 0);
            }
            break;
        case MOECACHE_POLICY_DROP_RANK:
            n_keep = K - 1;
            analysis_order(L, s, rp, K, false);
            break;
        case MOECACHE_POLICY_SWAP_RANK:
            analysis_order(L, s, rp, K, true);
            n_keep = L.scratch.swapped_from >= 0 ? K : std::max(K - 1, 1); // nothing to swap in: a drop
            break;
        case MOECACHE_POLICY_TOPK:
        default:
            promote_cached(L, s, 0);
            break;
    }

    // Delta, for the tokens after this one: a token is routed with the Delta of the tokens before it, as
    // with the cache, so both are known before the token starts (the prior as device ops, moecache-device.cpp)
    update_delta(L, u, s);

    // 2. selected = r[0:J] + the first (n_keep - J) others of r'
    std::fill(L.scratch.chosen.begin(), L.scratch.chosen.end(), 0);
    int32_t n_sel = 0;
    for (int32_t i = 0; i < J && n_sel < n_keep; i++) {
        L.scratch.chosen[L.scratch.rank[i]] = 1;
        n_sel++;
    }
    for (int32_t i = 0; i < N && n_sel < n_keep; i++) {
        if (!L.scratch.chosen[L.scratch.order[i]]) {
            L.scratch.chosen[L.scratch.order[i]] = 1;
            n_sel++;
        }
    }
    if (prior_u && update && moecache_counts_ahead(mc) && moecache_budgets_ahead(mc)) {
        marked_picks(L, prior_u, s, J, n_keep); // (only the budget reads them)
    }
    // output in r order
    int32_t n_out = 0;
    for (int32_t i = 0; i < N && n_out < n_sel; i++) {
        if (L.scratch.chosen[L.scratch.rank[i]]) {
            sel[n_out] = L.scratch.rank[i];
            hit[n_out] = -1;
            n_out++;
        }
    }
    for (int32_t i = n_out; i < K; i++) {
        sel[i] = -1;
        hit[i] = -1;
    }

    if (!update) {
        return n_sel;
    }

    // 3. cache update. A selected expert is a hit if it was cached when the token was routed.
    //    Then the selected experts are touched one at a time by router weight p, highest first
    //    (top-bottom: the lowest-weight new expert ends most recent) or exactly the reverse:
    //    a hit refreshes its recency, a miss is inserted, evicting the expert the eviction policy
    //    picks among those this token does not use (L.scratch.chosen marks the ones it uses; LRU: the
    //    least recently used). Only misses insert, so evictions <= misses even when the cache is
    //    smaller than K.
    //    slots are sorted by p descending, ties in r order; an insertion sort over <= K slots.
    int32_t * slot = L.scratch.order.data(); // r' is not needed any more
    for (int32_t i = 0; i < n_sel; i++) {
        int32_t j = i;
        while (j > 0 && p[sel[slot[j - 1]]] < p[sel[i]]) {
            slot[j] = slot[j - 1];
            j--;
        }
        slot[j] = i;
        hit[i] = L.last_use[sel[i]] >= 0 ? 1 : 0;
        L.st.pinned_hits += L.use.pinned[sel[i]]; // pinned experts are cached
    }
    moecache_layer_observe(L, p, sel, n_sel); // the usage the eviction policy scores, before any eviction
    // what the policy cost this token against the router's own top K (r[0:K], allowed ones), in probabilities:
    // where p are logits (probs_are_logits), their softmax over the N experts
    double p_max = 0.0, p_sum = 1.0;
    if (L.graph.probs_are_logits) {
        p_max = -INFINITY;
        for (int32_t e = 0; e < N; e++) {
            p_max = std::isfinite(p[e]) ? std::max(p_max, (double) p[e]) : p_max;
        }
        p_sum = 0.0;
        for (int32_t e = 0; e < N; e++) {
            p_sum += std::isfinite(p[e]) ? std::exp((double) p[e] - p_max) : 0.0;
        }
    }
    auto prob = [&](int32_t e) -> double {
        if (!std::isfinite(p[e])) {
            return 0.0;
        }
        return L.graph.probs_are_logits ? std::exp((double) p[e] - p_max) / p_sum : (double) p[e];
    };
    double p_top = 0.0;
    double p_run = 0.0;
    for (int32_t i = 0; i < K && i < N && is_allowed(s[L.scratch.rank[i]]); i++) {
        p_top += prob(L.scratch.rank[i]);
    }
    for (int32_t i = 0; i < n_sel; i++) {
        L.st.rerouted += L.scratch.pos[sel[i]] >= K ? 1 : 0;
        p_run += prob(sel[i]);
    }
    L.st.p_given_up += p_top - p_run;
    const bool top_bottom = mc.cparams.insertion == MOECACHE_INSERTION_TOP_BOTTOM;
    for (int32_t k = 0; k < n_sel; k++) {
        const int32_t i = slot[top_bottom ? k : n_sel - 1 - k];
        const int32_t e = sel[i];
        if (!hit[i]) {
            moecache_layer_insert(L, e, L.scratch.chosen.data());
        } else if (L.last_use[e] >= 0) { // (not evicted by this token's own misses: cache < K)
            L.last_use[e] = ++L.clock;
        }
        L.st.hits   += hit[i];
        L.st.misses += 1 - hit[i];
    }
    L.st.selections += n_sel;
    L.seen           = true;

    // 4. trace
    if (!mc.trace.empty()) {
        moecache_trace_record & rec = mc.trace[mc.trace_total % (int64_t) mc.trace.size()];
        rec = {};
        rec.layer      = L.il;
        rec.token      = L.st.tokens;
        rec.n_selected = std::min(n_sel, (int32_t) MOECACHE_TRACE_MAX_USED);
        for (int32_t i = 0; i < rec.n_selected; i++) {
            rec.experts[i] = sel[i];
            rec.hit_mask   |= (uint32_t) (hit[i] == 1) << i;
            rec.top_k_mask |= (uint32_t) (L.scratch.pos[sel[i]] < K) << i;
        }
        mc.trace_total++;
    }
    L.st.tokens += 1;
    return n_sel;
}

// --- batch_share: a step of several sequences ----------------------------------------------

bool moecache_route_shares(const moecache_routing_params & rp, int64_t n_tokens) {
    return n_tokens > 1 && rp.batch_share &&
           (rp.policy == MOECACHE_POLICY_PRIOR || rp.policy == MOECACHE_POLICY_MAX_RANK ||
            rp.policy == MOECACHE_POLICY_CUMSUM);
}

moecache_routing_params moecache_route_share_params(const moecache_routing_params & rp) {
    moecache_routing_params rs = rp;
    if (rp.policy == MOECACHE_POLICY_PRIOR) {
        rs.prior_lambda = rp.prior_lambda * rp.batch_prior;
    }
    return rs;
}

void moecache_route_share_first(moecache & mc, moecache_layer & L, const moecache_routing_params & rp, int64_t n_tokens,
                                const float * const * z, const float * const * p, const float * const * s,
                                const int32_t * const * stock) {
    const int32_t K = mc.n_expert_used;
    L.scratch.step.assign(mc.n_expert, 0);
    L.scratch.first.assign((size_t) n_tokens * K, -1);
    L.scratch.others.clear();
    const double  delta_sum = L.delta_sum; // (the first pass is not a token of the Delta statistics)
    const int64_t delta_n   = L.delta_n;
    int8_t hit[MOECACHE_MAX_USED];
    for (int64_t t = 0; t < n_tokens; t++) {
        int32_t * sel = L.scratch.first.data() + t * K;
        const int32_t n = moecache_route_token(mc, L, rp, z[t], p[t], s[t], stock ? stock[t] : nullptr, true, false,
                                               sel, hit);
        for (int32_t i = 0; i < n; i++) {
            L.scratch.step[sel[i]] += 1;
        }
    }
    L.delta_sum = delta_sum;
    L.delta_n   = delta_n;
}

void moecache_route_share_token(const moecache & mc, moecache_layer & L, int64_t t) {
    const int32_t K = mc.n_expert_used;
    L.scratch.others.resize(mc.n_expert);
    for (int32_t e = 0; e < mc.n_expert; e++) {
        L.scratch.others[e] = L.scratch.step[e] > 0;
    }
    const int32_t * sel = L.scratch.first.data() + t * K;
    for (int32_t i = 0; i < K && sel[i] >= 0; i++) { // (its own: only if another token selected it too)
        L.scratch.others[sel[i]] = L.scratch.step[sel[i]] > 1;
    }
}

void moecache_route_share_end(moecache_layer & L) {
    L.scratch.others.clear();
}

void moecache_route_count_union(moecache & mc, std::vector<uint8_t> & seen, const int32_t * sel, int32_t n,
                                int64_t n_tokens) {
    mc.rst.decode_selections += n;
    if (n_tokens == 1) { // (no bitmap on the one-token path)
        mc.rst.decode_union += n;
        return;
    }
    seen.resize(mc.n_expert, 0);
    for (int32_t i = 0; i < n; i++) {
        if (sel[i] >= 0 && sel[i] < mc.n_expert && !seen[sel[i]]) {
            seen[sel[i]] = 1;
            mc.rst.decode_union += 1;
        }
    }
}
