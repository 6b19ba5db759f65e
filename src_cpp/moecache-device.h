// moecache-device.h - the device path where the cache only counts (moecache-device.cpp): its staging
// (moecache_device, held by struct moecache) and the calls the graph and the API make. Not installed.
#pragma once

#include "moecache-layer.h"

struct moecache;

// the device path where the cache only counts (moecache-device.cpp): per MoE layer its fields in a
// persistent buffer on its router's device (the staging), where the graph computes what the counting
// reads; one read per device after each decode step's graph
// the most tokens of a decode step (one per sequence) the staging has room for
#define MOECACHE_DEVICE_MAX_STEP 32
// the most routings of a layer per token it has room for (grovemoe routes twice)
#define MOECACHE_DEVICE_CALLS 2

struct moecache_device {
    bool ready  = false;                           // the buffers below exist
    bool failed = false;                           // they could not be had: the CPU op routes
    ggml_context * ctx = nullptr;                  // the tensors' metadata (no data of its own)
    std::vector<ggml_backend_dev_t>    devs;       // [n_groups] the devices holding MoE layers' routers
    std::vector<ggml_backend_buffer_t> bufs;       // [n_groups] one buffer each
    std::vector<int32_t>               n_in;       // [n_groups] the MoE layers it holds
    std::vector<size_t>                align;      // [n_groups] its buffer type's alignment (each field's)
    std::vector<ggml_tensor *>         stage;      // [n_groups] I32: the staging, the device's layers' fields
                                                   //   for a step of up to MOECACHE_DEVICE_MAX_STEP tokens
    std::vector<ggml_tensor *>         stage_f32;  // [n_groups] the same memory as F32 (copies of floats)
    std::vector<ggml_tensor *>         bias;       // [n_groups] F32 [n_layers there * (N + K)]: the prior on the
                                                   //   device, per layer the boost of each expert (0 or b) and K b's
    std::vector<std::vector<float>>    bias_host;  // [n_groups] what was uploaded to it last
    std::vector<char *>                host;       // [n_groups] where the counting reads the staging: the staging
                                                   //   itself where it is host memory (the CPU), else pinned memory
                                                   //   where the device has a host buffer type (an asynchronous
                                                   //   read lands there directly), else host_vec
    std::vector<ggml_backend_buffer_t> host_bufs;  // [n_groups] that pinned memory, or NULL
    std::vector<std::vector<char>>     host_vec;   // [n_groups] plain memory where there is none
    std::vector<int32_t>       layer_group;        // [n_layer] the layer's device, -1 = none
    std::vector<int32_t>       layer_slot;         // [n_layer] its fields' place among that device's layers in
                                                   //   the staging (a second routing's: after every first one)
    bool routes_twice = false;                     // a layer routed twice a token in a graph seen (the prior
                                                   //   then stays with the op)
    // the graph built last (moecache_device_graph_begin resets them); [n_layer * MOECACHE_DEVICE_CALLS]: per
    // routing of a layer
    std::vector<int32_t> calls;                    // [n_layer] the layer's routings in this graph
    std::vector<int32_t> deferred;                 // [n_layer] of those, counted after the graph (the first ones)
    std::vector<uint8_t> p_from;                   // [.. * CALLS] the field its probabilities are read from (p; z
                                                   //   where they are the logits, gpt-oss's)
    std::vector<uint8_t> s_from;                   // [.. * CALLS] the field its selection score is read from (s; p
                                                   //   where it is p)
    std::vector<uint8_t> prior;                    // [n_layer] routed by the prior on the device (else top-k)
    int32_t n_deferred = 0;
    int32_t n_calls    = 0;                        // the most routings of one layer counted after the graph
    int32_t n_prior    = 0;                        // layers routed by the prior on the device (boosts per token)
    int32_t step_n     = 1;                        // tokens of a step (one per sequence of a batch)
    std::vector<ggml_tensor *> pending;            // the counting's own ops (the gating's copy), put into the
                                                   //   graph after llama.cpp's routing ops (moecache_device_expand)
    // the step in the staging, counted by moecache_device_flush or at the next ubatch
    std::mutex                         mutex;      // the reads and their counting (stats may be read from another thread)
    int32_t                            n_read = 0; // tokens of the step whose read is queued, not yet counted
    std::vector<ggml_backend_event_t>  events;     // [n_groups] marks that read's end on its device (NULL: none)
    std::vector<ggml_backend_t>        read_backends;
    struct moecache_routing_params     read_rp = {}; // the routing of the step's tokens
};

// moecache-device.cpp: a decoded token routed on its device (llama.cpp's top-k, or the prior as ggml
// ops), counted after the graph. Returns the layer's selected experts, or nullptr where the CPU op routes.
ggml_tensor * moecache_device_defer(moecache & mc, ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * selected,
                                    ggml_tensor * logits, ggml_tensor * probs, ggml_tensor * selection);
void moecache_device_graph_begin(moecache & mc);
// the copies moecache_device_defer made, into gf: after llama.cpp has put the layer's routing ops there
// (its first expert matmul), so that they stay together as a device fuses them; the rest at the graph's end
void moecache_device_expand(moecache & mc, ggml_cgraph * gf);
void moecache_device_ubatch_begin(moecache & mc); // before a ubatch computes: the token before counted, the prior's boosts
void moecache_device_ubatch_computed(moecache & mc, ggml_backend_sched_t sched);
void moecache_device_free(moecache & mc);
void moecache_device_flush(moecache & mc);  // count a read still pending (each API entry reading or changing the cache)

// moecache-device-route.cpp: the prior on the device. boosts: layer il's for its next token, into the host
// copy of its device's bias (b for each expert the prior's mask holds, then K copies of b for Top-J); upload:
// every such layer's, before a token computes; select: the prior as ggml ops on the router's outputs (the
// layer's selected experts in r order, nullptr where the device lacks an op); regate: the router's output t
// computed again from the logits by the same gating ops, `from` replaced by `to` (nullptr: another chain)
void          moecache_device_prior_boosts(moecache & mc, int il);
void          moecache_device_prior_upload(moecache & mc);
ggml_tensor * moecache_device_prior_select(moecache & mc, ggml_context * ctx, int il, ggml_tensor * selected,
                                           ggml_tensor * logits, ggml_tensor * selection);
ggml_tensor * moecache_device_regate(ggml_context * ctx, ggml_tensor * t, ggml_tensor * logits, ggml_tensor * from,
                                     ggml_tensor * to, int depth);
