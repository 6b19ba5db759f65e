// moecache-graph-residency.cpp - the op in front of a layer's expert matmuls, which makes the residency
// follow the cache (moecache-residency.cpp reads or locks what the selected experts need), and the
// expert matmuls over the slots that op hands them.

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstring>

// the layer runs a decode: one token per sequence (not the output row of a prompt's last layer);
// n_tokens: what the layer sees, for a layer the routing hook did not see (n_ubatch 0)
static bool moecache_layer_decodes(const moecache_layer & L, int64_t n_tokens) {
    return L.graph.n_ubatch > 0 ? L.graph.decode : n_tokens == 1;
}

// dst: I32 [K, n_tokens] = slot ids (STREAM decode) or the expert ids; src[0]: the expert ids.
// Reads or locks what the layer's experts need first (moecache-residency.cpp).
static void op_experts(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    moecache_layer & L = *(moecache_layer *) userdata;
    moecache_residency_sync(L, (const int32_t *) dst->src[0]->data, (int32_t *) dst->data, ggml_nelements(dst),
                            moecache_layer_decodes(L, dst->ne[1]));
}

void moecache_residency_graph_begin(moecache & mc) {
    moecache_slots_fill_behind(mc); // (left by a prompt whose graph did not finish)
    mc.build_n_ubatch = 0;
    moecache_device_graph_begin(mc);
    for (moecache_layer & L : mc.layers) {
        L.graph.ids_in   = nullptr;
        L.graph.ids_out  = nullptr;
        L.graph.arrival  = nullptr;
        L.graph.ready    = nullptr;
        L.graph.vram_joint = nullptr;
        L.graph.vram_joint_dev = nullptr;
        L.graph.vram_out = nullptr;
        L.graph.direct_ids = nullptr;
        L.graph.vram_w   = nullptr;
        L.graph.ffn_in   = nullptr;
        L.graph.vram_slot = nullptr;
        L.graph.vram_row = nullptr;
        L.graph.n_vram_sum = 0;
        L.graph.low_ids  = nullptr;
        L.graph.x_dev    = nullptr;
        L.graph.x_host   = nullptr;
        L.graph.n_ubatch = 0;
        L.graph.decode   = false;
    }
}

ggml_tensor * moecache_residency_mul_mat_id(moecache & mc, ggml_context * ctx, ggml_tensor * as,
                                            ggml_tensor * b, ggml_tensor * ids) {
    if (mc.cparams.residency == MOECACHE_RESIDENCY_NONE) {
        return nullptr;
    }
    auto it = mc.res.xt_layer.find(as);
    if (it == mc.res.xt_layer.end() || ids->type != GGML_TYPE_I32) {
        return nullptr;
    }
    moecache_layer & L = mc.layers[it->second];
    if (moecache_vram_direct_layer(mc, L)) { // routed on the device: the layer stays there (moecache-vram-direct.cpp)
        for (const moecache_expert_tensor & x : L.res.xt) {
            ggml_tensor * out = x.model_t == as ? moecache_vram_direct_mul_mat_id(mc, L, ctx, x, b, ids) : nullptr;
            if (out) {
                return out;
            }
        }
    }
    if (L.graph.ids_in != ids) {
        L.graph.ids_in  = ids;
        L.graph.ids_out = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], 1, 1, &ids, 1, op_experts, 1, &L);
        L.graph.arrival = nullptr;
        L.graph.ready   = nullptr;
        ggml_format_name(moecache_graph_on_cpu(L.graph.ids_out), "moecache_experts-%d", L.il);
    }
    if (mc.cparams.residency == MOECACHE_RESIDENCY_STREAM) {
        const bool decodes = moecache_layer_decodes(L, ids->ne[1]);
        for (const moecache_expert_tensor & x : L.res.xt) {
            if (x.model_t != as) {
                continue;
            }
            // on the device, in place (moecache-unified.cpp); a decode beside a direct tier: the tier's round trip
            const bool in_place = decodes ? moecache_vram_direct_in_place(mc, L) : !L.uni.t.empty() && L.res.all_in_slots;
            if (in_place) {
                return moecache_unified_mul_mat_id(L, ctx, x, b, decodes ? moecache_matmul_ready(L, ctx) : L.graph.ids_out);
            }
            if (decodes) { // on the slots (moecache-matmul.cpp), the low-bit pool's and the VRAM tier's
                ggml_tensor * b_gpu = b;
                ggml_tensor * b_cpu = moecache_graph_host_input(L, ctx, b); // (the FFN's input read with the logits)
                moecache_vram_split_act(L, ctx, b, &b_gpu, &b_cpu); // (down, beside a VRAM tier: each side's own)
                ggml_tensor * host = moecache_lowbit_mul_mat_id(L, ctx, x, b_cpu,
                                                                moecache_matmul_stream_decode(mc, L, ctx, x, b_cpu));
                return moecache_vram_mul_mat_id(L, ctx, x, b_gpu, host);
            }
            if (L.res.all_in_slots) {
                return ggml_mul_mat_id(ctx, x.slots_t, b, L.graph.ids_out); // a prompt, every expert in a slot
            }
        }
    }
    return ggml_mul_mat_id(ctx, as, b, L.graph.ids_out);
}
