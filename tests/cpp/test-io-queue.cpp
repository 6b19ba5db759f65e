// Unit tests of the reader queue (src_cpp/moecache-io.{h,cpp}), compiled with it alone:
// on-demand reads before prefetches, prefetches by score, promotion of a request a token waits
// for, cancellation of stale prefetches, the limit on readers ahead, errors and the bytes counted
// on demand and ahead.
// Jobs are queued while no reader thread runs, then one thread drains them, so the order in
// which they start (io.seq_log, the file offsets) is exact.

#include "moecache-io.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

static int g_failed = 0;
static int g_checks = 0;

#define CHECK(cond)                                                                     \
    do {                                                                                \
        g_checks++;                                                                     \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);    \
            g_failed++;                                                                 \
        }                                                                               \
    } while (0)

static const size_t FILE_BYTES = 64 * 1024;

// a file whose byte at offset o is (o * 7 + 3) & 0xff
static std::string make_file() {
    char path[] = "/tmp/moecache-io-test-XXXXXX";
    const int fd = mkstemp(path);
    std::vector<unsigned char> b(FILE_BYTES);
    for (size_t o = 0; o < b.size(); o++) {
        b[o] = (unsigned char) ((o * 7 + 3) & 0xff);
    }
    if (fd < 0 || write(fd, b.data(), b.size()) != (ssize_t) b.size()) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    close(fd);
    return path;
}

static bool holds_file_bytes(const char * buf, uint64_t off, size_t len) {
    for (size_t i = 0; i < len; i++) {
        if ((unsigned char) buf[i] != (unsigned char) (((off + i) * 7 + 3) & 0xff)) {
            return false;
        }
    }
    return true;
}

static moecache_io_job read_job(char * dst, uint64_t off, size_t len) {
    moecache_io_job j = {};
    j.kind = MOECACHE_IO_READ;
    j.dst  = dst;
    j.off  = off;
    j.len  = len;
    return j;
}

struct queue {
    moecache_io io;
    std::vector<uint64_t> order; // offsets, in the order the jobs started
    explicit queue(const std::string & path) {
        io.fd      = open(path.c_str(), O_RDONLY);
        io.seq_log = &order;
    }
    ~queue() {
        moecache_io_stop(io);
        close(io.fd);
    }
};

static void test_demand_before_prefetch_then_by_score(const std::string & path) {
    queue q(path);
    std::vector<char> buf(4 * 4096, 0);
    moecache_io_req a, b, c;
    a.prefetch = b.prefetch = true;
    moecache_io_submit(q.io, a, read_job(&buf[0], 0, 4096), 0.2f);         // prefetch, low score
    moecache_io_submit(q.io, b, read_job(&buf[4096], 4096, 4096), 0.9f);   // prefetch, high score
    moecache_io_submit(q.io, c, read_job(&buf[8192], 8192, 4096), -1.0f);  // on demand
    moecache_io_submit(q.io, c, read_job(&buf[12288], 12288, 4096), -1.0f);
    CHECK(a.pending == 1 && b.pending == 1 && c.pending == 2);
    moecache_io_start(q.io, 1);
    // (waiting for a would promote it: watch the queue drain instead)
    while (!moecache_io_idle(q.io, a) || !moecache_io_idle(q.io, b) || !moecache_io_idle(q.io, c)) {
        usleep(1000);
    }
    CHECK(a.err == 0 && b.err == 0 && c.err == 0);
    CHECK(q.order == (std::vector<uint64_t>{ 8192, 12288, 4096, 0 }));
    CHECK(holds_file_bytes(buf.data(), 0, buf.size()));
    int64_t bd = 0, bp = 0;
    moecache_io_counters(q.io, &bd, &bp);
    CHECK(bd == 2 * 4096 && bp == 2 * 4096);
}

static void test_waiting_promotes_a_prefetch(const std::string & path) {
    queue q(path);
    std::vector<char> buf(3 * 4096, 0);
    moecache_io_req hi, lo, other;
    hi.prefetch = lo.prefetch = true;
    moecache_io_submit(q.io, hi, read_job(&buf[0], 0, 4096), 0.9f);
    moecache_io_submit(q.io, lo, read_job(&buf[4096], 4096, 4096), 0.1f);
    moecache_io_submit(q.io, other, read_job(&buf[8192], 8192, 4096), -1.0f);
    moecache_io_promote(q.io, lo); // a token selected lo's expert: it goes before every prefetch
    moecache_io_start(q.io, 1);
    CHECK(moecache_io_wait(q.io, lo) == 0);
    CHECK(moecache_io_wait(q.io, hi) == 0 && moecache_io_wait(q.io, other) == 0);
    CHECK(q.order == (std::vector<uint64_t>{ 8192, 4096, 0 })); // on demand first, then lo (promoted), then hi
    int64_t bd = 0, bp = 0;
    moecache_io_counters(q.io, &bd, &bp);
    CHECK(bd == 4096 && bp == 2 * 4096); // a promoted prefetch still counts as read ahead
}

static void test_cancel_drops_queued_jobs(const std::string & path) {
    queue q(path);
    std::vector<char> stale(3 * 4096, 0), fresh(4096, 0);
    moecache_io_req s, f;
    s.prefetch = true;
    for (int i = 0; i < 3; i++) {
        moecache_io_submit(q.io, s, read_job(&stale[i * 4096], (uint64_t) i * 4096, 4096), 0.5f);
    }
    moecache_io_submit(q.io, f, read_job(fresh.data(), 20480, 4096), -1.0f);
    CHECK(moecache_io_cancel(q.io, s) == 3);
    CHECK(s.pending == 0 && moecache_io_idle(q.io, s));
    CHECK(moecache_io_cancel(q.io, s) == 0); // cancelling twice drops nothing
    moecache_io_start(q.io, 1);
    CHECK(moecache_io_wait(q.io, f) == 0);
    CHECK(q.order == (std::vector<uint64_t>{ 20480 }));
    CHECK(holds_file_bytes(fresh.data(), 20480, 4096));
    bool untouched = true;
    for (char ch : stale) {
        untouched = untouched && ch == 0;
    }
    CHECK(untouched); // a cancelled read never writes its slot
    int64_t bd = 0, bp = 0;
    moecache_io_counters(q.io, &bd, &bp);
    CHECK(bd == 4096 && bp == 0);
}

static void test_errors_and_many_threads(const std::string & path) {
    queue q(path);
    moecache_io_start(q.io, 4);
    std::vector<char> buf(FILE_BYTES, 0);
    moecache_io_req all;
    for (size_t o = 0; o < FILE_BYTES; o += 1024) {
        moecache_io_submit(q.io, all, read_job(&buf[o], o, 1024), o % 2048 ? 0.3f : -1.0f);
    }
    CHECK(moecache_io_wait(q.io, all) == 0 && all.pending == 0);
    CHECK(holds_file_bytes(buf.data(), 0, FILE_BYTES));
    CHECK(q.order.size() == FILE_BYTES / 1024);
    std::vector<char> past(4096, 0);
    moecache_io_req bad;
    moecache_io_submit(q.io, bad, read_job(past.data(), FILE_BYTES - 1024, 4096), -1.0f); // runs past the end
    CHECK(moecache_io_wait(q.io, bad) == -1);
    CHECK(bad.err_off == FILE_BYTES - 1024 && bad.err_len == 4096);
    // the synchronous batch (prompts, page locks) still works beside the queue
    std::vector<moecache_io_job> jobs;
    std::vector<char> b2(8192, 0);
    jobs.push_back(read_job(&b2[0], 4096, 4096));
    jobs.push_back(read_job(&b2[4096], 8192, 4096));
    moecache_io_run(q.io, jobs);
    CHECK(jobs[0].err == 0 && jobs[1].err == 0 && jobs[0].got == 4096 && holds_file_bytes(b2.data(), 4096, 8192));
}

// ahead_limit = 1 with three readers: while a prefetch job runs, on-demand jobs still find free
// readers, and no second prefetch starts; the prefetches then run one at a time, by score
static void test_one_reader_ahead_leaves_the_rest_for_misses(const std::string & path) {
    queue q(path);
    std::vector<char> ahead(4 * 4096, 0), now(2 * 4096, 0);
    moecache_io_req p, d;
    p.prefetch = true;
    const float score[4] = { 0.1f, 0.7f, 0.4f, 0.9f };
    for (int i = 0; i < 4; i++) {
        moecache_io_submit(q.io, p, read_job(&ahead[i * 4096], (uint64_t) i * 4096, 4096), score[i]);
    }
    moecache_io_submit(q.io, d, read_job(&now[0], 32768, 4096), -1.0f);
    moecache_io_submit(q.io, d, read_job(&now[4096], 36864, 4096), -1.0f);
    q.io.ahead_running = 1; // as if a prefetch chunk were being read: the one reader ahead is busy
    moecache_io_start(q.io, 3, 1);
    CHECK(moecache_io_wait(q.io, d) == 0 && holds_file_bytes(now.data(), 32768, now.size()));
    usleep(50 * 1000); // room for a (wrong) second reader ahead to start
    CHECK(p.pending == 4 && q.order.size() == 2);
    {
        std::lock_guard<std::mutex> lock(q.io.mu);
        q.io.ahead_running = 0; // that chunk is done
        q.io.cv_work.notify_all();
    }
    for (int i = 0; i < 5000 && !moecache_io_idle(q.io, p); i++) {
        usleep(1000);
    }
    CHECK(p.pending == 0 && p.err == 0 && holds_file_bytes(ahead.data(), 0, ahead.size()));
    CHECK(q.order == (std::vector<uint64_t>{ 32768, 36864, 12288, 4096, 8192, 0 }));
    CHECK(q.io.ahead_peak == 1 && q.io.ahead_running == 0);
}

// ahead_yield: while an on-demand read is in flight no read ahead starts (the disk would share its
// bandwidth with it), however many readers are idle; an on-demand job still runs; once the last
// on-demand read ends, the reads ahead start. Without ahead_yield they start at once.
static void test_reads_ahead_wait_for_reads_on_demand(const std::string & path) {
    for (const bool yield : { true, false }) {
        queue q(path);
        q.io.ahead_yield = yield;
        std::vector<char> ahead(2 * 4096, 0), now(4096, 0);
        moecache_io_req p, d;
        p.prefetch = true;
        moecache_io_submit(q.io, p, read_job(&ahead[0], 0, 4096), 0.5f);
        moecache_io_submit(q.io, p, read_job(&ahead[4096], 4096, 4096), 0.9f);
        q.io.demand_reads = 1; // as if a read for a token were in flight
        moecache_io_start(q.io, 3);
        usleep(50 * 1000); // room for a (wrong) read ahead to start
        CHECK(p.pending == (yield ? 2 : 0));
        moecache_io_submit(q.io, d, read_job(&now[0], 32768, 4096), -1.0f);
        CHECK(moecache_io_wait(q.io, d) == 0 && holds_file_bytes(now.data(), 32768, now.size()));
        CHECK(q.io.demand_reads == 1); // (the pretended one is still in flight)
        usleep(50 * 1000);
        CHECK(p.pending == (yield ? 2 : 0));
        if (yield) {
            CHECK(q.order == (std::vector<uint64_t>{ 32768 }));
        }
        {
            std::lock_guard<std::mutex> lock(q.io.mu);
            q.io.demand_reads = 0; // it ended (as io_finish does for a real one, which also wakes the readers)
            q.io.cv_work.notify_all();
        }
        for (int i = 0; i < 5000 && !moecache_io_idle(q.io, p); i++) {
            usleep(1000);
        }
        CHECK(p.pending == 0 && p.err == 0 && holds_file_bytes(ahead.data(), 0, ahead.size()));
        if (yield) {
            CHECK(q.order == (std::vector<uint64_t>{ 32768, 4096, 0 }));
        }
    }
    // a real on-demand read holds the reads ahead back while it runs, and lets them go when it ends
    queue q(path);
    std::vector<char> ahead(4096, 0), now(4096, 0);
    moecache_io_req p, d;
    p.prefetch = true;
    moecache_io_submit(q.io, d, read_job(&now[0], 8192, 4096), -1.0f);
    moecache_io_submit(q.io, p, read_job(&ahead[0], 0, 4096), 0.5f);
    moecache_io_start(q.io, 2);
    for (int i = 0; i < 5000 && !moecache_io_idle(q.io, p); i++) {
        usleep(1000);
    }
    CHECK(p.pending == 0 && d.pending == 0 && q.io.demand_reads == 0);
    CHECK(q.order == (std::vector<uint64_t>{ 8192, 0 }));
}

// pages of [p, p + len) in the page cache
static size_t pages_in_memory(const char * p, size_t len) {
    const size_t ps = moecache_page_size();
    std::vector<unsigned char> vec((len + ps - 1) / ps);
    if (mincore((void *) p, len, vec.data()) != 0) {
        return 0;
    }
    size_t n = 0;
    for (unsigned char v : vec) {
        n += v & 1;
    }
    return n;
}

// a read-ahead job (the prompt's next layers) asks the kernel for pages of the mapping; it reads
// nothing into a buffer and counts as no read of the cache
static void test_read_ahead_brings_pages_in(const std::string & path) {
    queue q(path);
    moecache_io_start(q.io, 2);
    const size_t ps  = moecache_page_size();
    const size_t len = FILE_BYTES / 2 / ps * ps;
    char * map = (char *) mmap(nullptr, FILE_BYTES, PROT_READ, MAP_SHARED, q.io.fd, 0);
    CHECK(map != MAP_FAILED);
    if (map == MAP_FAILED) {
        return;
    }
    fdatasync(q.io.fd);
    posix_fadvise(q.io.fd, 0, 0, POSIX_FADV_DONTNEED);
    const bool dropped = pages_in_memory(map, FILE_BYTES) == 0; // (not on tmpfs)
    moecache_io_req r;
    moecache_io_job j = {};
    j.kind = MOECACHE_IO_AHEAD;
    j.src  = map + ps + 100; // (rounded out to whole pages)
    j.len  = len - ps;
    moecache_io_submit(q.io, r, j, 1.0f);
    CHECK(moecache_io_wait(q.io, r) == 0 && r.pending == 0);
    size_t in = 0;
    for (int i = 0; i < 5000 && in < len / ps; i++) { // the kernel's reads run on after the call
        in = pages_in_memory(map + ps, len);
        usleep(1000);
    }
    CHECK(in == len / ps);
    if (dropped) {
        CHECK(pages_in_memory(map + ps + len, FILE_BYTES - ps - len) == 0); // nothing past the range
    }
    int64_t bd, bp;
    moecache_io_counters(q.io, &bd, &bp);
    CHECK(bd == 0 && bp == 0);
    CHECK(holds_file_bytes(map + ps, ps, len));
    munmap(map, FILE_BYTES);
}

// the timeline: one event per job, on the thread that ran it, after it was queued, read or read
// ahead as its request says; the busy clock is exactly the union of the READ intervals recorded
static void test_timeline_and_busy_time(const std::string & path) {
    moecache_timeline tl; // (outlives the queue's threads)
    queue q(path);
    tl.cap = 64;
    tl.on.store(true);
    q.io.timeline = &tl;
    std::vector<char> buf(16 * 4096, 0);
    moecache_io_req now, ahead;
    ahead.prefetch = true;
    for (int i = 0; i < 16; i++) {
        moecache_io_job j = read_job(&buf[i * 4096], (uint64_t) i * 4096, 4096);
        j.il = i % 3;
        j.e  = i;
        moecache_io_submit(q.io, i % 4 ? now : ahead, j, i % 4 ? -1.0f : 0.5f);
    }
    moecache_io_start(q.io, 3);
    CHECK(moecache_io_wait(q.io, now) == 0 && moecache_io_wait(q.io, ahead) == 0);
    CHECK(holds_file_bytes(buf.data(), 0, buf.size()));
    std::vector<moecache_event> ev;
    {
        std::lock_guard<std::mutex> lock(tl.mu);
        ev = tl.ev;
    }
    CHECK(ev.size() == 16);
    int n_ahead = 0;
    std::vector<std::pair<int64_t, int64_t>> iv;
    for (const moecache_event & e : ev) {
        CHECK(e.thread >= 1 && e.thread <= 3);
        CHECK(e.t_queued_us <= e.t_start_us && e.t_start_us <= e.t_end_us);
        CHECK(e.bytes == 4096 && e.layer == e.expert % 3);
        CHECK(e.kind == (e.expert % 4 ? MOECACHE_EVENT_READ : MOECACHE_EVENT_READ_AHEAD));
        n_ahead += e.kind == MOECACHE_EVENT_READ_AHEAD;
        iv.emplace_back(e.t_start_us, e.t_end_us);
    }
    CHECK(n_ahead == 4);
    std::sort(iv.begin(), iv.end());
    int64_t uni = 0, s = iv[0].first, t = iv[0].second;
    for (const auto & x : iv) {
        if (x.first > t) {
            uni += t - s;
            s = x.first;
        }
        t = std::max(t, x.second);
    }
    uni += t - s;
    std::lock_guard<std::mutex> lock(q.io.mu);
    CHECK(q.io.reads_running == 0 && q.io.read_busy_us == uni);
}

static void test_timeline_capacity(const std::string & path) {
    moecache_timeline tl;
    queue q(path);
    tl.cap = 5;
    tl.on.store(true);
    q.io.timeline = &tl;
    moecache_io_start(q.io, 2);
    std::vector<char> buf(8 * 4096, 0);
    moecache_io_req r;
    for (int i = 0; i < 8; i++) {
        moecache_io_submit(q.io, r, read_job(&buf[i * 4096], (uint64_t) i * 4096, 4096), -1.0f);
    }
    CHECK(moecache_io_wait(q.io, r) == 0);
    std::lock_guard<std::mutex> lock(tl.mu);
    CHECK(tl.ev.size() == 5 && tl.dropped == 3);
}

int main() {
    const std::string path = make_file();
    test_demand_before_prefetch_then_by_score(path);
    test_waiting_promotes_a_prefetch(path);
    test_cancel_drops_queued_jobs(path);
    test_errors_and_many_threads(path);
    test_one_reader_ahead_leaves_the_rest_for_misses(path);
    test_reads_ahead_wait_for_reads_on_demand(path);
    test_read_ahead_brings_pages_in(path);
    test_timeline_and_busy_time(path);
    test_timeline_capacity(path);
    unlink(path.c_str());
    printf("%d checks, %d failed\n", g_checks, g_failed);
    return g_failed ? 1 : 0;
}
