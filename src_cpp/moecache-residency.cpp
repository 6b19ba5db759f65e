// moecache-residency.cpp - where the routed experts' bytes live (moecache.h, enum moecache_residency):
// the residency's setup and teardown, and the one call per layer that makes memory follow the cache.
//
// STREAM: each MoE layer owns a slot arena per expert tensor (moecache-slots.cpp). The layer's
// mul_mat_id calls read the slots instead of the model's tensors: during the graph build an op
// goes in front of them (moecache-graph.cpp) that, for a one-token ubatch, has every selected or
// cached expert that no slot holds read from the GGUF with direct I/O (moecache-io.cpp) and turns
// expert ids into slot ids. Prompt ubatches touch almost every expert: they read the model's
// mmapped tensors as stock llama.cpp does and copy the experts that stay cached into their slots
// (moecache-mapping.cpp: the mapping's pages, asked for ahead and dropped behind).
//
// MMAP: the matmuls read the model's mapping; the cached experts' pages are locked and the evicted
// ones' unlocked and dropped (moecache-mapping.cpp). The dense part can be locked too
// (moecache-dense.cpp).
//
// The logical cache (moecache-route.cpp) decides hits and misses; these files only make memory
// follow it: after a layer's op, every cached expert is in a slot (or locked).

#include "moecache-impl.h"
#include "moecache-io.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"
#include "llama-impl.h"  // LLAMA_LOG_WARN: llama.cpp's logger, which the application controls
#include "llama-model.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <unordered_map>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

// ggml's buffer type for a mapped file has no public handle: its name is the test
bool moecache_tensor_is_mapped(const ggml_tensor * t) {
    return t && t->data && t->buffer && ggml_backend_buffer_is_host(t->buffer) &&
           strcmp(ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)), "CPU_Mapped") == 0;
}

// --- errors ----------------------------------------------------------------------------------

void moecache_warn_mlock_once(size_t bytes, int err) {
    static std::once_flag once;
    std::call_once(once, [bytes, err] {
        struct rlimit rl = {};
        getrlimit(RLIMIT_MEMLOCK, &rl);
        char lim[64];
        if (rl.rlim_cur == RLIM_INFINITY) {
            snprintf(lim, sizeof(lim), "unlimited");
        } else {
            snprintf(lim, sizeof(lim), "%.1f MiB", (double) rl.rlim_cur / (1 << 20));
        }
        LLAMA_LOG_WARN(
                "moecache: warning: mlock of the expert cache (%.1f MiB) was refused (%s; RLIMIT_MEMLOCK = %s). "
                "The run goes on unlocked, so the OS may page the cache out. Fix: raise the limit "
                "(`ulimit -l unlimited`, or memlock in /etc/security/limits.conf), or turn locking off "
                "(lock_memory=False, --no-mlock) to silence this.\n",
                (double) bytes / (1 << 20), strerror(err), lim);
    });
}

void moecache_set_io_error(moecache & mc, const std::string & msg) {
    std::lock_guard<std::mutex> lock(mc.io_error_mutex);
    if (!mc.io_failed.load()) {
        mc.io_error = msg;
        mc.io_failed.store(true);
    }
}

bool moecache_residency_abort(void * data) {
    return ((moecache *) data)->io_failed.load(std::memory_order_relaxed);
}

// --- making memory follow the cache (called by the graph op, moecache-graph.cpp) --------------

// dst: I32 [K, n_tokens]; src[0]: the selected expert ids of the same shape
void moecache_residency_sync(moecache_layer & L, const int32_t * ids, int32_t * out, int64_t n_ids, bool decode) {
    moecache & mc = *L.mc;
    const bool stream = mc.cparams.residency == MOECACHE_RESIDENCY_STREAM;
    memcpy(out, ids, n_ids * sizeof(int32_t));
    if (mc.io_failed.load()) {
        if (stream && decode) {
            memset(out, 0, n_ids * sizeof(int32_t)); // valid slot ids; the graph is being stopped anyway
        }
        return;
    }
    for (int64_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= mc.n_expert) {
            moecache_set_io_error(mc, "internal error: expert id out of range in layer " + std::to_string(L.il));
            memset(out, 0, n_ids * sizeof(int32_t));
            return;
        }
    }
    const int64_t t0 = moecache_time_us();
    int64_t t_copy = 0; // copying up (VRAM tier): not I/O
    const int32_t il_prompt = decode ? -1 : L.il;
    moecache_mapping_begin(mc, il_prompt, ids, n_ids);
    if (L.vram.n > 0) {
        t_copy = moecache_vram_begin(mc, L); // (copies up made ahead for this layer: before its slots change)
    }
    if (stream && (decode || L.res.all_in_slots)) { // (a prompt waits for every read: it reads none)
        moecache_slots_decode(mc, L, ids, out, n_ids, !decode || !mc.cparams.overlap_experts, decode);
        if (decode && L.vram.n > 0 && !moecache_vram_direct_in_place(mc, L)) { // (computed in place: not here)
            t_copy += moecache_vram_decode(mc, L, ids, out, n_ids); // (those computed on the device: the zero slot)
        }
    } else {
        moecache_mapping_sync(mc, L, ids, n_ids, decode);
    }
    if (mc.res.io->lock_failed.load() && mc.res.arena_locked == false && mc.cparams.lock_memory) {
        moecache_warn_mlock_once(moecache_slot_bytes(L) * (size_t) std::max(L.capacity, 1) * mc.layers.size(), mc.res.io->lock_errno.load());
    }
    const int64_t t1 = moecache_time_us();
    (decode ? mc.t_io_decode_us : mc.t_io_prompt_us) += t1 - t0 - t_copy;
    moecache_graph_event(mc, MOECACHE_EVENT_WAIT, L.il, -1, decode ? 1 : (int32_t) (n_ids / std::max(1, mc.n_expert_used)),
                         t0, t0, t1);
}

// --- setup -----------------------------------------------------------------------------------

int32_t moecache_fail_residency(const std::string & msg) {
    moecache_set_error(msg);
    return MOECACHE_ERR_RESIDENCY;
}

int32_t moecache_residency_init(moecache & mc, const llama_model * model) {
    const moecache_cache_params & cp = mc.cparams;
    const char * names[] = { "none", "mmap", "stream" };
    if (cp.residency == MOECACHE_RESIDENCY_NONE) {
        return MOECACHE_OK;
    }
    if (cp.residency != MOECACHE_RESIDENCY_MMAP && cp.residency != MOECACHE_RESIDENCY_STREAM) {
        return moecache_fail_residency("unknown residency " + std::to_string((int) cp.residency));
    }
    if (cp.io_threads < 1 || cp.io_threads > 64) {
        return moecache_fail_residency("io_threads = " + std::to_string(cp.io_threads) + " must be in [1, 64]");
    }
    if (cp.prefetch_threads < 0 || cp.prefetch_threads > cp.io_threads) {
        return moecache_fail_residency("prefetch_threads = " + std::to_string(cp.prefetch_threads) +
                                       " must be in [0, io_threads = " + std::to_string(cp.io_threads) + "]");
    }
    if (cp.prefetch_spare < 0 || cp.prefetch_spare > mc.n_expert) {
        return moecache_fail_residency("prefetch_spare = " + std::to_string(cp.prefetch_spare) +
                                       " must be in [0, N = " + std::to_string(mc.n_expert) + "]");
    }
    if (cp.n_vram < 0 || cp.n_vram > mc.n_expert) {
        return moecache_fail_residency("n_vram = " + std::to_string(cp.n_vram) + " must be in [0, N = " +
                                       std::to_string(mc.n_expert) + "]");
    }
    if (cp.n_vram > 0 && cp.residency != MOECACHE_RESIDENCY_STREAM) {
        return moecache_fail_residency("n_vram (a VRAM tier) needs stream residency: its device slots are filled "
                                       "from the host slots");
    }
    if (cp.vram_exclusive && cp.n_vram == 0) {
        return moecache_fail_residency("vram_exclusive needs a VRAM tier (n_vram > 0)");
    }
    if (cp.vram_fill < MOECACHE_VRAM_FILL_AUTO || cp.vram_fill > MOECACHE_VRAM_FILL_CPU) {
        return moecache_fail_residency("unknown vram_fill " + std::to_string((int) cp.vram_fill));
    }
    if (cp.vram_copy < MOECACHE_VRAM_COPY_ASYNC || cp.vram_copy > MOECACHE_VRAM_COPY_SYNC) {
        return moecache_fail_residency("unknown vram_copy " + std::to_string((int) cp.vram_copy));
    }
    if (cp.unified < MOECACHE_UNIFIED_AUTO || cp.unified > MOECACHE_UNIFIED_ON) {
        return moecache_fail_residency("unknown unified " + std::to_string((int) cp.unified));
    }
    if (cp.unified == MOECACHE_UNIFIED_ON && cp.residency != MOECACHE_RESIDENCY_STREAM) {
        return moecache_fail_residency("unified = on needs stream residency: the device computes on the host slots");
    }
    const std::string mode = names[cp.residency];
    if (!cp.model_path || !cp.model_path[0]) {
        return moecache_fail_residency(mode + " residency needs model_path: the GGUF file the model was loaded from");
    }
    mc.res.path     = cp.model_path;
    mc.res.src_path = mc.res.path;
    mc.res.fd = open(mc.res.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (mc.res.fd < 0) {
        return moecache_fail_residency("cannot open '" + mc.res.path + "': " + strerror(errno));
    }
    struct gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * gg = gguf_init_from_file(mc.res.path.c_str(), gp);
    if (!gg) {
        return moecache_fail_residency("'" + mc.res.path + "' is not a readable GGUF file");
    }
    struct stat st;
    fstat(mc.res.fd, &st);
    const size_t data_off = gguf_get_data_offset(gg);
    std::string err;
    // the routed-expert weights of each layer, from the model's own layer struct
    for (int32_t il = 0; il < mc.n_layer && il < (int32_t) model->layers.size() && err.empty(); il++) {
        const llama_layer & ly = model->layers[il];
        for (ggml_tensor * t : { ly.ffn_gate_exps, ly.ffn_up_exps, ly.ffn_down_exps, ly.ffn_gate_up_exps }) {
            if (!t) {
                continue;
            }
            const std::string name = ggml_get_name(t);
            char where[512];
            if (t->ne[2] != mc.n_expert || ggml_n_dims(t) != 3) {
                snprintf(where, sizeof(where), "tensor %s has %lld experts, the model routes over %d", name.c_str(),
                         (long long) t->ne[2], mc.n_expert);
                err = where;
                break;
            }
            const int64_t id = gguf_find_tensor(gg, name.c_str());
            if (id < 0) {
                err = "tensor " + name + " is not in '" + mc.res.path + "' (a split GGUF, or another file?): " + mode +
                      " residency needs the single GGUF file the model was loaded from";
                break;
            }
            if (gguf_get_tensor_type(gg, id) != t->type || gguf_get_tensor_size(gg, id) != ggml_nbytes(t) ||
                !ggml_is_contiguous(t)) {
                err = "tensor " + name + " is not stored as in the file (type or layout differs)";
                break;
            }
            if (!moecache_tensor_is_mapped(t) || t->extra != nullptr) {
                err = "the experts of layer " + std::to_string(il) + " are not memory-mapped from the file in its layout (" +
                      (t->buffer ? ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)) : "no buffer") +
                      "): " + mode + " residency needs the model loaded with mmap after moecache_set_load_residency, "
                      "which keeps them there beside GPU layers too (pymoecache.Llama does this)";
                break;
            }
            moecache_expert_tensor x;
            x.model_t  = t;
            x.file_off = data_off + gguf_get_tensor_offset(gg, id);
            x.nb2      = t->nb[2];
            x.src_type = t->type; // (the companion's, with lowbit SOURCE: moecache_lowbit_open)
            x.src_off  = x.file_off;
            x.src_nb2  = x.nb2;
            if (x.file_off + (uint64_t) x.nb2 * mc.n_expert > (uint64_t) st.st_size) {
                err = "'" + mc.res.path + "' is truncated: tensor " + name + " ends past the end of the file";
                break;
            }
            moecache_layer & L = mc.layers[il];
            L.res.xt.push_back(x);
            L.res.expert_bytes += x.nb2;
            mc.res.xt_layer[t] = il;
        }
    }
    gguf_free(gg);
    if (!err.empty()) {
        return moecache_fail_residency(err);
    }
    if (mc.res.xt_layer.empty()) {
        return moecache_fail_residency("no routed-expert tensors (blk.N.ffn_{gate,up,down,gate_up}_exps) found in the model");
    }

    mc.res.io = new moecache_io();
    mc.ahead.req = std::vector<moecache_io_req>((size_t) mc.n_layer);
    mc.res.io->fd   = mc.res.fd;
    mc.res.io->timeline = &mc.timeline;
    mc.res.io->lock = cp.lock_memory;
    if (cp.residency == MOECACHE_RESIDENCY_STREAM && cp.direct_io) {
#if defined(O_DIRECT)
        mc.res.fd_direct = open(mc.res.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
#elif defined(__APPLE__)
        mc.res.fd_direct = open(mc.res.path.c_str(), O_RDONLY | O_CLOEXEC);
        if (mc.res.fd_direct >= 0) {
            fcntl(mc.res.fd_direct, F_NOCACHE, 1); // no alignment rules on macOS
        }
#endif
        // (a file system without O_DIRECT, e.g. tmpfs: buffered reads, then the pages are dropped)
    }
    mc.res.io->fd_direct = mc.res.fd_direct;
    moecache_io_start(*mc.res.io, cp.io_threads, cp.prefetch_threads);

    for (moecache_layer & L : mc.layers) {
        if (L.res.xt.empty()) {
            continue;
        }
        if (cp.residency == MOECACHE_RESIDENCY_MMAP) {
            moecache_mapping_advise_random(mc, L);
        }
        L.res.keep.assign(mc.n_expert, 0);
        L.res.locked.assign(mc.n_expert, 0);
    }
    if (cp.lock_dense) {
        moecache_dense_lock(mc, model);
    }
    if (cp.residency == MOECACHE_RESIDENCY_MMAP) {
        return MOECACHE_OK;
    }

    int32_t rc = moecache_unified_plan(mc, model); // (a layer computed in place gets no VRAM tier, but direct)
    if (rc != MOECACHE_OK) {
        return rc;
    }
    moecache_vram_plan(mc, model); // (before the arena: a layer with a VRAM tier gets a zero slot)
    moecache_lowbit_plan(mc);      // (and one with a low-bit pool)
    rc = moecache_lowbit_open(mc); // (SOURCE: the slots hold the companion's copies, and more of them)
    rc = rc == MOECACHE_OK ? moecache_slots_init(mc) : rc;
    rc = rc == MOECACHE_OK ? moecache_unified_init(mc) : rc;
    rc = rc == MOECACHE_OK ? moecache_vram_init(mc) : rc;
    rc = rc == MOECACHE_OK ? moecache_vram_direct_init(mc) : rc;
    rc = rc == MOECACHE_OK ? moecache_lowbit_init(mc) : rc;
    if (rc == MOECACHE_OK) {
        moecache_mapping_advise_stream(mc); // (STREAM here: MMAP returned above)
    }
    rc = rc == MOECACHE_OK ? moecache_slots_fill_all(mc) : rc;
    if (rc == MOECACHE_OK) {
        moecache_residency_hold_all(mc);
    }
    return rc;
}

// moecache_clear: the residency as a fresh cache's, so that a miss after a clear reads its expert as
// the first one did (the rows of ppl --miss, quality_lowbit.py and pareto_default.py --streamed clear
// between settings). STREAM slots forget the experts they hold (reads in flight cancelled), but for
// a layer that holds every expert (filled at creation, as a fresh cache is); MMAP unlocks and drops
// the pages it locked; the VRAM tier empties.
void moecache_residency_clear(moecache & mc) {
    if (mc.cparams.residency == MOECACHE_RESIDENCY_MMAP && mc.res.fd >= 0) {
        moecache_mapping_unlock_all(mc);
        for (moecache_layer & L : mc.layers) {
            std::fill(L.res.locked.begin(), L.res.locked.end(), 0);
        }
    }
    for (moecache_layer & L : mc.layers) {
        if (mc.cparams.residency == MOECACHE_RESIDENCY_STREAM && mc.res.io && L.res.n_slots > 0 && !L.res.all_in_slots) {
            for (int32_t s = 0; s < L.res.n_slots; s++) {
                moecache_slots_empty(mc, L, s);
            }
        }
        if (L.vram.n > 0) {
            moecache_vram_empty(L);
        }
    }
}

// A layer whose slots hold every expert (filled at creation: moecache_slots_fill_all) caches every
// expert: none of its selections reads a byte, so none is a miss (the counters of misses and of
// bytes read agree). After the creation, a clear, a warm start and a loaded cache state.
void moecache_residency_hold_all(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        if (!L.res.all_in_slots) {
            continue;
        }
        for (int32_t e = 0; e < (int32_t) L.last_use.size(); e++) {
            if (L.last_use[e] < 0) {
                moecache_layer_insert(L, e, nullptr); // (capacity >= N: nothing is evicted)
            }
        }
    }
}

void moecache_residency_free(moecache & mc) {
    moecache_dense_unlock(mc);
    for (moecache_layer & L : mc.layers) {
        L.res.relock = false; // (lent slots are unmapped below, not locked again)
    }
    if (mc.res.io && mc.res.fd >= 0 && !mc.layers.empty()) {
        moecache_mapping_begin(mc, -1, nullptr, 0); // (waits for and drops what a prompt read ahead)
    }
    if (mc.res.io) {
        moecache_io_stop(*mc.res.io);
    }
    if (mc.res.fd >= 0 && !mc.layers.empty()) {
        moecache_mapping_unlock_all(mc);
    }
    delete mc.res.io;
    mc.res.io = nullptr;
    moecache_vram_direct_free(mc);
    moecache_vram_free(mc);
    moecache_lowbit_free(mc);
    moecache_unified_free(mc); // (before the arena it wraps)
    if (mc.res.slots_buf) {
        ggml_backend_buffer_free(mc.res.slots_buf);
        mc.res.slots_buf = nullptr;
    }
    if (mc.res.slots_ctx) {
        ggml_free(mc.res.slots_ctx);
        mc.res.slots_ctx = nullptr;
    }
    if (mc.res.arena) {
        munmap(mc.res.arena, mc.res.arena_size);
        mc.res.arena = nullptr;
    }
    if (mc.res.fd_direct >= 0) {
        close(mc.res.fd_direct);
        mc.res.fd_direct = -1;
    }
    if (mc.res.fd >= 0) {
        close(mc.res.fd);
        mc.res.fd = -1;
    }
}
