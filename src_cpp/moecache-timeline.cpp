// moecache-timeline.cpp - the timeline's three functions of the C API (moecache-timeline.h: its events; the
// graph thread and the reader threads record them with moecache_timeline_add, moecache-io.cpp).

#include "moecache-impl.h"
#include "moecache-io.h"

#include <algorithm>
#include <cstring>
#include <string>

extern "C" int32_t moecache_timeline_start(struct moecache * mc, int32_t capacity) {
    if (!mc || capacity < 0) {
        moecache_set_error("moecache_timeline_start: NULL moecache or capacity < 0");
        return MOECACHE_ERR_INVALID;
    }
    std::lock_guard<std::mutex> lock(mc->timeline.mu);
    mc->timeline.on.store(false);
    mc->timeline.ev.clear();
    mc->timeline.dropped = 0;
    try {
        if (capacity == 0) {
            mc->timeline.ev.shrink_to_fit();
        } else {
            mc->timeline.ev.reserve((size_t) capacity);
        }
    } catch (const std::exception &) {
        mc->timeline.cap = 0;
        moecache_set_error("moecache_timeline_start: out of memory for " + std::to_string(capacity) + " events");
        return MOECACHE_ERR_NO_MEMORY;
    }
    mc->timeline.cap = (size_t) capacity;
    mc->timeline.on.store(capacity > 0);
    return MOECACHE_OK;
}

extern "C" int32_t moecache_timeline_get(const struct moecache * mc, struct moecache_event * out, int32_t cap,
                                         int64_t * n_dropped) {
    if (mc) {
        moecache_device_flush(const_cast<moecache &>(*mc)); // (a token counted after its graph: before this)
    }
    if (!mc || cap < 0 || (cap > 0 && !out)) {
        moecache_set_error("moecache_timeline_get: NULL argument or cap < 0");
        return MOECACHE_ERR_INVALID;
    }
    moecache_timeline & tl = mc->timeline;
    std::lock_guard<std::mutex> lock(tl.mu);
    const size_t n = std::min(tl.ev.size(), (size_t) cap);
    if (n > 0) {
        memcpy(out, tl.ev.data(), n * sizeof(moecache_event));
    }
    if (n_dropped) {
        *n_dropped = tl.dropped;
    }
    return (int32_t) tl.ev.size();
}

extern "C" int64_t moecache_time_now_us(void) {
    return moecache_time_us();
}
