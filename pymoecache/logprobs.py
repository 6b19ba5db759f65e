"""OpenAI's ``logprobs`` without ``logits_all``: each sampled token's log-probability and the top N,
read from the logits the sampler drew it from (the last row llama.cpp computed), as it is drawn.

llama-cpp-python computes logprobs from a logits matrix of every context position, which it keeps
only with ``logits_all=True`` (n_ctx x n_vocab floats, and every prompt token's logits computed) and
refuses otherwise. A completion's tokens need only the row each was sampled from, which is there
when it is sampled. ``echo`` (the prompt's own logprobs) still needs ``logits_all``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np


class StepLogprobs:
    """The sampled tokens of one completion with their log-probabilities: (token, logprob, [(id, logprob)
    of the top ``n``]) per sampled token, in order."""

    def __init__(self, n: int):
        self.n = n
        self.steps: List[Tuple[int, float, List[Tuple[int, float]]]] = []
        self.given = 0  # steps already handed to a streamed chunk

    def record(self, logits: np.ndarray, token: int) -> None:
        """``logits``: the row ``token`` was sampled from [n_vocab]."""
        x = logits.astype(np.float64)
        m = np.max(x)
        lp = x - (m + np.log(np.sum(np.exp(x - m))))
        top: List[Tuple[int, float]] = []
        if self.n > 0:
            k = min(self.n, lp.size)
            idx = np.argpartition(-lp, k - 1)[:k]
            idx = idx[np.lexsort((idx, -lp[idx]))]  # most likely first, ties by the lower id
            top = [(int(i), float(lp[i])) for i in idx]
        self.steps.append((int(token), float(lp[token]), top))

    def completion_logprobs(self, llm, text: str, text_offset: int) -> dict:
        """OpenAI's completion ``logprobs`` object for the steps not yet given out whose text lies in
        ``text`` (a streamed chunk's, or the whole answer's): a step past its end stays for the next
        chunk (text held back for a stop word), and a stop word's own tokens never appear; end-of-text
        tokens are left out."""
        import llama_cpp

        vocab = llm._model.vocab
        out = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        pos = 0
        while self.given < len(self.steps) and pos < len(text):
            tok, lp, top = self.steps[self.given]
            self.given += 1
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                continue
            piece = llm.detokenize([tok], special=False).decode("utf-8", errors="ignore")
            out["tokens"].append(piece)
            out["text_offset"].append(text_offset + pos)
            out["token_logprobs"].append(lp)
            d = {llm.detokenize([i], special=False).decode("utf-8", errors="ignore"): v for i, v in top}
            d[piece] = lp
            out["top_logprobs"].append(d)
            pos += len(piece)
        return out


def logits_row(llm) -> Optional[np.ndarray]:
    """The last logits row llama.cpp computed for ``llm``'s context [n_vocab] (a view, valid until the next decode)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)) if ptr else None
