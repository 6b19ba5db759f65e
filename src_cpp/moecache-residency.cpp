// moecache-residency.cpp - where the routed experts' bytes live (moecache.h, enum moecache_residency).
//
// STREAM: each MoE layer owns a slot arena per expert tensor, [ne0, ne1, n_slots], in one
// anonymous mapping that is mlocked. The layer's mul_mat_id calls read the slots instead of the
// model's tensors: during the graph build, moecache_residency_mul_mat_id puts one op in front of
// them (op_experts) that turns expert ids into slot ids. At compute time, for a one-token ubatch,
// that op reads every selected or cached expert that no slot holds yet from the GGUF, with direct
// I/O and several reads in flight (moecache_io), then writes the slot ids. Prompt ubatches touch
// almost every expert: they read the model's mmapped tensors as stock llama.cpp does (the next
// MoE layers' asked for ahead on the reader threads), copy the experts that stay cached into
// their slots, and drop each layer's pages once the next layer runs.
//
// MMAP: the matmuls read the model's mapping; op_experts locks the pages of the cached experts
// and unlocks and drops the pages of the evicted ones (and of experts run without being cached).
//
// The logical cache (moecache-route.cpp) decides hits and misses; this file only makes memory
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

// the mapping of a truncated file raises SIGBUS: check the file still covers `end` before touching it
static bool file_covers(moecache & mc, uint64_t end) {
    struct stat st;
    if (fstat(mc.fd, &st) != 0) {
        moecache_set_io_error(mc, "model file '" + mc.path + "' cannot be read any more: " + strerror(errno));
        return false;
    }
    if ((uint64_t) st.st_size < end) {
        moecache_set_io_error(mc, "model file '" + mc.path + "' was truncated to " + std::to_string((long long) st.st_size) +
                         " bytes while in use (the experts need " + std::to_string((unsigned long long) end) + ")");
        return false;
    }
    return true;
}

// --- page bookkeeping of the mapping ---------------------------------------------------------

// pages that lie entirely inside expert e's bytes of tensor x (neighbours are never touched)
static bool inner_pages(const moecache_expert_tensor & x, int32_t e, char ** a, size_t * len) {
    const uintptr_t b0 = (uintptr_t) x.model_t->data + (uintptr_t) e * x.nb2;
    const uintptr_t p0 = moecache_round_up(b0, moecache_page_size());
    const uintptr_t p1 = (b0 + x.nb2) / moecache_page_size() * moecache_page_size();
    if (p1 <= p0) {
        return false;
    }
    *a   = (char *) p0;
    *len = p1 - p0;
    return true;
}

// ask the kernel to read expert e's pages now, in large requests (the expert regions are
// MADV_RANDOM: no readahead drags neighbours into the page cache behind the budget's back)
void moecache_willneed_expert(const moecache_layer & L, int32_t e) {
    if (L.il <= L.mc->ahead_last) {
        return; // asked for by the read-ahead of this prompt
    }
    for (const moecache_expert_tensor & x : L.res.xt) {
        moecache_io_willneed((const char *) x.model_t->data + (size_t) e * x.nb2, x.nb2);
    }
}

// drop expert e's pages from this process and from the page cache
static void drop_expert(moecache & mc, moecache_layer & L, int32_t e, bool unlock) {
    for (const moecache_expert_tensor & x : L.res.xt) {
        char * a;
        size_t len;
        if (!inner_pages(x, e, &a, &len)) {
            continue;
        }
        if (unlock) {
            munlock(a, len);
        }
        madvise(a, len, MADV_DONTNEED);
#ifdef __linux__
        const uint64_t off = x.file_off + (uint64_t) ((uintptr_t) a - (uintptr_t) x.model_t->data);
        posix_fadvise(mc.fd, (off_t) off, (off_t) len, POSIX_FADV_DONTNEED);
#endif
    }
}

// drops what was read through the mapping, but for the layers from `il` to the last one read
// ahead (il = -1: everything)
static void drop_pending(moecache & mc, int32_t il) {
    size_t n_kept = 0; // (kept in place: no allocation per layer)
    for (size_t i = 0; i < mc.drop_pending.size(); i++) {
        const std::pair<int32_t, int32_t> le = mc.drop_pending[i];
        if (il >= 0 && le.first >= il && le.first <= mc.ahead_last) {
            mc.drop_pending[n_kept++] = le;
            continue;
        }
        moecache_layer & L = mc.layers[le.first];
        const bool keep = mc.cparams.residency == MOECACHE_RESIDENCY_MMAP && L.res.locked[le.second];
        if (!keep) {
            drop_expert(mc, L, le.second, false);
        }
    }
    mc.drop_pending.resize(n_kept);
}

#define MOECACHE_READ_AHEAD 2                 // MoE layers a prompt reads ahead of the one computing
#define MOECACHE_READ_AHEAD_RESERVE (64 << 20) // bytes of free memory a read-ahead leaves alone

// bytes a prompt may read into the page cache now: what the OS can give (Linux: MemAvailable)
// less MOECACHE_READ_AHEAD_RESERVE; -1 where unknown
static int64_t read_room() {
    int64_t kib = -1;
#if defined(__linux__)
    FILE * f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        while (fgets(line, sizeof(line), f)) {
            long long v;
            if (sscanf(line, "MemAvailable: %lld kB", &v) == 1) {
                kib = (int64_t) v;
                break;
            }
        }
        fclose(f);
    }
#endif
    return kib < 0 ? -1 : kib * 1024 - MOECACHE_READ_AHEAD_RESERVE;
}

static int64_t layer_file_bytes(const moecache & mc, const moecache_layer & L) {
    return (int64_t) L.res.expert_bytes * mc.n_expert;
}

// the reader threads ask the kernel for all experts of layer il (MADV_WILLNEED: large read
// requests instead of a page per fault), to be dropped once the prompt is past that layer
static void ask_layer(moecache & mc, int32_t il) {
    const moecache_layer & next = mc.layers[il];
    for (int32_t e = 0; e < mc.n_expert; e++) {
        if (mc.cparams.residency == MOECACHE_RESIDENCY_MMAP && next.res.locked[e]) {
            continue;
        }
        for (const moecache_expert_tensor & x : next.res.xt) {
            moecache_io_job j = {};
            j.kind = MOECACHE_IO_AHEAD;
            j.src  = (const char *) x.model_t->data + (size_t) e * x.nb2;
            j.len  = x.nb2;
            j.il   = il;
            j.e    = e;
            moecache_io_submit(*mc.io, mc.ahead_req[il], j, (float) (mc.n_layer - il)); // nearest first
        }
        mc.drop_pending.emplace_back(il, e);
    }
    mc.ahead_last = il;
}

// A prompt ubatch that touches most experts of a layer will touch most of the next MoE layers'
// too: they are asked for while this layer computes, MOECACHE_READ_AHEAD MoE layers ahead, as
// far as the free memory holds them beside this layer's (on a small device, pages read ahead and
// dropped again before their layer runs would be read twice, and then a page per fault)
static void read_ahead(moecache & mc, const moecache_layer & L) {
    int64_t room = read_room(); // (the page cache of layers asked for counts as available: less them)
    if (room >= 0) {
        room -= layer_file_bytes(mc, L);
        for (int32_t il = L.il + 1; il <= mc.ahead_last; il++) {
            room -= mc.layers[il].res.xt.empty() ? 0 : layer_file_bytes(mc, mc.layers[il]);
        }
    }
    int32_t n_ahead = 0;
    for (int32_t il = L.il + 1; il < mc.n_layer && n_ahead < MOECACHE_READ_AHEAD; il++) {
        const moecache_layer & next = mc.layers[il];
        if (next.res.xt.empty() || next.res.all_in_slots) {
            continue; // (all in slots: its prompts read nothing)
        }
        n_ahead++;
        if (il <= mc.ahead_last) {
            continue; // asked for already
        }
        if (room >= 0 && (room -= layer_file_bytes(mc, next)) < 0) {
            break; // asked for by its own layer then (moecache_residency_sync)
        }
        ask_layer(mc, il);
    }
}

// before layer il's prompt (il = -1: a decode) the read-ahead of il is waited for; at the
// start of a ubatch or a decode, what an interrupted ubatch left queued is dropped
static void finish_read_ahead(moecache & mc, int32_t il) {
    if (il < 0 || il <= mc.prompt_il_last) {
        for (int32_t a = 0; a <= mc.ahead_last; a++) {
            moecache_io_cancel(*mc.io, mc.ahead_req[a]);
        }
        mc.ahead_last = -1; // (its pages are dropped with the rest of drop_pending)
    } else if (il <= mc.ahead_last) {
        moecache_io_wait(*mc.io, mc.ahead_req[il]); // (a failed hint is no error: the matmul faults the pages in)
    }
    mc.prompt_il_last = il;
}

// --- making memory follow the cache (called by the graph op, moecache-graph.cpp) --------------

// MMAP: lock the cached experts, unlock and drop the others; experts run uncached are dropped later
static void mmap_sync(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids, bool decode) {
    const int32_t N = mc.n_expert;
    std::vector<moecache_io_job> & jobs = mc.io->scratch;
    jobs.clear();
    for (int32_t e = 0; e < N; e++) {
        const bool want = L.last_use[e] >= 0;
        if (want && !L.res.locked[e]) {
            for (const moecache_expert_tensor & x : L.res.xt) {
                moecache_io_job j = {};
                j.kind = MOECACHE_IO_LOCK;
                j.src  = (const char *) x.model_t->data + (size_t) e * x.nb2;
                j.len  = x.nb2;
                j.il   = L.il;
                j.e    = e;
                jobs.push_back(j);
            }
            L.res.locked[e] = 1;
        } else if (!want && L.res.locked[e]) {
            drop_expert(mc, L, e, true);
            L.res.locked[e] = 0;
        }
    }
    moecache_io_run(*mc.io, jobs);
    int64_t bytes = 0;
    for (const moecache_io_job & j : jobs) {
        bytes += (int64_t) j.bytes_io;
    }
    std::fill(L.res.keep.begin(), L.res.keep.end(), 0);
    for (int64_t i = 0; i < n_ids; i++) {
        const int32_t e = ids[i];
        if (!L.res.locked[e] && !L.res.keep[e]) {
            L.res.keep[e] = 1;
            moecache_willneed_expert(L, e);
            bytes += (int64_t) L.res.expert_bytes; // faulted in by the matmul
            mc.drop_pending.emplace_back(L.il, e);
        }
    }
    if (decode) {
        mc.rst.decode_bytes_read += bytes;
        mc.rst.decode_loads      += (int64_t) (jobs.size() / std::max<size_t>(1, L.res.xt.size()));
    } else {
        mc.rst.prompt_bytes_read += bytes;
    }
}

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
    finish_read_ahead(mc, il_prompt);
    drop_pending(mc, il_prompt);
    if (L.vram.n > 0) {
        t_copy = moecache_vram_begin(mc, L); // (copies up made ahead for this layer: before its slots change)
    }
    if (stream && (decode || L.res.all_in_slots)) { // (a prompt waits for every read: it reads none)
        moecache_slots_decode(mc, L, ids, out, n_ids, !decode || !mc.cparams.overlap_experts);
        if (decode && L.vram.n > 0) {
            t_copy += moecache_vram_decode(mc, L, ids, out, n_ids); // (those computed on the device: the zero slot)
        }
    } else {
        uint64_t end = 0;
        for (const moecache_expert_tensor & x : L.res.xt) {
            end = std::max<uint64_t>(end, x.file_off + (uint64_t) x.nb2 * mc.n_expert);
        }
        if (file_covers(mc, end)) {
            if (!decode && n_ids >= mc.n_expert && L.il > mc.ahead_last) {
                // not read ahead (the first layer, or no room): all at once now, where it fits
                const int64_t room = read_room();
                if (room < 0 || room >= layer_file_bytes(mc, L)) {
                    ask_layer(mc, L.il);
                    moecache_io_wait(*mc.io, mc.ahead_req[L.il]);
                }
            }
            if (stream) {
                moecache_slots_prompt(mc, L, ids, n_ids);
            } else {
                mmap_sync(mc, L, ids, n_ids, decode);
            }
            if (!decode && n_ids >= mc.n_expert) { // (n_ids = tokens x K)
                read_ahead(mc, L);
            }
        }
    }
    if (mc.io->lock_failed.load() && mc.arena_locked == false && mc.cparams.lock_memory) {
        moecache_warn_mlock_once(L.res.expert_bytes * (size_t) std::max(L.capacity, 1) * mc.layers.size(), mc.io->lock_errno.load());
    }
    const int64_t t1 = moecache_time_us();
    (decode ? mc.t_io_decode_us : mc.t_io_prompt_us) += t1 - t0 - t_copy;
    moecache_graph_event(mc, MOECACHE_EVENT_WAIT, L.il, -1, decode ? 1 : (int32_t) (n_ids / std::max(1, mc.n_expert_used)),
                         t0, t0, t1);
}

// --- the dense part ------------------------------------------------------------------------
//
// Every token reads all of the model's weights but the routed experts. Mapped from the file, those
// pages are the kernel's to drop when memory runs short, and then every token reads them back (a
// major fault per page): on a device with little memory left a decode becomes a page-in of the
// dense part. lock_dense mlocks them. The token-embedding table stays unlocked unless the output
// reuses it: a token reads one row of it. Several moecaches on one model share the lock.

struct dense_lock {
    int32_t users = 0;
    int64_t bytes = 0;
    std::vector<std::pair<char *, size_t>> ranges; // page-aligned, sorted, disjoint
};

static std::mutex g_dense_mu;
static std::unordered_map<const llama_model *, dense_lock> g_dense; // model -> its locked dense part

static void dense_lock_acquire(moecache & mc, const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_dense_mu);
    dense_lock & d = g_dense[model];
    mc.dense_model = model;
    if (d.users++ > 0) {
        mc.dense_locked = d.bytes;
        return;
    }
    const size_t page = moecache_page_size();
    std::vector<std::pair<char *, size_t>> want; // [begin, end) per tensor
    for (const auto & nt : model->tensors_by_name) {
        const ggml_tensor * t = nt.second;
        if (mc.xt_layer.count(t) || !moecache_tensor_is_mapped(t)) {
            continue; // a routed expert, or not in the mapping (already anonymous memory)
        }
        if (t == model->tok_embd && !(model->output && model->output->data == t->data)) {
            continue;
        }
        char * b = (char *) ((uintptr_t) t->data & ~(uintptr_t) (page - 1));
        char * e = (char *) moecache_round_up((uintptr_t) t->data + ggml_nbytes(t), page);
        want.push_back({ b, (size_t) (e - b) });
    }
    std::sort(want.begin(), want.end());
    for (const auto & r : want) { // merge: tensors share pages and lie next to each other
        if (!d.ranges.empty() && r.first <= d.ranges.back().first + d.ranges.back().second) {
            size_t end = std::max((size_t) (r.first - d.ranges.back().first) + r.second, d.ranges.back().second);
            d.ranges.back().second = end;
        } else {
            d.ranges.push_back(r);
        }
    }
    int64_t total = 0;
    for (const auto & r : d.ranges) {
        total += (int64_t) r.second;
    }
    for (size_t i = 0; i < d.ranges.size(); i++) {
        if (mlock(d.ranges[i].first, d.ranges[i].second) != 0) {
            const int err = errno;
            for (size_t j = 0; j < i; j++) {
                munlock(d.ranges[j].first, d.ranges[j].second);
            }
            d.ranges.clear();
            static std::once_flag once;
            std::call_once(once, [total, err] {
                LLAMA_LOG_WARN("moecache: warning: mlock of the model's dense part (%.1f MiB, the weights every token "
                               "reads) was refused (%s). The run goes on with it mapped: when memory runs short the "
                               "OS drops its pages and every token reads them back. Fix: raise the limit (`ulimit -l "
                               "unlimited`), or lock_dense=False / --no-mlock to silence this.\n",
                               (double) total / (1 << 20), strerror(err));
            });
            break;
        }
    }
    d.bytes = d.ranges.empty() ? 0 : total;
    mc.dense_locked = d.bytes;
#ifdef __linux__
    for (const moecache_layer & L : mc.layers) { // what the kernel read around the locked pages: not needed
        for (const moecache_expert_tensor & x : L.res.xt) {
            posix_fadvise(mc.fd, (off_t) x.file_off, (off_t) (x.nb2 * (size_t) mc.n_expert), POSIX_FADV_DONTNEED);
        }
    }
#endif
}

static void dense_lock_release(moecache & mc) {
    if (!mc.dense_model) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_dense_mu);
    auto it = g_dense.find(mc.dense_model);
    if (it != g_dense.end() && --it->second.users == 0) {
        for (const auto & r : it->second.ranges) {
            munlock(r.first, r.second);
        }
        g_dense.erase(it);
    }
    mc.dense_model  = nullptr;
    mc.dense_locked = 0;
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
    mc.path = cp.model_path;
    mc.fd = open(mc.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (mc.fd < 0) {
        return moecache_fail_residency("cannot open '" + mc.path + "': " + strerror(errno));
    }
    struct gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * gg = gguf_init_from_file(mc.path.c_str(), gp);
    if (!gg) {
        return moecache_fail_residency("'" + mc.path + "' is not a readable GGUF file");
    }
    struct stat st;
    fstat(mc.fd, &st);
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
                err = "tensor " + name + " is not in '" + mc.path + "' (a split GGUF, or another file?): " + mode +
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
            if (x.file_off + (uint64_t) x.nb2 * mc.n_expert > (uint64_t) st.st_size) {
                err = "'" + mc.path + "' is truncated: tensor " + name + " ends past the end of the file";
                break;
            }
            moecache_layer & L = mc.layers[il];
            L.res.xt.push_back(x);
            L.res.expert_bytes += x.nb2;
            mc.xt_layer[t] = il;
        }
    }
    gguf_free(gg);
    if (!err.empty()) {
        return moecache_fail_residency(err);
    }
    if (mc.xt_layer.empty()) {
        return moecache_fail_residency("no routed-expert tensors (blk.N.ffn_{gate,up,down,gate_up}_exps) found in the model");
    }

    mc.io = new moecache_io();
    mc.ahead_req = std::vector<moecache_io_req>((size_t) mc.n_layer);
    mc.io->fd   = mc.fd;
    mc.io->timeline = &mc.timeline;
    mc.io->lock = cp.lock_memory;
    if (cp.residency == MOECACHE_RESIDENCY_STREAM && cp.direct_io) {
#if defined(O_DIRECT)
        mc.fd_direct = open(mc.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
#elif defined(__APPLE__)
        mc.fd_direct = open(mc.path.c_str(), O_RDONLY | O_CLOEXEC);
        if (mc.fd_direct >= 0) {
            fcntl(mc.fd_direct, F_NOCACHE, 1); // no alignment rules on macOS
        }
#endif
        // (a file system without O_DIRECT, e.g. tmpfs: buffered reads, then the pages are dropped)
    }
    mc.io->fd_direct = mc.fd_direct;
    moecache_io_start(*mc.io, cp.io_threads, cp.prefetch_threads);

    for (moecache_layer & L : mc.layers) {
        if (L.res.xt.empty()) {
            continue;
        }
        // MMAP decodes fault the experts in: no readahead beyond them. (STREAM decodes read with
        // pread; its prompts fault through the mapping and are better off with the kernel's
        // readahead where the memory is too short to ask for a whole layer.)
        for (const moecache_expert_tensor & x : L.res.xt) {
            char * a;
            size_t len;
            moecache_expert_tensor all = x;
            all.nb2 = x.nb2 * (size_t) mc.n_expert; // the whole tensor as one "expert"
            if (cp.residency == MOECACHE_RESIDENCY_MMAP && inner_pages(all, 0, &a, &len)) {
                madvise(a, len, MADV_RANDOM);
            }
        }
        L.res.keep.assign(mc.n_expert, 0);
        L.res.locked.assign(mc.n_expert, 0);
    }
    if (cp.lock_dense) {
        dense_lock_acquire(mc, model);
    }
    if (cp.residency == MOECACHE_RESIDENCY_MMAP) {
        return MOECACHE_OK;
    }

    int32_t rc = moecache_unified_plan(mc, model); // (a layer computed in place gets no VRAM tier)
    if (rc != MOECACHE_OK) {
        return rc;
    }
    moecache_vram_plan(mc, model); // (before the arena: a layer with a VRAM tier gets a zero slot)
    rc = moecache_slots_init(mc);
    rc = rc == MOECACHE_OK ? moecache_unified_init(mc) : rc;
    rc = rc == MOECACHE_OK ? moecache_vram_init(mc) : rc;
    return rc == MOECACHE_OK ? moecache_slots_fill_all(mc) : rc;
}

void moecache_residency_free(moecache & mc) {
    dense_lock_release(mc);
    if (mc.io && mc.fd >= 0 && !mc.layers.empty()) {
        finish_read_ahead(mc, -1);
        drop_pending(mc, -1);
    }
    if (mc.io) {
        moecache_io_stop(*mc.io);
    }
    if (mc.fd >= 0 && !mc.layers.empty()) {
        for (moecache_layer & L : mc.layers) {
            for (int32_t e = 0; e < (int32_t) L.res.locked.size(); e++) {
                if (L.res.locked[e]) {
                    drop_expert(mc, L, e, true);
                }
            }
        }
    }
    delete mc.io;
    mc.io = nullptr;
    moecache_vram_free(mc);
    moecache_unified_free(mc); // (before the arena it wraps)
    if (mc.slots_buf) {
        ggml_backend_buffer_free(mc.slots_buf);
        mc.slots_buf = nullptr;
    }
    if (mc.slots_ctx) {
        ggml_free(mc.slots_ctx);
        mc.slots_ctx = nullptr;
    }
    if (mc.arena) {
        munmap(mc.arena, mc.arena_size);
        mc.arena = nullptr;
    }
    if (mc.fd_direct >= 0) {
        close(mc.fd_direct);
        mc.fd_direct = -1;
    }
    if (mc.fd >= 0) {
        close(mc.fd);
        mc.fd = -1;
    }
}
