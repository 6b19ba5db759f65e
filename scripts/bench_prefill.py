#!/usr/bin/env python3
"""Prefill benchmark: one long prompt streamed (experts read through the mapping, the next two MoE
layers' read ahead on the reader threads) against the fully resident model with its weights in memory.

    python scripts/bench_prefill.py                  # 2.2 GB model of bench_residency.py, 512 tokens, 5 reps
    python scripts/bench_prefill.py --cache 0.25 --tokens 512 --reps 5

Every run is a fresh process that drops the page cache, loads the model and times ``llm.eval`` of
the prompt as one ubatch. The resident run evaluates it twice and reports the second time (weights
in memory: the "warm" reference). Settings alternate within each repetition. To compare two builds
(e.g. with and without a change), run this script in both checkouts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_residency import bench_model, drop_page_cache  # noqa: E402


def worker(args) -> None:
    import numpy as np

    import pymoecache

    drop_page_cache(Path(args.model))
    resident = args.mode == "resident"
    cache = pymoecache.CacheConfig(size=1.0 if resident else args.cache, residency="none" if resident else "stream")
    llm = pymoecache.Llama(args.model, cache=cache, routing="lru", n_ctx=args.tokens + 16, n_batch=args.tokens,
                           n_ubatch=args.tokens, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    tokens = np.random.default_rng(0).integers(300, 30000, args.tokens).tolist()
    t0 = time.perf_counter()
    llm.eval(tokens)
    out = {"mode": args.mode, "cold_tok_s": args.tokens / (time.perf_counter() - t0)}
    if resident:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        out["warm_tok_s"] = args.tokens / (time.perf_counter() - t0)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=2200, help="model file size in MB (default %(default)s)")
    ap.add_argument("--cache", type=float, default=0.25, help="stream: share of experts cached (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length, one ubatch (default %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default %(default)s)")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        worker(args)
        return
    model = bench_model(args.size_mb)
    stream, warm = [], []
    for rep in range(args.reps):
        for mode in (("stream", "resident") if rep % 2 == 0 else ("resident", "stream")):
            cmd = [sys.executable, __file__, "--mode", mode, "--model", str(model), "--cache", str(args.cache),
                   "--tokens", str(args.tokens), "--threads", str(args.threads)]
            r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            (stream if mode == "stream" else warm).append(r["cold_tok_s"] if mode == "stream" else r["warm_tok_s"])
            print(f"[{rep + 1}/{args.reps}] {mode:<8} {r}", file=sys.stderr, flush=True)
    s, w = statistics.median(stream), statistics.median(warm)
    print(f"{model.name}, {args.tokens}-token prompt, medians of {args.reps}: streamed (cache {args.cache}, page cache "
          f"dropped) {s:.1f} tok/s, resident with its weights in memory {w:.1f} tok/s: {s / w:.2f}x")
    print(f"streamed: {', '.join(f'{x:.1f}' for x in stream)}; resident: {', '.join(f'{x:.1f}' for x in warm)}")


if __name__ == "__main__":
    main()
