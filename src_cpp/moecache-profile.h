// moecache-profile.h - the usage profile of a moecache (moecache-profile.cpp): the expert counts of the
// current request and of every past one, kept across processes, and the PREFETCH_TRACE store of past
// requests. Not installed.
#pragma once

#include "moecache-layer.h"

#include <vector>

struct moecache;

struct moecache_profile {
    std::vector<float>              req_counts;   // [n_layer * N] the current request's expert counts (ACTIVATION
                                                  //   eviction, PREFETCH_TRACE)
    std::vector<double>             counts;       // [n_layer * N] every past request's: the usage profile
    std::vector<float>              req_share;    // req_counts, each row scaled to sum 1 (scratch)
    std::vector<std::vector<float>> trace_store;  // past requests, each normalized per layer
    int32_t                         trace_best = -1;       // the best match of the current token, -1 = none
    int32_t                         trace_best_layer = -1; // the layer the match was made at
};

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
