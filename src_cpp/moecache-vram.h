// moecache-vram.h - the VRAM tier (moecache-vram.cpp): device slots over the host slots; its graph
// (moecache-vram-graph.cpp). Not installed.
#pragma once

#include "moecache-layer.h"

struct moecache;

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
// J's layout (moecache-vram.cpp, above its op) for a step of n selections (K x T): the ids' two rows and the routing
// weights, each R floats (R = n rounded up to 64: 256 bytes, a device's storage buffer offsets must be aligned),
// then the CPU's down output
inline int64_t moecache_vram_joint_row(int64_t n) { return (n + 63) / 64 * 64; } // R
// the tier's CPU op of a layer's decode (J): the token's copies up finished, the ids [K, 2] and the CPU's down
// output written for the device (moecache-vram.cpp; the graph, moecache-vram-graph.cpp, builds it)
void          moecache_vram_op_joint(ggml_tensor * dst, int ith, int nth, void * userdata);
// moecache-vram-exclusive.cpp: exclusive tiers. stage_down: pinned host memory of the device for a token's moves
// down (mc.res.down_stage); claim: e, now in device slot vs, leaves the host tier and the slot's previous expert old
// (-1: none) moves down into e's host slot hs; settle: once the token's copies up have left their host slots
void          moecache_vram_stage_down(moecache & mc, ggml_backend_dev_t dev, size_t need);
void          moecache_vram_exclusive_claim(moecache_layer & L, int32_t e, int32_t old, int32_t vs, int32_t hs);
void          moecache_vram_exclusive_settle(moecache & mc, moecache_layer & L);
