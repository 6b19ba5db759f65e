// moecache-vram-direct.cpp - the direct tier: a decoded token's MoE layer computed on its device alone, with no
// round trip to the CPU. Where every expert of a layer is in its host slots (a cache of every expert, streamed),
// those slots are wrapped for the layer's device (unified = on, or auto on a discrete GPU: moecache-unified.cpp; on
// CUDA with patches/0004) and the layer has a VRAM tier (moecache-vram.cpp), the device path routes the token on the device
// (moecache-device.cpp: top-k, or the prior's ops, whose boosts are the tier's contents), and each expert matmul is
//   tier = get_rows(tab.tier, ids)                     // I32 [K, T]: the tier slot of each selection
//   host = get_rows(tab.host, ids)                     // I32 [K, T]: its host slot; the zero slot for the tier's
//   hit  = get_rows(tab.hit, ids)                      // F32 [1, K, T]: 1 where the tier has it
//   out  = mul_mat_id(host slots, b, host)             // the misses read over the bus; 0 for the tier's (zero slot)
//        + mul_mat_id(tier slots, b, tier) * hit       // the tier's hits
// (bit for bit each side's own numbers: x + 0 and y * 1 are exact). The table is the tier's contents before the
// token, uploaded once per token (one write for every layer); the token's selections are counted behind the graph
// (moecache-device.cpp), and the tier follows them: its hits, and copies up of the experts it lacked, made before
// the next token's table is uploaded. So the tier lags the cache by a token, and no layer waits for the CPU.
// Whatever does not take it (a prompt, a batch step, a routing the device cannot run: prior-p) decodes through the
// tier with its round trip, as with unified off. With unified = auto a trial of the first decoded tokens times both
// ways and keeps the faster one (moecache_vram_direct_trial): where the bus is slow against the CPU, the CPU's
// matmuls on the misses beside the round trip can win.

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-impl.h" // LLAMA_LOG_INFO

#include <algorithm>
#include <cstring>

#define MOECACHE_DIRECT_WINDOW 8     // decoded tokens of each of the trial's four blocks
#define MOECACHE_DIRECT_MARGIN 0.02  // the round trip wins only if its median token is this much faster

bool moecache_vram_direct_wanted(const moecache & mc, const moecache_layer & L) {
    return mc.cparams.n_vram > 0 && L.uni.dev != nullptr && L.uni.direct; // (moecache_unified_plan)
}

// a layer that cannot take the direct tier: with AUTO every layer's slots are unwrapped, so that the tier's round
// trip runs (a layer computed in place would leave its tier unused); ON keeps them, and says so
static int32_t without(moecache & mc, const moecache_layer & L) {
    if (mc.cparams.unified == MOECACHE_UNIFIED_AUTO) {
        moecache_unified_free(mc);
    } else if (L.vram.n > 0) {
        LLAMA_LOG_WARN("moecache: unified = on: layer %d cannot take the direct tier (its slots or its tier on another "
                       "device, or not wrapped): the VRAM tier waits unused beside its layers computed in place\n", L.il);
    }
    return MOECACHE_OK;
}

int32_t moecache_vram_direct_init(moecache & mc) {
    moecache_vram_direct & D = mc.vdir;
    ggml_backend_buffer_type_t buft = nullptr;
    int32_t n_with = 0;
    bool    wanted = false;
    for (const moecache_layer & L : mc.layers) {
        wanted = wanted || moecache_vram_direct_wanted(mc, L);
    }
    if (!wanted) {
        return MOECACHE_OK;
    }
    for (const moecache_layer & L : mc.layers) {
        if (L.res.xt.empty()) {
            continue;
        }
        if (L.vram.n == 0 || L.uni.t.size() != L.res.xt.size() || L.vram.t.size() != L.res.xt.size() ||
            (buft && L.vram.buft != buft)) {
            return without(mc, L); // (a layer without both, or on another device: the paths with the round trip)
        }
        buft = L.vram.buft;
        n_with++;
    }
    if (n_with == 0) {
        return MOECACHE_OK;
    }
    D.row = moecache_vram_joint_row(mc.n_expert); // (as J's rows: 256 bytes, a device's storage buffer offsets)
    ggml_init_params ip = { ggml_tensor_overhead(), nullptr, true };
    D.ctx = ggml_init(ip);
    D.tab = ggml_new_tensor_2d(D.ctx, GGML_TYPE_I32, 3 * D.row, mc.n_layer);
    D.buf = ggml_backend_alloc_ctx_tensors_from_buft(D.ctx, buft);
    if (!D.buf) {
        return moecache_fail_residency("cannot allocate the direct tier's table on the device");
    }
    ggml_backend_buffer_clear(D.buf, 0); // (written before every ubatch: moecache_vram_direct_upload)
    D.host.assign((size_t) ggml_nelements(D.tab), 0);
    D.on  = true;
    D.use = true;
    D.trial.on   = mc.cparams.unified == MOECACHE_UNIFIED_AUTO;
    D.trial.left = D.trial.on ? 4 * MOECACHE_DIRECT_WINDOW : 0;
    mc.cparams.prefetch = MOECACHE_PREFETCH_OFF; // (every expert is in RAM: nothing to read ahead)
    LLAMA_LOG_INFO("moecache: direct tier: %d layers' tokens computed on the device alone (tier of %d, the rest "
                   "read over the bus from the host slots)%s\n", n_with, mc.cparams.n_vram,
                   D.trial.on ? ", or with the tier's round trip, as a trial of the first decoded tokens decides" : "");
    return MOECACHE_OK;
}

void moecache_vram_direct_free(moecache & mc) {
    moecache_vram_direct & D = mc.vdir;
    if (D.buf) {
        ggml_backend_buffer_free(D.buf);
    }
    if (D.ctx) {
        ggml_free(D.ctx);
    }
    D = moecache_vram_direct();
}

bool moecache_vram_direct_layer(const moecache & mc, const moecache_layer & L) {
    return mc.vdir.use && L.vram.n > 0 && !L.uni.t.empty() && L.il < (int32_t) mc.dev.deferred.size() &&
           mc.dev.deferred[L.il] > 0 && L.graph.decode;
}

// a row of layer il's part of the table as a tensor [1, N] of `type` (a view)
static ggml_tensor * tab_row(moecache & mc, ggml_context * ctx, int32_t il, int32_t r, ggml_type type) {
    const moecache_vram_direct & D = mc.vdir;
    ggml_tensor * v = ggml_view_2d(ctx, D.tab, 1, mc.n_expert, sizeof(int32_t),
                                   ((size_t) il * 3 * D.row + (size_t) r * D.row) * sizeof(int32_t));
    v->type = type; // (F32 bits in an I32 tensor: both 4 bytes)
    return v;
}

ggml_tensor * moecache_vram_direct_mul_mat_id(moecache & mc, moecache_layer & L, ggml_context * ctx,
                                              const moecache_expert_tensor & x, ggml_tensor * b, ggml_tensor * ids) {
    size_t j = 0;
    while (j < L.res.xt.size() && L.res.xt[j].model_t != x.model_t) {
        j++;
    }
    if (j == L.res.xt.size() || ids->type != GGML_TYPE_I32 || !ggml_is_contiguous(ids)) {
        return nullptr;
    }
    const int64_t K = ids->ne[0];
    const int64_t T = ids->ne[1];
    if (L.graph.direct_ids != ids) { // the layer's three lookups, once for its matmuls
        ggml_tensor * tier = ggml_get_rows(ctx, tab_row(mc, ctx, L.il, 0, GGML_TYPE_I32), ids); // [1, K, T]
        ggml_tensor * host = ggml_get_rows(ctx, tab_row(mc, ctx, L.il, 1, GGML_TYPE_I32), ids); // [1, K, T]
        L.graph.direct_ids  = ids;
        L.graph.direct_tier = ggml_reshape_2d(ctx, tier, K, T);
        L.graph.direct_host = ggml_reshape_2d(ctx, host, K, T);
        L.graph.direct_hit  = ggml_get_rows(ctx, tab_row(mc, ctx, L.il, 2, GGML_TYPE_F32), ids); // [1, K, T]
        ggml_format_name(L.graph.direct_tier, "moecache_direct_tier-%d", L.il);
        ggml_format_name(L.graph.direct_host, "moecache_direct_host-%d", L.il);
    }
    ggml_tensor * host = ggml_mul_mat_id(ctx, L.uni.t[j], b, L.graph.direct_host);  // [n_out, K, T]
    ggml_tensor * tier = ggml_mul_mat_id(ctx, L.vram.t[j], b, L.graph.direct_tier); // [n_out, K, T]
    ggml_format_name(host, "moecache_direct_host_mm-%d", L.il);
    ggml_format_name(tier, "moecache_direct_tier_mm-%d", L.il);
    return ggml_add(ctx, host, ggml_mul(ctx, tier, L.graph.direct_hit));
}

void moecache_vram_direct_follow(moecache & mc, moecache_layer & L, const int32_t * sel, int32_t n) {
    if (!mc.vdir.on || L.vram.n == 0 || n <= 0) {
        return;
    }
    int32_t out[MOECACHE_MAX_USED];
    for (int32_t i = 0; i < n && i < MOECACHE_MAX_USED; i++) {
        out[i] = moecache_slots_holding(L, sel[i]); // (every expert is in a host slot: where its copy comes from)
    }
    moecache_vram_decode(mc, L, sel, out, std::min<int32_t>(n, MOECACHE_MAX_USED)); // (its copies' time counted there)
}

void moecache_vram_direct_upload(moecache & mc) {
    moecache_vram_direct & D = mc.vdir;
    if (!D.use) {
        return;
    }
    const int64_t N = mc.n_expert;
    for (moecache_layer & L : mc.layers) {
        if (L.vram.n == 0 || L.uni.t.empty()) {
            continue;
        }
        moecache_vram_begin(mc, L); // (the copies up the last token made, finished)
        int32_t * row = D.host.data() + (size_t) L.il * 3 * D.row;
        const int32_t zero = L.res.n_slots;
        for (int64_t e = 0; e < N; e++) {
            const int32_t vs = L.vram.expert_slot[e];
            const bool    in = vs >= 0 && L.vram.slot_expert[vs] == (int32_t) e;
            const int32_t hs = moecache_slots_holding(L, (int32_t) e);
            row[e]              = in ? vs : 0;
            row[D.row + e]      = in || hs < 0 ? zero : hs; // (hs < 0 cannot be: every expert is held)
            const float w       = in ? 1.0f : 0.0f;
            memcpy(&row[2 * D.row + e], &w, sizeof(float));
        }
    }
    ggml_backend_tensor_set(D.tab, D.host.data(), 0, ggml_nbytes(D.tab));
}

bool moecache_vram_direct_in_place(const moecache & mc, const moecache_layer & L) {
    return !L.uni.t.empty() && !mc.vdir.on;
}

// The trial (unified AUTO): which computes a token's misses faster on this model and machine, the device from the
// host slots over the bus (direct), or the CPU beside the tier's round trip per layer. Its decoded tokens run
// direct, round trip, round trip, direct, MOECACHE_DIRECT_WINDOW each (a drift of the machine or the tier's warming
// up weighs on both sides alike), timed from one token's ubatch queued to the next one's, where both ran the same
// side (the first after a change pays the graph's build; a prompt between breaks the chain). The round trip must
// win by MOECACHE_DIRECT_MARGIN of the median token; the winner then runs for good.
bool moecache_vram_direct_trial(moecache & mc, bool decoded) {
    moecache_vram_direct & D = mc.vdir;
    auto & c = D.trial;
    if (!D.on) {
        return false;
    }
    const bool ran = D.use && mc.dev.n_deferred > 0; // (the graph that ran routed on the device: took it; not
                                                     // where the routing cannot run there, as prior-p)
    mc.rst.direct_tokens += decoded && ran ? 1 : 0;
    if (c.left == 0) {
        return false;
    }
    const int64_t now = moecache_time_us();
    if (!decoded || (D.use && !ran)) {
        c.t_last = 0;
        return false;
    }
    if (c.t_last > 0 && c.direct == D.use) {
        (D.use ? c.dt_direct : c.dt_round).push_back(now - c.t_last);
    }
    c.t_last = now;
    c.direct = D.use;
    c.left -= 1;
    const bool was = D.use;
    if (c.left > 0) {
        const int32_t block = (4 * MOECACHE_DIRECT_WINDOW - c.left) / MOECACHE_DIRECT_WINDOW; // 0 1 2 3
        D.use = block == 0 || block == 3;
        return D.use != was;
    }
    c.ms_direct = (double) moecache_median_us(c.dt_direct) / 1000.0;
    c.ms_round  = (double) moecache_median_us(c.dt_round) / 1000.0;
    D.use = !(c.ms_round > 0.0 && c.ms_round < (1.0 - MOECACHE_DIRECT_MARGIN) * c.ms_direct);
    LLAMA_LOG_INFO("moecache: direct tier: %.2f ms a token against %.2f with the tier's round trip (medians of %zu "
                   "and %zu): %s\n", c.ms_direct, c.ms_round, c.dt_direct.size(), c.dt_round.size(),
                   D.use ? "direct" : "the round trip");
    return D.use != was;
}

void moecache_vram_direct_stats(const moecache & mc, moecache_residency_stats * out) {
    const auto & c     = mc.vdir.trial;
    out->direct_choice = c.on && c.left == 0 ? (mc.vdir.use ? 1 : 2) : 0;
    out->direct_ms     = c.ms_direct;
    out->round_trip_ms = c.ms_round;
}
