// moecache-rpc.cpp - what `pymoecache rpc-server --mem` serves: a device that is another in everything
// but the memory it reports. ggml's RPC server answers a client's memory query with its device's
// (the CPU device reports every byte of the machine as free); a server that advertises less lets a
// shared machine keep the rest, and lets a client be tried against a small GPU's memory.

#include "moecache-impl.h"

#include "ggml-backend.h"
#include "ggml-backend-impl.h" // struct ggml_backend_device: its interface, copied with get_memory replaced

#include <deque>
#include <mutex>

namespace {

struct device_with_memory {
    ggml_backend_device dev;  // first: the ggml_backend_dev_t handed out points here
    ggml_backend_dev_t  orig; // the device it is in everything else
    size_t free;
    size_t total;
};

std::mutex                     g_mutex;
std::deque<device_with_memory> g_devices; // (a deque keeps their addresses: they live as long as the process)

void get_memory(ggml_backend_dev_t dev, size_t * free, size_t * total) {
    const device_with_memory * d = (const device_with_memory *) dev;
    *free  = d->free;
    *total = d->total;
}

// the server asks a backend's device for the memory: its backends are the original's, on this device
ggml_backend_t init_backend(ggml_backend_dev_t dev, const char * params) {
    const device_with_memory * d = (const device_with_memory *) dev;
    ggml_backend_t backend = d->orig->iface.init_backend(d->orig, params);
    if (backend) {
        backend->device = dev;
    }
    return backend;
}

} // namespace

void * moecache_device_with_memory(void * device, size_t free, size_t total) {
    const ggml_backend_dev_t dev = (ggml_backend_dev_t) device;
    if (!dev || free > total) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_devices.push_back({ *dev, dev, free, total }); // (its context is dev's: every other function reads it as dev's)
    device_with_memory & d = g_devices.back();
    d.dev.iface.get_memory   = get_memory;
    d.dev.iface.init_backend = init_backend;
    return &d.dev;
}
