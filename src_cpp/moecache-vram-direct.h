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
    bool                  use = false;   // decoded tokens take it now; else the tier's round trip (the trial's
                                         //   other side, or what it chose)
    struct {                             // unified AUTO: a trial decides between it and the round trip, once
        bool    on     = false;          //   the trial runs (AUTO), or ran
        int32_t left   = 0;              //   decoded tokens left in it (0: decided)
        int64_t t_last = 0;              //   when the last counted token's ubatch was queued (us), 0 = none
        bool    direct = false;          //   that token ran direct
        std::vector<int64_t> dt_direct, dt_round; // token times of each side (us)
        double  ms_direct = 0.0, ms_round = 0.0;  // their medians once decided
    } trial;
    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr; // on the tier's device
    ggml_tensor *         tab = nullptr; // I32 [3R, n_layer], per layer (R = n_expert padded to 64 ints):
                                         //   [0, R) the tier slot of each expert (0 where it has none),
                                         //   [R, 2R) its host slot (the zero slot where the tier has it),
                                         //   [2R, 3R) F32 1 where the tier has it, else 0
    std::vector<int32_t>  host;          // what was uploaded last
    int64_t               row = 0;       // R
};

// wanted: layer L also gets a VRAM tier beside its wrapped host slots (unified ON, or AUTO on a discrete GPU): it
// caches every expert
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
// after a ubatch was queued (decoded: one token's): the trial's clock; true where the side changes (a graph
// built afresh follows it)
bool          moecache_vram_direct_trial(moecache & mc, bool decoded);
// its trial's outcome in the stats (direct_choice, direct_ms, round_trip_ms)
void          moecache_vram_direct_stats(const moecache & mc, struct moecache_residency_stats * out);
// decoded tokens of layer L computed in place (unified) where they do not take the direct tier's graph; beside a
// direct tier they take its round trip (the trial's other side or choice, a batch step, a routing not on the device)
bool          moecache_vram_direct_in_place(const moecache & mc, const moecache_layer & L);
