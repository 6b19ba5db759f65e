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
// Graph of one expert matmul (gate, up, gate_up or down) of a layer with the tier, decode:
//   cpu  = the stream path (moecache-matmul.cpp) on the host slots; a selection computed on the
//          device runs there on the zero slot (host slot res.n_slots), whose output is 0
//   ids  = moecache_vram_ids(slots)                 // I32 [K, 1]: device slot, or n (the zero one)
//   gpu  = mul_mat_id(device slots, b, ids)         // on the device: 0 for the CPU's selections
//   out  = gpu + cpu                                 // one side is exactly 0 for every selection
// The activation between up/gate and down is computed from those sums, so each side's down
// matmul gets the activations of its own selections. Per layer the router's logits, the ids and
// the FFN's small activations cross between the backends; expert bytes cross only when copied up.
// Copies are made by the CPU op before the matmuls (ggml_backend_tensor_set), not overlapped.

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "llama-model.h" // llama_layer: where the layer's router weight lives

#include <algorithm>
#include <string>

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
        L.vram.buft = n > 0 && !L.res.xt.empty() && !L.uni.dev ? layer_device_buft(model, L.il) : nullptr;
        L.vram.n    = L.vram.buft ? n : 0;
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
            ggml_tensor * v = ggml_new_tensor_3d(L.vram.ctx, t->type, t->ne[0], t->ne[1], L.vram.n + 1);
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
        for (ggml_tensor * v : L.vram.t) { // the zero slot
            ggml_backend_tensor_memset(v, 0, (size_t) L.vram.n * v->nb[2], v->nb[2]);
        }
        L.vram.slot_expert.assign(L.vram.n, -1);
        L.vram.expert_slot.assign(mc.n_expert, -1);
        L.vram.stamp.assign(mc.n_expert, -1);
        L.vram.in_use.assign(mc.n_expert, 0);
        L.vram.fresh.assign(mc.n_expert, 0);
        L.vram.tok_slot.assign(MOECACHE_MAX_USED, L.vram.n);
    }
    return MOECACHE_OK;
}

void moecache_vram_free(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        if (L.vram.buf) {
            ggml_backend_buffer_free(L.vram.buf);
        }
        if (L.vram.ctx) {
            ggml_free(L.vram.ctx);
        }
        L.vram = moecache_layer_vram();
    }
}

int64_t moecache_vram_bytes(const moecache & mc) {
    int64_t bytes = 0;
    for (const moecache_layer & L : mc.layers) {
        bytes += L.vram.buf ? (int64_t) ggml_backend_buffer_get_size(L.vram.buf) : 0;
    }
    return bytes;
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
    if (mc.vram_us_per_byte <= 0.0) {
        return true;
    }
    if (mc.vram_cpu_us <= 0.0) {
        return false;
    }
    const double reuse = mc.rst.vram_copies > 0 ? (double) mc.rst.vram_hits / (double) mc.rst.vram_copies : 1.0;
    return mc.vram_us_per_byte * (double) L.res.expert_bytes <= mc.vram_cpu_us * (1.0 + reuse);
}

// copies expert e from host slot hs into device slot vs; false if its read failed
static bool vram_copy_up(moecache & mc, moecache_layer & L, int32_t e, int32_t hs, int32_t vs) {
    const int64_t t0 = moecache_time_us();
    const int64_t waited = moecache_slots_wait(mc, L, &hs, 1); // (the miss's own read, queued by the host tier)
    if (mc.io_failed.load() || L.res.slot_expert[hs] != e) {
        return false;
    }
    const int64_t t1 = moecache_time_us();
    for (size_t j = 0; j < L.res.xt.size(); j++) {
        const moecache_expert_tensor & x = L.res.xt[j];
        ggml_tensor * v = L.vram.t[j];
        ggml_backend_tensor_set(v, (const char *) x.slots_t->data + (size_t) hs * x.slot_nb2, (size_t) vs * v->nb[2],
                                x.nb2);
    }
    const int64_t t2 = moecache_time_us();
    moecache_graph_event(mc, MOECACHE_EVENT_COPY_UP, L.il, e, 1, t0, t1, t2, (int64_t) L.res.expert_bytes);
    const double per_byte = (double) std::max<int64_t>(t2 - t1, 1) / (double) L.res.expert_bytes;
    mc.vram_us_per_byte = mc.vram_us_per_byte > 0.0 ? 0.9 * mc.vram_us_per_byte + 0.1 * per_byte : per_byte;
    mc.t_vram_copy_us += t2 - t0;
    mc.t_io_decode_us += waited;
    const int32_t old = L.vram.slot_expert[vs];
    if (old >= 0) {
        L.vram.expert_slot[old] = -1;
        L.vram.stamp[old]       = -1;
    }
    L.vram.slot_expert[vs] = e;
    L.vram.expert_slot[e]  = vs;
    mc.rst.vram_copies     += 1;
    mc.rst.vram_copy_bytes += (int64_t) L.res.expert_bytes;
    return true;
}

// a warm start (moecache_profile_warm): the device slots of each layer get its n hottest experts of
// the usage profile (never-selected ones stay out), copied from the model's mapping; the hottest is
// the most recent. Their pages are dropped from memory again once the layer next runs.
void moecache_vram_warm(moecache & mc) {
    std::vector<int32_t> hot;
    for (moecache_layer & L : mc.layers) {
        if (L.vram.n == 0 || mc.profile_counts.empty()) {
            continue;
        }
        const int32_t n_hot = std::min(moecache_profile_hottest(mc, L.il, hot), L.vram.n);
        std::fill(L.vram.slot_expert.begin(), L.vram.slot_expert.end(), -1);
        std::fill(L.vram.expert_slot.begin(), L.vram.expert_slot.end(), -1);
        std::fill(L.vram.stamp.begin(), L.vram.stamp.end(), -1);
        for (int32_t i = n_hot - 1; i >= 0; i--) { // the hottest last: the most recent
            const int32_t e = hot[i];
            const int32_t s = n_hot - 1 - i;
            for (size_t j = 0; j < L.res.xt.size(); j++) {
                const moecache_expert_tensor & x = L.res.xt[j];
                ggml_backend_tensor_set(L.vram.t[j], (const char *) x.model_t->data + (size_t) e * x.nb2,
                                        (size_t) s * L.vram.t[j]->nb[2], x.nb2);
            }
            L.vram.slot_expert[s] = e;
            L.vram.expert_slot[e] = s;
            L.vram.stamp[e]       = ++L.vram.clock;
            mc.drop_pending.emplace_back(L.il, e);
        }
    }
}

void moecache_vram_decode(moecache & mc, moecache_layer & L, const int32_t * ids, int32_t * out, int64_t n) {
    const int32_t zero = L.res.n_slots;
    std::fill(L.vram.in_use.begin(), L.vram.in_use.end(), 0);
    for (int64_t i = 0; i < n; i++) {
        L.vram.in_use[ids[i]] = 1;
    }
    for (int64_t i = 0; i < n && i < MOECACHE_MAX_USED; i++) {
        const int32_t e = ids[i];
        int32_t vs = L.vram.expert_slot[e];
        if (vs >= 0 && L.vram.slot_expert[vs] == e) {
            mc.rst.vram_hits += 1;
        } else {
            (L.vram.fresh[e] ? mc.rst.vram_from_file : mc.rst.vram_from_ram) += 1;
            const moecache_vram_fill fill = mc.cparams.vram_fill;
            const bool evict = fill == MOECACHE_VRAM_FILL_COPY || (fill == MOECACHE_VRAM_FILL_AUTO && vram_auto_copies(mc, L));
            vs = vram_victim(L, !evict);
            if (vs >= 0 && !vram_copy_up(mc, L, e, out[i], vs)) {
                vs = -1;
            }
            if (vs < 0) {
                L.vram.tok_slot[i] = L.vram.n; // on the CPU, from its host slot
                mc.rst.vram_cpu   += 1;
                continue;
            }
        }
        L.vram.stamp[e]      = ++L.vram.clock;
        L.vram.tok_slot[i]   = vs;
        out[i]               = zero; // (the host side computes 0 for it)
    }
}

// dst: I32 [K, 1] = the device slot of each selection of the token (n: the zero slot, computed on
// the CPU); src[0]: the host slot ids (moecache_experts), which ran moecache_vram_decode
static void op_vram_ids(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const moecache_layer & L = *(const moecache_layer *) userdata;
    int32_t * out = (int32_t *) dst->data;
    for (int64_t i = 0; i < ggml_nelements(dst); i++) {
        out[i] = i < MOECACHE_MAX_USED ? L.vram.tok_slot[i] : L.vram.n;
    }
}

ggml_tensor * moecache_vram_mul_mat_id(moecache_layer & L, ggml_context * ctx, const moecache_expert_tensor & x,
                                       ggml_tensor * b, ggml_tensor * cpu) {
    size_t j = 0;
    while (j < L.res.xt.size() && L.res.xt[j].model_t != x.model_t) {
        j++;
    }
    if (L.vram.n == 0 || j == L.res.xt.size() || L.graph.ids_out->ne[1] != 1) {
        return cpu;
    }
    if (!L.graph.vram_ids) {
        ggml_tensor * slots = L.graph.ids_out;
        L.graph.vram_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, slots->ne[0], slots->ne[1], 1, 1, &slots, 1,
                                          op_vram_ids, 1, &L);
        ggml_format_name(moecache_graph_on_cpu(L.graph.vram_ids), "moecache_vram_ids-%d", L.il);
    }
    ggml_tensor * gpu = ggml_mul_mat_id(ctx, L.vram.t[j], b, L.graph.vram_ids); // where its weights are
    ggml_format_name(gpu, "moecache_vram_mm-%d", L.il);
    return ggml_add(ctx, gpu, cpu);
}
