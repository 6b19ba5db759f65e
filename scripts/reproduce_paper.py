#!/usr/bin/env python3
"""Reproduce the published evaluation (docs/method.md) on our two trained MoE models.

For each model (models/*.gguf, trained by scripts/train_tiny_moe.py) on its held-out text (the
last 10% of Tiny Shakespeare, never trained on), with method.md's protocol (chunks of ``--ctx``
tokens, every token routed, the expert cache carried across chunks):

1. Pareto fronts, perplexity vs miss rate, at cache 1/2 and 1/4 of the routed experts: LRU
   (stock top-K), prune(R), max-rank(m), cumsum(tau) and prior(lambda), each knob swept;
2. a lifetime / miss-rate table like the published one (LRU vs prior:0.5 at half cache);
3. rank sensitivity: perplexity when the router's rank-i expert is dropped, or swapped for a
   random expert outside the top-K (policies drop-rank:i / swap-rank:i);
4. the effect of Top-J on prior:0.5 (J = 0..K);
5. hit/miss timelines of one layer for LRU and prior:0.5 (256 held-out tokens, cache 1/4).

Writes PNGs and CSVs into ``--out``/results/ and ``--out``/results.md with the tables, the plots,
plain statements of what the numbers show, and the exact command. One command::

    python scripts/reproduce_paper.py                 # both models, all held-out tokens
    python scripts/reproduce_paper.py --max-chunks 8  # a quick look (fewer tokens per setting)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import pymoecache  # noqa: E402  (before llama_cpp: our libllama)
from pymoecache import evaluate as E  # noqa: E402
from pymoecache.config import CacheConfig, CumsumThreshold, DropRank, MaxRank, Prior, Prune, SwapRank, TopK  # noqa: E402


@dataclass(frozen=True)
class ModelRun:
    key: str            # short name used in file names
    file: str           # under models/
    top_j: int          # J of the method for this layout (method.md: 1 for top-2, 2 for top-4/6)
    max_ranks: tuple    # m values for max-rank
    layer: int          # layer shown in the timeline


MODELS = {
    "A": ModelRun("A-qwen2moe-60x4", "tiny-shakespeare-qwen2moe-60x4.gguf", 2, (5, 6, 8, 12, 20, 30), 1),
    "B": ModelRun("B-mixtral-8x2", "tiny-shakespeare-mixtral-8x2.gguf", 1, (3, 4, 5, 6, 8), 1),
}
PRIORS = (0.1, 0.25, 0.5, 0.75, 1.0, 2.0)
TAUS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
CACHE_FRACTIONS = (0.5, 0.25)
TIMELINE_TOKENS = 256


def held_out_text() -> str:
    from train_tiny_moe import split_text  # the same split the models were trained with

    return split_text()[1]


def sweep_routings(run: ModelRun, K: int) -> list:
    j = run.top_j
    out = [TopK()]
    out += [Prune(r, top_j=min(j, r)) for r in range(1, K)]
    out += [MaxRank(m, top_j=j) for m in run.max_ranks]
    out += [CumsumThreshold(t, top_j=j) for t in TAUS]
    out += [Prior(x, top_j=j) for x in PRIORS]
    return out


def evaluate(llm, tokens, routing, ctx, max_chunks, desc) -> dict:
    llm.moecache.clear()          # empty cache and a fresh running Delta for every setting
    llm.moecache.reset_stats()
    llm.moecache.set_routing(routing, scope="all")
    res = E.perplexity(llm, tokens, ctx, progress=True, limit_chunks=max_chunks, desc=desc)
    return E.result_row(routing, res)


def write_csv(rows: Sequence[dict], path: Path) -> None:
    E.write_rows(rows, path, "csv")


# --- analysis of the rows (the statements in results.md come from here) ------------------------

def front_dominates(a: Sequence[dict], b: Sequence[dict], tol: float = 1e-9) -> bool:
    """True if every point of ``b`` is weakly dominated by the piecewise-linear front of ``a``
    (for b's miss rate, a reaches a perplexity <= b's by interpolation between its points)."""
    pts = sorted((float(r["miss_rate"]), float(r["ppl"])) for r in a)
    for r in b:
        x, y = float(r["miss_rate"]), float(r["ppl"])
        best = interp_front(pts, x)
        if best is None or best > y * (1 + tol):
            return False
    return True


def interp_front(pts: Sequence[tuple], x: float) -> Optional[float]:
    """Lowest perplexity reachable at miss rate <= x on the lower-left envelope of ``pts``
    (linear interpolation between neighbours); None if every point misses more than x."""
    pts = sorted(pts)
    if not pts or x < pts[0][0]:
        return None
    best = min(y for px, y in pts if px <= x)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1 and x1 > x0:
            best = min(best, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return best


def halving_cost(rows: Sequence[dict]) -> Optional[dict]:
    """Perplexity of prior's front at half of LRU's miss rate, relative to LRU's perplexity."""
    lru = next(r for r in rows if r["policy"] == "lru")
    target = lru["miss_rate"] / 2
    pts = [(float(r["miss_rate"]), float(r["ppl"])) for r in rows if r["policy"] == "prior"]
    y = interp_front(pts, target)
    if y is None:
        return None
    return {"lru_miss": lru["miss_rate"], "target_miss": target, "ppl_lru": lru["ppl"], "ppl_prior": y,
            "rel": y / lru["ppl"] - 1}


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# --- plots ----------------------------------------------------------------------------------------

def plot_rank(rows: Sequence[dict], base_ppl: float, title: str, path: Path) -> None:
    from pymoecache.plots import require_matplotlib

    plt = require_matplotlib()
    ranks = sorted({r["rank"] for r in rows})
    drop = [next(r["ppl"] for r in rows if r["kind"] == "drop" and r["rank"] == i) for i in ranks]
    swap = [next(r["ppl"] for r in rows if r["kind"] == "swap" and r["rank"] == i) for i in ranks]
    x = np.arange(len(ranks))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(x - 0.2, drop, 0.4, label="rank-i expert dropped", color="tab:red")
    ax.bar(x + 0.2, swap, 0.4, label="rank-i expert swapped for a random one", color="tab:purple")
    ax.axhline(base_ppl, color="black", linestyle="--", label=f"stock top-K ({base_ppl:.2f})")
    ax.set_xticks(x, [f"rank {i + 1}" for i in ranks])
    ax.set_ylabel("perplexity")
    lo = min(base_ppl, *drop, *swap)
    ax.set_ylim(lo * 0.95, max(drop + swap) * 1.05)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- one model ------------------------------------------------------------------------------------

def run_model(run: ModelRun, text: str, out: Path, ctx: int, max_chunks: Optional[int], threads: int) -> dict:
    from pymoecache.plots import plot_pareto, plot_timeline

    path = REPO / "models" / run.file
    if not path.is_file():
        raise SystemExit(f"reproduce_paper: {path} is missing (python scripts/train_tiny_moe.py builds it)")
    info = pymoecache.model_info(path)
    N, K = info.n_expert, info.n_expert_used
    res = {"run": run, "path": path, "N": N, "K": K, "sweep": [], "rank": [], "topj": []}
    t0 = time.time()
    for frac in CACHE_FRACTIONS:
        llm = E.load_for_eval(path, frac, ctx, n_threads=threads)
        try:
            tokens = E.tokenize_text(llm, text)
            res["n_tokens_text"] = len(tokens)
            for routing in sweep_routings(run, K):
                row = evaluate(llm, tokens, routing, ctx, max_chunks, f"{run.key} {routing.spec()} cache {frac}")
                res["sweep"].append({"model": run.key, **row})
            if frac == 0.5:
                base = next(r for r in res["sweep"] if r["policy"] == "lru" and r["cache_size"] == row["cache_size"])
                for i in range(K):
                    for kind, routing in (("drop", DropRank(i)), ("swap", SwapRank(i))):
                        row = evaluate(llm, tokens, routing, ctx, max_chunks, f"{run.key} {routing.spec()}")
                        res["rank"].append({"model": run.key, "kind": kind, "rank": i, "ppl": row["ppl"],
                                            "ppl_stock": base["ppl"], "rel": row["ppl"] / base["ppl"] - 1})
                for lam in (0.5, 1.0):
                    for j in range(0, K + 1):
                        row = evaluate(llm, tokens, Prior(lam, top_j=j), ctx, max_chunks, f"{run.key} prior:{lam}:j={j}")
                        res["topj"].append({"model": run.key, "lambda": lam, "top_j": j, **{
                            k: row[k] for k in ("ppl", "miss_rate", "lifetime", "cache_size")}})
        finally:
            llm.close()
    res["eval_s"] = time.time() - t0

    key = run.key
    write_csv(res["sweep"], out / f"sweep_{key}.csv")
    write_csv(res["rank"], out / f"rank_{key}.csv")
    write_csv(res["topj"], out / f"topj_{key}.csv")
    plot_pareto(res["sweep"], out / f"pareto_{key}.png",
                title=f"{run.file}: held-out perplexity vs miss rate (J={run.top_j})")
    plot_rank(res["rank"], res["rank"][0]["ppl_stock"], f"{run.file}: rank sensitivity (held-out)",
              out / f"rank_{key}.png")

    # timelines: the same tokens, LRU vs prior:0.5, cache 1/4
    tl_tokens = None
    res["timeline"] = {}
    for routing in (TopK(), Prior(0.5, top_j=run.top_j)):
        n_moe = len(info.moe_layers)
        llm = E.load_llama(path, cache=CacheConfig(size=0.25, trace=TIMELINE_TOKENS * n_moe, residency="none"),
                           routing=routing,
                           routing_scope="all", n_ctx=TIMELINE_TOKENS, n_batch=TIMELINE_TOKENS, n_threads=threads)
        try:
            tl_tokens = tl_tokens or E.tokenize_text(llm, text)[:TIMELINE_TOKENS]
            tr = E.record_trace(llm, tl_tokens)
        finally:
            llm.close()
        name = "lru" if isinstance(routing, TopK) else "prior"
        png = out / f"timeline_{key}_{name}.png"
        plot_timeline(tr, run.layer, png)
        j = [int(x) for x in tr["moe_layers"]].index(run.layer)
        res["timeline"][name] = {"png": png.name, "miss_rate": float(1 - tr["hit"][:, j].sum() / (K * len(tl_tokens)))}
    return res


# --- results.md -----------------------------------------------------------------------------------

def md_table(head: Sequence[str], rows: Sequence[Sequence]) -> List[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return out


def model_card(path: Path) -> dict:
    card = path.with_suffix(".json")
    return json.loads(card.read_text()) if card.is_file() else {}


def findings(res: dict) -> List[str]:
    rows, run = res["sweep"], res["run"]
    lines = []
    for size in sorted({r["cache_size"] for r in rows}, reverse=True):
        g = [r for r in rows if r["cache_size"] == size]
        prior = [r for r in g if r["policy"] == "prior"]
        dom = {p: front_dominates(prior, [r for r in g if r["policy"] == p])
               for p in ("lru", "prune", "max-rank", "cumsum") if any(r["policy"] == p for r in g)}
        yes = [p for p, d in dom.items() if d]
        no = [p for p, d in dom.items() if not d]
        s = f"- cache {size}/{res['N']}: prior's front "
        s += (f"Pareto-dominates {', '.join(yes)}" if yes else "dominates none of the other policies")
        if no:
            s += f"; it does **not** dominate {', '.join(no)} (some point of theirs has lower perplexity at the same or lower miss rate)"
        h = halving_cost(g)
        if h is None:
            s += f". Prior never reaches half of LRU's miss rate ({fmt_pct(g[0]['miss_rate'])}) in this sweep."
        else:
            s += (f". At half of LRU's miss rate ({fmt_pct(h['lru_miss'])} -> {fmt_pct(h['target_miss'])}) prior's "
                  f"perplexity is {h['ppl_prior']:.3f} vs LRU's {h['ppl_lru']:.3f} ({100 * h['rel']:+.2f}%).")
        lines.append(s)
    lru = next(r for r in rows if r["policy"] == "lru" and r["cache_size"] == max(x["cache_size"] for x in rows))
    p05 = next(r for r in rows if r["spec"].startswith("prior:0.5") and r["cache_size"] == lru["cache_size"])
    lines.append(f"- prior:0.5 at half cache: {lru['miss_rate'] / max(p05['miss_rate'], 1e-12):.1f}x fewer misses "
                 f"than LRU ({fmt_pct(lru['miss_rate'])} -> {fmt_pct(p05['miss_rate'])}), perplexity "
                 f"{lru['ppl']:.3f} -> {p05['ppl']:.3f} ({100 * (p05['ppl'] / lru['ppl'] - 1):+.2f}%); "
                 f"expert lifetime {lru['lifetime']:.1f} -> {p05['lifetime']:.1f} tokens.")
    rk = res["rank"]
    if rk:
        worst = max(rk, key=lambda r: r["rel"])
        later = [r for r in rk if r["rank"] >= run.top_j]
        lines.append(f"- rank sensitivity: the largest loss is {worst['kind']}ping rank {worst['rank'] + 1} "
                     f"({100 * worst['rel']:+.1f}% perplexity)"
                     + (f"; ranks {run.top_j + 1}..{res['K']} cost at most {100 * max(r['rel'] for r in later):+.1f}%"
                        if later else "") + ".")
    return lines


def write_md(results: List[dict], out_dir: Path, md: Path, cmd: str, wall_s: float, ctx: int) -> None:
    rel = lambda p: Path(out_dir.name) / p  # noqa: E731  (paths relative to results.md)
    L = ["# Results: cache-conditional routing on our trained MoE models", "",
         "Produced by one command, on this machine "
         f"({platform.machine()}, {platform.system()}), in {wall_s / 60:.1f} min:", "",
         f"    {cmd}", "",
         "Protocol ([method.md](method.md)): held-out text = the last 10% of Tiny Shakespeare (never trained on); "
         f"chunks of {ctx} tokens, each from an empty KV cache with BOS first; every token routed by the policy; "
         "the expert cache carried across chunks and emptied before each setting. Miss rate = misses / (K x tokens). "
         "Lifetime = mean tokens an expert stays in a layer's cache. Models and their training: `models/*.md`.", ""]
    L += ["## Models", ""]
    rows = []
    for r in results:
        c = model_card(r["path"])
        h = c.get("held_out", {})
        rows.append([r["run"].key, f"`{r['path'].name}`", f"{r['N']} x top-{r['K']}", r["run"].top_j,
                     f"{c.get('held_out_llama_cpp', {}).get('ppl', float('nan')):.2f}",
                     f"{h.get('unigram_ppl', float('nan')):.1f}", r["n_tokens_text"],
                     f"{r['eval_s'] / 60:.1f} min"])
    L += md_table(["model", "file", "experts", "J", "held-out ppl (llama.cpp)", "unigram ppl", "held-out tokens",
                   "eval time"], rows)
    L += ["", "## Lifetime and miss rate at half cache (as in method.md's table)", ""]
    rows = []
    for r in results:
        half = max(x["cache_size"] for x in r["sweep"])
        lru = next(x for x in r["sweep"] if x["policy"] == "lru" and x["cache_size"] == half)
        pr = next(x for x in r["sweep"] if x["spec"].startswith("prior:0.5") and x["cache_size"] == half)
        rows.append([r["run"].key, f"{half}/{r['N']}", f"{lru['lifetime']:.1f}", f"{100 * lru['miss_rate']:.1f}",
                     f"{pr['lifetime']:.1f}", f"{100 * pr['miss_rate']:.1f}", f"{lru['ppl']:.3f}", f"{pr['ppl']:.3f}"])
    L += md_table(["model", "cache", "LRU lifetime", "LRU miss %", "Prior lifetime", "Prior miss %", "LRU ppl",
                   "Prior(0.5) ppl"], rows)
    L += ["", "Published (Qwen1.5-MoE 30/60: LRU 22 / 35%, Prior 111 / 7%; Mixtral 4/8: LRU 5 / 40%, Prior 10 / 21%).", ""]
    for r in results:
        key = r["run"].key
        L += [f"## {key}: `{r['path'].name}`", "", "What the numbers show (computed from the rows below):", ""]
        L += findings(r)
        L += ["", f"![Pareto {key}]({rel(f'pareto_{key}.png')})", "",
              f"Sweep (`{rel(f'sweep_{key}.csv')}`):", ""]
        L += md_table(["cache", "policy", "knob", "J", "ppl", "miss %", "lifetime"],
                      [[f"{x['cache_size']}/{x['n_expert']}", x["policy"], "-" if x["knob"] is None else f"{x['knob']:g}",
                        "-" if x["top_j"] is None else x["top_j"], f"{x['ppl']:.3f}", f"{100 * x['miss_rate']:.1f}",
                        f"{x['lifetime']:.1f}"] for x in r["sweep"]])
        L += ["", f"### Rank sensitivity ({key})", "",
              f"![rank {key}]({rel(f'rank_{key}.png')})", ""]
        L += md_table(["rank", "dropped: ppl", "swapped: ppl", "stock ppl"],
                      [[i + 1, f"{next(x['ppl'] for x in r['rank'] if x['kind'] == 'drop' and x['rank'] == i):.3f}",
                        f"{next(x['ppl'] for x in r['rank'] if x['kind'] == 'swap' and x['rank'] == i):.3f}",
                        f"{r['rank'][0]['ppl_stock']:.3f}"] for i in range(r["K"])])
        L += ["", f"### Effect of J on the prior ({key}, half cache)", ""]
        L += md_table(["lambda", "J", "ppl", "miss %", "lifetime"],
                      [[x["lambda"], x["top_j"], f"{x['ppl']:.3f}", f"{100 * x['miss_rate']:.1f}", f"{x['lifetime']:.1f}"]
                       for x in r["topj"]])
        tl = r["timeline"]
        L += ["", f"### Hit/miss timeline ({key}, layer {r['run'].layer}, cache 1/4, {TIMELINE_TOKENS} held-out tokens)", "",
              f"LRU: miss rate {fmt_pct(tl['lru']['miss_rate'])} in this layer; prior:0.5: {fmt_pct(tl['prior']['miss_rate'])}.", "",
              f"![timeline LRU {key}]({rel(tl['lru']['png'])})", "", f"![timeline prior {key}]({rel(tl['prior']['png'])})", ""]
    quarter = out_dir / "quarter.md"  # scripts/bench_quarter.py's section, kept across regenerations
    if quarter.is_file():
        L += ["", quarter.read_text().rstrip()]
    md.write_text("\n".join(L) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS), help="which models")
    ap.add_argument("--out", type=Path, default=REPO / "docs", help="results.md goes here, figures in results/")
    ap.add_argument("--ctx", type=int, default=256, help="chunk length in tokens (the models' context)")
    ap.add_argument("--max-chunks", type=int, default=None, help="at most this many chunks per setting (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    args = ap.parse_args(argv)

    t0 = time.time()
    fig_dir = args.out / "results"
    fig_dir.mkdir(parents=True, exist_ok=True)
    text = held_out_text()
    results = [run_model(MODELS[k], text, fig_dir, args.ctx, args.max_chunks, args.threads) for k in args.models]
    argv_s = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    cmd = f"python scripts/reproduce_paper.py {argv_s}".strip()
    write_md(results, fig_dir, args.out / "results.md", cmd, time.time() - t0, args.ctx)
    print(f"wrote {args.out / 'results.md'} and {fig_dir}/ in {(time.time() - t0) / 60:.1f} min")
    for r in results:
        print("\n".join(findings(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
