#!/usr/bin/env python3
"""Is the default routing on the Pareto front? (issue 42 item 3: the default chosen by evidence)

    python scripts/pareto_default.py                                # A, B and the fixture models, 1/2 and 1/4
    python scripts/pareto_default.py --models A,B,C --sizes 0.25 --chunks 20

For each model and cache size it runs `ppl`'s sweep (chunks of --ctx tokens of the held-out tenth
of Tiny Shakespeare, each from an empty KV cache, the expert cache carried over, every token
routed) for: the default (no routing given), each preset, and a grid of flat settings (prior L
with J = 1 and J = 2, each under lru, lfu with decay 0.8 and router-mass eviction; top-k + LRU).
A row *dominates* another when both its miss rate and its perplexity are lower. It prints, per
cell, the default and every row that dominates it, and per candidate default (each preset) the
cells where a row dominates it. Rows go to --csv. Models A, B and C are the trained ones (models/);
the fixture models (tests/fixtures/models, built by the tests) have random weights: their
perplexity says little about language, but a default must not be beaten there either.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tools")]

MODELS = {"A": ROOT / "models" / "tiny-shakespeare-qwen2moe-60x4.gguf",
          "B": ROOT / "models" / "tiny-shakespeare-mixtral-8x2.gguf",
          "C": ROOT / "models" / "tiny-shakespeare-qwen2moe-32x4-w256.gguf"}
FIXTURES = ("qwen2moe-60x4", "mixtral-8x2", "olmoe-64x8", "deepseek2-sigmoid-64x6")
PRIORS = (0.05, 0.1, 0.2, 0.3)
EVICTIONS = (("lru", 0.95), ("lfu", 0.8), ("router-mass", 0.95))


def model_path(key: str) -> Path:
    if key in MODELS:
        return MODELS[key]
    path = ROOT / "tests" / "fixtures" / "models" / f"{key}.gguf"
    if not path.exists():
        import synth

        synth.build_all(path.parent, verbose=False)
    return path


def dominated(row: dict, rows: list) -> list:
    """The rows with both fewer misses and a lower perplexity than ``row``."""
    return [r for r in rows if r["miss_rate"] < row["miss_rate"] and r["ppl"] < row["ppl"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(("A", "B") + FIXTURES),
                    help="A, B, C (trained) and fixture names (default %(default)s)")
    ap.add_argument("--sizes", default="0.5,0.25", help="cache sizes, shares of N (default %(default)s)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=60,
                    help="chunks per row (default %(default)s: 15,360 tokens; 20 chunks moved rows by 0.5%% and flipped a verdict)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--csv", default=str(ROOT / "docs" / "results" / "pareto_default.csv"))
    ap.add_argument("--report", action="store_true", help="only the report, from the rows in --csv (of --models)")
    args = ap.parse_args()
    if args.report:
        from pymoecache.config import DEFAULT_PRESET

        with open(args.csv, newline="") as f:
            keys = set(args.models.split(","))
            rows = [dict(r, cache_size=int(r["cache_size"]), n_expert=int(r["n_expert"]), ppl=float(r["ppl"]),
                         miss_rate=float(r["miss_rate"])) for r in csv.DictReader(f) if r["model_key"] in keys]
        print(report(rows, DEFAULT_PRESET))
        return 0

    from pymoecache.config import DEFAULT_PRESET, PRESET_NAMES, Preset, Prior
    from pymoecache.evaluate import sweep
    from quality_lowbit import held_out_text

    work = ROOT / "models" / "_bench" / "quality"
    work.mkdir(parents=True, exist_ok=True)
    text = held_out_text(work)
    sizes = [float(s) for s in args.sizes.split(",")]
    flat = [Prior(lam, top_j=j) for lam in PRIORS for j in (1, 2)]
    rows = []
    t0 = time.time()
    for key in args.models.split(","):
        path = model_path(key.strip())
        common = dict(ctx=args.ctx, max_chunks=args.chunks, n_threads=args.threads, progress=False)
        got = sweep(path, text, [Preset(n) for n in PRESET_NAMES], sizes, **common)
        for i, r in enumerate(got):  # (per size: lru, then the presets in order)
            k = i % (len(PRESET_NAMES) + 1)
            r["setting"] = "lru" if k == 0 else f"preset:{PRESET_NAMES[k - 1]}"
        for ev, decay in EVICTIONS:
            more = sweep(path, text, flat, sizes, eviction=ev, eviction_decay=decay, **common)
            for r in more:
                r["setting"] = f"{r['spec']} {ev}"
            got += [r for r in more if r["spec"] != "lru" or ev != "lru"]  # (top-k + LRU once)
        for r in got:
            r["model_key"] = key
            print(f"  [{key}] {r['cache_size']}/{r['n_expert']} {r['setting']:28s} ppl {r['ppl']:.4f} "
                  f"miss {100 * r['miss_rate']:.1f}%", file=sys.stderr, flush=True)
        rows += got
    fields = ["model_key", "cache_size", "n_expert", "setting", "spec", "eviction", "ppl", "miss_rate", "tokens"]
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(report(rows, DEFAULT_PRESET))
    print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


def report(rows: list, default: str) -> str:
    """Markdown: per cell the default preset and what dominates it; then, per preset, the cells
    where it is dominated."""
    cells = sorted({(r["model_key"], r["cache_size"], r["n_expert"]) for r in rows},
                   key=lambda c: (c[0], -c[1]))
    out = [f"Default: `preset:{default}`. A row dominates it when both its miss rate and its perplexity "
           "are lower.", "",
           "| model | cache | default: routing, eviction | ppl | miss rate | dominated by |", "|---|---|---|---|---|---|"]
    beaten = {}
    for cell in cells:
        mine = [r for r in rows if (r["model_key"], r["cache_size"], r["n_expert"]) == cell]
        for r in mine:
            if r["setting"].startswith("preset:"):
                beaten.setdefault(r["setting"], []).append((cell, dominated(r, mine)))
        d = next((r for r in mine if r["setting"] == f"preset:{default}"), None)
        if d is None:
            continue
        by = dominated(d, mine)
        out.append(f"| {cell[0]} | {cell[1]}/{cell[2]} | `{d['spec']}` {d['eviction']} | {d['ppl']:.4f} | "
                   f"{100 * d['miss_rate']:.1f}% | "
                   + (", ".join(f"`{r['setting']}` ({r['ppl']:.4f}, {100 * r['miss_rate']:.1f}%)" for r in by)
                      or "nothing") + " |")
    out += ["", "| preset | cells where a row dominates it |", "|---|---|"]
    for name, cells_by in sorted(beaten.items()):
        lost = [f"{c[0]} {c[1]}/{c[2]}" for c, by in cells_by if by]
        out.append(f"| `{name}` | {len(lost)} of {len(cells_by)}" + (f": {', '.join(lost)}" if lost else "") + " |")
    # every setting (flat or preset) that nothing dominates in any cell: the candidates for a default,
    # with what they cost (perplexity against top-k + LRU) and save (misses against it) at worst and best
    out += ["", "Settings that no row dominates in any cell, with their perplexity cost and their fewer misses "
            "against top-k + LRU (worst / best over the cells):", "",
            "| setting | Δ ppl, worst | Δ ppl, best | fewer misses, worst | fewer misses, best |", "|---|---|---|---|---|"]
    for name in sorted({r["setting"] for r in rows}):
        costs, saves, ok = [], [], True
        for cell in cells:
            mine = [r for r in rows if (r["model_key"], r["cache_size"], r["n_expert"]) == cell]
            r = next((x for x in mine if x["setting"] == name), None)
            base = next((x for x in mine if x["setting"] == "lru"), None)
            if r is None or base is None or dominated(r, mine):
                ok = False
                break
            costs.append(r["ppl"] / base["ppl"] - 1)
            saves.append(base["miss_rate"] / max(r["miss_rate"], 1e-9))
        if ok and costs:
            out.append(f"| `{name}` | {100 * max(costs):+.2f}% | {100 * min(costs):+.2f}% | {min(saves):.2f}x | "
                       f"{max(saves):.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
