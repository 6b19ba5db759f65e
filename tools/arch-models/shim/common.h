// The few names of llama.cpp's common/common.h that tests/test-llama-archs.cpp uses, written
// over the public llama.h batch API, so that make-arch-models.cpp needs libllama alone.
#pragma once

#include "llama.h"
#include "log.h"

inline void common_init() {}

// a batch of token entries: add() appends one, get() hands the batch to llama_process
struct common_batch {
    llama_batch_ext * batch = nullptr;

    explicit common_batch(llama_context * ctx) : batch(llama_batch_ext_init(ctx)) {}
    ~common_batch() { llama_batch_ext_free(batch); }
    common_batch(const common_batch &) = delete;
    common_batch & operator=(const common_batch &) = delete;

    llama_batch_ext * get() { return batch; }
    void clear() { llama_batch_ext_clear(batch); }

    int32_t add(llama_token id, llama_pos pos, llama_seq_id seq_id, bool output) {
        const int32_t idx = llama_batch_ext_add_token(batch, seq_id, id);
        llama_batch_ext_set_pos(batch, idx, &pos);
        llama_batch_ext_set_output_logits(batch, idx, output);
        return idx;
    }
};
