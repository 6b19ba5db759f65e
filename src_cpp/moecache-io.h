// moecache-io.h - the reader threads of a moecache: a job list run in parallel, each job a read
// of a file range (direct I/O where the file allows, in aligned windows), a copy out of the
// model's mapping, or a page lock. The asynchronous, prioritised queue of prefetches grows here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#define MOECACHE_IO_ALIGN 4096          // O_DIRECT: offset, length and buffer aligned to this
#define MOECACHE_IO_CHUNK (256 * 1024)  // largest single read; experts are read in pieces in parallel

enum moecache_io_kind {
    MOECACHE_IO_READ = 0, // pread the file range [off, off + len) into dst
    MOECACHE_IO_COPY = 1, // memcpy len bytes from the mapping at src into dst
    MOECACHE_IO_LOCK = 2, // mlock (or fault in) the mapping at src, len bytes
};

struct moecache_io_job {
    moecache_io_kind kind;
    char *       dst;
    const char * src;
    uint64_t     off;
    size_t       len;
    int32_t      il, e;     // for messages and bookkeeping
    int          err;       // out: 0, an errno, or -1 for a short read
    size_t       got;       // out: bytes read
    size_t       bytes_io;  // out: bytes requested from storage (aligned window for O_DIRECT)
};

struct moecache_io {
    std::vector<moecache_io_job> scratch; // the op's job list, reused token after token (no allocation)
    std::vector<std::thread> workers;
    std::mutex               mu;
    std::condition_variable  cv_work;
    std::condition_variable  cv_done;
    moecache_io_job * jobs   = nullptr;
    size_t            n_jobs = 0;
    size_t            next   = 0;
    size_t            n_done = 0;
    bool              stop   = false;
    int               fd        = -1;
    int               fd_direct = -1;
    bool              lock      = true;
    std::atomic<bool> lock_failed{false};
    std::atomic<int>  lock_errno{0};
};

// starts n_threads reader threads / stops and joins them (before the fds close)
void moecache_io_start(moecache_io & io, int32_t n_threads);
void moecache_io_stop(moecache_io & io);

// runs the jobs on the reader threads (in the caller's thread for one job or no threads) and
// waits for all of them; each job's err, got and bytes_io are set
void moecache_io_run(moecache_io & io, std::vector<moecache_io_job> & jobs);

inline size_t moecache_page_size() {
    static const size_t ps = (size_t) sysconf(_SC_PAGESIZE);
    return ps;
}

inline size_t moecache_round_up(size_t x, size_t a) {
    return (x + a - 1) / a * a;
}
