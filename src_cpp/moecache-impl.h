// moecache-impl.h - internal state shared by the files of src_cpp/: moecache.cpp (the C API),
// moecache-init.cpp (parameters, construction), moecache-route.cpp (routing policies),
// moecache-cache.cpp (one layer's cache: insertion, eviction policies, prefetch insertion),
// moecache-profile.cpp (request counts, the usage profile and its files, the trace store),
// moecache-graph.cpp (ggml ops called from llama.cpp), moecache-residency.cpp (slots, page
// locks), moecache-io.{h,cpp} (reader threads), moecache-state.cpp (state files). Not installed.
#pragma once

#include "moecache.h"
#include "moecache-io.h"

#include "ggml.h" // enum ggml_type
#include "ggml-backend.h" // the device path's buffers (moecache_device)

#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct ggml_backend_buffer;
struct ggml_backend;

// largest K (experts per token) the graph op handles
#define MOECACHE_MAX_USED 64

// the smallest expert tensor (bytes of one expert) whose slots get a page of padding so that its
// reads land in place: the padding is at most 1/16 of the slot
#define MOECACHE_IN_PLACE_MIN (16 * 4096)

// one routed-expert weight tensor of a layer, [ne0, ne1, N]: expert e is bytes [e * nb2, (e + 1) * nb2)
struct moecache_expert_tensor {
    ggml_tensor * model_t  = nullptr;  // the model's tensor; its data is the file mapping
    ggml_tensor * slots_t  = nullptr;  // STREAM: src_type, the same rows, ne[2] = n_slots, data in the arena
    uint64_t      file_off = 0;        // file offset of expert 0
    size_t        nb2      = 0;        // bytes of one expert
    // STREAM: what the slots hold and where the reader threads read it (moecache_io::fd): the model's
    // tensor (its type, file_off, nb2), or with lowbit SOURCE the companion's copy (moecache-lowbit.cpp)
    ggml_type     src_type = GGML_TYPE_COUNT;
    uint64_t      src_off  = 0;        // file offset of expert 0 in that file
    size_t        src_nb2  = 0;        // bytes of one expert there
    // STREAM: slot s's bytes start at slots_t->data + s * slot_nb2. Where src_nb2 is a whole number of
    // pages (at least MOECACHE_IN_PLACE_MIN) but the file's experts start mid-page, each slot starts
    // slot_head = src_off % 4096 bytes into its own pages (slot_nb2 = src_nb2 + 4096): the aligned
    // window around an expert in the file is read straight into those pages (direct I/O), with no
    // bounce buffer and no copy. pymoecache/model_info.py (slot_bytes) sizes caches the same way.
    // Not in a layer its device computes in place (unified) where a page is not whole blocks of the
    // type: a device's kernels step from expert to expert in blocks (its reads then take a bounce buffer)
    size_t        slot_nb2  = 0;
    size_t        slot_head = 0;
};

// One MoE layer, in named parts: the cache itself (LRU, Delta, counters), the scratch of one
// routing decision, what the graph build leaves for the ops, and where the experts' bytes live.

// scratch for one token, sized n_expert at init, so routing never allocates (moecache-route.cpp)
struct moecache_layer_scratch {
    std::vector<int32_t> rank;   // r: expert ids by router rank
    std::vector<int32_t> pos;    // pos[e] = index of e in r
    std::vector<int32_t> order;  // r': final ranking
    std::vector<float>   boosted;
    std::vector<uint8_t> chosen;
    int32_t swapped_from = -1;   // set by moecache_route_token: SWAP_RANK's replaced expert, or -1
    std::vector<int32_t> step;   // batch_share: [n_expert] how many of the step's tokens select e (first pass)
    std::vector<int32_t> first;  //   [n_tokens x K] each token's first-pass selections (-1 past its count)
    std::vector<uint8_t> others; //   [n_expert] selected by another token of the step: preferred as if cached
                                 //   (empty outside a batch)
};

// set while the graph is built (graph-build thread), for the ops (moecache-graph.cpp)
struct moecache_layer_graph {
    bool          rank_on_logits = false;   // PRIOR boosts logits z (softmax without bias)
    ggml_tensor * route_out      = nullptr; // op_select's [K + 2, n_tokens]: selected, n_active, weight_from
    ggml_tensor * select_out     = nullptr; // its first K rows, what llama.cpp uses
    float         dropped_weight = 0.0f;    // weight of a dropped slot: 0, or -inf before a softmax
    ggml_tensor * ids_in         = nullptr; // residency: the ids the op below was built for
    ggml_tensor * ids_out        = nullptr; //   its output: slot ids (STREAM decode) or the ids unchanged
    ggml_tensor * arrival        = nullptr; // STREAM decode, overlap_experts: the input-side expert matmuls
    ggml_tensor * ready          = nullptr; //   and the slot ids once every read is in (moecache-matmul.cpp)
    ggml_tensor * vram_joint     = nullptr; // VRAM tier: what the device side reads from the CPU, joined (J,
    ggml_tensor * vram_joint_dev = nullptr; //   moecache-vram.cpp), and its one copy on the device
    ggml_tensor * vram_slot      = nullptr; //   the two rows of ids in it: the device slot of each selection and
    ggml_tensor * vram_row       = nullptr; //   its output row (views of the copy)
    ggml_tensor * vram_out       = nullptr; //   the experts' outputs [n_out, K, 1] (the down matmul's, J joined)
    ggml_tensor * vram_w         = nullptr; //   the weights' view of the copy [1, K, 1]
    ggml_tensor * ffn_in         = nullptr; // the router's input x (the FFN's input), where it is a plain matmul
    ggml_tensor * vram_sum[4]    = {};      //   the input-side matmuls' sums, device + CPU side,
    ggml_tensor * vram_side[4][2] = {};     //   and their two sides (0: device, 1: CPU)
    int32_t       n_vram_sum     = 0;
    ggml_tensor * low_ids        = nullptr; // low-bit misses: the pool slot of each selection (moecache-lowbit.cpp)
    ggml_tensor * x_dev          = nullptr; // a decode on a device layer with experts on the CPU: the FFN's
    ggml_tensor * x_host         = nullptr; //   input [n_embd, T] there, and its copy read with the router's
                                            //   logits in one piece (read_joint, moecache-graph.cpp)
    bool          predicts       = false;   // op_select's src[4] is layer il + d's router logits (GATE)
    int32_t       src_input      = -1;      // router_record: the index in op_select's src of the router's input
    int64_t       n_ubatch       = 0;       // tokens of the ubatch the graph is for (the first MoE layer's: the
                                            //   last layer of a prompt routes only its output rows)
    bool          decode         = false;   // the graph decodes: one token of each of n_ubatch sequences
                                            //   (moecache_graph_decodes); otherwise a prompt
};

// where the layer's experts live (moecache-residency.cpp, moecache-slots.cpp): empty for NONE and
// for layers without routed experts
struct moecache_layer_residency {
    std::vector<moecache_expert_tensor> xt;       // the layer's expert tensors: gate, up, down, gate_up
    size_t  expert_bytes = 0;          // bytes of one expert over all of xt
    int32_t n_slots      = 0;          // STREAM: max(capacity, K) slots per tensor
    bool    all_in_slots = false;      // STREAM: the cache holds all N experts, read in at creation:
                                       //   prompts compute on the slots too (moecache_slots_fill_all)
    std::vector<int32_t> slot_expert;  // [n_slots] expert whose bytes slot s holds, -1 = none
    std::vector<int32_t> expert_slot;  // [n_expert] slot holding e (valid only if slot_expert agrees)
    std::vector<uint8_t> locked;       // MMAP: [n_expert] e's pages are locked (or faulted in)
    std::vector<uint8_t> keep;         // [n_expert] scratch: cached or used by the current token
    std::unique_ptr<moecache_io_req[]> slot_req; // STREAM: [n_slots] the reads filling each slot (moecache-io.h)
};

// the VRAM tier of one layer (moecache-vram.cpp): device slots over the host slots, n = 0 where the
// layer has none. Slot n of each tensor (and host slot res.n_slots) is all zeros: a selection
// computed on the other side runs there, so the two sides' outputs add up to the CPU run's.
struct moecache_layer_vram {
    int32_t n = 0;                         // device slots per expert tensor
    struct ggml_backend_buffer_type * buft = nullptr; // the device memory of the layer's dense part
    ggml_context *              ctx = nullptr;
    struct ggml_backend_buffer * buf = nullptr;
    std::vector<ggml_tensor *>  t;         // parallel to res.xt: [ne0, ne1, n + 1] in device memory
    std::vector<int32_t> slot_expert;      // [n] expert held, -1 = none
    std::vector<int32_t> expert_slot;      // [n_expert] its slot (valid only if slot_expert agrees)
    std::vector<int64_t> stamp;            // [n_expert] held: the stamp of its last selection (larger = more
                                           //   recent); -1 = not held (the eviction policy's recency)
    std::vector<uint8_t> in_use;           // [n_expert] scratch: selected by the current token
    std::vector<uint8_t> fresh;            // [n_expert] scratch: read from the file for the current token
    int64_t              clock = 0;
    std::vector<int32_t> tok_slot;         // the current token's selections: device slot, n = on the CPU
    bool                 unacked = false;  // the device's synchronize returns before the bytes are there (RPC)
    struct ggml_backend * copier = nullptr;// a second backend of the device (its own stream): the copies up,
                                           //   queued without waiting (vram_copy ASYNC); owned by moecache
    std::vector<int32_t> copy_e, copy_hs;  // the current token's copies up: expert, host slot (parallel to
    std::vector<int32_t> copy_vs;          //   copy_vs, its device slot); sent once its read is in
    std::vector<int64_t> copy_t;           //   when each was sent (us; 0 = not, or its read failed)
    int32_t              copy_sent = 0;    // how many of them are sent
    int64_t              copy_t0   = 0;    // when the first was decided (us)
    std::vector<uint8_t> ahead;            // [n_expert] copied up ahead of the next routing (vram_ahead)
    // exclusive tiers (vram_exclusive, a layer whose host cache holds fewer than N): the experts held here
    // hold no host slot, and are in the layer's cache (last_use) beside the host's, never evicted from it
    bool                 exclusive = false;
    std::vector<uint8_t> excl;             // [n_expert] held here (exclusive)
    int32_t              n_excl = 0;       //   how many: the cache holds capacity + n_excl
    std::vector<uint8_t> keep_out;         // [n_expert] scratch: pinned or held here (the host cache's victims)
    std::vector<int32_t> down_e, down_hs;  // the current token's moves down: expert, the host slot it takes
    std::vector<char>    down_bytes;       //   their bytes, read from the device before their slot was reused
    char *               down_stage = nullptr; // the token's moves down read into moecache's pinned staging
                                           //   instead (by the copier, before the copies up), or nullptr
};

// the tokens after a low-bit miss that compute the expert from the companion too: its full copy was
// queued behind the miss, and waiting for it would put a full read back on the critical path
#define MOECACHE_LOWBIT_HOLD 1

// low-bit misses (moecache-lowbit.cpp): K slots of the companion's copies per expert tensor (or, with
// lowbit_in_ram, N: slot e holds expert e), and a zero slot; n = 0 where the layer has none
struct moecache_layer_lowbit {
    int32_t n = 0;                         // slots per expert tensor (K, or N in RAM)
    ggml_context *              ctx = nullptr;
    struct ggml_backend_buffer * buf = nullptr;
    std::vector<ggml_tensor *>  t;         // parallel to res.xt: [ne0, ne1, n + 1], the companion's type
    std::vector<ggml_type>      type;      // parallel to res.xt: the companion's type (every lowbit mode)
    std::vector<uint64_t>       off;       //   its file offset of expert 0
    std::vector<size_t>         nb2;       //   and the bytes of one expert
    std::vector<uint8_t>        fresh;     // [n_expert] scratch: 1 a miss whose full read starts now (behind the
                                           //   token), 2 one whose full read went behind the token before
    std::vector<int64_t>        hold;      // [n_expert] the last token that computes e from the companion after
                                           //   its miss (MOECACHE_LOWBIT_HOLD later), whatever its full read did
    int64_t                     tok = 0;   // decoded tokens this layer's pool served
    int32_t                     tok_slot[MOECACHE_MAX_USED] = {}; // this token's selections: low-bit slot, n = full
    float                       tok_p[MOECACHE_MAX_USED] = {};    //   and their router probabilities (0: dropped)
    std::vector<moecache_io_job> jobs;     // scratch: this token's reads into the pool
};

// unified memory (moecache-unified.cpp): the layer's host slots wrapped as buffers of the device of
// its dense part, which computes its expert matmuls there in place; dev = nullptr where it does not
struct moecache_layer_unified {
    struct ggml_backend_device * dev = nullptr;
    ggml_context *               ctx = nullptr;
    std::vector<struct ggml_backend_buffer *> buf; // one per expert tensor: its region of the arena
    std::vector<ggml_tensor *>   t;   // parallel to res.xt: the slots [ne0, ne1, n_slots] seen by the device
};

// prefetch bookkeeping of one layer (moecache-slots.cpp, moecache-route.cpp)
struct moecache_layer_prefetch {
    std::vector<uint8_t> predicted;  // [n_expert] named by the last prediction for this layer, until it routes
    bool    has_prediction = false;  // a prediction was made for the token this layer routes next
    std::vector<uint8_t> fetched;    // [n_expert] inserted by a prefetch and not selected since (used or wasted);
                                     //   prefetch_spare: read into a spare slot for the layer's next routing
    std::vector<uint8_t> ahead;      // [n_expert] prefetch_route: what the last prediction reads into spare
                                     //   slots (within prefetch_budget), until this layer routes
    float   credit = 0.0f;           // prefetch_budget: experts this layer may still read ahead
    std::vector<uint8_t> spent;      // [n_expert] prefetch_budget: charged to the credit by the last prediction
                                     //   (read, or already in a slot), until this layer routes: the budget
                                     //   follows the cache's contents, never which bytes a slot still holds
    std::vector<uint8_t> by_mark;    // [n_expert] prefetch_route: selected by the last routing only because
                                     //   a read ahead marked them (moecache-route.cpp marked_picks)
    std::vector<int32_t> last_sel;   // the experts this layer selected for the last token (PREVIOUS)
    int32_t n_last_sel = 0;
};

// what the eviction policies score (moecache-cache.cpp), kept for every routed token
struct moecache_layer_usage {
    std::vector<double>  freq;     // [n_expert] decayed count of selections (LFU, FREQ_PROB)
    std::vector<double>  mass;     // [n_expert] decayed sum of router probability (ROUTER_MASS)
    std::vector<float>   last_p;   // [n_expert] router probability of the layer's last token (FREQ_PROB)
    std::vector<uint8_t> pinned;   // [n_expert] cached and never evicted (moecache_profile_warm)
    int32_t n_pinned = 0;
};

struct moecache_layer {
    struct moecache * mc = nullptr; // owner (the graph op only gets a pointer to its layer)
    int32_t il       = 0;
    int32_t capacity = 0;           // M_l
    bool    seen     = false;       // routed at least one token

    // the cache over expert ids; last_use[e] < 0 means "not cached"
    std::vector<int64_t> last_use;    // [n_expert] recency stamp (larger = more recent)
    std::vector<int64_t> inserted_at; // [n_expert] value of stats.tokens when e was inserted
    int64_t clock     = 0;            // last stamp handed out
    int32_t occupancy = 0;

    // Delta_l for PRIOR: running mean of the score range, or a fixed calibrated value (> 0)
    double delta_sum   = 0.0;
    int64_t delta_n    = 0;
    float  delta_fixed = 0.0f;
    float  prior_scale = 1.0f;   // moecache_set_prior_scale: this layer's share of the prior's strength

    // counters only; moecache_get_layer_stats derives the shape, occupancy and Delta fields
    struct moecache_layer_stats st = {};
    int64_t decode_tokens = 0;        // decoded tokens routed by this layer (a batch of n counts n)
    int64_t decode_steps  = 0;        // decode ubatches routed by this layer

    moecache_layer_scratch   scratch;
    moecache_layer_graph     graph;
    moecache_layer_residency res;
    moecache_layer_prefetch  pf;
    moecache_layer_usage     use;
    moecache_layer_vram      vram;
    moecache_layer_unified   uni;
    moecache_layer_lowbit    low;

    std::vector<float> router_rec;    // cache params router_record: [n_rec][3][n_expert] z, p, s per token
    int32_t            n_rec = 0;
    std::vector<float> router_in;     //   and [n_rec][n_embd_in] the router's input (empty where not recognized)
    int32_t            n_embd_in = 0;
};

// the device path where the cache only counts (moecache-device.cpp): per MoE layer its fields in a
// persistent buffer on its router's device (the staging), where the graph computes what the counting
// reads; one read per device after each decode step's graph
// the most tokens of a decode step (one per sequence) the staging has room for
#define MOECACHE_DEVICE_MAX_STEP 32
// the most routings of a layer per token it has room for (grovemoe routes twice)
#define MOECACHE_DEVICE_CALLS 2

struct moecache_device {
    bool ready  = false;                           // the buffers below exist
    bool failed = false;                           // they could not be had: the CPU op routes
    ggml_context * ctx = nullptr;                  // the tensors' metadata (no data of its own)
    std::vector<ggml_backend_dev_t>    devs;       // [n_groups] the devices holding MoE layers' routers
    std::vector<ggml_backend_buffer_t> bufs;       // [n_groups] one buffer each
    std::vector<int32_t>               n_in;       // [n_groups] the MoE layers it holds
    std::vector<size_t>                align;      // [n_groups] its buffer type's alignment (each field's)
    std::vector<ggml_tensor *>         stage;      // [n_groups] I32: the staging, the device's layers' fields
                                                   //   for a step of up to MOECACHE_DEVICE_MAX_STEP tokens
    std::vector<ggml_tensor *>         stage_f32;  // [n_groups] the same memory as F32 (copies of floats)
    std::vector<ggml_tensor *>         bias;       // [n_groups] F32 [n_layers there * (N + K)]: the prior on the
                                                   //   device, per layer the boost of each expert (0 or b) and K b's
    std::vector<std::vector<float>>    bias_host;  // [n_groups] what was uploaded to it last
    std::vector<char *>                host;       // [n_groups] where the counting reads the staging: the staging
                                                   //   itself where it is host memory (the CPU), else pinned memory
                                                   //   where the device has a host buffer type (an asynchronous
                                                   //   read lands there directly), else host_vec
    std::vector<ggml_backend_buffer_t> host_bufs;  // [n_groups] that pinned memory, or NULL
    std::vector<std::vector<char>>     host_vec;   // [n_groups] plain memory where there is none
    std::vector<int32_t>       layer_group;        // [n_layer] the layer's device, -1 = none
    std::vector<int32_t>       layer_slot;         // [n_layer] its fields' place among that device's layers in
                                                   //   the staging (a second routing's: after every first one)
    bool routes_twice = false;                     // a layer routed twice a token in a graph seen (the prior
                                                   //   then stays with the op)
    // the graph built last (moecache_device_graph_begin resets them); [n_layer * MOECACHE_DEVICE_CALLS]: per
    // routing of a layer
    std::vector<int32_t> calls;                    // [n_layer] the layer's routings in this graph
    std::vector<int32_t> deferred;                 // [n_layer] of those, counted after the graph (the first ones)
    std::vector<uint8_t> p_from;                   // [.. * CALLS] the field its probabilities are read from (p; z
                                                   //   where they are the logits, gpt-oss's)
    std::vector<uint8_t> s_from;                   // [.. * CALLS] the field its selection score is read from (s; p
                                                   //   where it is p)
    std::vector<uint8_t> prior;                    // [n_layer] routed by the prior on the device (else top-k)
    int32_t n_deferred = 0;
    int32_t n_calls    = 0;                        // the most routings of one layer counted after the graph
    int32_t n_prior    = 0;                        // layers routed by the prior on the device (boosts per token)
    int32_t step_n     = 1;                        // tokens of a step (one per sequence of a batch)
    std::vector<ggml_tensor *> pending;            // the counting's own ops (the gating's copy), put into the
                                                   //   graph after llama.cpp's routing ops (moecache_device_expand)
    // the step in the staging, counted by moecache_device_flush or at the next ubatch
    std::mutex                         mutex;      // the reads and their counting (stats may be read from another thread)
    int32_t                            n_read = 0; // tokens of the step whose read is queued, not yet counted
    std::vector<ggml_backend_event_t>  events;     // [n_groups] marks that read's end on its device (NULL: none)
    std::vector<ggml_backend_t>        read_backends;
    struct moecache_routing_params     read_rp = {}; // the routing of the step's tokens
};

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

// moecache-residency.cpp
// Finds the expert tensors of every layer in the model and the file, and sets up the slot arena
// (STREAM) or the page locks (MMAP). Returns MOECACHE_OK or an error (message set).
int32_t moecache_residency_init(moecache & mc, const struct llama_model * model);
void    moecache_residency_free(moecache & mc);
// graph build: mul_mat_id over a routed-expert tensor, through the layer's residency op;
// nullptr when `as` is not one of the moecache's expert tensors (the caller does the stock op)
ggml_tensor * moecache_residency_mul_mat_id(moecache & mc, ggml_context * ctx, ggml_tensor * as,
                                            ggml_tensor * b, ggml_tensor * ids);
void moecache_residency_graph_begin(moecache & mc);
// moecache-device.cpp: a decoded token routed on its device (llama.cpp's top-k, or the prior as ggml
// ops), counted after the graph. Returns the layer's selected experts, or nullptr where the CPU op routes.
ggml_tensor * moecache_device_defer(moecache & mc, ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * selected,
                                    ggml_tensor * logits, ggml_tensor * probs, ggml_tensor * selection);
void moecache_device_graph_begin(moecache & mc);
// the copies moecache_device_defer made, into gf: after llama.cpp has put the layer's routing ops there
// (its first expert matmul), so that they stay together as a device fuses them; the rest at the graph's end
void moecache_device_expand(moecache & mc, ggml_cgraph * gf);
void moecache_device_ubatch_begin(moecache & mc); // before a ubatch computes: the token before counted, the prior's boosts
void moecache_device_ubatch_computed(moecache & mc, ggml_backend_sched_t sched);
void moecache_device_free(moecache & mc);
void moecache_device_flush(moecache & mc);  // count a read still pending (each API entry reading or changing the cache)
// places an op of ours on the CPU backend when the graph being built has GPU layers; returns t
ggml_tensor * moecache_graph_on_cpu(ggml_tensor * t);
// b where it is the layer's FFN input on the device and the CPU read a copy of it (with the router's
// logits): that copy, shaped as b; b otherwise
ggml_tensor * moecache_graph_host_input(moecache_layer & L, ggml_context * ctx, ggml_tensor * b);
// places t on the backend of the device whose memory buft is, when that backend computes t; returns t
ggml_tensor * moecache_graph_on_device(ggml_tensor * t, struct ggml_backend_buffer_type * buft);
// where layer il's dense part lives: its router weight's buffer type; nullptr where there is none
struct ggml_backend_buffer_type * moecache_layer_buft(const struct llama_model * model, int32_t il);
// moecache-vram.cpp: the VRAM tier. plan: which layers get one (before the slot arena, which then
// gives them a zero slot); init: their device slots; decode: one token's selections of layer L,
// after its host slots (out: host slot ids, set to the zero slot for those computed on the device);
// mul_mat_id: the device side of an expert matmul added to the CPU side
void          moecache_vram_plan(moecache & mc, const struct llama_model * model);
int32_t       moecache_vram_init(moecache & mc);
void          moecache_vram_free(moecache & mc);
int64_t       moecache_vram_decode(moecache & mc, moecache_layer & L, const int32_t * ids, int32_t * out,
                                   int64_t n); // the time it spent copying up, not waiting for reads (us)
void          moecache_vram_empty(moecache_layer & L);  // the tier holds nothing
void          moecache_vram_forget(moecache_layer & L); // an exclusive tier emptied (its cache entries leave)
bool          moecache_vram_warm(moecache & mc); // each layer's hottest experts of the usage profile, now
// the predicted experts of T that its host cache holds, copied up ahead of T's routing (prefetch);
// begin: at T's residency op, before its host slots change, the copies up made for T end
void          moecache_vram_ahead(moecache & mc, moecache_layer & T, const int32_t * ids, int32_t n);
int64_t       moecache_vram_begin(moecache & mc, moecache_layer & L); // the time it spent copying up (us)
// the down matmul's activations b (llama.cpp's, from the input-side sums) rebuilt per side: each sum replaced
// by its device part (*b_gpu) or its CPU part (*b_cpu), so each side computes its own activations and no
// value crosses between the backends inside the layer; both stay b where the chain cannot be rebuilt
void          moecache_vram_split_act(moecache_layer & L, ggml_context * ctx, ggml_tensor * b, ggml_tensor ** b_gpu,
                                      ggml_tensor ** b_cpu);
// the graph built (llama.cpp's ops after the experts' included): each layer's routing weights, read by the
// device side beside a VRAM tier, cross to it within the joint (moecache-vram.cpp, J)
void          moecache_vram_graph_end(moecache & mc, ggml_cgraph * gf);
ggml_tensor * moecache_vram_mul_mat_id(moecache_layer & L, ggml_context * ctx, const moecache_expert_tensor & x,
                                       ggml_tensor * b, ggml_tensor * cpu);
int64_t       moecache_vram_bytes(const moecache & mc);
inline bool   moecache_is_zero_slot(const moecache_layer & L, int32_t s) {
    return (L.vram.n > 0 || L.low.n > 0) && s == L.res.n_slots;
}
// moecache-unified.cpp: unified memory. plan: which layers their device computes in place (before
// the VRAM tier's plan: those get no tier); init: wraps their regions of the arena (after it exists);
// mul_mat_id: an expert matmul on the wrapped slots, nullptr where the layer has none
int32_t       moecache_unified_plan(moecache & mc, const struct llama_model * model);
int32_t       moecache_unified_init(moecache & mc);
void          moecache_unified_free(moecache & mc);
ggml_tensor * moecache_unified_mul_mat_id(moecache_layer & L, ggml_context * ctx, const moecache_expert_tensor & x,
                                          ggml_tensor * b, ggml_tensor * ids);
int64_t       moecache_unified_bytes(const moecache & mc, int32_t * n_layers);
// moecache-matmul.cpp: whether ggml's CPU backend has a vec_dot for weights w times activations b (the row-by-row ops compute exactly what its mul_mat_id computes); false without CPU traits
bool          moecache_matmul_cpu_vec_dot(const ggml_tensor * w, const ggml_tensor * b);
#ifndef MOECACHE_NO_CPU_TRAITS
// one-token matmul row by row with ggml's vec_dot, as mul_mat_id computes it; slot[i] < 0: 0, skipped
void          moecache_matmul_rows(ggml_tensor * dst, int ith, int nth, const int32_t * slot);
#endif
// moecache-matmul.cpp: the slot ids of a STREAM decode once every selected expert's read is in
ggml_tensor * moecache_matmul_ready(moecache_layer & L, ggml_context * ctx);
// makes memory follow the cache for one layer's expert ids (the op of moecache-graph.cpp): out = slot ids
// for a STREAM decode, the ids otherwise
void moecache_residency_sync(moecache_layer & L, const int32_t * ids, int32_t * out, int64_t n_ids, bool decode);
// moecache-residency.cpp: helpers shared with moecache-slots.cpp
int32_t moecache_fail_residency(const std::string & msg);           // sets the error, MOECACHE_ERR_RESIDENCY
void    moecache_set_io_error(moecache & mc, const std::string & msg); // the first failed read stops the decode
void    moecache_warn_mlock_once(size_t bytes, int err);
bool    moecache_tensor_is_mapped(const ggml_tensor * t); // its data lies in llama.cpp's mapping of the file
// moecache-mapping.cpp: the experts' pages in llama.cpp's mapping (MMAP residency, every prompt)
void    moecache_willneed_expert(const moecache_layer & L, int32_t e);  // MADV_WILLNEED on e's pages
// before a layer's op (il_prompt: that layer in a prompt ubatch; -1: a decode, or everything at
// teardown): waits for the prompt's read-ahead of that layer, drops what earlier layers read
void    moecache_mapping_begin(moecache & mc, int32_t il_prompt);
// a prompt ubatch (either residency) or an MMAP decode: asks for, locks and drops L's pages so
// they follow L's cache; STREAM prompts copy the cached experts into their slots
void    moecache_mapping_sync(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids, bool decode);
void    moecache_mapping_advise_random(moecache & mc, const moecache_layer & L); // MMAP: no readahead on L's experts
void    moecache_residency_clear(moecache & mc);                               // moecache_clear: no bytes kept
void    moecache_residency_hold_all(moecache & mc);                            // slots of every expert: all cached
void    moecache_mapping_unlock_all(moecache & mc);                            // teardown: the locked experts' pages
// moecache-lowbit.cpp: low-bit misses (cache params lowbit)
void          moecache_lowbit_plan(moecache & mc);  // before the arena: a layer with a pool gets a zero slot
// before the arena: opens and checks the companion; SOURCE: the slots become the companion's copies
int32_t       moecache_lowbit_open(moecache & mc);
int32_t       moecache_lowbit_init(moecache & mc);  // after the arena: allocates the pools (MISS, ALL)
void          moecache_lowbit_free(moecache & mc);
// STREAM decode, after moecache_slots_decode chose out[] (slot ids): the selections the mode computes
// from the companion are read into the pool and their out[i] becomes the zero slot
void          moecache_lowbit_decode(moecache & mc, moecache_layer & L, const int32_t * ids, int32_t * out,
                                     int64_t n_ids);
// a decode's expert matmul: `full` (the slots' result) + the pool's matmul; `full` where L has no pool
ggml_tensor * moecache_lowbit_mul_mat_id(moecache_layer & L, ggml_context * ctx, const moecache_expert_tensor & x,
                                         ggml_tensor * b, ggml_tensor * full);
int64_t       moecache_lowbit_bytes(const moecache & mc);
// moecache-dense.cpp: lock_dense, shared by the moecaches of one model
void    moecache_dense_lock(moecache & mc, const struct llama_model * model);
void    moecache_dense_unlock(moecache & mc);
// moecache-slots.cpp: STREAM's slot arena
int32_t moecache_slots_init(moecache & mc);
// STREAM, at creation: every layer whose cache holds all N experts reads them all into its slots
// now (waiting for the reads), as a resident model is read at load; a failed read is an error. The
// logical cache is left alone: its first uses still count as misses (they read nothing), so the
// routing is the same as with any other residency
int32_t moecache_slots_fill_all(moecache & mc);
// STREAM decode: layer `target` will probably select experts pred[0:n] (most likely first, score in
// (0, 1]): start reading those no slot holds, into slots that hold none of its cached experts. pred
// were just inserted into its cache (moecache_layer_prefetch), or, spare: are not cached and stay so
// (prefetch_spare; counted here as issued)
void    moecache_slots_prefetch(moecache & mc, moecache_layer & target, const int32_t * pred, const float * score,
                                int32_t n, bool spare);
// (also a prompt ubatch whose layer holds every expert: decode = false; only a decode uses the low-bit pool)
void    moecache_slots_decode(moecache & mc, moecache_layer & L, const int32_t * ids, int32_t * out, int64_t n_ids,
                              bool wait, bool decode);
// waits until slots[0:n] of L hold their experts; a failed read sets the I/O error (the decode
// stops) and frees its slot. Returns the microseconds it waited
int64_t moecache_slots_wait(moecache & mc, moecache_layer & L, const int32_t * slots, int64_t n);
int32_t moecache_slots_holding(const moecache_layer & L, int32_t e); // the slot holding e's bytes, or -1
// moecache-matmul.cpp: a STREAM decode's matmul over expert tensor x of L with activations b, on
// the slots (ids: L.graph.ids_out): with overlap_experts, each expert as soon as its bytes arrive
ggml_tensor * moecache_matmul_stream_decode(moecache & mc, moecache_layer & L, ggml_context * ctx,
                                            const moecache_expert_tensor & x, ggml_tensor * b);
void    moecache_slots_prompt(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids);
// moecache-init.cpp: the checks of moecache.h's parameters and the constructors
int32_t    moecache_check_routing(const moecache_routing_params & p, int32_t K);
int32_t    moecache_check_eviction(enum moecache_eviction eviction, float decay);
moecache * moecache_new_shape(int32_t n_layer, int32_t N, int32_t K, moecache_cache_params cp,
                              moecache_routing_params rp);
moecache * moecache_new(const llama_model * model, moecache_cache_params cparams, moecache_routing_params rparams);
// moecache-state.cpp: cache state files (status codes and messages as moecache_state_save/_load)
int32_t moecache_state_write(const moecache & mc, const char * path);
int32_t moecache_state_read(moecache & mc, const char * path);
// moecache-graph.cpp: the context registry behind moecache_attach / moecache_detach
int32_t moecache_graph_attach(moecache * mc, llama_context * ctx);
void    moecache_hook_detach(moecache * mc);       // (waits for the context's work in flight first)
void    moecache_graph_wait(moecache & mc);         // the attached context's work in flight, waited for
void    moecache_graph_set_load_residency(enum moecache_residency residency);
void    moecache_graph_mark_dirty(moecache * mc);  // the attached context builds its next graph afresh
// moecache-ahead.cpp: reads ahead of the layer that needs them
// GATE prefetch, decode graphs: layer il + d's router (or its fitted predictor) applied to layer il's
// FFN input, [n_expert, 1]; nullptr when there is nothing to predict
ggml_tensor * moecache_ahead_predict_router(moecache & mc, ggml_context * ctx, ggml_tensor * logits, int il,
                                            int64_t n_tokens);
// during layer L's decode, after it routed: predict what layer L + d selects, read the misses
// (pred: moecache_ahead_predict_router's output, computed; nullptr without GATE)
void          moecache_ahead_prefetch(moecache & mc, moecache_layer & L, const ggml_tensor * pred);
void          moecache_ahead_trial_token(moecache & mc, int64_t now); // prefetch_adaptive: a decoded token starts
int32_t       moecache_ahead_set_predictor(moecache & mc, int32_t il, const float * w, int32_t n_embd);
void          moecache_ahead_free_predictors(moecache & mc);
const float * moecache_row_f32(const ggml_tensor * t, int64_t i1); // row i1 of a 2-d F32 tensor on the host
bool moecache_residency_abort(void * mc);  // llama_set_abort_callback: true after a failed read

// moecache-route.cpp
// Routes one token of layer L and updates its cache and counters.
//   z, p, s: [n_expert] logits, probabilities, selection scores (s may be p)
//   stock:   [n_expert_used] the model's own top-K in its order, or nullptr to rank here
//   apply:   run the policy (false: stock top-K, cache still updated when `update`)
//   update:  update the cache, counters and trace
//   sel:     [n_expert_used] out, router-rank order; dropped slots -1
//   hit:     [n_expert_used] out, 1 hit / 0 miss / -1 dropped (or not updated)
// Returns the number of experts run.
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
        int8_t                               * hit);
// the prior's mask: expert e counts as cached for layer L's next token
bool moecache_route_preferred(const moecache_layer & L, int32_t e);

// batch_share: a decode step of several sequences' tokens (moecache_route_shares) is routed in two
// passes. The first routes every token against the cache as it is (nothing updated, Delta as it
// was), counting the selections (L.scratch.step, .first); before its second, updating pass, token t
// sees what the others selected in the first as cached (L.scratch.others); moecache_route_share_end
// clears that. Rows: z, p, s, stock of each token ([n_tokens] pointers; stock may be nullptr).
bool moecache_route_shares(const moecache_routing_params & rp, int64_t n_tokens);
moecache_routing_params moecache_route_share_params(const moecache_routing_params & rp); // (batch_prior applied)
void moecache_route_share_first(moecache & mc, moecache_layer & L, const moecache_routing_params & rp, int64_t n_tokens,
                                const float * const * z, const float * const * p, const float * const * s,
                                const int32_t * const * stock);
void moecache_route_share_token(const moecache & mc, moecache_layer & L, int64_t t);
void moecache_route_share_end(moecache_layer & L);

// moecache-cache.cpp
void moecache_layer_init (moecache & mc, moecache_layer & L, int32_t il, int32_t capacity);
void moecache_layer_clear(moecache_layer & L);   // empty, Delta, usage and pins to zero
void moecache_layer_empty(moecache_layer & L);   // empty (lifetimes of the entries end now) and unpinned
// a token of layer L routed: decays and adds its usage (router probabilities p [n_expert], the
// selection sel[0:n_sel]) and counts the selection in the current request; before its insertions
void moecache_layer_observe(moecache_layer & L, const float * p, const int32_t * sel, int32_t n_sel);
// inserts e as the most recent entry; when full, evicts the expert the eviction policy picks among
// those whose in_use[] entry is 0 (in_use may be NULL) and that are not pinned. Returns false if
// the capacity is 0.
bool moecache_layer_insert(moecache_layer & L, int32_t e, const uint8_t * in_use);
int32_t moecache_layer_pick_victim(const moecache_layer & L, const int64_t * stamp, const uint8_t * pinned,
                                   const uint8_t * in_use);
// a prediction for the next token of layer T: pred[0:n] (most likely first) are inserted into its
// cache unless cached already, each evicting by the policy an expert that is not predicted (an
// evicted prefetch never selected counts as wasted). inserted: out, the experts to read. Returns their count.
int32_t moecache_layer_prefetch(moecache_layer & T, const int32_t * pred, int32_t n, int32_t * inserted);
// prefetch_spare > 0: a prediction pred[0:n] for the next token of layer T, the cache left alone:
// missing = the predicted experts T does not cache (at most prefetch_spare), to read into spare slots
int32_t moecache_layer_speculate(moecache_layer & T, const int32_t * pred, int32_t n, int32_t * missing);
// after layer L routed a decoded token: recall of the prediction, prefetches used, last selection
void    moecache_layer_prefetch_outcome(moecache_layer & L, const int32_t * sel, int32_t n_sel);

// moecache-profile.cpp
// the current request's expert counts: a token's selection of layer L
void    moecache_request_count(moecache & mc, const moecache_layer & L, const int32_t * sel, int32_t n_sel);
// moecache_begin_request: the request that ends goes into the profile and the trace store
void    moecache_profile_begin_request(moecache & mc);
// PREFETCH_TRACE: during layer il, scores of layer target's experts ([N], larger = likelier); false if none
bool    moecache_trace_predict(moecache & mc, int32_t il, int32_t target, float * score);
int32_t moecache_profile_write(const moecache & mc, const char * path);
int32_t moecache_profile_read(moecache & mc, const char * path);
int32_t moecache_profile_warm_start(moecache & mc, int32_t n_pin);
// layer il's experts the usage profile counts, most selected first (ties by the lower id) in hot[0:n]; returns n
int32_t moecache_profile_hottest(const moecache & mc, int32_t il, std::vector<int32_t> & hot);

// moecache-state.cpp: file helpers shared with moecache-profile.cpp (native endianness)
template <typename T> inline void moecache_put(std::vector<uint8_t> & b, const T & v) {
    const uint8_t * p = (const uint8_t *) &v;
    b.insert(b.end(), p, p + sizeof(T));
}
// bounds-checked reader over a file's bytes
struct moecache_reader {
    const uint8_t * p;
    size_t n;
    size_t pos = 0;
    bool get_bytes(void * out, size_t k) {
        if (k > n - pos) {
            return false;
        }
        memcpy(out, p + pos, k);
        pos += k;
        return true;
    }
    template <typename T> bool get(T & v) { return get_bytes(&v, sizeof(T)); }
};
uint64_t moecache_fnv1a64(const uint8_t * p, size_t n);
// writes b to a temporary file beside path, syncs it and renames it over path; MOECACHE_ERR_IO
// with "cannot write <what> to '<path>': ..." on failure
int32_t  moecache_write_file_atomic(const std::vector<uint8_t> & b, const char * path, const char * what);
// 'path', as file names appear in messages
std::string moecache_quoted(const char * path);
// the whole regular file (never a FIFO or device), at most max_bytes; errors name `what`
int32_t  moecache_read_file(const char * path, size_t max_bytes, const char * what, std::vector<uint8_t> & out);
// every file of ours starts with: magic | u32 abi | u32 len + desc | u64 n_params | i32 n_layer, N, K
// and ends with the u64 FNV-1a hash of every byte before it
std::vector<uint8_t> moecache_file_header(const moecache & mc, const char magic[8]);
// reads path whole and checks its magic, checksum, ABI and that it belongs to mc's model (errors
// name `what`); on MOECACHE_OK, r reads buf from after the header up to the checksum
int32_t  moecache_read_checked(const moecache & mc, const char * path, const char magic[8], size_t max_bytes,
                               const char * what, std::vector<uint8_t> & buf, moecache_reader & r);
