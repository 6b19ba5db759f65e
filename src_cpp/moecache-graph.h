// moecache-graph.h - our ops in llama.cpp's graph (moecache-graph.cpp): where they are placed, the context
// registry behind moecache_attach, and the reads ahead of the layer that needs them (moecache-ahead.cpp).
// Not installed.
#pragma once

#include "moecache-layer.h"

struct moecache;

// places an op of ours on the CPU backend when the graph being built has GPU layers; returns t
ggml_tensor * moecache_graph_on_cpu(ggml_tensor * t);
// b where it is the layer's FFN input on the device and the CPU read a copy of it (with the router's
// logits): that copy, shaped as b; b otherwise
ggml_tensor * moecache_graph_host_input(moecache_layer & L, ggml_context * ctx, ggml_tensor * b);
// places t on the backend of the device whose memory buft is, when that backend computes t; returns t
ggml_tensor * moecache_graph_on_device(ggml_tensor * t, struct ggml_backend_buffer_type * buft);
// where layer il's dense part lives: its router weight's buffer type; nullptr where there is none
struct ggml_backend_buffer_type * moecache_layer_buft(const struct llama_model * model, int32_t il);
// moecache-graph.cpp: the context registry behind moecache_attach / moecache_detach
int32_t moecache_graph_attach(moecache * mc, llama_context * ctx);
void    moecache_hook_detach(moecache * mc);       // (waits for the context's work in flight first)
void    moecache_graph_wait(moecache & mc);         // the attached context's work in flight, waited for
void    moecache_graph_set_load_residency(enum moecache_residency residency);
void    moecache_graph_mark_dirty(moecache * mc);  // the attached context builds its next graph afresh
const float * moecache_row_f32(const ggml_tensor * t, int64_t i1); // row i1 of a 2-d F32 tensor on the host
bool moecache_residency_abort(void * mc);  // llama_set_abort_callback: true after a failed read
// moecache-graph-route.cpp: the routing ops of a MoE layer (userdata: its moecache_layer). select: I32
// [K + 2, n_tokens], each token's K experts, how many run, SWAP_RANK's replaced one; weights: F32 [1, K, n_tokens]
void moecache_op_select(ggml_tensor * dst, int ith, int nth, void * userdata);
void moecache_op_weights(ggml_tensor * dst, int ith, int nth, void * userdata);
