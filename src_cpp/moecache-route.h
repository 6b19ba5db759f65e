// moecache-route.h - a token's routing (moecache-route.cpp), one layer's cache: insertion and eviction
// (moecache-cache.cpp), and the usage profile (moecache-profile.cpp). Not installed.
#pragma once

#include "moecache-layer.h"

struct moecache;

// moecache-route.cpp
// Routes one token of layer L and updates its cache and counters.
//   z, p, s: [n_expert] logits, probabilities, selection scores (s may be p)
//   stock:   [n_expert_used] the model's own top-K in its order, or nullptr to rank here
//   apply:   run the policy (false: stock top-K, cache still updated when `update`)
//   update:  update the cache, counters and trace
//   sel:     [n_expert_used] out, router-rank order; dropped slots -1
//   hit:     [n_expert_used] out, 1 hit / 0 miss / -1 dropped (or not updated)
// Returns the number of experts run.
int32_t moecache_route_token(
        moecache                             & mc,
        moecache_layer                       & L,
        const struct moecache_routing_params & rp,
        const float                          * z,
        const float                          * p,
        const float                          * s,
        const int32_t                        * stock,
        bool                                   apply,
        bool                                   update,
        int32_t                              * sel,
        int8_t                               * hit);
// the prior's mask: expert e counts as cached for layer L's next token
bool moecache_route_preferred(const moecache_layer & L, int32_t e);

// batch_share: a decode step of several sequences' tokens (moecache_route_shares) is routed in two
// passes. The first routes every token against the cache as it is (nothing updated, Delta as it
// was), counting the selections (L.scratch.step, .first); before its second, updating pass, token t
// sees what the others selected in the first as cached (L.scratch.others); moecache_route_share_end
// clears that. Rows: z, p, s, stock of each token ([n_tokens] pointers; stock may be nullptr).
bool moecache_route_shares(const moecache_routing_params & rp, int64_t n_tokens);
moecache_routing_params moecache_route_share_params(const moecache_routing_params & rp); // (batch_prior applied)
void moecache_route_share_first(moecache & mc, moecache_layer & L, const moecache_routing_params & rp, int64_t n_tokens,
                                const float * const * z, const float * const * p, const float * const * s,
                                const int32_t * const * stock);
void moecache_route_share_token(const moecache & mc, moecache_layer & L, int64_t t);
void moecache_route_share_end(moecache_layer & L);

// a decoded token's selections sel [n] into decode_selections and decode_union: seen [n_expert] marks the
// experts the step's earlier tokens selected in this layer (the caller clears it at the step's start; a step of
// one token needs none: its selections are distinct)
void moecache_route_count_union(moecache & mc, std::vector<uint8_t> & seen, const int32_t * sel, int32_t n,
                                int64_t n_tokens);

// moecache-cache.cpp
void moecache_layer_init (moecache & mc, moecache_layer & L, int32_t il, int32_t capacity);
void moecache_layer_clear(moecache_layer & L);   // empty, Delta, usage and pins to zero
void moecache_layer_empty(moecache_layer & L);   // empty (lifetimes of the entries end now) and unpinned
// a token of layer L routed: decays and adds its usage (router probabilities p [n_expert], the
// selection sel[0:n_sel]) and counts the selection in the current request; before its insertions
void moecache_layer_observe(moecache_layer & L, const float * p, const int32_t * sel, int32_t n_sel);
// inserts e as the most recent entry; when full, evicts the expert the eviction policy picks among
// those whose in_use[] entry is 0 (in_use may be NULL) and that are not pinned. Returns false if
// the capacity is 0.
bool moecache_layer_insert(moecache_layer & L, int32_t e, const uint8_t * in_use);
int32_t moecache_layer_pick_victim(const moecache_layer & L, const int64_t * stamp, const uint8_t * pinned,
                                   const uint8_t * in_use);
// a prediction for the next token of layer T: pred[0:n] (most likely first) are inserted into its
// cache unless cached already, each evicting by the policy an expert that is not predicted (an
// evicted prefetch never selected counts as wasted). inserted: out, the experts to read. Returns their count.
int32_t moecache_layer_prefetch(moecache_layer & T, const int32_t * pred, int32_t n, int32_t * inserted);
// prefetch_spare > 0: a prediction pred[0:n] for the next token of layer T, the cache left alone:
// missing = the predicted experts T does not cache (at most prefetch_spare), to read into spare slots
int32_t moecache_layer_speculate(moecache_layer & T, const int32_t * pred, int32_t n, int32_t * missing);
// after layer L routed a decoded token: recall of the prediction, prefetches used, last selection
void    moecache_layer_prefetch_outcome(moecache_layer & L, const int32_t * sel, int32_t n_sel);

