// moecache-layer.h - one MoE layer's state, in named parts (moecache_layer: its cache, the scratch of one
// routing decision, what the graph build leaves for the ops, where its experts' bytes live, its VRAM tier,
// low-bit pools, unified memory, prefetch bookkeeping, usage), held by struct moecache. Not installed.
#pragma once

#include "moecache.h"
#include "moecache-io.h"

#include "ggml.h" // enum ggml_type
#include "ggml-backend.h"

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
    std::vector<int32_t> step_sel; // a decode step's selections, every row's (moecache-graph-route.cpp)
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
    bool          probs_are_logits = false; // the router's p are its logits (softmax over the chosen, gpt-oss's):
                                            //   what a token gives up is counted on their softmax
    ggml_tensor * route_out      = nullptr; // op_select's [K + 2, n_tokens]: selected, n_active, weight_from
    ggml_tensor * select_out     = nullptr; // its first K rows, what llama.cpp uses
    float         dropped_weight = 0.0f;    // weight of a dropped slot: 0, or -inf before a softmax
    ggml_tensor * ids_in         = nullptr; // residency: the ids the op below was built for
    ggml_tensor * ids_out        = nullptr; //   its output: slot ids (STREAM decode) or the ids unchanged
    ggml_tensor * arrival        = nullptr; // STREAM decode, overlap_experts: the input-side expert matmuls
    ggml_tensor * ready          = nullptr; //   and the slot ids once every read is in (moecache-matmul.cpp)
    ggml_tensor * vram_joint     = nullptr; // VRAM tier: what the device side reads from the CPU, joined (J,
    ggml_tensor * vram_joint_dev = nullptr; //   moecache-vram.cpp), and its one copy on the device
    ggml_tensor * vram_slot      = nullptr; //   the two rows of ids in it [K, T]: the device slot of each selection
    ggml_tensor * vram_row       = nullptr; //   and its output row (views of the copy)
    ggml_tensor * vram_out       = nullptr; //   the experts' outputs [n_out, K, T] (the down matmul's, J joined)
    ggml_tensor * vram_w         = nullptr; //   the weights' view of the copy [1, K, T]
    int64_t       vram_n         = 0;       //   the selections J carries, K x T (T: tokens of the step)
    ggml_tensor * direct_ids     = nullptr; // the direct tier (moecache-vram-direct.cpp): the ids its lookups
    ggml_tensor * direct_tier    = nullptr; //   were made for, and each selection's tier slot [K, T],
    ggml_tensor * direct_host    = nullptr; //   host slot [K, T]
    ggml_tensor * direct_hit     = nullptr; //   and whether the tier has it [1, K, T]
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
    int32_t n_slots      = 0;          // STREAM: max(capacity, K) slots per tensor (+ spare, + a batch's)
    int32_t n_own        = 0;          // STREAM: slots [0, n_own) are the layer's own; [n_own, n_slots), a
                                       //   batch's step slots, lie in pages every such layer maps (moecache-slots.cpp)
    bool    all_in_slots = false;      // STREAM: the cache holds all N experts, read in at creation:
                                       //   prompts compute on the slots too (moecache_slots_fill_all)
    bool    lent         = false;      // STREAM: the pages of its own slots are lent to a prompt's reads until its
                                       //   layer of the prompt takes them again (moecache_slots_lend)
    bool    relock       = false;      //   and they are to be locked (and given 2 MiB pages) again (moecache_slots_relock)
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
    std::vector<int32_t> tok_slot;         // the current step's selections [K x T]: device slot, -1 = on the CPU
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
    bool                         direct = false; // with a VRAM tier beside it (moecache-vram-direct.cpp)
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
