#!/usr/bin/env python3
"""Is the default routing on the Pareto front? (issue 42 item 3: the default chosen by evidence)

    python scripts/pareto_default.py                                # A, B and the fixture models, 1/2 and 1/4
    python scripts/pareto_default.py --models A,B,C --sizes 0.25 --chunks 20
    python scripts/pareto_default.py --streamed --models A,B        # as a user runs it: experts streamed, read ahead
    python scripts/pareto_default.py --streamed --models B --sizes 0.5 --only "prior:0.05:j=1 router-mass" --csv b.csv

For each model and cache size it runs `ppl`'s sweep (chunks of --ctx tokens of the held-out tenth
of Tiny Shakespeare, each from an empty KV cache, the expert cache carried over, every token
routed) for: the default (no routing given), each preset, and a grid of flat settings (prior L
with J = 1 and J = 2, each under lru, lfu with decay 0.8 and router-mass eviction; top-k + LRU).
A row *dominates* another when both its miss rate and its perplexity are lower. It prints, per
cell, the default and every row that dominates it, and per candidate default (each preset) the
cells where a row dominates it. Rows go to --csv. Models A, B and C are the trained ones (models/);
the fixture models (tests/fixtures/models, built by the tests) have random weights: their
perplexity says little about language, but a default must not be beaten there either.

--streamed: every token decoded alone with the experts streamed and the default reads ahead
(prefetch auto: 2 spare slots per layer under a budget of 0, counted as cached by the prior), as a
user runs it; a row then dominates another when both the MiB per token read on its critical path
(the reads a token waits for, not those read ahead that it used) and its perplexity are lower.
Rows go to pareto_default_streamed.csv.

Each row keeps its per-chunk mean NLLs, so the report gives, for every row that dominates the default,
its perplexity gap chunk by chunk and that gap's standard error (evaluate.paired_delta), and says
whether the gap is beyond twice the error. --only runs top-k + LRU, the default and the named
settings alone: one domination checked in minutes instead of the grid's hours.
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


def dominated(row: dict, rows: list, cost: str = "miss_rate") -> list:
    """The rows with both less ``cost`` (fewer misses, or fewer critical-path bytes) and a lower
    perplexity than ``row``."""
    return [r for r in rows if r[cost] < row[cost] and r["ppl"] < row["ppl"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(("A", "B") + FIXTURES),
                    help="A, B, C (trained) and fixture names (default %(default)s)")
    ap.add_argument("--sizes", default="0.5,0.25", help="cache sizes, shares of N (default %(default)s)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=60,
                    help="chunks per row (default %(default)s: 15,360 tokens; 20 chunks moved rows by 0.5%% and flipped a verdict)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streamed", action="store_true",
                    help="decode token by token with the experts streamed and the default reads ahead; compare "
                         "critical-path MiB per token instead of miss rates")
    ap.add_argument("--csv", default=None, help="rows (default docs/results/pareto_default.csv, with --streamed "
                                                "pareto_default_streamed.csv)")
    ap.add_argument("--report", action="store_true", help="only the report, from the rows in --csv (of --models)")
    ap.add_argument("--only", default=None, metavar="SETTING[,SETTING]",
                    help="run only top-k + LRU, the default and these settings, named as the report names them "
                         "(e.g. 'prior:0.05:j=1 router-mass'): one domination checked, with its gap and the "
                         "gap's standard error, without the whole grid; needs --csv")
    args = ap.parse_args()
    if args.only is not None and not args.csv and not args.report:
        ap.error("--only runs a part of the grid: name its --csv (the default file holds the whole grid)")
    args.csv = args.csv or str(ROOT / "docs" / "results" /
                               ("pareto_default_streamed.csv" if args.streamed else "pareto_default.csv"))
    cost = "critical_mib_per_token" if args.streamed else "miss_rate"
    if args.report:
        from pymoecache.config import DEFAULT_PRESET

        with open(args.csv, newline="") as f:
            keys = set(args.models.split(","))
            rows = [dict(r, cache_size=int(r["cache_size"]), n_expert=int(r["n_expert"]), ppl=float(r["ppl"]),
                         miss_rate=float(r["miss_rate"]), critical_mib_per_token=float(r.get("critical_mib_per_token") or 0),
                         chunk_nll=[float(x) for x in (r.get("chunk_nll") or "").split()])
                    for r in csv.DictReader(f) if r["model_key"] in keys]
        print(report(rows, DEFAULT_PRESET, cost))
        return 0

    from pymoecache.config import DEFAULT_PRESET, PRESET_NAMES, Preset, Prior
    from pymoecache.evaluate import sweep
    from quality_lowbit import held_out_text

    work = ROOT / "models" / "_bench" / "quality"
    work.mkdir(parents=True, exist_ok=True)
    text = held_out_text(work)
    sizes = [float(s) for s in args.sizes.split(",")]
    flat = [Prior(lam, top_j=j) for lam in PRIORS for j in (1, 2)]
    only = None if args.only is None else {x.strip() for x in args.only.split(",") if x.strip()}
    presets = [n for n in PRESET_NAMES if only is None or n == DEFAULT_PRESET or f"preset:{n}" in only]
    known = {f"preset:{n}" for n in PRESET_NAMES} | {f"{r.spec()} {ev}" for r in flat for ev, _ in EVICTIONS}
    if only is not None and only - known:
        ap.error(f"--only: no such setting in the grid: {', '.join(sorted(only - known))}")
    rows = []
    t0 = time.time()
    for key in args.models.split(","):
        path = model_path(key.strip())
        done = [0]

        def on_row(got, total, key=key, done=done):  # one line per finished row: these runs take hours
            if got:
                done[0] += 1
                r = got[-1]
                print(f"  [{key}] row {done[0]} ({time.time() - t0:.0f} s) {r['cache_size']}/{r['n_expert']} "
                      f"{r['spec']}: ppl {r['ppl']:.4f}", file=sys.stderr, flush=True)

        common = dict(ctx=args.ctx, max_chunks=args.chunks, n_threads=args.threads, progress=False, on_row=on_row)
        if args.streamed:
            common.update(decode=True, stream=True, prefetch="auto")
        got = sweep(path, text, [Preset(n) for n in presets], sizes, **common)
        for i, r in enumerate(got):  # (per size: lru, then the presets in order)
            k = i % (len(presets) + 1)
            r["setting"] = "lru" if k == 0 else f"preset:{presets[k - 1]}"
        for ev, decay in EVICTIONS:
            mine = [r for r in flat if only is None or f"{r.spec()} {ev}" in only]
            if not mine:
                continue
            more = sweep(path, text, mine, sizes, eviction=ev, eviction_decay=decay, **common)
            for r in more:
                r["setting"] = f"{r['spec']} {ev}"
            got += [r for r in more if r["spec"] != "lru" or ev != "lru"]  # (top-k + LRU once)
        for r in got:
            r["model_key"] = key
            print(f"  [{key}] {r['cache_size']}/{r['n_expert']} {r['setting']:28s} ppl {r['ppl']:.4f} "
                  f"miss {100 * r['miss_rate']:.1f}% critical {r['critical_mib_per_token']:.3f} MiB/tok",
                  file=sys.stderr, flush=True)
        rows += got
        write_rows(args.csv, rows)  # after each model, so a stopped run keeps the models it finished
    print(report(rows, DEFAULT_PRESET, cost))
    print(f"\n({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


def write_rows(path: str, rows: list) -> None:
    fields = ["model_key", "cache_size", "n_expert", "setting", "spec", "eviction", "ppl", "miss_rate",
              "critical_mib_per_token", "tokens", "ppl_err", "chunk_nll"]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(dict(r, chunk_nll=" ".join(map(str, r.get("chunk_nll") or []))) for r in rows)


def by_more_than_noise(r: dict, base: dict) -> str:
    """``r``'s perplexity against ``base``'s, chunk by chunk (evaluate.paired_delta), and whether the
    gap is more than twice its standard error: "-0.35% ±0.21, within 2 SE"; "" without the chunks."""
    from pymoecache.evaluate import format_gap, paired_delta

    a, b = r.get("chunk_nll") or [], base.get("chunk_nll") or []
    if len(a) < 2 or len(a) != len(b):
        return ""
    d, err = paired_delta(a, b)
    return f"{format_gap(d, err)}, " + ("beyond 2 SE" if abs(d) > 2 * err else "within 2 SE")


def report(rows: list, default: str, cost: str = "miss_rate") -> str:
    """Markdown: per cell the default preset and what dominates it (by ``cost``: "miss_rate" or
    "critical_mib_per_token"), with the perplexity gap chunk by chunk and its standard error where the
    rows have their chunks; then, per preset, the cells where it is dominated."""
    def fmt(r, d=None):
        gap = by_more_than_noise(r, d) if d is not None else ""
        return ((f"{100 * r['miss_rate']:.1f}%" if cost == "miss_rate"
                 else f"{r['critical_mib_per_token']:.3f} MiB/tok ({100 * r['miss_rate']:.1f}% misses)")
                + (f"; ppl {gap}" if gap else ""))

    what = "miss rate" if cost == "miss_rate" else "critical-path MiB per token"
    cells = sorted({(r["model_key"], r["cache_size"], r["n_expert"]) for r in rows},
                   key=lambda c: (c[0], -c[1]))
    out = [f"Default: `preset:{default}`. A row dominates it when both its {what} and its perplexity "
           "are lower.", "",
           f"| model | cache | default: routing, eviction | ppl | {what} | dominated by |", "|---|---|---|---|---|---|"]
    beaten = {}
    for cell in cells:
        mine = [r for r in rows if (r["model_key"], r["cache_size"], r["n_expert"]) == cell]
        for r in mine:
            if r["setting"].startswith("preset:"):
                beaten.setdefault(r["setting"], []).append((cell, dominated(r, mine, cost)))
        d = next((r for r in mine if r["setting"] == f"preset:{default}"), None)
        if d is None:
            continue
        by = dominated(d, mine, cost)
        out.append(f"| {cell[0]} | {cell[1]}/{cell[2]} | `{d['spec']}` {d['eviction']} | {d['ppl']:.4f} | {fmt(d)} | "
                   + (", ".join(f"`{r['setting']}` ({r['ppl']:.4f}, {fmt(r, d)})" for r in by) or "nothing") + " |")
    out += ["", "| preset | cells where a row dominates it |", "|---|---|"]
    for name, cells_by in sorted(beaten.items()):
        lost = [f"{c[0]} {c[1]}/{c[2]}" for c, by in cells_by if by]
        out.append(f"| `{name}` | {len(lost)} of {len(cells_by)}" + (f": {', '.join(lost)}" if lost else "") + " |")
    # every setting (flat or preset) that nothing dominates in any cell: the candidates for a default,
    # with what they cost (perplexity against top-k + LRU) and save (misses or bytes against it) at worst and best
    saved = "fewer misses" if cost == "miss_rate" else "fewer critical bytes"
    out += ["", f"Settings that no row dominates in any cell, with their perplexity cost and their {saved} "
            "against top-k + LRU (worst / best over the cells):", "",
            f"| setting | Δ ppl, worst | Δ ppl, best | {saved}, worst | {saved}, best |", "|---|---|---|---|---|"]
    candidates = 0
    for name in sorted({r["setting"] for r in rows}):
        costs, saves, ok = [], [], True
        for cell in cells:
            mine = [r for r in rows if (r["model_key"], r["cache_size"], r["n_expert"]) == cell]
            r = next((x for x in mine if x["setting"] == name), None)
            base = next((x for x in mine if x["setting"] == "lru"), None)
            if r is None or base is None or dominated(r, mine, cost):
                ok = False
                break
            costs.append(r["ppl"] / base["ppl"] - 1)
            saves.append(base[cost] / max(r[cost], 1e-9))
        if ok and costs:
            candidates += 1
            out.append(f"| `{name}` | {100 * max(costs):+.2f}% | {100 * min(costs):+.2f}% | {min(saves):.2f}x | "
                       f"{max(saves):.2f}x |")
    if not candidates:  # no default could meet the criterion in these cells: say so, not an empty table
        out[-2:] = [f"None: in these {len(cells)} cells every setting of the grid is dominated in at least one."]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
