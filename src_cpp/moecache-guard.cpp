// moecache-guard.cpp - a model file that shrinks under a running process must not kill it.
//
// llama.cpp maps the GGUF file (MAP_SHARED, PROT_READ). When another process truncates the file,
// every page of the mapping past the new end raises SIGBUS on its next access: in the dense
// weights, in an expert read through the mapping, anywhere in a matmul on a worker thread. The
// guard turns that into an error the caller can report. A SIGBUS whose address lies in a guarded
// mapping gets a page of zeros mapped over the faulting page (MAP_FIXED, anonymous, read-only), the
// guard counts it, and the instruction runs again. The token computed from those zeros is garbage:
// the caller checks moecache_guard_faults() after each decode and refuses to use it. A SIGBUS
// anywhere else goes to the handler that was installed before ours, or kills the process as usual.
//
// The handler only reads a fixed table of address ranges and calls mmap(2), a system call: no
// allocation, no lock.

#include "moecache.h"
#include "moecache-impl.h"

#include "ggml-backend.h"
#include "gguf.h"
#include "llama-model.h"

#include <atomic>
#include <csignal>
#include <cstring>
#include <mutex>
#include <string>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MOECACHE_GUARD_MAX 64  // models guarded at once in one process

struct moecache_guard_range {
    std::atomic<uintptr_t> lo{0};     // 0: free slot
    std::atomic<uintptr_t> hi{0};
    std::atomic<int64_t>   faults{0}; // pages replaced by zeros since the guard was added
};

static moecache_guard_range g_ranges[MOECACHE_GUARD_MAX];
static struct sigaction     g_prev_bus;
static std::mutex           g_install_mutex;
static bool                 g_installed = false;
static uintptr_t            g_page      = 4096;

static void moecache_on_sigbus(int sig, siginfo_t * si, void * uctx) {
    const uintptr_t a = (uintptr_t) si->si_addr;
    for (moecache_guard_range & r : g_ranges) {
        const uintptr_t lo = r.lo.load(std::memory_order_acquire);
        if (lo == 0 || a < lo || a >= r.hi.load(std::memory_order_acquire)) {
            continue;
        }
        void * page = (void *) (a & ~(g_page - 1));
        if (mmap(page, g_page, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED) {
            r.faults.fetch_add(1, std::memory_order_acq_rel);
            return; // the load runs again and reads zeros
        }
        break;
    }
    // not ours: whoever handled SIGBUS before us, else the default action (the fault recurs and kills)
    if ((g_prev_bus.sa_flags & SA_SIGINFO) && g_prev_bus.sa_sigaction != nullptr) {
        g_prev_bus.sa_sigaction(sig, si, uctx);
    } else if (g_prev_bus.sa_handler != SIG_DFL && g_prev_bus.sa_handler != SIG_IGN) {
        g_prev_bus.sa_handler(sig);
    } else {
        signal(SIGBUS, SIG_DFL);
    }
}

static void moecache_guard_install() {
    if (g_installed) {
        return;
    }
    g_page = (uintptr_t) sysconf(_SC_PAGESIZE);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = moecache_on_sigbus;
    sa.sa_flags     = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &g_prev_bus) == 0) {
        g_installed = true;
    }
}

int32_t moecache_guard_add(const struct llama_model * model, const char * path) {
    if (model == nullptr || path == nullptr) {
        moecache_set_error("moecache_guard_add: model and path are required");
        return MOECACHE_ERR_INVALID;
    }
    // where the file is mapped: a tensor in llama.cpp's mapped CPU buffer, less its offset in the file
    struct gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * gg = gguf_init_from_file(path, gp);
    if (gg == nullptr) {
        moecache_set_error(std::string("moecache_guard_add: '") + path + "' is not a readable GGUF file");
        return MOECACHE_ERR_INVALID;
    }
    uintptr_t base = 0;
    for (const auto & nt : model->tensors_by_name) {
        const ggml_tensor * t = nt.second;
        if (!moecache_tensor_is_mapped(t)) {
            continue;
        }
        const int64_t id = gguf_find_tensor(gg, ggml_get_name(t));
        if (id >= 0) {
            base = (uintptr_t) t->data - (uintptr_t) (gguf_get_data_offset(gg) + gguf_get_tensor_offset(gg, id));
            break;
        }
    }
    gguf_free(gg);
    struct stat st;
    if (base == 0 || stat(path, &st) != 0) {
        return MOECACHE_ERR_STATE; // nothing mapped from this file (use_mmap off, or all on a GPU)
    }
    std::lock_guard<std::mutex> lock(g_install_mutex);
    moecache_guard_install();
    if (!g_installed) {
        moecache_set_error(std::string("moecache_guard_add: sigaction(SIGBUS) failed: ") + strerror(errno));
        return MOECACHE_ERR_INVALID;
    }
    for (int32_t i = 0; i < MOECACHE_GUARD_MAX; i++) {
        moecache_guard_range & r = g_ranges[i];
        if (r.lo.load() == 0) {
            r.faults.store(0);
            r.hi.store(base + (uintptr_t) st.st_size, std::memory_order_release);
            r.lo.store(base, std::memory_order_release);
            return i;
        }
    }
    moecache_set_error("moecache_guard_add: more than " + std::to_string(MOECACHE_GUARD_MAX) + " models guarded");
    return MOECACHE_ERR_INVALID;
}

int64_t moecache_guard_faults(int32_t id) {
    if (id < 0 || id >= MOECACHE_GUARD_MAX) {
        return 0;
    }
    return g_ranges[id].faults.load(std::memory_order_acquire);
}

void moecache_guard_remove(int32_t id) {
    if (id < 0 || id >= MOECACHE_GUARD_MAX) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_install_mutex);
    g_ranges[id].lo.store(0, std::memory_order_release);
    g_ranges[id].hi.store(0, std::memory_order_release);
}
