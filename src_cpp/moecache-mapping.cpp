// moecache-mapping.cpp - the routed experts' pages in llama.cpp's mapping of the GGUF: what MMAP
// residency locks and drops as the cache changes, and what every prompt reads through the mapping,
// asked for a few MoE layers ahead (as far as the free memory allows) and dropped behind.

#include "moecache-impl.h"
#include "moecache-io.h"

#include "ggml.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

// the mapping of a truncated file raises SIGBUS: check the file still covers `end` before touching it
static bool file_covers(moecache & mc, uint64_t end) {
    struct stat st;
    if (fstat(mc.res.fd, &st) != 0) {
        moecache_set_io_error(mc, "model file '" + mc.res.path + "' cannot be read any more: " + strerror(errno));
        return false;
    }
    if ((uint64_t) st.st_size < end) {
        moecache_set_io_error(mc, "model file '" + mc.res.path + "' was truncated to " + std::to_string((long long) st.st_size) +
                         " bytes while in use (the experts need " + std::to_string((unsigned long long) end) + ")");
        return false;
    }
    return true;
}

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

// the experts of layer il this prompt's read-ahead has asked for (its first ones, in order)
static int32_t n_asked(const moecache & mc, int32_t il) {
    return il < mc.ahead.last ? mc.n_expert : il == mc.ahead.last ? mc.ahead.last_e : 0;
}

// expert e of layer il was asked for by this prompt's read-ahead
static bool asked_ahead(const moecache & mc, int32_t il, int32_t e) {
    return e < n_asked(mc, il);
}

// ask the kernel to read expert e's pages now, in large requests (the expert regions are
// MADV_RANDOM: no readahead drags neighbours into the page cache behind the budget's back)
void moecache_willneed_expert(const moecache_layer & L, int32_t e) {
    if (asked_ahead(*L.mc, L.il, e) || L.il == L.mc->ahead.faulted) {
        return;
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
        posix_fadvise(mc.res.fd, (off_t) off, (off_t) len, POSIX_FADV_DONTNEED);
#endif
    }
}

// drops what was read through the mapping, but for the layers from `il` to the last one read
// ahead (il = -1: everything)
static void drop_pending(moecache & mc, int32_t il) {
    size_t n_kept = 0; // (kept in place: no allocation per layer)
    for (size_t i = 0; i < mc.res.drop_pending.size(); i++) {
        const std::pair<int32_t, int32_t> le = mc.res.drop_pending[i];
        if (il >= 0 && le.first >= il && le.first <= mc.ahead.last) {
            mc.res.drop_pending[n_kept++] = le;
            continue;
        }
        moecache_layer & L = mc.layers[le.first];
        const bool keep = mc.cparams.residency == MOECACHE_RESIDENCY_MMAP && L.res.locked[le.second];
        const int32_t s = L.res.expert_slot.empty() ? -1 : L.res.expert_slot[le.second];
        if (!keep && s >= 0 && s < L.res.n_slots && L.res.slot_expert[s] == le.second) {
            moecache_io_wait(*mc.res.io, L.res.slot_req[s]); // (STREAM: a prompt's copy from these pages, not read twice)
        }
        if (!keep) {
            drop_expert(mc, L, le.second, false);
        }
    }
    mc.res.drop_pending.resize(n_kept);
}

#define MOECACHE_READ_AHEAD 2                 // MoE layers a prompt reads ahead of the one computing
#define MOECACHE_READ_AHEAD_RESERVE (64 << 20) // bytes of free memory a read-ahead leaves alone

static int64_t read_file_int(const std::string & path) {
    FILE * f = fopen(path.c_str(), "r");
    if (!f) {
        return -1;
    }
    long long v = -1;
    if (fscanf(f, "%lld", &v) != 1) {
        v = -1; // ("max": no limit)
    }
    fclose(f);
    return (int64_t) v;
}

// the values of keys[0..n) in a memory.stat file, read once (-1 where absent)
static void read_stats(const std::string & path, const char * const * keys, int64_t * out, int n) {
    for (int i = 0; i < n; i++) {
        out[i] = -1;
    }
    FILE * f = fopen(path.c_str(), "r");
    if (!f) {
        return;
    }
    char name[128];
    long long v;
    while (fscanf(f, "%127s %lld", name, &v) == 2) {
        for (int i = 0; i < n; i++) {
            if (strcmp(name, keys[i]) == 0) {
                out[i] = (int64_t) v;
            }
        }
    }
    fclose(f);
}

// this process's memory cgroup, found once: its folder and whether it is v1 ("" where none)
struct cgroup_memory {
    std::string dir;
    bool        v1 = false;
};

static cgroup_memory find_cgroup_memory() {
    cgroup_memory cg;
#if defined(__linux__)
    FILE * f = fopen("/proc/self/cgroup", "r");
    if (!f) {
        return cg;
    }
    char line[4096];
    std::string v2;
    while (fgets(line, sizeof(line), f)) { // "hierarchy:controllers:path"
        std::string s(line);
        s.erase(s.find_last_not_of("\n") + 1);
        const size_t c1 = s.find(':');
        const size_t c2 = c1 == std::string::npos ? c1 : s.find(':', c1 + 1);
        if (c2 == std::string::npos) {
            continue;
        }
        const std::string ctrl = "," + s.substr(c1 + 1, c2 - c1 - 1) + ",";
        const std::string rel  = s.substr(c2 + 1);
        if (ctrl.find(",memory,") != std::string::npos) {
            // v1 (the memory controller's own mount; a container sees its cgroup at the mount's root)
            for (const std::string & d : { "/sys/fs/cgroup/memory" + rel, std::string("/sys/fs/cgroup/memory") }) {
                if (read_file_int(d + "/memory.limit_in_bytes") >= 0) {
                    cg.dir = d;
                    cg.v1  = true;
                    break;
                }
            }
            break;
        }
        if (s.compare(0, 3, "0::") == 0) {
            v2 = "/sys/fs/cgroup" + rel;
        }
    }
    fclose(f);
    if (!cg.v1 && !v2.empty()) {
        cg.dir = v2;
    }
#endif
    return cg;
}

// bytes a cgroup's memory limit still leaves (limit less usage, its inactive page cache counted as
// free as MemAvailable counts it): v1 its hierarchical limit, v2 the tightest of it and its
// ancestors; -1 where no limit binds
static int64_t cgroup_room() {
    static const cgroup_memory cg = find_cgroup_memory();
    if (cg.dir.empty()) {
        return -1;
    }
    if (cg.v1) {
        static const char * const keys[2] = { "hierarchical_memory_limit", "total_inactive_file" };
        int64_t stat[2]; // [hierarchical limit, inactive page cache]
        read_stats(cg.dir + "/memory.stat", keys, stat, 2);
        int64_t limit = read_file_int(cg.dir + "/memory.limit_in_bytes");
        if (stat[0] >= 0 && (limit < 0 || stat[0] < limit)) {
            limit = stat[0];
        }
        const int64_t usage = read_file_int(cg.dir + "/memory.usage_in_bytes");
        if (limit < 0 || limit >= ((int64_t) 1 << 62) || usage < 0) {
            return -1;
        }
        return std::max<int64_t>(0, limit - usage + std::max<int64_t>(0, stat[1]));
    }
    int64_t room = -1;
    for (std::string d = cg.dir; ; d = d.substr(0, d.find_last_of('/'))) {
        const int64_t limit = read_file_int(d + "/memory.max");
        const int64_t usage = read_file_int(d + "/memory.current");
        if (limit >= 0 && usage >= 0) {
            static const char * const key[1] = { "inactive_file" };
            int64_t inactive;
            read_stats(d + "/memory.stat", key, &inactive, 1);
            inactive = std::max<int64_t>(0, inactive);
            const int64_t r = std::max<int64_t>(0, limit - usage + inactive);
            room = room < 0 ? r : std::min(room, r);
        }
        if (d.size() <= strlen("/sys/fs/cgroup")) {
            break;
        }
    }
    return room;
}

// bytes a prompt may read into the page cache now: what the OS can give (Linux: MemAvailable,
// capped by a cgroup's limit) less MOECACHE_READ_AHEAD_RESERVE; -1 where unknown
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
    if (kib < 0) {
        return -1;
    }
    int64_t room = kib * 1024;
    const int64_t cg = cgroup_room();
    if (cg >= 0 && cg < room) {
        room = cg;
    }
    return std::max<int64_t>(0, room - MOECACHE_READ_AHEAD_RESERVE); // (a cap nearly reached: no room, not unknown)
}

static int64_t layer_file_bytes(const moecache & mc, const moecache_layer & L) {
    return (int64_t) L.res.expert_bytes * mc.n_expert;
}

// the reader threads ask the kernel for the experts of layer il up to e_end, in order, after those
// asked already (only those marked in `only` where given: [n_expert]): STREAM faults them in (the
// fault's readahead: large reads in large folios), MMAP asks with MADV_WILLNEED (its regions are
// MADV_RANDOM: a fault reads a page); they are dropped once the prompt is past that layer
static void ask_layer(moecache & mc, int32_t il, int32_t e_end, const uint8_t * only = nullptr) {
    const moecache_layer & next = mc.layers[il];
    const bool stream = mc.cparams.residency == MOECACHE_RESIDENCY_STREAM;
    for (int32_t e = n_asked(mc, il); e < e_end; e++) {
        if ((mc.cparams.residency == MOECACHE_RESIDENCY_MMAP && next.res.locked[e]) || (only && !only[e])) {
            continue;
        }
        for (const moecache_expert_tensor & x : next.res.xt) {
            moecache_io_job j = {};
            j.kind = stream ? MOECACHE_IO_FAULT : MOECACHE_IO_AHEAD;
            j.src  = (const char *) x.model_t->data + (size_t) e * x.nb2;
            j.len  = x.nb2;
            j.il   = il;
            j.e    = e;
            moecache_io_submit(*mc.res.io, mc.ahead.req[il], j, (float) (mc.n_layer - il)); // nearest first
        }
        mc.res.drop_pending.emplace_back(il, e);
    }
    mc.ahead.last   = il;
    mc.ahead.last_e = e_end;
}

// A prompt ubatch that touches most experts of a layer will touch most of the next MoE layers'
// too: they are asked for while this layer computes, MOECACHE_READ_AHEAD MoE layers ahead, as
// far as the free memory holds them beside this layer's. Where it holds only part of the next
// layer, that part (its first experts: the matmul runs them first) is read while this layer
// computes and the rest when its own layer starts: the disk stays busy through the compute. (On a
// small device, pages read ahead and dropped again before their layer runs would be read twice.)
static void read_ahead(moecache & mc, const moecache_layer & L) {
    const int32_t N = mc.n_expert;
    int64_t room = read_room(); // (the page cache of layers asked for counts as available: less them)
    const bool known = room >= 0; // (less what is asked, the room may fall below 0: nothing more is asked then)
    if (known) {
        room -= layer_file_bytes(mc, L);
        room -= mc.res.refill_bytes; // (and its copies into the slots it took back, charged as they run)
        for (int32_t il = L.il + 1; il <= mc.ahead.last; il++) {
            room -= mc.layers[il].res.xt.empty() ? 0 : (int64_t) mc.layers[il].res.expert_bytes * n_asked(mc, il);
        }
    }
    int32_t n_ahead = 0;
    for (int32_t il = L.il + 1; il < mc.n_layer && n_ahead < MOECACHE_READ_AHEAD; il++) {
        const moecache_layer & next = mc.layers[il];
        if (next.res.xt.empty() || next.res.all_in_slots) {
            continue; // (all in slots: its prompts read nothing)
        }
        n_ahead++;
        room -= known ? moecache_slots_lent_bytes(mc, il, il) : 0; // (its slots, lent, fill again before it runs)
        const int32_t e_begin = n_asked(mc, il);
        if (e_begin >= N) {
            continue; // asked for already
        }
        int32_t       e_end   = N;
        if (known) {
            const int64_t fit = room / std::max<int64_t>(1, (int64_t) next.res.expert_bytes);
            e_end = (int32_t) std::min<int64_t>(N, e_begin + std::max<int64_t>(0, fit));
            room -= (int64_t) next.res.expert_bytes * (e_end - e_begin);
        }
        if (e_end <= e_begin) {
            break; // asked for by its own layer then (moecache_residency_sync)
        }
        ask_layer(mc, il, e_end);
        if (e_end < N) {
            break;
        }
    }
}

// before layer il's prompt (il = -1: a decode) the read-ahead of il is waited for, less the experts
// its ubatch did not select (selected: [n_expert], known now) that are still queued: they would be
// read for nothing; at the start of a ubatch or a decode, what an interrupted ubatch left queued is dropped
static void finish_read_ahead(moecache & mc, int32_t il, const uint8_t * selected) {
    if (il < 0 || il <= mc.prompt_il_last) {
        for (int32_t a = 0; a <= mc.ahead.last; a++) {
            moecache_io_cancel(*mc.res.io, mc.ahead.req[a]);
        }
        mc.ahead.last   = -1; // (its pages are dropped with the rest of drop_pending)
        mc.ahead.last_e = 0;
    } else if (il <= mc.ahead.last) {
        moecache_io_drop_queued(*mc.res.io, mc.ahead.req[il], selected);
        moecache_io_wait(*mc.res.io, mc.ahead.req[il]); // (a failed hint is no error: the matmul faults the pages in)
    }
    mc.prompt_il_last = il;
}

// --- MMAP: the cached experts locked, the others dropped ------------------------------------

// MMAP: lock the cached experts, unlock and drop the others; experts run uncached are dropped later
static void mmap_sync(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids, bool decode) {
    const int32_t N = mc.n_expert;
    std::vector<moecache_io_job> & jobs = mc.res.io->scratch;
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
    moecache_io_run(*mc.res.io, jobs);
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
            mc.res.drop_pending.emplace_back(L.il, e);
        }
    }
    if (decode) {
        mc.rst.decode_bytes_read += bytes;
        mc.rst.decode_loads      += (int64_t) (jobs.size() / std::max<size_t>(1, L.res.xt.size()));
    } else {
        mc.rst.prompt_bytes_read += bytes;
    }
}

// --- the calls of moecache-residency.cpp -------------------------------------------------------

void moecache_mapping_begin(moecache & mc, int32_t il_prompt, const int32_t * ids, int64_t n_ids) {
    std::vector<uint8_t> & selected = mc.ahead.selected; // [n_expert]
    if (il_prompt >= 0) {
        selected.assign(mc.n_expert, 0);
        for (int64_t i = 0; i < n_ids; i++) {
            selected[ids[i]] = 1; // (ids checked by the caller)
        }
    }
    const bool ubatch_start = il_prompt >= 0 && (mc.prompt_il_last < 0 || il_prompt <= mc.prompt_il_last);
    finish_read_ahead(mc, il_prompt, selected.data());
    drop_pending(mc, il_prompt);
    if (il_prompt < 0) {
        moecache_slots_relock(mc);
    } else if (ubatch_start && mc.cparams.residency == MOECACHE_RESIDENCY_STREAM && n_ids >= mc.n_expert) {
        // a ubatch with room for its first layer but not the next one too: the last layers' slots lend what the
        // read-ahead lacks. (With less room the matmul faults each layer in through the kernel's readahead as it
        // runs, which beats waiting for the whole of it: Mixtral's shape at a third, 17.1-18.0 tok/s against
        // 15.7-16.4 where the slots lent it the room to ask for its 800 MB layers)
        const int64_t room  = read_room();
        const int64_t layer = layer_file_bytes(mc, mc.layers[il_prompt]);
        if (room >= layer && room < 2 * layer) {
            moecache_slots_lend(mc, (1 + MOECACHE_READ_AHEAD) * layer + MOECACHE_READ_AHEAD_RESERVE - room);
        }
    }
}

void moecache_mapping_sync(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids, bool decode) {
    uint64_t end = 0;
    for (const moecache_expert_tensor & x : L.res.xt) {
        end = std::max<uint64_t>(end, x.file_off + (uint64_t) x.nb2 * mc.n_expert);
    }
    if (!file_covers(mc, end)) {
        return;
    }
    const int32_t asked = n_asked(mc, L.il);
    mc.ahead.faulted = -1;
    if (!decode && n_ids >= mc.n_expert && asked < mc.n_expert) {
        // not read ahead, or in part (the first layer, or little room): the rest now, where it fits; where it
        // does not, STREAM leaves the rest to the kernel's readahead as the matmul faults it in, in order (what
        // stock llama.cpp's mapping does at any memory size); MMAP's expert regions are MADV_RANDOM: asked for
        // (only the experts the ubatch selected: the matmul reads no other)
        int32_t n_rest = 0;
        for (int32_t e = asked; e < mc.n_expert; e++) {
            n_rest += mc.ahead.selected[e];
        }
        const int64_t room = read_room() - moecache_slots_lent_bytes(mc, L.il, L.il); // (its slots fill again next)
        if (room < 0 || room >= (int64_t) L.res.expert_bytes * n_rest) {
            ask_layer(mc, L.il, mc.n_expert, mc.ahead.selected.data());
            moecache_io_wait(*mc.res.io, mc.ahead.req[L.il]);
        } else if (mc.cparams.residency == MOECACHE_RESIDENCY_STREAM) {
            mc.ahead.faulted = L.il;
        }
    }
    if (mc.cparams.residency == MOECACHE_RESIDENCY_STREAM) {
        moecache_slots_prompt(mc, L, ids, n_ids);
    } else {
        mmap_sync(mc, L, ids, n_ids, decode);
    }
    if (!decode && n_ids >= mc.n_expert) { // (n_ids = tokens x K)
        read_ahead(mc, L);
    }
}

// one madvise over each of L's expert tensors, whole
static void advise_experts(const moecache & mc, const moecache_layer & L, int advice) {
    for (const moecache_expert_tensor & x : L.res.xt) {
        char * a;
        size_t len;
        moecache_expert_tensor all = x;
        all.nb2 = x.nb2 * (size_t) mc.n_expert; // the whole tensor as one "expert"
        if (inner_pages(all, 0, &a, &len)) {
            madvise(a, len, advice);
        }
    }
}

// MMAP decodes fault the experts in: no readahead beyond them. (STREAM decodes read with pread;
// its prompts fault through the mapping and are better off with the kernel's readahead where the
// memory is too short to ask for a whole layer.)
void moecache_mapping_advise_random(moecache & mc, const moecache_layer & L) {
    advise_experts(mc, L, MADV_RANDOM);
}

// STREAM prompts fault the experts in through the mapping. Where the memory free holds less than the file's
// experts (a cap, a small device), the pages a prompt reads are reclaimed again as it goes, and 2 MiB folios cost
// the kernel a fraction of what 4 KiB pages do: the expert regions get MADV_HUGEPAGE (a fault's readahead then
// reads 2 MiB folios). Qwen3-30B-A3B's shape under a cap of a third: a 128-token prompt in 8.1 s against 11.1-12.0.
// Where the experts fit, small folios measured faster (the 2.2 GB benchmark uncapped, 512 tokens: 150-157 tok/s
// against 126-137), so those regions are left as they are. Called once the slot arena and the dense part are
// locked: the memory free is what the prompt's pages will have
void moecache_mapping_advise_stream(moecache & mc) {
#if defined(MADV_HUGEPAGE)
    int64_t experts = 0;
    for (const moecache_layer & L : mc.layers) {
        experts += L.res.xt.empty() ? 0 : layer_file_bytes(mc, L);
    }
    const int64_t room = read_room();
    if (room < 0 || room >= experts) {
        return;
    }
    for (const moecache_layer & L : mc.layers) {
        advise_experts(mc, L, MADV_HUGEPAGE);
    }
#else
    (void) mc;
#endif
}

void moecache_mapping_unlock_all(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        for (int32_t e = 0; e < (int32_t) L.res.locked.size(); e++) {
            if (L.res.locked[e]) {
                drop_expert(mc, L, e, true);
            }
        }
    }
}
