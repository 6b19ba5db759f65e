// moecache-graph.cpp - what patched llama.cpp calls (moecache-hook.h): which moecache belongs
// to which llama_context, and where the graph being built takes our ops: the two that route a MoE
// layer (moecache-graph-route.cpp) and the one in front of its expert matmuls that makes the
// residency follow the cache (moecache-graph-residency.cpp). What the ops start for the layers
// ahead is moecache-ahead.cpp's.
//
// Graph reuse: llama.cpp reuses a built graph for later ubatches of the same shape. The ops
// keep only a pointer to their moecache_layer and read the routing parameters when they run,
// so a reused graph follows moecache_set_routing at once. Attaching or detaching marks the
// context dirty, and the next ubatch builds a fresh graph with (or without) the ops.

#include "moecache-impl.h"
#include "moecache-hook.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "llama.h"
#include "llama-context.h" // llama_context::get_sched: our ops stay on the CPU beside GPU layers
#include "llama-hparams.h" // llama_expert_gating_func_type
#include "llama-impl.h"    // LLAMA_LOG_WARN: llama.cpp's logger, which the application controls
#include "llama-model.h"   // llama_layer: the router a layer's logits come from

#include <algorithm>

#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

struct ctx_entry {
    moecache * mc    = nullptr; // attached moecache, or nullptr after detach
    bool       dirty = true;    // the current graph does not match `mc`: rebuild
};

std::mutex                                               g_mutex;
std::unordered_map<const llama_context *, ctx_entry>     g_ctx;
thread_local moecache *                                  g_building = nullptr; // set between graph_begin/end
// the graph's scheduler and its CPU backend while a graph with another backend beside the CPU
// (GPU layers, n_gpu_layers > 0) is built; nullptr otherwise
thread_local ggml_backend_sched_t                        g_sched    = nullptr;
thread_local ggml_backend_t                              g_cpu      = nullptr;
thread_local ggml_cgraph *                               g_gf       = nullptr; // the graph being built

} // namespace

bool moecache_hook_graph_reusable(const llama_context * lctx) {
    moecache * mc = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_ctx.find(lctx);
        if (it == g_ctx.end()) {
            return true;
        }
        if (it->second.dirty) {
            return false;
        }
        mc = it->second.mc;
    }
    if (mc) { // (a ubatch is about to compute: the device path's token before counted, the prior's boosts up)
        moecache_device_ubatch_begin(*mc);
    }
    return true;
}

// a ubatch of one token per sequence decodes. STREAM: a batch of several sequences' tokens runs on the host
// slots (and a VRAM tier's) when they have room for it (n_seq) and nothing else computes a layer's experts
// (low-bit pools, unified memory: one token's paths); otherwise it is computed from the mapping, as a prompt is
static bool moecache_graph_decodes(const moecache & mc, int64_t n_tokens, int64_t n_seqs) {
    if (n_tokens < 1 || n_tokens != n_seqs) {
        return false;
    }
    if (n_tokens == 1 || mc.cparams.residency != MOECACHE_RESIDENCY_STREAM) {
        return true;
    }
    if (n_tokens > mc.cparams.n_seq) {
        return false;
    }
    for (const moecache_layer & L : mc.layers) {
        if (L.low.n > 0 || moecache_vram_direct_in_place(mc, L)) {
            return false;
        }
    }
    return true;
}

void moecache_hook_graph_begin(const llama_context * lctx, int64_t n_tokens, int64_t n_seqs) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_ctx.find(lctx);
    g_building = nullptr;
    if (it != g_ctx.end()) {
        g_building       = it->second.mc;
        it->second.dirty = false;
        if (g_building) {
            moecache_residency_graph_begin(*g_building);
            g_building->build_decode = moecache_graph_decodes(*g_building, n_tokens, n_seqs);
        }
    }
    g_sched = nullptr;
    g_cpu   = nullptr;
    g_gf    = nullptr; // (set by the first routed layer)
    if (g_building) {
        ggml_backend_sched_t sched = lctx->get_sched();
        const int n = sched ? ggml_backend_sched_get_n_backends(sched) : 0;
        for (int i = 0; i < n && n > 1; i++) {
            ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
            ggml_backend_dev_t dev = ggml_backend_get_device(b);
            if (dev && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
                g_sched = sched;
                g_cpu   = b;
            }
        }
    }
}

void moecache_hook_graph_end(const llama_context * lctx) {
    (void) lctx;
    if (g_building && g_gf) {
        moecache_device_expand(*g_building, g_gf); // (a layer whose expert matmuls were not seen)
        moecache_vram_graph_end(*g_building, g_gf); // (the weights join what crosses to the device)
    }
    g_gf       = nullptr;
    g_building = nullptr;
    g_sched    = nullptr;
    g_cpu      = nullptr;
}

// Our ops are CPU code: they read and write their tensors' data in host memory. Beside GPU
// layers the scheduler would run an op on the backend of its inputs when that backend claims it
// (RPC claims every op), so each of ours is placed on the CPU backend; the scheduler copies the
// router's outputs over and the results back.
ggml_tensor * moecache_graph_on_cpu(ggml_tensor * t) {
    if (g_sched && g_cpu) {
        ggml_backend_sched_set_tensor_backend(g_sched, t, g_cpu);
    }
    return t;
}

ggml_tensor * moecache_graph_on_device(ggml_tensor * t, ggml_backend_buffer_type_t buft) {
    const int n = g_sched && g_cpu && buft ? ggml_backend_sched_get_n_backends(g_sched) : 0;
    for (int i = 0; i < n; i++) {
        ggml_backend_t b = ggml_backend_sched_get_backend(g_sched, i);
        if (b != g_cpu && ggml_backend_supports_buft(b, buft) && ggml_backend_supports_op(b, t)) {
            ggml_backend_sched_set_tensor_backend(g_sched, t, b);
            break;
        }
    }
    return t;
}

void moecache_hook_ubatch_computed(const llama_context * lctx) {
    moecache * mc = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_ctx.find(lctx);
        if (it == g_ctx.end() || !it->second.mc) {
            return;
        }
        mc = it->second.mc;
    }
    ggml_backend_sched_t sched = lctx->get_sched();
    if (mc->build_decode && sched) { // (the graph that ran was built last: a reused one is that one)
        mc->rst.decode_graph_splits += ggml_backend_sched_get_n_splits(sched);
        mc->rst.decode_graphs       += 1;
    }
    moecache_device_ubatch_computed(*mc, sched);
    moecache_slots_fill_behind(*mc); // (a prompt's slots, read behind it)
    if (moecache_vram_direct_trial(*mc, mc->build_decode && mc->build_n_ubatch == 1)) {
        moecache_graph_mark_dirty(mc); // (the trial's other side: the next graph is built for it)
    }
}

int32_t moecache_context_graph_splits(const struct llama_context * lctx) {
    ggml_backend_sched_t sched = lctx ? lctx->get_sched() : nullptr;
    return sched ? ggml_backend_sched_get_n_splits(sched) : 0;
}

int32_t moecache_context_nonfinite_logits(struct llama_context * lctx, int32_t i) {
    if (!lctx || !lctx->get_sched()) {
        return -1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(&lctx->get_model()));
    const float * row = lctx->get_logits_ith(i); // (the member: no synchronize)
    if (!row) {
        return -1;
    }
    int32_t n_bad = 0;
    for (int32_t v = 0; v < n_vocab; v++) {
        n_bad += !std::isfinite(row[v]);
    }
    return n_bad;
}

void moecache_hook_context_free(const llama_context * lctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_ctx.find(lctx);
    if (it != g_ctx.end()) {
        if (it->second.mc) {
            moecache_device_flush(*it->second.mc); // (its read is on this context's backends)
            it->second.mc->ctx = nullptr;
        }
        g_ctx.erase(it);
    }
}

// t and the ops between it and `from` (depth ops at most) on the CPU backend: the router's probabilities and
// llama.cpp's top-k computed beside our routing op, so that only the logits cross from the device (each
// tensor crossing is a read the scheduler waits for: over RPC a round trip). Views follow their source.
static void cpu_from(ggml_tensor * t, const ggml_tensor * from, int depth) {
    if (!t || t == from || depth == 0 || t->op == GGML_OP_NONE) {
        return;
    }
    if (!t->view_src) {
        moecache_graph_on_cpu(t);
    }
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        cpu_from(t->src[i], from, depth - 1);
    }
}

// t and the ops between it and `from` (depth ops at most) read `to` where they read `from`; not past
// `stop` (the copy `to` is a view of, which reads `from` itself)
static void swap_src(ggml_tensor * t, const ggml_tensor * from, ggml_tensor * to, const ggml_tensor * stop, int depth) {
    if (!t || t == from || t == stop || depth == 0 || t->op == GGML_OP_NONE) {
        return;
    }
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        if (t->src[i] == from) {
            t->src[i] = to;
        } else {
            swap_src(t->src[i], from, to, stop, depth - 1);
        }
    }
}

// whether t or an op between it and `from` is a view of `from` (whose data swap_src would not move)
static bool views_of(const ggml_tensor * t, const ggml_tensor * from, int depth) {
    if (!t || t == from || depth == 0 || t->op == GGML_OP_NONE) {
        return false;
    }
    if (t->view_src == from) {
        return true;
    }
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        if (views_of(t->src[i], from, depth - 1)) {
            return true;
        }
    }
    return false;
}

// the small F32 weights in device memory (at most n elements: a selection bias, deepseek2's exp_probs_b)
// that t and the ops between it and `from` read, into leaves (each once, at most 4)
static void device_leaves(const ggml_tensor * t, const ggml_tensor * from, int64_t n, std::vector<ggml_tensor *> & leaves,
                          int depth) {
    if (!t || t == from || depth == 0 || t->op == GGML_OP_NONE) {
        return;
    }
    for (int i = 0; i < GGML_MAX_SRC; i++) {
        ggml_tensor * w = t->src[i];
        if (w && w->op == GGML_OP_NONE && !w->view_src && w->buffer && !ggml_backend_buffer_is_host(w->buffer) &&
            w->type == GGML_TYPE_F32 && ggml_is_contiguous(w) && ggml_nelements(w) <= n && leaves.size() < 4 &&
            std::find(leaves.begin(), leaves.end(), w) == leaves.end()) {
            leaves.push_back(w);
        } else {
            device_leaves(w, from, n, leaves, depth - 1);
        }
    }
}

// the device computes t: a matmul (plus a bias) whose weight is in device memory
static bool on_device(const ggml_tensor * t) {
    const ggml_tensor * mm = t && t->op == GGML_OP_ADD ? t->src[0] : t;
    return mm && mm->op == GGML_OP_MUL_MAT && mm->src[0]->buffer && !ggml_backend_buffer_is_host(mm->src[0]->buffer);
}

// A decode (one token, or a step of one token per sequence: T rows) of a device layer whose experts the
// CPU computes (host slots) needs tensors of the device on the CPU: the router's logits [N, T], the FFN's
// input x [n_embd, T], with prefetch gate the predictor's logits [N, 1], and the small weights the
// router's CPU ops read (a selection bias). Each
// tensor a CPU split reads is a read the scheduler waits for (over RPC a round trip), so they cross as
// one: joint = concat(x, logits, ...) on the device, one copy of it on the CPU, and the CPU's ops read
// views of that copy (outs: the routing's outputs, whose ops read them; *pred: the predictor's logits,
// replaced by its view). Returns the CPU's view of the logits, or logits unchanged where this does not apply
static ggml_tensor * read_joint(moecache & mc, moecache_layer & L, ggml_context * ctx, ggml_tensor * logits,
                                ggml_tensor ** pred, ggml_tensor ** outs, int n_outs) {
    ggml_tensor * mm = logits->op == GGML_OP_ADD ? logits->src[0] : logits;
    ggml_backend_buffer_type_t buft = mc.model ? moecache_layer_buft(mc.model, L.il) : nullptr;
    if (!g_sched || !L.graph.decode || mc.cparams.residency != MOECACHE_RESIDENCY_STREAM ||
        L.res.xt.empty() || moecache_vram_direct_in_place(mc, L) || !buft || ggml_backend_buft_is_host(buft) ||
        mm->op != GGML_OP_MUL_MAT || mm->src[0] != mc.model->layers[L.il].ffn_gate_inp ||
        mm->src[1]->type != GGML_TYPE_F32 || mm->src[1]->ne[1] != logits->ne[1] || !ggml_is_contiguous(mm->src[1]) ||
        !ggml_is_contiguous(logits) || (*pred && (!ggml_is_contiguous(*pred) || !on_device(*pred)))) {
        return logits; // (a fitted predictor in host memory is computed on the CPU: its own read of x)
    }
    for (int i = 0; i < n_outs; i++) {
        if (views_of(outs[i], logits, 8)) {
            return logits;
        }
    }
    std::vector<ggml_tensor *> parts = { mm->src[1], logits }; // what crosses, in the order of the copy
    if (*pred) {
        parts.push_back(*pred);
    }
    std::vector<ggml_tensor *> leaves;
    for (int i = 0; i < n_outs; i++) {
        device_leaves(outs[i], logits, logits->ne[0], leaves, 8);
    }
    parts.insert(parts.end(), leaves.begin(), leaves.end());
    ggml_tensor * joint = nullptr;
    for (ggml_tensor * t : parts) {
        ggml_tensor * flat = ggml_reshape_1d(ctx, t, ggml_nelements(t));
        joint = joint ? ggml_concat(ctx, joint, flat, 0) : flat;
    }
    ggml_format_name(moecache_graph_on_device(joint, buft), "moecache_joint-%d", L.il); // [n_embd + N + ...]
    ggml_tensor * host = moecache_graph_on_cpu(ggml_cont(ctx, joint));                 // one read
    ggml_format_name(host, "moecache_joint_host-%d", L.il);
    size_t off = 0;
    std::vector<ggml_tensor *> views;
    for (ggml_tensor * t : parts) { // each part's view of the copy, shaped as the part (contiguous)
        const size_t nb1 = t->ne[0] * sizeof(float);
        views.push_back(ggml_view_4d(ctx, host, t->ne[0], t->ne[1], t->ne[2], t->ne[3], nb1, nb1 * t->ne[1],
                                     nb1 * t->ne[1] * t->ne[2], off));
        off += ggml_nelements(t) * sizeof(float);
    }
    L.graph.x_dev  = parts[0];
    L.graph.x_host = views[0];
    for (size_t j = 1; j < parts.size(); j++) { // the ops placed on the CPU read the copy
        for (int i = 0; i < n_outs; i++) {
            if (outs[i] == parts[j]) {
                outs[i] = views[j];
            } else {
                swap_src(outs[i], parts[j], views[j], host, 8);
            }
        }
    }
    if (*pred) {
        *pred = views[2];
    }
    return views[1];
}

ggml_tensor * moecache_graph_host_input(moecache_layer & L, ggml_context * ctx, ggml_tensor * b) {
    ggml_tensor * x = L.graph.x_dev;
    if (!x || !b || ggml_nelements(b) != ggml_nelements(x) || !ggml_is_contiguous(b) ||
        !(b == x || (b->view_src == x && b->view_offs == 0))) {
        return b;
    }
    return ggml_reshape_4d(ctx, L.graph.x_host, b->ne[0], b->ne[1], b->ne[2], b->ne[3]);
}

ggml_tensor * moecache_hook_select(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * selected, ggml_tensor * logits,
                                   ggml_tensor * probs, ggml_tensor * selection, int il, int gating_op,
                                   bool has_bias, bool warmup) {
    moecache * mc = g_building;
    if (!mc || warmup || il < 0 || il >= mc->n_layer) {
        return selected;
    }
    const int64_t N = logits->ne[0];
    const int64_t K = selected->ne[0];
    if (N != mc->n_expert || K != mc->n_expert_used || K > MOECACHE_MAX_USED ||
        logits->type != GGML_TYPE_F32 || probs->type != GGML_TYPE_F32 || selection->type != GGML_TYPE_F32 ||
        probs->ne[0] != N || selection->ne[0] != N) {
        LLAMA_LOG_WARN("moecache: warning: layer %d (N = %lld, K = %lld) does not match the model's N = %d, K = %d; "
                        "routed without the cache\n", il, (long long) N, (long long) K, mc->n_expert, mc->n_expert_used);
        return selected;
    }
    moecache_layer & L = mc->layers[il];
    g_gf = gf;
    if (mc->build_n_ubatch == 0) {
        mc->build_n_ubatch = selected->ne[1];
        mc->first_routed   = il;
    }
    L.graph.n_ubatch = mc->build_n_ubatch;
    L.graph.decode   = mc->build_decode && mc->build_n_ubatch == selected->ne[1]; // (a prompt's output rows: not)
    L.graph.rank_on_logits = gating_op == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX && !has_bias; // softmax keeps the logits' order
    L.graph.probs_are_logits = gating_op == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT;
    if (ggml_tensor * ran = moecache_device_defer(*mc, ctx, gf, il, selected, logits, probs, selection)) {
        return ran; // llama.cpp's top-k or the prior, on its device; counted after the graph (moecache-device.cpp)
    }

    if (g_sched && L.graph.decode) { // (a decode beside GPU layers: see cpu_from)
        for (ggml_tensor * t : { selected, probs, selection }) {
            cpu_from(t, logits, 8);
        }
    }
    ggml_tensor * pred = moecache_ahead_predict_router(*mc, ctx, logits, il, selected->ne[1]);
    L.graph.predicts = pred != nullptr;
    ggml_tensor * outs[3] = { selected, probs, selection }; // (what the CPU's ops above read comes in one read)
    ggml_tensor * logits_cpu = read_joint(*mc, L, ctx, logits, &pred, outs, 3);
    ggml_tensor * args[6] = { outs[0], logits_cpu, outs[1], outs[2], pred, nullptr };
    int32_t n_args = pred ? 5 : 4;
    L.graph.src_input = -1;
    ggml_tensor * mm = logits->op == GGML_OP_ADD ? logits->src[0] : logits;
    L.graph.ffn_in = mm->op == GGML_OP_MUL_MAT ? mm->src[1] : nullptr;
    if (mc->cparams.router_record > 0 && mc->cparams.router_record_input && mm->op == GGML_OP_MUL_MAT && mc->model &&
        mm->src[0] == mc->model->layers[il].ffn_gate_inp && mm->src[1]->type == GGML_TYPE_F32 &&
        mm->src[1]->ne[1] == selected->ne[1]) {
        L.graph.src_input = n_args; // the router's input rows, recorded with its outputs
        args[n_args++]    = L.graph.x_host ? L.graph.x_host : mm->src[1]; // (its copy, where read_joint made one)
    }
    L.graph.route_out = ggml_custom_4d(ctx, GGML_TYPE_I32, K + 2, selected->ne[1], 1, 1, args, n_args,
                                       moecache_op_select, 1, &L);
    ggml_format_name(moecache_graph_on_cpu(L.graph.route_out), "moecache_select-%d", il);
    // llama.cpp gets the K selected experts per token, contiguous as its own top-K
    L.graph.select_out = ggml_cont(ctx, ggml_view_2d(ctx, L.graph.route_out, K, selected->ne[1], L.graph.route_out->nb[1], 0));
    ggml_format_name(L.graph.select_out, "moecache_selected-%d", il);
    return L.graph.select_out;
}

ggml_tensor * moecache_hook_weights(ggml_context * ctx, ggml_tensor * weights, ggml_tensor * selected,
                                    int il, int gating_op) {
    moecache * mc = g_building;
    if (!mc || il < 0 || il >= mc->n_layer || mc->layers[il].graph.select_out != selected) {
        return weights;
    }
    moecache_layer & L = mc->layers[il];
    L.graph.dropped_weight = gating_op == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT ? -INFINITY : 0.0f;
    // weights = get_rows(probs, selected): its src[0] is probs
    ggml_tensor * args[3] = { weights, L.graph.route_out, weights->src[0] };
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, weights->ne[0], weights->ne[1], weights->ne[2], 1,
                                       args, 3, moecache_op_weights, 1, &L);
    ggml_format_name(moecache_graph_on_cpu(out), "moecache_weights-%d", il);
    L.graph.select_out = nullptr;
    L.graph.route_out  = nullptr;
    return out;
}

ggml_tensor * moecache_hook_mul_mat_id(ggml_context * ctx, ggml_tensor * as, ggml_tensor * b, ggml_tensor * ids) {
    moecache * mc = g_building;
    if (mc && g_gf) { // (llama.cpp has put the layer's weights, and so its routing ops, into the graph)
        moecache_device_expand(*mc, g_gf);
    }
    ggml_tensor * res = mc ? moecache_residency_mul_mat_id(*mc, ctx, as, b, ids) : nullptr;
    return res ? res : ggml_mul_mat_id(ctx, as, b, ids);
}

// --- model loading ---------------------------------------------------------------------------

static thread_local int g_load_residency = MOECACHE_RESIDENCY_NONE;

void moecache_graph_set_load_residency(enum moecache_residency residency) {
    g_load_residency = residency;
}

ggml_backend_buffer_type_t moecache_hook_weight_buft(const char * name, ggml_backend_buffer_type_t buft) {
    if (g_load_residency == MOECACHE_RESIDENCY_NONE || !strstr(name, "_exps.")) {
        return buft; // (blk.N.ffn_{gate,up,down,gate_up}_exps.weight: the routed experts)
    }
    // not repacked (a CPU extra type) and not on a GPU layer's device: in host memory, in the file's
    // layout, read from the file into slots or locked in the mapping (as llama.cpp's --cpu-moe places them)
    return ggml_backend_cpu_buffer_type();
}

bool moecache_hook_mmap_prefetch(void) {
    return g_load_residency == MOECACHE_RESIDENCY_NONE; // experts are read when a token needs them
}

void moecache_graph_mark_dirty(moecache * mc) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (mc->ctx) {
        auto it = g_ctx.find(mc->ctx);
        if (it != g_ctx.end()) {
            it->second.dirty = true;
        }
    }
}

// --- attach / detach (the registry; the API is in moecache.cpp) ---------------------------

// The context's last graph may still run on an asynchronous device (Vulkan, Metal, CUDA) after
// llama_decode returns, with this cache's buffers in it: the VRAM tier's slots, the device path's
// rows, the host slots a GPU computes in place. Whatever frees or rewrites them waits for it first:
// freed under a running graph, lavapipe's queue thread corrupted the heap (glibc aborted the process).
void moecache_graph_wait(moecache & mc) {
    if (mc.ctx) {
        llama_synchronize(mc.ctx);
    }
}

void moecache_hook_detach(moecache * mc) {
    moecache_graph_wait(*mc);
    moecache_device_flush(*mc); // (its read is on the context's backends)
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!mc->ctx) {
        return;
    }
    auto it = g_ctx.find(mc->ctx);
    if (it != g_ctx.end()) {
        it->second.mc    = nullptr;
        it->second.dirty = true;
    }
    if (mc->cparams.residency != MOECACHE_RESIDENCY_NONE) {
        llama_set_abort_callback(mc->ctx, nullptr, nullptr);
    }
    mc->ctx = nullptr;
}

int32_t moecache_graph_attach(moecache * mc, llama_context * ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (mc->ctx == ctx) {
        return MOECACHE_OK;
    }
    if (mc->ctx) {
        moecache_set_error("this moecache is attached to another context; detach it first");
        return MOECACHE_ERR_STATE;
    }
    auto it = g_ctx.find(ctx);
    if (it == g_ctx.end()) {
        try {
            it = g_ctx.emplace(ctx, ctx_entry()).first;
        } catch (const std::exception &) {
            moecache_set_error("moecache_attach: out of memory");
            return MOECACHE_ERR_NO_MEMORY;
        }
    }
    ctx_entry & e = it->second;
    if (e.mc) {
        moecache_set_error("another moecache is attached to this context; detach it first");
        return MOECACHE_ERR_STATE;
    }
    e.mc    = mc;
    e.dirty = true;
    mc->ctx = ctx;
    if (mc->cparams.residency != MOECACHE_RESIDENCY_NONE) {
        llama_set_abort_callback(ctx, moecache_residency_abort, mc); // a failed expert read stops the decode
    }
    return MOECACHE_OK;
}
