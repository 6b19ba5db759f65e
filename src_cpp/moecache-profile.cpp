// moecache-profile.cpp - what requests selected: the current request's expert counts (ACTIVATION
// eviction, PREFETCH_TRACE), the usage profile of past requests and its files, the warm start and
// pins it gives, and the trace store PREFETCH_TRACE matches against (MoE-Infinity's bounded,
// deduplicated collection of request activation matrices).

#include "moecache-impl.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

static int32_t fail(int32_t status, const std::string & msg) {
    moecache_set_error(msg);
    return status;
}

// --- the current request, and the trace store of past ones (PREFETCH_TRACE) ------------------

#define MOECACHE_TRACE_STORE 32      // past requests kept
#define MOECACHE_TRACE_MERGE 0.95    // cosine above which a finished request is merged into a stored one
#define MOECACHE_TRACE_MIN_TOKENS 8  // shorter requests are not stored

void moecache_request_count(moecache & mc, const moecache_layer & L, const int32_t * sel, int32_t n_sel) {
    if (mc.prof.req_counts.empty()) {
        mc.prof.req_counts.assign((size_t) mc.n_layer * mc.n_expert, 0.0f);
    }
    float * row = &mc.prof.req_counts[(size_t) L.il * mc.n_expert];
    for (int32_t i = 0; i < n_sel; i++) {
        row[sel[i]] += 1.0f;
    }
}

// one layer's counts scaled to sum 1 (a row without counts stays 0)
static void row_share(const float * counts, float * out, int32_t N) {
    double sum = 0.0;
    for (int32_t e = 0; e < N; e++) {
        sum += counts[e];
    }
    for (int32_t e = 0; e < N; e++) {
        out[e] = sum > 0.0 ? (float) (counts[e] / sum) : 0.0f;
    }
}

// cosine of a and b over layers [0, n_rows)
static double cosine_rows(const moecache & mc, const float * a, const float * b, int32_t n_rows) {
    double ab = 0.0, aa = 0.0, bb = 0.0;
    for (size_t i = 0; i < (size_t) n_rows * mc.n_expert; i++) {
        ab += (double) a[i] * b[i];
        aa += (double) a[i] * a[i];
        bb += (double) b[i] * b[i];
    }
    return aa > 0.0 && bb > 0.0 ? ab / std::sqrt(aa * bb) : 0.0;
}

void moecache_profile_begin_request(moecache & mc) {
    if (!mc.prof.req_counts.empty()) { // the usage profile: every request, however short
        if (mc.prof.counts.empty()) {
            mc.prof.counts.assign(mc.prof.req_counts.size(), 0.0);
        }
        for (size_t i = 0; i < mc.prof.req_counts.size(); i++) {
            mc.prof.counts[i] += (double) mc.prof.req_counts[i];
        }
    }
    double total = 0.0; // tokens of the request: selections / (K x layers that routed)
    int32_t rows = 0;
    for (int32_t il = 0; il < mc.n_layer && !mc.prof.req_counts.empty(); il++) {
        double sum = 0.0;
        for (int32_t e = 0; e < mc.n_expert; e++) {
            sum += mc.prof.req_counts[(size_t) il * mc.n_expert + e];
        }
        total += sum;
        rows  += sum > 0.0;
    }
    const double tokens = rows > 0 ? total / ((double) mc.n_expert_used * rows) : 0.0;
    if (tokens >= MOECACHE_TRACE_MIN_TOKENS) {
        std::vector<float> share(mc.prof.req_counts.size());
        for (int32_t il = 0; il < mc.n_layer; il++) {
            row_share(&mc.prof.req_counts[(size_t) il * mc.n_expert], &share[(size_t) il * mc.n_expert], mc.n_expert);
        }
        int32_t same = -1;
        for (int32_t k = 0; k < (int32_t) mc.prof.trace_store.size() && same < 0; k++) {
            if (cosine_rows(mc, share.data(), mc.prof.trace_store[k].data(), mc.n_layer) > MOECACHE_TRACE_MERGE) {
                same = k;
            }
        }
        if (same >= 0) { // deduplicated: the stored one moves halfway toward the new one
            for (size_t i = 0; i < share.size(); i++) {
                mc.prof.trace_store[same][i] = 0.5f * (mc.prof.trace_store[same][i] + share[i]);
            }
        } else {
            if ((int32_t) mc.prof.trace_store.size() >= MOECACHE_TRACE_STORE) {
                mc.prof.trace_store.erase(mc.prof.trace_store.begin()); // the oldest goes
            }
            mc.prof.trace_store.push_back(std::move(share));
        }
    }
    std::fill(mc.prof.req_counts.begin(), mc.prof.req_counts.end(), 0.0f);
    mc.prof.trace_best       = -1;
    mc.prof.trace_best_layer = -1;
}

bool moecache_trace_predict(moecache & mc, int32_t il, int32_t target, float * score) {
    if (mc.prof.req_counts.empty()) {
        return false;
    }
    const size_t N = (size_t) mc.n_expert;
    // the request's shares of layers 0..il and of the target (no other row is read)
    std::vector<float> & now = mc.prof.req_share;
    now.resize(mc.prof.req_counts.size());
    for (int32_t l = 0; l <= il; l++) {
        row_share(&mc.prof.req_counts[(size_t) l * N], &now[(size_t) l * N], (int32_t) N);
    }
    row_share(&mc.prof.req_counts[(size_t) target * N], &now[(size_t) target * N], (int32_t) N);
    // the best match of the request so far, over layers 0..il (remade at each layer: the counts grow)
    mc.prof.trace_best = -1;
    double best = 0.0;
    for (int32_t k = 0; k < (int32_t) mc.prof.trace_store.size(); k++) {
        const double c = cosine_rows(mc, now.data(), mc.prof.trace_store[k].data(), il + 1);
        if (c > best) {
            best          = c;
            mc.prof.trace_best = k;
        }
    }
    mc.prof.trace_best_layer = il;
    bool any = false;
    for (size_t e = 0; e < N; e++) {
        const float past = mc.prof.trace_best >= 0 ? mc.prof.trace_store[mc.prof.trace_best][target * N + e] : 0.0f;
        score[e] = past + 0.5f * now[target * N + e]; // the past request, then this request's own habits
        any = any || score[e] > 0.0f;
    }
    return any;
}


// --- profile files -------------------------------------------------------------------------------
//   "MOEPROF1" | u32 abi | u32 len + desc | u64 n_params | i32 n_layer, N, K
//   f64 counts[n_layer * N] (past requests plus the current one) | u32 n_store
//   f32 store[n_store][n_layer * N] (each layer's row sums to 1, or is 0)
//   u64 FNV-1a hash of every byte before it

static const char   PROFILE_MAGIC[8]  = {'M', 'O', 'E', 'P', 'R', 'O', 'F', '1'};
static const size_t PROFILE_MAX_BYTES = 1024u << 20;

int32_t moecache_profile_write(const moecache & mc, const char * path) {
    const size_t n = (size_t) mc.n_layer * mc.n_expert;
    std::vector<uint8_t> b = moecache_file_header(mc, PROFILE_MAGIC);
    for (size_t i = 0; i < n; i++) { // the current request counts too: a profile saved mid-request loses nothing
        const double past = mc.prof.counts.empty() ? 0.0 : mc.prof.counts[i];
        const double now  = mc.prof.req_counts.empty() ? 0.0 : (double) mc.prof.req_counts[i];
        moecache_put(b, past + now);
    }
    moecache_put(b, (uint32_t) mc.prof.trace_store.size());
    for (const std::vector<float> & t : mc.prof.trace_store) {
        b.insert(b.end(), (const uint8_t *) t.data(), (const uint8_t *) (t.data() + t.size()));
    }
    moecache_put(b, moecache_fnv1a64(b.data(), b.size()));
    return moecache_write_file_atomic(b, path, "usage profile");
}

int32_t moecache_profile_read(moecache & mc, const char * path) {
    std::vector<uint8_t> buf;
    moecache_reader r = {};
    const int32_t rc = moecache_read_checked(mc, path, PROFILE_MAGIC, PROFILE_MAX_BYTES, "usage profile", buf, r);
    if (rc != MOECACHE_OK) {
        return rc;
    }
    const std::string corrupt = moecache_quoted(path) + " is corrupt: ";
    const int32_t n_layer = mc.n_layer, N = mc.n_expert;
    // read and check everything first: a bad file leaves the profile untouched
    const size_t n = (size_t) n_layer * N;
    std::vector<double> counts(n);
    for (size_t i = 0; i < n; i++) {
        if (!r.get(counts[i])) {
            return fail(MOECACHE_ERR_CORRUPT, corrupt + "truncated counts");
        }
        if (!std::isfinite(counts[i]) || counts[i] < 0.0 || counts[i] > 1e15) {
            return fail(MOECACHE_ERR_CORRUPT, corrupt + "an expert count out of range");
        }
    }
    uint32_t n_store = 0;
    if (!r.get(n_store) || n_store > MOECACHE_TRACE_STORE) {
        return fail(MOECACHE_ERR_CORRUPT, corrupt + "bad number of stored requests");
    }
    std::vector<std::vector<float>> store(n_store, std::vector<float>(n));
    for (uint32_t k = 0; k < n_store; k++) {
        if (!r.get_bytes(store[k].data(), n * sizeof(float))) {
            return fail(MOECACHE_ERR_CORRUPT, corrupt + "truncated request store");
        }
        for (int32_t il = 0; il < n_layer; il++) {
            double row = 0.0;
            for (int32_t e = 0; e < N; e++) {
                const float v = store[k][(size_t) il * N + e];
                if (!(v >= 0.0f && v <= 1.0f)) {
                    return fail(MOECACHE_ERR_CORRUPT, corrupt + "a stored request share out of range");
                }
                row += v;
            }
            if (row > 1.001) {
                return fail(MOECACHE_ERR_CORRUPT, corrupt + "a stored request's shares sum above 1");
            }
        }
    }
    if (r.pos != r.n) {
        return fail(MOECACHE_ERR_CORRUPT, corrupt + "trailing bytes");
    }
    mc.prof.counts = std::move(counts);
    mc.prof.trace_store    = std::move(store);
    std::fill(mc.prof.req_counts.begin(), mc.prof.req_counts.end(), 0.0f); // its tokens are in the loaded profile or lost
    mc.prof.trace_best       = -1;
    mc.prof.trace_best_layer = -1;
    return MOECACHE_OK;
}

int32_t moecache_profile_hottest(const moecache & mc, int32_t il, std::vector<int32_t> & hot) {
    const int32_t N = mc.n_expert;
    hot.resize(N);
    if (mc.prof.counts.empty()) {
        return 0;
    }
    const double * c = &mc.prof.counts[(size_t) il * N];
    int32_t n_hot = 0;
    for (int32_t e = 0; e < N; e++) {
        if (c[e] > 0.0) {
            hot[n_hot++] = e;
        }
    }
    // most selected first; equal counts: the more recently cached, then the more router
    // probability (decayed), then the lower id: the id decides only what nothing else tells apart
    // (a profile loaded into a fresh process knows counts alone)
    const moecache_layer & L = mc.layers[il];
    std::sort(hot.begin(), hot.begin() + n_hot, [c, &L](int32_t a, int32_t b) {
        if (c[a] != c[b]) {
            return c[a] > c[b];
        }
        if (L.last_use[a] != L.last_use[b]) {
            return L.last_use[a] > L.last_use[b];
        }
        if (L.use.mass[a] != L.use.mass[b]) {
            return L.use.mass[a] > L.use.mass[b];
        }
        return a < b;
    });
    return n_hot;
}

int32_t moecache_profile_warm_start(moecache & mc, int32_t n_pin) {
    if (n_pin < 0) {
        return fail(MOECACHE_ERR_INVALID, "n_pin = " + std::to_string(n_pin) + " must be >= 0");
    }
    int32_t pinned = 0;
    std::vector<int32_t> hot;
    for (moecache_layer & L : mc.layers) {
        const int32_t n_hot = std::min(moecache_profile_hottest(mc, L.il, hot), L.capacity); // (before L empties)
        moecache_layer_empty(L);
        if (mc.prof.counts.empty()) {
            continue;
        }
        for (int32_t i = n_hot - 1; i >= 0; i--) { // the hottest is inserted last: the most recent
            moecache_layer_insert(L, hot[i], nullptr);
        }
        const int32_t n_layer_pin = std::min(n_pin, std::min(n_hot, std::max(0, L.capacity - mc.n_expert_used)));
        for (int32_t i = 0; i < n_layer_pin; i++) {
            L.use.pinned[hot[i]] = 1;
        }
        L.use.n_pinned = n_layer_pin;
        pinned += n_layer_pin;
    }
    return pinned;
}
