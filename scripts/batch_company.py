#!/usr/bin/env python3
"""Does a batched answer depend on the batch's company, and does stock llama.cpp's the same way?

One prompt's greedy answer, decoded alone and then beside other prompts (submitted together, or joining a
batch that runs already), on stock llama.cpp (llama-cpp-python's Llama on our library, no cache attached,
one KV cache of n_seq_max sequences) and on ours (``routing="lru"``: the model's own top-k, so any difference
from stock is the batch's arithmetic, not the routing). Prints, per grouping, whether the answer equals the
answer alone, for both; and whether ours equals stock's in each grouping.

    python scripts/batch_company.py [--model M] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pymoecache import BatchDecoder, CacheConfig, Llama  # noqa: E402  (first: llama_cpp on our library)
import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402
from llama_cpp._internals import LlamaContext  # noqa: E402

TARGET = "Once upon a time there was a king who"
OTHERS = ["The sea was calm that night, and", "My lord, I pray you", "What say you to this", "Come, let us go",
          "Her eyes were", "And so the battle ended with"]


def stock(model: str):
    llm = llama_cpp.Llama(model, n_ctx=1024, verbose=False)
    llm.context_params.n_seq_max, llm.context_params.kv_unified = 4, True
    llm._ctx = LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
    return llm


def ours(model: str):
    return Llama(model, cache=CacheConfig(size=1.0), routing="lru", n_seq_max=4, n_ctx=1024, verbose=False)


def answer(make, model: str, n: int, company: list, head_start: int) -> list:
    """TARGET's n greedy tokens, decoded with ``company`` (their prompts), which start ``head_start`` steps
    before it (0: submitted together)."""
    llm = make(model)
    dec = BatchDecoder(llm)
    tok = lambda s: llm.tokenize(s.encode(), add_bos=True)  # noqa: E731
    for c in company:
        dec.add(tok(c), max_tokens=n + head_start + 8)
    for _ in range(head_start):
        dec.step()
    seq = dec.add(tok(TARGET), max_tokens=n, keep_logits=True)
    dec.run()
    out = (list(seq.tokens), np.array(seq.logits))
    dec.close()
    llm.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "models",
                                                    "tiny-shakespeare-qwen2moe-60x4.gguf"))
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    groupings = [("alone", [], 0)]
    groupings += [(f"with {k} submitted together", OTHERS[:k], 0) for k in (1, 2, 3)]
    groupings += [(f"with {k} others (set {j})", OTHERS[j:j + k], 0) for k, j in ((1, 3), (2, 3), (3, 3))]
    groupings += [(f"joining {k} running {h} steps", OTHERS[:k], h) for k, h in ((1, 1), (2, 3), (3, 5))]
    rows = []
    for name, company, head in groupings:
        s = answer(stock, args.model, args.tokens, company, head)
        o = answer(ours, args.model, args.tokens, company, head)
        rows.append((name, s, o))
    def same(a, b):  # (tokens equal, logits equal bit for bit)
        return a[0] == b[0], a[1].shape == b[1].shape and bool(np.array_equal(a[1], b[1]))

    s0, o0 = rows[0][1], rows[0][2]
    print("tokens / logits bit for bit:")
    print(f"{'grouping':32s} {'stock = alone':>14s} {'ours = alone':>13s} {'ours = stock':>13s}")
    for name, s, o in rows:
        cells = ["/".join("yes" if x else "no" for x in same(a, b)) for a, b in ((s, s0), (o, o0), (o, s))]
        print(f"{name:32s} {cells[0]:>14s} {cells[1]:>13s} {cells[2]:>13s}")
    count = lambda pairs, i: sum(same(a, b)[i] for a, b in pairs)  # noqa: E731
    print(json.dumps({"model": os.path.basename(args.model), "groupings": len(rows) - 1,
                      "stock_tokens_as_alone": count([(s, s0) for _, s, _ in rows[1:]], 0),
                      "stock_logits_as_alone": count([(s, s0) for _, s, _ in rows[1:]], 1),
                      "ours_tokens_as_alone": count([(o, o0) for _, _, o in rows[1:]], 0),
                      "ours_logits_as_alone": count([(o, o0) for _, _, o in rows[1:]], 1),
                      "ours_logits_as_stock": count([(o, s) for _, s, o in rows], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
