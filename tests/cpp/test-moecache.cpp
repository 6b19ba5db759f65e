// test-moecache.cpp - hand-computed cases for the moecache C API (no model needed).
// Built and run by tests/test_cpp_unit.py against the built libllama; prints "N passed, N failed".

#include "moecache.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

static int n_pass = 0;
static int n_fail = 0;

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (cond) {                                                                     \
            n_pass++;                                                                   \
        } else {                                                                        \
            n_fail++;                                                                   \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);    \
        }                                                                               \
    } while (0)

// softmax probabilities of one row
static std::vector<float> softmax(const std::vector<float> & z) {
    float mx = -INFINITY;
    for (float v : z) mx = std::fmax(mx, v);
    std::vector<float> p(z.size());
    double sum = 0.0;
    for (size_t i = 0; i < z.size(); i++) { p[i] = std::exp(z[i] - mx); sum += p[i]; }
    for (float & v : p) v = (float) (v / sum);
    return p;
}

struct routed {
    std::vector<int32_t> sel;
    std::vector<int8_t>  hit;
};

// routes one token of layer 0
static routed route1(moecache * mc, const std::vector<float> & z, int K, bool rank_on_logits = true) {
    std::vector<float> p = softmax(z);
    routed r;
    r.sel.resize(K);
    r.hit.resize(K);
    const int rc = moecache_route(mc, 0, z.data(), p.data(), nullptr, (int) z.size(), K, 1, rank_on_logits,
                                  r.sel.data(), r.hit.data());
    CHECK(rc == MOECACHE_OK);
    return r;
}

static std::vector<int32_t> cached(moecache * mc) {
    std::vector<int32_t> ids(64);
    const int n = moecache_get_cached(mc, 0, ids.data(), (int) ids.size());
    ids.resize(n);
    return ids;
}

static moecache * make(int N, int K, int cache, moecache_policy policy, int top_j = 1,
                       moecache_insertion ins = MOECACHE_INSERTION_TOP_BOTTOM) {
    moecache_cache_params   cp = moecache_cache_default_params();
    moecache_routing_params rp = moecache_routing_default_params();
    cp.n_cached  = cache;
    cp.insertion = ins;
    rp.policy    = policy;
    rp.top_j     = top_j;
    return moecache_init_synthetic(1, N, K, cp, rp);
}

static void test_lru_and_insertion_order() {
    // N = 6, K = 2, cache 3. Token weights: expert 0 > expert 1.
    moecache * mc = make(6, 2, 3, MOECACHE_POLICY_TOPK);
    routed r = route1(mc, {3, 2, 0, 0, 0, 0}, 2);
    CHECK(r.sel == (std::vector<int32_t>{0, 1}));
    CHECK(r.hit == (std::vector<int8_t>{0, 0}));
    // top-bottom: 0 inserted first, 1 (lower weight) is the most recent
    CHECK(cached(mc) == (std::vector<int32_t>{0, 1}));
    route1(mc, {0, 0, 0, 0, 3, 2}, 2);        // experts 4 then 5: evicts 0 (LRU)
    CHECK(cached(mc) == (std::vector<int32_t>{1, 4, 5}));
    r = route1(mc, {0, 3, 0, 0, 0, 2}, 2);    // 1 and 5 are hits
    CHECK(r.hit == (std::vector<int8_t>{1, 1}));
    CHECK(cached(mc) == (std::vector<int32_t>{4, 1, 5}));

    moecache_layer_stats st;
    CHECK(moecache_get_layer_stats(mc, 0, &st) == MOECACHE_OK);
    CHECK(st.tokens == 3 && st.selections == 6 && st.hits == 2 && st.misses == 4 && st.evictions == 1);
    CHECK(st.occupancy == 3 && st.capacity == 3 && st.n_expert == 6 && st.n_expert_used == 2);
    // lifetimes: expert 0 lived 1 token (inserted at token 0, evicted at token 1); residents: 1 (3), 4 (2), 5 (2)
    CHECK(st.lifetime_count == 4);
    CHECK(std::fabs(st.lifetime_sum - (1 + 3 + 2 + 2)) < 1e-9);
    moecache_free(mc);

    // bottom-top: the higher-weight expert ends most recent
    mc = make(6, 2, 3, MOECACHE_POLICY_TOPK, 1, MOECACHE_INSERTION_BOTTOM_TOP);
    route1(mc, {3, 2, 0, 0, 0, 0}, 2);
    CHECK(cached(mc) == (std::vector<int32_t>{1, 0}));
    moecache_free(mc);
}

static void test_max_rank() {
    // N = 8, K = 2, J = 1. Cache {5}; router ranks 0,1,2,...,5 (5 at rank 5).
    moecache * mc = make(8, 2, 4, MOECACHE_POLICY_MAX_RANK);
    route1(mc, {0, 0, 0, 0, 0, 3, 0, 0}, 2);          // lru warm-up: caches 5 and 0 (lowest id among ties)
    moecache_routing_params rp = moecache_get_routing(mc);
    rp.max_rank = 5;                                    // r[0:5] = {0,1,2,3,4}: 5 is not in reach
    moecache_set_routing(mc, rp);
    std::vector<float> z = {8, 7, 6, 5, 4, 3, 2, 1};
    routed r = route1(mc, z, 2);
    CHECK(r.sel == (std::vector<int32_t>{0, 1}));       // 0 (top-J) + 1: nothing promoted from rank >= 5
    rp.max_rank = 6;                                    // now 5 is in reach and cached
    moecache_set_routing(mc, rp);
    moecache_clear(mc);
    route1(mc, {0, 0, 0, 0, 0, 3, 0, 0}, 2);          // cache {5, 0}
    r = route1(mc, z, 2);
    CHECK(r.sel == (std::vector<int32_t>{0, 5}));       // 0 kept by Top-J, 5 promoted over 1
    CHECK(r.hit == (std::vector<int8_t>{1, 1}));
    moecache_free(mc);
}

static void test_cumsum() {
    // probabilities (0.5, 0.3, 0.1, 0.1): tau 0.75 -> m = 2, tau 0.85 -> m = 3
    moecache * mc = make(4, 1, 2, MOECACHE_POLICY_CUMSUM, 0);
    moecache_routing_params rp = moecache_get_routing(mc);
    const std::vector<float> p = {0.5f, 0.3f, 0.1f, 0.1f};
    std::vector<float> z(4);
    for (int i = 0; i < 4; i++) z[i] = std::log(p[i]);
    int32_t sel = -1;
    int8_t hit = 0;
    // warm the cache with expert 2
    std::vector<float> z2 = {0, 0, 5, 0};
    std::vector<float> p2 = softmax(z2);
    moecache_route(mc, 0, z2.data(), p2.data(), nullptr, 4, 1, 1, true, &sel, &hit);
    CHECK(sel == 2);
    rp.cumsum_tau = 0.75f;
    moecache_set_routing(mc, rp);
    moecache_route(mc, 0, z.data(), p.data(), nullptr, 4, 1, 1, true, &sel, &hit);
    CHECK(sel == 0);            // m = 2: expert 2 (rank 2) is out of reach
    moecache_clear(mc);
    moecache_route(mc, 0, z2.data(), p2.data(), nullptr, 4, 1, 1, true, &sel, &hit);
    rp.cumsum_tau = 0.85f;
    moecache_set_routing(mc, rp);
    moecache_route(mc, 0, z.data(), p.data(), nullptr, 4, 1, 1, true, &sel, &hit);
    CHECK(sel == 2 && hit == 1); // m = 3: cached expert 2 jumps ahead (J = 0)
    moecache_free(mc);
}

static void test_prior() {
    // N = 8, K = 2, J = 1, cache {0,1,6,7} after four tokens of range 3; lambda = 1 -> boost 3
    moecache * mc = make(8, 2, 4, MOECACHE_POLICY_TOPK);
    route1(mc, {3, 2, 1, 0, 0, 0, 0, 0}, 2);
    route1(mc, {0, 0, 0, 0, 0, 0, 2, 3}, 2);
    route1(mc, {0, 0, 0, 0, 0, 1, 2, 3}, 2);
    moecache_routing_params rp = moecache_get_routing(mc);
    rp.policy       = MOECACHE_POLICY_PRIOR;
    rp.prior_lambda = 1.0f;
    moecache_set_routing(mc, rp);
    routed r = route1(mc, {0, 0.5f, 0, 0, 0, 1, 0, 3}, 2);
    CHECK(r.sel == (std::vector<int32_t>{7, 1}));   // stock would be {7, 5}; 1 is cached: 0.5 + 3 > 1
    CHECK(r.hit == (std::vector<int8_t>{1, 1}));
    moecache_layer_stats st;
    moecache_get_layer_stats(mc, 0, &st);
    CHECK(std::fabs(st.delta - 3.0f) < 1e-6f);

    // a fixed calibrated Delta replaces the running mean: 0.1 -> boost 0.1 is too small for 1
    const float d = 0.1f;
    moecache_set_prior_delta(mc, &d, 1);
    r = route1(mc, {0, 0.5f, 0, 0, 0, 1, 0, 3}, 2);
    CHECK(r.sel == (std::vector<int32_t>{7, 5}));
    moecache_free(mc);
}

static void test_prune() {
    moecache * mc = make(8, 4, 8, MOECACHE_POLICY_PRUNE, 1);
    moecache_routing_params rp = moecache_get_routing(mc);
    rp.prune_rank = 2;
    moecache_set_routing(mc, rp);
    routed r = route1(mc, {7, 6, 5, 4, 3, 2, 1, 0}, 4);
    CHECK(r.sel == (std::vector<int32_t>{0, 1, -1, -1}));
    CHECK(r.hit == (std::vector<int8_t>{0, 0, -1, -1}));
    moecache_layer_stats st;
    moecache_get_layer_stats(mc, 0, &st);
    CHECK(st.selections == 2 && st.misses == 2);
    moecache_free(mc);
}

static void test_masked_experts_are_never_selected() {
    // sigmoid-style scores with a masked group: experts 0..3 are -inf even though their logits are highest
    moecache * mc = make(8, 2, 8, MOECACHE_POLICY_PRIOR, 0);
    moecache_routing_params rp = moecache_get_routing(mc);
    rp.prior_lambda = 1000.0f;
    moecache_set_routing(mc, rp);
    std::vector<float> z = {9, 9, 9, 9, 1, 2, 3, 4};
    std::vector<float> p(8), s(8);
    for (int i = 0; i < 8; i++) { p[i] = 1.0f / (1.0f + std::exp(-z[i])); s[i] = i < 4 ? -INFINITY : p[i]; }
    int32_t sel[2];
    int8_t  hit[2];
    for (int t = 0; t < 3; t++) {
        moecache_route(mc, 0, z.data(), p.data(), s.data(), 8, 2, 1, false, sel, hit);
        CHECK(sel[0] >= 4 && sel[1] >= 4);
    }
    moecache_free(mc);
}

static void test_state_round_trip() {
    moecache * a = make(6, 2, 3, MOECACHE_POLICY_TOPK);
    route1(a, {3, 2, 0, 0, 0, 0}, 2);
    route1(a, {0, 0, 0, 0, 3, 2}, 2);
    const std::string path = "test-moecache.state";
    CHECK(moecache_state_save(a, path.c_str()) == MOECACHE_OK);
    moecache * b = make(6, 2, 3, MOECACHE_POLICY_TOPK);
    CHECK(moecache_state_load(b, path.c_str()) == MOECACHE_OK);
    CHECK(cached(a) == cached(b));
    // a smaller cache keeps the most recent entries
    moecache * c = make(6, 2, 2, MOECACHE_POLICY_TOPK);
    CHECK(moecache_state_load(c, path.c_str()) == MOECACHE_OK);
    CHECK(cached(c) == (std::vector<int32_t>{4, 5}));
    // another model shape is refused, and a bad file leaves the cache untouched
    moecache * d = make(8, 2, 3, MOECACHE_POLICY_TOPK);
    CHECK(moecache_state_load(d, path.c_str()) == MOECACHE_ERR_MISMATCH);
    CHECK(std::strstr(moecache_last_error(), "another model") != nullptr);
    // a truncated file is refused and leaves the cache untouched
    std::vector<char> bytes(4096);
    FILE * f = fopen(path.c_str(), "rb");
    const size_t n = fread(bytes.data(), 1, bytes.size(), f);
    fclose(f);
    f = fopen(path.c_str(), "wb");
    fwrite(bytes.data(), 1, n - 10, f);
    fclose(f);
    moecache_clear(b);
    route1(b, {0, 0, 3, 0, 0, 0}, 2);
    const std::vector<int32_t> before = cached(b);
    CHECK(moecache_state_load(b, path.c_str()) == MOECACHE_ERR_CORRUPT);
    CHECK(std::strstr(moecache_last_error(), "truncated") != nullptr);
    CHECK(cached(b) == before);
    CHECK(moecache_state_load(b, "/nonexistent/dir/x.state") == MOECACHE_ERR_IO);
    CHECK(cached(b) == before);
    remove(path.c_str());
    moecache_free(a);
    moecache_free(b);
    moecache_free(c);
    moecache_free(d);
}

static void test_invalid_parameters() {
    moecache_cache_params   cp = moecache_cache_default_params();
    moecache_routing_params rp = moecache_routing_default_params();
    cp.n_cached = 9;
    CHECK(moecache_init_synthetic(1, 8, 2, cp, rp) == nullptr);
    CHECK(std::strstr(moecache_last_error(), "larger than") != nullptr);
    cp.n_cached = 4;
    rp.top_j = 3;
    CHECK(moecache_init_synthetic(1, 8, 2, cp, rp) == nullptr);
    CHECK(std::strstr(moecache_last_error(), "top_j") != nullptr);
    rp.top_j = 1;
    rp.prior_lambda = -0.5f;
    CHECK(moecache_init_synthetic(1, 8, 2, cp, rp) == nullptr);
    rp.prior_lambda = 0.5f;
    rp.cumsum_tau = 1.5f;
    CHECK(moecache_init_synthetic(1, 8, 2, cp, rp) == nullptr);
    rp.cumsum_tau = 0.9f;
    moecache * mc = moecache_init_synthetic(1, 8, 2, cp, rp);
    CHECK(mc != nullptr);
    // a rejected change keeps the old parameters
    moecache_routing_params bad = rp;
    bad.prune_rank = 0;
    CHECK(moecache_set_routing(mc, bad) == MOECACHE_ERR_INVALID);
    CHECK(moecache_get_routing(mc).prune_rank == rp.prune_rank);
    moecache_free(mc);
}

static void test_trace_ring_buffer() {
    moecache_cache_params   cp = moecache_cache_default_params();
    moecache_routing_params rp = moecache_routing_default_params();
    cp.n_cached       = 2;
    cp.trace_capacity = 3;
    moecache * mc = moecache_init_synthetic(1, 4, 1, cp, rp);
    for (int t = 0; t < 5; t++) {
        std::vector<float> z(4, 0.0f);
        z[t % 4] = 5.0f;
        route1(mc, z, 1);
    }
    moecache_trace_record rec[8];
    const int n = moecache_get_trace(mc, rec, 8);
    CHECK(n == 3);
    CHECK(rec[0].token == 2 && rec[1].token == 3 && rec[2].token == 4);      // oldest kept first
    CHECK(rec[2].experts[0] == 0 && rec[2].hit_mask == 0 && rec[2].top_k_mask == 1);
    moecache_free(mc);
}

int main() {
    test_lru_and_insertion_order();
    test_max_rank();
    test_cumsum();
    test_prior();
    test_prune();
    test_masked_experts_are_never_selected();
    test_state_round_trip();
    test_invalid_parameters();
    test_trace_ring_buffer();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail == 0 ? 0 : 1;
}
