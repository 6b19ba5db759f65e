// moecache-vram.cpp - the VRAM tier (cache params n_vram, vram_fill): beside GPU layers, a layer's
// hottest experts also live in device slots, and a decoded token computes them there.
//
// Three tiers per MoE layer: device slots (n_vram), the host slot arena (the cache the routing
// sees, moecache-slots.cpp), the file. The host cache works exactly as without the tier: the
// routing, its hits and misses and the reads from the file do not change. On top of it, each
// selection of a decoded token is computed where its expert is:
//   in a device slot           -> on the device (vram_hits)
//   not (vram_from_ram: in a host slot already; vram_from_file: read for this token), vram_fill
//   decides                    -> copied up from its host slot into a device slot, then on the
//                                 device (vram_copies), or computed on the CPU from its host slot
//                                 (vram_cpu)
// A full tier evicts by the cache's eviction policy (moecache_layer_pick_victim: the same scores
// as the host cache, recency from the tier's own uses), never an expert the current token selected.
//
// The graph of the tier's matmuls: moecache-vram-graph.cpp; exclusive tiers' moves down: moecache-vram-exclusive.cpp.
//
// Copies up (vram_copy ASYNC): the routing op decides them and sends each one whose read is in
// to a second backend of the device (`copier`, its own stream: ggml_backend_tensor_set_async),
// which takes it while the CPU computes its own selections; the ids op, which runs after those
// matmuls (its src[1]), sends the rest as their reads come in and waits for the copier, before
// the device's matmuls. SYNC, or where the device gives no second backend: the routing op makes
// each copy itself (ggml_backend_tensor_set) before anything else runs.
//
// Copies up ahead (ASYNC, with prefetch): when layer L predicts what layer T = L + d will select,
// the predicted experts that T's host cache holds and its device slots do not are given device
// slots (as a miss would be, never evicting a predicted one) and queued as T's copies; L's ids op
// sends them once its own copies are waited for, so they run beside L's device matmuls. T's
// residency op waits for them first (moecache_vram_begin), before its host slots can change: the
// host cache does not evict a predicted expert, so their bytes stay put until then.

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "llama-model.h" // llama_layer: where the layer's router weight lives

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <unistd.h>

ggml_backend_buffer_type_t moecache_layer_buft(const llama_model * model, int32_t il) {
    if (!model || il >= (int32_t) model->layers.size()) {
        return nullptr;
    }
    const ggml_tensor * r = model->layers[il].ffn_gate_inp;
    return r && r->buffer ? ggml_backend_buffer_get_type(r->buffer) : nullptr;
}

// the device memory of layer il's dense part, when that is not host memory (a discrete GPU, an RPC
// server; unified memory needs no tier); nullptr otherwise
static ggml_backend_buffer_type_t layer_device_buft(const llama_model * model, int32_t il) {
    ggml_backend_buffer_type_t buft = moecache_layer_buft(model, il);
    return buft && !ggml_backend_buft_is_host(buft) ? buft : nullptr;
}

void moecache_vram_plan(moecache & mc, const llama_model * model) {
    const int32_t n = mc.cparams.residency == MOECACHE_RESIDENCY_STREAM ? mc.cparams.n_vram : 0;
    for (moecache_layer & L : mc.layers) {
        L.vram.buft = n > 0 && !L.res.xt.empty() && (!L.uni.dev || moecache_vram_direct_wanted(mc, L))
                    ? layer_device_buft(model, L.il) : nullptr;
        L.vram.n    = L.vram.buft ? n : 0;
    }
}

// The host slots that copies up are sent from, registered with the device as pinned memory where its
// backend offers that (CUDA: "ggml_backend_register_host_buffer", cudaHostRegister; ggml's own
// GGML_CUDA_NO_PINNED, or lock_memory off, leaves it off: pinned pages are locked pages). From
// pageable memory the driver stages each copy through a bounce buffer while the sending thread
// waits (a 1.67 MB expert: 0.24 ms on an H200); from pinned memory the copy is the copier stream's
// DMA (0.025 ms). A refusal changes nothing
static void vram_pin_arena(moecache & mc, ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (!mc.res.arena || !reg || !mc.cparams.lock_memory || getenv("GGML_CUDA_NO_PINNED") != nullptr) {
        return;
    }
    typedef bool (*register_fn)(void * buffer, size_t size);
    typedef void (*unregister_fn)(void * buffer);
    auto pin   = (register_fn)   ggml_backend_reg_get_proc_address(reg, "ggml_backend_register_host_buffer");
    auto unpin = (unregister_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_unregister_host_buffer");
    if (!pin || !unpin) {
        return;
    }
    setenv("GGML_CUDA_REGISTER_HOST", "1", 0); // (ggml-cuda registers host memory only where it is set)
    if (pin(mc.res.arena, mc.res.arena_size)) {
        mc.res.arena_unpin  = unpin;
        mc.res.arena_pinned = (int64_t) mc.res.arena_size;
    }
}

int32_t moecache_vram_init(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        if (L.vram.n == 0) {
            continue;
        }
        struct ggml_init_params ip = { (L.res.xt.size() + 1) * ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
        L.vram.ctx = ggml_init(ip);
        for (const moecache_expert_tensor & x : L.res.xt) {
            const ggml_tensor * t = x.model_t;
            ggml_tensor * v = ggml_new_tensor_3d(L.vram.ctx, x.src_type, t->ne[0], t->ne[1], L.vram.n); // (lowbit SOURCE: the companion's type)
            ggml_format_name(v, "moecache.%s.vram", t->name);
            L.vram.t.push_back(v);
        }
        L.vram.buf = ggml_backend_alloc_ctx_tensors_from_buft(L.vram.ctx, L.vram.buft);
        if (!L.vram.buf) {
            return moecache_fail_residency("cannot allocate " + std::to_string(L.vram.n) + " device slots per expert "
                                           "tensor in " + ggml_backend_buft_name(L.vram.buft) + " for layer " +
                                           std::to_string(L.il) + " (n_vram too large for the device memory?)");
        }
        ggml_backend_buffer_set_usage(L.vram.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // (its matmuls run there)
        ggml_backend_buffer_clear(L.vram.buf, 0); // (a slot not filled yet computes zeros for the rows dropped)
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(L.vram.buft);
        if (dev && mc.cparams.vram_copy == MOECACHE_VRAM_COPY_ASYNC) { // one copier per device, for its layers
            for (const moecache_layer & P : mc.layers) {
                if (&P != &L && P.vram.copier && ggml_backend_get_device(P.vram.copier) == dev) {
                    L.vram.copier = P.vram.copier;
                }
            }
            L.vram.copier = L.vram.copier ? L.vram.copier : ggml_backend_dev_init(dev, nullptr);
        }
        ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
        L.vram.unacked = reg && strcmp(ggml_backend_reg_name(reg), "RPC") == 0; // (a send returns once queued)
        L.vram.exclusive = mc.cparams.vram_exclusive && L.capacity < mc.n_expert; // (a host cache of every expert: inclusive)
        if (L.vram.exclusive && L.capacity < 1) {
            return moecache_fail_residency("vram_exclusive needs a host cache of at least one expert (layer " +
                                           std::to_string(L.il) + " has none): its evictions make the room");
        }
        L.vram.excl.assign(mc.n_expert, 0);
        L.vram.keep_out.assign(mc.n_expert, 0);
        L.vram.slot_expert.assign(L.vram.n, -1);
        L.vram.expert_slot.assign(mc.n_expert, -1);
        L.vram.stamp.assign(mc.n_expert, -1);
        L.vram.in_use.assign(mc.n_expert, 0);
        L.vram.fresh.assign(mc.n_expert, 0);
        L.vram.ahead.assign(mc.n_expert, 0);
        L.vram.tok_slot.assign((size_t) std::max(1, mc.cparams.n_seq) * mc.n_expert_used, -1); // (a batch step's)
    }
    // once per cache: the arena pinned for the first tier's device, the staging of moves down sized for
    // the largest exclusive layer with a copier (K experts)
    ggml_backend_dev_t first = nullptr, staged = nullptr;
    size_t need = 0;
    for (const moecache_layer & L : mc.layers) {
        ggml_backend_dev_t dev = L.vram.n > 0 ? ggml_backend_buft_get_device(L.vram.buft) : nullptr;
        first = first ? first : dev;
        if (dev && L.vram.exclusive && L.vram.copier) {
            staged = dev;
            need   = std::max(need, (size_t) mc.n_expert_used * moecache_slot_bytes(L));
        }
    }
    vram_pin_arena(mc, first);
    moecache_vram_stage_down(mc, staged, need);
    return MOECACHE_OK;
}

void moecache_vram_free(moecache & mc) {
    std::vector<ggml_backend_t> copiers;
    for (moecache_layer & L : mc.layers) {
        if (L.vram.copier && std::find(copiers.begin(), copiers.end(), L.vram.copier) == copiers.end()) {
            ggml_backend_synchronize(L.vram.copier); // (copies of a graph that was stopped)
            copiers.push_back(L.vram.copier);
        }
    }
    for (moecache_layer & L : mc.layers) {
        if (L.vram.buf) {
            ggml_backend_buffer_free(L.vram.buf);
        }
        if (L.vram.ctx) {
            ggml_free(L.vram.ctx);
        }
        L.vram = moecache_layer_vram();
    }
    for (ggml_backend_t be : copiers) {
        ggml_backend_free(be);
    }
    if (mc.res.down_stage) {
        ggml_backend_buffer_free(mc.res.down_stage);
        mc.res.down_stage       = nullptr;
        mc.res.down_stage_layer = -1;
    }
    if (mc.res.arena_unpin) { // (before the arena is unmapped)
        mc.res.arena_unpin(mc.res.arena);
        mc.res.arena_unpin  = nullptr;
        mc.res.arena_pinned = 0;
    }
}

int64_t moecache_vram_bytes(const moecache & mc) {
    int64_t bytes = 0;
    for (const moecache_layer & L : mc.layers) {
        bytes += L.vram.buf ? (int64_t) ggml_backend_buffer_get_size(L.vram.buf) : 0;
    }
    return bytes;
}

void moecache_vram_empty(moecache_layer & L) {
    moecache_layer_vram & V = L.vram;
    std::fill(V.slot_expert.begin(), V.slot_expert.end(), -1);
    std::fill(V.expert_slot.begin(), V.expert_slot.end(), -1);
    std::fill(V.stamp.begin(), V.stamp.end(), -1);
    std::fill(V.ahead.begin(), V.ahead.end(), 0);
    std::fill(V.excl.begin(), V.excl.end(), 0);
    V.n_excl = 0;
    V.clock  = 0;
}

void moecache_vram_forget(moecache_layer & L) {
    if (L.vram.exclusive) {
        moecache_vram_empty(L);
    }
}

// the device slot a selected expert may take: a free one, else that of the expert the eviction
// policy picks among those the current token did not select; -1 if none (free_only: no eviction)
static int32_t vram_victim(const moecache_layer & L, bool free_only) {
    for (int32_t s = 0; s < L.vram.n; s++) {
        if (L.vram.slot_expert[s] < 0) {
            return s;
        }
    }
    if (free_only) {
        return -1;
    }
    const int32_t e = moecache_layer_pick_victim(L, L.vram.stamp.data(), nullptr, L.vram.in_use.data());
    return e >= 0 && !L.vram.in_use[e] ? L.vram.expert_slot[e] : -1;
}

// AUTO: copy e up when copying its bytes costs at most computing it on the CPU, times what a copy
// has been worth so far (1 + device hits per copy); each side is measured once before comparing
static bool vram_auto_copies(const moecache & mc, const moecache_layer & L) {
    if (mc.vram_us_per_byte <= 0.0 || mc.vdir.use) { // (direct: the other side reads the bus, not the CPU's)
        return true;
    }
    if (mc.vram_cpu_us <= 0.0) {
        return false;
    }
    const double reuse = mc.rst.vram_copies > 0 ? (double) mc.rst.vram_hits / (double) mc.rst.vram_copies : 1.0;
    return mc.vram_us_per_byte * (double) moecache_slot_bytes(L) <= mc.vram_cpu_us * (1.0 + reuse);
}

// sends the token's copies up from copy_sent on, each once its read is in: to the copier, or made
// now where there is none; wait = false stops at the first whose read is still out. Returns the
// time spent sending (us); t_wait gets the time spent waiting for reads
static int64_t vram_send(moecache & mc, moecache_layer & L, bool wait, int64_t & t_wait) {
    moecache_layer_vram & V = L.vram;
    int64_t t_send = 0;
    for (; V.copy_sent < (int32_t) V.copy_e.size(); V.copy_sent++) {
        const int32_t e = V.copy_e[V.copy_sent], hs = V.copy_hs[V.copy_sent], vs = V.copy_vs[V.copy_sent];
        if (!wait && !moecache_io_idle(*mc.res.io, L.res.slot_req[hs])) {
            break;
        }
        const int64_t t0 = moecache_time_us();
        t_wait += moecache_slots_wait(mc, L, &hs, 1); // (the miss's own read, queued by the host tier)
        if (mc.io_failed.load() || L.res.slot_expert[hs] != e) { // (the decode is being stopped)
            V.slot_expert[vs] = -1;
            V.expert_slot[e]  = -1;
            V.stamp[e]        = -1;
            continue;
        }
        const int64_t t1 = moecache_time_us();
        V.copy_t[V.copy_sent] = t1;
        for (size_t j = 0; j < L.res.xt.size(); j++) {
            const moecache_expert_tensor & x = L.res.xt[j];
            ggml_tensor * v = V.t[j];
            const char * src = (const char *) x.slots_t->data + (size_t) hs * x.slot_nb2;
            if (V.copier) {
                ggml_backend_tensor_set_async(V.copier, v, src, (size_t) vs * v->nb[2], x.src_nb2);
            } else {
                ggml_backend_tensor_set(v, src, (size_t) vs * v->nb[2], x.src_nb2);
            }
        }
        const int64_t t2 = moecache_time_us();
        t_send += t2 - t1;
        mc.t_vram_copy_us += t2 - t1; // (its read's wait is I/O)
        if (!V.copier) { // made: on the timeline now (the copier's: once it is waited for)
            moecache_graph_event(mc, MOECACHE_EVENT_COPY_UP, L.il, e, 1, t0, t1, t2, (int64_t) moecache_slot_bytes(L));
        }
    }
    return t_send;
}

// the end of the token's copies up: the rest sent, the copier waited for. The measured cost (the
// sending, and the copier's time that the CPU's matmuls did not hide) feeds AUTO. t_send: the
// time spent sending them so far. Returns the time spent copying (us), not waiting for reads,
// which t_wait gets
static int64_t vram_finish(moecache & mc, moecache_layer & L, int64_t t_send, int64_t & t_wait) {
    moecache_layer_vram & V = L.vram;
    if (V.copy_e.empty()) {
        return 0;
    }
    const int64_t t_before = t_send;
    t_send += vram_send(mc, L, true, t_wait);
    // where the device's synchronize returns before the bytes are there (RPC: once they are queued on the
    // socket, however slow the link), every 16th end of a layer's copies (over all layers) reads back 4 bytes
    // of its first slot: a round trip, which returns once the server has taken every command sent before it,
    // the copies with them. AUTO's cost is measured on those alone
    const bool acked = V.unacked && mc.vram_acks++ % 16 == 0 && V.copy_t[0] > 0;
    if (V.copier || acked) {
        const int64_t t_sync = moecache_time_us();
        if (V.copier) {
            ggml_backend_synchronize(V.copier);
        }
        if (acked) {
            int32_t back = 0;
            ggml_backend_tensor_get(V.t[0], &back, (size_t) V.copy_vs[0] * V.t[0]->nb[2], sizeof(back));
        }
        const int64_t t1 = moecache_time_us();
        t_send            += t1 - t_sync;
        mc.t_vram_copy_us += t1 - t_sync;
        for (size_t i = 0; i < V.copy_e.size() && V.copier; i++) { // (made without one: on the timeline already)
            if (V.copy_t[i] > 0) { // (0: its read failed)
                moecache_graph_event(mc, MOECACHE_EVENT_COPY_UP, L.il, V.copy_e[i], 1, V.copy_t0, V.copy_t[i], t1,
                                     (int64_t) moecache_slot_bytes(L));
            }
        }
    }
    if (V.exclusive) { // the copies have left their host slots: those change hands now
        moecache_vram_exclusive_settle(mc, L);
    }
    const double bytes    = (double) moecache_slot_bytes(L) * (double) V.copy_e.size();
    const double per_byte = (double) std::max<int64_t>(t_send, 1) / bytes;
    if (!V.unacked || acked) {
        mc.vram_us_per_byte = mc.vram_us_per_byte > 0.0 ? 0.9 * mc.vram_us_per_byte + 0.1 * per_byte : per_byte;
    }
    V.copy_e.clear();
    V.copy_hs.clear();
    V.copy_vs.clear();
    V.copy_t.clear();
    V.copy_sent = 0;
    return t_send - t_before;
}

// len bytes of fd at off into dst; false on an error or a short file
static bool read_whole(int fd, char * dst, size_t len, uint64_t off) {
    size_t got = 0;
    while (got < len) {
        const ssize_t n = pread(fd, dst + got, len - got, (off_t) (off + got));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            errno = n == 0 ? EIO : errno; // (0: the file ends early)
            return false;
        }
        got += (size_t) n;
    }
    return true;
}

// a warm start (moecache_profile_warm): the device slots of each layer get its n hottest experts of
// the usage profile (never-selected ones stay out), copied from the model's mapping (lowbit SOURCE:
// read from the companion); the hottest is the most recent. The mapping's pages are dropped from
// memory again once the layer next runs. False (the error set) when a companion's read fails.
bool moecache_vram_warm(moecache & mc) {
    std::vector<int32_t> hot;
    std::vector<char>    copy;
    for (moecache_layer & L : mc.layers) {
        if (L.vram.n == 0 || mc.prof.counts.empty()) {
            continue;
        }
        int64_t t_wait = 0;
        vram_finish(mc, L, 0, t_wait); // (copies of a graph that was stopped: before the slots change hands)
        const int32_t n_hot = std::min(moecache_profile_hottest(mc, L.il, hot), L.vram.n);
        moecache_vram_empty(L);
        for (int32_t i = n_hot - 1; i >= 0; i--) { // the hottest last: the most recent
            const int32_t e = hot[i];
            const int32_t s = n_hot - 1 - i;
            for (size_t j = 0; j < L.res.xt.size(); j++) {
                const moecache_expert_tensor & x = L.res.xt[j];
                const char * src = (const char *) x.model_t->data + (size_t) e * x.nb2;
                if (mc.cparams.lowbit == MOECACHE_LOWBIT_SOURCE) { // the companion's copy, from its file
                    copy.resize(x.src_nb2);
                    if (!read_whole(mc.res.fd_lowbit, copy.data(), x.src_nb2, x.src_off + (uint64_t) e * x.src_nb2)) {
                        moecache_set_error("cannot read expert " + std::to_string(e) + " of " + x.model_t->name +
                                           " from the low-bit companion '" + mc.res.src_path + "': " + strerror(errno));
                        return false;
                    }
                    src = copy.data();
                }
                ggml_backend_tensor_set(L.vram.t[j], src, (size_t) s * L.vram.t[j]->nb[2], x.src_nb2);
            }
            L.vram.slot_expert[s] = e;
            L.vram.expert_slot[e] = s;
            L.vram.stamp[e]       = ++L.vram.clock;
            if (mc.cparams.lowbit != MOECACHE_LOWBIT_SOURCE) {
                mc.res.drop_pending.emplace_back(L.il, e);
            }
            if (L.vram.exclusive) { // here only, and an entry of the layer's cache (which holds capacity + n_excl)
                L.vram.excl[e] = 1;
                L.vram.n_excl += 1;
                if (L.last_use[e] < 0) {
                    L.last_use[e]    = ++L.clock;
                    L.inserted_at[e] = L.st.tokens;
                    L.occupancy     += 1;
                }
            }
        }
    }
    return true;
}

// a device slot for e, claimed (its bytes: vram_send from host slot hs); the victim's bookkeeping
static void vram_claim(moecache & mc, moecache_layer & L, int32_t e, int32_t hs, int32_t vs) {
    moecache_layer_vram & V = L.vram;
    const int32_t old = V.slot_expert[vs];
    if (V.exclusive) {
        moecache_vram_exclusive_claim(L, e, old, vs, hs);
    }
    if (old >= 0) {
        V.expert_slot[old] = -1;
        V.stamp[old]       = -1;
        V.ahead[old]       = 0;
    }
    V.slot_expert[vs] = e;
    V.expert_slot[e]  = vs;
    V.stamp[e]        = ++V.clock;
    V.copy_e.push_back(e);
    V.copy_hs.push_back(hs);
    V.copy_vs.push_back(vs);
    V.copy_t.push_back(0);
    mc.rst.vram_copy_bytes += (int64_t) moecache_slot_bytes(L);
}

void moecache_vram_ahead(moecache & mc, moecache_layer & T, const int32_t * ids, int32_t n) {
    moecache_layer_vram & V = T.vram;
    if (V.n == 0 || !V.copier || mc.cparams.residency != MOECACHE_RESIDENCY_STREAM || V.exclusive) {
        return; // (exclusive: a copy ahead would hold the expert in both tiers)
    }
    const moecache_vram_fill fill = mc.cparams.vram_fill;
    const bool evict = fill == MOECACHE_VRAM_FILL_COPY || (fill == MOECACHE_VRAM_FILL_AUTO && vram_auto_copies(mc, T));
    std::fill(V.in_use.begin(), V.in_use.end(), 0); // (scratch: the victims are not predicted ones)
    for (int32_t i = 0; i < n; i++) {
        V.in_use[ids[i]] = 1;
    }
    if (V.copy_e.empty()) {
        V.copy_t0 = moecache_time_us();
    }
    for (int32_t i = 0; i < n; i++) {
        const int32_t e  = ids[i];
        const int32_t hs = T.last_use[e] >= 0 ? moecache_slots_holding(T, e) : -1; // cached: stays put
        const int32_t at = V.expert_slot[e];
        if (hs < 0 || (at >= 0 && V.slot_expert[at] == e)) {
            continue;
        }
        const int32_t vs = vram_victim(T, !evict);
        if (vs < 0) {
            return;
        }
        vram_claim(mc, T, e, hs, vs);
        V.ahead[e] = 1;
        mc.rst.vram_ahead += 1;
    }
}

int64_t moecache_vram_begin(moecache & mc, moecache_layer & L) {
    int64_t t_wait = 0;
    return vram_finish(mc, L, 0, t_wait); // (its waits for reads are the residency op's I/O)
}

int64_t moecache_vram_decode(moecache & mc, moecache_layer & L, const int32_t * ids, int32_t * out, int64_t n) {
    moecache_layer_vram & V = L.vram;
    int64_t t_wait = 0;
    int64_t t_copy = 0;
    const int32_t zero = L.res.n_slots;
    std::fill(V.in_use.begin(), V.in_use.end(), 0);
    for (int64_t i = 0; i < n; i++) {
        V.in_use[ids[i]] = 1;
    }
    V.copy_t0 = moecache_time_us();
    if (V.exclusive && V.copier && mc.res.down_stage && mc.res.down_stage_layer < 0 && V.down_e.empty() &&
        (size_t) n * moecache_slot_bytes(L) <= ggml_backend_buffer_get_size(mc.res.down_stage)) {
        V.down_stage        = (char *) ggml_backend_buffer_get_base(mc.res.down_stage); // (until this layer's finish)
        mc.res.down_stage_layer = L.il;
    }
    for (int64_t i = 0; i < n && i < (int64_t) V.tok_slot.size(); i++) { // (a batch step: n = K x T)
        const int32_t e = ids[i];
        int32_t vs = V.expert_slot[e];
        if (vs >= 0 && V.slot_expert[vs] == e) {
            mc.rst.vram_hits       += 1;
            mc.rst.vram_ahead_used += V.ahead[e];
        } else {
            (V.fresh[e] ? mc.rst.vram_from_file : mc.rst.vram_from_ram) += 1;
            const moecache_vram_fill fill = mc.cparams.vram_fill;
            const bool evict = fill == MOECACHE_VRAM_FILL_COPY || (fill == MOECACHE_VRAM_FILL_AUTO && vram_auto_copies(mc, L));
            vs = vram_victim(L, !evict);
            if (vs < 0) {
                V.tok_slot[i] = -1; // on the CPU, from its host slot
                mc.rst.vram_cpu += 1;
                continue;
            }
            vram_claim(mc, L, e, out[i], vs);
            mc.rst.vram_copies += 1;
        }
        V.stamp[e]    = ++V.clock;
        V.tok_slot[i] = vs;
        out[i]        = zero; // (the host side computes 0 for it)
    }
    std::fill(V.ahead.begin(), V.ahead.end(), 0); // (a copy ahead is for the next token only)
    const int64_t t_send = vram_send(mc, L, !V.copier, t_wait); // the copier takes those already read
    t_copy += t_send + (V.copier ? 0 : vram_finish(mc, L, t_send, t_wait));
    return t_copy;
}

// What a decoded step's device side of a layer reads from the CPU goes up as one tensor, the joint J. For a
// step of n = K x T selections (T tokens, one per sequence; T = 1 for a single token), with R = n rounded
// up to 64 (moecache_vram_joint_row: each part 256 bytes aligned, as a device's storage buffer offsets must
// be), F32 [3R + n_out * n]:
//   [0, R)     I32 (as bits): row 0 [K, T] the device slot of each selection (one the device computes for
//              nothing where the CPU computes it: the step's first device slot, else slot 0)
//   [R, 2R)    I32: row 1 [K, T] the row of its token's concat(CPU's side, device's side) [n_out, 2K] that
//              holds its output (i on the CPU, K + i on the device)
//   [2R, 3R)   F32: the routing weights [K, T] as llama.cpp multiplies by them, where moecache_vram_graph_end
//              joined them
//   [3R, ...)  F32: the CPU's down output [n_out, K, T], where the down matmul joined it
// The device makes one copy of J and its ops read views of it: one write per layer, where the ids, the
// weights and the CPU's down output were three.
// dst: J, once the step's copies up are on the device. src[0]: the weights (or none), src[1]: the host
// slot ids (moecache_experts, which ran moecache_vram_decode; none where no matmul of the tier joined),
// src[2]: the CPU's down output (or none; it runs after the CPU's matmuls: the copies overlap them)
void moecache_vram_op_joint(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    moecache_layer & L = *(moecache_layer *) userdata;
    float * j = (float *) dst->data;
    const int64_t R = moecache_vram_joint_row(L.graph.vram_n);
    if (const ggml_tensor * w = dst->src[0]) {
        memcpy(j + 2 * R, w->data, ggml_nbytes(w));
    }
    if (const ggml_tensor * down = dst->src[2]) {
        memcpy(j + 3 * R, down->data, ggml_nbytes(down));
    }
    if (!dst->src[1]) {
        return;
    }
    moecache & mc = *L.mc;
    int64_t t_wait = 0;
    vram_finish(mc, L, 0, t_wait);
    mc.t_io_decode_us += t_wait;
    for (moecache_layer & T : mc.layers) { // copies up ahead for the next layers, beside this one's matmuls
        if (&T != &L && T.vram.copy_sent < (int32_t) T.vram.copy_e.size()) {
            int64_t t_later = 0; // (never waits: wait = false)
            vram_send(mc, T, false, t_later);
        }
    }
    const int64_t k = dst->src[1]->ne[0];                                          // K
    const int64_t n = std::min<int64_t>(ggml_nelements(dst->src[1]), (int64_t) L.vram.tok_slot.size()); // K x T
    const int32_t * on = L.vram.tok_slot.data();
    int32_t dummy = 0; // the step's first device slot (slot 0 where it has none)
    for (int64_t i = 0; i < n; i++) {
        if (on[i] >= 0) {
            dummy = on[i];
            break;
        }
    }
    int32_t * slot = (int32_t *) j;       // [K, T]
    int32_t * row  = (int32_t *) (j + R); // [K, T]
    for (int64_t i = 0; i < R; i++) {
        const bool device = i < n && on[i] >= 0;
        slot[i] = i < n ? (device ? on[i] : dummy) : 0;
        row[i]  = i < n ? (int32_t) (device ? k + i % k : i % k) : 0;
    }
}
