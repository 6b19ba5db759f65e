// moecache-state.cpp - cache state files: the format, an atomic write, and a read that checks
// everything before it changes anything (moecache.h: moecache_state_save / moecache_state_load).

#include "moecache-impl.h"

#include <cerrno>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

static int32_t fail(int32_t status, const std::string & msg) {
    moecache_set_error(msg);
    return status;
}

// state files: a tiny binary format, native endianness, written atomically, checked on load
//   "MOECACH2" | u32 abi | u32 len + desc | u64 n_params | i32 n_layer, N, K
//   per layer: i32 n_cached, i32 ids[n_cached] (least recently used first), f64 delta_sum, i64 delta_n
//   u64 FNV-1a hash of every byte before it

static const char     STATE_MAGIC[8]   = {'M', 'O', 'E', 'C', 'A', 'C', 'H', '2'};
static const size_t   STATE_MAX_BYTES  = 256u << 20; // far above any real model's state
static const uint32_t STATE_MAX_DESC   = 4096;

uint64_t moecache_fnv1a64(const uint8_t * p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ p[i]) * 0x100000001b3ull;
    }
    return h;
}

std::string moecache_quoted(const char * path) {
    return std::string("'") + path + "'";
}

// temporaries beside the target: <dir>/.<name>.tmp.<pid>.<hex>; those of a writer that died
// (kill -9 mid-save) are removed at the next save of the same target
static void remove_stale_temporaries(const std::string & dir, const std::string & name) {
    DIR * d = opendir(dir.c_str());
    if (d == nullptr) {
        return;
    }
    for (const std::string & prefix : { "." + name + ".tmp.", name + ".tmp." }) {
        rewinddir(d);
        while (const dirent * e = readdir(d)) {
            const std::string entry = e->d_name;
            if (entry.compare(0, prefix.size(), prefix) != 0) {
                continue;
            }
            char * end = nullptr;
            const long pid = strtol(entry.c_str() + prefix.size(), &end, 10);
            if (end == entry.c_str() + prefix.size() || (*end != '\0' && *end != '.') || pid <= 0 || pid == (long) getpid()) {
                continue;
            }
            if (kill((pid_t) pid, 0) != 0 && errno == ESRCH) {
                unlink((dir + "/" + entry).c_str());
            }
        }
    }
    closedir(d);
}

int32_t moecache_write_file_atomic(const std::vector<uint8_t> & b, const char * path, const char * what) {
    // a uniquely named temporary beside the target (O_EXCL | O_NOFOLLOW: a link planted at its
    // name is never followed), synced, then renamed over it: a failed save leaves the old file as
    // it was. The target must be a regular file or not exist (a device, FIFO or link loop is
    // refused before anything is written); a link to a regular file is followed, so it stays a link.
    const std::string head = std::string("cannot write ") + what + " to " + moecache_quoted(path) + ": ";
    std::string target = path;
    struct stat st;
    if (stat(path, &st) == 0) {
        if (!S_ISREG(st.st_mode)) {
            return fail(MOECACHE_ERR_IO, head + "not a regular file");
        }
        struct stat lst;
        if (lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode)) {
            char * real = realpath(path, nullptr);
            if (real == nullptr) {
                return fail(MOECACHE_ERR_IO, head + strerror(errno));
            }
            target = real;
            free(real);
        }
    } else if (errno == ELOOP) {
        return fail(MOECACHE_ERR_IO, head + "a link loop");
    } else if (errno != ENOENT) {
        return fail(MOECACHE_ERR_IO, head + strerror(errno));
    }
    const size_t slash = target.rfind('/');
    const std::string dir  = slash == std::string::npos ? "." : (slash == 0 ? "/" : target.substr(0, slash));
    const std::string name = slash == std::string::npos ? target : target.substr(slash + 1);
    remove_stale_temporaries(dir, name);

    std::string tmp;
    int fd = -1;
    uint64_t seed = (uint64_t) std::chrono::steady_clock::now().time_since_epoch().count() ^ ((uint64_t) getpid() << 32);
    for (int attempt = 0; attempt < 100 && fd < 0; attempt++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        char suffix[32];
        snprintf(suffix, sizeof(suffix), "%ld.%08x", (long) getpid(), (unsigned) (seed >> 32));
        tmp = dir + "/." + name + ".tmp." + suffix;
        fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST) {
            return fail(MOECACHE_ERR_IO, head + strerror(errno));
        }
    }
    if (fd < 0) {
        return fail(MOECACHE_ERR_IO, head + "no free temporary name");
    }
    size_t done = 0;
    int err = 0;
    while (done < b.size()) {
        const ssize_t k = write(fd, b.data() + done, b.size() - done);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            err = k < 0 ? errno : ENOSPC;
            break;
        }
        done += (size_t) k;
    }
    if (!err && fsync(fd) != 0) {
        err = errno;
    }
    if (close(fd) != 0 && !err) {
        err = errno;
    }
    if (!err && rename(tmp.c_str(), target.c_str()) != 0) {
        err = errno;
    }
    if (err) {
        unlink(tmp.c_str());
        return fail(MOECACHE_ERR_IO, head + strerror(err));
    }
    return MOECACHE_OK;
}

int32_t moecache_state_write(const moecache & mc, const char * path) {
    std::vector<uint8_t> b = moecache_file_header(mc, STATE_MAGIC);
    std::vector<int32_t> ids(mc.n_expert);
    for (int32_t il = 0; il < mc.n_layer; il++) {
        const int32_t n = moecache_get_cached(&mc, il, ids.data(), (int32_t) ids.size());
        moecache_put(b, n);
        for (int32_t i = 0; i < n; i++) {
            moecache_put(b, ids[i]);
        }
        moecache_put(b, mc.layers[il].delta_sum);
        moecache_put(b, mc.layers[il].delta_n);
    }
    moecache_put(b, moecache_fnv1a64(b.data(), b.size()));

    return moecache_write_file_atomic(b, path, "cache state");
}

// the whole file, if it is a regular file of a sane size (a FIFO or device never blocks us)
int32_t moecache_read_file(const char * path, size_t max_bytes, const char * what, std::vector<uint8_t> & out) {
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        return fail(MOECACHE_ERR_IO, std::string("cannot read ") + what + " " + moecache_quoted(path) + ": " + strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return fail(MOECACHE_ERR_IO, moecache_quoted(path) + " is not a regular file");
    }
    if ((uint64_t) st.st_size > max_bytes) {
        close(fd);
        return fail(MOECACHE_ERR_CORRUPT, moecache_quoted(path) + " is too large to be a pymoecache " + what + " file");
    }
    out.resize((size_t) st.st_size);
    size_t done = 0;
    while (done < out.size()) {
        const ssize_t k = read(fd, out.data() + done, out.size() - done);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            const int err = k < 0 ? errno : 0;
            close(fd);
            return fail(MOECACHE_ERR_IO, std::string("cannot read ") + what + " " + moecache_quoted(path) + ": " +
                                         (err ? strerror(err) : "the file shrank while being read"));
        }
        done += (size_t) k;
    }
    close(fd);
    return MOECACHE_OK;
}

std::vector<uint8_t> moecache_file_header(const moecache & mc, const char magic[8]) {
    std::vector<uint8_t> b(magic, magic + 8);
    moecache_put(b, (uint32_t) MOECACHE_ABI_VERSION);
    moecache_put(b, (uint32_t) mc.desc.size());
    b.insert(b.end(), mc.desc.begin(), mc.desc.end());
    moecache_put(b, mc.n_params);
    moecache_put(b, mc.n_layer);
    moecache_put(b, mc.n_expert);
    moecache_put(b, mc.n_expert_used);
    return b;
}

int32_t moecache_read_checked(const moecache & mc, const char * path, const char magic[8], size_t max_bytes,
                              const char * what, std::vector<uint8_t> & buf, moecache_reader & r) {
    const int32_t rc = moecache_read_file(path, max_bytes, what, buf);
    if (rc != MOECACHE_OK) {
        return rc;
    }
    const std::string corrupt = moecache_quoted(path) + " is corrupt: ";
    if (buf.size() < 8 + 8 || memcmp(buf.data(), magic, 8) != 0) {
        if (buf.size() >= 8 && memcmp(buf.data(), magic, 7) == 0) {
            return fail(MOECACHE_ERR_CORRUPT, moecache_quoted(path) + " is a " + what +
                                              " file of another pymoecache version: save it again");
        }
        return fail(MOECACHE_ERR_CORRUPT, moecache_quoted(path) + " is not a pymoecache " + what + " file");
    }
    uint64_t sum = 0;
    memcpy(&sum, buf.data() + buf.size() - 8, 8);
    if (sum != moecache_fnv1a64(buf.data(), buf.size() - 8)) {
        return fail(MOECACHE_ERR_CORRUPT, corrupt + "checksum mismatch (damaged or truncated)");
    }
    r = { buf.data(), buf.size() - 8 };
    r.pos = 8;
    uint32_t abi = 0, len = 0;
    if (!r.get(abi) || !r.get(len) || len > STATE_MAX_DESC) {
        return fail(MOECACHE_ERR_CORRUPT, corrupt + "bad header");
    }
    std::string desc(len, '\0');
    uint64_t n_params = 0;
    int32_t n_layer = 0, N = 0, K = 0;
    if (!r.get_bytes(&desc[0], len) || !r.get(n_params) || !r.get(n_layer) || !r.get(N) || !r.get(K)) {
        return fail(MOECACHE_ERR_CORRUPT, corrupt + "bad header");
    }
    if (abi != MOECACHE_ABI_VERSION || desc != mc.desc || n_params != mc.n_params ||
        n_layer != mc.n_layer || N != mc.n_expert || K != mc.n_expert_used) {
        return fail(MOECACHE_ERR_MISMATCH, std::string(what) + " " + moecache_quoted(path) + " was saved for another model (" +
                                           desc + ", " + std::to_string(n_layer) + " layers, " + std::to_string(N) +
                                           " experts)");
    }
    return MOECACHE_OK;
}

int32_t moecache_state_read(moecache & mc, const char * path) {
    std::vector<uint8_t> buf;
    moecache_reader r = {};
    const int32_t rc = moecache_read_checked(mc, path, STATE_MAGIC, STATE_MAX_BYTES, "cache state", buf, r);
    if (rc != MOECACHE_OK) {
        return rc;
    }
    const std::string corrupt = moecache_quoted(path) + " is corrupt: ";
    const int32_t n_layer = mc.n_layer, N = mc.n_expert;
    // read and check everything first: a bad file leaves the cache untouched
    std::vector<std::vector<int32_t>> ids(n_layer);
    std::vector<double>  dsum(n_layer);
    std::vector<int64_t> dn(n_layer);
    std::vector<uint8_t> seen(N);
    for (int32_t il = 0; il < n_layer; il++) {
        const std::string where = corrupt + "layer " + std::to_string(il) + ": ";
        int32_t n = 0;
        if (!r.get(n) || n < 0 || n > N) {
            return fail(MOECACHE_ERR_CORRUPT, where + "bad number of cached experts");
        }
        ids[il].resize(n);
        std::fill(seen.begin(), seen.end(), 0);
        for (int32_t i = 0; i < n; i++) {
            int32_t e = -1;
            if (!r.get(e) || e < 0 || e >= N || seen[e]) {
                return fail(MOECACHE_ERR_CORRUPT, where + "expert ids out of range or repeated");
            }
            seen[e] = 1;
            ids[il][i] = e;
        }
        if (!r.get(dsum[il]) || !r.get(dn[il])) {
            return fail(MOECACHE_ERR_CORRUPT, where + "truncated");
        }
        // Delta is a running mean of logit ranges: a finite sum >= 0 over n >= 0 tokens (sum 0 if n is
        // 0) whose mean is a finite float, as routing uses it
        if (!std::isfinite(dsum[il]) || dsum[il] < 0.0 || dn[il] < 0 || (dn[il] == 0 && dsum[il] != 0.0) ||
            (dn[il] > 0 && !(dsum[il] / (double) dn[il] <= (double) FLT_MAX))) {
            return fail(MOECACHE_ERR_CORRUPT, where + "Delta out of range");
        }
    }
    if (r.pos != r.n) {
        return fail(MOECACHE_ERR_CORRUPT, corrupt + "trailing bytes");
    }
    for (int32_t il = 0; il < n_layer; il++) {
        moecache_layer & L = mc.layers[il];
        moecache_layer_clear(L);
        // a smaller cache keeps the most recently used entries
        const size_t skip = ids[il].size() > (size_t) L.capacity ? ids[il].size() - L.capacity : 0;
        for (size_t i = skip; i < ids[il].size(); i++) {
            moecache_layer_insert(L, ids[il][i], nullptr);
        }
        L.delta_sum = dsum[il];
        L.delta_n   = dn[il];
    }
    return MOECACHE_OK;
}

// the model's id in the description the files carry: "<arch> | <desc>" then " | id <id>" (replaced)
extern "C" int32_t moecache_set_model_id(struct moecache * mc, const char * id) {
    if (!mc) {
        return fail(MOECACHE_ERR_INVALID, "moecache_set_model_id: NULL moecache");
    }
    const size_t at = mc->desc.find(" | id ");
    if (at != std::string::npos) {
        mc->desc.resize(at);
    }
    if (id && *id) {
        if (std::strlen(id) > 256) {
            return fail(MOECACHE_ERR_INVALID, "moecache_set_model_id: an id of more than 256 bytes");
        }
        mc->desc += std::string(" | id ") + id;
    }
    return MOECACHE_OK;
}
