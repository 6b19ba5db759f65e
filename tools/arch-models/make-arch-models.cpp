// make-arch-models - one small random-weight MoE GGUF for every architecture of the pinned
// llama.cpp that routes experts, for tests/test_arch_models.py.
//
// The hyperparameters and tensors of each architecture come from llama.cpp itself: this file
// compiles the pin's tests/test-llama-archs.cpp (its model builder, get_gguf_ctx, and its list of
// MoE architectures) against libllama, with shim/ standing in for the two headers of common/ it
// includes. We only raise the expert count and the experts used per token, so that a cache
// smaller than all experts means something, narrow the feed-forward layers (128 wide, where one
// length is given for all layers)
// so that the files stay small (55 models, 0.8 GB), and save each model with llama.cpp's
// own saver.
//
//     make-arch-models OUT_DIR [N_EXPERT [N_EXPERT_USED [ARCH_REGEX]]]     (defaults 16, 4, all)
//
// Prints one line per architecture: "ok ARCH PATH" or "skip ARCH REASON". Exit 1 if none was written.

#define main test_llama_archs_main  // the file's own main (its backend comparison) is not ours to run
#include "../../vendor/llama.cpp/tests/test-llama-archs.cpp"
#undef main

int main(int argc, char ** argv) {
    if (argc < 2 || argc > 5) {
        fprintf(stderr, "usage: %s OUT_DIR [N_EXPERT [N_EXPERT_USED [ARCH_REGEX]]]\n", argv[0]);
        return 2;
    }
    const std::string dir    = argv[1];
    const uint32_t n_expert  = argc > 2 ? (uint32_t) std::stoul(argv[2]) : 16;
    const uint32_t n_used    = argc > 3 ? (uint32_t) std::stoul(argv[3]) : 4;
    const std::string filter = argc > 4 ? argv[4] : "";
    if (n_used < 1 || n_used > n_expert) {
        fprintf(stderr, "N_EXPERT_USED must be 1 to N_EXPERT\n");
        return 2;
    }

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            fputs(text, stderr);
        }
    }, nullptr);

    int n_written = 0;
    for (const llm_arch arch : llm_arch_all()) {
        const char * name = llm_arch_name(arch);
        if (arch == LLM_ARCH_UNKNOWN || !moe_implemented(arch) || (!filter.empty() && !arch_matches(filter, arch))) {
            continue;
        }
        // the same exclusions as the pin's save_models(): no fixture, or no usable implementation
        if (arch == LLM_ARCH_GEMMA4 || arch == LLM_ARCH_GEMMA4_ASSISTANT || arch == LLM_ARCH_EAGLE3 || arch == LLM_ARCH_DFLASH ||
                !llama_model_saver_supports_arch(arch) || !arch_supported(arch)) {
            printf("skip %s unsupported by the pin's model builder\n", name);
            continue;
        }
        gguf_context_ptr gguf_ctx = get_gguf_ctx(arch, /*moe =*/ true);
        const std::string prefix = std::string(name) + ".";
        gguf_set_val_u32(gguf_ctx.get(), (prefix + "expert_count").c_str(),      n_expert);
        gguf_set_val_u32(gguf_ctx.get(), (prefix + "expert_used_count").c_str(), n_used);
        for (const char * key : { "expert_feed_forward_length", "feed_forward_length" }) {
            const int64_t id = gguf_find_key(gguf_ctx.get(), (prefix + key).c_str());
            if (id >= 0 && gguf_get_kv_type(gguf_ctx.get(), id) == GGUF_TYPE_UINT32) {  // not the per-layer arrays
                gguf_set_val_u32(gguf_ctx.get(), (prefix + key).c_str(), 128);
            }
        }
        const std::string path = dir + "/" + name + "-moe.gguf";
        try {
            auto model_and_ctx = get_model_and_ctx(gguf_ctx.get(), nullptr, /*seed =*/ 42, /*stdev =*/ 0.1f, {});
            llama_model_save_to_file(model_and_ctx.first.get(), path.c_str());
        } catch (const std::exception & e) {
            printf("skip %s %s\n", name, e.what());
            continue;
        }
        printf("ok %s %s\n", name, path.c_str());
        fflush(stdout);
        n_written++;
    }
    return n_written > 0 ? 0 : 1;
}
