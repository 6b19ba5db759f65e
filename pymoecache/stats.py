"""What the expert cache counted: :class:`MoEStats` (hits, misses, evictions, lifetime, per layer)
and :class:`ResidencyStats` (bytes read, time split, memory). Plain numpy: no native library.

>>> st = MoEStats.from_rows([(0, 2, 2, 10, 40, 30, 10, 8, 0, 0, 1.0)], n_expert=8, n_expert_used=4)
>>> st.miss_rate, st.tokens
(0.25, 10)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class ResidencyStats:
    """What the expert residency costs (``struct moecache_residency_stats``), with per-token rates.

    Decode times: ``t_io_ms`` waiting for expert reads, ``t_route_ms`` in the routing decision;
    ``Llama.moe_stats()`` adds ``decode_t_eval_ms``, llama.cpp's own decode timer (its perf
    counters, the one definition of decode time that ``bench`` uses too), from which
    ``t_compute_ms_per_token`` is that time less the two.
    """

    residency: str                   # "none", "mmap" or "stream"
    io_threads: int
    direct_io: bool
    locked: bool                     # the cache is mlocked
    arena_bytes: int                 # stream: bytes of all slot arenas
    locked_bytes: int                # experts mlocked now
    expert_bytes: int                # one expert of one layer, all its tensors
    decode_tokens: int
    decode_loads: int                # experts read from storage while decoding
    decode_bytes_read: int
    decode_t_io_ms: float
    decode_t_route_ms: float
    prompt_bytes_read: int           # experts read through the mapping by prompts
    prompt_t_io_ms: float
    rss_bytes: int                   # resident set size of the process now
    decode_t_eval_ms: float = 0.0    # llama.cpp's decode time over the same tokens (0 if unknown)
    # prefetch (CacheConfig.prefetch): bytes read on demand and ahead (stream), experts prefetched,
    # used (selected before eviction), wasted (evicted unselected), and the prediction's recall
    prefetch: str = "off"
    demand_bytes_read: int = 0
    prefetch_bytes_read: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    predicted_selected: int = 0
    predicted_total: int = 0
    decode_t_read_ms: float = 0.0    # stream: wall time with at least one expert read in flight (decode)
    prefetch_tokens_on: int = 0      # prefetch_spare: decoded tokens with the reads ahead on
    dense_locked_bytes: int = 0      # the dense part mlocked (CacheConfig.lock_dense)
    decode_major_faults: int = 0     # Llama.moe_stats(): the process's major page faults while decoding tokens (their sampling in)
    load_bytes_read: int = 0         # stream: read at load, filling the layers whose cache holds every expert
    load_t_io_ms: float = 0.0
    # VRAM tier (CacheConfig.vram_size): the selections of its layers by the tier their expert came
    # from (hits + from_ram + from_file), and where those not in GPU memory were computed
    vram_bytes: int = 0              # GPU memory of the tier
    vram_pinned_bytes: int = 0       # host slots pinned for the tier's copies up (CUDA; 0: pageable)
    vram_hits: int = 0               # in GPU memory: computed there
    vram_from_ram: int = 0           # not, but in host memory (the cache, or read ahead)
    vram_from_file: int = 0          # not, read from the file for the token
    vram_copies: int = 0             # copied up from host memory, then computed on the GPU
    vram_copy_bytes: int = 0
    vram_cpu: int = 0                # computed on the CPU
    vram_ahead: int = 0              # copied up ahead of their layer's routing (prefetch's prediction)
    vram_ahead_used: int = 0         #   of those, selected by the token they were copied for
    vram_t_copy_ms: float = 0.0
    unified_bytes: int = 0           # CacheConfig.unified: host slots the GPU computes on in place
    unified_layers: int = 0          #   and the MoE layers computed so
    vram_slots: int = 0              # device slots per layer of the VRAM tier (with lowbit-cache: the copies that fit)
    vram_copies_down: int = 0        # vram_exclusive: GPU experts evicted by a copy up, moved down into its host slot
    vram_exclusive_layers: int = 0   # layers whose tiers are exclusive (an expert in GPU memory keeps no host slot)
    # low-bit misses (CacheConfig.miss): decoded tokens' selections computed from the low-bit companion
    lowbit_bytes: int = 0            # memory of the low-bit pools
    lowbit_loads: int = 0            # selections computed from the companion
    lowbit_bytes_read: int = 0       #   bytes read from it for them (on the token's critical path)
    lowbit_behind: int = 0           #   full copies read behind those tokens
    miss: str = "full"               # CacheConfig.miss that runs; "lowbit-cache": the slots hold low-bit copies
    # the device path: decoded tokens' graphs, their graph splits (each a copy between backends and a
    # wait), the decode steps routed on their device and counted after the graph, and the reads of device
    # memory our hooks made after them (where the cache only counts: one per device and step, queued
    # behind the graph, instead of a CPU split per MoE layer; none on the CPU); layer-tokens the prior
    # routed on the device, and of those where our reference routing chose otherwise (exact ties of
    # boosted scores, broken by ggml's sort)
    decode_graphs: int = 0
    decode_graph_splits: int = 0
    device_steps: int = 0
    device_reads: int = 0
    device_routed: int = 0
    device_route_differs: int = 0
    # batched decoding (Llama(n_seq_max=N)): decode steps, each one llama_decode of one token per sequence
    # (decode_tokens counts the tokens: a step of 4 sequences is 4)
    decode_steps: int = 0
    # what the steps' tokens share: selections of decoded tokens, and the distinct experts among each step's
    # (per layer, summed); union / selections is 1 with one sequence, 1/n where n tokens all chose alike
    decode_selections: int = 0
    decode_union: int = 0
    # the direct tier (unified, a VRAM tier, every expert cached): decoded tokens it computed on the device alone;
    # with unified "auto" what its trial chose ("" while it runs or where there is none: "direct", "round trip")
    # and the trial's median token on each side (ms)
    direct_tokens: int = 0
    direct_choice: str = ""
    direct_ms: float = 0.0
    round_trip_ms: float = 0.0

    @property
    def splits_per_token(self) -> float:
        """Graph splits per decoded token (1 where one backend computes everything)."""
        return self.decode_graph_splits / self.decode_graphs if self.decode_graphs else 0.0

    @property
    def device_reads_per_token(self) -> float:
        return self.device_reads / self.decode_graphs if self.decode_graphs else 0.0

    @property
    def vram_hit_rate(self) -> float:
        """Share of the VRAM tier's selections computed from an expert already in GPU memory."""
        n = self.vram_hits + self.vram_from_ram + self.vram_from_file
        return self.vram_hits / n if n else 0.0

    @property
    def recall(self) -> float:
        """Share of the selected experts (of layers a prediction was made for) that it named."""
        return self.predicted_selected / self.predicted_total if self.predicted_total else 0.0

    @property
    def wasted_bytes(self) -> int:
        """Bytes of prefetched experts evicted before any token selected them (one expert each)."""
        return self.prefetch_wasted * self.expert_bytes

    @property
    def bytes_read_per_token(self) -> float:
        return self.decode_bytes_read / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def t_io_ms_per_token(self) -> float:
        return self.decode_t_io_ms / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def t_route_ms_per_token(self) -> float:
        return self.decode_t_route_ms / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def major_faults_per_token(self) -> float:
        """Pages the process had to read back from storage per decoded token (a file-mapped dense part
        that the kernel dropped under memory pressure shows here)."""
        return self.decode_major_faults / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def overlap(self) -> float:
        """Share of the read time hidden behind compute: 1 - I/O wait / time with reads in flight
        (0 when nothing was read)."""
        if self.decode_t_read_ms <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.decode_t_io_ms / self.decode_t_read_ms))

    @property
    def t_compute_ms_per_token(self) -> float:
        """Decode time that is neither waiting for reads nor routing (0 if the eval time is unknown)."""
        if not self.decode_tokens or self.decode_t_eval_ms <= 0:
            return 0.0
        return max(0.0, self.decode_t_eval_ms - self.decode_t_io_ms - self.decode_t_route_ms) / self.decode_tokens

    def summary_dict(self) -> dict:
        return {"residency": self.residency, "bytes_read_per_token": self.bytes_read_per_token,
                "decode_bytes_read": self.decode_bytes_read, "decode_loads": self.decode_loads,
                "t_io_ms_per_token": self.t_io_ms_per_token, "t_route_ms_per_token": self.t_route_ms_per_token,
                "t_compute_ms_per_token": self.t_compute_ms_per_token, "arena_bytes": self.arena_bytes,
                "locked": self.locked, "dense_locked_bytes": self.dense_locked_bytes, "direct_io": self.direct_io, "rss_bytes": self.rss_bytes,
                "prompt_bytes_read": self.prompt_bytes_read, "prefetch": self.prefetch,
                "demand_bytes_read": self.demand_bytes_read, "prefetch_bytes_read": self.prefetch_bytes_read,
                "prefetch_issued": self.prefetch_issued, "prefetch_used": self.prefetch_used,
                "prefetch_wasted": self.prefetch_wasted, "prefetch_recall": self.recall,
                "t_read_ms_per_token": self.decode_t_read_ms / self.decode_tokens if self.decode_tokens else 0.0,
                "overlap": self.overlap, "major_faults_per_token": self.major_faults_per_token,
                "load_bytes_read": self.load_bytes_read, "load_t_io_ms": self.load_t_io_ms,
                "vram_bytes": self.vram_bytes, "vram_pinned_bytes": self.vram_pinned_bytes, "vram_hits": self.vram_hits,
                "vram_from_ram": self.vram_from_ram,
                "vram_from_file": self.vram_from_file, "vram_copies": self.vram_copies,
                "vram_copy_bytes": self.vram_copy_bytes, "vram_cpu": self.vram_cpu,
                "vram_ahead": self.vram_ahead, "vram_ahead_used": self.vram_ahead_used,
                "vram_t_copy_ms": self.vram_t_copy_ms, "unified_bytes": self.unified_bytes,
                "unified_layers": self.unified_layers, "vram_slots": self.vram_slots,
                "vram_copies_down": self.vram_copies_down, "vram_exclusive_layers": self.vram_exclusive_layers, "lowbit_bytes": self.lowbit_bytes,
                "lowbit_loads": self.lowbit_loads, "lowbit_bytes_read": self.lowbit_bytes_read,
                "lowbit_behind": self.lowbit_behind, "miss": self.miss,
                "graph_splits_per_token": self.splits_per_token, "device_steps": self.device_steps,
                "device_reads_per_token": self.device_reads_per_token,
                "device_routed": self.device_routed, "device_route_differs": self.device_route_differs,
                "decode_tokens": self.decode_tokens, "decode_steps": self.decode_steps,
                "decode_selections": self.decode_selections, "decode_union": self.decode_union,
                "direct_tokens": self.direct_tokens, "direct_choice": self.direct_choice,
                "direct_ms": self.direct_ms, "round_trip_ms": self.round_trip_ms}

    def device_summary(self) -> str:
        """What a decoded token costs across backends (empty where one backend computes everything, as
        on the CPU alone, where the read after the graph is a copy in memory): graph splits (each a copy
        and a wait) and our reads of device memory after the graph."""
        if self.splits_per_token <= 1:
            return ""
        return (f"device: {self.splits_per_token:.1f} graph splits/tok"
                + (f", routing counted after the graph ({self.device_reads_per_token:.2f} reads/tok)"
                   if self.device_reads else "")
                + (", the prior routed on the device" + (f" ({self.device_route_differs} ties broken by ggml)"
                                                         if self.device_route_differs else "")
                   if self.device_routed else "")
                + (f", direct tier {self.direct_tokens} tokens" if self.direct_tokens else "")
                + (f", its trial chose {self.direct_choice} ({self.direct_ms:.2f} ms/tok direct, "
                   f"{self.round_trip_ms:.2f} with the round trip)" if self.direct_choice else ""))

    def summary(self) -> str:
        mib = 2.0 ** 20
        if self.residency == "none":  # every expert resident: nothing read, only what crosses backends
            return f"none: {self.device_summary()}" if self.device_summary() else "none"
        return (f"{self.residency}: read {self.bytes_read_per_token / mib:.2f} MiB/tok | "
                f"per token: compute {self.t_compute_ms_per_token:.2f} ms, I/O wait {self.t_io_ms_per_token:.2f} ms, "
                f"routing {self.t_route_ms_per_token:.3f} ms"
                + (f", overlap {100 * self.overlap:.0f}% of reads hidden" if self.decode_t_read_ms > 0 else "")
                + f" | major faults {self.major_faults_per_token:.1f}/tok | rss {self.rss_bytes / mib:.0f} MiB"
                + (f" (slots {self.arena_bytes / mib:.0f} MiB{'' if self.locked else ', unlocked'}"
                   if self.residency == "stream" else "")
                + ((", " if self.residency == "stream" else " (") + f"dense part {self.dense_locked_bytes / mib:.0f} MiB locked"
                   if self.dense_locked_bytes else "")
                + (")" if self.residency == "stream" or self.dense_locked_bytes else "")
                + (f" | prefetch {self.prefetch}: "
                   + (f"on for {self.prefetch_tokens_on}/{self.decode_tokens} tokens, " if self.prefetch_tokens_on else "")
                   + f"recall {100 * self.recall:.0f}%, {self.prefetch_issued} issued, "
                   f"{self.prefetch_used} used, {self.prefetch_wasted} wasted"
                   + (f", read ahead {self.prefetch_bytes_read / max(1, self.decode_tokens) / mib:.2f} MiB/tok"
                      if self.residency == "stream" else "")
                   if self.prefetch != "off" else "")
                + (f" | vram {self.vram_bytes / mib:.0f} MiB: selections from vram {self.vram_hits}, ram "
                   f"{self.vram_from_ram}, file {self.vram_from_file}; {self.vram_copies} copied up "
                   + (f"and {self.vram_ahead} ahead ({self.vram_ahead_used} used) " if self.vram_ahead else "")
                   + f"({self.vram_copy_bytes / mib:.1f} MiB, {self.vram_t_copy_ms:.1f} ms"
                   + (", from pinned memory" if self.vram_pinned_bytes else "") + f"), {self.vram_cpu} on the CPU"
                   + (f"; exclusive, {self.vram_copies_down} moved down" if self.vram_exclusive_layers else "")
                   if self.vram_bytes else "")
                + (f" | unified: {self.unified_layers} layers' experts on the GPU in place "
                   f"({self.unified_bytes / mib:.0f} MiB of slots)"
                   + (", for the direct tier" if self.direct_tokens or self.direct_choice else "")
                   if self.unified_layers else "")
                + (" | low-bit: every expert from the companion (lowbit-cache)" if self.miss == "lowbit-cache" else "")
                + (f" | low-bit: {self.lowbit_loads / max(1, self.decode_tokens):.2f} experts/tok from the companion "
                   f"({self.lowbit_bytes_read / max(1, self.decode_tokens) / mib:.2f} MiB/tok), "
                   f"{self.lowbit_behind} full copies read behind" if self.lowbit_bytes else "")
                + (f" | {self.device_summary()}" if self.device_summary() else ""))


@dataclass
class MoEStats:
    """Counters of the expert cache, in total and per layer (numpy arrays indexed by MoE layer).

    miss_rate = misses / (K * tokens), as in the published work; hit_rate = 1 - miss_rate.
    """

    n_expert: int
    n_expert_used: int
    moe_layers: np.ndarray           # layer index of each row below
    capacity_per_layer: np.ndarray
    occupancy_per_layer: np.ndarray
    tokens_per_layer: np.ndarray
    selections_per_layer: np.ndarray
    hits_per_layer: np.ndarray
    misses_per_layer: np.ndarray
    evictions_per_layer: np.ndarray
    lifetime_per_layer: np.ndarray   # mean tokens an entry stays cached (evicted + current entries)
    delta_per_layer: np.ndarray      # Delta_l used by the prior
    expert_bytes: float              # bytes of one routed expert (0 if unknown)
    lifetime: float                  # mean tokens an entry stays cached, over all layers
    residency: Optional[ResidencyStats] = None  # I/O, time split, memory (None for a synthetic cache)
    pinned_per_layer: Optional[np.ndarray] = None       # experts pinned now (a profile's warm start)
    pinned_hits_per_layer: Optional[np.ndarray] = None  # hits on pinned experts (part of the hits)
    rerouted_per_layer: Optional[np.ndarray] = None     # experts run from outside the router's own top K
    p_given_up_per_layer: Optional[np.ndarray] = None   # router probability of its top K less that of the
                                                        #   experts run, summed over tokens

    # columns of a layer row for from_rows(): what struct moecache_layer_stats reports (rows without
    # the last ones, from pinned on, count none)
    ROW = ("layer", "capacity", "occupancy", "tokens", "selections", "hits", "misses", "evictions",
           "lifetime_count", "lifetime_sum", "delta", "pinned", "pinned_hits", "rerouted", "p_given_up")

    @classmethod
    def from_rows(cls, rows, n_expert: int, n_expert_used: int, expert_bytes: float = 0.0, **extra) -> "MoEStats":
        """Build from one row per MoE layer with the columns of ``MoEStats.ROW``."""
        rows = [tuple(r) + (0,) * (len(cls.ROW) - len(r)) for r in rows]
        a = np.array(rows, dtype=np.float64).reshape(-1, len(cls.ROW))
        count, total = a[:, 8], a[:, 9]
        as_int = lambda j, t=np.int64: a[:, j].astype(t)  # noqa: E731
        return cls(
            n_expert=n_expert, n_expert_used=n_expert_used, moe_layers=as_int(0, np.int32),
            capacity_per_layer=as_int(1, np.int32), occupancy_per_layer=as_int(2, np.int32),
            tokens_per_layer=as_int(3), selections_per_layer=as_int(4), hits_per_layer=as_int(5),
            misses_per_layer=as_int(6), evictions_per_layer=as_int(7),
            lifetime_per_layer=np.where(count > 0, total / np.maximum(count, 1), 0.0),
            delta_per_layer=a[:, 10].astype(np.float32), expert_bytes=expert_bytes,
            lifetime=float(total.sum() / count.sum()) if count.sum() > 0 else 0.0,
            pinned_per_layer=as_int(11, np.int32), pinned_hits_per_layer=as_int(12), rerouted_per_layer=as_int(13),
            p_given_up_per_layer=a[:, 14].copy(), **extra)

    @property
    def tokens(self) -> int:
        """Tokens routed (through the first MoE layer)."""
        return int(self.tokens_per_layer.max()) if self.tokens_per_layer.size else 0

    @property
    def hits(self) -> int:
        return int(self.hits_per_layer.sum())

    @property
    def misses(self) -> int:
        return int(self.misses_per_layer.sum())

    @property
    def evictions(self) -> int:
        return int(self.evictions_per_layer.sum())

    @property
    def pinned(self) -> int:
        """Experts pinned now, over all layers."""
        return int(self.pinned_per_layer.sum()) if self.pinned_per_layer is not None else 0

    @property
    def pinned_hits(self) -> int:
        return int(self.pinned_hits_per_layer.sum()) if self.pinned_hits_per_layer is not None else 0

    @property
    def rerouted(self) -> int:
        """Experts run from outside the router's own top K, over all layers: what cache-conditional
        routing changed (0 under top-k)."""
        return int(self.rerouted_per_layer.sum()) if self.rerouted_per_layer is not None else 0

    @property
    def rerouted_per_token(self) -> float:
        return self.rerouted / self.tokens if self.tokens else 0.0

    @property
    def p_given_up(self) -> float:
        """The router probability given up per token and MoE layer, on average: its own top K's less
        that of the experts run (0 under top-k; 0.02: 2% of the router's weight went elsewhere)."""
        if self.p_given_up_per_layer is None or not self.tokens_per_layer.sum():
            return 0.0
        return float(self.p_given_up_per_layer.sum() / self.tokens_per_layer.sum())

    def routing_cost(self) -> str:
        """One line of what the routing changed against the router's own top K ('' where nothing)."""
        if not self.rerouted and not self.p_given_up:
            return ""
        return (f"rerouted {self.rerouted_per_token:.2f}/token (router probability given up "
                f"{100 * self.p_given_up:.2f}% per layer)")

    @property
    def miss_rate(self) -> float:
        denom = self.n_expert_used * int(self.tokens_per_layer.sum())
        return self.misses / denom if denom else 0.0

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.miss_rate if self.tokens_per_layer.sum() else 0.0

    @property
    def miss_rate_per_layer(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.tokens_per_layer > 0,
                            self.misses_per_layer / np.maximum(1, self.n_expert_used * self.tokens_per_layer), 0.0)

    @property
    def hit_rate_per_layer(self) -> np.ndarray:
        return np.where(self.tokens_per_layer > 0, 1.0 - self.miss_rate_per_layer, 0.0)

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0

    @property
    def bytes_loaded(self) -> int:
        """Bytes the misses had to bring in (misses x bytes of one expert)."""
        return int(self.misses * self.expert_bytes)

    def summary_dict(self) -> dict:
        """The headline numbers as plain JSON-ready values (used by ``run --json`` and ``serve``)."""
        hr = self.hit_rate_per_layer
        return {
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "cache_size": int(self.capacity_per_layer[0]) if self.capacity_per_layer.size else 0,
            "tokens": self.tokens, "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
            "hit_rate": self.hit_rate, "miss_rate": self.miss_rate, "misses_per_token": self.misses_per_token,
            "layer_hit_rate_min": float(hr.min()) if hr.size else 0.0,
            "layer_hit_rate_max": float(hr.max()) if hr.size else 0.0,
            "lifetime": self.lifetime, "bytes_loaded": self.bytes_loaded,
            "pinned": self.pinned, "pinned_hits": self.pinned_hits,
            "rerouted": self.rerouted, "rerouted_per_token": self.rerouted_per_token,
            "p_given_up": self.p_given_up,
            **(self.residency.summary_dict() if self.residency else {}),
        }

    def since(self, before: "MoEStats") -> "MoEStats":
        """The counters between ``before`` and this later snapshot of the same cache (one request,
        one answer); lifetimes and residency are this snapshot's."""

        def delta(field):  # a layer that had routed no token yet is not in ``before``: count it from 0
            a, b = getattr(self, field), getattr(before, field)
            if a is None or b is None:
                return a
            return a - b if b.shape == a.shape else a

        return dataclasses.replace(self, **{f: delta(f) for f in ("tokens_per_layer", "selections_per_layer",
                                                                  "hits_per_layer", "misses_per_layer",
                                                                  "evictions_per_layer",
                                                                  "pinned_hits_per_layer", "rerouted_per_layer",
                                                                  "p_given_up_per_layer")})

    def summary(self) -> str:
        hr = self.hit_rate_per_layer
        return (f"hit rate {100 * self.hit_rate:.1f}% | misses/token {self.misses_per_token:.2f} | "
                f"layer hit rate min {100 * hr.min():.1f}% max {100 * hr.max():.1f}% | "
                f"lifetime {self.lifetime:.1f} tok | loaded {self.bytes_loaded / 2**20:.1f} MiB"
                + (f" | pinned {self.pinned} experts, {self.pinned_hits} hits" if self.pinned else "")
                + (f" | {self.routing_cost()}" if self.routing_cost() else "")
                + (f" | {self.residency.summary()}" if self.residency and (self.residency.residency != "none" or
                                                                       self.residency.device_summary()) else "")
                if self.tokens else "no tokens routed yet")
