// The few names of llama.cpp's common/log.h that tests/test-llama-archs.cpp uses, so that
// make-arch-models.cpp can compile that file against libllama alone (common/ is not built).
// Messages go to stderr when their level is at most the threshold.
#pragma once

#include <cstdio>

#define LOG_LEVEL_DEBUG  5
#define LOG_LEVEL_TRACE  4
#define LOG_LEVEL_INFO   3
#define LOG_LEVEL_WARN   2
#define LOG_LEVEL_ERROR  1
#define LOG_LEVEL_OUTPUT 0

struct common_log;

inline int & moecache_archs_log_thold() {
    static int thold = LOG_LEVEL_ERROR;
    return thold;
}

inline void        common_log_set_verbosity_thold(int v) { moecache_archs_log_thold() = v; }
inline common_log * common_log_main() { return nullptr; }
inline void        common_log_flush(common_log *) { fflush(stderr); }

// llama.cpp's ggml log levels (GGML_LOG_LEVEL_*) mapped to the verbosity scale above
inline int common_log_get_verbosity(int ggml_level) {
    switch (ggml_level) {
        case 1:  return LOG_LEVEL_DEBUG;  // GGML_LOG_LEVEL_DEBUG
        case 2:  return LOG_LEVEL_INFO;   // GGML_LOG_LEVEL_INFO
        case 3:  return LOG_LEVEL_WARN;   // GGML_LOG_LEVEL_WARN
        case 4:  return LOG_LEVEL_ERROR;  // GGML_LOG_LEVEL_ERROR
        default: return LOG_LEVEL_INFO;
    }
}

#define MOECACHE_ARCHS_LOG(level, ...) \
    do { if ((level) <= moecache_archs_log_thold()) { fprintf(stderr, __VA_ARGS__); } } while (0)

#define LOG(...)     MOECACHE_ARCHS_LOG(LOG_LEVEL_OUTPUT, __VA_ARGS__)
#define LOG_DBG(...) MOECACHE_ARCHS_LOG(LOG_LEVEL_DEBUG,  __VA_ARGS__)
#define LOG_INF(...) MOECACHE_ARCHS_LOG(LOG_LEVEL_INFO,   __VA_ARGS__)
#define LOG_WRN(...) MOECACHE_ARCHS_LOG(LOG_LEVEL_WARN,   __VA_ARGS__)
#define LOG_ERR(...) MOECACHE_ARCHS_LOG(LOG_LEVEL_ERROR,  __VA_ARGS__)
