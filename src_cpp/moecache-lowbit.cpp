// moecache-lowbit.cpp - low-bit misses (cache params lowbit; HOBBIT, EdgeMoE): a decoded token's
// expert computed from its copy in a low-bit companion GGUF instead of waiting for its full copy.
//
// The companion (`pymoecache lowbit`) holds every routed expert tensor of the model under the same
// name and shape, at a smaller type. Each MoE layer gets a pool of K slots per expert tensor, and a
// zero slot, in host memory. For a decoded token, after the slots have chosen what to read
// (moecache_slots_decode), moecache_lowbit_decode picks the selections to compute from the
// companion (MISS: those whose full read starts now, at the lowest prefetch priority, behind the
// token, and in the next MOECACHE_LOWBIT_HOLD tokens, whose full reads are not waited for; ALL:
// every one), reads their copies into the pool and points their full-side slot id at
// the zero slot. With lowbit_in_ram the pool holds every expert's copy (slot e = expert e), read once at
// init, and a token reads nothing from the companion. The graph of each expert matmul of the layer then sums both sides:
//   full = the stream path on the slots (moecache-matmul.cpp): 0 for the pool's selections
//   ids  = moecache_lowbit_ids(slots)          // I32 [K, 1]: pool slot, or n (its zero slot)
//   low  = mul_mat_id(pool, b, ids)             // 0 for the full side's selections
//   out  = full + low                           // one side is exactly 0 for every selection
// so each selection is computed by ggml's own mul_mat_id on exactly one copy; the activation
// between up/gate and down is computed from those sums. Prompts do not use the pool.

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

void moecache_lowbit_plan(moecache & mc) {
    const bool on = (mc.cparams.lowbit == MOECACHE_LOWBIT_MISS || mc.cparams.lowbit == MOECACHE_LOWBIT_ALL) &&
                    mc.cparams.residency == MOECACHE_RESIDENCY_STREAM;
    for (moecache_layer & L : mc.layers) {
        L.low.n = on && !L.res.xt.empty() ? (mc.cparams.lowbit_in_ram ? mc.n_expert : mc.n_expert_used) : 0;
    }
}

static void copy_jobs(const moecache_layer & L, int32_t e, int32_t j, std::vector<moecache_io_job> & jobs);
static int64_t read_copies(moecache & mc, moecache_layer & L, std::vector<moecache_io_job> & jobs);

static int32_t fail(const std::string & msg) {
    return moecache_fail_residency("low-bit companion: " + msg);
}

// the companion's copy of model tensor t (id in g): its type, offset and bytes per expert in L.low;
// "" or what is wrong with it
static std::string check_tensor(const gguf_context * g, const std::string & path, uint64_t data, uint64_t size,
                                const moecache_expert_tensor & x, moecache_layer_lowbit & low) {
    const ggml_tensor * t = x.model_t;
    const int64_t id = gguf_find_tensor(g, t->name);
    if (id < 0) {
        return "'" + path + "' has no tensor " + t->name + ": not a companion of this model";
    }
    const ggml_type type = gguf_get_tensor_type(g, id);
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_type_size(type) == 0 || t->ne[0] % ggml_blck_size(type)) {
        return std::string("tensor ") + t->name + " has a type that does not fit rows of " + std::to_string(t->ne[0]);
    }
    const size_t nb2 = ggml_row_size(type, t->ne[0]) * (size_t) t->ne[1];
    if (gguf_get_tensor_size(g, id) != nb2 * (size_t) t->ne[2]) {
        return std::string("tensor ") + t->name + " is not of the model's shape";
    }
    if (nb2 >= x.nb2) {
        return std::string("tensor ") + t->name + " is " + ggml_type_name(type) + ", not smaller than the model's " +
               ggml_type_name(t->type);
    }
    const uint64_t off = data + gguf_get_tensor_offset(g, id);
    if (size < off + nb2 * (uint64_t) t->ne[2]) {
        return "'" + path + "' is truncated (tensor " + t->name + " lies past its end)";
    }
    low.type.push_back(type);
    low.off.push_back(off);
    low.nb2.push_back(nb2);
    return "";
}

int32_t moecache_lowbit_open(moecache & mc) {
    const moecache_cache_params & cp = mc.cparams;
    if (cp.lowbit == MOECACHE_LOWBIT_OFF) {
        return MOECACHE_OK;
    }
    if (cp.lowbit < MOECACHE_LOWBIT_MISS || cp.lowbit > MOECACHE_LOWBIT_SOURCE) {
        return fail("unknown lowbit mode " + std::to_string((int) cp.lowbit));
    }
    if (!(cp.lowbit_max_p > 0.0f && cp.lowbit_max_p <= 1.0f)) {
        return fail("lowbit_max_p = " + std::to_string(cp.lowbit_max_p) + " must be in (0, 1]");
    }
    if (cp.lowbit == MOECACHE_LOWBIT_SOURCE && cp.lowbit_in_ram) {
        return fail("lowbit_in_ram keeps copies beside the cache; with SOURCE the cache holds them (size it instead)");
    }
    if (cp.residency != MOECACHE_RESIDENCY_STREAM) {
        return fail("lowbit needs stream residency (it computes a streamed miss from the companion)");
    }
    if (!cp.lowbit_path || !cp.lowbit_path[0]) {
        return fail("lowbit is on but lowbit_path names no file (make one with `pymoecache lowbit MODEL`)");
    }
    for (const moecache_layer & L : mc.layers) {
        if ((L.vram.n > 0 || L.uni.dev) && cp.lowbit != MOECACHE_LOWBIT_SOURCE) {
            return fail("a low-bit pool beside a VRAM tier or unified memory is not supported (lowbit SOURCE is: the "
                        "slots and the device's copies hold the companion's experts)");
        }
    }
    const std::string path = cp.lowbit_path;
    struct gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    struct gguf_context * g = gguf_init_from_file(path.c_str(), gp);
    if (!g) {
        return fail("'" + path + "' cannot be read as a GGUF file (missing, truncated or damaged)");
    }
    struct stat st;
    mc.res.fd_lowbit = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (mc.res.fd_lowbit < 0 || fstat(mc.res.fd_lowbit, &st) != 0) {
        const std::string why = strerror(errno);
        gguf_free(g);
        return fail("cannot open '" + path + "': " + why);
    }
#if defined(O_DIRECT)
    if (cp.direct_io) { // (as the model's reads: the pool is the only copy; none where the file system has none)
        mc.res.fd_lowbit_direct = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    }
#endif
    mc.res.io->aux_fd        = mc.res.fd_lowbit; // the reader threads read the copies
    mc.res.io->aux_fd_direct = mc.res.fd_lowbit_direct;
    const uint64_t data = gguf_get_data_offset(g);
    std::string err;
    for (moecache_layer & L : mc.layers) {
        for (size_t k = 0; k < L.res.xt.size() && err.empty(); k++) {
            err = check_tensor(g, path, data, (uint64_t) st.st_size, L.res.xt[k], L.low);
        }
    }
    gguf_free(g);
    if (!err.empty()) {
        return fail(err);
    }
    if (cp.lowbit != MOECACHE_LOWBIT_SOURCE) {
        return MOECACHE_OK;
    }
    // SOURCE: every slot read is from the companion, and the cache holds as many copies as fit in
    // the bytes of the experts asked for
    mc.res.io->fd        = mc.res.fd_lowbit;
    mc.res.io->fd_direct = mc.res.fd_lowbit_direct;
    mc.res.src_path      = path;
    for (moecache_layer & L : mc.layers) {
        if (L.res.xt.empty()) {
            continue;
        }
        for (size_t k = 0; k < L.res.xt.size(); k++) {
            moecache_expert_tensor & x = L.res.xt[k];
            x.src_type = L.low.type[k];
            x.src_off  = L.low.off[k];
            x.src_nb2  = L.low.nb2[k];
        }
        const double  ratio = (double) L.res.expert_bytes / (double) moecache_slot_bytes(L);
        const int64_t fit   = (int64_t) ((double) L.capacity * ratio);
        L.capacity = (int32_t) std::min<int64_t>(mc.n_expert, std::max<int64_t>(fit, L.capacity));
        if (L.vram.n > 0) { // the VRAM tier too: as many copies as fit in the device bytes of n_vram experts
            const int64_t fit_vram = (int64_t) ((double) L.vram.n * ratio);
            L.vram.n = (int32_t) std::min<int64_t>(mc.n_expert, std::max<int64_t>(fit_vram, L.vram.n));
        }
    }
    return MOECACHE_OK;
}

int32_t moecache_lowbit_init(moecache & mc) {
    const moecache_cache_params & cp = mc.cparams;
    int32_t rc = MOECACHE_OK;
    for (moecache_layer & L : mc.layers) {
        if (L.low.n == 0 || rc != MOECACHE_OK) {
            continue;
        }
        struct ggml_init_params ip = { (L.res.xt.size() + 1) * ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
        L.low.ctx = ggml_init(ip);
        for (size_t k = 0; k < L.res.xt.size(); k++) {
            const ggml_tensor * t = L.res.xt[k].model_t;
            ggml_tensor * v = ggml_new_tensor_3d(L.low.ctx, L.low.type[k], t->ne[0], t->ne[1], L.low.n + 1);
            ggml_format_name(v, "moecache.%s.lowbit", t->name);
            L.low.t.push_back(v);
        }
        L.low.buf = ggml_backend_alloc_ctx_tensors_from_buft(L.low.ctx, ggml_backend_cpu_buffer_type());
        if (!L.low.buf) {
            rc = fail("out of memory for the pool of layer " + std::to_string(L.il));
            break;
        }
        ggml_backend_buffer_clear(L.low.buf, 0); // (the zero slot: a block of zero bytes is 0 in every type)
        L.low.fresh.assign(mc.n_expert, 0);
        L.low.hold.assign(mc.n_expert, -1);
        if (cp.lowbit_in_ram) { // slot e = expert e, read once
            std::vector<moecache_io_job> jobs;
            for (int32_t e = 0; e < mc.n_expert; e++) {
                copy_jobs(L, e, e, jobs);
            }
            if (read_copies(mc, L, jobs) < 0) {
                rc = fail(mc.io_error); // (set by read_copies; init runs on one thread)
                break;
            }
        }
    }
    return rc;
}

void moecache_lowbit_free(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        if (L.low.buf) {
            ggml_backend_buffer_free(L.low.buf);
        }
        if (L.low.ctx) {
            ggml_free(L.low.ctx);
        }
        L.low = moecache_layer_lowbit();
    }
    if (mc.res.fd_lowbit >= 0) {
        close(mc.res.fd_lowbit);
        mc.res.fd_lowbit = -1;
    }
    if (mc.res.fd_lowbit_direct >= 0) {
        close(mc.res.fd_lowbit_direct);
        mc.res.fd_lowbit_direct = -1;
    }
}

int64_t moecache_lowbit_bytes(const moecache & mc) {
    int64_t bytes = 0;
    for (const moecache_layer & L : mc.layers) {
        bytes += L.low.buf ? (int64_t) ggml_backend_buffer_get_size(L.low.buf) : 0;
    }
    return bytes;
}

// the reads of expert e's companion copy into pool slot j of every expert tensor of L
static void copy_jobs(const moecache_layer & L, int32_t e, int32_t j, std::vector<moecache_io_job> & jobs) {
    for (size_t k = 0; k < L.low.t.size(); k++) {
        moecache_io_job job = {};
        job.kind = MOECACHE_IO_READ;
        job.aux  = true;
        job.dst  = (char *) L.low.t[k]->data + (size_t) j * L.low.t[k]->nb[2];
        job.off  = L.low.off[k] + (uint64_t) e * L.low.nb2[k];
        job.len  = L.low.nb2[k];
        job.il   = L.il;
        job.e    = e;
        jobs.push_back(job);
    }
}

// runs the reads on the reader threads, ahead of every other read, and waits for them: the bytes
// read, or -1 after a failed read (the decode is stopped with the error)
static int64_t read_copies(moecache & mc, moecache_layer & L, std::vector<moecache_io_job> & jobs) {
    moecache_io_run(*mc.res.io, jobs);
    int64_t bytes = 0;
    for (const moecache_io_job & j : jobs) {
        if (j.err != 0 || j.got != j.len) {
            moecache_set_io_error(mc, "reading the low-bit copy of expert " + std::to_string(j.e) + " of layer " +
                                  std::to_string(L.il) + " failed: " +
                                  (j.err > 0 ? strerror(j.err) : "the companion ends early (truncated?)"));
            return -1;
        }
        bytes += (int64_t) j.len;
    }
    return bytes;
}

void moecache_lowbit_decode(moecache & mc, moecache_layer & L, const int32_t * ids, int32_t * out, int64_t n_ids) {
    const bool all = mc.cparams.lowbit == MOECACHE_LOWBIT_ALL;
    std::vector<moecache_io_job> & jobs = L.low.jobs;
    jobs.clear();
    int32_t j = 0;
    for (int64_t i = 0; i < n_ids && i < MOECACHE_MAX_USED; i++) {
        L.low.tok_slot[i] = L.low.n;
        const int32_t e = ids[i];
        if (!(all || L.low.fresh[e]) || j >= L.low.n || mc.io_failed.load()) {
            continue;
        }
        mc.rst.lowbit_loads  += 1;
        mc.rst.lowbit_behind += !all && L.low.fresh[e] == 1; // (2: its full read went behind an earlier token)
        out[i] = L.res.n_slots; // the zero slot: the full side adds 0
        if (mc.cparams.lowbit_in_ram) { // in memory already: nothing to read
            L.low.tok_slot[i] = e;
            continue;
        }
        copy_jobs(L, e, j, jobs);
        L.low.tok_slot[i] = j++;
    }
    const int64_t bytes = read_copies(mc, L, jobs); // (all of the layer's at once, in parallel)
    mc.rst.lowbit_bytes_read += bytes > 0 ? bytes : 0;
}

// dst: I32 [K, 1] = the pool slot of each selection of the decoded token (n: its zero slot); src[0]:
// the residency op's output, so that this runs after it chose them
static void op_lowbit_ids(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const moecache_layer & L = *(const moecache_layer *) userdata;
    int32_t * o = (int32_t *) dst->data;
    for (int64_t i = 0; i < ggml_nelements(dst); i++) {
        o[i] = i < MOECACHE_MAX_USED ? L.low.tok_slot[i] : L.low.n;
    }
}

#ifndef MOECACHE_NO_CPU_TRAITS
// dst: F32 [ne01, K, 1] = the pool's matmul for the selections computed from the companion, 0 for the
// others: what mul_mat_id(pool, b, ids) gives (moecache_matmul_rows), without computing the zero
// slot. src[0]: pool slots I32 [K, 1]; src[1]: b F32 [ne00, ne11, 1]; src[2]: the pool [ne00, ne01, n + 1]
static void op_lowbit_matmul(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const moecache_layer & L = *(const moecache_layer *) userdata;
    const int32_t * ids = (const int32_t *) dst->src[0]->data;
    int32_t slot[MOECACHE_MAX_USED];
    for (int64_t i = 0; i < dst->ne[1] && i < MOECACHE_MAX_USED; i++) {
        slot[i] = ids[i] >= 0 && ids[i] < L.low.n ? ids[i] : -1; // -1: computed from the full copy, 0 here
    }
    moecache_matmul_rows(dst, ith, nth, slot);
}
#endif

ggml_tensor * moecache_lowbit_mul_mat_id(moecache_layer & L, ggml_context * ctx, const moecache_expert_tensor & x,
                                         ggml_tensor * b, ggml_tensor * full) {
    if (L.low.n == 0 || !full) {
        return full;
    }
    size_t k = 0;
    while (k < L.res.xt.size() && L.res.xt[k].model_t != x.model_t) {
        k++;
    }
    if (k == L.res.xt.size()) {
        return full;
    }
    if (!L.graph.low_ids) {
        ggml_tensor * src = L.graph.ids_out;
        L.graph.low_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, src->ne[0], src->ne[1], 1, 1, &src, 1, op_lowbit_ids, 1, &L);
        ggml_format_name(moecache_graph_on_cpu(L.graph.low_ids), "moecache_lowbit_ids-%d", L.il);
    }
    ggml_tensor * low = nullptr;
#ifndef MOECACHE_NO_CPU_TRAITS
    if (moecache_matmul_cpu_vec_dot(L.low.t[k], b) && b->ne[2] == 1 && L.graph.low_ids->ne[1] == 1 &&
        L.graph.low_ids->ne[0] <= MOECACHE_MAX_USED) {
        ggml_tensor * args[3] = { L.graph.low_ids, b, L.low.t[k] }; // (only the pool's selections are computed)
        low = ggml_custom_4d(ctx, GGML_TYPE_F32, L.low.t[k]->ne[1], L.graph.low_ids->ne[0], 1, 1, args, 3,
                             op_lowbit_matmul, GGML_N_TASKS_MAX, &L);
    }
#endif
    low = low ? low : ggml_mul_mat_id(ctx, L.low.t[k], b, L.graph.low_ids);
    ggml_format_name(low, "moecache_lowbit-%d", L.il);
    return ggml_add(ctx, full, low);
}
