// moecache-io.cpp - the reader threads and their queue (moecache-io.h).

#include "moecache-io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>

static void io_read(moecache_io & io, moecache_io_job & j) {
    j.err = 0;
    j.got = 0;
    const int  fd_buffered = j.aux ? io.aux_fd : io.fd;
    const int  fd_direct   = j.aux ? io.aux_fd_direct : io.fd_direct;
    const bool direct = fd_direct >= 0;
    if (!direct || (j.off % MOECACHE_IO_ALIGN == 0 && j.len % MOECACHE_IO_ALIGN == 0 &&
                    (uintptr_t) j.dst % MOECACHE_IO_ALIGN == 0)) {
        const int fd = direct ? fd_direct : fd_buffered;
        while (j.got < j.len) {
            const ssize_t n = pread(fd, j.dst + j.got, j.len - j.got, (off_t) (j.off + j.got));
            if (n < 0 && errno == EINTR) {
                continue;
            }
            if (n == 0 && j.got + j.tail >= j.len) {
                break; // the end of the file, in the window's padding
            }
            if (n <= 0) {
                j.err = n < 0 ? errno : -1;
                break;
            }
            j.got += (size_t) n;
        }
        j.bytes_io = j.len;
#ifdef __linux__
        if (!direct) {
            posix_fadvise(fd, (off_t) j.off, (off_t) j.len, POSIX_FADV_DONTNEED); // the slot is the only copy
        }
#endif
        return;
    }
    // unaligned expert: read the aligned window around it into a bounce buffer of this thread
    static thread_local std::vector<char> bounce_mem;
    const uint64_t a0   = j.off / MOECACHE_IO_ALIGN * MOECACHE_IO_ALIGN;
    const size_t   head = (size_t) (j.off - a0);
    const size_t   win  = moecache_round_up(head + j.len, MOECACHE_IO_ALIGN);
    if (bounce_mem.size() < win + MOECACHE_IO_ALIGN) {
        bounce_mem.resize(win + MOECACHE_IO_ALIGN);
    }
    char * bounce = (char *) moecache_round_up((uintptr_t) bounce_mem.data(), MOECACHE_IO_ALIGN);
    size_t got = 0;
    while (got < win) {
        const ssize_t n = pread(fd_direct, bounce + got, win - got, (off_t) (a0 + got));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            j.err = errno;
            break;
        }
        if (n == 0) {
            break; // end of file: fine if the expert ended before it
        }
        got += (size_t) n;
    }
    j.bytes_io = win;
    if (j.err == 0 && got < head + j.len) {
        j.err = -1;
    }
    if (j.err == 0) {
        memcpy(j.dst, bounce + head, j.len);
        j.got = j.len;
    } else {
        j.got = got > head ? std::min(got - head, j.len) : 0;
    }
}

void moecache_io_willneed(const char * src, size_t len) {
    const uintptr_t p0 = (uintptr_t) src / moecache_page_size() * moecache_page_size();
    madvise((void *) p0, moecache_round_up((uintptr_t) src + len - p0, moecache_page_size()), MADV_WILLNEED);
}

#if defined(__linux__) && !defined(MADV_POPULATE_READ)
#define MADV_POPULATE_READ 22
#endif

// The kernel's readahead on a fault allocates large folios where the file system has them (ext4, xfs),
// growing as the reads go on; MADV_WILLNEED's readahead allocates 4 KiB pages, and inserting, mapping and
// dropping those cost the kernel more than the reads themselves: gpt-oss-20b's shape under a cap of a third,
// a 128-token prompt took 4.2 s of system time against stock llama.cpp's 0.6 s (its matmul faults the
// mapping in), and 1.9 s faulted in on the reader threads (docs/benchmarks.md)
bool moecache_io_fault_in(const char * src, size_t len) {
#if defined(MADV_POPULATE_READ)
    static std::atomic<bool> unsupported{false};
    if (!unsupported.load(std::memory_order_relaxed)) {
        const uintptr_t p0 = (uintptr_t) src / moecache_page_size() * moecache_page_size();
        const size_t    n  = moecache_round_up((uintptr_t) src + len - p0, moecache_page_size());
        if (madvise((void *) p0, n, MADV_POPULATE_READ) == 0) {
            return true;
        }
        if (errno == EINVAL) {
            unsupported.store(true); // (before Linux 5.14)
        }
    }
#else
    (void) src;
    (void) len;
#endif
    return false;
}

static void io_lock(moecache_io & io, moecache_io_job & j) {
    j.err = 0;
    j.bytes_io = j.len;
    moecache_io_willneed(j.src, j.len);
    if (io.lock && !io.lock_failed.load(std::memory_order_relaxed)) {
        if (mlock(j.src, j.len) == 0) {
            return;
        }
        io.lock_errno.store(errno);
        io.lock_failed.store(true); // warned once by the caller; the pages are faulted in below
    }
    // not locked: read every page once so the expert is in memory, as a locked one would be
    const size_t ps = moecache_page_size();
    volatile char sink = 0;
    for (size_t i = 0; i < j.len; i += ps) {
        sink = sink + j.src[i];
    }
    if (j.len > 0) {
        sink = sink + j.src[j.len - 1];
    }
    (void) sink;
}

// (mapping the pages too, MADV_POPULATE_READ, measured slower: it adds CPU work on the cores
// the matmul runs on)
static void io_ahead(moecache_io_job & j) {
    j.err = 0;
    j.bytes_io = j.len;
    if (j.kind != MOECACHE_IO_FAULT || !moecache_io_fault_in(j.src, j.len)) {
        moecache_io_willneed(j.src, j.len); // (a failed fault-in is no error either: the matmul faults the pages)
    }
}

static void io_run_job(moecache_io & io, moecache_io_job & j) {
    switch (j.kind) {
        case MOECACHE_IO_READ:  io_read(io, j); break;
        case MOECACHE_IO_COPY:  memcpy(j.dst, j.src, j.len); j.err = 0; j.got = j.len; j.bytes_io = j.len; break;
        case MOECACHE_IO_LOCK:  io_lock(io, j); break;
        case MOECACHE_IO_AHEAD: io_ahead(j); break;
        case MOECACHE_IO_FAULT: io_ahead(j); break;
    }
}

// (io.mu held) a prefetch may start now: one is queued, fewer than ahead_limit run, and no
// on-demand read is in flight (ahead_yield)
static bool io_ahead_ready(const moecache_io & io) {
    return !io.prefetch.empty() && (io.ahead_limit <= 0 || io.ahead_running < io.ahead_limit) &&
           !(io.ahead_yield && io.demand_reads > 0);
}

// (io.mu held) the next job: on demand first (oldest first), then, while fewer than ahead_limit
// prefetches run, the prefetch with the best score (oldest of equals)
static bool io_pop(moecache_io & io, moecache_io_item & it) {
    if (!io.demand.empty()) {
        it = io.demand.front();
        io.demand.pop_front(); // (ahead is false: set so at submission, and a promotion keeps it)
        return true;
    }
    if (!io_ahead_ready(io)) {
        return false;
    }
    size_t best = 0;
    for (size_t i = 1; i < io.prefetch.size(); i++) {
        if (io.prefetch[i].score > io.prefetch[best].score) {
            best = i;
        }
    }
    it = io.prefetch[best];
    io.prefetch.erase(io.prefetch.begin() + (std::ptrdiff_t) best);
    it.ahead = true;
    io.ahead_running += 1;
    io.ahead_peak     = std::max(io.ahead_peak, io.ahead_running);
    return true;
}

void moecache_timeline_add(moecache_timeline * tl, const moecache_event & e) {
    if (!tl || !tl->on.load(std::memory_order_relaxed)) {
        return;
    }
    std::lock_guard<std::mutex> lock(tl->mu);
    if (tl->ev.size() < tl->cap) {
        tl->ev.push_back(e);
    } else if (tl->cap > 0) {
        tl->dropped += 1;
    }
}

// (io.mu held) a job starts or ends: the wall time with a READ in flight
static void io_read_busy(moecache_io & io, const moecache_io_job & j, bool start, int64_t now) {
    if (j.kind != MOECACHE_IO_READ) {
        return;
    }
    if (start) {
        if (io.reads_running++ == 0) {
            io.reads_since = now;
        }
    } else if (--io.reads_running == 0) {
        io.read_busy_us += now - io.reads_since;
    }
}

static void io_record(moecache_io & io, const moecache_io_item & it, int32_t thread, int64_t t_start, int64_t t_end) {
    if (!io.timeline || !io.timeline->on.load(std::memory_order_relaxed)) {
        return;
    }
    moecache_event e = {};
    switch (it.job.kind) {
        case MOECACHE_IO_READ:  e.kind = it.job.aux ? MOECACHE_EVENT_LOWBIT : it.ahead || it.req->prefetch
                                    ? MOECACHE_EVENT_READ_AHEAD : MOECACHE_EVENT_READ; break;
        case MOECACHE_IO_AHEAD: e.kind = MOECACHE_EVENT_READ_AHEAD; break;
        case MOECACHE_IO_FAULT: e.kind = MOECACHE_EVENT_READ_AHEAD; break;
        case MOECACHE_IO_LOCK:  e.kind = MOECACHE_EVENT_LOCK; break;
        case MOECACHE_IO_COPY:  e.kind = MOECACHE_EVENT_COPY; break;
    }
    e.layer       = it.job.il;
    e.expert      = it.job.e;
    e.thread      = thread;
    e.t_queued_us = it.t_queued > 0 ? it.t_queued : t_start;
    e.t_start_us  = t_start;
    e.t_end_us    = t_end;
    e.bytes       = (int64_t) it.job.bytes_io;
    moecache_timeline_add(io.timeline, e);
}

// (io.mu held) a job ran: its request learns the outcome, waiters are woken
static void io_finish(moecache_io & io, const moecache_io_item & it) {
    moecache_io_req & r = *it.req;
    r.pending -= 1;
    if (it.job.err != 0 && r.err == 0) {
        r.err     = it.job.err;
        r.err_off = it.job.off;
        r.err_len = it.job.len;
    }
    if (it.job.kind == MOECACHE_IO_READ) {
        (it.job.aux ? io.bytes_aux : r.prefetch ? io.bytes_prefetch : io.bytes_demand) += (int64_t) it.job.bytes_io;
    }
    if (it.out) {
        *it.out = it.job;
    }
    if (it.ahead) {
        io.ahead_running -= 1;
        if (!io.prefetch.empty()) {
            io.cv_work.notify_one(); // the next prefetch may start
        }
    } else if (it.job.kind == MOECACHE_IO_READ && --io.demand_reads == 0 && !io.prefetch.empty()) {
        io.cv_work.notify_all(); // the reads ahead held back by it may start
    }
    io.n_run += 1;
    io.cv_done.notify_all();
}

// runs one popped job with io.mu held around it (released while the job runs); thread: 0 for
// the caller's own thread, 1.. for reader threads
static void io_run_locked(moecache_io & io, std::unique_lock<std::mutex> & lock, moecache_io_item & it, int32_t thread) {
    if (io.seq_log) {
        io.seq_log->push_back(it.job.off);
    }
    // both ends are taken with io.mu held, so the busy time is exactly the union of the recorded
    // intervals; a job ends when its waiter can learn of it (after this thread got the lock back)
    const int64_t t_start = moecache_time_us();
    io_read_busy(io, it.job, true, t_start);
    if (!it.ahead && it.job.kind == MOECACHE_IO_READ) {
        io.demand_reads += 1; // (io_finish takes it back)
    }
    lock.unlock();
    io_run_job(io, it.job);
    lock.lock();
    const int64_t t_end = moecache_time_us();
    io_read_busy(io, it.job, false, t_end);
    io_record(io, it, thread, t_start, t_end); // (lock order: io.mu, then the timeline's)
    io_finish(io, it);
}

static void io_worker(moecache_io * io, int32_t thread) {
    std::unique_lock<std::mutex> lock(io->mu);
    while (true) {
        io->cv_work.wait(lock, [io] { return io->stop || !io->demand.empty() || io_ahead_ready(*io); });
        if (io->stop) {
            return;
        }
        moecache_io_item it;
        if (!io_pop(*io, it)) {
            continue;
        }
        io_run_locked(*io, lock, it, thread);
    }
}

// (io.mu held) moves req's queued jobs out of `queue` into `out` (in order, where given); returns how
// many; keep_e ([n_expert], or nullptr): the jobs of an expert marked 1 stay queued
template <typename Queue>
static int32_t io_take(Queue & queue, const moecache_io_req & req, std::vector<moecache_io_item> * out,
                       const uint8_t * keep_e = nullptr) {
    int32_t n = 0;
    for (auto it = queue.begin(); it != queue.end();) {
        if (it->req == &req && !(keep_e && it->job.e >= 0 && keep_e[it->job.e])) {
            if (out) {
                out->push_back(*it);
            }
            it = queue.erase(it);
            n++;
        } else {
            ++it;
        }
    }
    return n;
}

// (io.mu held) no reader threads: the caller runs req's queued jobs itself
static void io_run_inline(moecache_io & io, std::unique_lock<std::mutex> & lock, moecache_io_req & req) {
    std::vector<moecache_io_item> mine;
    io_take(io.demand, req, &mine);
    io_take(io.prefetch, req, &mine);
    for (moecache_io_item & it : mine) {
        io_run_locked(io, lock, it, 0);
    }
}

// (io.mu held) req's queued prefetch jobs move to the end of the on-demand queue, in their order
static void io_promote(moecache_io & io, moecache_io_req & req) {
    std::vector<moecache_io_item> moved;
    io_take(io.prefetch, req, &moved);
    io.demand.insert(io.demand.end(), moved.begin(), moved.end());
    if (!moved.empty()) {
        io.cv_work.notify_all();
    }
}

void moecache_io_submit(moecache_io & io, moecache_io_req & req, const moecache_io_job * jobs, size_t n, float score) {
    if (n == 0) {
        return;
    }
    std::lock_guard<std::mutex> lock(io.mu); // (once for all: a reader woken per job would take the CPU each time)
    const int64_t now = moecache_time_us();
    for (size_t i = 0; i < n; i++) {
        req.pending += 1;
        moecache_io_item it = { jobs[i], &req, nullptr, score, false, now };
        if (score < 0.0f) {
            io.demand.push_back(it);
        } else {
            io.prefetch.push_back(it);
        }
    }
    if (n >= io.workers.size()) {
        io.cv_work.notify_all();
    } else {
        for (size_t i = 0; i < n; i++) {
            io.cv_work.notify_one();
        }
    }
}

int moecache_io_wait(moecache_io & io, moecache_io_req & req) {
    std::unique_lock<std::mutex> lock(io.mu);
    if (req.pending == 0) {
        return req.err;
    }
    if (io.workers.empty()) {
        io_run_inline(io, lock, req);
        return req.err;
    }
    io_promote(io, req);
    io.cv_done.wait(lock, [&req] { return req.pending == 0; });
    return req.err;
}

void moecache_io_promote(moecache_io & io, moecache_io_req & req) {
    std::lock_guard<std::mutex> lock(io.mu);
    io_promote(io, req);
}

int32_t moecache_io_drop_queued(moecache_io & io, moecache_io_req & req, const uint8_t * keep_e) {
    std::lock_guard<std::mutex> lock(io.mu);
    const int32_t dropped = io_take(io.demand, req, nullptr, keep_e) + io_take(io.prefetch, req, nullptr, keep_e);
    req.pending -= dropped;
    if (req.pending == 0 && dropped > 0) {
        io.cv_done.notify_all();
    }
    return dropped;
}

int32_t moecache_io_cancel(moecache_io & io, moecache_io_req & req) {
    const int32_t dropped = moecache_io_drop_queued(io, req, nullptr);
    std::unique_lock<std::mutex> lock(io.mu);
    io.cv_done.wait(lock, [&req] { return req.pending == 0; }); // the chunks being read now
    return dropped;
}

bool moecache_io_idle(moecache_io & io, const moecache_io_req & req) {
    std::lock_guard<std::mutex> lock(io.mu);
    return req.pending == 0;
}

void moecache_io_counters(moecache_io & io, int64_t * bytes_demand, int64_t * bytes_prefetch) {
    std::lock_guard<std::mutex> lock(io.mu);
    *bytes_demand   = io.bytes_demand;
    *bytes_prefetch = io.bytes_prefetch;
}

void moecache_io_run(moecache_io & io, std::vector<moecache_io_job> & jobs) {
    if (jobs.empty()) {
        return;
    }
    moecache_io_req req;
    if (jobs.size() == 1 || io.workers.empty()) { // not worth a hand-over
        std::unique_lock<std::mutex> lock(io.mu);
        for (moecache_io_job & j : jobs) {
            moecache_io_item it = { j, &req, &j, -1.0f, false, 0 };
            req.pending += 1;
            io_run_locked(io, lock, it, 0);
        }
        return;
    }
    {
        std::lock_guard<std::mutex> lock(io.mu);
        const int64_t now = moecache_time_us();
        for (moecache_io_job & j : jobs) {
            io.demand.push_back({ j, &req, &j, -1.0f, false, now });
            req.pending += 1;
        }
        io.cv_work.notify_all();
    }
    std::unique_lock<std::mutex> lock(io.mu);
    io.cv_done.wait(lock, [&req] { return req.pending == 0; });
}

void moecache_io_start(moecache_io & io, int32_t n_threads, int32_t ahead_limit) {
    io.ahead_limit = ahead_limit;
    for (int32_t i = 0; i < n_threads; i++) {
        io.workers.emplace_back(io_worker, &io, i + 1);
    }
}

void moecache_io_stop(moecache_io & io) {
    {
        std::lock_guard<std::mutex> lock(io.mu);
        io.stop = true;
    }
    io.cv_work.notify_all();
    for (std::thread & t : io.workers) {
        t.join();
    }
    io.workers.clear();
    io.demand.clear();
    io.prefetch.clear();
}
