// moecache-lend.cpp - a prompt short of memory borrows the pages of slots: a prompt ubatch computes on the
// mapping, not on the slots, and the cached experts no slot holds are copied into the slots from what the prompt
// reads, as each layer runs (moecache_slots_prompt). So the slots of the layers a ubatch has not reached yet hold
// nothing it needs, and where memory is short their pages are what its read-ahead lacks (moecache-mapping.cpp):
// the last layers lend theirs (they take them back last), as much as it lacks. A decode locks them again. Only
// layers whose slots the CPU alone reads; a batch's shared step slots stay as they are.
//
// gpt-oss-20b's shape under a cap of a third of its file: a 128-token prompt had room for its layer's 420 MB and
// 50 MB more, so it read nothing ahead and waited for each layer's reads before its matmul.

#include "moecache-impl.h"
#include "moecache-io.h"

#include <sys/mman.h>

static bool slots_lendable(const moecache & mc, const moecache_layer & L) {
    return !L.res.xt.empty() && !L.res.all_in_slots && L.vram.n == 0 && L.low.n == 0 && !L.uni.dev &&
           mc.cparams.lowbit != MOECACHE_LOWBIT_SOURCE && mc.res.arena_pinned == 0;
}

// the whole pages of x's own slots in L
static bool own_slot_pages(const moecache_layer & L, const moecache_expert_tensor & x, char ** a, size_t * len) {
    const size_t    page = moecache_page_size();
    const uintptr_t b0   = (uintptr_t) x.slots_t->data - x.slot_head; // (the tensor's region starts on a page)
    const uintptr_t b1   = ((uintptr_t) x.slots_t->data + (size_t) L.res.n_own * x.slot_nb2) / page * page;
    if (b1 <= b0) {
        return false;
    }
    *a   = (char *) b0;
    *len = (size_t) (b1 - b0);
    return true;
}

void moecache_slots_lend(moecache & mc, int64_t bytes) {
    int64_t lent = 0;
    for (int32_t il = (int32_t) mc.layers.size() - 1; il >= 0 && lent < bytes; il--) { // (the last: they take theirs
        moecache_layer & L = mc.layers[il];                                            //   back last)
        if (!slots_lendable(mc, L) || L.res.lent) {
            continue;
        }
        for (int32_t s = 0; s < L.res.n_own; s++) {
            moecache_slots_empty(mc, L, s);
        }
        for (const moecache_expert_tensor & x : L.res.xt) {
            char * a;
            size_t len;
            if (own_slot_pages(L, x, &a, &len)) {
                if (mc.res.arena_locked) {
                    munlock(a, len);
                }
#if defined(MADV_NOHUGEPAGE)
                madvise(a, len, MADV_NOHUGEPAGE); // (filled again in 2 MiB pages near a cap, the copies wait on compaction)
#endif
                madvise(a, len, MADV_DONTNEED);
                lent += (int64_t) len;
            }
        }
        L.res.lent     = true;
        L.res.relock   = true;
    }
}

int64_t moecache_slots_lent_bytes(const moecache & mc, int32_t il0, int32_t il1, bool unlocked) {
    int64_t bytes = 0;
    for (int32_t il = std::max(il0, 0); il <= il1 && il < (int32_t) mc.layers.size(); il++) {
        const moecache_layer & L = mc.layers[il];
        for (size_t i = 0; (unlocked ? L.res.relock : L.res.lent) && i < L.res.xt.size(); i++) {
            char * a;
            size_t len;
            bytes += own_slot_pages(L, L.res.xt[i], &a, &len) ? (int64_t) len : 0;
        }
    }
    return bytes;
}

void moecache_slots_relock(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        if (!L.res.relock) {
            continue;
        }
        for (const moecache_expert_tensor & x : L.res.xt) {
            char * a;
            size_t len;
            if (own_slot_pages(L, x, &a, &len)) {
#if defined(MADV_HUGEPAGE)
                madvise(a, len, MADV_HUGEPAGE);
#endif
                if (mc.res.arena_locked) {
                    mlock(a, len); // (the copies filled most of them: the rest is faulted in here, as at init)
                }
            }
        }
        L.res.relock = false;
    }
}
