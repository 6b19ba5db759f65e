#!/usr/bin/env python3
"""Where a streamed decode's misses come from, and what the reads ahead did about them.

    python scripts/miss_anatomy.py                                   # the 2.2 GB bench model, prior:0.5, 1/4 cache
    python scripts/miss_anatomy.py MODEL.gguf --routing lru --cache-size 0.5 --prefetch off
    python scripts/miss_anatomy.py --prefetch gate:s=2:b=-1 --tokens 128 --json

Every expert a decoded token selects that its layer did not cache (a miss) falls in one class
of each pair:
  forced / chosen   forced: among the router's top J, which a cache-aware policy runs whatever the
                    cache holds (top-k routing: every selection); chosen: one of the policy's other
                    picks. No routing can avoid a forced miss; only a read started early can hide it.
  ahead / demand    ahead: a read ahead (prefetch) of that expert was queued during the token, before
                    its layer routed; demand: it was read when the layer selected it.
  waited / on time  waited: the graph thread waited for its bytes; on time: they were in when its
                    matmuls ran.
So "forced, demand, waited" are the misses no predictor saw; "ahead, waited" the ones it saw too late.

One fresh process of the model with the settings of scripts/bench_residency.py (stream residency,
--prompt-tokens of WikiText-2, --warmup untimed decodes, then --tokens decodes that are traced:
the selections and hits, the router's outputs and the timeline of reads and waits). Nothing is
timed here; the page cache is dropped first as in the benchmark, so reads come from storage.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "scripts")]

CLASSES = [(f, a, w) for f in ("forced", "chosen") for a in ("ahead", "demand") for w in ("waited", "on time")]


def anatomy(llm, n_tokens: int, top_j: int) -> dict:
    """Classify the misses of the last ``n_tokens`` decoded tokens of ``llm`` (made with
    ``CacheConfig(trace=..., router_record=...)``, its timeline started right before them)."""
    import numpy as np

    from pymoecache.timeline import KIND

    mc = llm.moecache
    trace = mc.trace()
    tl = llm.timeline()
    spans = tl.decode_tokens()[-n_tokens:]
    ev = tl.events
    if len(spans) < n_tokens:
        raise SystemExit(f"the timeline holds {len(spans)} decoded tokens, not {n_tokens}")
    counts = collections.Counter()
    hits = selections = 0
    for il in mc.moe_layers:
        rec = trace[trace["layer"] == il][-n_tokens:]
        _, p, s, _ = mc.router_record([il])
        score = (p if s is None else s)[:, 0, :][-n_tokens:]
        if len(rec) < n_tokens or len(score) < n_tokens:
            raise SystemExit(f"layer {il}: {len(rec)} trace records, {len(score)} router rows for {n_tokens} tokens")
        here = ev[ev["layer"] == il]
        for t in range(n_tokens):
            t0, t1 = spans[t]["t_start_us"], spans[t]["t_end_us"]
            top = set(np.argsort(-score[t], kind="stable")[:top_j].tolist())  # (ties: lower id, as the router)
            in_token = here[(here["t_queued_us"] >= t0) & (here["t_queued_us"] <= t1)]
            for i in range(int(rec[t]["n_selected"])):
                selections += 1
                if (int(rec[t]["hit_mask"]) >> i) & 1:
                    hits += 1
                    continue
                e = int(rec[t]["experts"][i])
                mine = in_token[in_token["expert"] == e]
                counts[("forced" if e in top else "chosen",
                        "ahead" if (mine["kind"] == KIND["read_ahead"]).any() else "demand",
                        "waited" if (mine["kind"] == KIND["wait"]).any() else "on time")] += 1
    misses = sum(counts.values())
    return {"tokens": n_tokens, "top_j": top_j, "selections": selections, "hits": hits, "misses": misses,
            "classes": {" ".join(c): counts[c] for c in CLASSES}}


def table(r: dict) -> str:
    m = max(r["misses"], 1)
    lines = [f"{r['tokens']} decoded tokens: {r['selections']} selections, {r['hits']} hits, {r['misses']} misses "
             f"({r['misses'] / r['tokens']:.2f} per token); forced = among the router's top {r['top_j']}", "",
             "| miss | per token | share of misses |", "|---|---|---|"]
    for c in CLASSES:
        n = r["classes"][" ".join(c)]
        lines.append(f"| {', '.join(c)} | {n / r['tokens']:.2f} | {100 * n / m:.1f}% |")
    forced = sum(v for k, v in r["classes"].items() if k.startswith("forced"))
    ahead = sum(v for k, v in r["classes"].items() if " ahead " in f" {k} ")
    on_time = sum(v for k, v in r["classes"].items() if "ahead" in k and k.endswith("on time"))
    lines += ["", f"forced: {100 * forced / m:.1f}% of the misses (no routing avoids them); read ahead: "
                  f"{100 * ahead / m:.1f}% (in time: {100 * on_time / m:.1f}%)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: scripts/bench_residency.py's 2.2 GB model, built once)")
    ap.add_argument("--routing", default="prior:0.5", help="routing spec (default %(default)s)")
    ap.add_argument("--cache-size", default="0.25", help="experts cached per layer: a count or a share of N "
                                                         "(default %(default)s)")
    ap.add_argument("--prefetch", default="gate:s=2",
                    help="as bench_residency.py's --prefetch entries (default %(default)s: the gate predictor into "
                         "2 spare slots under a budget of 0, as prefetch auto; gate:s=2:b=-1 reads every predicted miss)")
    ap.add_argument("--eviction", default="lru", help="eviction policy (default %(default)s)")
    ap.add_argument("--predictor", help="fitted predictors (scripts/fit_predictor.py) for a --prefetch with f=1")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=32, help="decodes before the traced ones (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=128, help="traced decodes (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON instead of a table")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.prompt_tokens < 1 or args.warmup < 0:
        ap.error("--tokens and --prompt-tokens must be >= 1, --warmup >= 0")

    import bench_residency as br
    import pymoecache
    from pymoecache.config import resolved_top_j
    from storage import drop_page_cache

    model = Path(args.model) if args.model else br.bench_model(2200)
    if not model.is_file():
        ap.error(f"no such model file: {model}")
    try:
        size = float(args.cache_size) if "." in args.cache_size else int(args.cache_size)
    except ValueError:
        ap.error(f"--cache-size takes a count or a share of N (15, 0.25), got {args.cache_size!r}")
    try:
        prefetch = br.parse_prefetch(args.prefetch, predictor=args.predictor)
    except ValueError as e:
        ap.error(f"--prefetch {args.prefetch}: {e}")
    n = args.prompt_tokens + args.warmup + args.tokens
    try:
        cache = pymoecache.CacheConfig(size=size, residency="stream", eviction=args.eviction, trace=1_000_000,
                                       router_record=n, **prefetch)
        drop_page_cache(model)
        llm = pymoecache.Llama(str(model), cache=cache, routing=args.routing, n_ctx=n + 16, n_threads=args.threads,
                               n_threads_batch=args.threads, seed=0, verbose=False)
    except pymoecache.Error as e:  # a bad size, routing or file: one line, exit 2
        ap.error(str(e))
    if br.TEXT.exists():
        tokens = br.text_tokens(llm, n)
    else:  # (no corpus: fixed pseudo-random tokens of the model's own vocabulary)
        import numpy as np
        tokens = np.random.default_rng(0).integers(3, llm.n_vocab(), n).tolist()
    llm.eval(tokens[: args.prompt_tokens])
    for t in tokens[args.prompt_tokens: args.prompt_tokens + args.warmup]:
        llm.eval([t])
    llm.start_timeline()
    for t in tokens[args.prompt_tokens + args.warmup:]:
        llm.eval([t])
    K = llm.model_info.n_expert_used
    routing = llm.moecache.routing  # (a preset resolved for this model and cache)
    top_j = K if isinstance(routing, pymoecache.TopK) else resolved_top_j(routing, K)
    r = anatomy(llm, args.tokens, top_j)
    r.update(model=model.name, routing=args.routing, cache=str(size), prefetch=args.prefetch)
    print(json.dumps(r) if args.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
