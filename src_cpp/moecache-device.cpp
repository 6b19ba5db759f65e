// moecache-device.cpp - the device path where the cache only counts: every expert resident
// (residency NONE), the routing top-k or the prior; also the direct tier's tokens (every expert in
// the host slots, which the device reads: moecache-vram-direct.cpp).
//
// The routing op of moecache-graph.cpp is CPU code. Beside GPU layers it puts a CPU split in every
// MoE layer: the router's outputs come to the host, the scheduler waits for them, and the result
// goes back (two splits and a synchronization per layer). Here a decoded token's graph keeps the
// selection on the device: llama.cpp's own top-k, or the prior as ggml ops on the router's outputs
// (moecache-device-route.cpp: the boosts of the cache and Delta before the token, uploaded once per
// token before it computes). What the counting reads is computed straight into one persistent buffer per
// device, the staging: llama.cpp's router logits and its argsort write there (their memory is placed
// in it when the graph is built, so no copy runs), and the counting's own softmax (sigmoid, ...) of
// the logits, so that llama.cpp's routing ops keep no use outside themselves and a GPU backend fuses
// them into its one top-k MoE kernel as it does without us (ggml-cuda and ggml-vulkan do so only
// where the gating's output has no other use, and the ops are next to each other in the graph: ours
// go in after them). A decoded step of T tokens (one, or one per sequence of a batch under top-k):
//
//     staging, per layer on the device, each field aligned to the device's alignment:
//          [ ids I32 [N, T] (llama.cpp's argsort: its top K first) | z [N, T] | p [N, T] |
//            s [N, T] (where s is not p) | ids run I32 [K, T] (the prior's) ]
//     (a layer that routes twice a token, grovemoe's: its second routing's fields after every layer's first)
//
// After each graph one read per device is queued behind it (asynchronously; on the CPU the staging is
// host memory and nothing is read), and the step is counted once it has arrived: once the next ubatch's
// graph is queued (the host counts while the device computes; before it where the prior's next boosts
// need the count, or the CPU's graph would overwrite its staging), before the cache is next looked at
// or changed (every API entry calls moecache_device_flush), or before a graph is built. So no wait is
// added to a decode and no op per layer beside the gating's copy. Each layer of each token is counted
// by moecache_route_token, in token order, exactly as op_select counts it (same inputs, same code: the
// hits, misses, evictions, Delta and trace of the CPU op), and the prior's choice is checked against it.
// A graph with any other routing policy, reads ahead, router recording or a prompt of several tokens
// keeps the CPU op.

#include "moecache-impl.h"
#include "moecache-hook.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-context.h"
#include "llama-model.h"

#include <algorithm>
#include <cstring>

// a layer's fields in its device's staging for a step of T tokens (see the top of this file)
enum device_field { FIELD_IDS, FIELD_Z, FIELD_P, FIELD_S, FIELD_RAN, N_FIELDS };

struct device_fields {
    size_t off[N_FIELDS + 1]; // bytes from the layer's start; off[N_FIELDS]: the layer's share of the staging
};

static device_fields device_layout(const moecache & mc, int64_t T, size_t align) {
    const size_t row = GGML_PAD((size_t) mc.n_expert * T * sizeof(float), align);
    device_fields f;
    for (int i = 0; i <= FIELD_RAN; i++) {
        f.off[i] = (size_t) i * row;
    }
    f.off[N_FIELDS] = f.off[FIELD_RAN] + GGML_PAD((size_t) mc.n_expert_used * T * sizeof(int32_t), align);
    return f;
}

// the device a layer's router runs on: the one its router weight lives on
static ggml_backend_dev_t layer_device(const moecache & mc, int il) {
    ggml_backend_buffer_type_t buft = moecache_layer_buft(mc.model, il); // (moecache-vram.cpp)
    if (!buft) {
        return nullptr;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev && ggml_backend_buft_is_host(buft)) { // (ggml's CPU buffer types name no device)
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    return dev;
}

// the persistent buffers, one per device holding MoE layers; false when one cannot be had
static bool device_alloc(moecache & mc) {
    moecache_device & d = mc.dev;
    if (d.ready || d.failed) {
        return d.ready;
    }
    d.failed = true; // until it succeeds below
    d.layer_group.assign(mc.n_layer, -1);
    d.layer_slot.assign(mc.n_layer, -1);
    std::vector<int32_t> n_in;
    for (int il = 0; il < mc.n_layer; il++) {
        ggml_backend_dev_t dev = layer_device(mc, il);
        if (!dev) {
            continue;
        }
        int32_t g = (int32_t) (std::find(d.devs.begin(), d.devs.end(), dev) - d.devs.begin());
        if (g == (int32_t) d.devs.size()) {
            d.devs.push_back(dev);
            n_in.push_back(0);
        }
        d.layer_group[il] = g;
        d.layer_slot[il]  = n_in[g]++;
    }
    ggml_init_params ip = { ggml_tensor_overhead() * (3 * d.devs.size() + 1), nullptr, true };
    d.ctx = ggml_init(ip);
    if (!d.ctx) {
        return false;
    }
    for (size_t g = 0; g < d.devs.size(); g++) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(d.devs[g]);
        const size_t align = buft ? ggml_backend_buft_get_alignment(buft) : 64;
        const size_t stage_size = (size_t) n_in[g] * MOECACHE_DEVICE_CALLS * device_layout(mc, MOECACHE_DEVICE_MAX_STEP, align).off[N_FIELDS];
        // (the staging as one tensor of each type, for the reads and the copies; the fields are placed by offset)
        ggml_tensor * stage     = ggml_new_tensor_1d(d.ctx, GGML_TYPE_I32, (int64_t) (stage_size / sizeof(int32_t)));
        ggml_tensor * stage_f32 = ggml_new_tensor_1d(d.ctx, GGML_TYPE_F32, ggml_nelements(stage));
        ggml_tensor * bias  = ggml_new_tensor_1d(d.ctx, GGML_TYPE_F32, ((int64_t) mc.n_expert + mc.n_expert_used) * n_in[g]);
        ggml_backend_buffer_t buf = buft ? ggml_backend_buft_alloc_buffer(buft, stage_size + ggml_nbytes(bias)) : nullptr;
        if (!buf) {
            return false;
        }
        d.bufs.push_back(buf);
        d.n_in.push_back(n_in[g]);
        d.align.push_back(align);
        d.stage.push_back(stage);
        d.stage_f32.push_back(stage_f32);
        d.bias.push_back(bias);
        d.bias_host.emplace_back(ggml_nelements(bias), 0.0f);
        char * base = (char *) ggml_backend_buffer_get_base(buf);
        if (ggml_backend_tensor_alloc(buf, stage, base) != GGML_STATUS_SUCCESS ||
            ggml_backend_tensor_alloc(buf, stage_f32, base) != GGML_STATUS_SUCCESS ||
            ggml_backend_tensor_alloc(buf, bias, base + stage_size) != GGML_STATUS_SUCCESS) {
            return false;
        }
        // where the counting reads the staging: in place where it is host memory (the CPU); else pinned host
        // memory where the device has it (an asynchronous read lands there directly), else plain memory
        ggml_backend_buffer_type_t hbt = ggml_backend_buffer_is_host(buf) ? nullptr : ggml_backend_dev_host_buffer_type(d.devs[g]);
        ggml_backend_buffer_t hbuf = hbt ? ggml_backend_buft_alloc_buffer(hbt, stage_size) : nullptr;
        d.host_bufs.push_back(hbuf);
        d.host_vec.emplace_back(hbuf || ggml_backend_buffer_is_host(buf) ? 0 : stage_size);
        d.host.push_back(ggml_backend_buffer_is_host(buf) ? base
                         : hbuf ? (char *) ggml_backend_buffer_get_base(hbuf) : d.host_vec.back().data());
    }
    d.n_read = 0;
    d.ready  = true;
    d.failed = false;
    return true;
}

void moecache_device_free(moecache & mc) {
    moecache_device_flush(mc);
    moecache_device & d = mc.dev;
    for (ggml_backend_event_t e : d.events) {
        if (e) {
            ggml_backend_event_free(e);
        }
    }
    for (ggml_backend_buffer_t b : d.bufs) {
        ggml_backend_buffer_free(b);
    }
    for (ggml_backend_buffer_t b : d.host_bufs) {
        if (b) {
            ggml_backend_buffer_free(b);
        }
    }
    d.host_bufs.clear();
    d.host_vec.clear();
    d.host.clear();
    if (d.ctx) {
        ggml_free(d.ctx);
    }
    d.events.clear();
    d.bufs.clear();
    d.n_in.clear();
    d.align.clear();
    d.stage.clear();
    d.stage_f32.clear();
    d.bias.clear();
    d.bias_host.clear();
    d.ctx   = nullptr;
    d.ready = false;
}

void moecache_device_graph_begin(moecache & mc) {
    moecache_device_flush(mc); // (before a graph that may route another way)
    {
        std::lock_guard<std::mutex> lock(mc.dev.mutex); // (a graph built afresh, not reused: no ubatch_begin before it)
        moecache_vram_direct_upload(mc);
    }
    mc.dev.n_deferred = 0;
    mc.dev.n_calls    = 0;
    mc.dev.n_prior    = 0;
    mc.dev.step_n     = 1;
    mc.dev.calls.assign(mc.n_layer, 0);
    mc.dev.deferred.assign(mc.n_layer, 0);
    mc.dev.p_from.assign((size_t) mc.n_layer * MOECACHE_DEVICE_CALLS, FIELD_P);
    mc.dev.s_from.assign((size_t) mc.n_layer * MOECACHE_DEVICE_CALLS, FIELD_S);
    mc.dev.prior.assign(mc.n_layer, 0);
    mc.dev.pending.clear();
}

// the routing a decoded token's layer can take on its device: top-k (any device), or the prior on the
// logit scale (not on the CPU, whose op is as cheap and the reference itself), where nothing else
// changes the cache during the token (no reads ahead). Not prior-p: a boost of lambda on probabilities
// near 0 rounds many of them to the same value, and ggml's sort breaks such ties otherwise than r
// A decode step of several sequences (a batch, one token each) takes top-k only: the prior routes a
// step's tokens in order, each seeing the cache the ones before it left (and batch_share's two passes)
static bool device_routes(const moecache & mc, int64_t n_tokens, bool * prior) {
    const moecache_routing_params & rp = mc.rparams;
    *prior = rp.policy == MOECACHE_POLICY_PRIOR && rp.prior_lambda > 0.0f && !rp.prior_on_probs;
    const bool direct = mc.vdir.use && n_tokens == 1; // (moecache-vram-direct.cpp: one token)
    return (mc.cparams.residency == MOECACHE_RESIDENCY_NONE || direct) && (rp.policy == MOECACHE_POLICY_TOPK || *prior) &&
           mc.cparams.prefetch == MOECACHE_PREFETCH_OFF && mc.cparams.router_record == 0 && mc.model != nullptr &&
           n_tokens >= 1 && n_tokens <= MOECACHE_DEVICE_MAX_STEP && mc.build_n_ubatch == n_tokens &&
           (n_tokens == 1 || (mc.build_decode && !*prior));
}

// t's output can go to a field of `bytes` in its device's staging: an op of its own that nothing has
// placed yet, which the device computes
static bool device_placeable(const moecache_device & d, int32_t g, const ggml_tensor * t, size_t bytes) {
    return t->op != GGML_OP_NONE && !t->view_src && !t->data && !t->buffer && ggml_is_contiguous(t) &&
           ggml_nbytes(t) <= bytes && ggml_backend_dev_supports_op(d.devs[g], t);
}

// a copy of src into the field at `off`, where src cannot go there itself: an op for the graph, or nullptr
// where the device has no such copy
static ggml_tensor * device_copy(moecache_device & d, ggml_context * ctx, int32_t g, ggml_tensor * src, size_t off) {
    ggml_tensor * base = src->type == GGML_TYPE_I32 ? d.stage[g] : d.stage_f32[g];
    if (src->type != base->type) {
        return nullptr;
    }
    ggml_tensor * dst = ggml_view_1d(ctx, base, ggml_nelements(src), off);
    ggml_tensor * c = ggml_cpy(ctx, src, ggml_reshape(ctx, dst, src));
    return ggml_backend_dev_supports_op(d.devs[g], c) ? c : nullptr;
}

ggml_tensor * moecache_device_defer(moecache & mc, ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * selected,
                                    ggml_tensor * logits, ggml_tensor * probs, ggml_tensor * selection) {
    // a layer that routes twice a token (grovemoe: its experts, then its chunk experts; known from the
    // architecture, else seen in a graph: one with the prior on the device is built again, without it)
    if (il < (int) mc.dev.calls.size() && ++mc.dev.calls[il] > 1 && !mc.dev.routes_twice) {
        mc.dev.routes_twice = true;
        if (mc.dev.n_prior > 0) {
            moecache_graph_mark_dirty(&mc);
        }
    }
    bool prior = false;
    if (!gf || !device_routes(mc, selected->ne[1], &prior) || !device_alloc(mc) || mc.dev.layer_group[il] < 0 ||
        !ggml_is_contiguous(logits) || !ggml_is_contiguous(probs) || !ggml_is_contiguous(selection) ||
        (prior && !ggml_is_contiguous(selected))) {
        return nullptr;
    }
    moecache_device & d = mc.dev;
    const int32_t g = d.layer_group[il];
    ggml_backend_dev_t dev = d.devs[g];
    const bool on_cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    // the layer's routings of this token, counted in their order after the graph: top-k only where there are
    // two (the prior's boosts of the second would need the first counted; in a graph that showed a second
    // routing of an architecture not known for it, under the prior, that one token's second routing is the
    // op's, counted before the first)
    const int32_t call = d.deferred[il];
    if (call >= MOECACHE_DEVICE_CALLS || (prior && (call > 0 || d.routes_twice))) {
        return nullptr;
    }
    const int32_t k = il * MOECACHE_DEVICE_CALLS + call;
    if (prior && (on_cpu || (mc.layers[il].graph.rank_on_logits && selection != probs))) {
        return nullptr; // (the CPU: its op; a softmax router whose s is not p: masked experts, which u does not show)
    }
    // llama.cpp's top-k: the view of an argsort of [N, T], whose output goes to the staging
    ggml_tensor * sorted = selected->src[0];
    if (selected->op != GGML_OP_VIEW || selected->view_offs != 0 || !sorted || sorted->op != GGML_OP_ARGSORT ||
        sorted->type != GGML_TYPE_I32) {
        return nullptr;
    }
    ggml_tensor * ran = prior ? moecache_device_prior_select(mc, ctx, il, selected, logits, selection) : selected;
    if (!ran) {
        return nullptr;
    }
    const int64_t T = selected->ne[1]; // tokens: 1, or one per sequence of a batch
    const bool s_is_p = selection == probs;
    const device_fields f = device_layout(mc, T, d.align[g]);
    const size_t at = (size_t) (call * d.n_in[g] + d.layer_slot[il]) * f.off[N_FIELDS]; // (second routings after the first)
    // p and s: the counting's own copy of the gating ops, so that llama.cpp's are used by nothing outside
    // them; on the CPU (which fuses none of them) and under the prior (which uses them) llama.cpp's. Where
    // no copy could be made, llama.cpp's is copied, not placed: a device that fuses the routing would not
    // compute it, but with the copy reading it, it does not fuse it
    ggml_tensor * p_out = probs;
    ggml_tensor * s_out = selection; // (where s is p: p's tensor, read from p's field below)
    bool copy_p = false;
    bool copy_s = false;
    if (!on_cpu && !prior) {
        ggml_tensor * p2 = moecache_device_regate(ctx, probs, logits, nullptr, nullptr, 0);
        ggml_tensor * s2 = p2 && !s_is_p ? moecache_device_regate(ctx, selection, logits, probs, p2, 0) : nullptr;
        p_out  = p2 ? p2 : probs;
        copy_p = !p2;
        s_out  = s_is_p ? p_out : s2 ? s2 : selection;
        copy_s = !s_is_p && !s2;
    }
    // each into its field: the op's output placed there where it can be, else a copy (an op more); one that
    // is another field's tensor (s that is p; gpt-oss's probabilities, its logits) is read from that field
    struct field { ggml_tensor * t; bool copy; };
    field fields[N_FIELDS] = {
        { sorted,                        false  },
        { logits,                        false  },
        { p_out,                         copy_p },
        { s_out,                         copy_s },
        { prior ? ran->src[0] : nullptr, false  }, // (ran: a reshape of the get_rows)
    };
    uint8_t from[N_FIELDS] = { FIELD_IDS, FIELD_Z, FIELD_P, FIELD_S, FIELD_RAN };
    std::vector<ggml_tensor *> copies;
    bool placeable[N_FIELDS] = {};
    for (int i = 0; i < N_FIELDS; i++) {
        ggml_tensor * t = fields[i].t;
        for (int j = 0; j < i && t; j++) {
            if (fields[j].t == t) {
                from[i] = from[j];
                t = fields[i].t = nullptr;
            }
        }
        if (!t) {
            continue;
        }
        const size_t off   = at + f.off[i];
        const size_t bytes = f.off[i + 1] - f.off[i];
        placeable[i] = !fields[i].copy && device_placeable(d, g, t, bytes);
        if (!placeable[i]) {
            ggml_tensor * c = i > 0 && ggml_nbytes(t) <= bytes ? device_copy(d, ctx, g, t, off) : nullptr;
            if (!c) {
                return nullptr; // (the CPU op routes this layer; none of the above is in the graph)
            }
            copies.push_back(c);
        }
    }
    for (int i = 0; i < N_FIELDS; i++) {
        if (placeable[i] && ggml_backend_tensor_alloc(d.bufs[g], fields[i].t, (char *) d.stage[g]->data + at + f.off[i]) !=
                            GGML_STATUS_SUCCESS) {
            return nullptr; // (not reached: a buffer of ggml's init_tensor fails only for quantized tensors)
        }
    }
    for (ggml_tensor * t : { p_out, s_out == p_out ? nullptr : s_out }) {
        if (t && t != probs && t != selection && t != logits) {
            ggml_format_name(t, "moecache_counted-%d", il);
            d.pending.push_back(t); // (into the graph after llama.cpp's routing ops: moecache_device_expand)
        }
    }
    for (ggml_tensor * c : copies) {
        ggml_format_name(c, "moecache_counted-%d", il);
        d.pending.push_back(c);
    }
    d.deferred[il] = call + 1;
    d.n_calls      = std::max(d.n_calls, call + 1);
    d.p_from[k]    = from[FIELD_P];
    d.s_from[k]    = from[FIELD_S];
    d.prior[il]    = prior;
    d.n_deferred  += 1;
    d.n_prior     += prior;
    d.step_n       = (int32_t) T;
    if (prior) { // (this token's boosts: the cache is counted up to the token before, graph_begin flushed)
        const int64_t N = mc.n_expert;
        const int64_t K = mc.n_expert_used;
        std::lock_guard<std::mutex> lock(d.mutex);
        moecache_device_prior_boosts(mc, il);
        const size_t bytes = (size_t) (N + K) * sizeof(float);
        ggml_backend_tensor_set(d.bias[g], d.bias_host[g].data() + (size_t) d.layer_slot[il] * (N + K),
                                (size_t) d.layer_slot[il] * bytes, bytes);
    }
    return ran;
}

void moecache_device_expand(moecache & mc, ggml_cgraph * gf) {
    moecache_device & d = mc.dev;
    for (ggml_tensor * c : d.pending) {
        ggml_build_forward_expand(gf, c);
    }
    d.pending.clear();
}

// the backend of the scheduler that runs `dev`
static ggml_backend_t sched_backend(ggml_backend_sched_t sched, ggml_backend_dev_t dev) {
    const int n = ggml_backend_sched_get_n_backends(sched);
    for (int i = 0; i < n; i++) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(b) == dev) {
            return b;
        }
    }
    return nullptr;
}

// Counts the step the staging holds (read to the host), each deferred layer in layer order and within
// it the step's tokens in order, as the graph runs the CPU op, with the routing of the tokens (the
// graph's deferred layers are still theirs: moecache_device_graph_begin flushes before it changes
// them); the step's hits and misses added to each row's, as op_select keeps them
static void device_count(moecache & mc) {
    moecache_device & d = mc.dev;
    const bool    timeline = mc.timeline.on.load(std::memory_order_relaxed);
    const int64_t t0 = moecache_time_us();
    const int64_t N = mc.n_expert;
    const int64_t K = mc.n_expert_used;
    const int32_t T = std::max(1, d.step_n);
    int32_t sel[MOECACHE_MAX_USED];
    int8_t  hit[MOECACHE_MAX_USED];
    if ((int32_t) mc.step_hits.size() != T) { // (summed per row until moecache_get_step_rows reads them)
        mc.step_hits.assign(T, 0);
        mc.step_misses.assign(T, 0);
    }
    for (int il = 0; il < mc.n_layer; il++) {
        moecache_layer & L = mc.layers[il];
        for (int32_t call = 0; call < d.deferred[il]; call++) { // (its routings in their order: as the op's)
            const int32_t k = il * MOECACHE_DEVICE_CALLS + call;
            const int32_t g = d.layer_group[il];
            const device_fields f = device_layout(mc, T, d.align[g]);
            const char * at = d.host[g] + (size_t) (call * d.n_in[g] + d.layer_slot[il]) * f.off[N_FIELDS];
            const int64_t t1 = moecache_time_us();
            std::vector<uint8_t> seen; // [n_expert] the step's union so far
            for (int32_t t = 0; t < T; t++) {
                const int32_t * ids = (const int32_t *) (at + f.off[FIELD_IDS]) + t * N; // (the argsort's row: top K first)
                const int32_t * ran = (const int32_t *) (at + f.off[FIELD_RAN]) + t * K;
                const float   * z   = (const float *) (at + f.off[FIELD_Z]) + t * N;
                const float   * p   = (const float *) (at + f.off[d.p_from[k]]) + t * N;
                const float   * s   = (const float *) (at + f.off[d.s_from[k]]) + t * N;
                const int32_t n_sel = moecache_route_token(mc, L, d.read_rp, z, p, s, ids, true, true, sel, hit);
                if (d.prior[il]) {
                    mc.rst.device_routed += 1;
                    // a tie of boosted scores that ggml's sort broke otherwise (the cache follows the reference)
                    mc.rst.device_route_differs += n_sel != K || !std::equal(sel, sel + K, ran);
                }
                for (int32_t i = 0; i < n_sel; i++) {
                    mc.step_hits[t]   += hit[i] == 1 ? 1 : 0;
                    mc.step_misses[t] += hit[i] == 0 ? 1 : 0;
                }
                moecache_route_count_union(mc, seen, sel, n_sel, T);
                moecache_vram_direct_follow(mc, L, sel, n_sel); // (the direct tier's: its hits, its copies up)
            }
            L.decode_tokens += T;
            L.decode_steps  += 1;
            if (timeline) {
                moecache_graph_event(mc, MOECACHE_EVENT_ROUTE, L.il, -1, T, t1, t1, moecache_time_us());
            }
        }
    }
    mc.rst.device_steps  += 1;
    mc.t_route_decode_us += moecache_time_us() - t0;
}

// the step the last graph left in the staging, counted once its read has arrived (waiting for it alone
// where the device has events); caller holds d.mutex
static void device_count_read(moecache & mc) {
    moecache_device & d = mc.dev;
    if (d.n_read == 0) {
        return;
    }
    for (size_t g = 0; g < d.devs.size(); g++) {
        if (g < d.events.size() && d.events[g]) {
            ggml_backend_event_synchronize(d.events[g]);
        } else if (g < d.read_backends.size() && d.read_backends[g]) {
            ggml_backend_synchronize(d.read_backends[g]);
        }
    }
    d.n_read = 0;
    device_count(mc);
}

void moecache_device_flush(moecache & mc) {
    moecache_device & d = mc.dev;
    std::lock_guard<std::mutex> lock(d.mutex);
    device_count_read(mc);
}

void moecache_device_ubatch_begin(moecache & mc) {
    moecache_device & d = mc.dev;
    std::lock_guard<std::mutex> lock(d.mutex);
    // the step before is counted here where the next one needs it (the prior's boosts), would overwrite it
    // (a staging in host memory, read in place), or where its read has no event (waiting for it there would
    // wait for the next graph too); otherwise after this ubatch's graph is queued, while the device computes
    // it (moecache_device_ubatch_computed)
    bool early = d.n_prior > 0 || mc.vdir.use; // (direct: the tier follows the token before this one computes)
    for (size_t g = 0; g < d.bufs.size(); g++) {
        early = early || ggml_backend_buffer_is_host(d.bufs[g]) || g >= d.events.size() || !d.events[g];
    }
    if (early) {
        device_count_read(mc); // (the token before, whose graph is done when its logits were read)
    }
    if (d.n_prior > 0) {
        moecache_device_prior_upload(mc);
    }
    moecache_vram_direct_upload(mc); // (its copies up finished, its table written: before the graph reads them)
}

void moecache_device_ubatch_computed(moecache & mc, ggml_backend_sched_t sched) {
    moecache_device & d = mc.dev;
    std::lock_guard<std::mutex> lock(d.mutex);
    device_count_read(mc); // (the step before: its read has arrived, and this graph runs meanwhile)
    if (d.n_deferred == 0 || !sched) {
        return;
    }
    d.events.resize(d.devs.size(), nullptr);
    d.read_backends.assign(d.devs.size(), nullptr);
    d.read_rp = mc.rparams; // (the layers are the graph's: a graph is built only after a flush)
    const int32_t T = d.step_n;
    for (size_t g = 0; g < d.devs.size(); g++) {
        if (ggml_backend_buffer_is_host(d.bufs[g])) {
            d.read_backends[g] = sched_backend(sched, d.devs[g]); // (counted in place, once the graph is done)
            continue;
        }
        // the step's fields of every layer: one read, queued behind the graph; no wait here: the step is
        // counted at the next ubatch or when the cache is next looked at, by when the application's own wait
        // for the logits has brought it in (see moecache_device_ubatch_begin). An event where the copy lands
        // in the device's pinned memory, or where the device has none (RPC: its client writes the answer in
        // place); a device that copies into pageable memory only when it synchronizes (Vulkan) is waited for
        // whole. NULL where the device has no events
        const size_t bytes = (size_t) d.n_calls * d.n_in[g] * device_layout(mc, T, d.align[g]).off[N_FIELDS];
        ggml_backend_t b = sched_backend(sched, d.devs[g]);
        d.read_backends[g] = b;
        if (!b) { // (no backend of the scheduler runs the device: the graph has run, read it plainly)
            ggml_backend_tensor_get(d.stage[g], d.host[g], 0, bytes);
            mc.rst.device_reads += 1;
            continue;
        }
        if (!d.events[g] && (d.host_bufs[g] || !ggml_backend_dev_host_buffer_type(d.devs[g]))) {
            d.events[g] = ggml_backend_event_new(d.devs[g]);
        }
        ggml_backend_tensor_get_async(b, d.stage[g], d.host[g], 0, bytes);
        if (d.events[g]) {
            ggml_backend_event_record(d.events[g], b);
        }
        mc.rst.device_reads += 1;
    }
    d.n_read = T;
}
