// moecache-vram-direct.h - the direct tier (moecache-vram-direct.cpp): a decoded token's MoE layer computed on its
// device alone, the tier's hits from the device slots and the rest from the host slots over the bus. Not installed.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <vector>

struct moecache;
struct moecache_layer;
struct moecache_expert_tensor;

struct moecache_vram_direct {
    bool                  on  = false;   // every layer with experts takes it (moecache_vram_direct_init)
    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr; // on the tier's device
    ggml_tensor *         tab = nullptr; // I32 [3R, n_layer], per layer (R = n_expert padded to 64 ints):
                                         //   [0, R) the tier slot of each expert (0 where it has none),
                                         //   [R, 2R) its host slot (the zero slot where the tier has it),
                                         //   [2R, 3R) F32 1 where the tier has it, else 0
    std::vector<int32_t>  host;          // what was uploaded last
    int64_t               row = 0;       // R
};

// wanted: layer L, computed in place on the host slots (unified), also gets a VRAM tier: it caches every expert
bool          moecache_vram_direct_wanted(const moecache & mc, const moecache_layer & L);
// init (after the tier's slots): on where every layer with experts has both; free: the table's buffer
int32_t       moecache_vram_direct_init(moecache & mc);
void          moecache_vram_direct_free(moecache & mc);
// whether a decoded token's layer L is built direct (the device path routes it: moecache-device.cpp)
bool          moecache_vram_direct_layer(const moecache & mc, const moecache_layer & L);
// an expert matmul of layer L computed direct: [n_out, K, T] from the tier's and the host's slots
ggml_tensor * moecache_vram_direct_mul_mat_id(moecache & mc, moecache_layer & L, ggml_context * ctx,
                                              const moecache_expert_tensor & x, ggml_tensor * b, ggml_tensor * ids);
// a counted token's selections of layer L: the tier's counters and its copies up (finished before the next upload)
void          moecache_vram_direct_follow(moecache & mc, moecache_layer & L, const int32_t * sel, int32_t n);
// before a ubatch computes: the tier's copies finished, the table uploaded (one write)
void          moecache_vram_direct_upload(moecache & mc);
