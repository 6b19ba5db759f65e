// moecache-residency.h - where the experts' bytes live and how a matmul reaches them: the residencies
// (moecache-residency.cpp, -mapping.cpp, -slots.cpp: STREAM's arena), the row-by-row matmuls (-matmul.cpp),
// low-bit misses (-lowbit.cpp), unified memory (-unified.cpp) and the locked dense part (-dense.cpp).
// Not installed.
#pragma once

#include "moecache-layer.h"

#include <array>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

struct moecache;

// the residency's state of a moecache: the files the experts are read from, the reader threads, STREAM's
// slot arena, the locks (moecache-residency.cpp, -slots.cpp, -dense.cpp)
struct moecache_residency_state {
    std::string   path;                       // the GGUF
    std::string   src_path;                   // STREAM: the file the slots are read from (path, or the companion)
    int           fd        = -1;             // buffered reads, fadvise
    int           fd_direct = -1;             // O_DIRECT reads, or -1
    int           fd_lowbit = -1;             // the low-bit companion (cache params lowbit), or -1
    int           fd_lowbit_direct = -1;      //   and with O_DIRECT (cache params direct_io), or -1
    moecache_io * io        = nullptr;        // reader threads
    char *        arena     = nullptr;        // STREAM: all layers' slots, one anonymous mapping
    size_t        arena_size = 0;
    size_t        arena_shared = 0;           // bytes of the arena that map the step slots' pages a second time or
                                              //   more (moecache_slots_init): arena_size less these is its memory
    int32_t       step_owner = -1;            // the layer whose experts the step slots' pages hold now, or -1
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
    int64_t       refill_bytes = 0;           // a prompt layer's copies into the slots it took back (moecache_slots_lend)
    std::vector<std::array<int32_t, 3>> fill_behind; // (layer, slot, expert) a prompt left to read once its ubatch
                                                     //   ran (moecache_slots_prompt)
};

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
void    moecache_mapping_begin(moecache & mc, int32_t il_prompt, const int32_t * ids, int64_t n_ids);
// a prompt ubatch (either residency) or an MMAP decode: asks for, locks and drops L's pages so
// they follow L's cache; STREAM prompts copy the cached experts into their slots
void    moecache_mapping_sync(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids, bool decode);
void    moecache_mapping_advise_random(moecache & mc, const moecache_layer & L); // MMAP: no readahead on L's experts
void    moecache_mapping_advise_stream(moecache & mc); // STREAM short of memory for its experts: 2 MiB folios
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
// slot s of L holds nothing: its read (prefetch or not) cancelled, its expert (if any) in no slot
void    moecache_slots_empty(moecache & mc, moecache_layer & L, int32_t s);
// moecache-matmul.cpp: a STREAM decode's matmul over expert tensor x of L with activations b, on
// the slots (ids: L.graph.ids_out): with overlap_experts, each expert as soon as its bytes arrive
ggml_tensor * moecache_matmul_stream_decode(moecache & mc, moecache_layer & L, ggml_context * ctx,
                                            const moecache_expert_tensor & x, ggml_tensor * b);
void    moecache_slots_prompt(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids);
// the slots prompts left to fill behind them (fill_behind): their reads queued, at prefetch priority
void    moecache_slots_fill_behind(moecache & mc);
// moecache-lend.cpp: a prompt ubatch short of memory for its reads: the last layers whose slots only the CPU
// reads give the pages of their own slots back, about `bytes` (their experts stay cached, in no slot), until the
// prompt's copies fill them at their layer; relock: a decode locks those pages again (where the arena is locked)
void    moecache_slots_lend(moecache & mc, int64_t bytes);
void    moecache_slots_relock(moecache & mc);
// the bytes of the slots of layers [il0, il1] lent now (unlocked: or filled again, not locked again yet)
int64_t moecache_slots_lent_bytes(const moecache & mc, int32_t il0, int32_t il1, bool unlocked = false);
