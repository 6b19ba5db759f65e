// moecache-unified.cpp - unified memory (cache params `unified`): the device that computes a
// layer's dense part also computes its routed experts, in place on the host slot arena.
//
// A GPU that shares the host's memory (an integrated GPU, Apple silicon) can read the slots where
// the reader threads put them. ggml's buffer_from_host_ptr wraps each expert tensor's region of the
// arena (page-aligned, a whole number of pages: moecache-slots.cpp) as a buffer of that device; the
// layer's expert matmuls then run there on those buffers. Nothing is copied: the host cache, its
// routing, hits, misses and reads are those of the CPU run; only where the matmuls run changes.
//
// Decode graph of one layer computed in place (n_tokens = 1, K selected):
//   slots = moecache_experts(ids)               // CPU: I32 [K, 1] slot ids, the reads queued
//   ready = moecache_ready(slots)               // CPU: the same ids once every read is in
//   up    = mul_mat_id(device view of up slots, x, ready)   // on the device, as gate and down
// A prompt with every expert of the layer in a slot runs the same matmuls on `slots`; any other
// prompt keeps llama.cpp's op on the model's mapping.
//
// The device sees the bytes the CPU wrote before the graph reached the matmul: the wrapped memory
// is host-coherent (Vulkan imports it HOST_COHERENT; Metal's shared storage is the same memory).

#include "moecache-impl.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-backend-impl.h" // whether a device implements buffer_from_host_ptr at all
#include "llama-impl.h"        // LLAMA_LOG_INFO

#include <string>

// the device of layer il's dense part (its router weight's buffer), nullptr for the CPU
static ggml_backend_dev_t layer_device(const llama_model * model, int32_t il) {
    ggml_backend_buffer_type_t buft = moecache_layer_buft(model, il);
    ggml_backend_dev_t dev = buft ? ggml_backend_buft_get_device(buft) : nullptr;
    return dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU ? dev : nullptr;
}

// AUTO: the device shares the host's memory: an integrated GPU, or a backend that maps host memory
// as its own way of holding model files (Metal; ggml says so in the device's caps)
static bool shares_host_memory(ggml_backend_dev_t dev) {
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    return props.type == GGML_BACKEND_DEVICE_TYPE_IGPU || props.caps.buffer_from_host_ptr;
}

int32_t moecache_unified_plan(moecache & mc, const llama_model * model) {
    const moecache_unified mode = mc.cparams.unified;
    for (moecache_layer & L : mc.layers) {
        L.uni.dev    = nullptr;
        L.uni.direct = false;
        if (mc.cparams.residency != MOECACHE_RESIDENCY_STREAM || mode == MOECACHE_UNIFIED_OFF || L.res.xt.empty()) {
            continue;
        }
        ggml_backend_dev_t dev = layer_device(model, L.il);
        if (!dev) {
            continue;
        }
        const bool can = dev->iface.buffer_from_host_ptr != nullptr;
        if (mode == MOECACHE_UNIFIED_ON && !can) {
            return moecache_fail_residency(std::string("unified = on: device ") + ggml_backend_dev_name(dev) +
                                           " (layer " + std::to_string(L.il) + ") cannot wrap host memory as a "
                                           "buffer; use unified = auto or off");
        }
        // the direct tier (moecache-vram-direct.cpp): a tier beside the wrapped slots of a layer that caches every
        // expert; AUTO takes it on a discrete GPU, where a trial then decides between it and the tier's round trip
        const bool shares = shares_host_memory(dev);
        const bool direct = mc.cparams.n_vram > 0 && !mc.cparams.vram_exclusive && L.capacity >= mc.n_expert &&
                            (mode == MOECACHE_UNIFIED_ON || !shares);
        if (can && (mode == MOECACHE_UNIFIED_ON || shares || direct)) {
            L.uni.dev    = dev;
            L.uni.direct = direct;
        }
    }
    return MOECACHE_OK;
}

static void free_layer(moecache_layer & L) {
    for (ggml_backend_buffer_t buf : L.uni.buf) {
        ggml_backend_buffer_free(buf);
    }
    if (L.uni.ctx) {
        ggml_free(L.uni.ctx);
    }
    L.uni = moecache_layer_unified();
}

int32_t moecache_unified_init(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        if (!L.uni.dev) {
            continue;
        }
        struct ggml_init_params ip = { (L.res.xt.size() + 1) * ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
        L.uni.ctx = ggml_init(ip);
        for (const moecache_expert_tensor & x : L.res.xt) {
            // the tensor's region of the arena: from its page-aligned start to the end of its pages
            char * base = (char *) x.slots_t->data - x.slot_head;
            const size_t size = moecache_round_up((size_t) L.res.slot_expert.size() * x.slot_nb2, moecache_page_size());
            ggml_backend_buffer_t buf = ggml_backend_dev_buffer_from_host_ptr(L.uni.dev, base, size, size);
            if (!buf) {
                const std::string why = std::string("device ") + ggml_backend_dev_name(L.uni.dev) + " did not wrap the " +
                                        std::to_string(size >> 10) + " KiB of host slots of " + x.model_t->name;
                if (mc.cparams.unified == MOECACHE_UNIFIED_ON) {
                    return moecache_fail_residency("unified = on: " + why);
                }
                LLAMA_LOG_INFO("moecache: %s: layer %d's experts stay on the CPU\n", why.c_str(), L.il);
                free_layer(L);
                break;
            }
            ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS); // (its matmuls run there)
            L.uni.buf.push_back(buf);
            ggml_tensor * v = ggml_dup_tensor(L.uni.ctx, x.slots_t);
            ggml_format_name(v, "moecache.%s.unified", x.model_t->name);
            v->nb[2] = x.slots_t->nb[2];
            v->nb[3] = x.slots_t->nb[3];
            void * addr = (char *) ggml_backend_buffer_get_base(buf) + x.slot_head; // (a device's own addresses)
            if (ggml_backend_tensor_alloc(buf, v, addr) != GGML_STATUS_SUCCESS) {
                return moecache_fail_residency(std::string("cannot place the wrapped slots of ") + x.model_t->name);
            }
            L.uni.t.push_back(v);
            if (!ggml_backend_dev_supports_op(L.uni.dev, v)) { // (a tensor past its largest storage buffer: Vulkan)
                const std::string why = std::string("device ") + ggml_backend_dev_name(L.uni.dev) + " cannot compute on " +
                                        std::to_string(ggml_nbytes(v) >> 20) + " MiB of host slots of " +
                                        x.model_t->name + " as one tensor";
                if (mc.cparams.unified == MOECACHE_UNIFIED_ON) {
                    return moecache_fail_residency("unified = on: " + why + "; use unified = auto or off");
                }
                LLAMA_LOG_INFO("moecache: %s: layer %d's experts stay on the CPU\n", why.c_str(), L.il);
                free_layer(L);
                break;
            }
        }
    }
    return MOECACHE_OK;
}

void moecache_unified_free(moecache & mc) {
    for (moecache_layer & L : mc.layers) {
        free_layer(L);
    }
}

int64_t moecache_unified_bytes(const moecache & mc, int32_t * n_layers) {
    int64_t bytes = 0;
    int32_t n     = 0;
    for (const moecache_layer & L : mc.layers) {
        for (ggml_backend_buffer_t buf : L.uni.buf) {
            bytes += (int64_t) ggml_backend_buffer_get_size(buf);
        }
        n += L.uni.t.empty() ? 0 : 1;
    }
    if (n_layers) {
        *n_layers = n;
    }
    return bytes;
}

ggml_tensor * moecache_unified_mul_mat_id(moecache_layer & L, ggml_context * ctx, const moecache_expert_tensor & x,
                                          ggml_tensor * b, ggml_tensor * ids) {
    for (size_t j = 0; j < L.uni.t.size(); j++) {
        if (L.res.xt[j].model_t == x.model_t) {
            ggml_tensor * out = ggml_mul_mat_id(ctx, L.uni.t[j], b, ids); // where its weights are: the device
            ggml_format_name(out, "moecache_unified_mm-%d", L.il);
            return out;
        }
    }
    return nullptr;
}
