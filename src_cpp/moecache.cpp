// moecache.cpp - the extern "C" functions of moecache.h: defaults, life cycle, routing changes, stats, trace,
// state files, attach/detach, residency telemetry (the timeline's: moecache-timeline.cpp). Each checks its
// arguments and calls the file of its concept: moecache-init.cpp (parameters, construction), moecache-route.cpp
// (the per-token decision), moecache-state.cpp, moecache-graph.cpp, moecache-residency.cpp.

#include "moecache-impl.h"
#include "moecache-io.h"

#include "llama.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>


// a token the device path counts after its graph (moecache-device.cpp) is counted before any call
// that reads or changes the cache
static void moecache_device_flush_c(const struct moecache * mc) {
    if (mc) {
        moecache_device_flush(const_cast<moecache &>(*mc));
    }
}

#ifndef MOECACHE_VERSION_STR
#define MOECACHE_VERSION_STR "dev"
#endif
#ifndef MOECACHE_LLAMA_PIN
#define MOECACHE_LLAMA_PIN "?" // set by CMakeLists.txt from pyproject.toml
#endif

static thread_local std::string g_last_error;

void moecache_set_error(const std::string & msg) {
    g_last_error = msg;
}

static int32_t fail(int32_t status, const std::string & msg) {
    moecache_set_error(msg);
    return status;
}


extern "C" {

uint32_t moecache_abi_version(void) {
    return MOECACHE_ABI_VERSION;
}

const char * moecache_version(void) {
    return "pymoecache " MOECACHE_VERSION_STR " (llama.cpp from llama-cpp-python " MOECACHE_LLAMA_PIN ")";
}

const char * moecache_last_error(void) {
    return g_last_error.c_str();
}

struct moecache_cache_params moecache_cache_default_params(void) {
    struct moecache_cache_params p = {};
    p.n_cached           = -1;
    p.fraction           = 0.5f;
    p.n_cached_per_layer = nullptr;
    p.n_layer_sizes      = 0;
    p.insertion          = MOECACHE_INSERTION_TOP_BOTTOM;
    p.update_on_prompt   = true;
    p.trace_capacity     = 0;
    p.residency          = MOECACHE_RESIDENCY_NONE;
    p.model_path         = nullptr;
    p.io_threads         = 8;
    p.direct_io          = true;
    p.lock_memory        = true;
    p.lock_dense         = true;
    p.overlap_experts    = true;
    p.prefetch           = MOECACHE_PREFETCH_OFF;
    p.prefetch_distance  = 1;
    p.prefetch_min_p     = 0.0f;
    p.prefetch_threads   = 0;
    p.prefetch_spare     = 0;
    p.prefetch_adaptive  = false;
    p.prefetch_route     = true;
    p.prefetch_budget    = 0.0f;
    p.eviction           = MOECACHE_EVICTION_LRU;
    p.eviction_decay     = 0.95f;
    p.router_record      = 0;
    p.router_record_input = false;
    p.n_vram             = 0;
    p.vram_fill          = MOECACHE_VRAM_FILL_AUTO;
    p.unified            = MOECACHE_UNIFIED_AUTO;
    p.vram_copy          = MOECACHE_VRAM_COPY_ASYNC;
    p.lowbit             = MOECACHE_LOWBIT_OFF;
    p.lowbit_path        = nullptr;
    p.lowbit_in_ram      = false;
    p.lowbit_max_p       = 1.0f;
    p.vram_exclusive     = false;
    p.n_seq              = 1;
    p.share_steps        = true;
    return p;
}

struct moecache_routing_params moecache_routing_default_params(void) {
    struct moecache_routing_params p = {};
    p.policy       = MOECACHE_POLICY_TOPK;
    p.top_j        = 1;
    p.prior_lambda = 0.5f;
    p.max_rank     = 8;
    p.cumsum_tau   = 0.9f;
    p.prune_rank   = 2;
    p.scope        = MOECACHE_SCOPE_ALL;
    p.batch_share  = true;
    p.batch_prior  = 3.0f;
    return p;
}

} // extern "C"

extern "C" {

struct moecache * moecache_init(const struct llama_model * model,
                                struct moecache_cache_params cparams,
                                struct moecache_routing_params rparams) {
    try {
        return moecache_new(model, cparams, rparams);
    } catch (const std::exception & e) { // std::bad_alloc above all: an error, never an abort
        fail(MOECACHE_ERR_NO_MEMORY, std::string("moecache_init: ") + e.what());
        return nullptr;
    }
}

struct moecache * moecache_init_synthetic(int32_t n_layer, int32_t n_expert, int32_t n_expert_used,
                                          struct moecache_cache_params cparams,
                                          struct moecache_routing_params rparams) {
    if (cparams.residency != MOECACHE_RESIDENCY_NONE) {
        fail(MOECACHE_ERR_INVALID, "a synthetic moecache has no model: residency must be NONE");
        return nullptr;
    }
    try {
        moecache * mc = moecache_new_shape(n_layer, n_expert, n_expert_used, cparams, rparams);
        if (mc) {
            mc->desc = "synthetic";
        }
        return mc;
    } catch (const std::exception & e) {
        fail(MOECACHE_ERR_NO_MEMORY, std::string("moecache_init_synthetic: ") + e.what());
        return nullptr;
    }
}

void moecache_free(struct moecache * mc) {
    if (!mc) {
        return;
    }
    moecache_hook_detach(mc);
    moecache_residency_free(*mc);
    moecache_ahead_free_predictors(*mc);
    moecache_device_free(*mc);
    delete mc;
}

int32_t moecache_set_routing(struct moecache * mc, struct moecache_routing_params rparams) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    const int32_t rc = moecache_check_routing(rparams, mc->n_expert_used);
    if (rc == MOECACHE_OK) {
        if ((rparams.policy == MOECACHE_POLICY_TOPK) != (mc->rparams.policy == MOECACHE_POLICY_TOPK)) {
            moecache_graph_mark_dirty(mc); // top-k is counted after the graph where the cache only counts
        }
        mc->rparams = rparams;
    }
    return rc;
}

struct moecache_routing_params moecache_get_routing(const struct moecache * mc) {
    return mc->rparams;
}

int32_t moecache_set_prior_delta(struct moecache * mc, const float * delta, int32_t n) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (n < 0 || n > mc->n_layer || (n > 0 && !delta)) {
        return fail(MOECACHE_ERR_INVALID, "prior delta: need at most one value per layer");
    }
    for (int32_t il = 0; il < mc->n_layer; il++) {
        const float d = (delta && il < n) ? delta[il] : 0.0f;
        mc->layers[il].delta_fixed = (d > 0.0f && std::isfinite(d)) ? d : 0.0f;
    }
    return MOECACHE_OK;
}

int32_t moecache_set_prior_scale(struct moecache * mc, const float * scale, int32_t n) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (n < 0 || n > mc->n_layer || (n > 0 && !scale)) {
        return fail(MOECACHE_ERR_INVALID, "prior scale: need at most one value per layer");
    }
    for (int32_t il = 0; il < n; il++) {
        if (!(scale[il] >= 0.0f) || !std::isfinite(scale[il])) {
            return fail(MOECACHE_ERR_INVALID, "prior scale: every value must be finite and >= 0");
        }
    }
    for (int32_t il = 0; il < mc->n_layer; il++) {
        mc->layers[il].prior_scale = (scale && il < n) ? scale[il] : 1.0f;
    }
    return MOECACHE_OK;
}

void moecache_reset_stats(struct moecache * mc) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    for (moecache_layer & L : mc->layers) {
        L.st = {};
        // lifetimes restart now for the experts still cached
        for (int64_t & t : L.inserted_at) {
            t = 0;
        }
    }
    mc->trace_total = 0;
    mc->rst = {};
    mc->step_hits.clear();
    mc->step_misses.clear();
    if (mc->res.io) {
        std::lock_guard<std::mutex> lock(mc->res.io->mu);
        mc->res.io->bytes_demand   = 0;
        mc->res.io->bytes_prefetch = 0;
        mc->res.io->read_busy_us   = 0;
        mc->res.io->reads_since    = moecache_time_us(); // (reads running now count from here)
    }
    mc->t_route_decode_us = 0;
    mc->t_io_decode_us    = 0;
    mc->t_io_prompt_us    = 0;
    mc->t_vram_copy_us    = 0;
    for (moecache_layer & L : mc->layers) {
        L.decode_tokens = 0;
        L.decode_steps  = 0;
    }
}

extern "C" void moecache_begin_request(struct moecache * mc) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (mc) {
        moecache_profile_begin_request(*mc);
    }
}

void moecache_clear(struct moecache * mc) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc) {
        return;
    }
    moecache_graph_wait(*mc); // (its slots are emptied and refilled: not under a graph still running)
    for (moecache_layer & L : mc->layers) {
        moecache_layer_empty(L); // the entries leaving now end their lifetimes here
        moecache_layer_clear(L);
    }
    moecache_residency_clear(*mc); // and no expert's bytes stay: a cleared cache reads as a fresh one
    moecache_residency_hold_all(*mc); // (but for the layers whose slots hold every expert, as a fresh cache's)
    std::fill(mc->prof.req_counts.begin(), mc->prof.req_counts.end(), 0.0f); // the profile of past requests stays
}

int32_t moecache_set_eviction(struct moecache * mc, enum moecache_eviction eviction, float decay) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc) {
        return fail(MOECACHE_ERR_INVALID, "moecache_set_eviction: NULL moecache");
    }
    const int32_t rc = moecache_check_eviction(eviction, decay);
    if (rc == MOECACHE_OK) {
        mc->cparams.eviction       = eviction;
        mc->cparams.eviction_decay = decay;
    }
    return rc;
}

enum moecache_eviction moecache_get_eviction(const struct moecache * mc) {
    return mc->cparams.eviction;
}

int32_t moecache_n_layer(const struct moecache * mc) {
    return mc->n_layer;
}

int32_t moecache_get_layer_stats(const struct moecache * mc, int32_t il, struct moecache_layer_stats * out) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (il < 0 || il >= mc->n_layer || !out) {
        return fail(MOECACHE_ERR_INVALID, "layer index out of range");
    }
    const moecache_layer & L = mc->layers[il];
    *out = L.st;
    out->n_expert      = L.seen ? mc->n_expert : 0; // 0: a dense layer, or one that has not routed a token yet
    out->n_expert_used = mc->n_expert_used;
    out->capacity      = L.capacity;
    out->occupancy     = L.occupancy;
    out->delta         = (float) moecache_layer_delta(L);
    out->pinned        = L.use.n_pinned;
    // entries resident now count with their age so far
    for (size_t e = 0; e < L.last_use.size(); e++) {
        if (L.last_use[e] >= 0) {
            out->lifetime_sum   += (double) (L.st.tokens - L.inserted_at[e]);
            out->lifetime_count += 1;
        }
    }
    return MOECACHE_OK;
}

int32_t moecache_get_stats(const struct moecache * mc, struct moecache_stats * out) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!out) {
        return fail(MOECACHE_ERR_INVALID, "out is NULL");
    }
    *out = {};
    out->n_layer = mc->n_layer;
    moecache_layer_stats & t = out->total;
    for (int32_t il = 0; il < mc->n_layer; il++) {
        moecache_layer_stats ls;
        moecache_get_layer_stats(mc, il, &ls);
        if (ls.n_expert == 0) {
            continue;
        }
        if (out->n_moe_layer++ == 0) {
            t.n_expert      = ls.n_expert;
            t.n_expert_used = ls.n_expert_used;
            t.capacity      = ls.capacity;
        }
        t.occupancy      += ls.occupancy;
        t.tokens         += ls.tokens;
        t.selections     += ls.selections;
        t.hits           += ls.hits;
        t.misses         += ls.misses;
        t.evictions      += ls.evictions;
        t.lifetime_count += ls.lifetime_count;
        t.lifetime_sum   += ls.lifetime_sum;
        t.pinned         += ls.pinned;
        t.pinned_hits    += ls.pinned_hits;
        t.rerouted       += ls.rerouted;
        t.p_given_up     += ls.p_given_up;
        t.delta          += ls.delta;
    }
    if (out->n_moe_layer > 0) {
        t.delta /= (float) out->n_moe_layer; // mean Delta over layers
    }
    return MOECACHE_OK;
}

// the experts with a stamp >= 0, least recently used (smallest stamp) first
static int32_t held_by_recency(const std::vector<int64_t> & stamp, int32_t * ids, int32_t cap) {
    std::vector<std::pair<int64_t, int32_t>> v;
    for (int32_t e = 0; e < (int32_t) stamp.size(); e++) {
        if (stamp[e] >= 0) {
            v.emplace_back(stamp[e], e);
        }
    }
    std::sort(v.begin(), v.end());
    for (int32_t i = 0; i < (int32_t) v.size() && i < cap; i++) {
        ids[i] = v[i].second;
    }
    return (int32_t) v.size();
}

int32_t moecache_get_cached(const struct moecache * mc, int32_t il, int32_t * ids, int32_t cap) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (il < 0 || il >= mc->n_layer) {
        return fail(MOECACHE_ERR_INVALID, "layer index out of range");
    }
    return held_by_recency(mc->layers[il].last_use, ids, cap);
}

int32_t moecache_get_vram_cached(const struct moecache * mc, int32_t il, int32_t * ids, int32_t cap) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (il < 0 || il >= mc->n_layer) {
        return fail(MOECACHE_ERR_INVALID, "layer index out of range");
    }
    return held_by_recency(mc->layers[il].vram.stamp, ids, cap);
}

int32_t moecache_get_router_record(const struct moecache * mc, int32_t il, float * logits, float * probs,
                                   float * scores, int32_t cap, bool * rank_on_logits) {
    if (!mc || il < 0 || il >= mc->n_layer || cap < 0) {
        return fail(MOECACHE_ERR_INVALID, "moecache_get_router_record: layer out of range or cap < 0");
    }
    const moecache_layer & L = mc->layers[il];
    const size_t N = (size_t) mc->n_expert;
    float * out[3] = { logits, probs, scores };
    for (int32_t t = 0; t < std::min(cap, L.n_rec); t++) {
        for (int k = 0; k < 3; k++) {
            if (out[k]) {
                memcpy(out[k] + t * N, &L.router_rec[(t * 3 + k) * N], N * sizeof(float));
            }
        }
    }
    if (rank_on_logits) {
        *rank_on_logits = L.graph.rank_on_logits;
    }
    return L.n_rec;
}

int32_t moecache_get_router_input(const struct moecache * mc, int32_t il, float * x, int32_t cap, int32_t * n_embd) {
    if (!mc || il < 0 || il >= mc->n_layer || cap < 0) {
        return fail(MOECACHE_ERR_INVALID, "moecache_get_router_input: layer out of range or cap < 0");
    }
    const moecache_layer & L = mc->layers[il];
    const int32_t n = L.n_embd_in > 0 ? L.n_rec : 0;
    if (x && n > 0) {
        memcpy(x, L.router_in.data(), (size_t) std::min(cap, n) * (size_t) L.n_embd_in * sizeof(float));
    }
    if (n_embd) {
        *n_embd = L.n_embd_in;
    }
    return n;
}

int32_t moecache_set_predictor(struct moecache * mc, int32_t il, const float * w, int32_t n_embd) {
    if (!mc || il < 0 || il >= mc->n_layer) {
        return fail(MOECACHE_ERR_INVALID, "moecache_set_predictor: layer out of range");
    }
    return moecache_ahead_set_predictor(*mc, il, w, n_embd);
}

int32_t moecache_get_trace(const struct moecache * mc, struct moecache_trace_record * out, int32_t cap) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    const int64_t size = (int64_t) mc->trace.size();
    if (size == 0 || cap <= 0) {
        return 0;
    }
    const int64_t n     = std::min<int64_t>({mc->trace_total, size, (int64_t) cap});
    const int64_t first = mc->trace_total - std::min(mc->trace_total, size); // oldest kept record
    for (int64_t i = 0; i < n; i++) {
        out[i] = mc->trace[(first + i) % size];
    }
    return (int32_t) n;
}

static int32_t route_rows(struct moecache * mc, int32_t il, const float * logits, const float * probs,
                          const float * scores, int32_t n_expert, int32_t n_expert_used, int32_t n_tokens,
                          bool rank_on_logits, int32_t * selected, int8_t * hits, bool step) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (il < 0 || il >= mc->n_layer) {
        return fail(MOECACHE_ERR_INVALID, "layer index out of range");
    }
    if (n_expert != mc->n_expert || n_expert_used != mc->n_expert_used) {
        return fail(MOECACHE_ERR_INVALID, "n_expert / n_expert_used differ from the moecache's model");
    }
    if (n_tokens < 0 || !logits || !probs || !selected) {
        return fail(MOECACHE_ERR_INVALID, "moecache_route: bad arguments");
    }
    moecache_layer & L = mc->layers[il];
    L.graph.rank_on_logits = rank_on_logits;
    int8_t hit_tmp[MOECACHE_MAX_USED];
    const moecache_routing_params rp = mc->rparams;
    const bool share = step && moecache_route_shares(rp, n_tokens);
    const moecache_routing_params rs = share ? moecache_route_share_params(rp) : rp;
    if (share) {
        std::vector<const float *> zr(n_tokens), pr(n_tokens), sr(n_tokens);
        for (int32_t t = 0; t < n_tokens; t++) {
            const size_t row = (size_t) t * n_expert;
            zr[t] = logits + row;
            pr[t] = probs + row;
            sr[t] = (scores ? scores : probs) + row;
        }
        moecache_route_share_first(*mc, L, rs, n_tokens, zr.data(), pr.data(), sr.data(), nullptr);
    }
    for (int32_t t = 0; t < n_tokens; t++) {
        const size_t row = (size_t) t * n_expert;
        int8_t * h = hits ? hits + (size_t) t * n_expert_used : hit_tmp;
        if (share) {
            moecache_route_share_token(*mc, L, t);
        }
        moecache_route_token(*mc, L, rs, logits + row, probs + row, (scores ? scores : probs) + row,
                             nullptr, true, true, selected + (size_t) t * n_expert_used, h);
    }
    moecache_route_share_end(L);
    return MOECACHE_OK;
}

int32_t moecache_route(struct moecache * mc, int32_t il, const float * logits, const float * probs,
                       const float * scores, int32_t n_expert, int32_t n_expert_used, int32_t n_tokens,
                       bool rank_on_logits, int32_t * selected, int8_t * hits) {
    return route_rows(mc, il, logits, probs, scores, n_expert, n_expert_used, n_tokens, rank_on_logits, selected,
                      hits, false);
}

int32_t moecache_route_step(struct moecache * mc, int32_t il, const float * logits, const float * probs,
                            const float * scores, int32_t n_expert, int32_t n_expert_used, int32_t n_tokens,
                            bool rank_on_logits, int32_t * selected, int8_t * hits) {
    return route_rows(mc, il, logits, probs, scores, n_expert, n_expert_used, n_tokens, rank_on_logits, selected,
                      hits, true);
}

} // extern "C"

// ---------------------------------------------------------------------------------------------
// state files (the format and its checks: moecache-state.cpp)

extern "C" int32_t moecache_state_save(const struct moecache * mc, const char * path) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc || !path) {
        return fail(MOECACHE_ERR_INVALID, "moecache_state_save: NULL argument");
    }
    try {
        return moecache_state_write(*mc, path);
    } catch (const std::exception & e) {
        return fail(MOECACHE_ERR_NO_MEMORY, std::string("moecache_state_save: ") + e.what());
    }
}

extern "C" int32_t moecache_state_load(struct moecache * mc, const char * path) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc || !path) {
        return fail(MOECACHE_ERR_INVALID, "moecache_state_load: NULL argument");
    }
    moecache_graph_wait(*mc); // (the slots are refilled: not under a graph still running)
    try {
        const int32_t rc = moecache_state_read(*mc, path);
        if (rc == MOECACHE_OK) {
            moecache_residency_hold_all(*mc); // (a state saved with a smaller cache: the slots still hold every expert)
        }
        return rc;
    } catch (const std::exception & e) {
        return fail(MOECACHE_ERR_NO_MEMORY, std::string("moecache_state_load: ") + e.what());
    }
}

extern "C" int32_t moecache_profile_save(const struct moecache * mc, const char * path) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc || !path) {
        return fail(MOECACHE_ERR_INVALID, "moecache_profile_save: NULL argument");
    }
    try {
        return moecache_profile_write(*mc, path);
    } catch (const std::exception & e) {
        return fail(MOECACHE_ERR_NO_MEMORY, std::string("moecache_profile_save: ") + e.what());
    }
}

extern "C" int32_t moecache_profile_load(struct moecache * mc, const char * path) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc || !path) {
        return fail(MOECACHE_ERR_INVALID, "moecache_profile_load: NULL argument");
    }
    try {
        return moecache_profile_read(*mc, path);
    } catch (const std::exception & e) {
        return fail(MOECACHE_ERR_NO_MEMORY, std::string("moecache_profile_load: ") + e.what());
    }
}

extern "C" int32_t moecache_profile_get(const struct moecache * mc, int32_t il, double * counts, int32_t n) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc || !counts || il < 0 || il >= mc->n_layer || n < mc->n_expert) {
        return fail(MOECACHE_ERR_INVALID, "moecache_profile_get: layer out of range or counts shorter than N");
    }
    for (int32_t e = 0; e < mc->n_expert; e++) {
        counts[e] = mc->prof.counts.empty() ? 0.0 : mc->prof.counts[(size_t) il * mc->n_expert + e];
    }
    return MOECACHE_OK;
}

extern "C" int32_t moecache_profile_warm(struct moecache * mc, int32_t n_pin) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc) {
        return fail(MOECACHE_ERR_INVALID, "moecache_profile_warm: NULL moecache");
    }
    moecache_graph_wait(*mc); // (the slots and the VRAM tier are refilled: not under a graph still running)
    const int32_t pinned = moecache_profile_warm_start(*mc, n_pin);
    if (pinned >= 0) {
        moecache_residency_hold_all(*mc); // (a layer whose slots hold every expert caches them all: none is evicted)
        if (!moecache_vram_warm(*mc)) { // (and the VRAM tier's device slots with the hottest of each layer)
            return MOECACHE_ERR_IO;
        }
    }
    return pinned;
}

// ---------------------------------------------------------------------------------------------
// attach / detach (the context registry is in moecache-graph.cpp)

extern "C" int32_t moecache_attach(struct moecache * mc, struct llama_context * ctx) {
    if (!mc || !ctx) {
        return fail(MOECACHE_ERR_INVALID, "moecache_attach: NULL argument");
    }
    return moecache_graph_attach(mc, ctx);
}

extern "C" void moecache_detach(struct moecache * mc) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (mc) {
        moecache_hook_detach(mc);
    }
}

extern "C" void moecache_set_load_residency(enum moecache_residency residency) {
    moecache_graph_set_load_residency(residency);
}

// ---------------------------------------------------------------------------------------------
// residency telemetry and errors (moecache-residency.cpp)

static int64_t rss_bytes() {
#ifdef __linux__
    FILE * f = fopen("/proc/self/statm", "r");
    if (!f) {
        return 0;
    }
    long long pages_total = 0, pages_rss = 0;
    const int n = fscanf(f, "%lld %lld", &pages_total, &pages_rss);
    fclose(f);
    return n == 2 ? (int64_t) pages_rss * (int64_t) moecache_page_size() : 0;
#else
    return 0;
#endif
}

extern "C" int32_t moecache_get_step_rows(const struct moecache * mc, int32_t * hits, int32_t * misses, int32_t n_max) {
    moecache_device_flush_c(mc); // (a step counted after its graph: counted before this)
    if (!mc || n_max < 0 || (n_max > 0 && (!hits || !misses))) {
        return fail(MOECACHE_ERR_INVALID, "moecache_get_step_rows: bad arguments");
    }
    moecache * m = const_cast<moecache *>(mc); // (read and started over: counters, not the cache)
    const int32_t n = (int32_t) m->step_hits.size();
    for (int32_t i = 0; i < n && i < n_max; i++) {
        hits[i]   = (int32_t) std::min<int64_t>(m->step_hits[i], INT32_MAX);
        misses[i] = (int32_t) std::min<int64_t>(m->step_misses[i], INT32_MAX);
    }
    std::fill(m->step_hits.begin(), m->step_hits.end(), 0);
    std::fill(m->step_misses.begin(), m->step_misses.end(), 0);
    return n;
}

extern "C" int32_t moecache_get_residency_stats(const struct moecache * mc, struct moecache_residency_stats * out) {
    moecache_device_flush_c(mc); // (a token counted after its graph: counted before this)
    if (!mc || !out) {
        moecache_set_error("moecache_get_residency_stats: NULL argument");
        return MOECACHE_ERR_INVALID;
    }
    *out = mc->rst;
    out->residency   = mc->cparams.residency;
    out->arena_bytes = (int64_t) (mc->res.arena_size - mc->res.arena_shared);
    for (const moecache_layer & L : mc->layers) {
        if (!L.res.xt.empty()) {
            out->expert_bytes = (int64_t) moecache_slot_bytes(L); // the first MoE layer's (the companion's: SOURCE)
            break;
        }
    }
    out->io_threads = mc->res.io ? (int32_t) mc->res.io->workers.size() : 0;
    out->direct_io  = mc->res.io && mc->res.io->fd_direct >= 0;
    out->locked     = mc->cparams.lock_memory &&
                      (mc->cparams.residency == MOECACHE_RESIDENCY_STREAM ? mc->res.arena_locked
                                                                          : (mc->res.io && !mc->res.io->lock_failed.load()));
    out->decode_t_io_ms    = (double) mc->t_io_decode_us / 1000.0;
    out->decode_t_route_ms = (double) mc->t_route_decode_us / 1000.0;
    out->prompt_t_io_ms    = (double) mc->t_io_prompt_us / 1000.0;
    out->load_bytes_read   = mc->load_bytes;
    out->load_t_io_ms      = (double) mc->t_io_load_us / 1000.0;
    out->vram_bytes        = moecache_vram_bytes(*mc);
    out->vram_pinned_bytes = mc->res.arena_pinned;
    out->lowbit_bytes      = moecache_lowbit_bytes(*mc);
    out->lowbit            = mc->cparams.residency == MOECACHE_RESIDENCY_STREAM ? (int32_t) mc->cparams.lowbit : 0;
    out->vram_t_copy_ms    = (double) mc->t_vram_copy_us / 1000.0;
    out->unified_bytes     = moecache_unified_bytes(*mc, &out->unified_layers);
    moecache_vram_direct_stats(*mc, out);
    out->vram_slots            = 0;
    out->vram_exclusive_layers = 0;
    for (const moecache_layer & L : mc->layers) {
        out->vram_slots             = std::max(out->vram_slots, L.vram.n);
        out->vram_exclusive_layers += L.vram.exclusive ? 1 : 0;
    }
    int64_t decode_tokens = 0, decode_steps = 0;
    int64_t locked = 0;
    for (const moecache_layer & L : mc->layers) {
        decode_tokens = std::max(decode_tokens, L.decode_tokens);
        decode_steps  = std::max(decode_steps, L.decode_steps);
        for (uint8_t l : L.res.locked) {
            locked += l ? (int64_t) L.res.expert_bytes : 0;
        }
    }
    out->decode_tokens = decode_tokens;
    out->decode_steps  = decode_steps;
    if (mc->res.io && mc->cparams.residency == MOECACHE_RESIDENCY_STREAM) { // decode reads run on the reader threads
        moecache_io_counters(*mc->res.io, &out->demand_bytes_read, &out->prefetch_bytes_read);
        out->decode_bytes_read = out->demand_bytes_read + out->prefetch_bytes_read;
        std::lock_guard<std::mutex> lock(mc->res.io->mu);
        int64_t busy = mc->res.io->read_busy_us;
        if (mc->res.io->reads_running > 0) {
            busy += moecache_time_us() - mc->res.io->reads_since;
        }
        out->decode_t_read_ms = (double) busy / 1000.0;
    }
    const int64_t lent = moecache_slots_lent_bytes(*mc, 0, mc->n_layer, true); // (to a prompt, until a decode)
    out->locked_bytes  = mc->res.arena_locked ? (int64_t) mc->res.arena_size - lent : (out->locked ? locked : 0);
    out->dense_locked_bytes = mc->res.dense_locked;
    out->rss_bytes     = rss_bytes();
    return MOECACHE_OK;
}

extern "C" const char * moecache_take_io_error(struct moecache * mc) {
    static thread_local std::string msg;
    if (!mc || !mc->io_failed.load()) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(mc->io_error_mutex);
    msg = mc->io_error;
    mc->io_error.clear();
    mc->io_failed.store(false);
    return msg.c_str();
}
