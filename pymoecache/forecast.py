"""A decode speed forecast before the run: tok/s with a band, from the GGUF header, the cache size, the
default routing's measured miss rates, a probe of the disk and a probe of the memory.

A decoded token costs compute and the reads it waits for:

    compute = FIXED_MS + n_layer * LAYER_MS + bytes a token multiplies / (memory speed * EFFICIENCY)
    reads   = miss rate * K * MoE layers * bytes of one expert's copy / disk speed

The bytes a token multiplies are the dense part and K experts per MoE layer. A low-bit copy (the
companion's, under lowbit-cache) is fewer bytes but costs more per byte to multiply (its blocks are
unpacked): it counts as the model's expert times the square root of the ratio of their sizes (a Q4_K
copy of a Q8_0 expert, 0.53 of its bytes, costs 0.73 of its time; measured on the trained benchmark
model). The miss rate is the default routing's, as measured at the share of experts cached
(``MEASURED_MISS``; the companion's copies raise the share). The band: the lowest and highest
measured miss rate at that share, compute from ``EFFICIENCY`` x (1 - BAND) to x (1 + BAND), and reads
from none hidden behind compute (low end) to all of them (high end). The disk is probed twice (the
second pass re-reads the first's offsets, as a decode re-reads its experts) and the faster taken.
Calibrated on a 2-core x86-64 host (``scripts/bench_forecast.py`` measures it against ``pymoecache
bench``; docs/forecast.md has the table).

>>> f = forecast_from(n_layer=4, n_moe_layer=4, K=4, N=32, dense_bytes=4 << 20, expert_bytes=1.6e6,
...                   slot_bytes=1.6e6, n_cached=32, mem_bytes_per_s=20e9, disk_bytes_per_s=1e9)
>>> f.low <= f.tok_s <= f.high and f.miss_rate == 0.0
True
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional, Tuple

# the default routing's miss rate (misses per selection of a decoded token) by the share of experts cached:
# model -> ((share, miss rate), ...). The trained models' in the ppl protocol (docs/results.md, every token
# decoded alone, the experts streamed); the random benchmark model's (a router of random weights: nearly
# flat logits, which the prior steers most) from `pymoecache bench` (4 prompts x 64 tokens, 2026-11-28)
MEASURED_MISS = {
    "A (qwen2moe 60x4)": ((0.25, 0.285), (0.5, 0.111)),
    "B (mixtral 8x2)": ((0.25, 0.588), (0.5, 0.335)),
    "C (qwen2moe 32x4)": ((0.25, 0.283), (0.5, 0.106)),
    "random benchmark (qwen2moe 60x4, 20 layers)": ((0.25, 0.184), (0.5, 0.078)),
    # the fine-grained trained model at Q4_K_M (128 experts, 8 used; `ppl --decode --chunks 20`, 2026-12-04)
    "D (fine 128x8)": ((0.0625, 0.668), (0.125, 0.473), (0.1875, 0.367), (0.25, 0.286), (0.375, 0.167),
                       (0.5, 0.090)),
}
FIXED_MS = 0.5       # per decoded token: sampling, the graph's dispatch, the checks of Llama.eval
LAYER_MS = 0.03      # per layer and token: the graph's nodes, the routing hook
EFFICIENCY = 0.55    # of the probed memory speed that llama.cpp's matrix-vector products reach
BAND = 0.35          # compute's band: EFFICIENCY x (1 -/+ BAND)


def _miss_at(points: Tuple[Tuple[float, float], ...], share: float) -> float:
    """One model's measured miss rate at ``share``, linear between its points and (0, 1), (1, 0)."""
    pts = [(0.0, 1.0), *sorted(points), (1.0, 0.0)]
    share = min(1.0, max(0.0, share))
    for (s0, m0), (s1, m1) in zip(pts, pts[1:]):
        if s0 <= share <= s1:
            return m0 + (m1 - m0) * (share - s0) / (s1 - s0) if s1 > s0 else m0
    return 0.0


def miss_band(share: float) -> Tuple[float, float, float]:
    """(lowest, median, highest) of the measured models' miss rates at ``share`` of the experts cached.

    >>> tuple(round(x, 3) for x in miss_band(0.5))
    (0.078, 0.106, 0.335)
    >>> miss_band(1.0)
    (0.0, 0.0, 0.0)
    """
    rates = sorted(_miss_at(p, share) for p in MEASURED_MISS.values())
    mid = (rates[(len(rates) - 1) // 2] + rates[len(rates) // 2]) / 2
    return rates[0], mid, rates[-1]


@dataclass
class Forecast:
    """What a decoded token is expected to cost and the tok/s that follows, with its band."""

    tok_s: float              # the forecast: the median miss rate, reads not hidden
    low: float                # the band's low end: the highest miss rate, slow compute, reads not hidden
    high: float               # the band's high end: the lowest miss rate, fast compute, reads hidden
    compute_ms: float         # per token, every selected expert in memory
    read_ms: float            # per token, the reads waited for at the median miss rate
    miss_rate: float          # the median measured miss rate at the share cached
    share: float              # of the experts cached (the companion's copies counted)
    mem_bytes_per_s: float    # probed
    disk_bytes_per_s: float   # probed (0: not probed, or nothing is read)

    def contains(self, tok_s: float) -> bool:
        return self.low <= tok_s <= self.high

    def text(self) -> str:
        """One line: the figure, its band and what it stands on."""
        reads = (f"{self.miss_rate * 100:.0f}% misses at {self.share * 100:.0f}% of the experts cached, "
                 f"{self.read_ms:.2f} ms of reads from a disk of {self.disk_bytes_per_s / 1e6:.0f} MB/s"
                 if self.share < 1 else "nothing read (every expert cached)")
        return (f"~{self.tok_s:.1f} tok/s (band {self.low:.1f} to {self.high:.1f}): {self.compute_ms:.2f} ms of compute "
                f"a token (memory {self.mem_bytes_per_s / 1e9:.0f} GB/s), {reads}")


def forecast_from(*, n_layer: int, n_moe_layer: int, K: int, N: int, dense_bytes: float, expert_bytes: float,
                  slot_bytes: float, n_cached: int, mem_bytes_per_s: float, disk_bytes_per_s: float,
                  read_bytes: Optional[float] = None) -> Forecast:
    """The forecast from the numbers it stands on. ``slot_bytes``: one expert's copy as computed (the
    companion's under lowbit-cache); ``read_bytes``: what a miss waits for (default ``slot_bytes``; the
    companion's copy on the low-bit miss path); ``n_cached``: copies cached per layer."""
    read_bytes = slot_bytes if read_bytes is None else read_bytes
    share = min(1.0, n_cached / N) if N else 1.0
    lo, mid, hi = miss_band(share) if share < 1 else (0.0, 0.0, 0.0)
    ratio = min(1.0, slot_bytes / expert_bytes) if expert_bytes else 1.0
    touched = dense_bytes + K * n_moe_layer * expert_bytes * ratio ** 0.5  # (a low-bit copy: see above)
    fixed = FIXED_MS + n_layer * LAYER_MS

    def compute(eff: float) -> float:
        return fixed + 1e3 * touched / (mem_bytes_per_s * eff) if mem_bytes_per_s > 0 else fixed

    def reads(rate: float) -> float:
        if not rate or disk_bytes_per_s <= 0:
            return 0.0
        return 1e3 * rate * K * n_moe_layer * read_bytes / disk_bytes_per_s

    c_mid, c_slow, c_fast = compute(EFFICIENCY), compute(EFFICIENCY * (1 - BAND)), compute(EFFICIENCY * (1 + BAND))
    return Forecast(tok_s=1e3 / (c_mid + reads(mid)), low=1e3 / (c_slow + reads(hi)),
                    high=1e3 / max(c_fast, reads(lo)), compute_ms=c_mid, read_ms=reads(mid), miss_rate=mid,
                    share=share, mem_bytes_per_s=mem_bytes_per_s, disk_bytes_per_s=disk_bytes_per_s)


def probe_memory(n_threads: int = 1, size: int = 128 << 20, seconds: float = 0.3) -> float:
    """Read speed of memory in bytes/s: ``n_threads`` threads sum their share of a buffer of ``size``
    bytes (larger than any cache), the best of the passes made in ``seconds``."""
    import numpy as np

    buf = np.ones(size // 8, dtype=np.int64)
    parts = np.array_split(buf, max(1, n_threads))
    best, t_end = 0.0, time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, buf.nbytes / (time.perf_counter() - t0))
        if time.perf_counter() > t_end:
            return best


def forecast(plan, n_layer: int, n_threads: int, mem_bytes_per_s: Optional[float] = None, *,
             model_expert_bytes: Optional[float] = None, path: Optional[str] = None) -> Forecast:
    """The forecast of a :class:`pymoecache.plan.MemoryPlan` (its cache, companion and probed disk) for a
    model of ``n_layer`` layers decoded on ``n_threads`` threads; the memory is probed where not given.
    ``model_expert_bytes``: one expert in the model, where the plan's slots hold the companion's copies;
    ``path``: the file the misses read, probed a second time (the faster of the two probes is taken).

    >>> from pymoecache.plan import MemoryPlan
    >>> plan = MemoryPlan(available=8 << 30, budget_from="free", dense=4 << 20, kv=1 << 20, n_ctx=256, n_cached=16,
    ...                   n_spare=0, n_expert=32, n_expert_used=4, n_moe_layer=4, slot_bytes=1.6e6, expert_bytes=1.6e6,
    ...                   disk_bytes_per_s=1e9)
    >>> f = forecast(plan, 4, 1, mem_bytes_per_s=20e9)
    >>> f.share, f.low < f.tok_s < f.high
    (0.5, True)
    """
    from .disk import probe_disk

    if mem_bytes_per_s is None:  # (its buffer within a quarter of the plan's headroom: a capped run stays in its cap)
        mem_bytes_per_s = probe_memory(n_threads, size=min(128 << 20, max(16 << 20, plan.headroom // 4)))
    disk = plan.disk_bytes_per_s if plan.streamed else 0.0
    if disk and path:
        disk = max(disk, probe_disk(path, plan.slot_bytes))
    low = plan.miss in ("lowbit", "lowbit-all") and plan.lowbit_bytes
    return forecast_from(n_layer=n_layer, n_moe_layer=plan.n_moe_layer, K=plan.n_expert_used, N=plan.n_expert,
                         dense_bytes=plan.dense, expert_bytes=model_expert_bytes or plan.expert_bytes,
                         slot_bytes=plan.slot_bytes, n_cached=plan.n_cached, mem_bytes_per_s=mem_bytes_per_s,
                         disk_bytes_per_s=disk, read_bytes=plan.lowbit_bytes if low else None)
