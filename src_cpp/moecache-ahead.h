// moecache-ahead.h - reads ahead of the layer that needs them (moecache-ahead.cpp): the predictors of GATE
// prefetch, a prompt's read-ahead, the adaptive trial and the reads a routing decided for spare slots.
// Not installed.
#pragma once

#include "moecache-layer.h"

#include <vector>

struct moecache;

struct moecache_ahead {
    // GATE prefetch: fitted predictors (moecache_set_predictor), [n_layer] tensors [n_embd, N] in their own
    // CPU buffer, used in place of a layer's router to predict it; nullptr = its router
    ggml_context *               pred_ctx = nullptr;
    ggml_backend_buffer *        pred_buf = nullptr;
    std::vector<ggml_tensor *>   pred_w;
    std::vector<uint8_t>         pred_on;
    std::vector<moecache_io_req> req;          // [n_layer] a prompt's read-ahead of a layer, on the reader threads
    int32_t last = -1;                         // the last layer read ahead in this ubatch, or -1
    int32_t last_e = 0;                        // its experts asked for, in order (n_expert: all of them)
    std::vector<uint8_t> selected;             // [n_expert] the experts a prompt's layer selected (scratch)
    int32_t faulted = -1;                      // STREAM: a prompt's layer left to the kernel's readahead (no room
                                               //   to ask for it whole: asked experts would evict each other), or -1
    struct {                                   // prefetch_adaptive: the on/off trial
        bool    on      = true;                //   reads ahead are issued for this token
        int32_t phase   = 0;                   //   0: the trial (on and off in turn), 1: running the winner
        int32_t left    = 0;                   //   tokens left in this phase (0: not started)
        int64_t t_last  = 0;                   //   when the previous decoded token started (us), 0 = none
        std::vector<int64_t> dt_on, dt_off;    //   token times of the trial's two sides (us)
    } trial;
    struct {                                   // prefetch_spare: reads decided by a layer's routing, queued by
        int32_t target = -1;                   //   its residency op after its own reads (target layer, or -1)
        int32_t n      = 0;
        int32_t ids[MOECACHE_MAX_USED];
        float   score[MOECACHE_MAX_USED];
    } pending;
};

// GATE prefetch, decode graphs: layer il + d's router (or its fitted predictor) applied to layer il's
// FFN input, [n_expert, n_tokens] (several: a decode step of sequences); nullptr when there is nothing to predict
ggml_tensor * moecache_ahead_predict_router(moecache & mc, ggml_context * ctx, ggml_tensor * logits, int il,
                                            int64_t n_tokens);
// during layer L's decode, after it routed: predict what layer L + d selects, read the misses
// (pred: moecache_ahead_predict_router's output, computed; nullptr without GATE)
void          moecache_ahead_prefetch(moecache & mc, moecache_layer & L, const ggml_tensor * pred);
// the same for a decode step of n_tokens sequences (pred [n_expert, n_tokens]): the union of their predictions
void          moecache_ahead_prefetch_step(moecache & mc, moecache_layer & L, const ggml_tensor * pred, int64_t n_tokens);
void          moecache_ahead_trial_token(moecache & mc, int64_t now); // prefetch_adaptive: a decoded token starts
int32_t       moecache_ahead_set_predictor(moecache & mc, int32_t il, const float * w, int32_t n_embd);
void          moecache_ahead_free_predictors(moecache & mc);
