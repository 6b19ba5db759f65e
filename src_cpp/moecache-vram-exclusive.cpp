// moecache-vram-exclusive.cpp - exclusive VRAM tiers (cache params vram_exclusive, moecache-vram.cpp): an
// expert is held by the device slots or the host slots, not both, so the two tiers together hold more
// experts. An expert copied up leaves its host slot; the one its device slot held moves down into it, its
// bytes read back from the device (on the copier, into pinned memory, where there is one).

#include "moecache-impl.h"

#include "ggml-backend.h"

#include <cstring>

// Exclusive tiers with a copier: `need` bytes of pinned host memory of the device (its host buffer type;
// none over RPC) for one layer's moves down of a token, so that the copier reads them back beside the
// copies up rather than one synchronous read per tensor. Where there is none, or a step moves more,
// they are read synchronously (moecache_vram_exclusive_claim)
void moecache_vram_stage_down(moecache & mc, ggml_backend_dev_t dev, size_t need) {
    ggml_backend_buffer_type_t host = dev && need > 0 ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    if (host) {
        mc.res.down_stage = ggml_backend_buft_alloc_buffer(host, need); // (nullptr: refused, read synchronously)
    }
}

// exclusive: e, now in device slot vs, leaves the host tier (its host slot is freed at the end of the
// token's copies); the slot's previous expert, if any, moves down into e's host slot hs: its bytes are
// read back from the device now, before e's copy can overwrite them, and written to hs once e's copy
// has left it (vram_finish)
// With a copier and the pinned staging (down_stage), the read back is queued on the copier ahead of the
// token's copies up (the same stream: done before any of them overwrites the slot), and waited for with
// them; otherwise it is made now, one synchronous read per expert tensor.
void moecache_vram_exclusive_claim(moecache_layer & L, int32_t e, int32_t old, int32_t vs, int32_t hs) {
    moecache_layer_vram & V = L.vram;
    V.excl[e] = 1;
    if (old < 0) {
        V.n_excl += 1;
        return;
    }
    V.excl[old] = 0;
    size_t off = V.down_e.size() * moecache_slot_bytes(L);
    if (!V.down_stage) {
        V.down_bytes.resize(off + moecache_slot_bytes(L));
    }
    for (size_t j = 0; j < L.res.xt.size(); j++) {
        const size_t at = (size_t) vs * V.t[j]->nb[2], len = L.res.xt[j].src_nb2;
        if (V.down_stage) {
            ggml_backend_tensor_get_async(V.copier, V.t[j], V.down_stage + off, at, len);
        } else {
            ggml_backend_tensor_get(V.t[j], V.down_bytes.data() + off, at, len);
        }
        off += len;
    }
    V.down_e.push_back(old);
    V.down_hs.push_back(hs);
}

// exclusive, once the token's copies up have left their host slots: each slot freed, or given the
// expert that moved down into it
void moecache_vram_exclusive_settle(moecache & mc, moecache_layer & L) {
    moecache_layer_vram & V = L.vram;
    for (size_t i = 0; i < V.copy_e.size(); i++) {
        const int32_t e = V.copy_e[i], hs = V.copy_hs[i];
        if (V.copy_t[i] == 0) { // its read failed (the decode is being stopped): held by neither tier
            if (V.excl[e]) {
                V.excl[e] = 0;
                V.n_excl -= 1;
            }
            continue;
        }
        if (L.res.slot_expert[hs] == e) {
            L.res.slot_expert[hs] = -1;
            L.res.expert_slot[e]  = -1;
        }
    }
    const char * down = V.down_stage ? V.down_stage : V.down_bytes.data(); // (the copier was waited for)
    size_t off = 0;
    for (size_t i = 0; i < V.down_e.size(); i++) {
        const int32_t v = V.down_e[i], hs = V.down_hs[i];
        for (const moecache_expert_tensor & x : L.res.xt) {
            memcpy((char *) x.slots_t->data + (size_t) hs * x.slot_nb2, down + off, x.src_nb2);
            off += x.src_nb2;
        }
        if (L.last_use[v] >= 0 && L.res.slot_expert[hs] < 0) {
            L.res.slot_expert[hs] = v;
            L.res.expert_slot[v]  = hs;
            mc.rst.vram_copies_down += 1;
        }
    }
    V.down_e.clear();
    V.down_hs.clear();
    V.down_bytes.clear();
    if (V.down_stage) {
        V.down_stage        = nullptr;
        mc.res.down_stage_layer = -1;
    }
}
