// moecache-files.h - the files of ours (moecache-state.cpp): cache states, and the helpers shared with the
// usage profile's files (moecache-profile.cpp). Not installed.
#pragma once

#include "moecache-layer.h"

struct moecache;

// moecache-state.cpp: cache state files (status codes and messages as moecache_state_save/_load)
int32_t moecache_state_write(const moecache & mc, const char * path);
int32_t moecache_state_read(moecache & mc, const char * path);
// moecache-state.cpp: file helpers shared with moecache-profile.cpp (native endianness)
template <typename T> inline void moecache_put(std::vector<uint8_t> & b, const T & v) {
    const uint8_t * p = (const uint8_t *) &v;
    b.insert(b.end(), p, p + sizeof(T));
}
// bounds-checked reader over a file's bytes
struct moecache_reader {
    const uint8_t * p;
    size_t n;
    size_t pos = 0;
    bool get_bytes(void * out, size_t k) {
        if (k > n - pos) {
            return false;
        }
        memcpy(out, p + pos, k);
        pos += k;
        return true;
    }
    template <typename T> bool get(T & v) { return get_bytes(&v, sizeof(T)); }
};
uint64_t moecache_fnv1a64(const uint8_t * p, size_t n);
// writes b to a temporary file beside path, syncs it and renames it over path; MOECACHE_ERR_IO
// with "cannot write <what> to '<path>': ..." on failure
int32_t  moecache_write_file_atomic(const std::vector<uint8_t> & b, const char * path, const char * what);
// 'path', as file names appear in messages
std::string moecache_quoted(const char * path);
// the whole regular file (never a FIFO or device), at most max_bytes; errors name `what`
int32_t  moecache_read_file(const char * path, size_t max_bytes, const char * what, std::vector<uint8_t> & out);
// every file of ours starts with: magic | u32 abi | u32 len + desc | u64 n_params | i32 n_layer, N, K
// and ends with the u64 FNV-1a hash of every byte before it
std::vector<uint8_t> moecache_file_header(const moecache & mc, const char magic[8]);
// reads path whole and checks its magic, checksum, ABI and that it belongs to mc's model (errors
// name `what`); on MOECACHE_OK, r reads buf from after the header up to the checksum
int32_t  moecache_read_checked(const moecache & mc, const char * path, const char magic[8], size_t max_bytes,
                               const char * what, std::vector<uint8_t> & buf, moecache_reader & r);
