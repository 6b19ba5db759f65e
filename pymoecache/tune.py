"""Per-layer tuning of the cache-conditional router on a calibration text (issue 28, directions 1-2).

Two things may differ between layers while the memory and the perplexity budget stay the same:

- **the prior's strength** (``Prior(layers=...)``): some layers lose little perplexity under a
  strong prior, others a lot. :func:`layer_sensitivity` measures, on a calibration text, the
  perplexity and that layer's miss rate with the prior applied at one layer alone, for a few
  strengths; :func:`choose_layer_scales` spends the budget where it buys the most misses (a
  Lagrangian choice, one strength per layer, assuming the layers' costs add up); :func:`tune`
  checks the result on the calibration text and backs off until it fits.
- **the cache size** (``CacheConfig(per_layer=...)``): :func:`allocate_slots` gives the same
  total number of slots to the layers where one more slot saves the most misses, never fewer
  than K per layer (a token's K experts must fit).

The text must not be the one you evaluate on: tune on one part, measure on another
(``scripts/bench_quarter.py`` does both on the trained models).

>>> allocate_slots({0: {2: 0.5, 3: 0.3, 4: 0.2}, 1: {2: 0.6, 3: 0.3, 4: 0.25}}, total=6, k=2)
[3, 3]
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from .config import ConfigError, Prior
from .constants import MOECACHE_MAX_EXPERTS, MOECACHE_MAX_LAYERS
from .predictors import load_predictor, save_predictor  # noqa: F401  (the files fit_predictor's result goes to)

SCALES = (0.5, 1.0, 1.5, 2.5, 5.0)  # per-layer multiples of the base strength that are measured


def _number(what: str, v, lo: float = 0.0, hi: float = math.inf, lo_open: bool = False) -> float:
    """``v`` as a float when it is a finite real number in [lo, hi] (``(lo, hi]`` with lo_open);
    ConfigError otherwise (NaN, inf, a string, a bool)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
            or not (v > lo if lo_open else v >= lo) or v > hi:
        raise ConfigError(f"{what} must be a finite number {'>' if lo_open else '>='} {lo:g}"
                          + (f" and <= {hi:g}" if hi != math.inf else "") + f", got {v!r}")
    return float(v)


def _int(what: str, v, lo: int, hi: int) -> int:
    """``v`` as an int when it is a whole number (Python's or numpy's, not a bool) in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
        raise ConfigError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)


def _rates(what: str, rates) -> Dict[int, float]:
    """``{int: rate in [0, 1]}`` checked (a miss rate per layer, or per cache size)."""
    if not isinstance(rates, Mapping) or not rates:
        raise ConfigError(f"{what} must be a non-empty mapping, got {rates!r}")
    out = {}
    for key, v in rates.items():
        out[_int(f"a key of {what}", key, 0, MOECACHE_MAX_EXPERTS)] = _number(f"{what}[{key}]", v, 0.0, 1.0)
    return out


def allocate_slots(miss: Mapping[int, Mapping[int, float]], total: int, k: int) -> List[int]:
    """Cache sizes per layer (in the order of ``miss``'s keys) that sum to ``total``.

    miss: ``{layer: {size: miss rate}}``, measured at a few sizes; between two measured sizes the
    rate is interpolated linearly. Every layer starts at its smallest measured size (at least
    ``k``: a token's K experts must fit), then each further slot goes to the layer whose miss
    rate it lowers most (ties: the smaller layer, then the lower one), never past a layer's largest measured size while
    another layer can still grow. ConfigError if ``total < k * layers``, for more than a cache can
    hold (``MOECACHE_MAX_EXPERTS`` per layer), and for rates that are not in [0, 1].
    """
    if not isinstance(miss, Mapping) or not miss:
        raise ConfigError("allocate_slots: no layers (miss must map each layer to {cache size: miss rate})")
    if len(miss) > MOECACHE_MAX_LAYERS:
        raise ConfigError(f"allocate_slots: {len(miss)} layers; at most {MOECACHE_MAX_LAYERS}")
    miss = {_int("a layer of miss", il, 0, MOECACHE_MAX_LAYERS): _rates(f"miss[{il}]", m) for il, m in miss.items()}
    layers = list(miss)
    k = _int("k", k, 1, MOECACHE_MAX_EXPERTS)
    total = _int("total", total, 0, MOECACHE_MAX_EXPERTS * len(layers))
    if total < k * len(layers):
        raise ConfigError(f"{total} slots cannot give {len(layers)} layers K = {k} each")

    def rate(il: int, c: int) -> float:
        pts = sorted(miss[il].items())
        if c <= pts[0][0]:
            return pts[0][1]
        for (c0, m0), (c1, m1) in zip(pts, pts[1:]):
            if c0 <= c <= c1:
                return m0 + (m1 - m0) * (c - c0) / (c1 - c0)
        return pts[-1][1]

    size = {il: max(k, min(miss[il])) for il in layers}
    while sum(size.values()) > total:  # the measured range starts above the budget: shrink the largest
        big = max(layers, key=lambda il: (size[il], -layers.index(il)))
        if size[big] <= k:
            break
        size[big] -= 1
    for _ in range(total - sum(size.values())):
        room = [il for il in layers if size[il] < max(miss[il])] or layers
        gain = {il: rate(il, size[il]) - rate(il, size[il] + 1) for il in room}
        best = max(room, key=lambda il: (round(gain[il], 12), -size[il], -layers.index(il)))
        size[best] += 1
    return [size[il] for il in layers]


@dataclass
class LayerPoint:
    """The prior at one layer alone, at ``scale`` x the base strength, on the calibration text."""
    layer: int
    scale: float
    ppl: float
    miss: float     # that layer's miss rate


@dataclass
class Sensitivity:
    """What :func:`layer_sensitivity` measured: the stock router's perplexity and per-layer miss
    rates, and the points of every layer."""
    base_ppl: float
    base_miss: Dict[int, float]
    points: List[LayerPoint] = field(default_factory=list)


def choose_layer_scales(sens: Sensitivity, budget: float, mu: Optional[float] = None) -> Dict[int, float]:
    """One scale per layer (0 = no prior there) whose summed perplexity cost stays within
    ``budget`` (a share: 0.01 = 1%) and whose summed miss rates are the lowest; each layer's
    cost is measured with the prior at that layer alone, and the costs are assumed to add up.

    With ``mu`` given, each layer takes the point that minimises miss + mu x cost instead (the
    Lagrangian step; a larger mu is more careful). Without it, the smallest mu that fits is searched.
    """
    budget = _number("the perplexity budget", budget)
    if mu is not None:
        mu = _number("mu", mu)
    base_ppl = _number("the base perplexity", sens.base_ppl, lo_open=True)
    base_miss = _rates("the base miss rates", sens.base_miss)
    layers = sorted(base_miss)
    opts = {il: [(0.0, 0.0, base_miss[il])] for il in layers}
    for p in sens.points:
        if p.layer not in opts:
            raise ConfigError(f"a measured point is for layer {p.layer}, which has no base miss rate")
        opts[p.layer].append((_number("a scale", p.scale), max(0.0, _number("a perplexity", p.ppl, lo_open=True)
                                                                / base_ppl - 1.0),
                              _number("a miss rate", p.miss, 0.0, 1.0)))

    def pick(m: float) -> Dict[int, tuple]:
        return {il: min(opts[il], key=lambda o: (o[2] + m * o[1], o[1])) for il in layers}

    if mu is not None:
        return {il: o[0] for il, o in pick(mu).items()}
    lo, hi = 0.0, 1.0
    while sum(o[1] for o in pick(hi).values()) > budget and hi < 1e9:
        hi *= 2
    if sum(o[1] for o in pick(lo).values()) <= budget:
        return {il: o[0] for il, o in pick(lo).items()}
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(o[1] for o in pick(mid).values()) <= budget:
            hi = mid
        else:
            lo = mid
    return {il: o[0] for il, o in pick(hi).items()}


def layer_sensitivity(evaluate: Callable[[Prior], "tuple[float, Dict[int, float]]"], strength: float, top_j: int,
                      layers: Sequence[int], n_layer: int, scales: Sequence[float] = SCALES,
                      progress: Optional[Callable[[int, int], None]] = None) -> Sensitivity:
    """Measures each layer's cost: ``evaluate(routing) -> (perplexity, {layer: miss rate})`` runs the
    calibration text; first with the prior off everywhere (scale 0), then for each layer and scale
    with the prior at ``scale x strength`` on that layer alone."""
    n_layer = _int("n_layer", n_layer, 1, MOECACHE_MAX_LAYERS)
    layers = [_int("a layer", il, 0, n_layer - 1) for il in layers]
    if not layers:
        raise ConfigError("no layers to measure")
    scales = [_number("a scale", x, lo_open=True) for x in scales]
    off = Prior(strength, top_j=top_j, layers=(0.0,) * n_layer)
    base_ppl, base_miss = _measured(evaluate, off, layers)
    sens = Sensitivity(base_ppl, {il: base_miss[il] for il in layers})
    todo = [(il, s) for il in layers for s in scales]
    for i, (il, s) in enumerate(todo):
        one = [0.0] * n_layer
        one[il] = float(s)
        ppl, miss = _measured(evaluate, Prior(strength, top_j=top_j, layers=tuple(one)), layers)
        sens.points.append(LayerPoint(il, float(s), ppl, miss[il]))
        if progress:
            progress(i + 1, len(todo))
    return sens


def _measured(evaluate, routing: Prior, layers: Sequence[int]) -> "tuple[float, Dict[int, float]]":
    """``evaluate(routing)``, checked: a finite perplexity > 0 and a miss rate in [0, 1] for each layer."""
    got = evaluate(routing)
    try:
        ppl, miss = got
        ppl = _number("the perplexity evaluate returned", ppl, lo_open=True)
        miss = {il: _number(f"the miss rate evaluate returned for layer {il}", miss[il], 0.0, 1.0) for il in layers}
    except (TypeError, ValueError, KeyError, IndexError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"evaluate must return (perplexity, {{layer: miss rate}}) for layers {list(layers)}, "
                          f"got {got!r:.200}") from None
    return ppl, miss


@dataclass
class TuneResult:
    """A tuned router: ``routing`` (a Prior with per-layer scales) within ``budget`` on the
    calibration text; ``ppl``/``miss`` as measured there, against the stock router's ``base_ppl``."""
    routing: Prior
    budget: float
    base_ppl: float
    ppl: float
    miss: float
    sensitivity: Sensitivity
    tries: int


def tune_layer_scales(evaluate: Callable[[Prior], "tuple[float, Dict[int, float]]"], strength: float, top_j: int,
                      layers: Sequence[int], n_layer: int, budget: float, *, scales: Sequence[float] = SCALES,
                      max_tries: int = 6, progress=None) -> TuneResult:
    """:func:`layer_sensitivity`, :func:`choose_layer_scales`, then a run of the whole choice on the
    calibration text; where it costs more than ``budget`` (the layers' costs do not add up
    exactly), the budget given to the choice shrinks by a quarter and the choice is checked again,
    at most ``max_tries`` times; the last one that fits wins (the flat-off router if none)."""
    budget = _number("the perplexity budget", budget, lo_open=True)
    max_tries = _int("max_tries", max_tries, 1, 1000)
    sens = layer_sensitivity(evaluate, strength, top_j, layers, n_layer, scales, progress)
    b = budget
    best = None
    for t in range(1, max_tries + 1):
        chosen = choose_layer_scales(sens, b)
        scale = [0.0] * n_layer
        for il, s in chosen.items():
            scale[il] = s
        routing = Prior(strength, top_j=top_j, layers=tuple(scale))
        ppl, miss = _measured(evaluate, routing, layers)
        mean_miss = sum(miss[il] for il in layers) / len(layers)
        if ppl <= sens.base_ppl * (1 + budget):
            best = TuneResult(routing, budget, sens.base_ppl, ppl, mean_miss, sens, t)
            break
        b *= 0.75
    if best is None:
        off = Prior(strength, top_j=top_j, layers=(0.0,) * n_layer)
        best = TuneResult(off, budget, sens.base_ppl, sens.base_ppl,
                          sum(sens.base_miss.values()) / len(layers), sens, max_tries)
    return best


def ppl_evaluator(llm, tokens: Sequence[int], ctx: int, limit_chunks: Optional[int] = None):
    """An ``evaluate`` for :func:`tune_layer_scales` on a loaded Llama (``evaluate.load_for_eval``):
    the cache emptied, the routing set, ``pymoecache ppl``'s protocol over ``tokens``; returns the
    perplexity and each MoE layer's miss rate."""
    from .evaluate import perplexity

    def evaluate(routing: Prior):
        llm.moecache.clear()
        llm.moecache.reset_stats()
        llm.set_routing(routing, scope="all")
        res = perplexity(llm, tokens, ctx, progress=False, limit_chunks=limit_chunks)
        st = res.stats
        return res.ppl, {int(il): float(m) for il, m in zip(st.moe_layers, st.miss_rate_per_layer)}
    return evaluate


# --- fitted predictors for reading ahead (issue 26) ---------------------------------------------

def _router_weights(path: str, il: int, reader=None):
    """Layer il's router from the GGUF as float32 ([n_expert, n_embd], [n_expert] bias or None);
    ``reader``: a gguf.GGUFReader of ``path`` already open."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    names = {f"blk.{il}.ffn_gate_inp.weight": None, f"blk.{il}.ffn_gate_inp.bias": None}
    for t in (reader or GGUFReader(path)).tensors:
        if t.name in names:
            names[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    w, b = names.values()
    if w is None:
        raise ConfigError(f"layer {il} has no router in {path}")
    return w.reshape(-1, w.shape[-1]), (None if b is None else b.reshape(-1))


def fit_predictor(model_path, tokens, *, lam: float = 1000.0, n_threads: Optional[int] = None):
    """Predictors of the next layer's experts for ``prefetch="gate"``, fitted on ``tokens``.

    The gate predictor applies layer l + 1's router W to layer l's FFN input x, as if the hidden
    state did not change in between. Here each such pair of MoE layers gets W + D^T, where D is the
    ridge regression of what that misses (layer l + 1's true router logits z less W x and its bias)
    on x: D = (X^T X + lam I)^-1 X^T (Z - X W^T - b), over ``tokens`` decoded one at a time with the
    stock router. ``tokens``: one token list, or several (each decoded in a fresh context: texts
    of several kinds, so that what one context shares is not taken for what every token shares).
    ``lam`` pulls D toward 0 (the router itself): fit on one text, check on another.
    Returns ``{layer: [n_expert, n_embd] float32}`` for :meth:`pymoecache.Llama.load_predictor` (via
    :func:`save_predictor`) or ``MoECache.set_predictor``.
    """
    import numpy as np
    from gguf import GGUFReader

    from . import Llama
    from .config import CacheConfig, check_int

    contexts = [list(c) for c in tokens] if len(tokens) and not np.isscalar(tokens[0]) else [list(tokens)]
    n = sum(len(c) for c in contexts)
    check_int("tokens", n, 2)
    if not (isinstance(lam, (int, float)) and lam > 0 and np.isfinite(lam)):
        raise ConfigError(f"lam must be a positive number, got {lam!r}")
    llm = Llama(str(model_path), cache=CacheConfig(size=1.0, residency="none", router_record=n, router_record_input=True),
                routing="lru", n_ctx=max(len(c) for c in contexts) + 8, n_threads=n_threads, verbose=False)
    n_vocab = llm.n_vocab()
    bad = [t for c in contexts for t in c if not (isinstance(t, numbers.Integral) and 0 <= t < n_vocab)]
    if bad:
        llm.close()
        raise ConfigError(f"tokens must be token ids in [0, {n_vocab}) of this model, got {bad[0]!r}")
    for c in contexts:
        llm.reset()
        for t in c:  # one at a time: every layer routes (and records) every token
            llm.eval([int(t)])
    mc = llm.moecache
    if mc is None:
        llm.close()
        raise ConfigError(f"{model_path} has no MoE layers: there are no experts to predict")
    layers = list(mc.moe_layers)
    reader = GGUFReader(str(model_path))
    out = {}
    for a, b in zip(layers, layers[1:]):
        if b != a + 1:
            continue
        X = mc.router_inputs(a).astype(np.float64)
        z, _, _, _ = mc.router_record([b])
        Z = z[:, 0, :].astype(np.float64)
        if X.shape[0] == 0 or X.shape[0] != Z.shape[0]:
            continue  # (a router that is not a plain matmul on its input: nothing recorded)
        W, bias = _router_weights(str(model_path), b, reader)
        if W.shape != (Z.shape[1], X.shape[1]):
            continue
        R = Z - X @ W.T - (0.0 if bias is None else bias)
        D = np.linalg.solve(X.T @ X + lam * np.eye(X.shape[1]), X.T @ R)
        out[b] = (W + D.T).astype(np.float32)
    llm.close()
    return out
