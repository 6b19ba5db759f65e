"""Figures: the perplexity / miss-rate Pareto front of a sweep, and one layer's hit/miss timeline.

matplotlib (Agg backend) is imported only when a figure is drawn, so ``import pymoecache`` never
needs it (``pip install 'pymoecache[plot]'``).

>>> from pymoecache.evaluate import sweep, parse_sweep                           # doctest: +SKIP
>>> rows = sweep("model.gguf", "valid.txt", parse_sweep("prior=0,0.5,1"), [0.5, 0.25], ctx=256)  # doctest: +SKIP
>>> plot_pareto(rows, "pareto.png")                                              # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from ._mpl import require_matplotlib  # noqa: F401  (re-exported: pymoecache.plots.require_matplotlib)
from .evaluate import EvalError, trace_source

# one colour per policy, the same in every panel; LRU is a black star
POLICY_STYLE = {
    "prior": ("tab:blue", "o", "prior (λ)"),
    "cumsum": ("tab:orange", "s", "cumsum (τ)"),
    "max-rank": ("tab:green", "^", "max-rank (m)"),
    "prune": ("tab:red", "v", "prune (R)"),
}
# where each policy writes its knob values next to a point (offset in points, alignment), so that
# labels of different policies at the same point do not overlap
LABEL_PLACE = {"prior": ((5, 4), "left"), "cumsum": ((5, -11), "left"),
               "max-rank": ((-5, 4), "right"), "prune": ((-5, -11), "right")}

# timeline cell states: colour and legend label
NOT_CACHED, CACHED, HIT, MISS = 0, 1, 2, 3
TIMELINE_COLORS = ["#f4f4f4", "#a6cee3", "#33a02c", "#e31a1c"]
TIMELINE_LABELS = ["not cached", "cached, not used", "hit", "miss"]




def _by_cache_size(rows: Sequence[dict]) -> Dict[int, List[dict]]:
    groups: Dict[int, List[dict]] = {}
    for r in rows:
        groups.setdefault(int(r["cache_size"]), []).append(r)
    return dict(sorted(groups.items(), reverse=True))  # biggest cache first


def _draw_pareto_panel(ax, rows: Sequence[dict]) -> None:
    for policy, (color, marker, label) in POLICY_STYLE.items():
        pts = sorted((r for r in rows if r["policy"] == policy), key=lambda r: float(r["knob"]))
        if not pts:
            continue
        x = [100 * float(r["miss_rate"]) for r in pts]
        y = [float(r["ppl"]) for r in pts]
        ax.plot(x, y, marker=marker, color=color, label=label, linewidth=1.5, markersize=6)
        labels: Dict[tuple, List[str]] = {}  # knob values that land on the same point share one label
        for r, xi, yi in zip(pts, x, y):
            labels.setdefault((xi, yi), []).append(f"{float(r['knob']):g}")
        offset, ha = LABEL_PLACE[policy]
        for (xi, yi), knobs in labels.items():
            ax.annotate(",".join(knobs), (xi, yi), textcoords="offset points", xytext=offset, ha=ha,
                        fontsize=8, color=color)
    for r in rows:
        if r["policy"] == "lru":
            ax.scatter([100 * float(r["miss_rate"])], [float(r["ppl"])], marker="*", s=220, color="black",
                       zorder=5, label="LRU (stock top-K)")
    r0 = rows[0]
    ax.set_title(f"cache {r0['cache_size']}/{r0['n_expert']} experts per layer")
    ax.set_xlabel("miss rate (% of K x tokens)")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)


def plot_pareto(rows: Sequence[dict], out_png: "str | Path", title: str = "perplexity vs expert-cache miss rate") -> None:
    """Perplexity (y) against miss rate in % (x): one line per policy, points sorted by the
    policy's knob and labelled with it, LRU as a black star; one panel per cache size."""
    if not rows:
        raise EvalError("no rows to plot")
    plt = require_matplotlib()
    groups = _by_cache_size(rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups) + 1, 4.8), sharey=True, squeeze=False)
    for ax, group in zip(axes[0], groups.values()):
        _draw_pareto_panel(ax, group)
    axes[0][0].set_ylabel("perplexity")
    axes[0][-1].legend(loc="best", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def timeline_states(trace: dict, layer: int, max_tokens: Optional[int] = None) -> np.ndarray:
    """[N experts, T tokens] of NOT_CACHED / CACHED / HIT / MISS for one model layer.

    A cell is HIT or MISS when the expert was selected for that token, else CACHED when the expert
    is in the cache after the token, else NOT_CACHED.
    """
    j = moe_index(trace, layer)
    sel, hit, cached = trace["selected"][:, j], trace["hit"][:, j], trace["cached"][:, j]
    if max_tokens is not None:
        sel, hit, cached = sel[:max_tokens], hit[:max_tokens], cached[:max_tokens]
    T, N = cached.shape
    state = np.where(cached, CACHED, NOT_CACHED).astype(np.int8)
    t_idx, slot = np.nonzero(sel >= 0)
    state[t_idx, sel[t_idx, slot]] = np.where(hit[t_idx, slot], HIT, MISS)
    return state.T


def moe_index(trace: dict, layer: int) -> int:
    """Position of model layer ``layer`` in the trace's MoE layers; EvalError if it has none."""
    moe = [int(x) for x in trace["moe_layers"]]
    n_layer = int(trace.get("n_layer", max(moe) + 1))
    if not 0 <= layer < n_layer:
        raise EvalError(f"layer {layer} is out of range: the model has layers 0..{n_layer - 1}")
    if layer not in moe:
        raise EvalError(f"layer {layer} is not a MoE layer (MoE layers: {moe[0]}..{moe[-1]})")
    return moe.index(layer)


def plot_timeline(trace, layer: int, out_png: "str | Path", max_tokens: Optional[int] = None) -> None:
    """Image of one layer's cache over time: experts (y) x tokens (x), coloured not cached /
    cached, not used / hit / miss. A horizontal run of colour is one stay of an expert in the cache.
    ``trace`` is a :func:`pymoecache.evaluate.record_trace` dict or the path of its .npz."""
    d = trace_source(trace)
    state = timeline_states(d, layer, max_tokens)
    plt = require_matplotlib()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    N, T = state.shape
    misses = int((state == MISS).sum())
    miss_rate = misses / (int(d["n_expert_used"]) * T)
    fig, ax = plt.subplots(figsize=(min(16, 8 + T / 40), min(10, 2.5 + N / 8)))
    cmap = ListedColormap(TIMELINE_COLORS)
    ax.imshow(state, aspect="auto", interpolation="nearest", origin="lower", cmap=cmap,
              norm=BoundaryNorm(np.arange(-0.5, 4.5), cmap.N), extent=(-0.5, T - 0.5, -0.5, N - 0.5))
    ax.set_xlabel("token")
    ax.set_ylabel("expert")
    ax.set_title(f"{d.get('model', '')}  layer {layer}\nrouting {d['routing']}, cache {d['cache_size']}/{N} experts, "
                 f"miss rate {100 * miss_rate:.1f}% over {T} tokens", fontsize=11)
    handles = [Patch(facecolor=c, edgecolor="0.5", label=lab) for c, lab in zip(TIMELINE_COLORS, TIMELINE_LABELS)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
