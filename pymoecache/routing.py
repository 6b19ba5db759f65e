"""Routing policies: how a token's experts are chosen, each a small validated object that fills the C
library's ``moecache_routing_params``, parsed from the CLI's strings; the presets (a routing and an eviction
chosen at load); the evictions a preset names.

>>> parse_routing("prior:0.5")
Prior(strength=0.5, top_j=None)
>>> parse_routing("max-rank:4")
MaxRank(m=4, top_j=None)
>>> parse_routing("lru")
TopK()
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple, Union

from . import constants as C
from .errors import ConfigError

if TYPE_CHECKING:  # the ctypes struct each policy fills; importing it would load the native library
    from ._moecache_cpp import moecache_routing_params

EVICTIONS = {"lru": C.MOECACHE_EVICTION_LRU, "lfu": C.MOECACHE_EVICTION_LFU,
             "activation": C.MOECACHE_EVICTION_ACTIVATION, "freq-prob": C.MOECACHE_EVICTION_FREQ_PROB,
             "router-mass": C.MOECACHE_EVICTION_ROUTER_MASS}


def check_eviction(eviction: str, decay: float) -> None:
    """ConfigError unless ``eviction`` is a policy name and ``decay`` in (0, 1]."""
    if eviction not in EVICTIONS:
        raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        raise ConfigError(f"eviction decay must be a number in (0, 1], got {decay!r}")


# CacheConfig.residency -> enum moecache_residency ("auto" is resolved by CacheConfig.residency_for)
def _with_j(spec: str, top_j: Optional[int]) -> str:
    """``prior:0.5`` -> ``prior:0.5:j=2`` when J is set, not the model's default (parse_routing reads both)."""
    return spec if top_j is None else f"{spec}:j={top_j}"


def _j(top_j: Optional[int]) -> int:
    """J for the C struct; -1 (the model's default) is resolved by MoECache before the struct is used."""
    return -1 if top_j is None else top_j


def default_top_j(n_expert_used: int) -> int:
    """J of a policy that does not set it: the published choice by K (docs/method.md), 1 for
    top-1 to top-3 models, 2 for K >= 4.

    >>> default_top_j(2), default_top_j(4), default_top_j(8)
    (1, 2, 2)
    """
    return 1 if n_expert_used <= 3 else 2


def resolved_top_j(routing, n_expert_used: int) -> int:
    """The J a policy runs with on a model with K = n_expert_used (0 for the analysis policies)."""
    if isinstance(routing, (DropRank, SwapRank)):
        return 0
    j = getattr(routing, "top_j", None)
    return default_top_j(n_expert_used) if j is None else j


INT32_MAX = 2**31 - 1  # integer parameters reach the C library as int32: larger ones are refused, never wrapped


def check_int(what: str, v, lo: int, hi: int = INT32_MAX) -> None:
    """ConfigError unless ``v`` is an int (not a bool) in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}")


def _check_top_j(top_j: Optional[int]) -> None:
    if top_j is not None:  # None: the model's default, default_top_j(K)
        check_int("top_j", top_j, 0, C.MOECACHE_MAX_EXPERTS)


@dataclass(frozen=True)
class TopK:
    """Stock routing (the "LRU" baseline): the model's own top-K; the cache only counts and evicts."""

    spec_name = "lru"

    def _apply(self, p: moecache_routing_params) -> None:
        p.policy = C.MOECACHE_POLICY_TOPK

    def spec(self) -> str:
        return "lru"


@dataclass(frozen=True)
class Prune:
    """Run only the router's top ``rank`` experts (at most K, at least J); drop the others.

    >>> Prune(2).spec()
    'prune:2'
    """

    rank: int
    top_j: Optional[int] = None

    def __post_init__(self):
        check_int("prune rank R", self.rank, 1)
        _check_top_j(self.top_j)

    def _apply(self, p: moecache_routing_params) -> None:
        p.policy, p.prune_rank, p.top_j = C.MOECACHE_POLICY_PRUNE, self.rank, _j(self.top_j)

    def spec(self) -> str:
        return _with_j(f"prune:{self.rank}", self.top_j)


@dataclass(frozen=True)
class MaxRank:
    """Cached experts among the router's top ``m`` jump ahead of uncached ones (Top-J always kept).

    >>> MaxRank(4).spec()
    'max-rank:4'
    """

    m: int
    top_j: Optional[int] = None

    def __post_init__(self):
        check_int("max-rank m", self.m, 0)
        _check_top_j(self.top_j)

    def _apply(self, p: moecache_routing_params) -> None:
        p.policy, p.max_rank, p.top_j = C.MOECACHE_POLICY_MAX_RANK, self.m, _j(self.top_j)

    def spec(self) -> str:
        return _with_j(f"max-rank:{self.m}", self.top_j)


@dataclass(frozen=True)
class CumsumThreshold:
    """Max-rank with a per-token m: the first rank where the router's cumulative probability
    reaches ``tau``. A confident router allows little change, a flat one more.

    >>> CumsumThreshold(0.7).spec()
    'cumsum:0.7'
    """

    tau: float
    top_j: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not (0.0 <= self.tau <= 1.0):
            raise ConfigError(f"cumsum tau must be a number in [0, 1], got {self.tau!r}")
        _check_top_j(self.top_j)

    def _apply(self, p: moecache_routing_params) -> None:
        p.policy, p.cumsum_tau, p.top_j = C.MOECACHE_POLICY_CUMSUM, float(self.tau), _j(self.top_j)

    def spec(self) -> str:
        return _with_j(f"cumsum:{self.tau:g}", self.top_j)


@dataclass(frozen=True, repr=False)
class Prior:
    """The main method: rank by ``z + strength * Delta_l`` for cached (and Top-J) experts.
    Weights still come from the unmodified router probabilities. ``strength=0`` is the stock
    model; 0.5 is the usual operating point.

    >>> Prior(0.5).spec()
    'prior:0.5'
    """

    strength: float = 0.5
    top_j: Optional[int] = None
    layers: Optional[Tuple[float, ...]] = None  # per-layer scale of the strength (model layer order); None = 1
    on_probs: bool = False  # boost the router probability by strength x scale (no Delta): "prior-p:L"

    def __post_init__(self):
        if (isinstance(self.strength, bool) or not isinstance(self.strength, (int, float))
                or not math.isfinite(self.strength) or self.strength < 0):
            raise ConfigError(f"prior strength (lambda) must be a finite number >= 0, got {self.strength!r}")
        _check_top_j(self.top_j)
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not hasattr(self.layers, "__len__") or not self.layers:
                raise ConfigError(f"prior layers must be a list of per-layer scales, got {self.layers!r}")
            if len(self.layers) > C.MOECACHE_MAX_LAYERS:
                raise ConfigError(f"prior layers has {len(self.layers)} entries, more than any model's layers")
            for x in self.layers:
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                    raise ConfigError(f"a per-layer prior scale must be a finite number >= 0, got {x!r}")
            object.__setattr__(self, "layers", tuple(float(x) for x in self.layers))

    def __repr__(self) -> str:  # the per-layer scales and prior-p only where set
        extra = (f", layers={self.layers!r}" if self.layers is not None else "") + (", on_probs=True" if self.on_probs else "")
        return f"Prior(strength={self.strength!r}, top_j={self.top_j!r}{extra})"

    def _apply(self, p: moecache_routing_params) -> None:
        p.policy, p.prior_lambda, p.top_j = C.MOECACHE_POLICY_PRIOR, float(self.strength), _j(self.top_j)
        p.prior_on_probs = bool(self.on_probs)

    def spec(self) -> str:
        s = _with_j(f"{'prior-p' if self.on_probs else 'prior'}:{self.strength:g}", self.top_j)
        return s if self.layers is None else s + ":layers=" + "/".join(f"{x:g}" for x in self.layers)


@dataclass(frozen=True)
class DropRank:
    """Analysis only (rank sensitivity): the expert of router rank ``rank`` (0 = the top one)
    is not run; the other K - 1 are. Top-J does not apply.

    >>> DropRank(1).spec()
    'drop-rank:1'
    """

    rank: int

    def __post_init__(self):
        check_int("drop-rank i", self.rank, 0)

    def _apply(self, p: moecache_routing_params) -> None:
        p.policy, p.analysis_rank, p.top_j = C.MOECACHE_POLICY_DROP_RANK, self.rank, 0

    def spec(self) -> str:
        return f"drop-rank:{self.rank}"


@dataclass(frozen=True)
class SwapRank:
    """Analysis only (rank sensitivity): the expert of router rank ``rank`` is replaced by a
    random allowed expert outside the top-K (a hash of ``seed``, layer and token), which runs
    with the replaced expert's router weight. Top-J does not apply.

    >>> SwapRank(0).spec()
    'swap-rank:0'
    """

    rank: int
    seed: int = 0

    def __post_init__(self):
        check_int("swap-rank i", self.rank, 0)
        check_int("swap-rank seed", self.seed, 0, 2**32 - 1)

    def _apply(self, p: moecache_routing_params) -> None:
        p.policy, p.analysis_rank, p.analysis_seed, p.top_j = C.MOECACHE_POLICY_SWAP_RANK, self.rank, self.seed, 0

    def spec(self) -> str:
        return f"swap-rank:{self.rank}" + (f":seed={self.seed}" if self.seed else "")


Routing = Union[TopK, Prune, MaxRank, CumsumThreshold, Prior, DropRank, SwapRank]

PRESET_NAMES = ("quality", "balanced", "speed")
# what each preset cost and bought on the two trained models (docs/eviction.md, the eviction
# sweep: 15,360 held-out tokens, against top-k routing with LRU eviction at the same cache size)
_PRESET_MEASURED = {
    "quality": "+0.86-0.94% perplexity for 1.11-2.29x fewer misses",
    "balanced": "+0.92-1.94% perplexity for 1.11-3.97x fewer misses",
    "speed": "+2.64-3.86% perplexity for 1.42-4.68x fewer misses",
}


DEFAULT_PRESET = "quality"  # what a cache smaller than the model runs when no routing is given
FINE_GRAINED_K = 8          # experts per token from which the quality preset's prior is halved (Qwen3-MoE, OLMoE)


@dataclass(frozen=True)
class Preset:
    """A named choice of routing and eviction, picked from the model's K and the share of the
    experts cached once the cache size is known (``pymoecache.Llama`` resolves it at load):

    * ``quality`` (the default): prior 0.1 with J = 1, lfu eviction with decay 0.8: at most 1%
      perplexity on the reference models (K = 2 and 4); for K >= 8 prior 0.05: on the fine-grained
      trained model (128 experts, 8 used) 0.1 cost +0.6% to +2.9% from 1/16 to 1/2 of the experts
      cached, 0.05 at most +0.2% for 1.2-1.8x LRU's hit rate (docs/results.md, issue 76 item 5);
    * ``balanced``: prior 0.2 with router-mass eviction, J = 1 from half the experts cached, J = 2
      below (K >= 4; prior 0.1 for K <= 2): at most 2%;
    * ``speed``: prior 0.3 with J = 1, router-mass eviction: at most 4%, the most misses saved.

    Where every expert is cached the routing changes nothing: the preset is then top-k with LRU.
    ``device_tier``: the share is a VRAM tier's, over host memory that holds every expert (a
    selection outside the tier is computed on the CPU, not read from the file); ``quality`` is then
    prior 0.05 (within 0.5% of top-k's perplexity and over twice ``--n-cpu-moe``'s device share on
    the reference models, where 0.1 cost 0.45-1.45%: docs/platforms.md).

    >>> Preset("balanced").resolve(n_expert_used=4, cache_share=0.25)
    (Prior(strength=0.2, top_j=2), 'router-mass')
    >>> Preset("quality").resolve(n_expert_used=4, cache_share=1.0)
    (TopK(), 'lru')
    >>> Preset("quality").resolve(n_expert_used=4, cache_share=0.25, device_tier=True)
    (Prior(strength=0.05, top_j=1), 'lfu')
    >>> Preset("quality").resolve(n_expert_used=8, cache_share=0.25)
    (Prior(strength=0.05, top_j=1), 'lfu')
    """

    name: str = "balanced"
    eviction: Optional[str] = None  # instead of the preset's own (a user's explicit choice)

    def __post_init__(self):
        if self.name not in PRESET_NAMES:
            raise ConfigError(f"unknown preset {self.name!r}; expected one of {', '.join(PRESET_NAMES)}")
        if self.eviction is not None:
            check_eviction(self.eviction, 0.95)

    def spec(self) -> str:
        return f"preset:{self.name}"

    def resolve(self, n_expert_used: int, cache_share: float, device_tier: bool = False) -> Tuple["Routing", str]:
        """(routing, eviction) for a model with K = ``n_expert_used`` and ``cache_share`` of its
        routed experts cached (``device_tier``: in a VRAM tier over a host memory of all of them)."""
        return self.resolve_all(n_expert_used, cache_share, device_tier)[:2]

    def resolve_all(self, n_expert_used: int, cache_share: float,
                    device_tier: bool = False) -> Tuple["Routing", str, Optional[float]]:
        """(routing, eviction, eviction decay or None to keep the cache's) as :meth:`resolve`."""
        routing, eviction = self._pick(n_expert_used, cache_share, device_tier)
        if self.eviction is not None:  # the user's eviction, with the user's decay
            return routing, self.eviction, None
        return routing, eviction, (0.8 if eviction == "lfu" else None)

    def _pick(self, n_expert_used: int, cache_share: float, device_tier: bool) -> Tuple["Routing", str]:
        if cache_share >= 1.0:
            routing, eviction = TopK(), "lru"
        elif self.name == "quality" and n_expert_used >= FINE_GRAINED_K:
            # many small experts: each token's 8 or more leave more room to swap in a cached one, and 0.1 swapped
            # too many (the fine-grained trained model: +2.9% at 1/4, where 0.05 gave -0.1% for 61% hits, LRU 46%)
            routing, eviction = Prior(0.05, top_j=1), "lfu"
        elif self.name == "quality" and device_tier:
            # a miss of the tier is computed on the CPU, not read: half the quality prior keeps A, C and B's
            # Q8_0 tier within 0.5% of top-k at 2.1-2.7x --n-cpu-moe's device share (bench_vram_share.py)
            routing, eviction = Prior(0.05, top_j=1), "lfu"
        elif self.name == "quality":
            # lfu with a short memory (decay 0.8): within 1% on both models at 1/2 and 1/4, and fewer
            # misses than LRU eviction in every cell (docs/eviction.md, under a perplexity budget)
            routing, eviction = Prior(0.1, top_j=1), "lfu"
        elif self.name == "speed":
            routing, eviction = Prior(0.3, top_j=1), "router-mass"
        elif n_expert_used <= 2:
            routing, eviction = Prior(0.1, top_j=1), "router-mass"
        else:
            routing, eviction = Prior(0.2, top_j=1 if cache_share >= 0.5 else 2), "router-mass"
        return routing, eviction

    def measured(self) -> str:
        """What it cost and bought on the reference models, for the stats line."""
        return _PRESET_MEASURED[self.name]

    @classmethod
    def default_for(cls, cache) -> "Preset":  # (cache: a pymoecache.CacheConfig)
        """The routing of a Llama (or server) given none: the default preset, with the cache's eviction
        where it is not the default "lru" (which the preset's own replaces)."""
        return cls(DEFAULT_PRESET, eviction=cache.eviction if cache.eviction != "lru" else None)


ROUTING_TYPES = (TopK, Prune, MaxRank, CumsumThreshold, Prior, DropRank, SwapRank)

_SPEC_RE = re.compile(r"^\s*([a-z-]+)\s*(?::\s*([^:\s]+))?\s*(?::\s*(j|seed)\s*=\s*(\d+))?"
                      r"\s*(?::\s*layers\s*=\s*([^:\s]+))?\s*$")
ROUTING_SPECS = ("lru | topk | prior:L | max-rank:M | cumsum:T | prune:R  (optionally ':j=J', e.g. prior:0.5:j=2; "
                 "prior also ':layers=S0/S1/...', a scale per layer) | prior-p:L (the boost in probability) | "
                 "preset:quality|balanced|speed; analysis: drop-rank:I | swap-rank:I[:seed=S]")


def parse_routing(spec: str, top_j: Optional[int] = None) -> Routing:
    """Parse a routing spec string (``prior:0.5``, ``max-rank:4``, ``cumsum:0.7``, ``prune:3``, ``lru``).

    >>> parse_routing("prior:0.25:j=2")
    Prior(strength=0.25, top_j=2)
    >>> parse_routing("cumsum:0.7", top_j=0)
    CumsumThreshold(tau=0.7, top_j=0)
    """
    if not isinstance(spec, str):
        raise ConfigError(f"a routing spec is a string such as 'prior:0.5', got {spec!r}")
    if spec.strip().lower().startswith("preset:"):  # a Preset: routing and eviction chosen at load
        return Preset(spec.strip().lower().split(":", 1)[1].strip())
    m = _SPEC_RE.match(spec.lower())
    if not m:
        raise ConfigError(f"cannot parse routing spec {spec!r}; expected {ROUTING_SPECS}")
    name, arg, opt, opt_val, layers = m.group(1), m.group(2), m.group(3), m.group(4), m.group(5)
    if layers is not None and name not in ("prior", "prior-p"):
        raise ConfigError(f"routing spec {spec!r}: only prior takes ':layers=S0/S1/...'")
    if opt == "seed" and name != "swap-rank":
        raise ConfigError(f"routing spec {spec!r}: only swap-rank takes ':seed=S'")
    if opt == "j" and name in ("drop-rank", "swap-rank"):
        raise ConfigError(f"routing spec {spec!r}: {name} is an analysis policy without Top-J")
    j = int(opt_val) if opt == "j" else top_j  # None: the model's default J

    def num(kind):
        if arg is None:
            raise ConfigError(f"routing spec {spec!r} needs a value, e.g. {name}:{'0.5' if kind is float else '4'}")
        try:
            return kind(arg)
        except ValueError:
            raise ConfigError(f"routing spec {spec!r}: {arg!r} is not a valid {'number' if kind is float else 'integer'}")

    if name in ("lru", "topk", "top-k"):
        if arg is not None:
            raise ConfigError(f"routing spec {spec!r}: '{name}' takes no value")
        return TopK()
    if name in ("prior", "prior-p"):
        scales = None
        if layers is not None:
            try:
                scales = tuple(float(x) for x in layers.split("/"))
            except ValueError:
                raise ConfigError(f"routing spec {spec!r}: ':layers=' takes numbers separated by '/', e.g. 0/1.5/1")
        return Prior(num(float) if arg is not None else (0.5 if name == "prior" else 0.1), top_j=j, layers=scales,
                     on_probs=name == "prior-p")
    if name in ("max-rank", "maxrank"):
        return MaxRank(num(int), top_j=j)
    if name == "cumsum":
        return CumsumThreshold(num(float), top_j=j)
    if name == "prune":
        return Prune(num(int), top_j=j)
    if name == "drop-rank":
        return DropRank(num(int))
    if name == "swap-rank":
        return SwapRank(num(int), seed=int(opt_val) if opt == "seed" else 0)
    raise ConfigError(f"unknown routing policy {name!r} in {spec!r}; expected {ROUTING_SPECS}")
