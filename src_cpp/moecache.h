// moecache.h - per-layer expert cache and cache-conditional routing for llama.cpp MoE models.
//
// The whole public C API of pymoecache. Specification of the routing policies:
// docs/method.md (notation used below: N routed experts per layer, K = experts used
// per token, r = the router's ranking, C = the layer's cache, J = Top-J).
//
// Usage:
//     struct moecache_cache_params   cp = moecache_cache_default_params();
//     struct moecache_routing_params rp = moecache_routing_default_params();
//     cp.n_cached     = 30;                      // experts kept per layer
//     rp.policy       = MOECACHE_POLICY_PRIOR;
//     rp.prior_lambda = 0.5f;
//     struct moecache * mc = moecache_init(model, cp, rp);   // NULL on error: moecache_last_error()
//     moecache_attach(mc, ctx);                  // the next llama_decode routes through mc
//     ... llama_decode(ctx, batch) ...
//     struct moecache_stats st; moecache_get_stats(mc, &st);
//     moecache_free(mc);                         // detaches first
//
// How a token gets here: llama_decode -> build_moe_ffn (patched, patches/0001-*.patch) ->
// moecache_hook_select inserts one ggml custom op per MoE layer -> at compute time the op
// calls moecache_route_token (moecache-route.cpp) for the tokens of the ubatch, in order. With
// MMAP or STREAM residency the layer's expert matmuls (patches/0002-*.patch) first pass through
// a second op that brings the selected experts in (moecache-residency.cpp).
//
// Determinism: the router's ranking r sorts by the selection score, descending, ties by lower
// expert id (in the graph, r starts with the model's own top-K, so ties break as the model
// breaks them); every re-ranking is stable with respect to r; the selected experts are
// returned in r order, so a policy that leaves the set unchanged leaves the logits unchanged.
// A selected expert is a hit if it was cached when its token was routed; misses are inserted
// in router-weight order and never evict an expert the same token uses.
//
// Threading: one moecache per llama_context. Read stats and change parameters between
// llama_decode calls, not during one.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moecache-timeline.h" // the timeline's events (moecache_timeline_get)

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && !defined(__MINGW32__)
#    define MOECACHE_API __declspec(dllexport)
#else
#    define MOECACHE_API __attribute__((visibility("default")))
#endif

// bumped whenever a struct layout or a signature below changes; bindings check it
#define MOECACHE_ABI_VERSION 29

// a trace record holds at most this many experts (models with larger K are truncated)
#define MOECACHE_TRACE_MAX_USED 32

// upper bounds of the parameters below (larger values are refused with MOECACHE_ERR_INVALID)
#define MOECACHE_MAX_EXPERTS   4096       // routed experts N per layer
#define MOECACHE_MAX_LAYERS    4096       // layers of a model
#define MOECACHE_MAX_TRACE     (1 << 24)  // trace_capacity (152 bytes per record: 2.4 GiB at the bound)
#define MOECACHE_MAX_PREFETCH_DISTANCE 8  // prefetch_distance
#define MOECACHE_MAX_SEQ       256        // n_seq (llama.cpp's LLAMA_MAX_SEQ)

struct llama_model;
struct llama_context;

struct moecache; // opaque handle

// status codes returned by functions that can fail; details in moecache_last_error()
enum moecache_status {
    MOECACHE_OK              =  0,
    MOECACHE_ERR_INVALID     = -1, // a parameter is out of range
    MOECACHE_ERR_NOT_MOE     = -2, // the model has no routed experts
    MOECACHE_ERR_IO          = -3, // a state file could not be read or written
    MOECACHE_ERR_MISMATCH    = -4, // a state file belongs to another model
    MOECACHE_ERR_STATE       = -5, // call not allowed now (e.g. attached to another context)
    MOECACHE_ERR_RESIDENCY   = -6, // the model's experts cannot be streamed or locked (layout, backend, file)
    MOECACHE_ERR_CORRUPT     = -7, // a state file is damaged (checksum, a field out of range); nothing was loaded
    MOECACHE_ERR_NO_MEMORY   = -8, // an allocation failed; nothing was changed
};

enum moecache_policy {
    MOECACHE_POLICY_TOPK     = 0, // stock routing; the cache only counts and evicts ("LRU")
    MOECACHE_POLICY_PRUNE    = 1, // keep r[0:max(J, min(K, R))], drop the others (fewer experts run)
    MOECACHE_POLICY_MAX_RANK = 2, // cached experts of rank < m jump ahead of uncached ones
    MOECACHE_POLICY_CUMSUM   = 3, // max-rank with per-token m = first rank where cumsum(p) >= tau
    MOECACHE_POLICY_PRIOR    = 4, // rank by z + lambda * Delta_l * [e in C or e in r[0:J]]
    // analysis only (rank sensitivity, method.md); the cache counts as usual, J is not applied:
    MOECACHE_POLICY_DROP_RANK = 5, // run r[0:K] without r[i] (i = analysis_rank): K - 1 experts
    MOECACHE_POLICY_SWAP_RANK = 6, // run r[i] replaced by a random allowed expert outside r[0:K],
                                   //   with r[i]'s router weight
};

enum moecache_insertion {
    MOECACHE_INSERTION_TOP_BOTTOM = 0, // insert highest router weight first: lowest weight is most recent
    MOECACHE_INSERTION_BOTTOM_TOP = 1, // the reverse order
};

enum moecache_scope {
    MOECACHE_SCOPE_ALL    = 0, // the policy routes every token (evaluation, perplexity)
    MOECACHE_SCOPE_DECODE = 1, // only ubatches of one token (generation); prompts use stock top-k
};

// Where the routed experts' weights live (moecache-residency.cpp). The hits and misses are the
// same in every mode; what a miss costs is not.
enum moecache_residency {
    MOECACHE_RESIDENCY_NONE   = 0, // counters only: every expert stays where llama.cpp put it
    MOECACHE_RESIDENCY_MMAP   = 1, // experts stay mmapped; cached ones are mlocked, evicted ones unlocked
                                   //   and their pages dropped (the published deployment, a baseline)
    MOECACHE_RESIDENCY_STREAM = 2, // cached experts live in a per-layer slot arena (mlocked); a decode miss
                                   //   reads the expert's bytes from the GGUF into its slot (direct I/O,
                                   //   parallel reads); prompts read experts through the mapping, one layer
                                   //   at a time, and copy the ones that stay cached into their slots
};

// Proactive reads (STREAM decode): while layer l routes a token, predict which experts layer
// l + d will select and read them now, into slots of layer l + d chosen by its eviction policy
// (a prefetch is an insertion into that layer's cache), so the reads overlap the compute in
// between. An expert a token selects waits only for its own reads; reads for a token's
// selection (on demand) go before prefetches, and a prefetch is cancelled when its slot is
// given to another expert. With TOPK routing a prefetch changes what is resident, never the
// output; with a cache-aware policy prefetched experts count as cached (they are).
enum moecache_prefetch {
    MOECACHE_PREFETCH_OFF      = 0, // reads start when the layer's own routing is known
    MOECACHE_PREFETCH_GATE     = 1, // layer l + d's router applied to layer l's FFN input (ProMoE): its top K
                                    //   under TOPK routing, its top J under a cache-aware policy (the
                                    //   experts that policy runs whether cached or not)
    MOECACHE_PREFETCH_PREVIOUS = 2, // the experts layer l + d selected for the previous token
    MOECACHE_PREFETCH_TRACE    = 3, // request traces (MoE-Infinity): the request's expert counts so far,
                                    //   layers 0..l, matched by cosine against past requests (a bounded,
                                    //   deduplicated store filled by moecache_begin_request); layer l + d's
                                    //   counts of the best match plus the request's own, its top K (J)
};

// Which cached expert leaves when a miss (or a prefetch) needs its place (moecache-cache.cpp).
// Every policy skips the experts the current token uses and the pinned ones, and breaks ties by
// least recent use. The usage each policy scores is kept for every routed token whatever the
// policy, so a switch at run time (moecache_set_eviction) decides with full information.
// "Decayed" values are updated per token of the layer as x = decay * x + v (decay: eviction_decay).
enum moecache_eviction {
    MOECACHE_EVICTION_LRU         = 0, // least recently used
    MOECACHE_EVICTION_LFU         = 1, // lowest decayed count of selections
    MOECACHE_EVICTION_ACTIVATION  = 2, // MoE-Infinity: lowest share of the layer's selections in the current
                                       //   request (since moecache_begin_request) + 0.1 x its share in the
                                       //   usage profile of past requests
    MOECACHE_EVICTION_FREQ_PROB   = 3, // fMoE: lowest decayed count of selections x the router probability
                                       //   of the layer's last token (its prediction for the next one)
    MOECACHE_EVICTION_ROUTER_MASS = 4, // lowest decayed sum of router probability (every expert, every token)
};

// VRAM tier (n_vram > 0, STREAM): what happens when a decoded token selects an expert that its
// layer's device slots do not hold (moecache-vram.cpp). A layer has the tier when its router weight
// is in device memory that is not host memory (n_gpu_layers: a discrete GPU, or an RPC server).
enum moecache_vram_fill {
    MOECACHE_VRAM_FILL_AUTO = 0, // copy it up (as COPY) when the measured copy time of its bytes is at
                                 //   most the measured CPU time of one expert x (1 + the device hits per
                                 //   copy so far); otherwise compute it on the CPU. A free device slot is
                                 //   always filled; the first copy and the first CPU expert measure
    MOECACHE_VRAM_FILL_COPY = 1, // copy it from its host slot into a device slot (a free one, else that
                                 //   of the expert the cache's eviction policy picks among those the
                                 //   token did not select, recency from the tier's own uses) and
                                 //   compute it there
    MOECACHE_VRAM_FILL_CPU  = 2, // compute it on the CPU from its host slot; only free device slots are
                                 //   filled (the first experts used stay)
};

// VRAM tier: how a decoded token's copies up reach the device (moecache-vram.cpp)
enum moecache_vram_copy {
    MOECACHE_VRAM_COPY_ASYNC = 0, // queued on a second backend of the device (its own stream: ggml's
                                  //   set_tensor_async) while the CPU computes its own selections, and
                                  //   waited for just before the device's expert matmuls; SYNC where the
                                  //   device gives no second backend
    MOECACHE_VRAM_COPY_SYNC  = 1, // made by the layer's routing op (ggml_backend_tensor_set), one after
                                  //   the other, before any expert matmul
};

// Low-bit misses (STREAM; HOBBIT, EdgeMoE): a decoded token's expert is computed from its copy in
// a low-bit companion GGUF (`pymoecache lowbit`: every routed expert tensor of the model at a lower
// type, same names and shapes), read into a small pool of K slots per layer (moecache-lowbit.cpp),
// or held in memory whole (lowbit_in_ram).
// Each selection is computed from one copy or the other, never both: the other side's matmul runs
// on a zero slot and adds exactly 0. The routing, the cache and its hits and misses are unchanged.
enum moecache_lowbit {
    MOECACHE_LOWBIT_OFF  = 0, // every expert at full precision
    MOECACHE_LOWBIT_MISS = 1, // a miss whose full copy is neither in a slot nor being read is computed from
                              //   the companion; its full copy is read behind the token (at the lowest
                              //   prefetch priority) and not waited for by the next token, which computes
                              //   it from the companion too; a later selection is a full-precision hit
    MOECACHE_LOWBIT_ALL  = 2, // every selection of a decoded token is computed from the companion; no full
                              //   copy is read while decoding (the memory-poor extreme, and a reference)
    MOECACHE_LOWBIT_SOURCE = 3, // the companion is the cache's source: the slots hold its copies (its type)
                              //   and every read, decode, prefetch or prompt, is from it. The cache keeps
                              //   the memory asked for: its size (n_cached, fraction) counts the model's
                              //   experts, and holds as many companion copies as fit in their bytes (up
                              //   to N). What a user gets from a model with every expert at the low type,
                              //   from the same files. Prompts that do not find every expert in a slot
                              //   compute from the model's mapping, at full precision. Beside GPU layers
                              //   the VRAM tier holds the companion's copies too (its n_vram counts the
                              //   model's experts, as the cache's size does: more of them fit), and
                              //   unified memory computes them in place on the slots
};

// Unified memory (STREAM, GPU layers): whether the device of a layer's dense part computes the
// layer's expert matmuls in place, on the host slot arena wrapped as a device buffer (ggml's
// buffer_from_host_ptr: Metal, Vulkan with VK_EXT_external_memory_host). No copies: the reads
// fill the slots and the device's matmuls read them there (moecache-unified.cpp).
enum moecache_unified {
    MOECACHE_UNIFIED_AUTO = 0, // where the device shares the host's memory (an integrated GPU, Apple silicon) and
                               //   can wrap the arena; on a discrete GPU with n_vram and every expert cached, the direct
                               //   tier where a trial finds it faster; elsewhere the CPU computes the experts
    MOECACHE_UNIFIED_OFF  = 1, // never: the CPU computes the routed experts (llama.cpp's --cpu-moe)
    MOECACHE_UNIFIED_ON   = 2, // on any device that can wrap the arena, a discrete GPU too (its matmuls
                               //   then read host memory over the bus); a device that cannot is an error
};

// Routing: how the selection is changed. May be changed at run time (moecache_set_routing);
// the change takes effect on the next token, no graph rebuild, no reload.
struct moecache_routing_params {
    enum moecache_policy policy;  // default MOECACHE_POLICY_TOPK
    int32_t top_j;                // J: experts of router rank < J are always selected; default 1; 0 <= J <= K
    float   prior_lambda;         // PRIOR strength lambda >= 0; 0 = stock model; default 0.5
    int32_t max_rank;             // MAX_RANK m >= 0 (ranks counted from 0: r[0:m] may be promoted); default 8
    float   cumsum_tau;           // CUMSUM threshold tau in [0, 1]; default 0.9
    int32_t prune_rank;           // PRUNE R >= 1: experts kept per token (at most K, at least J); default 2
    enum moecache_scope scope;    // default MOECACHE_SCOPE_ALL
    int32_t  analysis_rank;       // DROP_RANK / SWAP_RANK: the rank i removed, 0 = top expert, i < K; default 0
    uint32_t analysis_seed;       // SWAP_RANK: the replacement is a hash of (seed, layer, token); default 0
    bool     prior_on_probs;      // PRIOR: boost the router probability p of a cached expert by lambda x scale_l
                                  //   (probability units, no Delta) instead of its logit by lambda x scale_l x
                                  //   Delta_l: a swap then costs at most lambda of router mass, so a confident
                                  //   router keeps its choice; the gate predictor then predicts top-k; default false
    bool     batch_share;         // PRIOR, MAX_RANK, CUMSUM on a batch of several sequences (cache params n_seq):
                                  //   an expert another sequence of the step selects is as good as cached (it
                                  //   is read for that one anyway), so the step reads fewer; each token is routed
                                  //   twice, the first time to learn the step's selections. A sequence decoded
                                  //   alone is routed as without it; default true
    float    batch_prior;         // PRIOR, batch_share, a step of several sequences: the prior's strength lambda
                                  //   is multiplied by this for the step (one cache serves the batch's sequences
                                  //   at once, so each finds less of its own in it); 1 = as alone, in [1, 100];
                                  //   default 3
};

// Cache: sizes and bookkeeping. Fixed for the life of the moecache.
struct moecache_cache_params {
    int32_t n_cached;             // experts kept per MoE layer, 0 <= n_cached <= N; < 0: use `fraction`; default -1
    float   fraction;             // share of the routed experts kept when n_cached < 0, in [0, 1]; default 0.5
                                  //   (rounded to the nearest count, at least 1 when fraction > 0)
    const int32_t * n_cached_per_layer; // optional [n_layer] per-layer sizes (-1 = use the above); copied at init; default NULL
    int32_t n_layer_sizes;        // length of n_cached_per_layer; default 0
    enum moecache_insertion insertion; // default MOECACHE_INSERTION_TOP_BOTTOM
    bool    update_on_prompt;     // prompt ubatches (> 1 token) update the cache and counters; default true
    int32_t trace_capacity;       // per-token trace records kept, newest win (ring buffer); 0 = off;
                                  //   at most MOECACHE_MAX_TRACE; default 0
    // residency (MMAP and STREAM need the model loaded after moecache_set_load_residency, see below)
    enum moecache_residency residency; // default MOECACHE_RESIDENCY_NONE
    const char * model_path;      // the single-file GGUF the model was loaded from (MMAP, STREAM); copied; default NULL
    int32_t io_threads;           // reads (or page locks) in flight at once on a miss, in [1, 64]; default 8
    bool    direct_io;            // STREAM: O_DIRECT reads where the OS and file system allow; default true
    bool    lock_memory;          // mlock the slot arena (STREAM) or the cached experts (MMAP); refused:
                                  //   one warning on stderr and the run goes on unlocked; default true
    bool    lock_dense;           // MMAP, STREAM: mlock the model's mapped weights other than the routed experts
                                  //   (the dense part every token reads; the token-embedding table only when the
                                  //   output reuses it), so that the OS cannot drop them and page them back in every
                                  //   token when memory runs short; refused: one warning, the run goes on; default true
    bool    overlap_experts;      // STREAM decode: a layer's expert matmuls (up, gate) take each selected expert as
                                  //   soon as its bytes are in its slot, so the cached experts compute while the
                                  //   misses are read and a miss waits only for its own bytes; false: the layer waits
                                  //   for all its reads, then runs llama.cpp's matmul. The same logits; default true
    enum moecache_prefetch prefetch; // STREAM only (ignored otherwise); default MOECACHE_PREFETCH_OFF
    int32_t prefetch_distance;    // d: predict layer l + d during layer l, in [1, MOECACHE_MAX_PREFETCH_DISTANCE];
                                  //   default 1
    float   prefetch_min_p;       // GATE and TRACE: a predicted expert is prefetched only if its predicted
                                  //   probability (GATE: softmax of layer l + d's router logits over all N;
                                  //   TRACE: its share of the prediction) is at least this, in [0, 1];
                                  //   PREVIOUS ignores it; default 0 (every predicted expert)
    int32_t prefetch_threads;     // STREAM: reader threads that may read ahead (prefetch) at once, in
                                  //   [0, io_threads], 0 = all of them; a miss waits at most for the chunks
                                  //   these are reading; default 0
    int32_t prefetch_spare;       // STREAM: spare slots per MoE layer for speculative reads, in [0, N]. 0: a
                                  //   prefetch is an insertion into the predicted layer's cache (above). > 0:
                                  //   the predicted experts that layer does not cache are read into its spare
                                  //   slots, at most this many per prediction, and the cache is left alone:
                                  //   routing, hits and misses are exactly those without prefetch, and a miss
                                  //   whose expert was read ahead waits only for what is still in flight.
                                  //   Costs this many experts' bytes per layer on top of the cache; default 0
    bool    prefetch_adaptive;    // prefetch_spare > 0: the reads ahead switch themselves off where they lose:
                                  //   a trial of 32 decoded tokens, with and without them in turn, compares
                                  //   the median time per token; they run for the next 96 tokens only if
                                  //   they were at least 2% faster, then a new trial. It follows the clock,
                                  //   so prefetch_route and prefetch_budget are off under it; default false
                                  //   (the reads ahead run under prefetch_budget, the same on every run)
    bool    prefetch_route;       // prefetch_spare > 0, STREAM, prefetch_adaptive false (the reads ahead
                                  //   do not follow the clock): the routing's prior counts the experts a prediction
                                  //   reads into this layer's spare slots as cached (issue 28's direction
                                  //   4, the cache left alone): a token picks what is being read over what
                                  //   is not. Not with the adaptive trial: the routing would follow its
                                  //   timing, and while the reads are off it pulls tokens toward experts
                                  //   nobody reads (measured: more misses); default true (false: routing,
                                  //   hits and misses exactly as without prefetch)
    float   prefetch_budget;      // prefetch_spare > 0, prefetch_adaptive false: the reads ahead of each
                                  //   layer spend a budget that only the routing refills, so a run reads
                                  //   ahead the same experts whatever the disk's timing: an expert read
                                  //   ahead (or found still in a slot) costs one expert, one the layer's
                                  //   token then selects earns back
                                  //   1 + this (nothing where prefetch_route's mark alone made the prior
                                  //   pick it: a miss the routing without the reads would not have had),
                                  //   and every decoded token adds 1/32 (a retry); the budget
                                  //   starts at prefetch_spare experts and holds at most 2 x prefetch_spare.
                                  //   So the experts read ahead for nothing stay under this many times
                                  //   those a token used, plus one per 32 tokens. In [0, 64]; < 0: no
                                  //   budget, every predicted miss is read (up to prefetch_spare);
                                  //   default 0 (the experts read ahead for nothing are about one per
                                  //   32 tokens and layer, so a slow disk loses little to them)
    enum moecache_eviction eviction; // default MOECACHE_EVICTION_LRU; moecache_set_eviction changes it
    float   eviction_decay;       // per-token decay of LFU / FREQ_PROB / ROUTER_MASS usage, in (0, 1]; default 0.95
    int32_t router_record;        // tokens of router outputs (z, p, s) kept per MoE layer for offline replay
                                  //   (moecache_get_router_record), the first ones; 0 = off; at most
                                  //   MOECACHE_MAX_TRACE; default 0
    bool    router_record_input;  // router_record: also keep each router's input, n_embd floats per token and
                                  //   layer (moecache_get_router_input; pymoecache.tune.fit_predictor); default false
    int32_t n_vram;               // STREAM: experts per MoE layer kept in device memory, for the layers whose
                                  //   dense part is on a GPU (n_gpu_layers), in [0, N]. A decoded token's
                                  //   experts held there are computed on the device; the others as
                                  //   vram_fill says. The host cache (routing, hits, misses, reads) is
                                  //   the same with or without it. With lowbit SOURCE the device bytes of
                                  //   n_vram experts hold as many companion copies as fit (up to N:
                                  //   moecache_vram_cached lists them); 0 = none; default 0
    enum moecache_vram_fill vram_fill; // default MOECACHE_VRAM_FILL_AUTO
    enum moecache_unified unified; // STREAM with GPU layers: experts computed by the device in place on the host
                                  //   slots; such a layer has no VRAM tier but with n_vram and every expert
                                  //   cached (the direct tier: moecache-vram-direct.cpp); default UNIFIED_AUTO
    enum moecache_vram_copy vram_copy; // n_vram: default MOECACHE_VRAM_COPY_ASYNC
    enum moecache_lowbit lowbit;  // STREAM: which selections of a decoded token are computed from the low-bit
                                  //   companion; default MOECACHE_LOWBIT_OFF (MISS and ALL with a VRAM tier
                                  //   or unified memory: refused; SOURCE runs with both)
    const char * lowbit_path;     // lowbit != OFF: the companion GGUF (checked against the model at init:
                                  //   every routed expert tensor, same shape, a smaller type); default NULL
    bool lowbit_in_ram;           // lowbit != OFF: every expert's low-bit copy is read into host memory at
                                  //   init (the companion's expert bytes, in lowbit_bytes), so a selection
                                  //   computed from it reads nothing on the token's critical path; false:
                                  //   a pool of K slots per layer, filled from the file per token; default false
    float lowbit_max_p;           // lowbit MISS: a miss whose router probability is at least this is read at
                                  //   full precision on the token's critical path, as without the companion
                                  //   (HOBBIT: the experts that weigh most); in (0, 1]; default 1 (every miss
                                  //   from the companion)
    bool vram_exclusive;          // n_vram: exclusive tiers. An expert in a device slot is not also kept in a
                                  //   host slot, so the two hold up to n_cached + n_vram experts of a layer
                                  //   (a model larger than the host cache's memory, with no read after warm-up
                                  //   where that is N). The cache the routing sees is both: a selection in
                                  //   either is a hit, and host evictions never take a device expert. A copy up
                                  //   frees the host slot; vram_fill's eviction of a device expert moves it
                                  //   down into that slot (copied back from the device: vram_copies_down).
                                  //   Where n_cached + n_vram >= N the routing prefers the device's experts.
                                  //   Layers whose host cache holds every expert keep the tier inclusive;
                                  //   copies up ahead (prefetch) are not made. Needs n_cached >= 1; default false
    int32_t n_seq;                // sequences decoded together in one llama_decode (a batch of one token per
                                  //   sequence: llama.cpp's n_seq_max), in [1, 256]. STREAM: each MoE layer has
                                  //   (n_seq - 1) x K more step slots (on Linux in pages all layers share), so the
                                  //   batch's selections are read into slots once each (their union) and each is
                                  //   computed from a slot as one sequence's are. A batch takes that path on the
                                  //   host slots (without a VRAM tier, low-bit pools or unified memory) when it
                                  //   has at most n_seq tokens; otherwise it is computed as a prompt is. default 1
    bool    share_steps;          // n_seq > 1: the layers share the step slots' pages (false: each keeps its own,
                                  //   more memory, which hold its step's selections to its next step); default true
};

// Counters of one layer (or, in moecache_stats, summed over MoE layers).
// hits + misses = selections; with no pruning selections = n_expert_used * tokens.
struct moecache_layer_stats {
    int32_t n_expert;             // N routed experts; 0 if this layer has not routed a token yet (or is dense)
    int32_t n_expert_used;        // K
    int32_t capacity;             // cache size M_l (experts)
    int32_t occupancy;            // experts in the cache now
    int64_t tokens;               // tokens routed through the policy's cache update
    int64_t selections;           // experts run (pruned slots excluded)
    int64_t hits;                 // selected and already cached
    int64_t misses;               // selected and not cached: must be brought in
    int64_t evictions;            // experts dropped to make room
    int64_t lifetime_count;       // cache entries measured (evicted ones + those resident now)
    double  lifetime_sum;         // tokens each entry stayed, insertion to eviction (or to now)
    float   delta;                // Delta_l used by PRIOR: running mean of max(score) - min(score)
    int32_t pinned;               // cached experts kept out of eviction now (moecache_profile_warm)
    int64_t pinned_hits;          // hits on pinned experts (included in hits)
    int64_t rerouted;             // experts run from outside the router's own top K (the policy chose them instead)
    double  p_given_up;           // sum over tokens of the router probability of its own top K less that of the
                                  //   experts run (0 under top-k; what cache-conditional routing costs a token)
};

struct moecache_stats {
    int32_t n_layer;              // layers of the model
    int32_t n_moe_layer;          // layers that routed at least one token through the moecache
    struct moecache_layer_stats total; // sums over MoE layers (n_expert, capacity: of the first one)
};

// What the residency costs, summed since init (or moecache_reset_stats). Times in milliseconds.
struct moecache_residency_stats {
    enum moecache_residency residency;
    int32_t io_threads;           // reads in flight at most
    bool    direct_io;            // STREAM reads bypass the page cache (O_DIRECT / F_NOCACHE)
    bool    locked;               // the arena (STREAM) or the cached experts (MMAP) are mlocked
    int64_t arena_bytes;          // STREAM: memory of the slot arenas (n_slots experts a layer; shared step slots once)
    int64_t locked_bytes;         // bytes mlocked now (experts; STREAM: less slots lent to a prompt, until a decode)
    int64_t dense_locked_bytes;   // bytes of the dense part mlocked now (lock_dense), page-rounded
    int64_t expert_bytes;         // bytes of one expert summed over its tensors (first MoE layer); lowbit
                                  //   SOURCE: of its companion copy, what a slot holds and a miss reads
    int64_t decode_tokens;        // decoded tokens routed (a batch of n sequences' tokens counts n)
    int64_t decode_loads;         // experts read from storage during those
    int64_t decode_bytes_read;    // bytes read from storage during those
    double  decode_t_io_ms;       // time the decode graph waited for expert reads (STREAM with prefetch: also
                                  //   the time spent issuing prefetches, whose slots may wait for a stale read)
    double  decode_t_route_ms;    // time spent in the routing decision (decode)
    int64_t prompt_bytes_read;    // bytes of experts read through the mapping by prompt ubatches
    double  prompt_t_io_ms;       // time prompt ubatches spent filling slots / locking pages
    int64_t rss_bytes;            // resident set size of the process now (0 where unknown)
    // prefetch (decode): bytes read for a token's own selection vs ahead of it (both are in decode_bytes_read)
    int64_t demand_bytes_read;    // bytes read because a token selected an expert no slot held
    int64_t prefetch_bytes_read;  // bytes read by prefetches (including cancelled ones' finished chunks)
    int64_t prefetch_issued;      // experts prefetched (inserted, or read into a spare slot, ahead of their
                                  //   layer's routing)
    int64_t prefetch_used;        // prefetched experts selected before they were evicted (spare slots: by the
                                  //   routing they were read for)
    int64_t prefetch_wasted;      // prefetched experts evicted (or cancelled) before any token selected them
                                  //   (spare slots: not selected by the routing they were read for)
    int64_t predicted_selected;   // selections of predicted layers that the prediction named
    int64_t predicted_total;      // selections of layers a prediction was made for (recall = selected / total)
    int64_t prefetch_tokens_on;   // decoded tokens with prefetch on (prefetch_adaptive: the others had it off)
    double  decode_t_read_ms;     // STREAM: wall time during which at least one expert read was in flight
                                  //   (on demand or ahead). The share of it hidden behind compute, the
                                  //   overlap, is 1 - decode_t_io_ms / decode_t_read_ms
    // STREAM: the slots of a layer whose cache holds all N experts are filled when the moecache is
    // made, as a resident model is read at load; its misses then read nothing (these two are not
    // reset by moecache_reset_stats)
    int64_t load_bytes_read;      // bytes read into the slots then
    double  load_t_io_ms;         // the time it took
    // VRAM tier (n_vram > 0): the selections of decoded tokens in the layers that have it, by the
    // tier their expert came from: vram_hits + vram_from_ram + vram_from_file = those selections;
    // and by what was done with the ones not in device memory: vram_copies + vram_cpu =
    // vram_from_ram + vram_from_file
    int64_t vram_bytes;           // device memory of the tier (every layer's slots and one zero slot)
    int64_t vram_hits;            // in device memory: computed there
    int64_t vram_from_ram;        // not, but in a host slot when the token came (cached, or read ahead)
    int64_t vram_from_file;       // not, and read from the file for this token
    int64_t vram_copies;          // copied up from their host slot, then computed on the device
    int64_t vram_copy_bytes;      // bytes copied up
    int64_t vram_cpu;             // computed on the CPU from their host slot (vram_fill)
    int64_t vram_ahead;           // copied up ahead of their layer's routing (prefetch's prediction for the
                                  //   layer, vram_copy ASYNC: the predicted experts that the host cache
                                  //   holds), in vram_copy_bytes too
    int64_t vram_ahead_used;      // of those, selected by the token they were copied for (vram_hits)
    double  vram_t_copy_ms;       // time the decode spent copying up (ASYNC: sending, and the copies'
                                  //   time that the CPU's matmuls did not hide); its waits for the host
                                  //   reads are I/O time, not this
    int64_t unified_bytes;        // host slots wrapped as device buffers (unified): their device computes
                                  //   those layers' experts in place; 0 = none
    int32_t unified_layers;       // MoE layers computed so
    int32_t vram_slots;           // device slots per layer of the VRAM tier (the most over layers): n_vram, or
                                  //   with lowbit SOURCE the companion copies that fit in their bytes; 0 = none
    int64_t vram_copies_down;     // vram_exclusive: device experts evicted by a copy up and moved down into its
                                  //   host slot (copied from the device), so that no tier drops an expert
    int32_t vram_exclusive_layers; // layers whose tiers are exclusive now
    // low-bit misses (lowbit != OFF): the selections of decoded tokens computed from the companion
    int64_t lowbit_bytes;         // memory of the low-bit pools (every layer's K slots, or with lowbit_in_ram
                                  //   its N copies, and a zero slot)
    int64_t lowbit_loads;         // selections computed from the companion (each read from it for its token)
    int64_t lowbit_bytes_read;    // bytes read from the companion for them (on the token's critical path)
    int64_t lowbit_behind;        // full copies read behind those tokens (in decode_loads too): one per miss;
                                  //   the token after a miss computes it from the companion again
    int32_t lowbit;               // enum moecache_lowbit that runs (SOURCE: the slots hold the companion's
                                  //   copies, and expert_bytes, the reads and the misses are theirs)
    // the device path, per decoded token's graph (any residency)
    int64_t decode_graphs;        // graphs computed for decoded tokens (a token's ubatch of one)
    int64_t decode_graph_splits;  // their graph splits, summed (ggml_backend_sched_get_n_splits: each split
                                  //   boundary between backends is a copy and a wait; stock llama.cpp's count
                                  //   for the same model and placement is moecache_context_graph_splits's)
    int64_t device_reads;         // reads of device memory our hooks made after those graphs (residency
                                  //   NONE with top-k or the prior on the device, which replaces a CPU split
                                  //   per MoE layer: one per device that holds MoE layers each decode step,
                                  //   queued behind its graph; none on the CPU, whose staging is host memory)
    int64_t decode_steps;         // decode ubatches routed: a batch of several sequences' tokens (n_seq) is one
                                  //   step of several decode_tokens; one sequence: = decode_tokens
    int64_t device_routed;        // layer-tokens the prior routed on a device (residency NONE beside GPU
                                  //   layers: the boosts uploaded once per token, ggml ops on the router's
                                  //   outputs; checked after the graph against moecache_route_token)
    int64_t device_route_differs; // of those, where moecache_route_token chose other experts: boosted scores
                                  //   tied exactly, which ggml's sort breaks its own way (the cache and the
                                  //   counters follow moecache_route_token's choice)
    int64_t vram_pinned_bytes;    // n_vram: bytes of the host slot arena registered with the tier's device as
                                  //   pinned memory, so that copies up are its DMA (CUDA, with lock_memory and
                                  //   GGML_CUDA_NO_PINNED unset; the library sets GGML_CUDA_REGISTER_HOST=1,
                                  //   which ggml-cuda asks for, where it is unset); 0 = pageable (other
                                  //   devices, or refused)
    int64_t device_steps;         // decode steps routed on their device, counted after the graph (CPU: no read)
    int64_t decode_selections;    // selections of decoded tokens (experts run; pruned slots excluded)
    int64_t decode_union;         // distinct experts of each decode step and layer, summed (= selections alone)
    int64_t direct_tokens;        // decoded tokens whose MoE layers the direct tier computed (moecache-vram-direct.cpp)
    int32_t direct_choice;        // unified AUTO, a direct tier: 0 none or its trial runs, 1 it won, 2 the round trip
    double  direct_ms;            // the trial's median token: direct,
    double  round_trip_ms;        //   and with the tier's round trip (0 before it ends)
};

// one (layer, token) routing decision, for timelines and offline analysis
struct moecache_trace_record {
    int32_t  layer;
    int32_t  n_selected;                         // experts run for this token (<= MOECACHE_TRACE_MAX_USED)
    int64_t  token;                              // index of the token at this layer (stats.tokens before it)
    int32_t  experts[MOECACHE_TRACE_MAX_USED];   // selected expert ids, in router-rank order
    uint32_t hit_mask;                           // bit i set: experts[i] was a hit
    uint32_t top_k_mask;                         // bit i set: experts[i] is also in the stock top-K
};

MOECACHE_API uint32_t     moecache_abi_version(void); // MOECACHE_ABI_VERSION of the library
MOECACHE_API const char * moecache_version(void);     // "pymoecache <version> (llama.cpp from llama-cpp-python <pin>)"
MOECACHE_API const char * moecache_last_error(void);  // message of the last failure on this thread, "" if none

MOECACHE_API struct moecache_cache_params   moecache_cache_default_params(void);
MOECACHE_API struct moecache_routing_params moecache_routing_default_params(void);

// Checks the parameters against the model (N and K come from its GGUF metadata).
// Returns NULL on error (MoE-less model, n_cached > N, top_j > K, ...): see moecache_last_error().
MOECACHE_API struct moecache * moecache_init(const struct llama_model * model, struct moecache_cache_params cparams,
                                             struct moecache_routing_params rparams);

// Models loaded by this thread from now on are prepared for `residency`: MMAP and STREAM turn
// off the mmap prefetch (experts are not read at load time) and keep the routed experts in the
// file's layout in the mapping (the slots are read in it), not repacked; every other weight gets
// the buffer type a resident model's gets (the CPU's repacked layouts where llama.cpp has one
// for its type). NONE (the default) restores stock loading.
MOECACHE_API void moecache_set_load_residency(enum moecache_residency residency);

// Detaches (if attached) and frees. Detaching waits for the context's work in flight
// (llama_synchronize): its last graph may still run on a device with this cache's buffers in it.
MOECACHE_API void moecache_free(struct moecache * mc);

// Route ctx's MoE layers through mc from its next llama_decode on (the graph is rebuilt once).
// One context per moecache and one moecache per context. With MMAP or STREAM residency this
// sets ctx's abort callback (llama_set_abort_callback): a failed expert read stops the decode.
MOECACHE_API int32_t moecache_attach(struct moecache * mc, struct llama_context * ctx);
MOECACHE_API void    moecache_detach(struct moecache * mc);

// Validated like moecache_init; on error the old parameters stay.
MOECACHE_API int32_t moecache_set_routing(struct moecache * mc, struct moecache_routing_params rparams);
MOECACHE_API struct moecache_routing_params moecache_get_routing(const struct moecache * mc);

// Fixed per-layer Delta_l for PRIOR (from a calibration run) instead of the running mean.
// delta: [n] values, n <= n_layer; an entry <= 0 keeps the running mean for that layer; NULL clears all.
MOECACHE_API int32_t moecache_set_prior_delta(struct moecache * mc, const float * delta, int32_t n);

// Per-layer strength of PRIOR: layer l boosts its cached experts by lambda * scale[l] * Delta_l
// (tuned per layer: pymoecache/tune.py). scale: [n] finite values >= 0, n <= n_layer; 0 = stock
// routing at that layer (Top-J aside, which keeps r[0:J] anyway); layers from n on and NULL: 1 (default).
// On error nothing changes. Takes effect on the next token.
MOECACHE_API int32_t moecache_set_prior_scale(struct moecache * mc, const float * scale, int32_t n);

MOECACHE_API void    moecache_reset_stats(struct moecache * mc); // counters and trace to zero; cache kept
// A new request starts (a new prompt, not a continuation): PREFETCH_TRACE files the expert counts
// of the request that ends into its store (at most 32 requests; one within cosine 0.95 of a stored
// one is merged into it) and starts counting anew. Harmless with other prefetch modes.
MOECACHE_API void    moecache_begin_request(struct moecache * mc);
// Empties every layer's cache (and the running Delta, the eviction usage, the pins and the current request's
// counts; the profile stays) and its residency: no expert's bytes stay in a slot, a lock or the VRAM tier (a
// layer filled with every expert at creation keeps them): the next misses read as a fresh cache's do.
MOECACHE_API void    moecache_clear(struct moecache * mc);

// Validated like moecache_init (decay in (0, 1]); the next eviction decides by the new policy.
MOECACHE_API int32_t moecache_set_eviction(struct moecache * mc, enum moecache_eviction eviction, float decay);
MOECACHE_API enum moecache_eviction moecache_get_eviction(const struct moecache * mc);

MOECACHE_API int32_t moecache_n_layer(const struct moecache * mc);
MOECACHE_API int32_t moecache_get_stats(const struct moecache * mc, struct moecache_stats * out);
MOECACHE_API int32_t moecache_get_layer_stats(const struct moecache * mc, int32_t il, struct moecache_layer_stats * out);

// Experts cached in layer il, least recently used first. Returns how many (<= cap are written).
MOECACHE_API int32_t moecache_get_cached(const struct moecache * mc, int32_t il, int32_t * ids, int32_t cap);
// The same for the experts in layer il's device slots (the VRAM tier, n_vram); 0 where it has none.
MOECACHE_API int32_t moecache_get_vram_cached(const struct moecache * mc, int32_t il, int32_t * ids, int32_t cap);

MOECACHE_API int32_t moecache_get_residency_stats(const struct moecache * mc, struct moecache_residency_stats * out);
// Hits and misses per token row of the decode steps since the last call (a row of the ubatch: a batch of
// several sequences has one per sequence), summed over the MoE layers and those steps: hits[i], misses[i]
// for i < min(rows, n_max); the sums start over at this call, and at a step of another number of rows.
// Returns the rows (0 before a decode step). How a batch's counters split by sequence
// (pymoecache.BatchDecoder reads them when its sequences change, not every step: on the device path a
// read waits for the device).
MOECACHE_API int32_t moecache_get_step_rows(const struct moecache * mc, int32_t * hits, int32_t * misses, int32_t n_max);
// Graph splits of the graph `ctx` computed last (any context of this library, a stock one too: the
// benchmark prints stock llama.cpp's beside ours); 0 before its first.
MOECACHE_API int32_t moecache_context_graph_splits(const struct llama_context * ctx);
// The non-finite values (NaN, inf) among the logits of output row i of `ctx` (i as
// llama_get_logits_ith takes it: -1 the last), -1 where it has no such row. Unlike llama_get_logits_ith
// it does not synchronize (on RPC a round trip through ggml's client thread): call it once something
// did (llama_get_logits*, a sampler, llama_synchronize) since the last llama_decode.
MOECACHE_API int32_t moecache_context_nonfinite_logits(struct llama_context * ctx, int32_t i);

// A failed or short expert read (file truncated, unreadable) stops the llama_decode that needed
// it (it returns 2, "aborted", and its output is not used); the expert is read again next time.
// Returns that error's message and clears it, or NULL if there was none.
MOECACHE_API const char * moecache_take_io_error(struct moecache * mc);

// Starts recording a timeline of at most `capacity` events, clearing what was recorded (the first
// `capacity` are kept; 0 stops recording and frees them). Reads, locks and copies are recorded
// with STREAM or MMAP residency; routing and waits with any.
MOECACHE_API int32_t moecache_timeline_start(struct moecache * mc, int32_t capacity);
// Copies up to cap events recorded so far, in the order they ended; returns how many were recorded
// (events that did not fit the capacity are counted in *n_dropped, which may be NULL).
MOECACHE_API int32_t moecache_timeline_get(const struct moecache * mc, struct moecache_event * out, int32_t cap,
                                           int64_t * n_dropped);
MOECACHE_API int64_t moecache_time_now_us(void); // the timeline's clock (microseconds, monotonic)

// Copies up to cap trace records, oldest first; returns how many. Records are not consumed.
MOECACHE_API int32_t moecache_get_trace(const struct moecache * mc, struct moecache_trace_record * out, int32_t cap);

// The router outputs recorded for layer il (cache params: router_record), tokens in order:
// logits, probs, scores: out [cap, N] each (any may be NULL); rank_on_logits: out (may be NULL), the
// prior boosts z (softmax router) rather than s. Returns the tokens recorded (rows written: at most cap).
MOECACHE_API int32_t moecache_get_router_record(const struct moecache * mc, int32_t il, float * logits, float * probs,
                                                float * scores, int32_t cap, bool * rank_on_logits);
// With router_record_input: the router's input (the FFN input its matmul takes, [n_embd] per token) of the same tokens
// as moecache_get_router_record, where the graph's router is the plain matmul on it (0 rows elsewhere, and without
// router_record_input): copies min(cap, T) rows into x [cap, n_embd] (may be NULL), sets *n_embd; returns T. What
// pymoecache.tune.fit_predictor fits a layer's predictor on.
MOECACHE_API int32_t moecache_get_router_input(const struct moecache * mc, int32_t il, float * x, int32_t cap,
                                               int32_t * n_embd);
// GATE prefetch: a fitted predictor of layer il, w [n_expert, n_embd] F32 (row e: expert e's weights, the layout of the
// router's own ffn_gate_inp; copied), applied in place of il's router to an earlier layer's FFN input to predict il's
// experts (the router's bias, if any, is still added). w = NULL: back to the router. Prediction only: routing and
// logits never change. Takes effect on the next graph. MOECACHE_ERR_INVALID for a layer without a router of N experts,
// n_embd other than the router's, or a value that is not finite.
MOECACHE_API int32_t moecache_set_predictor(struct moecache * mc, int32_t il, const float * w, int32_t n_embd);

// Cache contents (with recency order) and Delta per layer, tied to the model's identity (description,
// parameter count, layer and expert counts, and the id set by moecache_set_model_id: pymoecache sets a
// content fingerprint of the GGUF). Save writes a temporary file beside `path`, syncs it and renames it
// over `path` (a failed save leaves the old file; a write error is MOECACHE_ERR_IO). Load reads regular
// files only, checks a checksum and every field (ids in range and unique, Delta finite and >= 0) before
// it changes anything: a damaged file is MOECACHE_ERR_CORRUPT, another model's MOECACHE_ERR_MISMATCH.
MOECACHE_API int32_t moecache_state_save(const struct moecache * mc, const char * path);
MOECACHE_API int32_t moecache_state_load(struct moecache * mc, const char * path);
MOECACHE_API int32_t moecache_set_model_id(struct moecache * mc, const char * id); // NULL, "": none; MOECACHE_OK

// The model file shrinking under a running process (moecache-guard.cpp). llama.cpp maps the GGUF; once another process
// truncates it, touching a page past the new end raises SIGBUS. While a guard is added, a SIGBUS inside the model's
// mapping is answered with a page of zeros instead, and counted: check moecache_guard_faults() after each decode and
// discard that decode's output when it grew (its logits came from zeros). A SIGBUS elsewhere goes to the previous
// handler. Returns a guard id >= 0; MOECACHE_ERR_STATE when nothing of `path` is mapped (use_mmap off).
MOECACHE_API int32_t moecache_guard_add(const struct llama_model * model, const char * path);
MOECACHE_API int64_t moecache_guard_faults(int32_t id);   // pages replaced by zeros since moecache_guard_add
MOECACHE_API void    moecache_guard_remove(int32_t id);   // before the model is freed

// A device that is `dev` in everything but the memory it reports: `free` and `total` bytes (moecache-rpc.cpp).
// `pymoecache rpc-server --mem` serves one: a client plans its GPU layers for that much device memory. dev: a
// ggml_backend_dev_t. Lives until the process ends; NULL when dev is NULL or free > total.
MOECACHE_API void * moecache_device_with_memory(void * dev, size_t free, size_t total);

// Usage profile (moecache-profile.cpp): what past requests selected, kept across processes. It holds,
// per layer, the count of every expert's selections over the requests filed by moecache_begin_request (a
// request's tokens are filed when the next one begins), and the PREFETCH_TRACE store of past requests. Saved
// atomically, tied to the model and checked on load as the state files above; a load replaces the profile.
MOECACHE_API int32_t moecache_profile_save(const struct moecache * mc, const char * path);
MOECACHE_API int32_t moecache_profile_load(struct moecache * mc, const char * path);
// counts: out [N] selections of layer il's experts in the profile (past requests, not the current one)
MOECACHE_API int32_t moecache_profile_get(const struct moecache * mc, int32_t il, double * counts, int32_t n);
// Warm start: every layer's cache is emptied and refilled with its most selected experts of the profile (at most its
// capacity; never-selected experts stay out; the hottest is the most recent), and its n_pin hottest are pinned: never
// evicted until moecache_clear or the next warm start. n_pin is capped per layer at capacity - K (a token's misses
// always find room). STREAM reads the experts on the next decode (or copies them from the mapping on the next prompt).
// A VRAM tier (n_vram) gets each layer's n_vram hottest in its device slots now, read from the mapping (lowbit SOURCE:
// from the companion). Returns the number of experts pinned over all layers, or an error (n_pin < 0; MOECACHE_ERR_IO: a
// companion's read failed).
MOECACHE_API int32_t moecache_profile_warm(struct moecache * mc, int32_t n_pin);

// Routes n_tokens tokens of layer il exactly as the graph op does and updates the cache and
// counters (for tests and trace replay; the hook calls the same code).
//   logits:   [n_tokens, n_expert] router logits z
//   probs:    [n_tokens, n_expert] gating probabilities p
//   scores:   [n_tokens, n_expert] selection score s (p, p + bias, -INFINITY = masked); NULL = probs
//   selected: [n_tokens, n_expert_used] out: chosen experts, router-rank order, dropped slots = -1
//   hits:     [n_tokens, n_expert_used] out, may be NULL: 1 hit, 0 miss, -1 dropped slot
// rank_on_logits: PRIOR boosts logits (softmax models without bias) instead of scores.
// Layer il must have n_expert == N of the moecache's model (or any N when the moecache was
// made with moecache_init_synthetic).
MOECACHE_API int32_t moecache_route(struct moecache * mc, int32_t il, const float * logits, const float * probs,
                                    const float * scores, int32_t n_expert, int32_t n_expert_used, int32_t n_tokens,
                                    bool rank_on_logits, int32_t * selected, int8_t * hits);

// As moecache_route, the n_tokens rows being one decode step of n_tokens sequences (a batch, one token
// each), routed as the graph op routes such a step: with routing params batch_share, in two passes.
MOECACHE_API int32_t moecache_route_step(struct moecache * mc, int32_t il, const float * logits, const float * probs,
                                         const float * scores, int32_t n_expert, int32_t n_expert_used,
                                         int32_t n_tokens, bool rank_on_logits, int32_t * selected, int8_t * hits);

// A moecache without a model, for moecache_route (tests, offline simulation): n_layer layers
// of n_expert experts, n_expert_used per token.
MOECACHE_API struct moecache * moecache_init_synthetic(int32_t n_layer, int32_t n_expert, int32_t n_expert_used,
                                                       struct moecache_cache_params cparams,
                                                       struct moecache_routing_params rparams);

#ifdef __cplusplus
}
#endif
