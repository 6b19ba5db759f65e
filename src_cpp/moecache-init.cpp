// moecache-init.cpp - parameters checked and a moecache built from them: its shape (layers, N,
// K), each layer's cache size, the routing parameters, then the residency (moecache-residency.cpp).
// Errors leave nothing allocated and set moecache_last_error().

#include "moecache-impl.h"

#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

static int32_t fail(int32_t status, const std::string & msg) {
    moecache_set_error(msg);
    return status;
}

int32_t moecache_check_eviction(enum moecache_eviction eviction, float decay) {
    char buf[128];
    if (eviction < MOECACHE_EVICTION_LRU || eviction > MOECACHE_EVICTION_ROUTER_MASS) {
        snprintf(buf, sizeof(buf), "unknown eviction policy %d", (int) eviction);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (!(decay > 0.0f && decay <= 1.0f)) {
        snprintf(buf, sizeof(buf), "eviction decay = %g must be in (0, 1]", (double) decay);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    return MOECACHE_OK;
}

int32_t moecache_check_routing(const moecache_routing_params & p, int32_t K) {
    char buf[256];
    if (p.policy < MOECACHE_POLICY_TOPK || p.policy > MOECACHE_POLICY_SWAP_RANK) {
        snprintf(buf, sizeof(buf), "unknown routing policy %d", (int) p.policy);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (p.top_j < 0 || p.top_j > K) {
        snprintf(buf, sizeof(buf), "top_j = %d is out of range: the model uses K = %d experts per token (0 <= top_j <= K)", p.top_j, K);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (!(p.prior_lambda >= 0.0f) || std::isinf(p.prior_lambda)) {
        snprintf(buf, sizeof(buf), "prior lambda = %g must be a finite number >= 0", (double) p.prior_lambda);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (!(p.batch_prior >= 1.0f && p.batch_prior <= 100.0f)) {
        snprintf(buf, sizeof(buf), "batch_prior = %g must be in [1, 100]", (double) p.batch_prior);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (p.max_rank < 0) {
        snprintf(buf, sizeof(buf), "max-rank m = %d must be >= 0", p.max_rank);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (!(p.cumsum_tau >= 0.0f && p.cumsum_tau <= 1.0f)) {
        snprintf(buf, sizeof(buf), "cumsum tau = %g must be in [0, 1]", (double) p.cumsum_tau);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (p.prune_rank < 1) {
        snprintf(buf, sizeof(buf), "prune rank R = %d must be >= 1", p.prune_rank);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (p.scope != MOECACHE_SCOPE_ALL && p.scope != MOECACHE_SCOPE_DECODE) {
        snprintf(buf, sizeof(buf), "unknown routing scope %d", (int) p.scope);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if ((p.policy == MOECACHE_POLICY_DROP_RANK || p.policy == MOECACHE_POLICY_SWAP_RANK) &&
        (p.analysis_rank < 0 || p.analysis_rank >= K)) {
        snprintf(buf, sizeof(buf), "analysis rank i = %d is out of range: the model uses K = %d experts per token (0 <= i < K)",
                 p.analysis_rank, K);
        return fail(MOECACHE_ERR_INVALID, buf);
    }
    if (p.policy == MOECACHE_POLICY_DROP_RANK && K < 2) {
        return fail(MOECACHE_ERR_INVALID, "drop-rank needs a model with at least 2 experts per token");
    }
    return MOECACHE_OK;
}

// the cache size of layer il, or -2 when the parameters are invalid (error set)
static int32_t resolve_capacity(const moecache_cache_params & p, int32_t il, int32_t N) {
    char buf[256];
    int32_t n = p.n_cached;
    if (p.n_cached_per_layer && il < p.n_layer_sizes && p.n_cached_per_layer[il] >= 0) {
        n = p.n_cached_per_layer[il];
    }
    if (n < 0) {
        if (!(p.fraction >= 0.0f && p.fraction <= 1.0f)) {
            snprintf(buf, sizeof(buf), "cache fraction = %g must be in [0, 1]", (double) p.fraction);
            fail(MOECACHE_ERR_INVALID, buf);
            return -2;
        }
        n = (int32_t) std::lround((double) p.fraction * N);
        if (p.fraction > 0.0f && n < 1) {
            n = 1;
        }
    }
    if (n > N) {
        snprintf(buf, sizeof(buf), "cache size %d (layer %d) is larger than the %d routed experts of the model", n, il, N);
        fail(MOECACHE_ERR_INVALID, buf);
        return -2;
    }
    return n;
}

moecache * moecache_new_shape(int32_t n_layer, int32_t N, int32_t K, moecache_cache_params cp,
                             moecache_routing_params rp) {
    char buf[256];
    if (N < 1 || N > MOECACHE_MAX_EXPERTS || K < 1 || K > N || K > MOECACHE_MAX_USED) {
        snprintf(buf, sizeof(buf), "invalid expert counts: N = %d routed experts (at most %d), K = %d used per token "
                 "(1 <= K <= min(N, %d))", N, MOECACHE_MAX_EXPERTS, K, MOECACHE_MAX_USED);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (n_layer < 1 || n_layer > MOECACHE_MAX_LAYERS) {
        snprintf(buf, sizeof(buf), "invalid layer count %d (1 to %d)", n_layer, MOECACHE_MAX_LAYERS);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (moecache_check_routing(rp, K) != MOECACHE_OK) {
        return nullptr;
    }
    if (cp.insertion != MOECACHE_INSERTION_TOP_BOTTOM && cp.insertion != MOECACHE_INSERTION_BOTTOM_TOP) {
        fail(MOECACHE_ERR_INVALID, "unknown insertion order");
        return nullptr;
    }
    if (cp.trace_capacity < 0 || cp.trace_capacity > MOECACHE_MAX_TRACE) {
        snprintf(buf, sizeof(buf), "trace_capacity = %d must be in [0, %d]", cp.trace_capacity, MOECACHE_MAX_TRACE);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (cp.prefetch < MOECACHE_PREFETCH_OFF || cp.prefetch > MOECACHE_PREFETCH_TRACE) {
        snprintf(buf, sizeof(buf), "unknown prefetch mode %d", (int) cp.prefetch);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (cp.prefetch_distance < 1 || cp.prefetch_distance > MOECACHE_MAX_PREFETCH_DISTANCE) {
        snprintf(buf, sizeof(buf), "prefetch_distance = %d must be in [1, %d]", cp.prefetch_distance,
                 MOECACHE_MAX_PREFETCH_DISTANCE);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (!(cp.prefetch_min_p >= 0.0f && cp.prefetch_min_p <= 1.0f)) {
        snprintf(buf, sizeof(buf), "prefetch_min_p = %g must be in [0, 1]", (double) cp.prefetch_min_p);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (!(cp.prefetch_budget <= 64.0f)) { // (NaN too; any negative value: no budget)
        snprintf(buf, sizeof(buf), "prefetch_budget = %g must be in [0, 64], or negative for none", (double) cp.prefetch_budget);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (cp.router_record < 0 || cp.router_record > MOECACHE_MAX_TRACE) {
        snprintf(buf, sizeof(buf), "router_record = %d must be in [0, %d]", cp.router_record, MOECACHE_MAX_TRACE);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (cp.n_seq < 1 || cp.n_seq > MOECACHE_MAX_SEQ) {
        snprintf(buf, sizeof(buf), "n_seq = %d must be in [1, %d]", cp.n_seq, MOECACHE_MAX_SEQ);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    if (moecache_check_eviction(cp.eviction, cp.eviction_decay) != MOECACHE_OK) {
        return nullptr;
    }
    if (cp.n_layer_sizes < 0 || cp.n_layer_sizes > n_layer || (cp.n_layer_sizes > 0 && !cp.n_cached_per_layer)) {
        snprintf(buf, sizeof(buf), "per-layer cache sizes: got %d entries for a model of %d layers", cp.n_layer_sizes, n_layer);
        fail(MOECACHE_ERR_INVALID, buf);
        return nullptr;
    }
    std::vector<int32_t> caps(n_layer);
    for (int32_t il = 0; il < n_layer; il++) {
        caps[il] = resolve_capacity(cp, il, N);
        if (caps[il] < 0) {
            return nullptr;
        }
    }

    std::unique_ptr<moecache> owner(new moecache()); // freed if an allocation below throws
    moecache * mc = owner.get();
    mc->n_layer       = n_layer;
    mc->n_expert      = N;
    mc->n_expert_used = K;
    mc->cparams       = cp;
    mc->cparams.n_cached_per_layer = nullptr; // not kept: resolved into the layers
    mc->cparams.model_path         = nullptr; // copied into mc->res.path by moecache_residency_init
    mc->cparams.lowbit_path        = nullptr; // read by moecache_lowbit_open only
    mc->rparams       = rp;
    mc->layers.resize(n_layer);
    for (int32_t il = 0; il < n_layer; il++) {
        moecache_layer_init(*mc, mc->layers[il], il, caps[il]);
    }
    mc->trace.resize(cp.trace_capacity);
    return owner.release();
}

static int32_t meta_int(const llama_model * model, const std::string & key) {
    char buf[64];
    if (llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf)) < 0) {
        return -1;
    }
    return (int32_t) std::strtol(buf, nullptr, 10);
}

moecache * moecache_new(const llama_model * model, moecache_cache_params cparams, moecache_routing_params rparams) {
    if (!model) {
        fail(MOECACHE_ERR_INVALID, "model is NULL");
        return nullptr;
    }
    char arch[64] = {0};
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch));
    const int32_t N = meta_int(model, std::string(arch) + ".expert_count");
    const int32_t K = meta_int(model, std::string(arch) + ".expert_used_count");
    if (N <= 1 || K <= 0) {
        fail(MOECACHE_ERR_NOT_MOE, std::string("the model has no MoE layers (architecture '") + arch +
                                   "' without routed experts in its GGUF metadata); moecache needs a Mixture-of-Experts model");
        return nullptr;
    }
    // freed with moecache_free if anything below fails or throws
    std::unique_ptr<moecache, void (*)(moecache *)> owner(
        moecache_new_shape(llama_model_n_layer(model), N, K, cparams, rparams), moecache_free);
    moecache * mc = owner.get();
    if (!mc) {
        return nullptr;
    }
    char desc[256] = {0};
    llama_model_desc(model, desc, sizeof(desc));
    mc->desc     = std::string(arch) + " | " + desc;
    mc->n_params = llama_model_n_params(model);
    mc->model    = model;
    mc->dev.routes_twice = std::string(arch) == "grovemoe"; // (its experts, then its chunk experts: moecache-device.cpp)
    mc->cparams.model_path  = cparams.model_path;
    mc->cparams.lowbit_path = cparams.lowbit_path;
    const int32_t rc = moecache_residency_init(*mc, model);
    mc->cparams.model_path  = nullptr;
    mc->cparams.lowbit_path = nullptr;
    if (rc != MOECACHE_OK) {
        const std::string msg = moecache_last_error();
        owner.reset();
        moecache_set_error(msg);
        return nullptr;
    }
    return owner.release();
}
