// moecache-impl.h - struct moecache, the state of one expert cache, made of its layers (moecache-layer.h), its
// usage profile (moecache-profile.h), its reads ahead (moecache-ahead.h), its residency's files and arena
// (moecache-residency.h) and its device path (moecache-device.h), with the small helpers every file of
// src_cpp/ uses; it includes the header of each concept, so a file of src_cpp/ includes this one: the routing
// (moecache-route.h), the graph (moecache-graph.h), the VRAM tier (moecache-vram.h), the files
// (moecache-files.h), the reader threads (moecache-io.h). Not installed.
#pragma once

#include "moecache-layer.h"
#include "moecache-ahead.h"
#include "moecache-device.h"
#include "moecache-profile.h"
#include "moecache-residency.h"
#include "moecache-vram-direct.h"

#include <algorithm>
#include <vector>

struct moecache {
    // model identity (for state files) and shape
    std::string desc;
    uint64_t    n_params      = 0;
    int32_t     n_layer       = 0;
    int32_t     n_expert      = 0; // N
    int32_t     n_expert_used = 0; // K

    struct moecache_cache_params   cparams = {};
    struct moecache_routing_params rparams = {};

    std::vector<moecache_layer> layers; // [n_layer], never resized after init (ops keep pointers)

    moecache_profile prof;  // the usage profile and the request traces (moecache-profile.h)
    moecache_ahead   ahead; // reads ahead: predictors, a prompt's read-ahead, the trial (moecache-ahead.h)

    struct llama_context * ctx = nullptr; // attached context
    const struct llama_model * model = nullptr; // the model (nullptr for a synthetic moecache)

    // trace ring buffer
    std::vector<moecache_trace_record> trace;
    int64_t trace_total = 0; // records ever written; the newest is at (trace_total - 1) % capacity

    moecache_residency_state res; // the files, the reader threads, the slot arena, the locks (moecache-residency.h)
    int32_t prompt_il_last = -1;               // the layer of the last prompt sync, -1 after a decode
    int64_t build_n_ubatch = 0;                // graph build: tokens the first MoE layer routes (0 before it)
    bool    build_decode   = false;            // graph build: the ubatch decodes (moecache_graph_decodes)
    std::vector<int64_t> step_hits, step_misses; // hits and misses per row of the decode steps since the last
                                                 // moecache_get_step_rows, over layers (a step of another
                                                 // number of rows starts them over)
    int32_t first_routed   = -1;               // the first layer the routing hook saw (a decoded token starts there)
    moecache_vram_direct vdir;                 // the direct tier: a token's layer on the device alone
    moecache_device dev;                       // residency NONE, top-k: routing counted after the graph
    struct moecache_residency_stats rst = {};  // counters only; the other fields are derived on read
    int64_t t_route_decode_us = 0;
    int64_t t_io_decode_us    = 0;
    int64_t t_io_prompt_us    = 0;
    int64_t t_vram_copy_us    = 0;             // VRAM tier: time spent copying up
    double  vram_us_per_byte  = 0.0;           //   measured: a copy's time per byte (0 = not yet)
    int64_t vram_acks         = 0;             //   copies up ended on a device whose sends do not wait (RPC)
    double  vram_cpu_us       = 0.0;           //   measured: one expert's matmuls on the CPU (0 = not yet)
    int64_t load_bytes        = 0;             // read by moecache_slots_fill_all (moecache_residency_stats)
    int64_t t_io_load_us      = 0;
    mutable moecache_timeline timeline;       // moecache_timeline_start; the reader threads record into it too
    std::atomic<bool> io_failed{false};       // a read failed: the abort callback stops the graph
    std::mutex        io_error_mutex;
    std::string       io_error;
};

// the median of token times (us; 0 for none): the trials' measure (prefetch_adaptive, the direct tier)
inline int64_t moecache_median_us(std::vector<int64_t> v) {
    if (v.empty()) {
        return 0;
    }
    std::nth_element(v.begin(), v.begin() + (std::ptrdiff_t) (v.size() / 2), v.end());
    return v[v.size() / 2];
}

// prefetch_route in effect: reads ahead into spare slots that do not follow the clock (no adaptive
// trial, whose timing the routing must not follow), which the prior counts as cached: moecache-ahead.cpp marks
// them (L.pf.ahead), moecache-route.cpp reads the marks
inline bool moecache_counts_ahead(const moecache & mc) {
    const moecache_cache_params & cp = mc.cparams;
    return cp.prefetch_route && cp.prefetch != MOECACHE_PREFETCH_OFF && cp.prefetch_spare > 0 && !cp.prefetch_adaptive &&
           cp.residency == MOECACHE_RESIDENCY_STREAM;
}

// prefetch_budget in effect: reads ahead into spare slots, no adaptive trial, a budget (L.pf.credit)
inline bool moecache_budgets_ahead(const moecache & mc) {
    const moecache_cache_params & cp = mc.cparams;
    return cp.prefetch_spare > 0 && !cp.prefetch_adaptive && cp.prefetch_budget >= 0.0f;
}

// the layer's cache holds every expert and a VRAM tier holds some: the routing prefers the tier's
// (or, exclusive, the two tiers together can hold every expert)
inline bool moecache_layer_routes_to_vram(const moecache_layer & L) {
    return L.vram.n > 0 && (L.res.all_in_slots || (L.vram.exclusive && L.capacity + L.vram.n >= (int32_t) L.last_use.size()));
}

// bytes of one expert as the slots hold it, over all of L's expert tensors: the model's (expert_bytes),
// or with lowbit SOURCE the companion's copy
inline size_t moecache_slot_bytes(const moecache_layer & L) {
    size_t bytes = 0;
    for (const moecache_expert_tensor & x : L.res.xt) {
        bytes += x.src_nb2;
    }
    return bytes;
}

// Delta_l the prior uses now: the calibrated value, else the running mean (0 before any token)
inline double moecache_layer_delta(const moecache_layer & L) {
    if (L.delta_fixed > 0.0f) {
        return L.delta_fixed;
    }
    return L.delta_n > 0 ? L.delta_sum / (double) L.delta_n : 0.0;
}

// the prior's boost of a cached expert at this layer: lambda * scale_l * Delta_l, rounded once to float
inline float moecache_layer_boost(const moecache_layer & L, float lambda) {
    return (float) ((double) lambda * (double) L.prior_scale * moecache_layer_delta(L));
}

// an event of the graph thread (thread 0) on the timeline, when one is being recorded
inline void moecache_graph_event(moecache & mc, moecache_event_kind kind, int32_t il, int32_t e, int32_t n_tokens,
                                 int64_t t_queued, int64_t t_start, int64_t t_end, int64_t bytes = 0) {
    if (mc.timeline.on.load(std::memory_order_relaxed)) {
        moecache_event ev = {};
        ev.kind        = kind;
        ev.layer       = il;
        ev.expert      = e;
        ev.n_tokens    = n_tokens;
        ev.t_queued_us = t_queued;
        ev.t_start_us  = t_start;
        ev.t_end_us    = t_end;
        ev.bytes       = bytes;
        moecache_timeline_add(&mc.timeline, ev);
    }
}

// moecache.cpp
void moecache_set_error(const std::string & msg);
// moecache-init.cpp: the checks of moecache.h's parameters and the constructors
int32_t    moecache_check_routing(const moecache_routing_params & p, int32_t K);
int32_t    moecache_check_eviction(enum moecache_eviction eviction, float decay);
moecache * moecache_new_shape(int32_t n_layer, int32_t N, int32_t K, moecache_cache_params cp,
                              moecache_routing_params rp);
moecache * moecache_new(const llama_model * model, moecache_cache_params cparams, moecache_routing_params rparams);

#include "moecache-files.h"
#include "moecache-graph.h"
#include "moecache-route.h"
#include "moecache-vram.h"
