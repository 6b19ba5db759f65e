// moecache-slots.cpp - STREAM residency's slot arena: each MoE layer owns max(M, K) slots per
// expert tensor, [ne0, ne1, n_slots], in one mlocked anonymous mapping, and the layer's matmuls
// run on the slots. A decode fills the slots of the experts that are cached or selected and
// held by none (reads from the file, on the reader threads, waiting only for the selected ones);
// a prefetch fills the slots of experts a later layer is predicted to select, in the background;
// a prompt copies the experts that stay cached out of the model's mapping. The logical cache
// (moecache-route.cpp) decides which experts are cached; this file makes the slots follow it.

#include "moecache-impl.h"
#include "moecache-io.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

// A batch's step slots (cache params n_seq > 1) hold the selections the cache does not keep after the step, so
// a layer needs them only while its step reads and computes them, one layer after another. Where the device
// reads a layer's slots from the host alone (no VRAM tier, low-bit pool or device computing them in place),
// every such layer maps the same pages there (share_steps): n_seq costs one layer's (n_seq - 1) x K slots, not
// every layer's (qwen3-30b-a3b's shape, 4 sequences: 65 MiB, not 3.1 GiB). A layer's step slots keep its experts
// until another layer takes them (take_step_slot); slots of its own keep them until they are taken for others.
static bool steps_shareable(const moecache & mc, const moecache_layer & L) {
    return mc.cparams.n_seq > 1 && mc.cparams.share_steps && L.vram.n == 0 && L.low.n == 0 && !L.uni.dev;
}

// maps the whole pages of every shareable layer's step slots onto one memfd; where the system has none, each
// layer keeps its own (n_own = n_slots). Before the arena is locked.
static int32_t share_step_slots(moecache & mc) {
    struct piece { size_t off, len, at; }; // [off, off + len) of the arena shows [at, at + len) of the memfd
    std::vector<piece> pieces;
    const size_t page = moecache_page_size();
    size_t p = 0, most = 0;
    for (const moecache_layer & L : mc.layers) {
        size_t at = 0;
        for (const moecache_expert_tensor & x : L.res.xt) {
            const size_t data = p + x.slot_head;
            const size_t b    = moecache_round_up(data + (size_t) L.res.n_own * x.slot_nb2, page);
            const size_t e    = (data + (size_t) L.res.n_slots * x.slot_nb2) / page * page; // (the pages shared
            if (L.res.n_own < L.res.n_slots && e > b) {                                     //   with own slots: not)
                pieces.push_back({ b, e - b, at });
                at += e - b;
            }
            p += moecache_round_up(L.res.slot_expert.size() * x.slot_nb2, page);
        }
        most = std::max(most, at);
    }
    if (pieces.empty()) {
        return MOECACHE_OK;
    }
    int fd = -1;
#if defined(__linux__) && defined(SYS_memfd_create)
    fd = (int) syscall(SYS_memfd_create, "moecache-step-slots", 1u /* MFD_CLOEXEC */);
#endif
    if (fd < 0 || ftruncate(fd, (off_t) most) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        for (moecache_layer & L : mc.layers) {
            L.res.n_own = L.res.n_slots;
        }
        size_t all = 0;
        for (const piece & pc : pieces) {
            all += pc.len;
        }
        fprintf(stderr, "moecache: every layer keeps its own slots for a batch's selections (%.0f MiB more): no "
                "memfd here to share them\n", (double) (all - most) / (1 << 20));
        return MOECACHE_OK;
    }
    for (const piece & pc : pieces) {
        if (mmap(mc.res.arena + pc.off, pc.len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t) pc.at) ==
            MAP_FAILED) {
            const int err = errno;
            close(fd);
            return moecache_fail_residency(std::string("cannot map the step slots: ") + strerror(err));
        }
        mc.res.arena_shared += pc.len;
    }
    close(fd); // (the mappings keep its pages)
    mc.res.arena_shared -= most;
    return MOECACHE_OK;
}

// the slots of every MoE layer in one anonymous mapping, each tensor's region page-aligned
int32_t moecache_slots_init(moecache & mc) {
    const moecache_cache_params & cp = mc.cparams;
    size_t total = 0;
    int32_t n_xt = 0;
    for (moecache_layer & L : mc.layers) {
        if (L.res.xt.empty()) {
            continue;
        }
        L.res.n_slots = std::max(L.capacity, mc.n_expert_used) +
                        (cp.prefetch != MOECACHE_PREFETCH_OFF ? cp.prefetch_spare : 0) + // spare: speculative reads
                        (cp.n_seq - 1) * mc.n_expert_used; // a batch's selections: the cache's, and K for each
                                                           //   other sequence (its insertions may evict them)
        L.res.n_own = L.res.n_slots - (steps_shareable(mc, L) ? (cp.n_seq - 1) * mc.n_expert_used : 0);
        const int32_t n_alloc = L.res.n_slots + (L.vram.n > 0 || L.low.n > 0 ? 1 : 0); // (and a zero slot)
        for (moecache_expert_tensor & x : L.res.xt) {
            // a device computing the layer in place (moecache-unified.cpp) steps from expert to expert
            // and finds the first in whole blocks of the type: the padded layout only where those are whole
            const size_t block  = ggml_type_size(x.src_type);
            const bool   blocks = !L.uni.dev || (MOECACHE_IO_ALIGN % block == 0 && x.src_off % MOECACHE_IO_ALIGN % block == 0);
            const bool in_place = mc.res.io->fd_direct >= 0 && x.src_nb2 % MOECACHE_IO_ALIGN == 0 &&
                                  x.src_nb2 >= MOECACHE_IN_PLACE_MIN && blocks;
            x.slot_head = in_place ? (size_t) (x.src_off % MOECACHE_IO_ALIGN) : 0;
            x.slot_nb2  = x.src_nb2 + (x.slot_head > 0 ? MOECACHE_IO_ALIGN : 0);
            total += moecache_round_up((size_t) n_alloc * x.slot_nb2, moecache_page_size());
            n_xt++;
        }
        L.res.slot_expert.assign(n_alloc, -1);
        L.res.expert_slot.assign(mc.n_expert, -1);
        L.res.slot_req.reset(new moecache_io_req[n_alloc]);
    }
    void * arena = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (arena == MAP_FAILED) {
        char buf[128];
        snprintf(buf, sizeof(buf), "cannot reserve %.1f MiB for the expert slots: ", (double) total / (1 << 20));
        return moecache_fail_residency(buf + std::string(strerror(errno)));
    }
    mc.res.arena      = (char *) arena;
    mc.res.arena_size = total;
    const int32_t rc = share_step_slots(mc);
    if (rc != MOECACHE_OK) {
        return rc;
    }
#if defined(MADV_HUGEPAGE)
    madvise(arena, total, MADV_HUGEPAGE); // 2 MiB pages where the kernel has them: fewer TLB misses in the matmuls
#endif
    if (cp.lock_memory) {
        if (mlock(mc.res.arena, total) == 0) {
            mc.res.arena_locked = true;
        } else {
            moecache_warn_mlock_once(total, errno);
        }
    }
    struct ggml_init_params ip = { (size_t) (n_xt + 1) * ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
    mc.res.slots_ctx = ggml_init(ip);
    mc.res.slots_buf = ggml_backend_cpu_buffer_from_ptr(mc.res.arena, total);
    ggml_backend_buffer_set_usage(mc.res.slots_buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    char * p = mc.res.arena;
    for (moecache_layer & L : mc.layers) {
        const int32_t n_alloc = (int32_t) L.res.slot_expert.size();
        for (moecache_expert_tensor & x : L.res.xt) {
            const ggml_tensor * t = x.model_t;
            x.slots_t = ggml_new_tensor_3d(mc.res.slots_ctx, x.src_type, t->ne[0], t->ne[1], n_alloc);
            ggml_format_name(x.slots_t, "moecache.%s.slots", t->name);
            const bool same_rows = x.slots_t->nb[2] == x.src_nb2;
            x.slots_t->nb[2] = x.slot_nb2; // (mul_mat_id and the arrival op step from expert to expert by nb[2])
            x.slots_t->nb[3] = x.slot_nb2 * (size_t) n_alloc;
            if (!same_rows || ggml_backend_tensor_alloc(mc.res.slots_buf, x.slots_t, p + x.slot_head) != GGML_STATUS_SUCCESS) {
                return moecache_fail_residency(std::string("cannot place the slots of ") + t->name);
            }
            p += moecache_round_up((size_t) n_alloc * x.slot_nb2, moecache_page_size()); // (anonymous: zero slot is 0)
        }
    }
    return MOECACHE_OK;
}

static bool slot_holds(const moecache_layer & L, int32_t e) {
    const int32_t s = L.res.expert_slot[e];
    return s >= 0 && L.res.slot_expert[s] == e;
}

// gives e the first slot in [cursor, end) that holds no expert of L.res.keep; -1 if there is none,
// which cannot happen: |L.res.keep| <= n_slots (cached, plus a step's selections the cache does not keep).
// Reads still filling the slot for its previous expert are cancelled (or waited for, if running).
static int32_t take_slot(moecache & mc, moecache_layer & L, int32_t e, int32_t & cursor, int32_t end) {
    for (; cursor < end; cursor++) {
        const int32_t held = L.res.slot_expert[cursor];
        if (held < 0 || !L.res.keep[held] || L.res.expert_slot[held] != cursor) {
            moecache_io_req & req = L.res.slot_req[cursor];
            if (!moecache_io_idle(*mc.res.io, req)) {
                moecache_io_cancel(*mc.res.io, req);
            }
            req.err      = 0;
            req.prefetch = false;
            L.res.slot_expert[cursor] = e;
            L.res.expert_slot[e]      = cursor;
            return cursor++;
        }
    }
    return -1;
}

// L.res.keep = the experts L caches now in host slots (not those an exclusive VRAM tier holds)
static void keep_cached(moecache_layer & L) {
    const bool excl = L.vram.exclusive;
    for (size_t e = 0; e < L.res.keep.size(); e++) {
        L.res.keep[e] = L.last_use[e] >= 0 && !(excl && L.vram.excl[e]);
    }
}

// the step slots' pages pass to another layer: what layer O holds there is gone, but for its cached experts
// (a step's own selections filled its own slots, so some the cache keeps went there), which move to slots of
// its own: after its step those hold no selection of it (|cached| <= capacity)
static void release_step_slots(moecache & mc, moecache_layer & O) {
    keep_cached(O);
    int32_t cursor = 0;
    for (int32_t s = O.res.n_own; s < O.res.n_slots; s++) {
        moecache_io_req & req = O.res.slot_req[s];
        const int32_t     e   = O.res.slot_expert[s];
        bool move = e >= 0 && O.res.expert_slot[e] == s && O.res.keep[e];
        if (!moecache_io_idle(*mc.res.io, req)) {
            if (move) {
                move = moecache_io_wait(*mc.res.io, req) == 0;
            } else {
                moecache_io_cancel(*mc.res.io, req);
            }
        }
        O.res.slot_expert[s] = -1;
        const int32_t t = move ? take_slot(mc, O, e, cursor, O.res.n_own) : -1;
        for (size_t j = 0; t >= 0 && j < O.res.xt.size(); j++) { // (the expert's bytes, not its window's)
            const moecache_expert_tensor & x = O.res.xt[j];
            char * data = (char *) x.slots_t->data;
            memcpy(data + (size_t) t * x.slot_nb2, data + (size_t) s * x.slot_nb2, x.src_nb2);
        }
    }
}

// a step's selection the cache does not keep (last_use < 0): a step slot, whose pages the layer takes over
// from the one that used them last (release_step_slots); a slot of its own where none is free (its own
// slots hold some of the step's selections: evicted by the step, read before)
static int32_t take_step_slot(moecache & mc, moecache_layer & L, int32_t e, int32_t & step_cursor,
                              int32_t & cursor) {
    if (L.res.n_own < L.res.n_slots && mc.res.step_owner != L.il) {
        if (mc.res.step_owner >= 0) { // (its matmuls ran: the graph computes one layer after another)
            release_step_slots(mc, mc.layers[mc.res.step_owner]);
        }
        mc.res.step_owner = L.il;
    }
    const int32_t s = take_slot(mc, L, e, step_cursor, L.res.n_slots);
    return s >= 0 ? s : take_slot(mc, L, e, cursor, L.res.n_own);
}

// the jobs that fill slot s with expert e: reads from the file, each tensor's bytes (with a
// slot_head, the page-aligned window around them, read in place) in as few equal pieces of at
// most MOECACHE_IO_CHUNK as there can be, so a large tensor keeps several reads in flight and a
// small one is one read; or one copy per tensor from the mapping (the slots hold the model's type)
static void slot_fill_jobs(const moecache_layer & L, int32_t e, int32_t s, moecache_io_kind kind,
                           std::vector<moecache_io_job> & jobs) {
    for (const moecache_expert_tensor & x : L.res.xt) {
        const bool     window = kind == MOECACHE_IO_READ && x.slot_head > 0;
        const uint64_t off = x.src_off + (uint64_t) e * x.src_nb2 - (window ? x.slot_head : 0);
        const uint64_t len = window ? x.slot_nb2 : x.src_nb2;
        char *         dst = (char *) x.slots_t->data + (size_t) s * x.slot_nb2 - (window ? x.slot_head : 0);
        const uint64_t n_piece = kind == MOECACHE_IO_READ ? (len + MOECACHE_IO_CHUNK - 1) / MOECACHE_IO_CHUNK : 1;
        const uint64_t piece   = moecache_round_up((size_t) ((len + n_piece - 1) / std::max<uint64_t>(n_piece, 1)),
                                                   MOECACHE_IO_ALIGN);
        for (uint64_t o = off; o < off + len;) {
            const uint64_t end = std::min<uint64_t>(off + len, o + piece);
            moecache_io_job j = {};
            j.kind = kind;
            j.dst  = dst + (o - off);
            j.src  = kind == MOECACHE_IO_COPY ? (const char *) x.model_t->data + (size_t) e * x.nb2 + (o - off) : nullptr;
            j.off  = o;
            j.len  = (size_t) (end - o);
            if (window) { // the padding after the expert may lie past the end of the file
                const uint64_t expert_end = off + x.slot_head + x.src_nb2;
                j.tail = (size_t) (end - std::max(o, std::min(end, expert_end)));
            }
            j.il   = L.il;
            j.e    = e;
            jobs.push_back(j);
            o = end;
        }
    }
}

// what a failed read of expert e of layer il at [off, off + len) says (err: an errno, or -1 for a short read)
static std::string read_error(const moecache & mc, int32_t il, int32_t e, uint64_t off, size_t len, int err) {
    char buf[512];
    snprintf(buf, sizeof(buf), "reading expert %d of layer %d from '%s' failed at offset %llu (%zu bytes): %s",
             e, il, mc.res.src_path.c_str(), (unsigned long long) off, len,
             err > 0 ? strerror(err) : "the file ends early (truncated?)");
    return buf;
}

static void slot_read_failed(moecache & mc, const moecache_layer & L, int32_t e, const moecache_io_req & req) {
    moecache_set_io_error(mc, read_error(mc, L.il, e, req.err_off, req.err_len, req.err));
}

// a decoded token's read of expert e into slot s (-1: none was free, an internal error)
static void decode_read(moecache & mc, moecache_layer & L, int32_t e, int32_t s, bool low) {
    if (s < 0) {
        moecache_set_io_error(mc, "internal error: no free expert slot in layer " + std::to_string(L.il));
        return;
    }
    std::vector<moecache_io_job> & jobs = mc.res.io->scratch;
    jobs.clear();
    slot_fill_jobs(L, e, s, MOECACHE_IO_READ, jobs);
    // (a miss computed from the low-bit copy: its full read goes behind everything, at prefetch priority 0)
    moecache_io_submit(*mc.res.io, L.res.slot_req[s], jobs.data(), jobs.size(), low && L.low.fresh[e] ? 0.0f : -1.0f);
    if (low && L.low.fresh[e] == 1) {
        L.low.hold[e] = L.low.tok + MOECACHE_LOWBIT_HOLD;
    }
    mc.rst.decode_loads += 1;
    if (L.vram.n > 0) {
        L.vram.fresh[e] = 1;
    }
}

// STREAM, one token: every expert that is cached or selected gets a slot, whose reads start now
// (ahead of every prefetch); the selected experts' reads ahead move to the on-demand queue.
// out = slot ids. wait: returns once the selected experts' bytes are in (moecache_slots_wait);
// otherwise the expert matmuls wait for each expert themselves (moecache-matmul.cpp)
void moecache_slots_decode(moecache & mc, moecache_layer & L, const int32_t * ids, int32_t * out, int64_t n_ids,
                           bool wait, bool decode) {
    const bool low = decode && L.low.n > 0; // (the low-bit pool serves decoded tokens only)
    keep_cached(L);
    const bool excl = decode && L.vram.exclusive; // (a selection in an exclusive device slot takes no host slot)
    for (int64_t i = 0; i < n_ids; i++) {
        L.res.keep[ids[i]] = !(excl && L.vram.excl[ids[i]]);
    }
    if (L.vram.n > 0) { // (the VRAM tier counts where each selection came from)
        std::fill(L.vram.fresh.begin(), L.vram.fresh.end(), 0);
    }
    if (low && mc.cparams.lowbit == MOECACHE_LOWBIT_ALL) { // every selection from the companion
        for (int64_t i = 0; i < n_ids; i++) {
            out[i] = L.res.n_slots;
        }
        moecache_lowbit_decode(mc, L, ids, out, n_ids);
        return;
    }
    if (low) { // which selections the companion computes: a function of the cache and the token count only,
        L.low.tok += 1; // so that a run's numbers do not depend on when the disk answered
        std::fill(L.low.fresh.begin(), L.low.fresh.end(), 0);
        for (int64_t i = 0; i < n_ids; i++) {
            const int32_t e = ids[i];
            const float   p = i < MOECACHE_MAX_USED ? L.low.tok_p[i] : 0.0f;
            if (!slot_holds(L, e)) { // a miss that weighs less than lowbit_max_p: its full read starts now, behind
                L.low.fresh[e] = p < mc.cparams.lowbit_max_p ? 1 : 0;
            } else if (L.low.hold[e] >= L.low.tok) { // the token after such a miss: its full read is not waited for
                L.low.fresh[e] = 2;
            }
        }
    }
    int32_t cursor = 0, step_cursor = L.res.n_own;
    // the cached experts first, in the layer's own slots (where those hold the step's other selections, in a
    // step slot: moved home once another layer takes the pages)
    for (int32_t e = 0; e < (int32_t) L.res.keep.size(); e++) {
        if (L.res.keep[e] && L.last_use[e] >= 0 && !slot_holds(L, e)) {
            const int32_t s = take_slot(mc, L, e, cursor, L.res.n_own);
            decode_read(mc, L, e, s >= 0 ? s : take_step_slot(mc, L, e, step_cursor, cursor), low);
        }
    }
    for (int64_t i = 0; i < n_ids; i++) { // then the selections the cache does not keep, in step slots
        const int32_t e = ids[i];
        if (L.res.keep[e] && L.last_use[e] < 0 && !slot_holds(L, e)) {
            decode_read(mc, L, e, take_step_slot(mc, L, e, step_cursor, cursor), low);
        }
    }
    for (int64_t i = 0; i < n_ids; i++) {
        const int32_t s = L.res.expert_slot[ids[i]];
        out[i] = s >= 0 && s < L.res.n_slots && L.res.slot_expert[s] == ids[i] ? s : 0; // (0: only after the error above)
        if (excl && L.vram.excl[ids[i]]) {
            out[i] = L.res.n_slots; // the zero slot: the device computes it (moecache_vram_decode)
        }
    }
    if (low) { // the misses from the companion: their full side on the zero slot, not waited for
        moecache_lowbit_decode(mc, L, ids, out, n_ids);
    }
    for (int64_t i = 0; i < n_ids; i++) {
        moecache_io_promote(*mc.res.io, L.res.slot_req[out[i]]); // (a read ahead of a selected expert is needed now)
    }
    if (mc.ahead.pending.target >= 0) { // the reads ahead this layer's routing decided, behind its own
        const int32_t target = mc.ahead.pending.target;
        mc.ahead.pending.target = -1;
        moecache_slots_prefetch(mc, mc.layers[target], mc.ahead.pending.ids, mc.ahead.pending.score,
                                mc.ahead.pending.n, true);
    }
    if (wait) {
        moecache_slots_wait(mc, L, out, n_ids);
    }
}

int64_t moecache_slots_wait(moecache & mc, moecache_layer & L, const int32_t * slots, int64_t n) {
    int64_t waited = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t s = slots[i];
        moecache_io_req & req = L.res.slot_req[s];
        const int64_t t0 = moecache_time_us();
        const bool    idle = moecache_io_idle(*mc.res.io, req);
        if (moecache_io_wait(*mc.res.io, req) != 0 && L.res.slot_expert[s] >= 0) {
            slot_read_failed(mc, L, L.res.slot_expert[s], req);
            L.res.slot_expert[s] = -1; // a bad read is never used as weights; read again next time
        }
        waited += idle ? 0 : moecache_time_us() - t0;
    }
    return waited;
}

int32_t moecache_slots_holding(const moecache_layer & L, int32_t e) {
    return slot_holds(L, e) ? L.res.expert_slot[e] : -1;
}

void moecache_slots_empty(moecache & mc, moecache_layer & L, int32_t s) {
    moecache_io_req & req = L.res.slot_req[s];
    if (!moecache_io_idle(*mc.res.io, req)) {
        moecache_io_cancel(*mc.res.io, req); // (waits for a chunk being read into it)
    }
    req.err      = 0;
    req.prefetch = false;
    const int32_t e = L.res.slot_expert[s];
    if (e >= 0 && L.res.expert_slot[e] == s) {
        L.res.expert_slot[e] = -1;
    }
    L.res.slot_expert[s] = -1;
}

void moecache_slots_prefetch(moecache & mc, moecache_layer & T, const int32_t * ids, const float * score, int32_t n,
                             bool spare) {
    if (T.res.xt.empty() || T.res.n_slots == 0) {
        return;
    }
    keep_cached(T); // never taken (insertion: the experts just inserted are among them; spare: the cached
                    //   ones hold at most max(M, K) slots, the spare ones stay free of them)
    std::vector<moecache_io_job> & jobs = mc.res.io->scratch;
    int32_t cursor = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t e = ids[i];
        if (slot_holds(T, e)) {
            continue; // its bytes are here already (read before, evicted since, its slot not reused)
        }
        const int32_t s = take_slot(mc, T, e, cursor, T.res.n_own);
        if (s < 0) {
            return;
        }
        if (spare) { // (an insertion was counted by moecache_layer_prefetch)
            T.pf.fetched[e] = 1;
            mc.rst.prefetch_issued += 1;
        }
        moecache_io_req & req = T.res.slot_req[s];
        req.prefetch = true;
        jobs.clear();
        slot_fill_jobs(T, e, s, MOECACHE_IO_READ, jobs);
        moecache_io_submit(*mc.res.io, req, jobs.data(), jobs.size(), std::max(0.0f, score[i]));
    }
}

int32_t moecache_slots_fill_all(moecache & mc) {
    const int64_t t0 = moecache_time_us();
    std::vector<moecache_io_job> jobs;
    for (moecache_layer & L : mc.layers) {
        if (L.res.xt.empty() || L.capacity < mc.n_expert) {
            continue; // (a smaller cache is filled by the tokens that need its experts)
        }
        L.res.all_in_slots = true;
        int32_t cursor = 0;
        for (int32_t e = 0; e < mc.n_expert; e++) {
            const int32_t s = take_slot(mc, L, e, cursor, L.res.n_own);
            if (s >= 0) {
                slot_fill_jobs(L, e, s, MOECACHE_IO_READ, jobs);
            }
        }
    }
    if (jobs.empty()) {
        return MOECACHE_OK;
    }
    moecache_io_run(*mc.res.io, jobs);
    for (const moecache_io_job & j : jobs) {
        if (j.err != 0) {
            return moecache_fail_residency(read_error(mc, j.il, j.e, j.off, j.len, j.err));
        }
        mc.load_bytes += (int64_t) j.bytes_io;
    }
    {
        std::lock_guard<std::mutex> lock(mc.res.io->mu); // a load, not a decode: the decode counters start at 0
        mc.res.io->bytes_demand = 0;
        mc.res.io->read_busy_us = 0;
    }
    mc.t_io_load_us = moecache_time_us() - t0;
    return MOECACHE_OK;
}

void moecache_slots_fill_behind(moecache & mc) {
    if (mc.res.fill_behind.empty()) {
        return; // (every ubatch: nothing to do but after a capped prompt)
    }
    std::vector<moecache_io_job> & jobs = mc.res.io->scratch;
    for (const std::array<int32_t, 3> & lse : mc.res.fill_behind) {
        moecache_layer & L = mc.layers[lse[0]];
        const int32_t    s = lse[1], e = lse[2];
        if (L.res.slot_expert[s] != e || L.res.expert_slot[e] != s) {
            continue; // (taken again since, or cleared)
        }
        jobs.clear();
        slot_fill_jobs(L, e, s, MOECACHE_IO_READ, jobs);
        moecache_io_submit(*mc.res.io, L.res.slot_req[s], jobs.data(), jobs.size(), 0.0f);
    }
    mc.res.fill_behind.clear();
}

// STREAM, prompt: the matmuls read the mapping; the cached experts no slot holds are copied from it
// (lowbit SOURCE: read from the companion). The copies are queued as a decode's reads are, on demand: the
// reader threads make them while the matmul runs (it faults in the same pages; a synchronous copy kept it
// waiting for them, a third of gpt-oss-20b's prompt under a cap of a third), and whatever reads a slot waits
// for its request, as for a read; the pages are dropped behind once their copies ran (drop_pending).
// Where the memory left no room to ask for the layer (a cap: the matmul faults it in through the kernel's
// readahead, mc.ahead.faulted), a copy before the matmul would read pages the matmul's own faults then evict
// and read again (Mixtral's shape at a third: 9.3 GB read for a 7.2 GB file, a fifth of the prompt's time
// waiting for the copies): those slots are read from the file instead, with direct I/O past the page cache,
// once the prompt's ubatch ran (moecache_slots_fill_behind, at prefetch priority: a decode's own reads go
// first, and it waits for its experts' slots; a slot taken again before its read is queued is not read)
void moecache_slots_prompt(moecache & mc, moecache_layer & L, const int32_t * ids, int64_t n_ids) {
    const bool copy   = mc.cparams.lowbit != MOECACHE_LOWBIT_SOURCE;
    const bool behind = copy && mc.ahead.faulted == L.il && !L.res.all_in_slots;
    std::vector<uint8_t> touched(L.res.keep.size(), 0); // read through the mapping by this ubatch: dropped later
    for (int64_t i = 0; i < n_ids; i++) {
        touched[ids[i]] = 1;
    }
    keep_cached(L);
    const bool lent = L.res.lent;
    L.res.lent = false; // (its copies below take the pages again)
    std::vector<std::array<int32_t, 2>> fills; // (slot, expert) to fill now
    int32_t cursor = 0;
    for (int32_t e = 0; e < (int32_t) L.res.keep.size(); e++) {
        if (L.res.keep[e] && !slot_holds(L, e)) {
            const int32_t s = take_slot(mc, L, e, cursor, L.res.n_own);
            if (s >= 0 && behind) {
                mc.res.fill_behind.push_back({ L.il, s, e });
                mc.rst.prompt_bytes_read += (int64_t) L.res.expert_bytes;
            } else if (s >= 0) {
                fills.push_back({ s, e });
                touched[e] |= copy; // (also a cached expert this ubatch does not run, e.g. after a state load)
            }
        }
    }
    for (int32_t e = 0; e < (int32_t) touched.size(); e++) {
        if (touched[e]) {
            moecache_willneed_expert(L, e); // one large read request before the matmul or the copy faults it in
            mc.rst.prompt_bytes_read += (int64_t) L.res.expert_bytes;
            mc.res.drop_pending.emplace_back(L.il, e);
        }
    }
    mc.res.refill_bytes = lent ? (int64_t) fills.size() * (int64_t) L.res.expert_bytes : 0;
    std::vector<moecache_io_job> & jobs = mc.res.io->scratch;
    jobs.clear();
    for (const std::array<int32_t, 2> & f : fills) {
        if (copy) {
            jobs.clear();
            slot_fill_jobs(L, f[1], f[0], MOECACHE_IO_COPY, jobs);
            moecache_io_submit(*mc.res.io, L.res.slot_req[f[0]], jobs.data(), jobs.size(), -1.0f);
        } else {
            slot_fill_jobs(L, f[1], f[0], MOECACHE_IO_READ, jobs);
        }
    }
    if (copy) {
        return;
    }
    moecache_io_run(*mc.res.io, jobs);
    for (const moecache_io_job & j : jobs) {
        if (j.err != 0) {
            moecache_set_io_error(mc, read_error(mc, j.il, j.e, j.off, j.len, j.err));
            L.res.slot_expert[L.res.expert_slot[j.e]] = -1;
        }
        mc.rst.prompt_bytes_read += (int64_t) j.bytes_io;
    }
}
