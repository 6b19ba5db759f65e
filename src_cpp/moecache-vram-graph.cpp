// moecache-vram-graph.cpp - the VRAM tier in the graph (moecache-vram.cpp keeps its slots, copies and
// the op that decides them): each expert matmul of a layer with a tier computed on both sides, and the
// activations each side gets.
//
// Graph of one expert matmul (gate, up, gate_up or down) of a layer with the tier, decode (one token, or a
// batch step of T, one per sequence; shapes below for one token):
//   cpu  = the stream path (moecache-matmul.cpp) on the host slots; a selection computed on the
//          device runs there on the zero slot (host slot res.n_slots), whose output is 0
//   J    = op_joint(slots, cpu_down, weights)       // F32 on the CPU, after its matmuls: the ids [K, T] x 2
//                                                   // (row 0 the device slot of each selection, the
//                                                   // CPU's: one of the token's own, computed and
//                                                   // dropped; row 1 where its output is), the CPU's
//                                                   // down output, the routing weights
//   ids  = the I32 view of J's copy on the device
//   gpu  = mul_mat_id(device slots, b, ids[:, 0])   // [n_out, K, 1] on the device
//   out  = get_rows(concat(cpu, gpu), ids[:, 1])    // [n_out, K, 1]: each row taken whole from its side
//                                                   // (down: cpu is the view of J's copy)
// The device has no zero slot (every byte of the tier holds an expert): its rows of the CPU's
// selections are picked out, not added, so whatever they hold never reaches the output. Each
// side's activations between up/gate and down are rebuilt from its own part (split_act), so each
// side's down matmul gets the activations of its own selections. Per layer one read crosses to the CPU
// (the router's logits with the FFN's input, moecache-graph.cpp's read_joint) and one write crosses
// back (J); expert bytes cross only when copied up.
//

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

// the rows of the down expert tensor's output (n_embd), 0 where the layer has none
static int64_t vram_n_out(const moecache_layer & L) {
    for (const moecache_expert_tensor & x : L.res.xt) {
        if (strstr(ggml_get_name(x.model_t), "down")) {
            return x.model_t->ne[1];
        }
    }
    return 0;
}

// J on the CPU and its copy on the device (L.graph.vram_joint, vram_joint_dev) for a step of n_tok tokens, with
// the views of the ids' two rows the device's matmuls read
static void vram_joint(moecache_layer & L, ggml_context * ctx, int64_t n_used, int64_t n_tok) {
    const int64_t n = n_used * n_tok;
    const int64_t R = moecache_vram_joint_row(n);
    ggml_tensor * j = ggml_custom_4d(ctx, GGML_TYPE_F32, 3 * R + vram_n_out(L) * n, 1, 1, 1,
                                     nullptr, 0, moecache_vram_op_joint, 1, &L); // (its sources are joined later)
    ggml_format_name(moecache_graph_on_cpu(j), "moecache_vram_joint-%d", L.il);
    ggml_tensor * dev = moecache_graph_on_device(ggml_cont(ctx, j), L.vram.buft); // the one copy up
    ggml_format_name(dev, "moecache_vram_joint_dev-%d", L.il);
    L.graph.vram_joint     = j;
    L.graph.vram_joint_dev = dev;
    L.graph.vram_n         = n;
    for (int r = 0; r < 2; r++) { // (I32 views of F32 bits: both are 4 bytes, the strides stay)
        ggml_tensor * v = ggml_view_2d(ctx, dev, n_used, n_tok, n_used * sizeof(float), r * R * sizeof(float));
        v->type = GGML_TYPE_I32;
        (r == 0 ? L.graph.vram_slot : L.graph.vram_row) = v; // [K, T]
    }
    L.graph.vram_w = ggml_view_3d(ctx, dev, 1, n_used, n_tok, sizeof(float), n_used * sizeof(float), 2 * R * sizeof(float));
    ggml_format_name(L.graph.vram_w, "moecache_vram_weights-%d", L.il); // [1, K, T] (moecache_vram_graph_end)
}

// whether t reaches `to` through its sources, not past `stop` (the FFN's input); false also where the walk
// would take more than `budget` ops (then the caller keeps what it has: no cycle can come of it)
static bool reaches(const ggml_tensor * t, const ggml_tensor * to, const ggml_tensor * stop,
                    std::unordered_set<const ggml_tensor *> & seen, int & budget) {
    if (!t || t == stop || t->op == GGML_OP_NONE || !seen.insert(t).second) {
        return false;
    }
    if (t == to || --budget < 0) {
        return true;
    }
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        if (reaches(t->src[i], to, stop, seen, budget)) {
            return true;
        }
    }
    return false;
}

// whether t reads L's joint copy (the FFN's input, the walk's stop, is read by both): then t cannot join J
static bool reads_joint(const moecache_layer & L, const ggml_tensor * t) {
    std::unordered_set<const ggml_tensor *> seen;
    int budget = 1024;
    return reaches(t, L.graph.vram_joint_dev, L.graph.ffn_in, seen, budget);
}

ggml_tensor * moecache_vram_mul_mat_id(moecache_layer & L, ggml_context * ctx, const moecache_expert_tensor & x,
                                       ggml_tensor * b, ggml_tensor * cpu) {
    size_t j = 0;
    while (j < L.res.xt.size() && L.res.xt[j].model_t != x.model_t) {
        j++;
    }
    if (L.vram.n == 0 || j == L.res.xt.size()) {
        return cpu;
    }
    const int64_t n_used = L.graph.ids_out->ne[0];
    const int64_t n_tok  = L.graph.ids_out->ne[1]; // (a batch step: one token per sequence)
    if (!L.graph.vram_joint) {
        vram_joint(L, ctx, n_used, n_tok);
    }
    const size_t down_off = 3 * moecache_vram_joint_row(L.graph.vram_n) * sizeof(float);
    ggml_tensor * joint = L.graph.vram_joint;
    joint->src[1] = L.graph.ids_out;
    ggml_tensor * slot = L.graph.vram_slot; // (the same views for every matmul of the layer: the scheduler
    ggml_tensor * row  = L.graph.vram_row;  //  copies each tensor a split reads once, a view like any other)
    ggml_tensor * gpu = ggml_mul_mat_id(ctx, L.vram.t[j], b, slot); // where its weights are
    ggml_format_name(gpu, "moecache_vram_mm-%d", L.il);
    const bool input_side = strstr(ggml_get_name(x.model_t), "down") == nullptr;
    if (!input_side && !joint->src[2] && cpu->type == GGML_TYPE_F32 && ggml_is_contiguous(cpu) &&
        ggml_nelements(cpu) * sizeof(float) == ggml_nbytes(joint) - down_off && !reads_joint(L, cpu)) {
        joint->src[2] = cpu; // the CPU's down output crosses in J (where it does not itself read J: no cycle)
        const size_t nb1 = cpu->ne[0] * sizeof(float);
        cpu = ggml_view_3d(ctx, L.graph.vram_joint_dev, cpu->ne[0], cpu->ne[1], cpu->ne[2], nb1, nb1 * cpu->ne[1],
                           down_off);
    }
    // the CPU's side first in the graph, where nothing of the device's is needed: the CPU's work of the layer
    // (its matmuls, activations, down) and the device's each run as one split
    ggml_tensor * both = ggml_concat(ctx, cpu, gpu, 1);                       // [n_out, 2K, T]
    ggml_tensor * sum  = ggml_get_rows(ctx, both, row);                       // [n_out, K, T]
    if (L.graph.n_vram_sum < 4 && input_side) {
        const int32_t k = L.graph.n_vram_sum++;
        L.graph.vram_sum[k]     = sum;
        L.graph.vram_side[k][0] = gpu;
        L.graph.vram_side[k][1] = cpu;
    }
    if (joint->src[2]) {
        L.graph.vram_out = sum;
    }
    return sum;
}

// llama.cpp expands the weights into the graph before the experts' matmuls are built, so J cannot read them
// when it is made: once the graph is built, J reads llama.cpp's weights (before it in the graph), and the op
// that weights the experts' outputs reads J's copy instead (the view placed just before that op)
void moecache_vram_graph_end(moecache & mc, ggml_cgraph * gf) {
    bool any = false;
    for (const moecache_layer & L : mc.layers) {
        any |= L.graph.vram_out != nullptr;
    }
    if (!any) {
        return;
    }
    ggml_tensor ** nodes = ggml_graph_nodes(gf);
    const int n = ggml_graph_n_nodes(gf);
    std::unordered_map<const ggml_tensor *, int> at; // each node's place, and llama.cpp's weighting of each output
    std::unordered_map<const ggml_tensor *, ggml_tensor *> weighting;
    for (int i = 0; i < n; i++) {
        at[nodes[i]] = i;
        if (nodes[i]->op == GGML_OP_MUL && nodes[i]->src[0]) {
            weighting.emplace(nodes[i]->src[0], nodes[i]);
        }
    }
    for (moecache_layer & L : mc.layers) {
        ggml_tensor * j = L.graph.vram_joint;
        auto m = L.graph.vram_out ? weighting.find(L.graph.vram_out) : weighting.end();
        if (m == weighting.end() || ggml_graph_n_nodes(gf) >= ggml_graph_size(gf)) {
            continue;
        }
        ggml_tensor * mul = m->second;
        ggml_tensor * w   = mul->src[1]; // [1, K, 1] (llama.cpp's normalizing and scaling done)
        if (w->type != GGML_TYPE_F32 || !ggml_is_contiguous(w) || !ggml_are_same_shape(w, L.graph.vram_w) ||
            !at.count(w) || !at.count(j) || at[w] > at[j]) {
            continue; // (where J is computed, the weights must be: they come before it)
        }
        j->src[0] = w;
        ggml_tensor * v = L.graph.vram_w;
        ggml_build_forward_expand(gf, v); // (appended after mul: moved to just before it)
        nodes = ggml_graph_nodes(gf);
        const int last = ggml_graph_n_nodes(gf) - 1;
        std::rotate(nodes + at[mul], nodes + last, nodes + last + 1);
        mul->src[1] = v;
        for (auto & it : at) { // (the nodes after it moved one on)
            if (it.second >= at[mul] && it.first != v) {
                it.second += 1;
            }
        }
        at[v] = at[mul] - 1;
    }
}

// t with each input-side sum of L replaced by its `side` part: t itself where no sum lies within `depth`
// ops of it; nullptr where one does but the way there holds an op computed in place (a view of its input
// that also computes), which this does not rebuild
static ggml_tensor * rebuild_side(moecache_layer & L, ggml_context * ctx, ggml_tensor * t, int side, int depth) {
    for (int32_t k = 0; k < L.graph.n_vram_sum; k++) {
        if (t == L.graph.vram_sum[k]) {
            return L.graph.vram_side[k][side];
        }
    }
    if (!t || depth == 0 || t->op == GGML_OP_NONE) {
        return t;
    }
    ggml_tensor * src[GGML_MAX_SRC] = {};
    bool changed = false;
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        src[i] = t->src[i] ? rebuild_side(L, ctx, t->src[i], side, depth - 1) : nullptr;
        if (t->src[i] && !src[i]) {
            return nullptr;
        }
        changed |= src[i] != t->src[i];
    }
    if (!changed) {
        return t;
    }
    ggml_tensor * c = nullptr;
    if (t->op == GGML_OP_VIEW || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE) {
        // the same window of the rebuilt source (view_offs counts from the root of its views)
        const size_t base = t->src[0]->view_src ? t->src[0]->view_offs : 0;
        c = ggml_view_4d(ctx, src[0], t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3],
                         t->view_offs - base);
    } else if (t->view_src) {
        return nullptr; // computed in place (ggml_clamp, the *_inplace ops)
    } else {
        c = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
        c->op = t->op;
        memcpy(c->op_params, t->op_params, sizeof(c->op_params));
        for (int i = 0; i < GGML_MAX_SRC; i++) {
            c->src[i] = src[i];
        }
    }
    ggml_format_name(c, "%s-%s", ggml_get_name(t), side ? "cpu" : "dev");
    return side && !c->view_src ? moecache_graph_on_cpu(c) : c; // (a view is where its source is)
}

void moecache_vram_split_act(moecache_layer & L, ggml_context * ctx, ggml_tensor * b, ggml_tensor ** b_gpu,
                             ggml_tensor ** b_cpu) {
    if (L.graph.n_vram_sum == 0 || L.vram.n == 0) {
        return;
    }
    const int depth = 8; // (the activations are a few ops from the sums: glu, scales, views, biases)
    ggml_tensor * g = rebuild_side(L, ctx, b, 0, depth);
    ggml_tensor * c = rebuild_side(L, ctx, b, 1, depth);
    if (g && c && g != b && c != b) {
        *b_gpu = g;
        *b_cpu = c;
    }
}
