#!/usr/bin/env python3
"""Quality at a quarter cache (issue 28): each direction alone and combined, on both trained models,
at 1/2 and 1/4 of the experts cached, with `pymoecache ppl`'s protocol (chunks of 256 tokens, each
from an empty KV cache, the expert cache carried over).

    python scripts/bench_quarter.py                 # both models, both sizes: about 10 minutes on 2 cores
    python scripts/bench_quarter.py --models A --sizes 0.25

Text: the held-out 10% of Tiny Shakespeare (`train_tiny_moe.split_text()[1]`). Chunks 0-59 are the
evaluation text (as docs/results/eviction_*.csv); chunks 60-119 are the calibration text on which
the per-layer choices are made, so no choice sees the text it is scored on.

Rows (each: perplexity, its change against top-k + LRU, miss rate, fewer misses than top-k + LRU):
  top-k + LRU             the stock router, LRU eviction
  old best                the flat prior (lambda 0.05-0.3, J = 1; J = 2 too on model A) with LRU, the
                          fewest misses within +1% perplexity on the evaluation text itself
  1. slots per layer      the old best's routing on per-layer cache sizes (same total) from the
                          calibration text's miss curves (pymoecache.tune.allocate_slots)
  2. prior per layer      which layers get how much of the prior, tuned within +1% on the calibration
                          text (tune_layer_scales); the strength then swept as the old best's
  3. prior in p           prior-p: the boost added to the router probability (0.01-0.1) instead of the
                          logit, so a swap costs at most that much router mass whatever the logit gap
  5. eviction             the flat-prior sweep under lfu, freq-prob, router-mass (decay 0.95 and 0.8)
  preset quality          the default (docs/eviction.md): prior 0.1, J = 1, lfu with decay 0.8
  combined                2 tuned under the best eviction of 5 and on the slots of 1
Rows go to docs/results/quarter_<model>.csv; the table is printed as markdown. Needs ../shared/data.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

MODELS = {"A": "tiny-shakespeare-qwen2moe-60x4.gguf", "B": "tiny-shakespeare-mixtral-8x2.gguf"}
LAMBDAS = (0.05, 0.1, 0.15, 0.2, 0.3)
SHAPED = (0.1, 0.15, 0.2, 0.3, 0.4)   # strengths swept with per-layer scales (mean scale 1)
PROBS = (0.01, 0.02, 0.04, 0.06, 0.1)  # prior-p: the boost in router probability
EVICTIONS = (("lfu", 0.95), ("lfu", 0.8), ("freq-prob", 0.95), ("router-mass", 0.95), ("router-mass", 0.8))
CTX, CHUNKS = 256, 60


class Runner:
    """One loaded model per (cache sizes); every run empties the cache and resets the counters."""

    def __init__(self, model: Path):
        self.model, self.llm, self.key = model, None, None
        self.tokens = None

    def load(self, size, per_layer=None):
        from pymoecache.evaluate import load_for_eval, tokenize_text

        key = (size, tuple(per_layer) if per_layer else None)
        if self.key != key:
            if self.llm is not None:
                self.llm.close()
            self.llm = load_for_eval(self.model, size, CTX, per_layer=list(per_layer) if per_layer else None)
            self.key = key
        if self.tokens is None:
            from train_tiny_moe import split_text
            self.tokens = tokenize_text(self.llm, split_text()[1])
        return self.llm

    def part(self, which: str):
        n = CHUNKS * CTX
        return self.tokens[:n] if which == "eval" else self.tokens[n:2 * n]

    def evaluator(self, which: str, eviction=("lru", 0.95)):
        from pymoecache.tune import ppl_evaluator

        inner = ppl_evaluator(self.llm, self.part(which), CTX)

        def evaluate(routing):
            self.llm.set_eviction(*eviction)
            return inner(routing)
        return evaluate


INFLIGHT_ROWS = "topk,none,spare,route,budget,insert"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="A,B", help="A, B or both (default %(default)s)")
    ap.add_argument("--sizes", default="0.5,0.25", help="shares of the experts cached (default %(default)s)")
    ap.add_argument("--budget", type=float, default=0.01, help="perplexity budget, a share (default %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"), help="output folder (default docs/results)")
    ap.add_argument("--inflight", action="store_true",
                    help="only direction 4: decoded token by token with streamed experts, prefetch into the cache "
                         "(in flight counts as cached) against reads ahead into spare slots and no reads ahead")
    ap.add_argument("--inflight-rows", default=INFLIGHT_ROWS,
                    help="with --inflight: which rows, of topk (top-k + LRU, the reference, always run), none (no reads "
                         "ahead), spare, route (spare slots counted by the prior), budget (route under "
                         "prefetch_budget=0), insert (default all)")
    args = ap.parse_args()
    if args.inflight:
        return inflight(args)

    from pymoecache.config import Prior, TopK
    from pymoecache.tune import allocate_slots, tune_layer_scales

    t0 = time.time()
    table = []
    for key in args.models.split(","):
        run = Runner(ROOT / "models" / MODELS[key])
        rows = []
        for share in (float(s) for s in args.sizes.split(",")):
            llm = run.load(share)
            n_layer, K, N = llm.moecache.n_layer, llm.moecache.n_expert_used, llm.moecache.n_expert
            moe = list(llm.moecache.moe_layers)
            size = int(llm.moecache.stats().capacity_per_layer[0])
            js = (1, 2) if K >= 4 else (1,)

            def row(name, routing, ev, res, note="", per_layer=None):
                ppl, miss = res
                r = {"model": key, "cache": f"{size}/{N}", "direction": name, "routing": routing.spec(),
                     "eviction": f"{ev[0]}" + (f" (decay {ev[1]:g})" if ev[0] not in ("lru",) else ""),
                     "slots": "/".join(map(str, per_layer)) if per_layer else str(size),
                     "ppl": ppl, "miss": sum(miss[il] for il in moe) / len(moe), "note": note}
                rows.append(r)
                print(f"[{key} {size}/{N} {time.time() - t0:5.0f}s] {name:18} {r['routing']:40} {r['eviction']:20} "
                      f"slots {r['slots']:12} ppl {ppl:.3f} miss {100 * r['miss']:.2f}%", file=sys.stderr, flush=True)
                return r

            ev_lru = ("lru", 0.95)
            base = row("top-k + LRU", TopK(), ev_lru, run.evaluator("eval")(TopK()))
            limit = base["ppl"] * (1 + args.budget)

            def sweep(name, ev, per_layer=None, shape=None, on_probs=False):
                best = None
                grid = PROBS if on_probs else (LAMBDAS if shape is None else SHAPED)
                for j in (js if shape is None else (1,)):
                    for lam in grid:
                        r = Prior(lam, top_j=j, layers=shape, on_probs=on_probs)
                        res = run.evaluator("eval", ev)(r)
                        if res[0] <= limit:
                            m = sum(res[1][il] for il in moe) / len(moe)
                            if best is None or m < best[2]:
                                best = (r, res, m)
                if best is None:
                    return None
                return row(name, best[0], ev, best[1], "best of the sweep within the budget", per_layer)

            old = sweep("old best", ev_lru)
            old_routing = Prior(0.1, top_j=1) if old is None else _parse(old["routing"])

            # 3. a prior that respects the router's confidence: the boost in probability (prior-p)
            sweep("3. prior in p", ev_lru, on_probs=True)

            # 5. eviction
            best_ev, best_ev_miss = ev_lru, old["miss"] if old else base["miss"]
            for ev in EVICTIONS:
                r = sweep("5. eviction", ev)
                if r is not None and r["miss"] < best_ev_miss:
                    best_ev, best_ev_miss = ev, r["miss"]

            # 1. slots per layer: miss curves on the calibration text under the old best routing
            total = size * len(moe)
            per_layer = None
            if total >= (K + 1) * len(moe):
                curves = {il: {} for il in moe}
                for c in sorted({max(K, size - 4), max(K, size - 2), size, min(N, size + 2), min(N, size + 4)}):
                    run.load(share if c == size else c)
                    _, miss = run.evaluator("cal")(old_routing)
                    for il in moe:
                        curves[il][c] = miss[il]
                alloc = allocate_slots(curves, total, K)
                per_layer = [0] * n_layer
                for il, c in zip(moe, alloc):
                    per_layer[il] = c
                run.load(share, per_layer)
                row("1. slots per layer", old_routing, ev_lru, run.evaluator("eval")(old_routing),
                    "sizes from the calibration text", per_layer)
            else:
                row("1. slots per layer", old_routing, ev_lru, (old["ppl"] if old else base["ppl"],
                                                                {il: (old or base)["miss"] for il in moe}),
                    f"not possible: {size} slots = K, every layer needs K")

            # 2. prior per layer, tuned on the calibration text
            # (the shape, which layers get how much of the prior, comes from the calibration text; the
            # strength is swept on the evaluation text, as the old best's is)
            run.load(share)
            tuned = tune_layer_scales(run.evaluator("cal"), 0.2, 1, moe, n_layer, args.budget)
            shape = _shape(tuned.routing.layers)
            sweep("2. prior per layer", ev_lru, shape=shape)

            # the default preset, resolved by Llama.set_routing for this cache (routing, eviction, decay)
            run.load(share)
            llm = run.llm
            llm.moecache.clear()
            llm.moecache.reset_stats()
            llm.set_routing("preset:quality", scope="all")
            preset_ev = (llm.moecache.eviction, llm.moecache.eviction_decay)
            row("preset quality", llm.moecache.routing, preset_ev,
                run.evaluator("eval", preset_ev)(llm.moecache.routing), "the default")

            # combined: 2 under the best eviction, on the slots of 1
            run.load(share, per_layer)
            comb = tune_layer_scales(run.evaluator("cal", best_ev), 0.2, 1, moe, n_layer, args.budget)
            sweep("combined", best_ev, per_layer, shape=_shape(comb.routing.layers))
        _write(rows, Path(args.out) / f"quarter_{key}.csv")
        table += rows
    print(_markdown(table))
    print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


def inflight(args) -> int:
    """Direction 4 on the first 20 chunks, every token decoded alone with the experts streamed (prefetch
    acts on decoded tokens only): top-k + LRU, then the default preset's routing with no reads ahead, with gate reads
    ahead into 2 spare slots (the prior does not see them; then counting them as cached: prefetch_route), and with
    gate reads ahead inserted into the cache (an expert in flight counts as cached for the prior)."""
    from pymoecache.config import CacheConfig
    from pymoecache.evaluate import check_loaded_model, load_llama, perplexity, tokenize_text
    from train_tiny_moe import split_text

    rows = []
    for key in args.models.split(","):
        model = ROOT / "models" / MODELS[key]
        tokens = None
        for share in (float(s) for s in args.sizes.split(",")):
            for key_row, name, routing, pf, spare, route, budget in (
                    ("topk", "top-k + LRU", "lru", "off", 0, False, -1.0),
                    ("none", "no reads ahead", "preset:quality", "off", 0, False, -1.0),
                    ("spare", "ahead, spare slots", "preset:quality", "gate", 2, False, -1.0),
                    ("route", "ahead, spare slots, counted by the prior", "preset:quality", "gate", 2, True, -1.0),
                    ("budget", "ahead under a budget (0), counted by the prior", "preset:quality", "gate", 2, True, 0.0),
                    ("insert", "ahead, in the cache", "preset:quality", "gate", 0, False, -1.0)):
                if key_row != "topk" and key_row not in args.inflight_rows.split(","):
                    continue
                cache = CacheConfig(size=share, residency="stream", prefetch=pf, prefetch_spare=spare,
                                    prefetch_adaptive=False, prefetch_route=route, prefetch_budget=budget,
                                    lock_memory=False, miss="full")
                llm = load_llama(model, cache=cache, routing=routing, routing_scope="all", n_ctx=CTX,
                                 n_batch=CTX, logits_all=True)
                try:
                    check_loaded_model(llm, CTX)
                    tokens = tokens or tokenize_text(llm, split_text()[1])
                    res = perplexity(llm, tokens[:20 * CTX], CTX, progress=False, decode=True)
                    st, rs = res.stats, res.stats.residency
                    n_sel = max(1, int(st.selections_per_layer.sum()))
                    r = {"model": key, "cache": f"{int(st.capacity_per_layer[0])}/{st.n_expert}", "reads ahead": name,
                         "routing": llm.moecache.routing.spec(), "ppl": res.ppl, "miss": st.miss_rate,
                         "reads per selection": (st.misses + rs.prefetch_issued) / n_sel,
                         "recall": rs.recall,
                         # what a token waited for: the reads on demand (the reads ahead it used are not)
                         "demand MiB per token": rs.demand_bytes_read / max(1, rs.decode_tokens) / 2**20}
                finally:
                    llm.close()
                rows.append(r)
                print(f"[{key}] {r}", file=sys.stderr, flush=True)
    _write(rows, Path(args.out) / ("quarter_inflight.csv" if args.inflight_rows == INFLIGHT_ROWS
                                   else f"quarter_inflight_{args.inflight_rows.replace(',', '_')}.csv"))
    print("| model | cache | routing | reads ahead | ppl | miss rate | fewer misses | expert reads per selection | recall "
          "| demand MiB/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["cache"] == r["cache"])
        print(f"| {r['model']} | {r['cache']} | `{r['routing']}` | {r['reads ahead']} | {r['ppl']:.3f} "
              f"({100 * (r['ppl'] / base['ppl'] - 1):+.2f}%) | {100 * r['miss']:.1f}% | "
              f"{base['miss'] / max(r['miss'], 1e-9):.2f}x | {r['reads per selection']:.3f} | {100 * r['recall']:.0f}% | "
              f"{r['demand MiB per token']:.3f} |")
    return 0


def _shape(scales):
    """Per-layer scales normalised to a mean of 1 over the layers that have a prior (all 0: None)."""
    on = [s for s in scales if s > 0]
    if not on:
        return tuple(scales)
    mean = sum(scales) / len(scales)
    return tuple(round(s / mean, 3) for s in scales)


def _parse(spec):
    from pymoecache.config import parse_routing
    return parse_routing(spec)


def _write(rows, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _markdown(rows) -> str:
    out = ["| model | cache | direction | routing | eviction | slots per layer | ppl | Δ ppl | miss rate | fewer misses |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["cache"] == r["cache"]
                    and b["direction"] == "top-k + LRU")
        out.append(f"| {r['model']} | {r['cache']} | {r['direction']} | `{r['routing']}` | {r['eviction']} | {r['slots']} | "
                   f"{r['ppl']:.3f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f}% | {100 * r['miss']:.1f}% | "
                   f"{base['miss'] / max(r['miss'], 1e-9):.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
