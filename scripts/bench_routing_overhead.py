#!/usr/bin/env python3
"""Decode speed with the moecache hook attached vs detached, side by side in one run.

    python scripts/bench_routing_overhead.py [--model PATH] [--reps 7] [--tokens 64] [--json out.json]

On one model and one llama context, each repetition times the same fixed decode (one token per
llama_decode, no sampling) in four settings, in rotating order:
  detached   stock llama.cpp graph, no custom ops
  topk-full  hook attached, top-k routing, cache = all experts (pure bookkeeping overhead)
  prior-half hook attached, prior:0.5 at half the experts (compute only: counters, no I/O)
  unchecked  topk-full through llama_cpp.Llama.eval, skipping pymoecache.Llama.eval's per-token
             guards (the one-thread lock and the model file check)
and reports the median of the per-repetition ratios topk-full/detached, prior-half/topk-full and
topk-full/unchecked.
Default model: the synthetic >= 300 MB qwen2moe-style benchmark model (built on first use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # the package, and tools/synth/

import pymoecache  # noqa: E402
import llama_cpp  # noqa: E402  (after pymoecache, which points it at our library)
from pymoecache import CacheConfig, MoECache, Prior, TopK  # noqa: E402
import synth  # noqa: E402  (tools/)
from pymoecache.models import home_dir  # noqa: E402


def decode_tok_s(llm, prompt, tokens, checked: bool = True) -> float:
    ev = llm.eval if checked else lambda toks: llama_cpp.Llama.eval(llm, toks)
    llm.reset()
    ev(prompt)
    t0 = time.perf_counter()
    for t in tokens:
        ev([t])
    return len(tokens) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the synthetic benchmark model, built if missing)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of the four settings (default 7, >= 5)")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per timing (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    args = ap.parse_args()

    path = Path(args.model) if args.model else home_dir() / "models" / "bench-320.gguf"
    if not args.model and not path.exists():
        print(f"building the benchmark model {path} ...", file=sys.stderr)
        synth.build_bench_model(path, target_mb=320)
    info = pymoecache.model_info(path)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0), routing=TopK(), n_ctx=args.tokens + 64,
                           n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    full = llm.moecache
    # residency "none": this measures the routing hook alone (bench_residency.py measures the I/O)
    half = MoECache.for_model(llm._model.model, info, cache=CacheConfig(size=0.5, residency="none"),
                              routing=Prior(0.5))
    ctx = llm._ctx.ctx

    def use(mc):
        full.detach()
        half.detach()
        if mc is not None:
            mc.attach(ctx)

    settings = {"detached": None, "topk-full": full, "prior-half": half, "unchecked": full}
    prompt = list(range(1000, 1016))
    tokens = [2000 + (7 * i) % 5000 for i in range(args.tokens)]
    use(None)
    decode_tok_s(llm, prompt, tokens[:8])  # warm-up: page in the weights, build the graphs
    results = {k: [] for k in settings}
    names = list(settings)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            use(settings[name])
            results[name].append(decode_tok_s(llm, prompt, tokens, checked=name != "unchecked"))
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {results[n][-1]:.1f}" for n in names),
              file=sys.stderr, flush=True)
    use(half)
    miss_half = half.stats().miss_rate
    use(full)
    r_topk = [a / b for a, b in zip(results["topk-full"], results["detached"])]
    r_prior = [a / b for a, b in zip(results["prior-half"], results["topk-full"])]
    r_checks = [a / b for a, b in zip(results["topk-full"], results["unchecked"])]
    out = {
        "model": str(path), "model_mb": round(path.stat().st_size / 2**20, 1), "n_expert": info.n_expert,
        "n_expert_used": info.n_expert_used, "n_layer": info.n_layer, "threads": args.threads,
        "tokens": args.tokens, "reps": args.reps,
        "tok_s_median": {k: statistics.median(v) for k, v in results.items()},
        "ratio_topk_full_vs_detached_median": statistics.median(r_topk),
        "ratio_prior_half_vs_topk_full_median": statistics.median(r_prior),
        "ratio_checked_vs_unchecked_median": statistics.median(r_checks),
        "ratios_topk_full_vs_detached": r_topk, "ratios_prior_half_vs_topk_full": r_prior,
        "ratios_checked_vs_unchecked": r_checks,
        "prior_half_miss_rate": miss_half,
    }
    print(f"\nmodel {path.name} ({out['model_mb']} MiB, {info.n_layer} layers, {info.n_expert} experts, "
          f"top-{info.n_expert_used}), {args.threads} threads, {args.tokens} tokens x {args.reps} reps")
    print(f"{'setting':<12} {'median tok/s':>12}")
    for k, v in out["tok_s_median"].items():
        print(f"{k:<12} {v:>12.2f}")
    print(f"median ratio topk-full / detached  : {out['ratio_topk_full_vs_detached_median']:.4f}  (target >= 0.98)")
    print(f"median ratio prior-half / topk-full: {out['ratio_prior_half_vs_topk_full_median']:.4f}  (target >= 0.97)")
    print(f"median ratio topk-full / unchecked : {out['ratio_checked_vs_unchecked_median']:.4f}  (per-token guards)")
    print(f"prior-half miss rate (counted, no I/O): {100 * miss_half:.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    half.close()
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
