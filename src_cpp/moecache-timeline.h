// moecache-timeline.h - the events of a timeline (moecache_timeline_start, moecache.h): what the graph thread
// and the reader threads did, and when. Part of the public C API (moecache.h includes it); the reader threads
// (moecache-io.h) record into it without the rest of the API.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Timeline (moecache_timeline_start): what the graph thread and the reader threads did, and when.
// Times are moecache_time_now_us(), a monotonic clock in microseconds.
enum moecache_event_kind {
    MOECACHE_EVENT_ROUTE      = 0, // graph thread: a layer's routing decision of a decoded token (and the
                                   //   prefetch it issues)
    MOECACHE_EVENT_WAIT       = 1, // graph thread: a layer's residency op: it queues the reads its experts
                                   //   need (STREAM decode; without overlap_experts it also waits for them),
                                   //   copies or locks them (prompt, MMAP); the layer's expert matmuls start
                                   //   at t_end_us; `expert` is -1. With overlap_experts, the expert
                                   //   matmuls then wait for each selected expert still being read: one
                                   //   WAIT per wait, `expert` the expert waited for
    MOECACHE_EVENT_READ       = 2, // reader thread: a read of an expert a token selected (on demand)
    MOECACHE_EVENT_READ_AHEAD = 3, // reader thread: a read ahead of the routing (prefetch, a prompt's read-ahead)
    MOECACHE_EVENT_LOCK       = 4, // reader thread: MMAP locking an expert's pages
    MOECACHE_EVENT_COPY       = 5, // reader thread: a prompt copying an expert out of the mapping into its slot
    MOECACHE_EVENT_EXPERT     = 6, // graph thread, STREAM decode with overlap_experts: the input-side matmuls
                                   //   (up, gate) of the selected expert `expert`, once its bytes were in
    MOECACHE_EVENT_COPY_UP    = 7, // graph thread, VRAM tier: copying expert `expert` from its host slot into
                                   //   device memory (`bytes`): t_queued_us when the copy was decided or
                                   //   its read waited for, t_start_us when it was sent, t_end_us when
                                   //   the device had it (vram_copy ASYNC: when the layer's copies were
                                   //   waited for, after the CPU's matmuls; they start at the decision)
    MOECACHE_EVENT_LOWBIT     = 8, // reader thread, lowbit: reading (a piece of) expert `expert`'s low-bit copy
                                   //   from the companion into its pool slot, for this token (`bytes`)
};

struct moecache_event {
    int32_t kind;        // enum moecache_event_kind
    int32_t layer;       // the layer
    int32_t expert;      // READ*, LOCK, COPY, EXPERT, COPY_UP: the expert; WAIT: -1 or the expert (above); -1 otherwise
    int32_t thread;      // 0: the graph thread (or a caller running a job itself); 1..: reader thread
    int32_t n_tokens;    // ROUTE, WAIT, EXPERT: tokens of the ubatch (1: a decode); 0 otherwise
    int32_t pad;
    int64_t t_queued_us; // READ*, LOCK, COPY: when the job was queued; = t_start_us otherwise
    int64_t t_start_us;
    int64_t t_end_us;
    int64_t bytes;       // READ*, LOCK, COPY: bytes requested from storage (one piece of an expert); COPY_UP: bytes
                         //   copied to the device; 0 otherwise
};

#ifdef __cplusplus
}
#endif
