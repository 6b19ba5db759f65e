#!/usr/bin/env python3
"""Eviction policies under cache-conditional routing: perplexity against miss rate (Pareto fronts)
of prior routing with each eviction policy, against prior with LRU eviction and LRU alone, on
the two trained models' held-out text (models/, docs/models.md).

    python scripts/bench_eviction.py                       # both models, 1/2 and 1/4 cache, lru and router-mass
    python scripts/bench_eviction.py --models A --sizes 0.5 --evictions lru,lfu,freq-prob,router-mass --chunks 60

For each model, cache size, eviction and J it runs `pymoecache ppl`'s sweep (every chunk of the
held-out text evaluated from an empty KV cache, the expert cache carried over), then reports the
headline: the largest reduction of misses against LRU routing with LRU eviction at a perplexity
cost of at most 1% (and 2%). Rows go to docs/results/eviction_<model>.csv, fronts to
docs/results/eviction_<model>.png. Needs ../shared/data (the training split of scripts/train_tiny_moe.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

MODELS = {"A": "tiny-shakespeare-qwen2moe-60x4.gguf", "B": "tiny-shakespeare-mixtral-8x2.gguf"}
PRIORS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)


def best_at_cost(rows, base_ppl: float, base_miss: float, cost: float):
    """(factor, row): the row with the fewest misses whose perplexity is at most (1 + cost) x base."""
    ok = [r for r in rows if r["ppl"] <= base_ppl * (1 + cost) and r["miss_rate"] > 0]
    if not ok:
        return None, None
    r = min(ok, key=lambda r: r["miss_rate"])
    return base_miss / r["miss_rate"], r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="A,B", help="A, B or both (default %(default)s)")
    ap.add_argument("--sizes", default="0.5,0.25", help="cache sizes, shares of the experts (default %(default)s)")
    ap.add_argument("--evictions", default="lru,router-mass",
                    help="eviction policies (default %(default)s)")
    ap.add_argument("--top-j", default="1,2", help="J values for model A (B has K = 2: J = 1) (default %(default)s)")
    ap.add_argument("--ctx", type=int, default=256, help="chunk length (default %(default)s)")
    ap.add_argument("--chunks", type=int, default=60,
                    help="only the first N chunks of --ctx tokens, 0 = all (default %(default)s: about half the "
                         "held-out text)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"), help="output folder (default docs/results)")
    args = ap.parse_args()

    from train_tiny_moe import split_text

    from pymoecache.config import Prior, TopK
    from pymoecache.evaluate import sweep, write_rows

    text_path = Path(args.out) / "_heldout.txt"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    text_path.write_text(split_text()[1], encoding="utf-8")
    sizes = [float(s) for s in args.sizes.split(",")]
    evictions = [e.strip() for e in args.evictions.split(",")]
    lines = []
    try:
        for key in args.models.split(","):
            model = ROOT / "models" / MODELS[key]
            js = [int(j) for j in args.top_j.split(",")] if key == "A" else [1]
            rows = []
            for ev in evictions:
                for j in js:
                    routings = [TopK()] + [Prior(lam, top_j=j) for lam in PRIORS]
                    for r in sweep(model, text_path, routings, sizes, ctx=args.ctx, max_chunks=args.chunks or None,
                                   progress=False, eviction=ev):
                        if r["policy"] == "lru" and j != js[0]:
                            continue  # LRU routing does not depend on J
                        r["series"] = "lru" if r["policy"] == "lru" else f"prior J={j}"
                        rows.append(r)
                    print(f"[{key}] eviction {ev}, J={j}: done", file=sys.stderr, flush=True)
                    write_rows(rows, Path(args.out) / f"eviction_{key}.csv", "csv")  # so far: a stop loses little
            _plot(rows, Path(args.out) / f"eviction_{key}.png", f"model {key}: {MODELS[key]}")
            lines += _summary(key, rows, sizes)
    finally:
        text_path.unlink(missing_ok=True)
    print("\n".join(lines))
    return 0


def _summary(key, rows, sizes):
    out = [f"## model {key}"]
    for size in sizes:
        at = [r for r in rows if abs(r["cache_size"] / r["n_expert"] - size) < 1e-6]
        base = next(r for r in at if r["policy"] == "lru" and r["eviction"] == "lru")
        out.append(f"cache {base['cache_size']}/{base['n_expert']}: LRU routing + LRU eviction ppl {base['ppl']:.3f}, "
                   f"miss {100 * base['miss_rate']:.2f}%")
        for ev in sorted({r["eviction"] for r in at}):
            lru_ev = next(r for r in at if r["policy"] == "lru" and r["eviction"] == ev)
            parts = [f"  {ev:<12} lru routing: miss {100 * lru_ev['miss_rate']:.2f}% ppl {lru_ev['ppl']:.3f}"]
            for cost in (0.01, 0.02):
                f, r = best_at_cost([x for x in at if x["eviction"] == ev], base["ppl"], base["miss_rate"], cost)
                if r is not None:
                    parts.append(f"<= {100 * cost:.0f}% ppl: {f:.2f}x fewer misses ({r['spec']}, "
                                 f"miss {100 * r['miss_rate']:.2f}%, ppl {r['ppl']:.3f})")
            out.append(" | ".join(parts))
    return out


def _plot(rows, png, title):
    from pymoecache.plots import require_matplotlib

    plt = require_matplotlib()
    sizes = sorted({r["cache_size"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        at = [r for r in rows if r["cache_size"] == size]
        base = next(r for r in at if r["policy"] == "lru" and r["eviction"] == "lru")
        for ev in sorted({r["eviction"] for r in at}):
            for series in sorted({r["series"] for r in at if r["series"] != "lru"}):
                pts = sorted((100 * r["miss_rate"], r["ppl"]) for r in at if r["eviction"] == ev and r["series"] == series)
                ax.plot(*zip(*pts), marker="o", ms=3, label=f"{series}, {ev}")
            lr = next(r for r in at if r["policy"] == "lru" and r["eviction"] == ev)
            ax.plot(100 * lr["miss_rate"], lr["ppl"], marker="*", ms=10, color="black" if ev == "lru" else "gray",
                    linestyle="none")
        ax.axhline(base["ppl"] * 1.01, color="gray", lw=0.8, ls="--")
        ax.set_ylim(base["ppl"] * 0.995, base["ppl"] * 1.06)
        ax.set_xlabel("miss rate (%)")
        ax.set_title(f"cache {size}/{at[0]['n_expert']} (stars: LRU routing; dashed: +1% ppl)")
    axes[0][0].set_ylabel("perplexity")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
