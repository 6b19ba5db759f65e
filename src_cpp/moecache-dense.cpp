// moecache-dense.cpp - the model's dense part (every weight but the routed experts) locked in
// memory (moecache_cache_params.lock_dense).
//
// Every token reads all of the model's weights but the routed experts. Mapped from the file, those
// pages are the kernel's to drop when memory runs short, and then every token reads them back (a
// major fault per page): on a device with little memory left a decode becomes a page-in of the
// dense part. lock_dense mlocks them. The token-embedding table stays unlocked unless the output
// reuses it: a token reads one row of it. Several moecaches on one model share the lock.

#include "moecache-impl.h"

#include "llama-impl.h"  // LLAMA_LOG_WARN: llama.cpp's logger, which the application controls
#include "llama-model.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <fcntl.h>
#include <sys/mman.h>

struct dense_lock {
    int32_t users = 0;
    int64_t bytes = 0;
    std::vector<std::pair<char *, size_t>> ranges; // page-aligned, sorted, disjoint
};

static std::mutex g_dense_mu;
static std::unordered_map<const llama_model *, dense_lock> g_dense; // model -> its locked dense part

void moecache_dense_lock(moecache & mc, const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_dense_mu);
    dense_lock & d = g_dense[model];
    mc.res.dense_model = model;
    if (d.users++ > 0) {
        mc.res.dense_locked = d.bytes;
        return;
    }
    const size_t page = moecache_page_size();
    std::vector<std::pair<char *, size_t>> want; // [begin, end) per tensor
    for (const auto & nt : model->tensors_by_name) {
        const ggml_tensor * t = nt.second;
        if (mc.res.xt_layer.count(t) || !moecache_tensor_is_mapped(t)) {
            continue; // a routed expert, or not in the mapping (already anonymous memory)
        }
        if (t == model->tok_embd && !(model->output && model->output->data == t->data)) {
            continue;
        }
        char * b = (char *) ((uintptr_t) t->data & ~(uintptr_t) (page - 1));
        char * e = (char *) moecache_round_up((uintptr_t) t->data + ggml_nbytes(t), page);
        want.push_back({ b, (size_t) (e - b) });
    }
    std::sort(want.begin(), want.end());
    for (const auto & r : want) { // merge: tensors share pages and lie next to each other
        if (!d.ranges.empty() && r.first <= d.ranges.back().first + d.ranges.back().second) {
            size_t end = std::max((size_t) (r.first - d.ranges.back().first) + r.second, d.ranges.back().second);
            d.ranges.back().second = end;
        } else {
            d.ranges.push_back(r);
        }
    }
    int64_t total = 0;
    for (const auto & r : d.ranges) {
        total += (int64_t) r.second;
    }
    for (size_t i = 0; i < d.ranges.size(); i++) {
        if (mlock(d.ranges[i].first, d.ranges[i].second) != 0) {
            const int err = errno;
            for (size_t j = 0; j < i; j++) {
                munlock(d.ranges[j].first, d.ranges[j].second);
            }
            d.ranges.clear();
            static std::once_flag once;
            std::call_once(once, [total, err] {
                LLAMA_LOG_WARN("moecache: warning: mlock of the model's dense part (%.1f MiB, the weights every token "
                               "reads) was refused (%s). The run goes on with it mapped: when memory runs short the "
                               "OS drops its pages and every token reads them back. Fix: raise the limit (`ulimit -l "
                               "unlimited`), or lock_dense=False / --no-mlock to silence this.\n",
                               (double) total / (1 << 20), strerror(err));
            });
            break;
        }
    }
    d.bytes = d.ranges.empty() ? 0 : total;
    mc.res.dense_locked = d.bytes;
#ifdef __linux__
    for (const moecache_layer & L : mc.layers) { // what the kernel read around the locked pages: not needed
        for (const moecache_expert_tensor & x : L.res.xt) {
            posix_fadvise(mc.res.fd, (off_t) x.file_off, (off_t) (x.nb2 * (size_t) mc.n_expert), POSIX_FADV_DONTNEED);
        }
    }
#endif
}

void moecache_dense_unlock(moecache & mc) {
    if (!mc.res.dense_model) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_dense_mu);
    auto it = g_dense.find(mc.res.dense_model);
    if (it != g_dense.end() && --it->second.users == 0) {
        for (const auto & r : it->second.ranges) {
            munlock(r.first, r.second);
        }
        g_dense.erase(it);
    }
    mc.res.dense_model  = nullptr;
    mc.res.dense_locked = 0;
}
