"""``MoECache``: the owner of one native ``struct moecache`` (src_cpp/moecache.h), the Pythonic layer
over its C API (pymoecache._moecache_cpp). ``pymoecache.Llama`` builds one per model; tests and
offline replay build one without a model (:meth:`MoECache.synthetic`, :meth:`MoECache.route`).

>>> mc = MoECache.synthetic(n_layer=1, n_expert=8, n_expert_used=2, cache=CacheConfig(size=4))
>>> mc.route(0, np.array([[3., 2, 1, 0, 0, 0, 0, 0]], dtype=np.float32))[0].tolist()
[[0, 1]]
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import warnings
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from . import _moecache_cpp as C
from .config import (EVICTIONS, LOWBIT_NAMES, LOWBITS, PREFETCHES, PREFETCH_NAMES, RESIDENCIES, RESIDENCY_NAMES,
                     ROUTING_TYPES, VRAM_COPIES, VRAM_FILLS, UNIFIED, CacheConfig, ConfigError, Preset, Prior, Routing, TopK,
                     check_eviction, check_int, default_top_j, parse_routing)
from .errors import ClosedError, MoECacheError, StateFileError
from .files import read_user_text, write_atomic
from .model_info import ModelInfo, _fmt_bytes
from .reference import softmax_f32
from .stats import MoEStats, ResidencyStats

_SCOPES = {"all": C.MOECACHE_SCOPE_ALL, "decode": C.MOECACHE_SCOPE_DECODE}
CALIBRATION_FORMAT = "pymoecache-prior-calibration"
_MAX_JSON_BYTES = 64 << 20


def _checked_path(path: "os.PathLike[str] | str", what: str) -> bytes:
    """``path`` as bytes for the C API; StateFileError for a path ctypes would cut at a NUL."""
    try:
        b = os.fsencode(path)
    except TypeError:
        raise StateFileError(f"{what} path must be a string or os.PathLike, got {type(path).__name__}") from None
    if b"\0" in b or not b:
        raise StateFileError(f"{what} path {path!r} is empty or contains a NUL byte")
    return b


def read_json_file(path: "os.PathLike[str] | str", what: str):
    """Parse a small JSON file; StateFileError for anything but a readable regular file of valid JSON."""
    p = os.fsdecode(_checked_path(path, what))
    text = read_user_text(p, what, _MAX_JSON_BYTES, StateFileError)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise StateFileError(f"{what} {p} is not valid JSON: {str(e)[:200]}") from None


def _as_routing(routing: Union[Routing, str]) -> Routing:
    if isinstance(routing, str):
        routing = parse_routing(routing)
    if isinstance(routing, Preset):
        raise ConfigError(f"{routing.spec()} is resolved from the cache size by pymoecache.Llama: pass it as "
                          "Llama(routing=...) or to Llama.set_routing")
    if not isinstance(routing, ROUTING_TYPES):
        raise ConfigError(f"routing must be a spec string such as 'prior:0.5' or a policy object "
                          f"(Prior(0.5), MaxRank(4), ...), got {routing!r}")
    return routing


def _check(rc: int, error: type = MoECacheError) -> None:
    if rc != C.MOECACHE_OK:
        msg = C.last_error()
        raise (ConfigError if rc == C.MOECACHE_ERR_INVALID else error)(msg)


class MoECache:
    """Owner of one native ``struct moecache`` (see src_cpp/moecache.h). Usually reached through
    ``Llama``; also usable on its own with :meth:`synthetic` and :meth:`route` (tests, replay).

    >>> mc = MoECache.synthetic(n_layer=1, n_expert=8, n_expert_used=2, cache=CacheConfig(size=4))
    >>> sel, hits = mc.route(0, np.array([[3., 2, 1, 0, 0, 0, 0, 0]], dtype=np.float32))
    >>> sel.tolist(), hits.tolist()
    ([[0, 1]], [[0, 0]])
    """

    def __init__(self, handle: int, n_layer: int, n_expert: int, n_expert_used: int, expert_bytes: float = 0.0,
                 trace_capacity: int = 0):
        self._handle = handle or None
        self._closed_why = ""  # set by close(): what a later call says
        self._rpc_used: Sequence[str] = ()  # RPC servers its device buffers are on (set by Llama): not freed once gone
        self.routing: Routing = TopK()  # what the native cache routes with now (set by the constructors)
        self.scope = "all"
        if not handle:
            msg = C.last_error()
            raise (ConfigError if "no MoE layers" not in msg else MoECacheError)(msg)
        self.n_layer, self.n_expert, self.n_expert_used = n_layer, n_expert, n_expert_used
        self.expert_bytes = expert_bytes
        self.trace_capacity = trace_capacity
        self.moe_layers: Sequence[int] = ()  # the model's MoE layers: in stats() before their first token too
        self.prefetch = "off"  # CacheConfig.prefetch (set by the constructors)
        self.eviction, self.eviction_decay = "lru", 0.95  # CacheConfig.eviction (set by the constructors)
        self.batch_share, self.batch_prior = True, 3.0  # CacheConfig.batch_share, batch_prior (the constructors)

    # --- construction ------------------------------------------------------------------------
    @staticmethod
    def _params(n_expert: int, cache: CacheConfig, routing: Routing, scope: str,
                expert_bytes: float = 0.0, n_moe_layer: int = 0, model_path: Optional[str] = None,
                n_expert_used: int = 0, n_seq: int = 1, share_steps: bool = True):
        cp = C.moecache_cache_default_params()
        cp.n_seq = int(n_seq)  # sequences decoded together (Llama's n_seq_max): slots for a batch's selections
        cp.share_steps = bool(share_steps)  # (the layers share those: placement.batch_slots_shared)
        cp.n_cached = cache.n_cached_for(n_expert, expert_bytes, n_moe_layer)
        capacities = cache.capacities(cp.n_cached)
        if cache.prefetch == "auto":  # (Llama resolves it first, taking spare slots out of a memory budget)
            cache = cache.resolve_prefetch(cache.residency_for(capacities, n_expert) if model_path is not None
                                           else "none", cp.n_cached, n_expert_used, n_expert=n_expert)
        if model_path is not None:
            residency = cache.residency_for(capacities, n_expert)
            if (residency == "stream" and isinstance(cache.size, str) and n_expert_used
                    and cp.n_cached < n_expert_used):
                raise ConfigError(
                    f"cache budget {cache.size} holds {cp.n_cached} experts per layer, but streaming needs at least "
                    f"K = {n_expert_used} slots per layer ({_fmt_bytes(n_expert_used * expert_bytes * n_moe_layer)}): "
                    "raise the budget or use residency='mmap'")
            cp.residency = RESIDENCIES[residency]
            cp.model_path = os.fsencode(model_path)
            cp.io_threads = cache.io_threads
            cp.direct_io = bool(cache.direct_io)
            cp.lock_memory = bool(cache.lock_memory)
            cp.lock_dense = bool(cache.lock_dense)
            cp.overlap_experts = bool(cache.overlap_experts)
        cp.insertion = (C.MOECACHE_INSERTION_TOP_BOTTOM if cache.insertion == "top-bottom"
                        else C.MOECACHE_INSERTION_BOTTOM_TOP)
        cp.update_on_prompt = bool(cache.update_on_prompt)
        cp.trace_capacity = int(cache.trace)
        cp.prefetch = PREFETCHES[cache.prefetch]
        cp.prefetch_distance = int(cache.prefetch_distance)
        cp.prefetch_min_p = float(cache.prefetch_min_p)
        cp.prefetch_threads = int(cache.prefetch_threads)
        cp.prefetch_spare = int(cache.prefetch_spare)
        cp.prefetch_adaptive = bool(cache.prefetch_adaptive)
        cp.prefetch_route = bool(cache.prefetch_route)
        cp.prefetch_budget = float(cache.prefetch_budget)
        cp.eviction = EVICTIONS[cache.eviction]
        cp.eviction_decay = float(cache.eviction_decay)
        cp.router_record = int(cache.router_record)
        cp.router_record_input = bool(cache.router_record_input)
        if cache.vram_size == "auto":
            raise ConfigError('vram_size "auto" is resolved by pymoecache.Llama from the GPU\'s free memory')
        cp.n_vram = int(cache.vram_size)
        cp.vram_fill = VRAM_FILLS[cache.vram_fill]
        cp.unified = UNIFIED[cache.unified]
        cp.vram_copy = VRAM_COPIES[cache.vram_copy]
        cp.vram_exclusive = bool(cache.vram_exclusive)
        cp.lowbit = LOWBITS.get(cache.miss, C.MOECACHE_LOWBIT_OFF)  # (Llama resolves "auto", finds the companion)
        keep = []  # what cp points to: alive while cp is (the native side reads it at init)
        if cache.lowbit is not None:
            keep.append(os.fsencode(cache.lowbit))
            cp.lowbit_path = keep[-1]
        cp.lowbit_in_ram = bool(cache.lowbit_in_ram)
        cp.lowbit_max_p = float(cache.lowbit_max_p)
        if cache.per_layer is not None:
            keep.append((ctypes.c_int32 * len(cache.per_layer))(*[int(x) for x in cache.per_layer]))
            cp.n_cached_per_layer = keep[-1]
            cp.n_layer_sizes = len(cache.per_layer)
        rp = MoECache._routing_params(routing, scope, n_expert_used)
        rp.batch_share = bool(cache.batch_share)
        rp.batch_prior = float(cache.batch_prior)
        return cp, rp, keep

    @staticmethod
    def _routing_params(routing: Union[Routing, str], scope: str, n_expert_used: int) -> C.moecache_routing_params:
        if isinstance(routing, str):
            routing = parse_routing(routing)
        if scope not in _SCOPES:
            raise ConfigError(f"routing scope must be one of {sorted(_SCOPES)}, got {scope!r}")
        rp = C.moecache_routing_default_params()
        routing._apply(rp)
        if rp.top_j < 0:  # the policy leaves J to the model: the published choice by K
            rp.top_j = default_top_j(n_expert_used)
        rp.scope = _SCOPES[scope]
        return rp

    @classmethod
    def synthetic(cls, n_layer: int, n_expert: int, n_expert_used: int, *, cache: Optional[CacheConfig] = None,
                  routing: Union[Routing, str, None] = None, scope: str = "all") -> "MoECache":
        """A moecache without a model, driven by :meth:`route`."""
        routing = _as_routing(routing or TopK())
        cp, rp, _keep = cls._params(n_expert, cache or CacheConfig(size=0.5), routing, scope,
                                    n_expert_used=n_expert_used)
        h = C.moecache_init_synthetic(n_layer, n_expert, n_expert_used, cp, rp)
        mc = cls(h, n_layer, n_expert, n_expert_used, trace_capacity=cp.trace_capacity)
        mc.routing, mc.scope = routing, scope
        mc._check_layer_scale(routing)
        mc._apply_layer_scale(routing)
        mc.prefetch = PREFETCH_NAMES[cp.prefetch]
        mc.eviction = (cache or CacheConfig(size=0.5)).eviction
        mc.eviction_decay = float((cache or CacheConfig(size=0.5)).eviction_decay)
        mc.batch_share, mc.batch_prior = bool(rp.batch_share), float(rp.batch_prior)
        return mc

    @classmethod
    def for_model(cls, model_ptr, info: ModelInfo, *, cache: CacheConfig, routing: Union[Routing, str],
                  scope: str = "all", params: Optional[tuple] = None) -> "MoECache":
        """The cache of a loaded model. ``params``: the native parameters :meth:`_params` built from
        these very ``cache`` and ``routing`` (Llama builds them once, before the load, and passes them)."""
        routing = _as_routing(routing)
        cp, rp, _keep = params if params is not None else cls._params(
            info.n_expert, cache, routing, scope, info.cache_bytes, info.n_moe_layer, model_path=info.path,
            n_expert_used=info.n_expert_used)
        h = C.moecache_init(model_ptr, cp, rp)
        mc = cls(h, info.n_layer, info.n_expert, info.n_expert_used, info.expert_bytes, cp.trace_capacity)
        mc.routing, mc.scope, mc.moe_layers = routing, scope, tuple(info.moe_layers)
        mc._check_layer_scale(routing)
        mc._apply_layer_scale(routing)
        mc.prefetch = PREFETCH_NAMES[cp.prefetch]  # ("auto" resolved)
        mc.eviction, mc.eviction_decay = cache.eviction, float(cache.eviction_decay)
        mc.batch_share, mc.batch_prior = bool(rp.batch_share), float(rp.batch_prior)
        return mc

    # --- life cycle --------------------------------------------------------------------------
    def attach(self, ctx_ptr) -> None:
        _check(C.moecache_attach(self._h, ctx_ptr))

    def detach(self) -> None:
        C.moecache_detach(self._h)

    @property
    def _h(self):
        """The native handle; :class:`ClosedError` once it was freed (a call on a freed handle would
        reach freed memory: a segmentation fault)."""
        h = self.__dict__.get("_handle")
        if h is None:
            raise ClosedError(self.__dict__.get("_closed_why") or "this expert cache was freed (close()): "
                              "load the model again")
        return h

    def close(self, why: str = "") -> None:
        """Free the native cache now (a second call does nothing); every later use raises
        :class:`ClosedError` (``why``: its message, e.g. that the Llama it came from was closed)."""
        h = self.__dict__.get("_handle")
        self._handle = None
        self._closed_why = why or "this expert cache was freed (close()): load the model again"
        if h and not self._rpc_lost():
            C.moecache_free(h)

    def _rpc_lost(self) -> bool:
        """An RPC server its device buffers (a VRAM tier, the device path's rows) are on is gone: ggml's
        RPC client would wait forever for the answer to their free, so the cache is dropped, not freed
        (collected after its server stopped, e.g. at the end of a process, it would hang the exit)."""
        try:
            from . import rpc

            return any(rpc.server_gone(e) for e in self.__dict__.get("_rpc_used") or ())
        except Exception:  # (at interpreter exit the modules may be half torn down)
            return False

    def __del__(self):
        self.close()

    # --- routing -----------------------------------------------------------------------------
    def set_routing(self, routing: Union[Routing, str], scope: Optional[str] = None) -> None:
        """Change the policy (and optionally the scope); the next token uses it."""
        routing = _as_routing(routing)
        scope = self.scope if scope is None else scope
        rp = self._routing_params(routing, scope, self.n_expert_used)  # everything is checked before anything
        rp.batch_share, rp.batch_prior = self.batch_share, self.batch_prior
        self._check_layer_scale(routing)                                 # changes: a refused setting applies nowhere
        _check(C.moecache_set_routing(self._h, rp))
        self.routing, self.scope = routing, scope
        self._apply_layer_scale(routing)

    def _check_layer_scale(self, routing: Routing) -> None:
        """ConfigError for more per-layer prior scales (Prior.layers) than the model has layers; fewer
        are taken as the first layers' with a warning that says what the others get (scale 1)."""
        scale = getattr(routing, "layers", None) if isinstance(routing, Prior) else None
        if scale is None or len(scale) == self.n_layer:
            return
        if len(scale) > self.n_layer:
            raise ConfigError(f"{routing.spec()} gives {len(scale)} per-layer scales; the model has {self.n_layer} "
                              "layers: give at most one scale per layer")
        rest = (f"layer {len(scale)} keeps" if len(scale) == self.n_layer - 1 else
                f"layers {len(scale)} to {self.n_layer - 1} keep")
        warnings.warn(f"{routing.spec()} gives {len(scale)} per-layer scales for {self.n_layer} layers: {rest} "
                      "scale 1 (the flat prior)", stacklevel=4)

    def _apply_layer_scale(self, routing: Routing) -> None:
        """The prior's per-layer scales (Prior.layers), or 1 everywhere for any other routing."""
        scale = getattr(routing, "layers", None) if isinstance(routing, Prior) else None
        if scale is None:
            _check(C.moecache_set_prior_scale(self._h, None, 0))
            return
        arr = (ctypes.c_float * len(scale))(*scale)
        _check(C.moecache_set_prior_scale(self._h, arr, len(scale)))

    def set_prior_delta(self, delta: Optional[np.ndarray]) -> None:
        """Fixed per-layer Delta_l (entries <= 0 keep the running mean); None restores the running mean."""
        if delta is None:
            _check(C.moecache_set_prior_delta(self._h, None, 0))
            return
        d = np.ascontiguousarray(delta, dtype=np.float32)
        _check(C.moecache_set_prior_delta(self._h, d.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), d.size))

    def route(self, il: int, logits: np.ndarray, probs: Optional[np.ndarray] = None,
              scores: Optional[np.ndarray] = None, rank_on_logits: bool = True,
              step: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """Route ``[n_tokens, n_expert]`` router outputs through layer ``il`` as the graph op does.

        ``probs`` defaults to softmax(logits) and ``scores`` to ``probs``. Returns
        ``(selected, hits)``, both ``[n_tokens, K]``; dropped slots are -1. ``step``: the rows are one
        decode step of several sequences (a batch), routed as such (``CacheConfig.batch_share``);
        otherwise tokens one after another.
        """
        z = np.ascontiguousarray(np.atleast_2d(logits), dtype=np.float32)
        p = np.ascontiguousarray(softmax_f32(z) if probs is None else probs, dtype=np.float32)
        s = None if scores is None else np.ascontiguousarray(scores, dtype=np.float32)
        n_tokens, n_expert = z.shape
        if z.ndim != 2 or p.shape != z.shape or (s is not None and s.shape != z.shape):
            raise ConfigError("logits, probs and scores must have the same shape [n_tokens, n_expert]")
        allowed = np.count_nonzero(~np.isnan(z) & (z > -np.inf), axis=1)  # NaN and -inf mask an expert out
        if n_tokens and allowed.min() < self.n_expert_used:
            t = int(np.argmin(allowed))
            raise ConfigError(f"token {t}: {int(allowed[t])} of its {n_expert} router logits are numbers (not NaN or "
                              f"-inf); K = {self.n_expert_used} experts cannot be chosen")
        sel = np.empty((n_tokens, self.n_expert_used), dtype=np.int32)
        hits = np.empty((n_tokens, self.n_expert_used), dtype=np.int8)
        fp = ctypes.POINTER(ctypes.c_float)
        _check((C.moecache_route_step if step else C.moecache_route)(self._h, il, z.ctypes.data_as(fp), p.ctypes.data_as(fp),
                                None if s is None else s.ctypes.data_as(fp), n_expert, self.n_expert_used, n_tokens,
                                rank_on_logits, sel.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                hits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))))
        return sel, hits

    # --- stats, contents, state ----------------------------------------------------------------
    def layer_row(self, il: int) -> tuple:
        """Layer il's counters in the column order of ``MoEStats.ROW``."""
        ls = C.moecache_layer_stats()
        _check(C.moecache_get_layer_stats(self._h, il, ctypes.byref(ls)))
        return (il, ls.capacity, ls.occupancy, ls.tokens, ls.selections, ls.hits, ls.misses, ls.evictions,
                ls.lifetime_count, ls.lifetime_sum, ls.delta, ls.pinned, ls.pinned_hits, ls.rerouted,
                ls.p_given_up), ls.n_expert > 0

    def stats(self) -> MoEStats:
        rows = [row for il, (row, routed) in enumerate(map(self.layer_row, range(self.n_layer)))
                if routed or il in self.moe_layers]
        return MoEStats.from_rows(rows, self.n_expert, self.n_expert_used, self.expert_bytes,
                                  residency=self.residency_stats())

    def step_rows(self, n_max: int = 256) -> Tuple[np.ndarray, np.ndarray]:
        """(hits, misses) per token row (a batch: per sequence) of the decode steps since the last call, over
        the MoE layers and those steps (a step of another number of rows starts them over)."""
        hits = np.zeros(n_max, dtype=np.int32)
        misses = np.zeros(n_max, dtype=np.int32)
        n = C.moecache_get_step_rows(self._h, hits.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                     misses.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n_max)
        _check(min(n, 0))
        return hits[:min(n, n_max)], misses[:min(n, n_max)]

    def residency_stats(self) -> ResidencyStats:
        """I/O, time and memory of the expert residency (all zero but rss for ``"none"``)."""
        rs = C.moecache_residency_stats()
        _check(C.moecache_get_residency_stats(self._h, ctypes.byref(rs)))
        return ResidencyStats(residency=RESIDENCY_NAMES.get(rs.residency, "?"), io_threads=rs.io_threads,
                              direct_io=rs.direct_io, locked=rs.locked, arena_bytes=rs.arena_bytes,
                              locked_bytes=rs.locked_bytes, dense_locked_bytes=rs.dense_locked_bytes,
                              expert_bytes=rs.expert_bytes,
                              decode_tokens=rs.decode_tokens, decode_loads=rs.decode_loads,
                              decode_bytes_read=rs.decode_bytes_read, decode_t_io_ms=rs.decode_t_io_ms,
                              decode_t_route_ms=rs.decode_t_route_ms, prompt_bytes_read=rs.prompt_bytes_read,
                              prompt_t_io_ms=rs.prompt_t_io_ms, rss_bytes=rs.rss_bytes,
                              demand_bytes_read=rs.demand_bytes_read, prefetch_bytes_read=rs.prefetch_bytes_read,
                              prefetch_issued=rs.prefetch_issued, prefetch_used=rs.prefetch_used,
                              prefetch_wasted=rs.prefetch_wasted, predicted_selected=rs.predicted_selected,
                              predicted_total=rs.predicted_total, decode_t_read_ms=rs.decode_t_read_ms,
                              prefetch_tokens_on=rs.prefetch_tokens_on, load_bytes_read=rs.load_bytes_read,
                              load_t_io_ms=rs.load_t_io_ms, prefetch=self.prefetch, vram_bytes=rs.vram_bytes,
                              vram_pinned_bytes=rs.vram_pinned_bytes,
                              vram_hits=rs.vram_hits, vram_from_ram=rs.vram_from_ram,
                              vram_from_file=rs.vram_from_file, vram_copies=rs.vram_copies,
                              vram_copy_bytes=rs.vram_copy_bytes, vram_cpu=rs.vram_cpu, vram_ahead=rs.vram_ahead,
                              vram_ahead_used=rs.vram_ahead_used,
                              vram_t_copy_ms=rs.vram_t_copy_ms, unified_bytes=rs.unified_bytes,
                              unified_layers=rs.unified_layers, vram_slots=rs.vram_slots,
                              vram_copies_down=rs.vram_copies_down, vram_exclusive_layers=rs.vram_exclusive_layers,
                              lowbit_bytes=rs.lowbit_bytes,
                              lowbit_loads=rs.lowbit_loads, lowbit_bytes_read=rs.lowbit_bytes_read,
                              lowbit_behind=rs.lowbit_behind, miss=LOWBIT_NAMES.get(rs.lowbit, "?"),
                              decode_graphs=rs.decode_graphs, decode_graph_splits=rs.decode_graph_splits,
                              device_reads=rs.device_reads, decode_steps=rs.decode_steps, device_steps=rs.device_steps,
                              device_routed=rs.device_routed, device_route_differs=rs.device_route_differs,
                              decode_selections=rs.decode_selections, decode_union=rs.decode_union,
                              direct_tokens=rs.direct_tokens, direct_ms=rs.direct_ms, round_trip_ms=rs.round_trip_ms,
                              direct_choice=("", "direct", "round trip")[rs.direct_choice])

    def timeline_start(self, capacity: int = 262_144) -> None:
        """Record a timeline of at most ``capacity`` events from now on (0 stops and frees it)."""
        check_int("timeline capacity", capacity, 0)
        _check(C.moecache_timeline_start(self._h, int(capacity)))

    def timeline_events(self) -> Tuple[np.ndarray, int]:
        """The events recorded so far (``pymoecache.timeline.EVENT_DTYPE``) and how many did not fit."""
        from .timeline import EVENT_DTYPE

        dropped = ctypes.c_int64(0)
        n = C.moecache_timeline_get(self._h, None, 0, ctypes.byref(dropped))
        _check(min(n, 0))
        buf = (C.moecache_event * max(1, n))()
        got = C.moecache_timeline_get(self._h, buf, n, ctypes.byref(dropped))
        _check(min(got, 0))
        n = min(n, got)  # (reads still running may have added events since the count: only n were copied)
        assert EVENT_DTYPE.itemsize == ctypes.sizeof(C.moecache_event)
        ev = np.frombuffer(ctypes.string_at(buf, n * EVENT_DTYPE.itemsize), dtype=EVENT_DTYPE).copy()
        return ev, int(dropped.value)

    def take_io_error(self) -> Optional[str]:
        """The message of a failed expert read since the last call, or None."""
        msg = C.moecache_take_io_error(self._h)
        return msg.decode("utf-8", "replace") if msg else None

    def reset_stats(self) -> None:
        C.moecache_reset_stats(self._h)

    def clear(self) -> None:
        C.moecache_clear(self._h)

    def begin_request(self) -> None:
        """A new request starts: the one that ends goes into the usage profile (and, for
        prefetch="trace", the store of past requests); eviction="activation" counts anew."""
        C.moecache_begin_request(self._h)

    def set_eviction(self, eviction: str, decay: Optional[float] = None) -> None:
        """Change the eviction policy (``CacheConfig.eviction``; decay: keep the current one if None).

        >>> mc = MoECache.synthetic(n_layer=1, n_expert=8, n_expert_used=2, cache=CacheConfig(size=4))
        >>> mc.set_eviction("router-mass"); mc.eviction
        'router-mass'
        """
        decay = self.eviction_decay if decay is None else decay
        check_eviction(eviction, decay)
        _check(C.moecache_set_eviction(self._h, EVICTIONS[eviction], float(decay)))
        self.eviction, self.eviction_decay = eviction, float(decay)

    def router_inputs(self, il: int) -> np.ndarray:
        """The router's input of layer ``il`` for the tokens of :meth:`router_record` (the FFN input
        its matmul took; ``CacheConfig(router_record=T, router_record_input=True)``), ``[T, n_embd]``
        float32; ``[0, 0]`` without router_record_input or where the router was not recognized as a
        plain matmul. What :func:`pymoecache.tune.fit_predictor` fits on."""
        check_int("layer", il, 0, self.n_layer - 1)
        n_embd = ctypes.c_int32(0)
        T = C.moecache_get_router_input(self._h, int(il), None, 0, ctypes.byref(n_embd))
        _check(min(T, 0))
        out = np.zeros((T, n_embd.value), dtype=np.float32)
        if T and n_embd.value:
            C.moecache_get_router_input(self._h, int(il), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), T, None)
        return out

    def set_predictor(self, il: int, w: Optional[np.ndarray]) -> None:
        """Predict layer ``il``'s experts (``prefetch="gate"``) with ``w`` ``[n_expert, n_embd]``
        instead of its router (None: the router again), e.g. one fitted by
        :func:`pymoecache.tune.fit_predictor`. Only what is read ahead changes, never a routing
        decision or a logit."""
        check_int("layer", il, 0, self.n_layer - 1)
        if w is None:
            _check(C.moecache_set_predictor(self._h, int(il), None, 0))
            return
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim != 2 or w.shape[0] != self.n_expert:
            raise MoECacheError(f"a predictor of layer {il} is [n_expert = {self.n_expert}, n_embd], got {w.shape}")
        _check(C.moecache_set_predictor(self._h, int(il), w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), w.shape[1]))

    def router_record(self, layers: Optional[Sequence[int]] = None):
        """The router outputs recorded so far (``CacheConfig(router_record=T)``) over ``layers``
        (default: the MoE layers): ``(logits, probs, scores, rank_on_logits)``, the arrays
        ``[T, len(layers), n_expert]`` float32 (scores None when they equal probs). Every layer must
        have recorded the same tokens. ``pymoecache.simulate.record_router_trace`` makes a
        RouterTrace of it, the simulator's input."""
        layers = list(self.moe_layers if layers is None else layers)
        if not layers:
            raise MoECacheError("no MoE layers to read router outputs from")
        N = self.n_expert
        n = [C.moecache_get_router_record(self._h, il, None, None, None, 0, None) for il in layers]
        if min(n) <= 0 or len(set(n)) != 1:
            raise MoECacheError(f"router outputs recorded per layer: {n}; create the cache with "
                                "CacheConfig(router_record=T) and evaluate tokens first")
        T = n[0]
        z, p, s = (np.zeros((T, len(layers), N), dtype=np.float32) for _ in range(3))
        rank_on_logits = ctypes.c_bool(True)
        fp = ctypes.POINTER(ctypes.c_float)
        for j, il in enumerate(layers):
            bufs = [np.zeros((T, N), dtype=np.float32) for _ in range(3)]
            C.moecache_get_router_record(self._h, il, *(b.ctypes.data_as(fp) for b in bufs), T,
                                         ctypes.byref(rank_on_logits))
            z[:, j], p[:, j], s[:, j] = bufs
        return z, p, (None if np.array_equal(s, p) else s), bool(rank_on_logits.value)

    def save_profile(self, path: "os.PathLike[str] | str") -> None:
        """Write the usage profile (past requests' expert counts, the current one's included, and the
        trace store) atomically; StateFileError on any error."""
        _check(C.moecache_profile_save(self._h, _checked_path(path, "usage profile")), StateFileError)

    def load_profile(self, path: "os.PathLike[str] | str") -> None:
        """Replace the usage profile with one saved by :meth:`save_profile` for the same model
        (StateFileError for a damaged file or another model's; nothing changes then)."""
        _check(C.moecache_profile_load(self._h, _checked_path(path, "usage profile")), StateFileError)

    def profile_counts(self) -> np.ndarray:
        """``[n_layer, n_expert]`` selections per expert in the profile (past requests)."""
        out = np.zeros((self.n_layer, self.n_expert), dtype=np.float64)
        for il in range(self.n_layer):
            row = out[il]
            _check(C.moecache_profile_get(self._h, il, row.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
                                          self.n_expert))
        return out

    def warm_start(self, pin_hot: int = 0) -> int:
        """Refill every layer's cache with its most selected experts of the profile and pin the
        ``pin_hot`` hottest per layer (at most capacity - K). Returns the experts pinned."""
        check_int("pin_hot", pin_hot, 0, C.MOECACHE_MAX_EXPERTS)
        n = C.moecache_profile_warm(self._h, pin_hot)
        _check(min(n, 0))
        return n

    def _held(self, get, il: int) -> list:
        buf = (ctypes.c_int32 * self.n_expert)()
        n = get(self._h, il, buf, self.n_expert)
        if n < 0:
            _check(n)
        return list(buf[:n])

    def cached(self, il: int) -> list:
        """Experts cached in layer ``il``, least recently used first."""
        return self._held(C.moecache_get_cached, il)

    def vram_cached(self, il: int) -> list:
        """Experts in layer ``il``'s GPU slots (``CacheConfig.vram_size``), least recently used first."""
        return self._held(C.moecache_get_vram_cached, il)

    def trace(self) -> np.ndarray:
        """The per-token trace (oldest first) as a numpy structured array: layer, token,
        n_selected, experts[32], hit_mask, top_k_mask. Empty unless ``CacheConfig(trace=N)``."""
        cap = max(1, self.trace_capacity)
        buf = (C.moecache_trace_record * cap)()
        n = C.moecache_get_trace(self._h, buf, cap)
        dt = np.dtype([("layer", "<i4"), ("n_selected", "<i4"), ("token", "<i8"),
                       ("experts", "<i4", (C.MOECACHE_TRACE_MAX_USED,)), ("hit_mask", "<u4"), ("top_k_mask", "<u4")])
        assert dt.itemsize == ctypes.sizeof(C.moecache_trace_record)
        return np.frombuffer(ctypes.string_at(buf, n * dt.itemsize), dtype=dt).copy()

    def save_prior_calibration(self, path: "os.PathLike[str] | str", model: str = "") -> None:
        """Write the per-layer Delta_l measured so far (running means) as JSON, to be loaded with
        :meth:`load_prior_calibration` instead of starting the running mean from scratch.
        Written atomically (temporary file, fsync, rename); StateFileError on any write error."""
        st = self.stats()
        delta = np.zeros(self.n_layer, dtype=np.float64)
        delta[st.moe_layers] = st.delta_per_layer
        if not st.tokens:
            raise MoECacheError("no tokens routed yet: run some text through the model before calibrating")
        text = json.dumps({"format": CALIBRATION_FORMAT, "version": 1, "model": str(model),
                           "n_layer": self.n_layer, "n_expert": self.n_expert,
                           "tokens": st.tokens, "delta": delta.tolist()}, indent=1)
        write_atomic(path, text.encode(), "prior calibration")

    def load_prior_calibration(self, path: "os.PathLike[str] | str") -> None:
        """Use fixed per-layer Delta_l from a file written by :meth:`save_prior_calibration`.
        Every field is checked (format, this model's layer and expert counts, one finite
        Delta >= 0 per layer); StateFileError otherwise, and nothing changes."""
        d = read_json_file(path, "prior calibration")
        if not isinstance(d, dict) or d.get("format") != CALIBRATION_FORMAT:
            raise StateFileError(f"{path} is not a pymoecache prior calibration file")
        def whole(v) -> bool:  # a JSON integer: not 4.0, not true
            return isinstance(v, int) and not isinstance(v, bool)

        if not whole(d.get("version")) or d.get("version") != 1:
            raise StateFileError(f"{path}: unsupported prior calibration version {d.get('version')!r}")
        if not (whole(d.get("n_layer")) and whole(d.get("n_expert"))) or \
                d.get("n_layer") != self.n_layer or d.get("n_expert") != self.n_expert:
            raise StateFileError(f"{path} is not a prior calibration for this model "
                                 f"({self.n_layer} layers, {self.n_expert} experts as integers)")
        delta = d.get("delta")
        if (not isinstance(delta, list) or len(delta) != self.n_layer
                or not all((whole(x) or (isinstance(x, float) and math.isfinite(x))) and 0 <= x < 3.4e38
                           for x in delta)):
            raise StateFileError(f"{path}: 'delta' must hold {self.n_layer} finite numbers >= 0, one per layer")
        self.set_prior_delta(np.asarray(delta, dtype=np.float32))

    def set_model_id(self, model_id: str) -> None:
        """The model's id its cache state and profile files carry besides its description and shape (and a load
        compares): :meth:`identify` sets the GGUF's content fingerprint."""
        _check(C.moecache_set_model_id(self._h, model_id.encode("utf-8")), ConfigError)
        self._model_id = model_id

    def identify(self, model_path: "os.PathLike[str] | str") -> "MoECache":
        """This cache, its files (profiles, cache states) naming the model at ``model_path`` by its content
        (pymoecache.kv.model_fingerprint), so a same-shape model of other weights refuses them; set once."""
        if not getattr(self, "_model_id", ""):
            from .kv import model_fingerprint

            self.set_model_id(model_fingerprint(model_path).hex()[:16])
        return self

    def save(self, path: "os.PathLike[str] | str") -> None:
        """Write the cache state atomically (temporary file, fsync, rename); StateFileError on any error."""
        _check(C.moecache_state_save(self._h, _checked_path(path, "cache state")), StateFileError)

    def load(self, path: "os.PathLike[str] | str") -> None:
        """Load a state saved by :meth:`save` for the same model; a damaged file (checksum, any field
        out of range) or another model's raises StateFileError and leaves the cache as it was."""
        _check(C.moecache_state_load(self._h, _checked_path(path, "cache state")), StateFileError)
