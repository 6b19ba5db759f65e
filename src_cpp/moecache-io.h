// moecache-io.h - the reader threads of a moecache and their queue. A job is a read of a file
// range (direct I/O where the file allows, in aligned windows), a copy out of the model's
// mapping, a page lock, or a read-ahead of the mapping. Jobs wait in two queues: on demand (a
// token needs the bytes now) and prefetch (ordered by a score: predicted probability over layer
// distance; a prompt's read-ahead scores above every prediction). Workers take
// on-demand jobs first, and at most `ahead_limit` of them read ahead at once (0: no limit); no
// read ahead starts while an on-demand read is in flight (a disk shares its bandwidth among the
// reads it has, so a read ahead beside an urgent one would make the token wait longer for it), so
// an urgent read waits at most for the prefetch chunks already being read.
// Jobs belong to a request (moecache_io_req: one slot's fill, or one synchronous batch); a
// caller waits for a request, which first moves its queued jobs to the on-demand queue, or
// cancels it, which drops its queued jobs and waits for those being read.
#pragma once

#include "moecache-timeline.h" // struct moecache_event

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <unistd.h>

#define MOECACHE_IO_ALIGN 4096          // O_DIRECT: offset, length and buffer aligned to this
#define MOECACHE_IO_CHUNK (2 * 1024 * 1024) // largest single read: a tensor larger than this is read in equal
                                            //   pieces in parallel (one read per piece: fewer, larger reads get
                                            //   more from the disk and wake the readers less often)

enum moecache_io_kind {
    MOECACHE_IO_READ  = 0, // pread the file range [off, off + len) into dst
    MOECACHE_IO_COPY  = 1, // memcpy len bytes from the mapping at src into dst
    MOECACHE_IO_LOCK  = 2, // mlock (or fault in) the mapping at src, len bytes
    MOECACHE_IO_AHEAD = 3, // ask the kernel to read the mapping at src, len bytes, into the page cache
    MOECACHE_IO_FAULT = 4, // fault the mapping at src, len bytes, in: read and mapped, as a matmul's faults
                           //   would (large folios where the file system has them); AHEAD where the kernel
                           //   cannot (MADV_POPULATE_READ, Linux 5.14). Not for MADV_RANDOM regions: no readahead
};

struct moecache_io_job {
    moecache_io_kind kind;
    char *       dst;
    const char * src;
    uint64_t     off;
    size_t       len;
    size_t       tail;      // READ: the last `tail` bytes may lie past the end of the file (an aligned window)
    bool         aux;       // READ: from the second file (moecache_io::aux_fd, the low-bit companion)
    int32_t      il, e;     // for messages and bookkeeping
    int          err;       // out: 0, an errno, or -1 for a short read
    size_t       got;       // out: bytes read
    size_t       bytes_io;  // out: bytes requested from storage (aligned window for O_DIRECT)
};

// A group of jobs a caller waits for or cancels together. Guarded by moecache_io::mu.
struct moecache_io_req {
    int32_t  pending  = 0;     // jobs queued or being run
    int      err      = 0;     // first error of a job (see moecache_io_job::err)
    uint64_t err_off  = 0;     //   its file offset and length, for the message
    size_t   err_len  = 0;
    bool     prefetch = false; // its reads count as speculative (moecache_io::bytes_prefetch)
};

struct moecache_io_item {
    moecache_io_job   job;
    moecache_io_req * req;
    moecache_io_job * out;     // where the finished job is copied back (synchronous batches), or nullptr
    float             score;   // prefetch queue: larger runs first
    bool              ahead;   // taken from the prefetch queue (counts against ahead_limit while it runs)
    int64_t           t_queued = 0; // moecache_time_us() at submission (the timeline)
};

// What the graph thread and the reader threads did, when (moecache_timeline_start): the first
// `cap` events, in the order they ended. Its own lock: the graph thread adds to it between jobs.
struct moecache_timeline {
    std::atomic<bool>          on{false};   // recording (read without the lock: a cheap test on hot paths)
    std::mutex                 mu;
    size_t                     cap = 0;     // 0: not recording
    int64_t                    dropped = 0; // events past cap
    std::vector<moecache_event> ev;
};

// records e if a timeline is being recorded (tl may be nullptr)
void moecache_timeline_add(moecache_timeline * tl, const moecache_event & e);

struct moecache_io {
    std::vector<moecache_io_job> scratch; // a caller's job list, reused token after token
    std::vector<std::thread> workers;
    std::mutex               mu;
    std::condition_variable  cv_work;
    std::condition_variable  cv_done;
    std::deque<moecache_io_item>  demand;   // FIFO
    std::vector<moecache_io_item> prefetch; // by score
    bool              stop   = false;
    int32_t           ahead_limit   = 0; // workers that may run prefetch jobs at once; 0 = every worker
    int32_t           ahead_running = 0; // prefetch jobs being run now
    int32_t           ahead_peak    = 0; // the most prefetch jobs run at once so far (tests)
    int32_t           demand_reads  = 0; // on-demand READ jobs being run now: while there is one, no read
                                         //   ahead starts (the disk's bandwidth is shared by the reads in
                                         //   flight, and a token is waiting for these)
    bool              ahead_yield   = true; // read ahead only while no on-demand read runs (above)
    int               fd        = -1;
    int               fd_direct = -1;
    int               aux_fd        = -1; // a second file READ jobs may name (job.aux), or -1
    int               aux_fd_direct = -1;
    bool              lock      = true;
    std::atomic<bool> lock_failed{false};
    std::atomic<int>  lock_errno{0};
    // bytes requested from storage by READ jobs, on demand and speculatively (guarded by mu)
    int64_t bytes_demand   = 0;
    int64_t bytes_prefetch = 0;
    int64_t bytes_aux      = 0;  // (from the second file: in neither of the above)
    uint64_t n_run         = 0;  // jobs run so far; job k (from 1) got seq = k (tests: execution order)
    std::vector<uint64_t> * seq_log = nullptr; // tests: the `off` of each job as it starts, if set
    // wall time with at least one READ job running (the overlap: how much of it the graph waited
    // for), guarded by mu
    int32_t reads_running = 0;
    int64_t reads_since   = 0;  // moecache_time_us() when reads_running became 1
    int64_t read_busy_us  = 0;
    moecache_timeline * timeline = nullptr; // the owner's timeline, or nullptr
};

// starts n_threads reader threads, at most ahead_limit of them reading ahead at once (0 = all) /
// stops and joins them (before the fds close); queued jobs are dropped
void moecache_io_start(moecache_io & io, int32_t n_threads, int32_t ahead_limit = 0);
void moecache_io_stop(moecache_io & io);

// runs the jobs on the reader threads, ahead of every prefetch (in the caller's thread when
// there are no threads) and waits for all of them; each job's err, got and bytes_io are set
void moecache_io_run(moecache_io & io, std::vector<moecache_io_job> & jobs);

// queues jobs[0:n] of `req`, on demand (score < 0) or as prefetches with this score (>= 0)
void moecache_io_submit(moecache_io & io, moecache_io_req & req, const moecache_io_job * jobs, size_t n, float score);
inline void moecache_io_submit(moecache_io & io, moecache_io_req & req, const moecache_io_job & job, float score) {
    moecache_io_submit(io, req, &job, 1, score);
}
// moves req's queued prefetch jobs to the on-demand queue and waits until none is pending;
// returns req.err (0 if all its jobs succeeded)
int  moecache_io_wait(moecache_io & io, moecache_io_req & req);
// moves req's queued prefetch jobs to the end of the on-demand queue (what wait does first)
void moecache_io_promote(moecache_io & io, moecache_io_req & req);
// drops req's queued jobs, waits for those being run; returns how many were dropped
int32_t moecache_io_cancel(moecache_io & io, moecache_io_req & req);
// drops req's queued jobs but those of an expert marked in keep_e ([n_expert]; nullptr: drops them
// all); those being read run on (no wait); returns how many were dropped
int32_t moecache_io_drop_queued(moecache_io & io, moecache_io_req & req, const uint8_t * keep_e);
// req has no job queued or running (no lock held by the caller)
bool moecache_io_idle(moecache_io & io, const moecache_io_req & req);
void moecache_io_counters(moecache_io & io, int64_t * bytes_demand, int64_t * bytes_prefetch);
// MADV_WILLNEED over the whole pages of [src, src + len) of a mapping: the kernel reads them in
// large requests; returns once they are issued
void moecache_io_willneed(const char * src, size_t len);
// MADV_POPULATE_READ over them: returns once they are read and mapped; false where the kernel cannot
bool moecache_io_fault_in(const char * src, size_t len);

inline int64_t moecache_time_us(void) { // a monotonic clock in microseconds (telemetry, the timeline)
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline size_t moecache_page_size() {
    static const size_t ps = (size_t) sysconf(_SC_PAGESIZE);
    return ps;
}

inline size_t moecache_round_up(size_t x, size_t a) {
    return (x + a - 1) / a * a;
}
