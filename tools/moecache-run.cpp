// moecache-run - a small command-line driver over the public llama.h + moecache.h API (no Python).
//
// For devices and emulators where the Python package is not at hand: qemu-user (scripts/
// test_aarch64.sh), `adb shell` on Android (scripts/build_android.sh), Termux, macOS/Metal.
// It loads a GGUF, attaches a moecache, decodes the prompt and then greedily (argmax, so the
// run is deterministic) n tokens, and prints a stable text report on stdout:
//
//     moecache-run 1
//     model n_layer=.. n_expert=.. n_expert_used=..
//     config cache=.. routing=..
//     prompt <token ids>
//     gen <i> <token id>                        one line per generated token
//     sel L=<layer> T=<token> <e0>,<e1>,..  hit=<bits> topk=<bits>   (--trace: one line per layer and token)
//     z L=<layer> T=<token> <z0> <z1> ..        (--trace: the router logits of that selection)
//     layer <il> tokens=.. hits=.. misses=.. hit_rate=..
//     total tokens=.. selections=.. hits=.. misses=.. evictions=.. hit_rate=.. misses_per_token=..
//
// Logs, timings and the decoded text go to stderr, so the stdout of two machines can be diffed.
//
//     moecache-run -m model.gguf -p "Once upon a time" -n 16 --cache 30 --routing prior:0.5 --trace
//     moecache-run --quantize model.gguf model.Q8_0.gguf Q8_0
//
// Build: cmake -DMOECACHE_BUILD_TOOLS=ON (target moecache-run).

#include "llama.h"
#include "moecache.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

void usage(FILE * f) {
    fprintf(f,
        "usage: moecache-run -m MODEL [options]\n"
        "       moecache-run --quantize SRC DST [Q8_0|Q4_K_M|F16]\n"
        "\n"
        "  -m, --model PATH       GGUF model (required)\n"
        "  -p, --prompt TEXT      prompt (default \"Once upon a time\")\n"
        "  -n, --n-predict N      tokens to generate greedily, EOG ignored (default 16)\n"
        "  -c, --ctx N            context size (default 512)\n"
        "  -t, --threads N        CPU threads (default 2)\n"
        "  -ngl, --n-gpu-layers N layers offloaded to a GPU backend (Metal, CUDA; default 0)\n"
        "  --cache N|F            experts cached per MoE layer: a count N, or a share 0 < F < 1 with\n"
        "                         a decimal point (default 0.5)\n"
        "  --routing SPEC         topk (= lru), prior:L, max-rank:M, cumsum:T, prune:R, each with an\n"
        "                         optional :j=J (default topk; J default: 1 for K <= 3, 2 for K >= 4)\n"
        "  --scope all|decode     decode: prompts use stock top-k routing (default all)\n"
        "  --no-prompt-update     prompt ubatches do not update the cache and counters\n"
        "  --residency MODE       none (every expert resident), mmap (cached experts mlocked in the\n"
        "                         mapping, evicted ones dropped) or stream (cached experts in an mlocked\n"
        "                         slot arena, misses read from the file) (default none)\n"
        "  --trace                print the selected experts of every layer and token\n"
        "  -fa, --flash-attn      flash attention (default off, as in llama-cpp-python, so the two\n"
        "                         runs agree bit for bit)\n"
        "  --mlock                lock the model in memory (llama.cpp use_mlock; warns if the limit is too low)\n"
        "  --no-mmap              read the model into memory instead of mapping it\n"
        "  --stop-at-eog          stop at an end-of-generation token\n"
        "  -v, --verbose          llama.cpp's log on stderr\n"
        "  -h, --help             this text\n");
}

bool g_verbose = false;

void log_cb(enum ggml_log_level level, const char * text, void * ud) {
    (void) ud;
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

[[noreturn]] void die(const char * fmt, const char * arg = "") {
    fprintf(stderr, "moecache-run: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(2);
}

bool parse_int(const std::string & s, long & out) {
    char * end = nullptr;
    out = strtol(s.c_str(), &end, 10);
    return !s.empty() && end && *end == '\0';
}

bool parse_float(const std::string & s, float & out) {
    char * end = nullptr;
    out = strtof(s.c_str(), &end);
    return !s.empty() && end && *end == '\0';
}

// "prior:0.5", "max-rank:8:j=2", "topk", "lru", ...
bool parse_routing(const std::string & spec, moecache_routing_params & rp) {
    std::vector<std::string> parts;
    size_t start = 0;
    while (true) {
        const size_t pos = spec.find(':', start);
        parts.push_back(spec.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
        if (pos == std::string::npos) break;
        start = pos + 1;
    }
    const std::string & name = parts[0];
    size_t next = 1;
    long  iv = 0;
    float fv = 0.0f;
    if (name == "topk" || name == "lru") {
        rp.policy = MOECACHE_POLICY_TOPK;
    } else if (name == "prior" || name == "max-rank" || name == "cumsum" || name == "prune") {
        if (parts.size() < 2) return false;
        const std::string & v = parts[1];
        next = 2;
        if (name == "prior") {
            if (!parse_float(v, fv)) return false;
            rp.policy = MOECACHE_POLICY_PRIOR;
            rp.prior_lambda = fv;
        } else if (name == "cumsum") {
            if (!parse_float(v, fv)) return false;
            rp.policy = MOECACHE_POLICY_CUMSUM;
            rp.cumsum_tau = fv;
        } else if (name == "max-rank") {
            if (!parse_int(v, iv)) return false;
            rp.policy = MOECACHE_POLICY_MAX_RANK;
            rp.max_rank = (int32_t) iv;
        } else {
            if (!parse_int(v, iv)) return false;
            rp.policy = MOECACHE_POLICY_PRUNE;
            rp.prune_rank = (int32_t) iv;
        }
    } else {
        return false;
    }
    for (; next < parts.size(); next++) {
        const std::string & p = parts[next];
        if (p.rfind("j=", 0) != 0 || !parse_int(p.substr(2), iv)) return false;
        rp.top_j = (int32_t) iv;
    }
    return true;
}

int quantize(int argc, char ** argv) {
    if (argc < 4) {
        usage(stderr);
        return 2;
    }
    const std::string type = argc > 4 ? argv[4] : "Q8_0";
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    if (type == "Q8_0") {
        qp.ftype = LLAMA_FTYPE_MOSTLY_Q8_0;
    } else if (type == "Q4_K_M") {
        qp.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M;
    } else if (type == "F16") {
        qp.ftype = LLAMA_FTYPE_MOSTLY_F16;
    } else {
        die("unknown quantization type %s (Q8_0, Q4_K_M, F16)", type.c_str());
    }
    qp.nthread = 2;
    llama_backend_init();
    const uint32_t rc = llama_model_quantize(argv[2], argv[3], &qp);
    llama_backend_free();
    if (rc != 0) {
        die("quantizing %s failed", argv[2]);
    }
    return 0;
}

std::string bits(uint32_t mask, int n) {
    std::string s;
    for (int i = 0; i < n; i++) s += (mask >> i) & 1u ? '1' : '0';
    return s;
}

double rate(int64_t num, int64_t den) {
    return den > 0 ? (double) num / (double) den : 0.0;
}

} // namespace

int main(int argc, char ** argv) {
    if (argc > 1 && strcmp(argv[1], "--quantize") == 0) {
        llama_log_set(log_cb, nullptr);
        return quantize(argc, argv);
    }

    std::string model_path;
    std::string prompt      = "Once upon a time";
    std::string routing     = "topk";
    std::string cache       = "0.5";
    std::string scope       = "all";
    std::string residency   = "none";
    long n_predict = 16, n_ctx = 512, n_threads = 2, n_gpu_layers = 0;
    bool trace = false, flash_attn = false, mlock = false, no_mmap = false, stop_at_eog = false, prompt_update = true;

    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) die("%s needs a value", a.c_str());
            return argv[++i];
        };
        auto int_value = [&]() -> long {
            const std::string v = value();
            long x = 0;
            if (!parse_int(v, x) || x < 0) die("%s: not a non-negative integer", v.c_str());
            return x;
        };
        if (a == "-m" || a == "--model") model_path = value();
        else if (a == "-p" || a == "--prompt") prompt = value();
        else if (a == "-n" || a == "--n-predict") n_predict = int_value();
        else if (a == "-c" || a == "--ctx") n_ctx = int_value();
        else if (a == "-t" || a == "--threads") n_threads = int_value();
        else if (a == "-ngl" || a == "--n-gpu-layers") n_gpu_layers = int_value();
        else if (a == "--cache") cache = value();
        else if (a == "--routing") routing = value();
        else if (a == "--scope") scope = value();
        else if (a == "--residency") residency = value();
        else if (a == "--no-prompt-update") prompt_update = false;
        else if (a == "--trace") trace = true;
        else if (a == "-fa" || a == "--flash-attn") flash_attn = true;
        else if (a == "--mlock") mlock = true;
        else if (a == "--no-mmap") no_mmap = true;
        else if (a == "--stop-at-eog") stop_at_eog = true;
        else if (a == "-v" || a == "--verbose") g_verbose = true;
        else if (a == "-h" || a == "--help") { usage(stdout); return 0; }
        else { usage(stderr); die("unknown option %s", a.c_str()); }
    }
    if (model_path.empty()) {
        usage(stderr);
        die("no model (-m)");
    }
    if (n_threads < 1) n_threads = 1;

    moecache_cache_params   cp = moecache_cache_default_params();
    moecache_routing_params rp = moecache_routing_default_params();
    rp.top_j = -1; // no :j=J: the model's default, set once K is known (below)
    if (!parse_routing(routing, rp)) die("bad --routing %s (topk, prior:L, max-rank:M, cumsum:T, prune:R, :j=J)", routing.c_str());
    const bool default_j = rp.top_j < 0;
    if (default_j) rp.top_j = 1;
    if (scope == "all") rp.scope = MOECACHE_SCOPE_ALL;
    else if (scope == "decode") rp.scope = MOECACHE_SCOPE_DECODE;
    else die("bad --scope %s (all, decode)", scope.c_str());
    {
        long  n = 0;
        float f = 0.0f;
        if (cache.find('.') == std::string::npos && parse_int(cache, n) && n >= 0) {
            cp.n_cached = (int32_t) n;
        } else if (parse_float(cache, f) && f >= 0.0f && f <= 1.0f) {
            cp.n_cached = -1;
            cp.fraction = f;
        } else {
            die("bad --cache %s (a count, or a share in [0, 1] with a decimal point)", cache.c_str());
        }
    }
    cp.update_on_prompt = prompt_update;
    if (residency == "none") cp.residency = MOECACHE_RESIDENCY_NONE;
    else if (residency == "mmap") cp.residency = MOECACHE_RESIDENCY_MMAP;
    else if (residency == "stream") cp.residency = MOECACHE_RESIDENCY_STREAM;
    else die("bad --residency %s (none, mmap, stream)", residency.c_str());
    cp.model_path = model_path.c_str();

    llama_log_set(log_cb, nullptr);
    llama_backend_init();
    fprintf(stderr, "%s\n", moecache_version());

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = (int32_t) n_gpu_layers;
    mparams.load_mode    = no_mmap ? (mlock ? LLAMA_LOAD_MODE_MLOCK : LLAMA_LOAD_MODE_NONE)
                                   : (mlock ? LLAMA_LOAD_MODE_MMAP_MLOCK : LLAMA_LOAD_MODE_MMAP);
    const auto t_load = std::chrono::steady_clock::now();
    moecache_set_load_residency(cp.residency); // mmap/stream: experts in file layout, not prefetched
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    moecache_set_load_residency(MOECACHE_RESIDENCY_NONE);
    if (!model) die("cannot load %s", model_path.c_str());
    const llama_vocab * vocab = llama_model_get_vocab(model);

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = (uint32_t) n_ctx;
    cparams.n_batch         = (uint32_t) n_ctx;
    cparams.n_ubatch        = (uint32_t) n_ctx;
    cparams.n_threads       = (int32_t) n_threads;
    cparams.n_threads_batch = (int32_t) n_threads;
    cparams.no_perf         = true;
    cparams.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) die("cannot create a context for %s", model_path.c_str());

    // tokenize
    std::vector<llama_token> tokens(prompt.size() + 8);
    int n_prompt = llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), tokens.data(), (int32_t) tokens.size(), true, false);
    if (n_prompt < 0) {
        tokens.resize(-n_prompt);
        n_prompt = llama_tokenize(vocab, prompt.c_str(), (int32_t) prompt.size(), tokens.data(), (int32_t) tokens.size(), true, false);
    }
    if (n_prompt <= 0) die("the prompt gives no tokens");
    tokens.resize(n_prompt);
    if (n_prompt + n_predict > n_ctx) die("prompt + n-predict exceed the context (-c)");

    const int32_t n_layer = llama_model_n_layer(model);
    cp.trace_capacity = trace ? (int32_t) (n_layer * (n_prompt + n_predict + 1)) : 0;
    cp.router_record  = trace ? (int32_t) (n_prompt + n_predict + 1) : 0; // the z lines of --trace
    moecache * mc = moecache_init(model, cp, rp);
    if (!mc) die("moecache_init: %s", moecache_last_error());
    if (default_j) { // J by K, as the Python package: 1 for K <= 3, 2 for K >= 4
        moecache_layer_stats ls;
        moecache_get_layer_stats(mc, 0, &ls);
        rp.top_j = ls.n_expert_used <= 3 ? 1 : 2;
        if (moecache_set_routing(mc, rp) != MOECACHE_OK) die("moecache_set_routing: %s", moecache_last_error());
    }
    if (moecache_attach(mc, ctx) != MOECACHE_OK) die("moecache_attach: %s", moecache_last_error());
    const moecache_routing_params rp_used = moecache_get_routing(mc);

    const auto t_start = std::chrono::steady_clock::now();
    const double load_s = std::chrono::duration<double>(t_start - t_load).count();

    // decode: the prompt as one batch, then one token at a time (argmax)
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_token> generated;
    std::string text;
    llama_batch batch = llama_batch_get_one(tokens.data(), n_prompt);
    llama_token next = 0;
    bool pending = true; // `batch` has not been decoded yet
    for (long i = 0; i < n_predict; i++) {
        if (llama_decode(ctx, batch) != 0) {
            const char * err = moecache_take_io_error(mc);
            die("llama_decode failed: %s", err ? err : "see the log above");
        }
        pending = false;
        const float * logits = llama_get_logits_ith(ctx, -1);
        next = (llama_token) (std::max_element(logits, logits + n_vocab) - logits); // first maximum
        generated.push_back(next);
        char piece[256];
        const int n = llama_token_to_piece(vocab, next, piece, sizeof(piece), 0, true);
        if (n > 0) text.append(piece, n);
        if (stop_at_eog && llama_vocab_is_eog(vocab, next)) break;
        batch = llama_batch_get_one(&next, 1);
        pending = true;
    }
    // the last generated token is routed too (and the prompt with -n 0), so that every token
    // printed has its selections
    if (pending) {
        if (llama_decode(ctx, batch) != 0) {
            const char * err = moecache_take_io_error(mc);
            die("llama_decode failed: %s", err ? err : "see the log above");
        }
    }
    const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

    // the report (stdout)
    moecache_stats st{};
    moecache_get_stats(mc, &st);
    printf("moecache-run 1\n");
    printf("model n_layer=%d n_moe_layer=%d n_expert=%d n_expert_used=%d\n", st.n_layer, st.n_moe_layer,
           st.total.n_expert, st.total.n_expert_used);
    printf("config cache=%d routing=%s policy=%d top_j=%d scope=%s prompt_update=%d\n", st.total.capacity,
           routing.c_str(), (int) rp_used.policy, rp_used.top_j, scope.c_str(), (int) prompt_update);
    printf("prompt");
    for (llama_token t : tokens) printf(" %d", t);
    printf("\n");
    for (size_t i = 0; i < generated.size(); i++) printf("gen %zu %d\n", i, generated[i]);

    if (trace) {
        std::vector<moecache_trace_record> rec((size_t) cp.trace_capacity);
        const int32_t n = moecache_get_trace(mc, rec.data(), (int32_t) rec.size());
        std::stable_sort(rec.begin(), rec.begin() + n, [](const moecache_trace_record & a, const moecache_trace_record & b) {
            return a.token != b.token ? a.token < b.token : a.layer < b.layer;
        });
        for (int32_t r = 0; r < n; r++) {
            const moecache_trace_record & t = rec[r];
            const int ns = std::min<int>(t.n_selected, MOECACHE_TRACE_MAX_USED);
            printf("sel L=%d T=%" PRId64 " ", t.layer, t.token);
            for (int i = 0; i < ns; i++) printf(i ? ",%d" : "%d", t.experts[i]);
            printf(" hit=%s topk=%s\n", bits(t.hit_mask, ns).c_str(), bits(t.top_k_mask, ns).c_str());
        }
        // the router logits behind each selection: two machines whose selections part can tell a
        // near-tie (the same z up to rounding) from a real difference (scripts/test_aarch64.sh)
        std::vector<float> z;
        for (int32_t il = 0; il < n_layer; il++) {
            moecache_layer_stats ls{};
            if (moecache_get_layer_stats(mc, il, &ls) != MOECACHE_OK || ls.tokens == 0 || ls.n_expert <= 0) continue;
            z.resize((size_t) cp.router_record * (size_t) ls.n_expert);
            const int32_t n_rec = moecache_get_router_record(mc, il, z.data(), nullptr, nullptr, cp.router_record, nullptr);
            for (int32_t t = 0; t < std::min(n_rec, cp.router_record); t++) {
                printf("z L=%d T=%d", il, t);
                for (int32_t e = 0; e < ls.n_expert; e++) printf(" %.6g", z[(size_t) t * ls.n_expert + e]);
                printf("\n");
            }
        }
    }
    for (int32_t il = 0; il < n_layer; il++) {
        moecache_layer_stats ls{};
        if (moecache_get_layer_stats(mc, il, &ls) != MOECACHE_OK || ls.tokens == 0) continue;
        printf("layer %d tokens=%" PRId64 " hits=%" PRId64 " misses=%" PRId64 " evictions=%" PRId64 " hit_rate=%.6f\n",
               il, ls.tokens, ls.hits, ls.misses, ls.evictions, rate(ls.hits, ls.selections));
    }
    const moecache_layer_stats & T = st.total;
    const int64_t tokens_per_layer = st.n_moe_layer > 0 ? T.tokens / st.n_moe_layer : 0;
    printf("total tokens=%" PRId64 " selections=%" PRId64 " hits=%" PRId64 " misses=%" PRId64 " evictions=%" PRId64
           " hit_rate=%.6f misses_per_token=%.4f\n",
           tokens_per_layer, T.selections, T.hits, T.misses, T.evictions, rate(T.hits, T.selections),
           tokens_per_layer > 0 ? (double) T.misses / (double) tokens_per_layer : 0.0);
    fflush(stdout);

    fprintf(stderr, "text: %s%s\n", prompt.c_str(), text.c_str());
    fprintf(stderr, "load %.2f s | %d prompt + %zu generated tokens in %.2f s (%.1f tok/s) | hit rate %.1f%%\n",
            load_s, n_prompt, generated.size(), gen_s, gen_s > 0 ? (double) (n_prompt + generated.size()) / gen_s : 0.0,
            100.0 * rate(T.hits, T.selections));
    moecache_residency_stats rs{};
    moecache_get_residency_stats(mc, &rs);
    if (rs.residency != MOECACHE_RESIDENCY_NONE) {
        const double n = rs.decode_tokens > 0 ? (double) rs.decode_tokens : 1.0;
        fprintf(stderr, "%s: read %.2f MiB/token | I/O wait %.2f ms/token | routing %.3f ms/token | slots %.1f MiB%s | rss %.1f MiB\n",
                residency.c_str(), (double) rs.decode_bytes_read / n / 1048576.0, rs.decode_t_io_ms / n,
                rs.decode_t_route_ms / n, (double) rs.arena_bytes / 1048576.0, rs.locked ? "" : " (unlocked)",
                (double) rs.rss_bytes / 1048576.0);
    }
    if (const char * err = moecache_take_io_error(mc)) {
        fprintf(stderr, "moecache-run: %s\n", err);
    }

    moecache_free(mc);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
