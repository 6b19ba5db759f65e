"""The cache's configuration (CacheConfig) and the parsers of the CLI's sizes; the routing policies live in
routing.py (its names are imported here too).

>>> CacheConfig(size=0.25).size
0.25
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

from . import constants as C
from .errors import ConfigError
from .routing import (  # noqa: F401  (the routing policies, where they were: pymoecache.config.Prior, ...)
    EVICTIONS, check_eviction, _with_j, _j, default_top_j, resolved_top_j, INT32_MAX, check_int, _check_top_j,
    TopK, Prune, MaxRank, CumsumThreshold, Prior, DropRank, SwapRank, Routing, PRESET_NAMES, _PRESET_MEASURED,
    DEFAULT_PRESET, Preset, ROUTING_TYPES, _SPEC_RE, ROUTING_SPECS, parse_routing)


# CacheConfig.prefetch -> enum moecache_prefetch
PREFETCHES = {"off": C.MOECACHE_PREFETCH_OFF, "gate": C.MOECACHE_PREFETCH_GATE,
              "previous": C.MOECACHE_PREFETCH_PREVIOUS, "trace": C.MOECACHE_PREFETCH_TRACE}

PREFETCH_NAMES = {v: k for k, v in PREFETCHES.items()}

# CacheConfig.prefetch "auto": with stream residency, gate reading ahead into this many spare slots
# per layer, under prefetch_budget (what it reads for nothing is bounded by what the tokens use), counted
# as cached by the prior; off with the other residencies
PREFETCH_AUTO_SPARE = 2

# CacheConfig.vram_fill -> enum moecache_vram_fill
VRAM_FILLS = {"auto": C.MOECACHE_VRAM_FILL_AUTO, "copy": C.MOECACHE_VRAM_FILL_COPY, "cpu": C.MOECACHE_VRAM_FILL_CPU}
# CacheConfig.vram_copy -> enum moecache_vram_copy
VRAM_COPIES = {"async": C.MOECACHE_VRAM_COPY_ASYNC, "sync": C.MOECACHE_VRAM_COPY_SYNC}
# CacheConfig.miss -> enum moecache_lowbit ("auto" is resolved by Llama: "lowbit-cache" where a companion is found)
LOWBITS = {"full": C.MOECACHE_LOWBIT_OFF, "lowbit": C.MOECACHE_LOWBIT_MISS, "lowbit-all": C.MOECACHE_LOWBIT_ALL,
           "lowbit-cache": C.MOECACHE_LOWBIT_SOURCE}
LOWBIT_NAMES = {code: name for name, code in LOWBITS.items()}  # enum value -> name
# CacheConfig.unified -> enum moecache_unified
UNIFIED = {"auto": C.MOECACHE_UNIFIED_AUTO, "off": C.MOECACHE_UNIFIED_OFF, "on": C.MOECACHE_UNIFIED_ON}

RESIDENCIES = {"auto": -1, "none": C.MOECACHE_RESIDENCY_NONE, "mmap": C.MOECACHE_RESIDENCY_MMAP,
               "stream": C.MOECACHE_RESIDENCY_STREAM}
RESIDENCY_NAMES = {code: name for name, code in RESIDENCIES.items()}  # enum value -> name


_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|m|g|t|kb|mb|gb|tb|kib|mib|gib|tib)\s*$", re.I)
# one letter (4G, 512M, as llama.cpp users, QEMU and Docker write memory) is binary, as are KiB..TiB
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_bytes(text: str) -> Optional[int]:
    """``"4GiB"`` -> 4294967296; None if ``text`` is not a byte size. One letter is binary
    (``4G`` = 4 GiB, ``512M`` = 512 MiB); ``GB``/``MB`` are decimal.

    >>> parse_bytes("1.5 MiB"), parse_bytes("4G"), parse_bytes("512m"), parse_bytes("2GB")
    (1572864, 4294967296, 536870912, 2000000000)
    """
    m = _BYTES_RE.match(text)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else None


def parse_percent(text: str) -> Optional[float]:
    """``"25%"`` -> 0.25; None if ``text`` is not a percentage.

    >>> parse_percent("25%"), parse_percent("12.5 %"), parse_percent("25")
    (0.25, 0.125, None)
    """
    m = _PERCENT_RE.match(text)
    return float(m.group(1)) / 100 if m else None


def parse_memory(text: str, total: int) -> int:
    """A memory size as the CLI takes it (``info --ram``): bytes with a unit (``8G``, ``512MiB``)
    or a percentage of ``total`` (``50%``); ConfigError otherwise, and for 0.

    >>> parse_memory("50%", 16 << 30) == 8 << 30, parse_memory("8G", 0) == 8 << 30
    (True, True)
    """
    n = parse_bytes(text)
    if n is None:
        share = parse_percent(text)
        if share is None or share > 1:
            raise ConfigError(f"cannot parse memory size {text!r}: use bytes with a unit (8G, 512MiB, 4GB) or a "
                              "percentage of the machine's memory (50%)")
        if not total:
            raise ConfigError(f"{text}: the machine's memory is unknown here, give bytes (8G)")
        n = int(share * total)
    if n <= 0:
        raise ConfigError(f"memory size {text!r} must be more than 0")
    return n


def parse_override_tensor(spec: str) -> list:
    """The patterns of llama.cpp's tensor buffer overrides ``PATTERN=CPU[,...]`` (llama-cli's -ot); only
    CPU memory is available here. ConfigError naming the item that is wrong.

    >>> parse_override_tensor("exps=CPU,attn_q=cpu")
    ['exps', 'attn_q']
    """
    import re

    if not isinstance(spec, str) or not spec.replace(",", "").strip():
        raise ConfigError(f"{spec!r}: expected PATTERN=BUFFER_TYPE[,...], e.g. exps=CPU")
    out = []
    for item in spec.split(","):
        if not item.strip():
            continue
        pattern, eq, buft = item.partition("=")
        if not eq or not pattern:
            raise ConfigError(f"{item!r}: expected PATTERN=BUFFER_TYPE, e.g. exps=CPU")
        try:
            re.compile(pattern)  # (llama.cpp takes it as a regular expression over tensor names)
        except re.error as e:
            raise ConfigError(f"{item!r}: {pattern!r} is not a regular expression ({e})") from None
        if buft.strip().upper() != "CPU":
            raise ConfigError(f"{item}: buffer type {buft!r} is not available: only =CPU is (the expert cache places "
                              "the experts in CPU memory, -ngl the other weights of its layers on the GPU)")
        out.append(pattern)
    return out


def parse_cache_size(text: str) -> Union[int, float, str]:
    """CLI form of a cache size: ``30`` (experts per layer), ``0.5`` or ``50%`` (share of N),
    ``4GiB`` or ``4G`` (budget), ``auto``. 0 in any form is refused: a cache of nothing.

    >>> parse_cache_size("30"), parse_cache_size("0.5"), parse_cache_size("3GiB"), parse_cache_size("auto")
    (30, 0.5, '3GiB', 'auto')
    >>> parse_cache_size("25%"), parse_cache_size("4G")
    (0.25, '4G')
    """
    text = text.strip()
    if text == "auto":
        return text
    zero = ConfigError(f"cache size {text!r} is zero: give at least 1 expert per layer (a streamed token needs K "
                       "slots anyway), a share such as 0.25, a budget such as 4G, or auto")
    if re.fullmatch(r"\d+", text):
        if int(text) == 0:
            raise zero
        return int(text)
    n = parse_bytes(text)
    if n is not None:
        if n == 0:
            raise zero
        return text
    share = parse_percent(text)
    if share is not None:
        f = share
    else:
        try:
            f = float(text)
        except ValueError:
            raise ConfigError(f"cannot parse cache size {text!r}: use a count (30), a share of the experts "
                              "(0.5 or 50%), a memory budget (4G, 4GiB) or auto")
    if not 0.0 <= f <= 1.0:
        raise ConfigError(f"cache share {text} must be in (0, 1] / (0%, 100%] (use an integer for a count of experts)")
    if f == 0.0:
        raise zero
    return f


@dataclass
class CacheConfig:
    """Per-layer expert cache.

    size: ``int`` experts per MoE layer, ``float`` in [0, 1] share of the routed experts, a
    memory budget string such as ``"4GiB"`` for all layers' cached experts together (turned into
    a per-layer count from the model's real expert sizes, never more than asked), or ``"auto"``
    (the default): the budget is what the machine has free (MemAvailable, capped by a cgroup
    limit), less the non-expert weights, the KV cache and a margin; ``Llama.cache_choice`` says
    what it chose and why. A model that fits keeps every expert resident, as plain llama.cpp
    would. ``per_layer`` overrides single layers.

    residency: where the experts' bytes live (src_cpp/moecache.h, ``enum moecache_residency``):
    ``"stream"`` (cached experts in an mlocked per-layer slot arena, misses read from the GGUF
    with direct I/O), ``"mmap"`` (experts stay mmapped, cached ones mlocked, evicted ones
    dropped), ``"none"`` (counters only, every expert resident), or ``"auto"`` (the default):
    ``stream`` when the cache is smaller than all experts, else ``none``.
    io_threads: reads in flight on a miss. direct_io: ``O_DIRECT`` reads for ``stream``.
    lock_memory: mlock the cache; if the OS refuses, one warning and the run goes on unlocked.
    lock_dense: (``stream``, ``mmap``) mlock the weights every token reads, all but the routed
    experts (and the token-embedding table unless the output reuses it), so that the OS cannot
    drop them when memory runs short and read them back every token; same refusal rule.
    overlap_experts: (``stream``) a decoded token's expert matmuls take each selected expert as
    soon as its bytes arrive: the cached experts compute while the misses are read. False waits
    for every read of a layer first (as before); the logits are the same either way.

    prefetch: ``"auto"`` (the default: with ``stream`` residency, ``"gate"`` reading ahead into
    ``PREFETCH_AUTO_SPARE`` = 2 spare slots per layer under the budget below, the prior counting
    them as cached; where the cache size came from a memory budget or ``"auto"``, the spare slots
    come out of it, and where fewer than twice top-K experts per layer would stay cached, prefetch
    is ``"off"``; ``"off"`` with the other residencies), ``"off"``, ``"gate"`` (while layer l
    decodes a token, layer l + d's
    router applied to layer l's FFN input predicts layer l + d's experts; ProMoE) or
    ``"previous"`` (what layer l + d selected for the previous token) or ``"trace"`` (the
    request's expert counts so far matched by cosine against past requests, MoE-Infinity's
    activation matrices; a request starts at ``Llama.reset()``). The predicted experts are
    inserted into layer l + d's cache (evicting its least recently used ones) and, with
    ``stream``, read in the background while the layers in between compute; with the other
    residencies only the cache's contents (and the counters) change. prefetch_distance: d (1..8).
    prefetch_min_p: ``gate`` and ``trace`` prefetch a predicted expert only if its predicted
    probability is at least this (default 0: all of them); fewer, surer reads on a slow disk.
    prefetch_threads: of the ``io_threads`` readers, how many may read ahead at once (default 0:
    all of them); a miss waits at most for the prefetch chunks these are reading.
    prefetch_spare: 0 (the default) makes a prefetch an insertion, as above. S > 0 gives each MoE
    layer S spare slots (S experts' bytes per layer on top of the cache, ``stream`` only): the
    predicted experts the layer does not cache are read into them, and the cache is left alone; a
    miss whose expert was read ahead only waits for what is still in flight.

    prefetch_budget (default 0; spare slots): the reads ahead of each layer spend a budget that only
    the routing refills, so a run reads ahead the same experts whatever the disk's timing: each
    expert a prediction reads ahead (or finds still in a spare slot) costs one, each one the
    layer's token then selects earns back
    ``1 + prefetch_budget`` (nothing where the prior picked it only because it was being read: a
    miss the routing without the reads would not have had), and every token adds 1/32. The
    experts read ahead for nothing stay under ``prefetch_budget`` times those used, plus one per
    32 tokens and layer: where the predictions are poor the reads ahead fall silent and a slow
    disk loses little to them. Negative: no budget, every predicted miss is read.
    prefetch_route (default True; spare slots, not adaptive): the prior counts the experts being
    read ahead as cached, so a token picks what is in flight over what is not (issue 28's
    direction 4). False: routing, hits and misses exactly those without prefetch, under every
    policy. prefetch_adaptive (default False; spare slots): instead of the budget, the reads ahead
    switch themselves on and off by a timed trial: 32 decoded tokens, with and without them in
    turn, compare the median time per token; they run for the next 96 tokens only if they were at
    least 2% faster, then the trial again (``moe_stats().residency.prefetch_tokens_on`` counts the
    tokens that had them on). The trial follows the clock, so under it the routing does not
    count the reads (prefetch_route is off) and the budget does not apply.

    predictor: a file of :func:`pymoecache.tune.save_predictor` for this model: ``gate`` predicts
    with the predictors fitted by :func:`pymoecache.tune.fit_predictor` instead of the next
    layers' routers (loaded at start, as ``Llama.load_predictor``); only what is read ahead changes.

    eviction: which cached expert leaves for a miss or a prefetch (src_cpp/moecache.h, ``enum
    moecache_eviction``): ``"lru"`` (the default, least recently used), ``"lfu"`` (lowest decayed
    count of selections), ``"activation"`` (MoE-Infinity: lowest share of the layer's selections
    in the current request, plus a tenth of its share in past requests), ``"freq-prob"`` (fMoE:
    decayed count x the router probability of the layer's last token) or ``"router-mass"``
    (lowest decayed sum of router probability). eviction_decay: the per-token decay of the
    "decayed" values, in (0, 1] (default 0.95: a memory of about 20 tokens). Ties go to the least
    recently used expert; a token's own experts and pinned ones are never evicted for it.

    vram_size: beside GPU layers (``n_gpu_layers``), with ``stream``: this many experts per layer
    also live in GPU memory (a VRAM tier over the host cache, for the layers whose dense part is
    on a discrete GPU or an RPC server), and a decoded token computes those there; ``"auto"``: as
    many as fit in the free memory the GPUs report, beside the dense part and KV cache of their
    layers and a margin of 1 GiB (llama.cpp's --fit keeps as much); where the cache holds fewer than
    every expert, those are others than the cache's (``vram_exclusive``). Residency ``"auto"`` with a
    tier is ``"stream"``, also where the cache holds every expert (every one in RAM, the hot ones on
    the GPU). With GPU layers, residency "auto" and no tier given, a Llama spends the GPUs' free
    memory by itself (``plan.device_fit``; not where llama.cpp's placement flags, n_cpu_moe /
    override_tensor, name where the experts go): every expert on the GPU where they fit (residency
    none; with a stated cache size smaller than every expert, a tier of the others instead), else a
    tier as ``"auto"`` sizes it: the hot ones where RAM holds every expert, others where it holds
    fewer (a model larger than RAM: the two hold more, the file is read less). Residency
    ``"stream"`` keeps them all in RAM. Without GPU layers the tier is dropped with a warning. A selected
    expert that is not there: vram_fill ``"copy"`` copies it up from its host slot (into a free
    device slot, else the one the ``eviction`` policy frees), ``"cpu"`` computes it on the CPU (only free
    device slots are filled), ``"auto"`` (the default) copies when the measured copy time is at
    most the measured CPU time of an expert times (1 + device hits per copy so far). The host
    cache, its routing, hits, misses and reads are the same with or without the tier. Memory:
    vram_size experts per layer on the GPU, one more per layer in RAM (the host's zero slot).
    vram_copy: ``"async"`` queues a token's copies up on a second stream of the GPU while the CPU
    computes its own selections, and waits for them just before the GPU's expert matmuls (the
    default); with ``prefetch``, it also copies up ahead the predicted experts of the next layer
    that its cache holds, beside this layer's GPU work. ``"sync"`` makes each copy before any
    matmul, and none ahead. The results are the same.
    vram_exclusive: the two tiers hold different experts: one in GPU memory is not also kept in a host
    slot, so host and GPU together hold up to size + vram_size experts per layer, a model larger than
    the host cache's memory (none read from the file after warm-up where that is every expert). A
    selection in either is a hit; a copy up frees its host slot, and a GPU expert it evicts moves down
    into that slot (copied back from the GPU). Where size + vram_size covers every expert, the routing
    prefers the GPU's. Needs vram_size and a cache smaller than every expert; copies up ahead of the
    routing (prefetch) are not made. Default False: the tier is a copy of part of the host cache.

    batch_share, batch_prior: several sequences decoded together (``Llama(n_seq_max=N)``, ``serve -np
    N``) under a routing that prefers cached experts: an expert another sequence of the step selects
    is as good as cached (the step reads it anyway), and the prior's strength is ``batch_prior`` times
    its own for such a step, since one cache serves every sequence of the batch (docs/method.md).
    A sequence decoded alone is routed as without them. Defaults True and 3.0.

    unified: beside GPU layers, with ``stream``: whether the GPU computes a layer's experts in place
    on the host slots, which ggml wraps as GPU buffers (Metal; Vulkan with host-pointer import):
    no copies, the reads fill the slots and the GPU reads them there. ``"auto"`` (the default) does
    so where the GPU shares the host's memory (Apple silicon, an integrated GPU); ``"on"`` also on a
    discrete GPU that can wrap host memory (its matmuls then read over the bus; a GPU that cannot is
    an error); ``"off"`` leaves the experts to the CPU (llama.cpp's ``--cpu-moe``). A layer computed
    in place has no VRAM tier, but for the direct tier: with ``vram_size`` and a cache of every
    expert (``size=1.0``) a decoded token is routed on the GPU (top-k or the prior) and each MoE layer computed
    there alone, the tier's experts from GPU memory and the rest from the host slots over the bus, with no
    round trip to the CPU per layer; the tier copies each miss up behind the token (``vram_fill`` has
    no CPU side to choose). ``"on"`` takes it on any GPU that can wrap host memory; ``"auto"`` on a discrete
    one times its first 32 decoded tokens both ways (direct, and the tier with its round trip, where the CPU
    computes the misses) and keeps the faster (``residency_stats().direct_choice``). The host cache,
    routing, hits, misses and reads do not change.

    miss: with ``stream``, what a decoded token's miss is computed from. ``"full"``: its full copy,
    read now. ``"lowbit"``: its copy in the low-bit companion ``lowbit`` (``pymoecache
    lowbit MODEL`` makes one; default: the one beside the model), a fraction of the bytes, while the
    full copy is read behind the token for its next use (HOBBIT's and EdgeMoE's idea). ``"lowbit-all"``:
    every selection of a decoded token from the companion, no full copy read while decoding. With
    these the routing, the cache and its hits and misses do not change; only the precision of the
    experts computed does. ``"lowbit-cache"``: the companion is the cache's source: the cache holds
    its copies, as many as fit in the memory ``size`` gives the model's experts (a Q4_K copy of a
    Q8_0 expert is about half its bytes: twice as many cached), and every read is from it; prompts
    that do not find every expert cached compute from the model file at full precision. It is what
    a model with every expert at the low type gives, from the same two files, and on the measured
    models it beats the low-bit miss path in speed and perplexity (docs/results.md). ``"auto"``:
    ``"lowbit-cache"`` where a usable companion is found and the experts stream on the CPU
    (``"lowbit"`` with ``lowbit_in_ram``), else ``"full"``, saying why. None (the default): the same,
    quietly where the model has no companion (a user who made one gets it used; the plan line says
    which ran).
    lowbit_in_ram: with a low-bit miss path, read every expert's low-bit copy into memory at load
    (the companion's expert bytes, a tier of its own) instead of a few per token from the file: a
    token computed from them waits for no read at all. lowbit_max_p: with miss ``"lowbit"``, a miss
    whose router probability is at least this is read at full precision on the token's critical
    path, as without a companion (HOBBIT's rule: the experts that weigh most); 1.0 (the default):
    every miss from the companion.

    >>> CacheConfig(size=30, insertion="bottom-top").insertion
    'bottom-top'
    >>> CacheConfig(size=0.5).residency_for([30, 30], 60), CacheConfig(size=1.0).residency_for([60, 60], 60)
    ('stream', 'none')
    """

    size: Union[int, float, str] = "auto"
    insertion: str = "top-bottom"
    update_on_prompt: bool = True
    trace: int = 0
    per_layer: Optional[Sequence[int]] = field(default=None)
    residency: str = "auto"
    io_threads: int = 8
    direct_io: bool = True
    lock_memory: bool = True
    lock_dense: bool = True
    overlap_experts: bool = True
    prefetch: str = "auto"
    prefetch_distance: int = 1
    prefetch_min_p: float = 0.0
    prefetch_threads: int = 0
    prefetch_spare: int = 0
    prefetch_adaptive: bool = False  # spare slots: the timed on/off trial instead of the budget
    prefetch_route: bool = True  # spare slots, not adaptive: the prior counts the experts read ahead as cached
    prefetch_budget: float = 0.0  # spare slots, not adaptive: read-ahead experts wasted per used one (< 0: no budget)
    eviction: str = "lru"
    eviction_decay: float = 0.95
    router_record: int = 0  # tokens of router outputs kept per MoE layer for the simulator (MoECache.router_trace)
    router_record_input: bool = False  # router_record: also keep each router's input (n_embd floats per token and layer)
    predictor: Optional[str] = None  # fitted predictors for prefetch="gate" (pymoecache.tune.fit_predictor), loaded at start
    vram_size: Union[int, str] = 0  # experts per layer kept in GPU memory beside GPU layers (stream); 0 = no VRAM
    #                                 tier; "auto": as many as fit in the GPUs' free memory
    vram_fill: str = "auto"  # a selected expert not in GPU memory: "copy" it up, compute it on the "cpu", or "auto"
    vram_copy: str = "async"  # copies up on a second GPU stream, behind the CPU's matmuls ("async"), or "sync"
    vram_exclusive: bool = False  # an expert in GPU memory keeps no host slot: the tiers hold size + vram_size
    batch_share: bool = True  # batched decoding: an expert another sequence of the step selects counts as cached
    batch_prior: float = 3.0  # batched decoding, prior routing: the prior's strength times this in a step of several
    unified: str = "auto"  # GPU layers + stream: the GPU computes the experts in place on the host slots ("auto", "on", "off")
    miss: Optional[str] = None  # stream: a decoded token's miss at "full" precision, from its "lowbit" copy, every
                                #   selection from it ("lowbit-all"), a cache of low-bit copies ("lowbit-cache"), or
                                #   "auto" (lowbit-cache where a companion is found); None: auto, quietly
    lowbit: Optional[str] = None  # the low-bit companion (pymoecache lowbit); default: the one beside the model
    lowbit_in_ram: bool = False  # miss lowbit: every low-bit copy in memory (read once), none read per token
    lowbit_max_p: float = 1.0  # miss lowbit: a miss whose router probability is >= this is read at full precision

    def __post_init__(self):
        if isinstance(self.size, bool):
            raise ConfigError("cache size must be a count, a fraction or a byte budget, not a bool")
        if isinstance(self.size, int):
            check_int("cache size", self.size, 0, C.MOECACHE_MAX_EXPERTS)
        elif isinstance(self.size, float):
            if not 0.0 <= self.size <= 1.0:
                raise ConfigError(f"cache fraction {self.size} must be in [0, 1]")
        elif isinstance(self.size, str):
            if self.size != "auto" and parse_bytes(self.size) is None:
                raise ConfigError(f"cannot parse cache budget {self.size!r} (e.g. '4GiB', '512MB', 'auto')")
        else:
            raise ConfigError(f"cache size must be int, float or str, got {type(self.size).__name__}")
        if self.insertion not in ("top-bottom", "bottom-top"):
            raise ConfigError(f"insertion must be 'top-bottom' or 'bottom-top', got {self.insertion!r}")
        check_int("trace (records kept)", self.trace, 0, C.MOECACHE_MAX_TRACE)
        if self.per_layer is not None:
            if isinstance(self.per_layer, (str, bytes)) or not hasattr(self.per_layer, "__len__"):
                raise ConfigError(f"per_layer must be a list of cache sizes, got {self.per_layer!r}")
            if len(self.per_layer) > C.MOECACHE_MAX_LAYERS:
                raise ConfigError(f"per_layer has {len(self.per_layer)} entries, more than any model's layers")
            for x in self.per_layer:
                check_int("a per-layer cache size (-1 = the default)", x, -1, C.MOECACHE_MAX_EXPERTS)
        if self.residency not in RESIDENCIES:
            raise ConfigError(f"residency must be one of {', '.join(RESIDENCIES)}, got {self.residency!r}")
        check_int("io_threads", self.io_threads, 1, 64)
        if self.prefetch not in PREFETCHES and self.prefetch != "auto":
            raise ConfigError(f"prefetch must be one of auto, {', '.join(PREFETCHES)}, got {self.prefetch!r}")
        check_int("prefetch_distance", self.prefetch_distance, 1, C.MOECACHE_MAX_PREFETCH_DISTANCE)
        m = self.prefetch_min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0:
            raise ConfigError(f"prefetch_min_p must be a probability in [0, 1], got {m!r}")
        check_int("prefetch_threads (0 = all io_threads)", self.prefetch_threads, 0, self.io_threads)
        check_int("prefetch_spare (spare slots per layer)", self.prefetch_spare, 0, C.MOECACHE_MAX_EXPERTS)
        b = self.prefetch_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b < 0 or 0.0 <= b <= 64.0):  # (NaN too)
            raise ConfigError(f"prefetch_budget must be in [0, 64] (experts read ahead for nothing per one used), "
                              f"or negative for no budget, got {b!r}")
        for name in ("prefetch_adaptive", "prefetch_route", "overlap_experts", "router_record_input"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_eviction(self.eviction, self.eviction_decay)
        check_int("router_record (tokens)", self.router_record, 0, C.MOECACHE_MAX_TRACE)
        if self.vram_size != "auto":
            check_int("vram_size (experts per layer in GPU memory, or 'auto')", self.vram_size, 0,
                      C.MOECACHE_MAX_EXPERTS)
        if self.vram_fill not in VRAM_FILLS:
            raise ConfigError(f"vram_fill must be one of {', '.join(VRAM_FILLS)}, got {self.vram_fill!r}")
        if self.vram_copy not in VRAM_COPIES:
            raise ConfigError(f"vram_copy must be one of {', '.join(VRAM_COPIES)}, got {self.vram_copy!r}")
        if not isinstance(self.batch_share, bool):
            raise ConfigError(f"batch_share must be True or False, got {self.batch_share!r}")
        if isinstance(self.batch_prior, bool) or not isinstance(self.batch_prior, (int, float)) or \
                not 1.0 <= self.batch_prior <= 100.0:
            raise ConfigError(f"batch_prior must be a number in [1, 100] (1: a batch routed with the prior alone's "
                              f"strength), got {self.batch_prior!r}")
        if not isinstance(self.vram_exclusive, bool):
            raise ConfigError(f"vram_exclusive must be True or False, got {self.vram_exclusive!r}")
        if self.vram_exclusive and not self.vram_size:
            raise ConfigError("vram_exclusive needs a VRAM tier (vram_size > 0)")
        if self.unified not in UNIFIED:
            raise ConfigError(f"unified must be one of {', '.join(UNIFIED)}, got {self.unified!r}")
        if self.miss is not None and self.miss not in LOWBITS and self.miss != "auto":
            raise ConfigError(f"miss must be one of auto, {', '.join(LOWBITS)}, got {self.miss!r}")
        if self.lowbit is not None and not isinstance(self.lowbit, (str, os.PathLike)):
            raise ConfigError(f"lowbit must be the path of a low-bit companion, got {self.lowbit!r}")
        if isinstance(self.lowbit_max_p, bool) or not isinstance(self.lowbit_max_p, (int, float)) \
                or not 0.0 < self.lowbit_max_p <= 1.0:
            raise ConfigError(f"lowbit_max_p must be a probability in (0, 1], got {self.lowbit_max_p!r}")
        if not isinstance(self.lowbit_in_ram, bool):
            raise ConfigError(f"lowbit_in_ram must be True or False, got {self.lowbit_in_ram!r}")
        if self.lowbit_in_ram and self.miss in ("full", "lowbit-cache"):
            raise ConfigError(f"lowbit_in_ram keeps the companion's copies in memory beside the cache for "
                              f"miss='lowbit', 'lowbit-all' or 'auto'; with miss={self.miss!r} "
                              + ("nothing reads them" if self.miss == "full" else "the cache holds them: size it"))
        if self.predictor is not None and not os.path.isfile(self.predictor):
            raise ConfigError(f"predictor file {self.predictor!r} not found (pymoecache.tune.save_predictor writes one)")

    def resolve_prefetch(self, residency: str, n_cached: int, n_expert_used: int,
                         from_memory: bool = False, n_expert: int = 0) -> "CacheConfig":
        """This config with prefetch ``"auto"`` made explicit for ``residency`` and ``n_cached`` experts
        per layer (``from_memory``: the size came from a memory budget, which the spare slots come out of;
        ``n_expert``: the model's N, where a cache of every expert reads nothing ahead).

        >>> c = CacheConfig(size=30).resolve_prefetch("stream", 30, 4)
        >>> (c.prefetch, c.prefetch_spare, c.size)
        ('gate', 2, 30)
        >>> CacheConfig(size="1GiB").resolve_prefetch("stream", 20, 4, from_memory=True).size   # 18 + 2 spare
        18
        >>> CacheConfig(size="200MiB").resolve_prefetch("stream", 6, 4, from_memory=True).prefetch  # 4 + 2: too few
        'off'
        >>> CacheConfig().resolve_prefetch("none", 60, 4).prefetch
        'off'
        >>> CacheConfig(size=1.0, residency="stream").resolve_prefetch("stream", 60, 4, n_expert=60).prefetch
        'off'
        """
        if self.prefetch != "auto":
            return self
        spare = self.prefetch_spare or PREFETCH_AUTO_SPARE
        # from a memory budget the spare slots are taken from the cache: not where fewer than 2K experts
        # would stay cached (measured at 6 of 60, top-4: 4 cached + 2 spare ran 0.94-0.97x of 6 cached);
        # nor where the cache holds all n_expert experts (no token misses: nothing to read ahead)
        full = 0 < n_expert <= n_cached and all(0 > c or c >= n_expert for c in self.per_layer or [])
        if residency != "stream" or full or (from_memory and n_cached - spare < 2 * n_expert_used):
            return dataclasses.replace(self, prefetch="off")
        size = n_cached - spare if from_memory else self.size
        return dataclasses.replace(self, prefetch="gate", prefetch_spare=spare, size=size)

    def capacities(self, n_cached: int) -> List[int]:
        """The per-layer cache sizes this config gives, with ``n_cached`` the size it asks for (per_layer
        entries below 0 take that size)."""
        return [n_cached] + [int(x) for x in (self.per_layer or []) if int(x) >= 0]

    def residency_for(self, capacities: Sequence[int], n_expert: int) -> str:
        """The residency this config means for these per-layer cache sizes (resolves ``"auto"``)."""
        if self.residency != "auto":
            return self.residency
        return "stream" if any(c < n_expert for c in capacities) else "none"

    def n_cached_for(self, n_expert: int, expert_bytes_per_layer: Optional[float], n_moe_layer: int) -> int:
        """Experts per layer this config asks for, given the model's N and the bytes of one expert."""
        if isinstance(self.size, int):
            n = self.size
        elif isinstance(self.size, float):
            n = int(math.floor(self.size * n_expert + 0.5))  # halves round up, like the C library's lround
            if self.size > 0 and n < 1:
                n = 1
        elif self.size == "auto":
            raise ConfigError('cache size "auto" is resolved by pymoecache.Llama from the free memory')
        else:
            budget = parse_bytes(self.size)
            if not expert_bytes_per_layer or n_moe_layer <= 0:
                raise ConfigError("a memory budget needs the model's expert sizes, which are unknown")
            # a budget above all experts keeps all of them (as `info --ram` says)
            n = min(n_expert, int(budget // (expert_bytes_per_layer * n_moe_layer)))
        if n > n_expert:
            raise ConfigError(f"cache size {n} is larger than the model's {n_expert} routed experts per layer")
        return n
