// moecache-io.cpp - the reader threads (moecache-io.h).

#include "moecache-io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/mman.h>

#define MOECACHE_IO_ALIGN 4096          // O_DIRECT: offset, length and buffer aligned to this
#define MOECACHE_IO_CHUNK (256 * 1024)  // largest single read; experts are read in pieces in parallel

static void io_read(moecache_io & io, moecache_io_job & j) {
    j.err = 0;
    j.got = 0;
    const bool direct = io.fd_direct >= 0;
    if (!direct || (j.off % MOECACHE_IO_ALIGN == 0 && j.len % MOECACHE_IO_ALIGN == 0 &&
                    (uintptr_t) j.dst % MOECACHE_IO_ALIGN == 0)) {
        const int fd = direct ? io.fd_direct : io.fd;
        while (j.got < j.len) {
            const ssize_t n = pread(fd, j.dst + j.got, j.len - j.got, (off_t) (j.off + j.got));
            if (n < 0 && errno == EINTR) {
                continue;
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
            posix_fadvise(io.fd, (off_t) j.off, (off_t) j.len, POSIX_FADV_DONTNEED); // the slot is the only copy
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
        const ssize_t n = pread(io.fd_direct, bounce + got, win - got, (off_t) (a0 + got));
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

static void io_lock(moecache_io & io, moecache_io_job & j) {
    j.err = 0;
    j.bytes_io = j.len;
    {
        const uintptr_t p0 = (uintptr_t) j.src / moecache_page_size() * moecache_page_size();
        madvise((void *) p0, moecache_round_up((uintptr_t) j.src + j.len - p0, moecache_page_size()), MADV_WILLNEED);
    }
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

static void io_run_job(moecache_io & io, moecache_io_job & j) {
    switch (j.kind) {
        case MOECACHE_IO_READ: io_read(io, j); break;
        case MOECACHE_IO_COPY: memcpy(j.dst, j.src, j.len); j.err = 0; j.got = j.len; j.bytes_io = j.len; break;
        case MOECACHE_IO_LOCK: io_lock(io, j); break;
    }
}

static void io_worker(moecache_io * io) {
    std::unique_lock<std::mutex> lock(io->mu);
    while (true) {
        io->cv_work.wait(lock, [io] { return io->stop || io->next < io->n_jobs; });
        if (io->stop) {
            return;
        }
        moecache_io_job & j = io->jobs[io->next++];
        lock.unlock();
        io_run_job(*io, j);
        lock.lock();
        if (++io->n_done == io->n_jobs) {
            io->cv_done.notify_all();
        }
    }
}

void moecache_io_run(moecache_io & io, std::vector<moecache_io_job> & jobs) {
    if (jobs.empty()) {
        return;
    }
    if (jobs.size() == 1 || io.workers.empty()) {
        for (moecache_io_job & j : jobs) {
            io_run_job(io, j);
        }
        return;
    }
    std::unique_lock<std::mutex> lock(io.mu);
    io.jobs   = jobs.data();
    io.n_jobs = jobs.size();
    io.next   = 0;
    io.n_done = 0;
    io.cv_work.notify_all();
    io.cv_done.wait(lock, [&io] { return io.n_done == io.n_jobs; });
    io.jobs   = nullptr;
    io.n_jobs = 0;
    io.next   = 0;
}

void moecache_io_start(moecache_io & io, int32_t n_threads) {
    for (int32_t i = 0; i < n_threads; i++) {
        io.workers.emplace_back(io_worker, &io);
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
}
