// moecache-cache.cpp - one layer's expert cache: which experts it holds, what a miss or a
// prefetch inserts, and which expert leaves for it (the eviction policies of moecache.h).
//
// pymoecache/reference.py (LayerCache) is the same cache in numpy; tests/test_route_property.py
// checks that both evict the same experts under every policy. Change them together.
//
// Every eviction is decided in moecache_layer_pick_victim below, the host cache's and the VRAM
// tier's (moecache-vram.cpp). The usage it scores is updated once per routed token
// (moecache_layer_observe), before the token's misses are inserted, whatever the policy.

#include "moecache-impl.h"

#include <algorithm>
#include <cmath>

void moecache_layer_init(moecache & mc, moecache_layer & L, int32_t il, int32_t capacity) {
    const int32_t n = mc.n_expert;
    L.mc       = &mc;
    L.il       = il;
    L.capacity = capacity;
    L.last_use.assign(n, -1);
    L.inserted_at.assign(n, 0);
    L.scratch.rank.assign(n, 0);
    L.scratch.pos.assign(n, 0);
    L.scratch.order.assign(n, 0);
    L.scratch.boosted.assign(n, 0.0f);
    L.scratch.chosen.assign(n, 0);
    L.pf.predicted.assign(n, 0);
    L.pf.fetched.assign(n, 0);
    L.pf.ahead.assign(n, 0);
    L.pf.by_mark.assign(n, 0);
    L.pf.spent.assign(n, 0);
    L.pf.credit = (float) mc.cparams.prefetch_spare;
    L.pf.last_sel.assign(mc.n_expert_used, -1);
    L.use.freq.assign(n, 0.0);
    L.use.mass.assign(n, 0.0);
    L.use.last_p.assign(n, 0.0f);
    L.use.pinned.assign(n, 0);
}

void moecache_layer_clear(moecache_layer & L) {
    std::fill(L.last_use.begin(), L.last_use.end(), -1);
    std::fill(L.pf.fetched.begin(), L.pf.fetched.end(), 0);
    std::fill(L.pf.ahead.begin(), L.pf.ahead.end(), 0);
    std::fill(L.pf.by_mark.begin(), L.pf.by_mark.end(), 0);
    std::fill(L.pf.spent.begin(), L.pf.spent.end(), 0);
    L.pf.credit = (float) L.mc->cparams.prefetch_spare;
    std::fill(L.use.freq.begin(), L.use.freq.end(), 0.0);
    std::fill(L.use.mass.begin(), L.use.mass.end(), 0.0);
    std::fill(L.use.last_p.begin(), L.use.last_p.end(), 0.0f);
    std::fill(L.use.pinned.begin(), L.use.pinned.end(), 0);
    L.use.n_pinned = 0;
    L.occupancy    = 0;
    L.clock        = 0;
    moecache_vram_forget(L); // (an exclusive tier's experts were entries of this cache)
    L.delta_sum    = 0.0;
    L.delta_n      = 0;
}

void moecache_layer_empty(moecache_layer & L) {
    for (size_t e = 0; e < L.last_use.size(); e++) {
        if (L.last_use[e] >= 0) { // the entries leaving now end their lifetimes here
            L.st.lifetime_sum   += (double) (L.st.tokens - L.inserted_at[e]);
            L.st.lifetime_count += 1;
        }
        L.last_use[e] = -1;
    }
    std::fill(L.pf.fetched.begin(), L.pf.fetched.end(), 0);
    std::fill(L.pf.ahead.begin(), L.pf.ahead.end(), 0);
    std::fill(L.pf.by_mark.begin(), L.pf.by_mark.end(), 0);
    std::fill(L.pf.spent.begin(), L.pf.spent.end(), 0);
    std::fill(L.use.pinned.begin(), L.use.pinned.end(), 0);
    L.use.n_pinned = 0;
    L.occupancy    = 0;
    moecache_vram_forget(L);
}

void moecache_layer_observe(moecache_layer & L, const float * p, const int32_t * sel, int32_t n_sel) {
    const double decay = (double) L.mc->cparams.eviction_decay;
    for (size_t e = 0; e < L.use.freq.size(); e++) {
        const float pe = std::isfinite(p[e]) && p[e] > 0.0f ? p[e] : 0.0f; // a NaN router output adds nothing
        L.use.freq[e]   = L.use.freq[e] * decay;
        L.use.mass[e]   = L.use.mass[e] * decay + (double) pe;
        L.use.last_p[e] = pe;
    }
    for (int32_t i = 0; i < n_sel; i++) {
        L.use.freq[sel[i]] += 1.0;
    }
    moecache_request_count(*L.mc, L, sel, n_sel);
}

// ACTIVATION's weight of the profile's share against the request's own
#define MOECACHE_ACTIVATION_PAST 0.1

// the sum of a row, in order (the numpy twin sums the same way)
template <typename T> static double row_sum(const T * row, int32_t n) {
    double sum = 0.0;
    for (int32_t e = 0; e < n; e++) {
        sum += (double) row[e];
    }
    return sum;
}

// the expert to evict from a set of L's experts (stamp[e] >= 0: held, the larger the more recently
// used): the one with the lowest score of the eviction policy that is not pinned and, if possible,
// not in use (pinned and in_use may be NULL); ties (and LRU, whose score is always 0) by least
// recent use. Pinned experts go only if every held expert is pinned.
int32_t moecache_layer_pick_victim(const moecache_layer & L, const int64_t * stamp, const uint8_t * pinned,
                                   const uint8_t * in_use) {
    const moecache & mc = *L.mc;
    const int32_t N = (int32_t) L.last_use.size();
    const enum moecache_eviction policy = mc.cparams.eviction;
    const float  * req  = nullptr;
    const double * past = nullptr;
    double req_sum = 0.0, past_sum = 0.0;
    if (policy == MOECACHE_EVICTION_ACTIVATION) {
        if (!mc.prof.req_counts.empty()) {
            req     = &mc.prof.req_counts[(size_t) L.il * N];
            req_sum = row_sum(req, N);
        }
        if (!mc.prof.counts.empty()) {
            past     = &mc.prof.counts[(size_t) L.il * N];
            past_sum = row_sum(past, N);
        }
    }
    auto score = [&](int32_t e) -> double {
        switch (policy) {
            case MOECACHE_EVICTION_LFU:         return L.use.freq[e];
            case MOECACHE_EVICTION_ROUTER_MASS: return L.use.mass[e];
            case MOECACHE_EVICTION_FREQ_PROB:   return L.use.freq[e] * (double) L.use.last_p[e];
            case MOECACHE_EVICTION_ACTIVATION: {
                const double now  = req_sum  > 0.0 ? (double) req[e] / req_sum : 0.0;
                const double then = past_sum > 0.0 ? past[e] / past_sum : 0.0;
                return now + MOECACHE_ACTIVATION_PAST * then;
            }
            case MOECACHE_EVICTION_LRU:
            default:                            return 0.0;
        }
    };
    int32_t victim = -1;
    double  best   = 0.0;
    // pass 0: neither in use nor pinned; 1: not pinned (the cache is smaller than K); 2: any
    for (int32_t pass = 0; pass < 3 && victim < 0; pass++) {
        for (int32_t e = 0; e < N; e++) {
            if (stamp[e] < 0 || (pass < 2 && pinned && pinned[e]) || (pass == 0 && in_use && in_use[e])) {
                continue;
            }
            const double s = score(e);
            if (victim < 0 || s < best || (s == best && stamp[e] < stamp[victim])) {
                victim = e;
                best   = s;
            }
        }
    }
    return victim;
}

bool moecache_layer_insert(moecache_layer & L, int32_t e, const uint8_t * in_use) {
    const int32_t capacity = L.capacity + L.vram.n_excl; // (an exclusive VRAM tier's experts are cached too)
    if (L.capacity <= 0) {
        return false;
    }
    if (L.occupancy >= capacity) {
        const uint8_t * keep_out = L.use.pinned.data();
        if (L.vram.n_excl > 0) { // never one in device memory: it holds no host slot to give (capacity >= 1
            for (size_t f = 0; f < L.vram.keep_out.size(); f++) { // leaves a host expert to evict)
                L.vram.keep_out[f] = L.use.pinned[f] | L.vram.excl[f];
            }
            keep_out = L.vram.keep_out.data();
        }
        const int32_t victim = moecache_layer_pick_victim(L, L.last_use.data(), keep_out, in_use);
        L.st.lifetime_sum   += (double) (L.st.tokens - L.inserted_at[victim]);
        L.st.lifetime_count += 1;
        L.st.evictions      += 1;
        L.last_use[victim]   = -1;
        L.occupancy         -= 1;
        if (L.use.pinned[victim]) {
            L.use.pinned[victim] = 0;
            L.use.n_pinned      -= 1;
        }
        if (L.pf.fetched[victim]) { // prefetched, never selected: its read was for nothing
            L.pf.fetched[victim] = 0;
            L.mc->rst.prefetch_wasted += 1;
        }
    }
    L.last_use[e]    = ++L.clock;
    L.inserted_at[e] = L.st.tokens;
    L.occupancy     += 1;
    return true;
}

// the prediction for T's next token, for its recall (moecache_layer_prefetch_outcome)
static void set_prediction(moecache_layer & T, const int32_t * pred, int32_t n) {
    std::fill(T.pf.predicted.begin(), T.pf.predicted.end(), 0);
    for (int32_t i = 0; i < n; i++) {
        T.pf.predicted[pred[i]] = 1;
    }
    T.pf.has_prediction = true;
}

int32_t moecache_layer_prefetch(moecache_layer & T, const int32_t * pred, int32_t n, int32_t * inserted) {
    set_prediction(T, pred, n);
    int32_t n_ins = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = pred[i];
        if (T.last_use[e] >= 0) {
            continue; // cached already: nothing to read, and its recency is left alone
        }
        // evicts (by the layer's policy) an expert that is not predicted itself
        if (!moecache_layer_insert(T, e, T.pf.predicted.data())) {
            break;
        }
        T.pf.fetched[e] = 1;
        T.mc->rst.prefetch_issued += 1;
        inserted[n_ins++] = e;
    }
    return n_ins;
}

int32_t moecache_layer_speculate(moecache_layer & T, const int32_t * pred, int32_t n, int32_t * missing) {
    set_prediction(T, pred, n);
    int32_t m = 0;
    for (int32_t i = 0; i < n && m < T.mc->cparams.prefetch_spare; i++) {
        if (T.last_use[pred[i]] < 0) { // (the cache is left alone: its contents, recency and counters)
            missing[m++] = pred[i];
        }
    }
    return m;
}

void moecache_layer_prefetch_outcome(moecache_layer & L, const int32_t * sel, int32_t n_sel) {
    moecache & mc = *L.mc;
    if (L.pf.has_prediction) {
        for (int32_t i = 0; i < n_sel; i++) {
            mc.rst.predicted_selected += L.pf.predicted[sel[i]];
        }
        mc.rst.predicted_total += n_sel;
        L.pf.has_prediction = false;
    }
    const bool budget = moecache_budgets_ahead(mc);
    for (int32_t i = 0; i < n_sel; i++) {
        if (L.pf.fetched[sel[i]]) {
            L.pf.fetched[sel[i]] = 0;
            mc.rst.prefetch_used += 1;
        }
        // (picked only for its mark: a miss the routing without the reads would not have had)
        L.pf.credit += budget && L.pf.spent[sel[i]] && !L.pf.by_mark[sel[i]] ? 1.0f + mc.cparams.prefetch_budget : 0.0f;
        L.pf.by_mark[sel[i]] = 0;
    }
    if (budget) { // (a retry per 32 tokens, up to twice the spare slots)
        L.pf.credit = std::min(L.pf.credit + 1.0f / 32.0f, 2.0f * (float) mc.cparams.prefetch_spare);
        std::fill(L.pf.spent.begin(), L.pf.spent.end(), 0);
    }
    if (mc.cparams.prefetch_spare > 0) { // spare slots: read for this routing only; the rest was for nothing
        for (uint8_t & f : L.pf.fetched) {
            mc.rst.prefetch_wasted += f;
            f = 0;
        }
    }
    if (moecache_counts_ahead(mc)) {
        std::fill(L.pf.ahead.begin(), L.pf.ahead.end(), 0); // (counted by this routing only)
    }
    L.pf.n_last_sel = std::min<int32_t>(n_sel, (int32_t) L.pf.last_sel.size());
    std::copy(sel, sel + L.pf.n_last_sel, L.pf.last_sel.begin());
}
