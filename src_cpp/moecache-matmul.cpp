// moecache-matmul.cpp - STREAM decode: a layer's expert matmuls take each selected expert as soon
// as its bytes are in its slot. The cached experts compute while the misses are still being read,
// and a miss waits only for its own bytes (cache params overlap_experts).
//
// llama.cpp's MoE FFN is up = mul_mat_id(up_exps, x), gate = mul_mat_id(gate_exps, x) (or one
// gate_up), an activation, then down = mul_mat_id(down_exps, act). The matmuls on x (the
// "input side") need nothing but the experts' bytes, so one op computes all of them, expert by
// expert in the order the reads finish; the graph gets a view of that op's output per tensor.
// The down matmul stays llama.cpp's own, behind an op that waits for every selected expert (all
// are in by then) and reports a failed read.
//
// Each output row is one call of ggml's vec_dot on the same quantized activations, exactly as
// ggml_compute_forward_mul_mat_id computes it, so the logits are those of the stock op, bit for bit.
//
// Decode graph of one layer (n_tokens = 1, K selected):
//   ids      = moecache_select                    // I32 [K, 1] expert ids
//   slots    = moecache_experts(ids)              // I32 [K, 1] slot ids; queues the reads, returns
//   arrival  = moecache_arrival(slots, x, up_slots, gate_slots)  // F32 [n_ff*K + n_ff*K]
//   up, gate = views of arrival                   // [n_ff, K, 1] each
//   ready    = moecache_ready(slots, arrival)     // I32 [K, 1] slot ids, every read waited for
//   down     = mul_mat_id(down_slots, act, ready) // llama.cpp's op; with a zero slot (low-bit misses,
//                                                 // VRAM tier) moecache_down, which skips it

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-cpu.h"

#include <cstring>
#include <string>
#include <vector>

#ifndef MOECACHE_NO_CPU_TRAITS
// the tensors of a layer the arrival op computes: every expert tensor but down whose rows are as
// long as the activations x
static bool input_side(const moecache_expert_tensor & x, const ggml_tensor * b) {
    return strstr(ggml_get_name(x.model_t), "down") == nullptr && x.slots_t->ne[0] == b->ne[0];
}
#endif

// what ggml's CPU backend computes mul_mat_id of these weights with; false where it has no vec_dot
// for them (the stock op runs then)
bool moecache_matmul_cpu_vec_dot(const ggml_tensor * w, const ggml_tensor * b) {
#ifdef MOECACHE_NO_CPU_TRAITS
    (void) w;
    (void) b;
    return false;
#else
    const ggml_type_traits_cpu * t = ggml_get_type_traits_cpu(w->type);
    if (!t || !t->vec_dot || b->type != GGML_TYPE_F32) {
        return false;
    }
    return t->vec_dot_type == GGML_TYPE_F32 || ggml_get_type_traits_cpu(t->vec_dot_type)->from_float != nullptr;
#endif
}

#ifndef MOECACHE_NO_CPU_TRAITS
// dst: F32 [ne01, K, 1] = w's rows in slot[i] times b's row i % ne11 for each selection i, with ggml's
// vec_dot on b converted to its vec_dot type, as mul_mat_id computes a one-token matmul; 0 where
// slot[i] < 0 (nothing computed). src[1]: b F32 [ne00, ne11, 1]; src[2]: w [ne00, ne01, n]
void moecache_matmul_rows(ggml_tensor * dst, int ith, int nth, const int32_t * slot) {
    const ggml_tensor * b = dst->src[1];
    const ggml_tensor * w = dst->src[2];
    const int64_t K = dst->ne[1], ne00 = b->ne[0], ne11 = b->ne[1], ne01 = w->ne[1];
    const ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(w->type);
    const ggml_type vt  = tr->vec_dot_type;
    const size_t    row = vt == GGML_TYPE_F32 ? 0 : ggml_row_size(vt, ne00);
    thread_local std::vector<char> xq; // b in the vec_dot type, converted by every thread for itself
    if (xq.size() < row * (size_t) ne11) {
        xq.resize(row * (size_t) ne11);
    }
    for (int64_t r = 0; r < ne11 && vt != GGML_TYPE_F32; r++) {
        ggml_get_type_traits_cpu(vt)->from_float((const float *) ((const char *) b->data + r * b->nb[1]),
                                                 xq.data() + (size_t) r * row, ne00);
    }
    const int64_t r0 = ne01 * ith / nth;
    const int64_t r1 = ne01 * (ith + 1) / nth;
    for (int64_t i = 0; i < K; i++) {
        float * o = (float *) ((char *) dst->data + i * dst->nb[1]);
        if (slot[i] < 0) {
            memset(o + r0, 0, (size_t) (r1 - r0) * sizeof(float));
            continue;
        }
        const char * rows = (const char *) w->data + (size_t) slot[i] * w->nb[2];
        const char * xr   = vt == GGML_TYPE_F32 ? (const char *) b->data + (i % ne11) * b->nb[1]
                                                : xq.data() + (size_t) (i % ne11) * row;
        for (int64_t r = r0; r < r1; r++) {
            tr->vec_dot((int) ne00, &o[r], 0, rows + r * w->nb[1], 0, xr, 0, 1);
        }
    }
}

// dst: F32 [ne01, K, 1] = the down matmul of a layer with a zero slot (low-bit misses, VRAM tier): the
// stock op's numbers for the selections in the slots, 0 for those computed elsewhere, which are not
// computed here at all. src[0]: the ready op's slot ids I32 [K, 1] (every read waited for)
static void op_down(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const moecache_layer & L = *(const moecache_layer *) userdata;
    const int32_t * ready = (const int32_t *) dst->src[0]->data;
    int32_t slot[MOECACHE_MAX_USED];
    for (int64_t i = 0; i < dst->ne[1] && i < MOECACHE_MAX_USED; i++) {
        slot[i] = moecache_is_zero_slot(L, ready[i]) ? -1 : ready[i];
    }
    moecache_matmul_rows(dst, ith, nth, slot);
}
#endif

#define MOECACHE_SPIN_US 5000 // longest a thread polls for an expert's bytes before it sleeps

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield");
#endif
}

// a WAIT (for expert e) or EXPERT (e's matmuls) event of a decoded token on the graph thread
static void graph_event(moecache & mc, const moecache_layer & L, moecache_event_kind kind, int32_t e, int64_t t0,
                        int64_t t1) {
    moecache_graph_event(mc, kind, L.il, e, 1, t0, t0, t1);
}

#ifndef MOECACHE_NO_CPU_TRAITS
// dst: F32, for each src[2 + j] (a slot tensor [ne0, ne1_j, n_slots]) a block [ne1_j, K, n_tokens] of
// its rows times x, one block after the other. src[0]: slot ids I32 [K, n_tokens]; src[1]: x F32
// [ne0, ne11, n_tokens], row i % ne11 of token t for the i-th selection of t (ne11 = 1: the same x for
// all). A batch of sequences (n_tokens > 1) computes each slot once it arrived, for every token that
// selected it, row by row, so the rows are read once for all of them
static void op_arrival(ggml_tensor * dst, int ith, int nth, void * userdata) {
    moecache_layer & L  = *(moecache_layer *) userdata;
    moecache       & mc = *L.mc;
    const ggml_tensor * ids = dst->src[0];
    const ggml_tensor * b   = dst->src[1];
    const int64_t K    = ids->ne[0];
    const int64_t n_t  = ids->ne[1];
    const int64_t n_ik = K * n_t; // selections, token after token
    const int64_t ne00 = b->ne[0];
    const int64_t ne11 = b->ne[1];
    int32_t n_x = 0;
    while (n_x + 2 < GGML_MAX_SRC && dst->src[n_x + 2]) {
        n_x++;
    }
    auto slot_of = [&](int64_t ik) { // selection ik = t * K + i
        return *(const int32_t *) ((const char *) ids->data + (ik % K) * ids->nb[0] + (ik / K) * ids->nb[1]);
    };
    auto x_row = [&](int64_t ik) { // the row of x selection ik multiplies: (i % ne11, t)
        return (ik / K) * ne11 + (ik % K) % ne11;
    };

    // x in each tensor's vec_dot type, converted by every thread for itself (a few KiB per token)
    thread_local std::vector<char> xq;
    size_t xq_off[GGML_MAX_SRC] = {};
    size_t total = 0;
    for (int32_t j = 0; j < n_x; j++) {
        const ggml_type vt = ggml_get_type_traits_cpu(dst->src[j + 2]->type)->vec_dot_type;
        xq_off[j] = total;
        total += vt == GGML_TYPE_F32 ? 0 : ggml_row_size(vt, ne00) * (size_t) (ne11 * n_t);
    }
    if (xq.size() < total) {
        xq.resize(total);
    }
    for (int32_t j = 0; j < n_x; j++) {
        const ggml_type vt = ggml_get_type_traits_cpu(dst->src[j + 2]->type)->vec_dot_type;
        if (vt == GGML_TYPE_F32) {
            continue;
        }
        const ggml_from_float_t from_float = ggml_get_type_traits_cpu(vt)->from_float;
        for (int64_t r = 0; r < ne11 * n_t; r++) {
            from_float((const float *) ((const char *) b->data + (r % ne11) * b->nb[1] + (r / ne11) * b->nb[2]),
                       xq.data() + xq_off[j] + (size_t) r * ggml_row_size(vt, ne00), ne00);
        }
    }

    // each thread computes its share of every tensor's rows, expert by expert as they arrive; the
    // selections of one slot (several tokens of a batch) together
    thread_local std::vector<uint8_t> done;
    thread_local std::vector<int64_t> same;
    done.assign((size_t) n_ik, 0);
    same.resize((size_t) n_ik);
    int64_t left = n_ik;
    while (left > 0) {
        bool ran = false;
        for (int64_t ik = 0; ik < n_ik; ik++) {
            const int32_t slot = slot_of(ik);
            if (done[ik] || !moecache_io_idle(*mc.res.io, L.res.slot_req[slot])) {
                continue;
            }
            int64_t n_same = 0; // the selections of this slot, from ik on
            for (int64_t jk = ik; jk < n_ik; jk++) {
                if (!done[jk] && slot_of(jk) == slot) {
                    same[n_same++] = jk;
                }
            }
            const int64_t t0 = ith == 0 ? moecache_time_us() : 0;
            float * out = (float *) dst->data;
            const bool zero = moecache_is_zero_slot(L, slot); // computed on the device (VRAM tier): 0 here
            for (int32_t j = 0; j < n_x; j++) {
                const ggml_tensor * w  = dst->src[j + 2];
                const ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(w->type);
                const int64_t ne01 = w->ne[1];
                const int64_t r0 = ne01 * ith / nth;
                const int64_t r1 = ne01 * (ith + 1) / nth;
                const size_t  xr_size = tr->vec_dot_type == GGML_TYPE_F32 ? 0 : ggml_row_size(tr->vec_dot_type, ne00);
                const char * rows = (const char *) w->data + (size_t) slot * w->nb[2];
                for (int64_t m = 0; m < n_same && zero; m++) {
                    memset(out + same[m] * ne01 + r0, 0, (size_t) (r1 - r0) * sizeof(float));
                }
                for (int64_t r = r0; r < r1 && !zero; r++) {
                    for (int64_t m = 0; m < n_same; m++) {
                        const int64_t xrow = x_row(same[m]);
                        const char * xr = tr->vec_dot_type == GGML_TYPE_F32
                            ? (const char *) b->data + (xrow % ne11) * b->nb[1] + (xrow / ne11) * b->nb[2]
                            : xq.data() + xq_off[j] + (size_t) xrow * xr_size;
                        tr->vec_dot((int) ne00, out + same[m] * ne01 + r, 0, rows + r * w->nb[1], 0, xr, 0, 1);
                    }
                }
                out += ne01 * n_ik; // [ne01, K, n_tokens] block of this tensor
            }
            if (ith == 0 && !zero) {
                const int64_t t1 = moecache_time_us();
                graph_event(mc, L, MOECACHE_EVENT_EXPERT, L.res.slot_expert[slot], t0, t1);
                if (L.vram.n > 0) { // (VRAM tier, AUTO: what an expert costs the CPU; down is the other third)
                    const double us = 1.5 * (double) (t1 - t0);
                    mc.vram_cpu_us = mc.vram_cpu_us > 0.0 ? 0.9 * mc.vram_cpu_us + 0.1 * us : us;
                }
            }
            for (int64_t m = 0; m < n_same; m++) {
                done[same[m]] = 1;
            }
            left -= n_same;
            ran = true;
        }
        if (!ran) { // nothing has arrived: wait for the first one still out (its reads were queued first)
            int64_t ik = 0;
            while (done[ik]) {
                ik++;
            }
            // poll, as ggml's barrier does, for up to MOECACHE_SPIN_US: a thread asleep on the queue's
            // condition variable woke up to milliseconds after the read ended on a virtual machine,
            // whose idle CPUs the host parks; then sleep (a failed read: moecache_ready reports it)
            moecache_io_req & req = L.res.slot_req[slot_of(ik)];
            const int64_t t0 = moecache_time_us();
            if (ith == 0) {
                moecache_io_promote(*mc.res.io, req);
            }
            while (!moecache_io_idle(*mc.res.io, req)) {
                if (moecache_time_us() - t0 > MOECACHE_SPIN_US) {
                    moecache_io_wait(*mc.res.io, req);
                    break;
                }
                for (int k = 0; k < 256; k++) {
                    cpu_relax();
                }
            }
            if (ith == 0) {
                const int64_t t1 = moecache_time_us();
                mc.t_io_decode_us += t1 - t0;
                graph_event(mc, L, MOECACHE_EVENT_WAIT, L.res.slot_expert[slot_of(ik)], t0, t1);
            }
        }
    }
}
#endif

// dst: I32 [K, n_tokens] = src[0], the slot ids, once every one of them holds its expert; a failed
// read stops the decode (moecache_slots_wait). src[1], when set, is the arrival op (runs before).
static void op_ready(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    moecache_layer & L  = *(moecache_layer *) userdata;
    moecache       & mc = *L.mc;
    const int32_t * slots = (const int32_t *) dst->src[0]->data;
    const int64_t   n     = ggml_nelements(dst);
    for (int64_t i = 0; i < n; i++) {
        const int32_t e  = L.res.slot_expert[slots[i]];
        const int64_t t0 = moecache_time_us();
        const int64_t waited = moecache_slots_wait(mc, L, &slots[i], 1);
        if (waited > 0) {
            mc.t_io_decode_us += waited;
            graph_event(mc, L, MOECACHE_EVENT_WAIT, e, t0, moecache_time_us());
        }
    }
    memcpy(dst->data, slots, (size_t) n * sizeof(int32_t));
}

ggml_tensor * moecache_matmul_stream_decode(moecache & mc, moecache_layer & L, ggml_context * ctx,
                                            const moecache_expert_tensor & x, ggml_tensor * b) {
    ggml_tensor * slots = L.graph.ids_out;
    if (!mc.cparams.overlap_experts) {
        return ggml_mul_mat_id(ctx, x.slots_t, b, slots); // (the residency op waited for every read)
    }
#ifndef MOECACHE_NO_CPU_TRAITS
    if (input_side(x, b) && moecache_matmul_cpu_vec_dot(x.slots_t, b) && b->ne[2] == slots->ne[1] &&
        (!L.graph.arrival || L.graph.arrival->src[1] == b)) {
        if (!L.graph.arrival) { // the first input-side matmul of the layer: one op for all of them
            ggml_tensor * args[GGML_MAX_SRC] = { slots, b };
            int32_t n_args = 2;
            int64_t n_out  = 0;
            for (const moecache_expert_tensor & y : L.res.xt) {
                if (n_args < GGML_MAX_SRC && input_side(y, b) && moecache_matmul_cpu_vec_dot(y.slots_t, b)) {
                    args[n_args++] = y.slots_t;
                    n_out += y.slots_t->ne[1] * slots->ne[0] * slots->ne[1];
                }
            }
            L.graph.arrival = ggml_custom_4d(ctx, GGML_TYPE_F32, n_out, 1, 1, 1, args, n_args, op_arrival,
                                             GGML_N_TASKS_MAX, &L);
            ggml_format_name(moecache_graph_on_cpu(L.graph.arrival), "moecache_arrival-%d", L.il);
        }
        size_t off = 0;
        for (int32_t j = 2; j < GGML_MAX_SRC && L.graph.arrival->src[j]; j++) {
            const ggml_tensor * w = L.graph.arrival->src[j];
            if (w == x.slots_t) {
                const int64_t K = slots->ne[0];
                return ggml_view_3d(ctx, L.graph.arrival, w->ne[1], K, slots->ne[1], w->ne[1] * sizeof(float),
                                    w->ne[1] * K * sizeof(float), off);
            }
            off += (size_t) (w->ne[1] * slots->ne[0] * slots->ne[1]) * sizeof(float);
        }
    }
    if ((L.low.n > 0 || L.vram.n > 0) && moecache_matmul_cpu_vec_dot(x.slots_t, b) && slots->ne[1] == 1 &&
        b->ne[2] == 1 && slots->ne[0] <= MOECACHE_MAX_USED) { // down without computing the zero slot
        ggml_tensor * args[3] = { moecache_matmul_ready(L, ctx), b, x.slots_t };
        ggml_tensor * down = ggml_custom_4d(ctx, GGML_TYPE_F32, x.slots_t->ne[1], slots->ne[0], 1, 1, args, 3,
                                            op_down, GGML_N_TASKS_MAX, &L);
        ggml_format_name(moecache_graph_on_cpu(down), "moecache_down-%d", L.il);
        return down;
    }
#endif
    return ggml_mul_mat_id(ctx, x.slots_t, b, moecache_matmul_ready(L, ctx)); // down, or one arrival does not cover
}

ggml_tensor * moecache_matmul_ready(moecache_layer & L, ggml_context * ctx) {
    if (!L.graph.ready) { // after every read (and after the arrival op, where there is one)
        ggml_tensor * slots   = L.graph.ids_out;
        ggml_tensor * args[2] = { slots, L.graph.arrival };
        L.graph.ready = ggml_custom_4d(ctx, GGML_TYPE_I32, slots->ne[0], slots->ne[1], 1, 1, args,
                                       L.graph.arrival ? 2 : 1, op_ready, 1, &L);
        ggml_format_name(moecache_graph_on_cpu(L.graph.ready), "moecache_ready-%d", L.il);
    }
    return L.graph.ready;
}
