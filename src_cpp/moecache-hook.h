// moecache-hook.h - the only functions patched llama.cpp calls (see patches/).
//
// Not a public API: users include moecache.h. Every hook is a no-op (returns its input
// unchanged) when no moecache is attached to the context whose graph is being built, so a
// stock context keeps its exact graph and logits.
//
// Life of one graph build (llama_context::process_ubatch):
//   moecache_hook_graph_reusable(ctx)  false once after attach/detach: the old graph is rebuilt
//   moecache_hook_graph_begin(ctx, n_tokens, n_seqs)  remembers which moecache this thread is building
//                                      for, and whether the ubatch decodes (one token per sequence)
//     build_moe_ffn -> moecache_hook_select / moecache_hook_weights, once per MoE layer
//   moecache_hook_graph_end(ctx)
//   (graph computed) moecache_hook_ubatch_computed(ctx)   counts what the graph left to count
#pragma once

struct ggml_cgraph;
struct ggml_context;
struct ggml_tensor;
struct llama_context;
struct ggml_backend_buffer_type;

#include <stdint.h>

// Model loading (llama_model_load): with moecache_set_load_residency(MMAP or STREAM) on this
// thread, the routed experts stay in the file's layout in the mapping (the CPU buffer type where
// llama.cpp chose one of the CPU's repacking extra types or a GPU layer's device, as its
// --cpu-moe does; the other weights keep the type it chose, as a resident model's do) and the
// mapping is not prefetched.
//   name: the weight's GGUF name; buft: llama.cpp's choice for it. Returns the type to use.
struct ggml_backend_buffer_type * moecache_hook_weight_buft(const char * name, struct ggml_backend_buffer_type * buft);
bool moecache_hook_mmap_prefetch(void);

bool moecache_hook_graph_reusable(const llama_context * lctx);
// n_tokens: the ubatch's tokens; n_seqs: its distinct sequences (llama_ubatch::n_seqs_unq). A ubatch
// of one token per sequence decodes (a batch of several sequences, or one token); otherwise a prompt.
void moecache_hook_graph_begin   (const llama_context * lctx, int64_t n_tokens, int64_t n_seqs);
void moecache_hook_graph_end     (const llama_context * lctx);
void moecache_hook_context_free  (const llama_context * lctx);
// After a ubatch's graph computed (llama_context::process_ubatch, before its outputs are read):
// the decoded token's graph splits, and the routing the device path left for after the graph
// (moecache-device.cpp).
void moecache_hook_ubatch_computed(const llama_context * lctx);

// Replaces the stock top-k selection with the moecache routing op.
//   selected:  stock ggml_argsort_top_k result            // I32 [n_expert_used, n_tokens]
//   logits:    router logits z                             // F32 [n_expert, n_tokens]
//   probs:     gating probabilities p (weights come from these)
//   selection: the score the model ranks by (p, p + bias, group-masked with -inf)
//   gating_op: llama_expert_gating_func_type; has_bias: selection = p + b
//   warmup:    llama.cpp's warm-up run routes to every expert; never hooked
//   gf:        the graph being built (the device path adds its copies to it)
ggml_tensor * moecache_hook_select(
        ggml_context * ctx,
        ggml_cgraph  * gf,
        ggml_tensor  * selected,
        ggml_tensor  * logits,
        ggml_tensor  * probs,
        ggml_tensor  * selection,
        int            il,
        int            gating_op,
        bool           has_bias,
        bool           warmup);

// Zeroes the router weight of slots a policy dropped (prune). `selected` must be the tensor
// moecache_hook_select returned for the same layer; otherwise weights pass through.
//   weights: F32 [1, n_expert_used, n_tokens]
ggml_tensor * moecache_hook_weights(
        ggml_context * ctx,
        ggml_tensor  * weights,
        ggml_tensor  * selected,
        int            il,
        int            gating_op);

// ggml_mul_mat_id for the expert matmuls (build_lora_mm_id). For an expert tensor of a moecache
// with MMAP or STREAM residency, the ids first pass through the layer's residency op, and STREAM
// decode graphs read the layer's slot arena with slot ids; otherwise the stock op.
//   as: [ne0, ne1, N] expert weights; b: activations; ids: I32 [n_expert_used, n_tokens]
ggml_tensor * moecache_hook_mul_mat_id(
        ggml_context * ctx,
        ggml_tensor  * as,
        ggml_tensor  * b,
        ggml_tensor  * ids);
