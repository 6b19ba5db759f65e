// moecache-impl.h - struct moecache, the state of one expert cache, made of its layers (moecache-layer.h) and
// its device path (moecache-device.h), with the small helpers every file of src_cpp/ uses; it includes the
// header of each concept, so a file of src_cpp/ includes this one: the routing (moecache-route.h), the graph
// (moecache-graph.h), the residencies (moecache-residency.h), the VRAM tier (moecache-vram.h), the files
// (moecache-files.h), the reader threads (moecache-io.h). Not installed.
#pragma once

#include "moecache-layer.h"
#include "moecache-device.h"

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

    // moecache-profile.cpp: expert counts of the current request, [n_layer * N] (ACTIVATION eviction,
    // PREFETCH_TRACE), and of every past request (the usage profile); the trace store: past requests,
    // each normalized per layer; the best match of the current token, -1 = none
    std::vector<float>              req_counts;
    std::vector<double>             profile_counts;
    std::vector<float>              req_share;  // req_counts, each row scaled to sum 1 (scratch)
    std::vector<std::vector<float>> trace_store;
    int32_t                         trace_best = -1;
    int32_t                         trace_best_layer = -1; // the layer the match was made at

    // GATE prefetch: fitted predictors (moecache_set_predictor), [n_layer] tensors [n_embd, N] in their own
    // CPU buffer, used in place of a layer's router to predict it; nullptr = its router
    ggml_context *               pred_ctx = nullptr;
    ggml_backend_buffer *        pred_buf = nullptr;
    std::vector<ggml_tensor *>   pred_w;
    std::vector<uint8_t>         pred_on;

    struct llama_context * ctx = nullptr; // attached context
    const struct llama_model * model = nullptr; // the model (nullptr for a synthetic moecache)

    // trace ring buffer
    std::vector<moecache_trace_record> trace;
    int64_t trace_total = 0; // records ever written; the newest is at (trace_total - 1) % capacity

    // residency (moecache-residency.cpp)
    std::string   path;                       // the GGUF
    std::string   src_path;                   // STREAM: the file the slots are read from (path, or the companion)
    int           fd        = -1;             // buffered reads, fadvise
    int           fd_direct = -1;             // O_DIRECT reads, or -1
    int           fd_lowbit = -1;             // the low-bit companion (cache params lowbit), or -1
    int           fd_lowbit_direct = -1;      //   and with O_DIRECT (cache params direct_io), or -1
    moecache_io * io        = nullptr;        // reader threads
    char *        arena     = nullptr;        // STREAM: all layers' slots, one anonymous mapping
    size_t        arena_size = 0;
    bool          arena_locked = false;
    void       (* arena_unpin)(void *) = nullptr; // the VRAM tier's device unregisters the arena with it (pinned)
    int64_t       arena_pinned = 0;           //   bytes of the arena registered with that device for its DMA
    struct ggml_backend_buffer * down_stage = nullptr; // exclusive tiers with a copier: pinned host memory
                                              //   for one token's moves down of a layer (K experts)
    int32_t       down_stage_layer = -1;      //   the layer whose moves down it holds until they settle, or -1
    const struct llama_model * dense_model = nullptr; // lock_dense: the model whose dense part this holds locked
    int64_t       dense_locked = 0;           //   bytes of it mlocked (shared with other moecaches on the model)
    ggml_context * slots_ctx = nullptr;       // STREAM: the slot tensors (no data of their own)
    ggml_backend_buffer * slots_buf = nullptr;//   wraps the arena for the CPU backend
    std::unordered_map<const ggml_tensor *, int32_t> xt_layer; // model expert tensor -> layer
    std::vector<std::pair<int32_t, int32_t>> drop_pending; // (layer, expert) read through the mapping, to drop
                                                           //   once that layer ran
    std::vector<moecache_io_req> ahead_req;    // [n_layer] a prompt's read-ahead of a layer, on the reader threads
    int32_t ahead_last = -1;                   // the last layer read ahead in this ubatch, or -1
    int32_t prompt_il_last = -1;               // the layer of the last prompt sync, -1 after a decode
    int64_t build_n_ubatch = 0;                // graph build: tokens the first MoE layer routes (0 before it)
    bool    build_decode   = false;            // graph build: the ubatch decodes (moecache_graph_decodes)
    std::vector<int64_t> step_hits, step_misses; // hits and misses per row of the decode steps since the last
                                                 // moecache_get_step_rows, over layers (a step of another
                                                 // number of rows starts them over)
    int32_t first_routed   = -1;               // the first layer the routing hook saw (a decoded token starts there)
    struct {                                   // prefetch_adaptive: the on/off trial (moecache-graph.cpp)
        bool    on      = true;                //   reads ahead are issued for this token
        int32_t phase   = 0;                   //   0: the trial (on and off in turn), 1: running the winner
        int32_t left    = 0;                   //   tokens left in this phase (0: not started)
        int64_t t_last  = 0;                   //   when the previous decoded token started (us), 0 = none
        std::vector<int64_t> dt_on, dt_off;    //   token times of the trial's two sides (us)
    } spec_ctl;
    struct {                                   // prefetch_spare: reads decided by a layer's routing, queued by
        int32_t target = -1;                   //   its residency op after its own reads (target layer, or -1)
        int32_t n      = 0;
        int32_t ids[MOECACHE_MAX_USED];
        float   score[MOECACHE_MAX_USED];
    } spec_pending;
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
#include "moecache-residency.h"
#include "moecache-route.h"
#include "moecache-vram.h"
