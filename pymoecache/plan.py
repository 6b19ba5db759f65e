"""The memory plan of a run, as an engine that knows the machine prints it: memory available,
the dense part, the KV cache for the context, the expert cache (slots per layer), the headroom,
and what decoding will cost in reads, from a quick probe of the disk that holds the model.

    >>> from pymoecache.model_info import ModelInfo
    >>> info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=5 << 30, n_layer=8,
    ...                  moe_layers=list(range(8)), n_expert=64, n_expert_used=4, n_expert_shared=0,
    ...                  gating="softmax", n_expert_groups=0, expert_bytes=8 << 20,
    ...                  expert_bytes_total=8 * 64 * (8 << 20), n_embd=1024)
    >>> p = memory_plan(info, n_ctx=4096, n_cached=16, available=4 << 30, disk_bytes_per_s=1e9)
    >>> p.cache_bytes >> 20, p.read_per_token >> 20, round(p.io_tok_s, 1)   # 0.75 x 4 x 8 MiB x 8 layers
    (1024, 192, 5.0)
    >>> print(p.summary())
    plan: 4.0 GiB budget = dense part 1.0 GiB + KV cache 128 MiB (4096 tokens) + expert cache 1.0 GiB (16 of 64 per layer) + headroom 1.9 GiB; decode reads ~192 MiB/token (75% misses if routing were uniform): at most 5.0 tok/s from a disk that reads 1000 MB/s
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

from .disk import probe_disk
from .model_info import ModelInfo


def _fmt(n: float) -> str:
    n = float(n)
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if abs(n) < 10 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 20):.0f} MiB"


_PROC_CGROUP, _MOUNTINFO, _CGROUP_ROOT = "/proc/self/cgroup", "/proc/self/mountinfo", "/sys/fs/cgroup"
_NO_LIMIT = 1 << 62  # (cgroup v1 writes "no limit" as the largest page-aligned 64-bit number)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _cgroup_v1_dir(rel: str) -> str:
    """Where cgroup v1's memory controller shows the cgroup ``rel`` (its mount, from mountinfo)."""
    try:
        with open(_MOUNTINFO) as f:
            for line in f:
                fields = line.split()
                dash = fields.index("-") if "-" in fields else -1
                if dash > 0 and fields[dash + 1] == "cgroup" and "memory" in fields[-1].split(","):
                    root, mount = fields[3], fields[4]
                    inner = rel[len(root):] if root != "/" and rel.startswith(root) else rel
                    return os.path.join(mount, inner.lstrip("/"))
    except (OSError, ValueError, IndexError):
        pass
    return os.path.join(_CGROUP_ROOT, "memory", rel.lstrip("/"))


def _cgroup_limit() -> Optional[Tuple[int, str]]:
    """(bytes a cgroup's memory limit still leaves this process, "cgroup v1" or "cgroup v2"), or None where
    no limit binds. v1 (many container hosts, Android): the memory controller's limit with its ancestors'
    (``hierarchical_memory_limit``) less its usage; v2: the tightest ``memory.max`` less ``memory.current`` of
    the cgroup and its ancestors. Both count the page cache, as the kernel charges it."""
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:  # v1's memory controller (on a hybrid host it, not v2, holds the limit)
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            d = _cgroup_v1_dir(parts[2])
            limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
            try:
                with open(os.path.join(d, "memory.stat")) as f:
                    for row in f:
                        if row.startswith("hierarchical_memory_limit "):
                            limit = min(limit or _NO_LIMIT, int(row.split()[1]))
            except (OSError, ValueError):
                pass
            usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            if limit is None or limit >= _NO_LIMIT or usage is None:
                return None
            return max(0, limit - usage), "cgroup v1"
    rel = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    if rel is None:
        return None
    left = None
    d = rel.strip() or "/"
    while True:  # the cgroup and each ancestor: the tightest limit binds
        base = os.path.join(_CGROUP_ROOT, d.lstrip("/"))
        limit, current = _read_int(os.path.join(base, "memory.max")), _read_int(os.path.join(base, "memory.current"))
        if limit is not None and current is not None:
            left = max(0, limit - current) if left is None else min(left, max(0, limit - current))
        if d in ("/", ""):
            break
        d = os.path.dirname(d.rstrip("/")) or "/"
    return (left, "cgroup v2") if left is not None else None


def _cgroup_available() -> Optional[int]:
    """Bytes a cgroup memory limit (v1 or v2) still leaves this process (containers, systemd slices), or None."""
    got = _cgroup_limit()
    return got[0] if got is not None else None


def _free_source() -> str:
    """What bounds the memory free now: "free" (the OS's MemAvailable), or "cgroup v1" / "cgroup v2" where a
    cgroup's limit leaves less (the plan line and ``auto`` say which)."""
    got = _cgroup_limit()
    if got is None:
        return "free"
    free = 0
    try:
        with open(_MEMINFO) as f:
            free = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")), 0)
    except (OSError, ValueError):
        pass
    return got[1] if not free or got[0] < free else "free"


_MEMINFO = "/proc/meminfo"
PROMPT_READ_AHEAD = 1  # MoE layers of a prompt's read-ahead the plan leaves room for (moecache-mapping.cpp reads up to 2)


def _available_memory() -> int:
    """Bytes the OS can give this process now: MemAvailable on Linux (capped by a cgroup v1 or v2 limit),
    free pages elsewhere, half of the physical memory where neither is known (macOS); 0 if nothing is."""
    free = 0
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for name, share in (("SC_AVPHYS_PAGES", 1), ("SC_PHYS_PAGES", 2)):  # macOS has only the second: half of it
        if free:
            break
        try:
            free = os.sysconf(name) * os.sysconf("SC_PAGE_SIZE") // share
        except (ValueError, OSError, AttributeError):
            free = 0
    cg = _cgroup_available()
    return min(free, cg) if cg is not None and free else (cg or free)


@dataclasses.dataclass(frozen=True)
class AutoCacheSize:
    """What ``CacheConfig(size="auto")`` chose for one model and why (``Llama.cache_choice``)."""

    n_cached: int          # experts per MoE layer chosen
    n_expert: int          # routed experts per MoE layer
    n_expert_used: int     # K: a streamed token needs K slots per layer even when n_cached < K
    available: int         # bytes free when the model was loaded
    dense: int             # bytes of the non-expert weights (always resident: locked when streamed)
    kv: int                # bytes of the KV cache at F16 (its KV heads' K and V; unknown heads: n_embd wide)
    margin: int            # bytes left for the runtime and the OS: 10% of the rest, at least 128 MiB, or a prompt's reads
    fit: int = -1          # experts per layer the budget holds (n_cached is at least K when streaming)
    left: int = 0          # fit < K: bytes left for the runtime beside the K slots a streamed token needs
    spare: int = 0         # of the fit, slots per layer given to reading ahead (prefetch "auto"), not cached
    gpu_layers: int = 0    # layers whose dense part and KV cache are on a GPU (n_gpu_layers), not counted above
    lowbit: int = 0        # bytes of the low-bit pools (miss "lowbit"/"lowbit-all": K + 1 copies per layer, N + 1
                           #   with lowbit_in_ram), set aside before the cache
    gpu_expert_layers: int = 0  # MoE layers whose experts went to the GPU instead (llama.cpp's placement: the GPU
                                #   holds them where RAM does not; device_fit), n_cached then N
    source: str = "free"   # what bounded ``available``: "free", "budget", "cgroup v1" or "cgroup v2" (its limit)
    prompt_room: bool = False  # the margin is the room of a prompt's reads (streamed experts)

    def __str__(self) -> str:
        free = f"{self.available / (1 << 30):.1f} GiB" if self.available >= 1 << 30 else _mib(self.available)
        fit = self.n_cached if self.fit < 0 else self.fit
        on_gpu = f"; the dense part of {self.gpu_layers} layers on the GPU" if self.gpu_layers else ""
        pools = f", {_mib(self.lowbit)} low-bit pools" if self.lowbit else ""
        free += " free" + (f" under the {self.source} limit" if self.source.startswith("cgroup") else "")
        head = (f"auto: {fit} of {self.n_expert} experts per layer fit in {free} "
                f"(less {_mib(self.dense)} dense weights, {_mib(self.kv)} KV cache{pools}, {_mib(self.margin)} margin"
                + (" for a prompt's reads" if self.prompt_room else "") + f"{on_gpu})")
        if self.spare:
            head += f"; {self.spare} of them per layer are spare slots for reading ahead"
        if self.n_cached >= self.n_expert and fit < self.n_expert and self.gpu_expert_layers:
            return head + (f"; every expert of the {self.gpu_expert_layers} MoE layer"
                           f"{'s' if self.gpu_expert_layers != 1 else ''} on the GPU goes there (llama.cpp's "
                           "placement): all resident, nothing streamed")
        if self.n_cached >= self.n_expert:
            return head + ": all resident, nothing streamed"
        if fit < self.n_expert_used:
            head += (f": a streamed token needs K = {self.n_expert_used} slots per layer, which cache "
                     f"{self.n_cached} experts and leave {_mib(max(0, self.left))} for the runtime")
            if self.left < 64 << 20:
                head += ": too little memory, expect page faults (free memory, or use a smaller context)"
        return head


def _kv_bytes(info: ModelInfo, n_ctx: int) -> int:
    """The KV cache llama.cpp allocates at F16 for every layer and position: K and V of its KV heads
    (``ModelInfo.n_embd_kv``; where unknown an upper bound, K and V n_embd wide)."""
    return 2 * n_ctx * info.n_layer * (info.n_embd_kv or 2 * max(info.n_embd, 0))


def memory_context(info: ModelInfo, available: Optional[int] = None) -> Tuple[int, str]:
    """(n_ctx, note) for -c 0 (run, chat, bench, serve): the model's training context, halved while its KV cache
    (F16) would take more than a quarter of the memory left beside the dense part; at least 512. Under a cap of a third
    of qwen3-30b-a3b's file its 40960 tokens' KV cache (3.8 GiB of 5.7) left the expert cache 8 of 128 per layer."""
    n = info.n_ctx_train or 4096
    free = _available_memory() if available is None else available
    room = max(0, free - max(0, info.non_expert_bytes)) // 4
    want = n
    while free and n > 512 and _kv_bytes(info, n) > room:
        n //= 2
    return n, (" (the model's)" if n == want else f" (the model's {want} capped by the free memory)")


def _on_host(info: ModelInfo, n_ctx: int, gpu_layers: int) -> Tuple[int, int]:
    """(dense part, KV cache) in RAM with ``gpu_layers`` repeating layers on a GPU (:func:`gpu_layers`): the
    dense part as llama.cpp places it (:meth:`ModelInfo.dense_bytes`) but an untied input layer (a token reads a row
    of it from the mapping; lock_dense leaves it unlocked: gpt-oss-20b's 586 MiB), the other layers' KV cache."""
    host = 1.0 - min(max(gpu_layers, 0), info.n_layer) / max(info.n_layer, 1)
    rows = 0 if info.output_tied_bytes else info.input_bytes
    return info.dense_bytes(gpu_layers)[0] - rows, int(_kv_bytes(info, n_ctx) * host)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def auto_cache_size(info: ModelInfo, n_ctx: int, available: Optional[int] = None,
                    gpu_layers: int = 0, lowbit: int = 0, batch: int = 0) -> AutoCacheSize:
    """Experts per layer for ``CacheConfig(size="auto")``: the free memory, less the non-expert
    weights, the KV cache (F16 K and V of the KV heads per layer and position, :func:`_kv_bytes`) and a
    margin of 10% (at least 128 MiB, the runtime's own memory), spent on cached experts; at most N. Where the
    experts stream, the margin holds a prompt's reads (below), up to a quarter of the rest.
    A streamed token needs K slots per layer whatever the size, so where fewer than K fit, the
    cache is K (those slots keep the last experts read). ``gpu_layers`` of the model's layers have
    their dense part and KV cache on a GPU (:func:`gpu_layers`): their share of both is not
    counted against the free memory. ``lowbit``: bytes of low-bit pools decoding will hold beside
    the cache (the miss paths "lowbit" and "lowbit-all"), set aside first, as ``batch``: bytes of the
    slots a batch of sequences' selections take beside the cache (Llama(n_seq_max=N)).

    >>> from pymoecache.model_info import ModelInfo
    >>> info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=4 << 30, n_layer=8,
    ...                  moe_layers=list(range(8)), n_expert=60, n_expert_used=4, n_expert_shared=0,
    ...                  gating="softmax", n_expert_groups=0, expert_bytes=8 << 20, expert_bytes_total=8 * 60 * (8 << 20),
    ...                  n_embd=1024)
    >>> auto_cache_size(info, n_ctx=512, available=3 << 30).n_cached   # (3 GiB - 256 MiB dense - 16 MiB KV) * 3/4 / (8 x 8 MiB)
    32
    >>> auto_cache_size(info, n_ctx=512, available=512 << 20).n_cached  # 1 fits after a 128 MiB margin; K = 4 is the floor
    4
    >>> auto_cache_size(info, n_ctx=512, available=3 << 30, gpu_layers=8).n_cached   # dense part and KV cache on the GPU
    36
    >>> auto_cache_size(info, n_ctx=512, available=3 << 30, lowbit=8 * 61 * (2 << 20)).n_cached  # every copy in RAM
    21
    """
    free = _available_memory() if available is None else available
    dense, kv = _on_host(info, n_ctx, gpu_layers)
    budget = free - dense - kv - max(0, lowbit) - max(0, batch)
    margin = max(128 << 20, budget // 10)
    # streamed: a prompt reads each layer's experts through the mapping, ahead as far as the free memory holds them
    # (moecache-mapping.cpp); with less room than the layer computing and PROMPT_READ_AHEAD more, pages read ahead
    # are evicted before their layer runs and read again
    room = min((1 + PROMPT_READ_AHEAD) * (info.expert_bytes_total // max(1, info.n_moe_layer)) + (64 << 20), budget // 4)
    prompt_room = info.cache_size_for_budget(max(0, budget - margin)) < info.n_expert and room > margin
    margin = room if prompt_room else margin
    fit = max(0, info.cache_size_for_budget(max(0, budget - margin)))
    n, left = fit, 0
    if fit < min(info.n_expert_used, info.n_expert):
        n = min(info.n_expert_used, info.n_expert)
        left = budget - int(n * info.cache_bytes * info.n_moe_layer)
    return AutoCacheSize(n_cached=n, n_expert=info.n_expert, n_expert_used=info.n_expert_used, available=free,
                         dense=dense, kv=kv, margin=margin, fit=fit, left=left, gpu_layers=min(max(gpu_layers, 0),
                                                                                                 info.n_layer),
                         lowbit=max(0, lowbit), source=_free_source() if available is None else "budget",
                         prompt_room=prompt_room)


def has_gpu() -> bool:
    """ggml has a GPU device: this build's backends', or an RPC server registered so far."""
    from ._lib import has_gpu_device  # (the library, only when GPU layers are asked for)

    try:
        return bool(has_gpu_device())
    except (OSError, AttributeError, ImportError):  # (ImportError: no native library, as `info` runs without one)
        return False


def gpu_layers(n_gpu_layers, n_layer: int) -> int:
    """How many of a model's ``n_layer`` repeating layers llama.cpp puts on a GPU for
    ``n_gpu_layers``: ``-ngl N`` offloads the output layer first, then the last N - 1 layers (the
    pin's llama-model.cpp); all for -1, for N > ``n_layer`` and for "auto" (not yet resolved by
    :func:`auto_gpu_layers`); 0 where ggml has no GPU device (:func:`has_gpu`)."""
    if not n_gpu_layers or not has_gpu():
        return 0
    if n_gpu_layers == "auto" or n_gpu_layers < 0 or n_gpu_layers > n_layer:
        return n_layer
    return int(n_gpu_layers) - 1


DEVICE_MARGIN = 1 << 30  # bytes left free on a GPU beside the weights and KV cache: its compute buffers and the
#                          driver's (llama.cpp's --fit keeps as much: its --fit-target default)


def auto_gpu_layers(info: ModelInfo, n_ctx: int, free: Optional[int]) -> int:
    """``n_gpu_layers="auto"`` (llama.cpp's ``-ngl auto``): every layer (-1, the output too) where the
    dense part and the KV cache fit in ``free`` bytes of GPU memory beside
    :data:`DEVICE_MARGIN`, else the output layer (-ngl counts it first) and as many repeating layers as
    fit (each an equal share of theirs and of the KV cache; the input layer stays on the CPU,
    :meth:`ModelInfo.dense_bytes`); 0 without a GPU (``free`` None) or where no repeating layer fits.
    The experts are not counted: where they do not fit beside, the cache keeps them in RAM
    (``Llama``, residency auto).

    >>> from pymoecache.model_info import ModelInfo
    >>> info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=5 << 30, n_layer=8,
    ...                  moe_layers=list(range(8)), n_expert=64, n_expert_used=4, n_expert_shared=0,
    ...                  gating="softmax", n_expert_groups=0, expert_bytes=8 << 20,
    ...                  expert_bytes_total=8 * 64 * (8 << 20), n_embd=1024, input_bytes=256 << 20, output_bytes=256 << 20)
    >>> auto_gpu_layers(info, 4096, 4 << 30), auto_gpu_layers(info, 4096, None)
    (-1, 0)
    >>> auto_gpu_layers(info, 4096, 1600 << 20)  # (1600 - 1024 margin - 256 output) MiB / (64 dense + 16 KV) MiB a layer
    5
    """
    if not free:
        return 0
    _, every = info.dense_bytes(info.n_layer)
    output = info.output_bytes + info.output_tied_bytes  # (-ngl 1: the output layer; each 1 more, a repeating one)
    per_layer = (every - output + _kv_bytes(info, n_ctx)) / max(info.n_layer, 1)
    left = free - DEVICE_MARGIN - output
    n = int(max(0, left) // per_layer) if per_layer > 0 else info.n_layer
    return -1 if n >= info.n_layer else n + 1 if left >= 0 and n > 0 else 0


def device_free_memory(devices: Optional[list] = None) -> Optional[int]:
    """Free bytes of the discrete GPUs a load offloads to: ``devices`` (ggml device handles; default
    what llama.cpp takes, the RPC servers' devices and this build's GPUs, :func:`rpc.live_devices`),
    the RPC servers' as they report it; None where none is discrete or none reports its memory (a GPU
    that shares the host's memory is planned with the host's)."""
    import ctypes

    from ._lib import GGML_BACKEND_DEVICE_TYPE_GPU, load_ggml
    from .rpc import live_devices

    try:
        ggml = load_ggml()
        devs = live_devices([]) if devices is None else devices
        free = ctypes.c_size_t(0)
        total = ctypes.c_size_t(0)
        free_sum = 0
        for dev in devs:
            if ggml.ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_GPU:
                continue
            ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            free_sum += free.value
    except (OSError, AttributeError):
        return None
    return free_sum or None


def moe_layers_on_gpu(info: ModelInfo, gpu_layers: int) -> int:
    """MoE layers among the last ``gpu_layers`` repeating layers, those llama.cpp offloads
    (:func:`gpu_layers`)."""
    n_gpu = min(max(gpu_layers, 0), info.n_layer)
    return sum(1 for il in info.moe_layers if il >= info.n_layer - n_gpu)


def device_experts_fit(info: ModelInfo, n_ctx: int, gpu_layers: int, free: int) -> int:
    """Experts per MoE layer that fit in ``free`` bytes of GPU memory beside what ``gpu_layers``
    offloaded layers put there (their share of the dense part, their KV cache) and
    :data:`DEVICE_MARGIN`; at most N. llama.cpp offloads the last ``gpu_layers`` layers.

    >>> from pymoecache.model_info import ModelInfo
    >>> info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=5 << 30, n_layer=8,
    ...                  moe_layers=list(range(8)), n_expert=64, n_expert_used=4, n_expert_shared=0,
    ...                  gating="softmax", n_expert_groups=0, expert_bytes=8 << 20,
    ...                  expert_bytes_total=8 * 64 * (8 << 20), n_embd=1024)
    >>> device_experts_fit(info, 4096, 8, 4 << 30)   # (4 GiB - 1 GiB - 1 GiB dense - 128 MiB KV) / (8 x 8 MiB)
    30
    >>> device_experts_fit(info, 4096, 8, 8 << 30), device_experts_fit(info, 4096, 8, 1 << 30)
    (64, 0)
    """
    n_gpu = min(max(gpu_layers, 0), info.n_layer)
    share = n_gpu / max(info.n_layer, 1)
    moe_on_gpu = moe_layers_on_gpu(info, n_gpu)
    left = free - DEVICE_MARGIN - info.dense_bytes(n_gpu)[1] - int(_kv_bytes(info, n_ctx) * share)
    if moe_on_gpu == 0 or info.expert_bytes <= 0:
        return info.n_expert
    return int(min(info.n_expert, max(0, left) // (info.expert_bytes * moe_on_gpu)))


@dataclasses.dataclass(frozen=True)
class DeviceFit:
    """Where the experts of a load with GPU layers go, from the GPUs' free memory (:func:`device_fit`)."""
    residency: str  # "none": every expert on the GPU, none in RAM (llama.cpp's placement); "stream": the RAM cache
    n_vram: int     # experts per MoE layer in a VRAM tier (0: none)
    exclusive: bool  # the tier's experts keep no host slot: RAM and GPU together hold n_cached + n_vram
    where: str      # what the plan line and ``info --gpu-mem`` say of it


def device_fit(info: ModelInfo, n_ctx: int, gpu_layers: int, free: Optional[int], n_cached: int,
               keep_ram: bool = False) -> DeviceFit:
    """Where the experts go beside ``gpu_layers`` offloaded layers and a RAM cache of ``n_cached``
    experts per layer, given ``free`` bytes of GPU memory (:func:`device_experts_fit`), the one rule
    ``Llama`` (residency auto) and ``info --gpu-mem`` follow:

    - every expert fits the GPU: llama.cpp's placement, all of them there, whatever RAM holds; unless
      ``keep_ram`` (a cache size or a tier was stated) and RAM holds fewer than all: then the tier
      takes the rest;
    - RAM holds every expert: it keeps them, the GPU as many per layer as fit, copies in a VRAM tier;
    - RAM holds fewer (a model larger than RAM): RAM keeps its share and the GPU as many others as fit,
      exclusive tiers, so the two together hold more and the file is read less. Where some MoE layers
      stay on the CPU, llama.cpp's placement (every expert of theirs in RAM) is taken only where RAM
      holds them (``n_cached`` experts of every layer are as many bytes as all of fewer layers).

    >>> from pymoecache.model_info import ModelInfo
    >>> info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=5 << 30, n_layer=8,
    ...                  moe_layers=list(range(8)), n_expert=64, n_expert_used=4, n_expert_shared=0,
    ...                  gating="softmax", n_expert_groups=0, expert_bytes=8 << 20,
    ...                  expert_bytes_total=8 * 64 * (8 << 20), n_embd=1024)
    >>> [(f.residency, f.n_vram, f.exclusive) for f in (device_fit(info, 4096, 8, 8 << 30, 64),
    ...  device_fit(info, 4096, 8, 4 << 30, 64), device_fit(info, 4096, 8, 4 << 30, 20),
    ...  device_fit(info, 4096, 8, 8 << 30, 20), device_fit(info, 4096, 8, 8 << 30, 20, keep_ram=True))]
    [('none', 0, False), ('stream', 30, False), ('stream', 30, True), ('none', 0, False), ('stream', 44, True)]
    >>> device_fit(info, 4096, 4, 8 << 30, 40).where   # 4 of 8 layers on the GPU: RAM holds the other 4's 64
    "every expert of the 4 MoE layers on the GPU there, of the other 4 in RAM (llama.cpp's placement)"
    >>> device_fit(info, 4096, 4, 8 << 30, 20).where   # RAM holds fewer: the cache streams in every layer
    '20 per layer in RAM, 44 others in GPU memory in the 4 MoE layers on the GPU (exclusive: the two hold all there)'
    """
    n_expert = info.n_expert
    on_gpu = moe_layers_on_gpu(info, gpu_layers)
    on_cpu = info.n_moe_layer - on_gpu
    if on_gpu == 0:  # (the output layer alone: every expert where it is without a GPU)
        return DeviceFit("none" if n_cached >= n_expert else "stream", 0, False, "no MoE layer on the GPU: "
                         + ("every expert in RAM" if n_cached >= n_expert else f"{n_cached} per layer streamed in RAM"))
    fit = device_experts_fit(info, n_ctx, gpu_layers, free) if free else 0
    s = "s" if on_gpu != 1 else ""
    there = f" in the {on_gpu} MoE layer{s} on the GPU" if on_cpu else ""  # (the others stream n_cached in RAM)
    # llama.cpp's placement loads every expert of the layers left on the CPU: RAM must hold them
    ram_holds_cpu_layers = n_cached >= n_expert or n_expert * on_cpu <= n_cached * info.n_moe_layer
    if fit >= n_expert and ram_holds_cpu_layers and (n_cached >= n_expert or not keep_ram):
        return DeviceFit("none", 0, False, (f"every expert of the {on_gpu} MoE layer{s} on the GPU there, of the "
                                            f"other {on_cpu} in RAM" if on_cpu else "every expert on the GPU"
                                            + ("" if n_cached >= n_expert else ", none in RAM"))
                         + " (llama.cpp's placement)")
    if n_cached >= n_expert:
        return DeviceFit("stream", fit, False, f"every expert in RAM, {fit} per layer also in GPU memory" if fit else
                         "every expert in RAM, computed by the CPU (as --cpu-moe)")
    n = min(fit, n_expert - n_cached)
    held = "all" if n_cached + n >= n_expert else f"{n_cached + n} of {n_expert}"
    return DeviceFit("stream", n, n > 0, f"{n_cached} per layer in RAM, {n} others in GPU memory{there} (exclusive: "
                     f"the two hold {held}{' there' if there else ''})" if n else
                     f"{n_cached} per layer streamed in RAM, none in GPU memory")


def gpu_plan_rows(info: ModelInfo, n_ctx: int, free: int, n_cached: int, keep_ram: bool = False) -> List[tuple]:
    """(what, value) rows for ``info --gpu-mem``: what ``-ngl 99`` and ``-ngl auto`` place where on a GPU
    with ``free`` bytes, beside a host cache of ``n_cached`` experts per layer (``keep_ram``: a size the
    user stated; Llama's own rules: :func:`auto_gpu_layers`, :func:`device_fit`)."""
    n_gpu = auto_gpu_layers(info, n_ctx, free)
    dense = info.dense_bytes(info.n_layer)[1] + _kv_bytes(info, n_ctx)
    experts = int(info.expert_bytes * info.n_expert * info.n_moe_layer)

    def mib(n: float) -> str:  # (a GPU's memory in MiB, as llama.cpp prints it)
        return _mib(n) if 10 << 20 <= n < 64 << 30 else _fmt(n)

    rows = [("GPU memory free", mib(free)),
            ("  margin (llama.cpp's --fit)", mib(DEVICE_MARGIN)),
            ("  dense part + KV cache", f"{mib(dense)} (every layer, the input layer's {mib(info.input_bytes)} staying "
                                        "in RAM; KV at F16)" if info.input_bytes else f"{mib(dense)} (every layer; KV at F16)"),
            ("  routed experts", f"{mib(experts)} ({info.n_expert} per layer)")]
    if n_gpu == 0:
        rows.append(("-ngl auto", "no layer fits: every layer stays on the CPU"))
        return rows
    layers = info.n_layer if n_gpu < 0 else n_gpu - 1  # (-ngl N: the output layer, then N - 1 repeating layers)
    if n_gpu > 0:
        rows.append(("-ngl auto", f"{n_gpu} of {info.n_layer + 1} layers, the output layer first, as llama.cpp counts "
                                  "them (the dense part of more does not fit)"))
    fit = device_fit(info, n_ctx, layers, free, n_cached, keep_ram)
    where = fit.where + (f" ({mib(fit.n_vram * info.expert_bytes * info.n_moe_layer)})" if fit.n_vram else "")
    rows.append(("-ngl 99" if n_gpu < 0 else f"-ngl {n_gpu}", where))
    return rows


def memory_shortfall(info: ModelInfo, n_cached: int, n_ctx: int, spare: int = 0,
                     available: Optional[int] = None, gpu_layers: int = 0, lowbit: int = 0) -> Optional[str]:
    """Why a streamed run with ``n_cached`` experts per layer does not fit the free memory, or None
    where it does (or the free memory is unknown): its expert slots (at least K per layer, plus
    ``spare``), the low-bit pools (``lowbit`` bytes), the dense part, the KV cache and 64 MiB for the
    runtime, against what is free.

    >>> from pymoecache.model_info import ModelInfo
    >>> info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=4 << 30, n_layer=8,
    ...                  moe_layers=list(range(8)), n_expert=60, n_expert_used=4, n_expert_shared=0,
    ...                  gating="softmax", n_expert_groups=0, expert_bytes=8 << 20, expert_bytes_total=8 * 60 * (8 << 20),
    ...                  n_embd=1024)
    >>> memory_shortfall(info, 30, 512, available=4 << 30) is None
    True
    >>> print(memory_shortfall(info, 30, 512, available=2 << 30))
    1920 MiB of expert slots + 256 MiB dense part + 16 MiB KV cache + 64 MiB runtime = 2256 MiB, 2048 MiB free
    """
    free = _available_memory() if available is None else available
    if not free:
        return None
    slots = int((max(n_cached, info.n_expert_used) + spare) * info.cache_bytes * info.n_moe_layer)
    dense, kv = _on_host(info, n_ctx, gpu_layers)  # (the rest is on a GPU)
    need = slots + max(0, lowbit) + dense + kv + (64 << 20)
    if need <= free:
        return None
    pools = f" + {_mib(lowbit)} low-bit pools" if lowbit > 0 else ""
    return (f"{_mib(slots)} of expert slots{pools} + {_mib(dense)} dense part + {_mib(kv)} KV cache + 64 MiB runtime "
            f"= {_mib(need)}, {_mib(free)} free")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where the memory goes and what a decoded token will read (:func:`memory_plan`)."""

    available: int            # bytes free now (MemAvailable, a cgroup limit), or the budget given
    budget_from: str          # "free", "budget", "cgroup v1" or "cgroup v2": where ``available`` came from
    dense: int                # non-expert weights (resident; locked when streamed)
    kv: int                   # KV cache for n_ctx at F16 (_kv_bytes)
    n_ctx: int
    n_cached: int             # experts cached per MoE layer
    n_spare: int              # more slots per layer that read ahead (prefetch auto), not cached
    n_expert: int
    n_expert_used: int
    n_moe_layer: int
    slot_bytes: float         # one expert of one layer in the cache
    expert_bytes: float       # one expert of one layer in the file
    disk_bytes_per_s: float   # probed read speed of the model's disk (0: not probed)
    miss: str = "full"        # what a streamed miss is computed from: "full", "lowbit", "lowbit-all", or
                              #   "lowbit-cache" (the cache holds low-bit copies: slot_bytes and expert_bytes are theirs)
    lowbit_bytes: float = 0.0  # one expert of one layer in the low-bit companion
    lowbit_in_ram: bool = False  # every low-bit copy in memory (else K slots per layer, read per token)
    lowbit_name: str = ""     # the companion in use: its file name and the types its experts are at
    n_vram: int = 0           # experts per layer in the VRAM tier's device slots (CacheConfig.vram_size; with
                              #   lowbit-cache, the low-bit copies that fit in that many experts' bytes)
    vram_bytes: int = 0       # GPU memory of the tier (every layer's slots)
    vram_exclusive: bool = False  # the tier's experts keep no host slot: the two hold n_cached + n_vram
    exclusive_layers: int = 0  # MoE layers whose tiers are exclusive (the GPU layers'; 0 with vram_exclusive: all)
    n_batch: int = 0          # more slots per layer for sequences decoded together (Llama(n_seq_max=N): (N - 1) x K)
    batch_shared: bool = False  # the layers share those slots' memory (placement.batch_slots_shared): one layer's
    device_note: str = ""     # what the GPUs' free memory decided (the tier's size, the experts kept in RAM), or ""
    gpu_expert_layers: int = 0  # MoE layers whose experts llama.cpp placed in GPU memory (residency none beside GPU
                                #   layers): not in RAM, not counted in cache_bytes

    @property
    def streamed(self) -> bool:
        return self.n_cached < self.n_expert

    @property
    def cache_bytes(self) -> int:
        slots = max(self.n_cached, self.n_expert_used if self.streamed else 0) + self.n_spare
        batch = self.n_batch * self.slot_bytes * (1 if self.batch_shared else self.ram_expert_layers)
        return int(slots * self.slot_bytes * self.ram_expert_layers + (batch if self.streamed else 0))

    @property
    def _shared(self) -> str:
        return " (one layer's: the layers share them)" if self.batch_shared else ""

    @property
    def ram_expert_layers(self) -> int:
        """MoE layers whose experts are in RAM (the cache's): those not on the GPU (:attr:`gpu_expert_layers`)."""
        return max(0, self.n_moe_layer - (0 if self.streamed else self.gpu_expert_layers))

    @property
    def gpu_expert_bytes(self) -> int:
        """GPU memory the experts of :attr:`gpu_expert_layers` take (llama.cpp's placement)."""
        return int(self.n_expert * self.expert_bytes * (0 if self.streamed else self.gpu_expert_layers))

    def _cache_text(self) -> str:
        """Where the experts are when every one is in memory: 'N of N per layer', and the layers on the GPU."""
        layers = self.gpu_expert_layers if not self.streamed else 0
        if not layers:
            return ""
        if layers >= self.n_moe_layer:
            return f"every expert on the GPU: {_fmt(self.gpu_expert_bytes)} of GPU memory"
        return (f"in the {self.ram_expert_layers} MoE layer{'s' if self.ram_expert_layers != 1 else ''} on the CPU; "
                f"the other {layers}'s on the GPU: {_fmt(self.gpu_expert_bytes)} of GPU memory")

    @property
    def lowbit_memory(self) -> int:
        """The low-bit pools: K slots (every expert with lowbit_in_ram) and a zero slot per layer."""
        if self.miss in ("full", "lowbit-cache") or not self.streamed:
            return 0
        slots = (self.n_expert if self.lowbit_in_ram else self.n_expert_used) + 1
        return int(slots * self.lowbit_bytes * self.n_moe_layer)

    @property
    def headroom(self) -> int:
        """What the budget leaves beside the dense part, the KV cache, the expert cache and the low-bit pools."""
        return self.available - self.dense - self.kv - self.cache_bytes - self.lowbit_memory

    @property
    def n_held(self) -> int:
        """Experts per layer held in memory in a layer with a tier: the cache's, with exclusive tiers the tier's too."""
        return min(self.n_expert, self.n_cached + (self.n_vram if self.vram_exclusive else 0))

    @property
    def tier_layers(self) -> int:
        """MoE layers whose experts :attr:`n_held` counts (exclusive tiers); the others hold the cache's."""
        return min(self.exclusive_layers or self.n_moe_layer, self.n_moe_layer) if self.vram_exclusive else 0

    @property
    def miss_rate(self) -> float:
        """Misses per selection if routing were uniform under top-k + LRU: 1 - held / N, averaged over
        the layers. Real routing concentrates on fewer experts, and cache-aware routing lowers it further.

        >>> p = MemoryPlan(available=1, budget_from="free", dense=0, kv=0, n_ctx=1, n_cached=30, n_spare=0,
        ...                n_expert=60, n_expert_used=4, n_moe_layer=4, slot_bytes=1, expert_bytes=1,
        ...                disk_bytes_per_s=0, n_vram=30, vram_exclusive=True)
        >>> p.miss_rate, dataclasses.replace(p, exclusive_layers=2).miss_rate   # all 4 layers' tiers, or 2 of them
        (0.0, 0.25)
        """
        if not self.streamed:
            return 0.0
        share = self.tier_layers / max(self.n_moe_layer, 1)
        return 1.0 - (share * self.n_held + (1.0 - share) * self.n_cached) / self.n_expert

    @property
    def read_per_token(self) -> int:
        """Bytes a decoded token is expected to read at :attr:`miss_rate` (with the low-bit miss path
        the full copies are still read, behind the token; with lowbit-all none is)."""
        if self.miss == "lowbit-all":
            return 0 if self.lowbit_in_ram else int(self.n_expert_used * self.lowbit_bytes * self.n_moe_layer)
        return int(self.miss_rate * self.n_expert_used * self.expert_bytes * self.n_moe_layer)

    @property
    def critical_per_token(self) -> int:
        """Bytes a decoded token is expected to wait for: its misses' full copies, or with the low-bit
        miss path their low-bit copies (none in memory)."""
        if self.miss in ("full", "lowbit-cache"):
            return self.read_per_token
        if self.lowbit_in_ram:
            return 0
        share = 1.0 if self.miss == "lowbit-all" else self.miss_rate
        return int(share * self.n_expert_used * self.lowbit_bytes * self.n_moe_layer)

    @property
    def io_tok_s(self) -> float:
        """The disk's bound on decode speed: probed bytes/s over the bytes a token reads."""
        if not self.read_per_token or not self.disk_bytes_per_s:
            return 0.0
        return self.disk_bytes_per_s / self.read_per_token

    def decode_text(self) -> str:
        if not self.streamed:
            return ("from memory: every expert is " + ("in RAM or on the GPU" if self.gpu_expert_layers else "cached")
                    + ", nothing is read while decoding") + (
                f" (every one a low-bit copy from the companion{' ' + self.lowbit_name if self.lowbit_name else ''})"
                if self.miss == "lowbit-cache" else "")
        if self.miss_rate <= 0.0 and self.miss in ("full", "lowbit-cache"):
            return "from memory once warm: RAM and VRAM hold every expert, each read once"
        text = (f"reads ~{_fmt(self.read_per_token)}/token ({100 * self.miss_rate:.0f}% misses if routing "
                "were uniform)")
        if self.disk_bytes_per_s and self.read_per_token:
            text += (f": at most {self.io_tok_s:.1f} tok/s from a disk that reads "
                     f"{self.disk_bytes_per_s / 1e6:.0f} MB/s")
        companion = f"the companion {self.lowbit_name}" if self.lowbit_name else "the companion"
        if self.miss == "lowbit-cache":
            text += f"; every expert computed from its low-bit copy in {companion} (lowbit-cache)"
        elif self.miss != "full":
            text += (f"; misses computed from the low-bit copies in {companion} ({self.miss}), a token waits for "
                     + (f"~{_fmt(self.critical_per_token)} of reads" if self.critical_per_token
                        else "no read (its copies are in memory)"))
        return text

    def lowbit_text(self) -> str:
        return (f"{_fmt(self.lowbit_memory)}: " + ("every expert's low-bit copy" if self.lowbit_in_ram
                                                   else f"{self.n_expert_used} low-bit slots per layer")
                + f" ({_fmt(self.lowbit_bytes)} each) and a zero slot")

    def free_word(self) -> str:
        """"free", "budget", or "free under the cgroup v1 limit" (what bounded ``available``)."""
        return self.budget_from if self.budget_from in ("free", "budget") else f"free under the {self.budget_from} limit"

    def summary(self) -> str:
        """One line: the sum, then the decode's reads."""
        free = self.free_word()
        on_gpu = self._cache_text()  # (a part of the layers: "in the N MoE layers on the CPU; ...")
        sep = "; " if self.gpu_expert_layers >= self.n_moe_layer else " "
        cache = (f"{self.n_cached} of {self.n_expert} per layer" + (" low-bit" if self.miss == "lowbit-cache" else "")
                 + (sep + on_gpu if on_gpu else "")
                 + (f" + {self.n_spare} spare" if self.n_spare else "")
                 + (f" + {self.n_batch} for a batch{self._shared}" if self.n_batch and self.streamed else ""))
        return (f"plan: {_fmt(self.available)} {free} = dense part {_fmt(self.dense)} + KV cache {_fmt(self.kv)} "
                f"({self.n_ctx} tokens) + expert cache {_fmt(self.cache_bytes)} ({cache}) + "
                + (f"low-bit {self.lowbit_text()} + " if self.lowbit_memory else "") + "headroom "
                f"{_fmt(self.headroom)}{' (too little: expect page faults)' if self.headroom < 64 << 20 else ''}; "
                + (f"{self.vram_text()}; " if self.n_vram else "") + (f"{self.device_note}; " if self.device_note else "")
                + f"decode {self.decode_text()}")

    def vram_text(self) -> str:
        """What the VRAM tier holds, in GPU memory beside the sum above.

        >>> MemoryPlan(available=1, budget_from="free", dense=0, kv=0, n_ctx=1, n_cached=60, n_spare=0, n_expert=60,
        ...            n_expert_used=4, n_moe_layer=4, slot_bytes=1, expert_bytes=1, disk_bytes_per_s=0,
        ...            miss="lowbit-cache", n_vram=9, vram_bytes=168960).vram_text()
        'VRAM tier 9 of 60 per layer low-bit in 0.16 MiB of GPU memory'
        """
        held = self.n_held
        return (f"VRAM tier {self.n_vram} of {self.n_expert} per layer" + (" low-bit" if self.miss == "lowbit-cache" else "")
                + f" in {_fmt(self.vram_bytes)} of GPU memory"
                + (f", exclusive: RAM and VRAM hold {held} of {self.n_expert}"
                   + (f" in the {self.tier_layers} MoE layer{'s' if self.tier_layers != 1 else ''} on the GPU "
                      f"(the others {self.n_cached})"
                      if self.tier_layers < self.n_moe_layer else "")
                   + (" (all: none read again after warm-up)" if held == self.n_expert and not self.miss_rate else "")
                   if self.vram_exclusive else ""))

    def rows(self) -> List[tuple]:
        """(what, value) rows for ``info``'s table."""
        on_gpu = self._cache_text()
        return [
            ("memory " + self.free_word(), _fmt(self.available)),
            ("  dense part", _fmt(self.dense)),
            ("  KV cache", f"{_fmt(self.kv)} for {self.n_ctx} tokens (F16)"),
            ("  expert cache", f"{_fmt(self.cache_bytes)}: {self.n_cached} of {self.n_expert} experts per layer"
             + (" (low-bit copies)" if self.miss == "lowbit-cache" else "")
             + (f" + {self.n_spare} spare slots reading ahead" if self.n_spare else "")
             + (f" + {self.n_batch} slots for a batch{self._shared}" if self.n_batch and self.streamed else "")
             + ("" if self.streamed else ", all of them: nothing streamed")
             + (f" ({on_gpu})" if on_gpu else "")),
            *((("  low-bit copies", self.lowbit_text()),) if self.lowbit_memory else ()),
            *((("  VRAM tier", self.vram_text()[len("VRAM tier "):]),) if self.n_vram else ()),
            ("  headroom", _fmt(self.headroom) + (" (too little: expect page faults)"
                                                  if self.headroom < 64 << 20 else "")),
            ("disk", f"{self.disk_bytes_per_s / 1e6:.0f} MB/s (probed, direct reads of expert size)"
             if self.disk_bytes_per_s else "not probed"),
            ("decode", self.decode_text()),
        ]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(cache_bytes=self.cache_bytes, gpu_expert_bytes=self.gpu_expert_bytes, headroom=self.headroom,
                 streamed=self.streamed, miss_rate_uniform=self.miss_rate, read_per_token=self.read_per_token, io_tok_s=self.io_tok_s,
                 lowbit_memory=self.lowbit_memory, critical_per_token=self.critical_per_token)
        return d


def memory_plan(info: ModelInfo, n_ctx: int, n_cached: int, *, n_spare: int = 0, available: Optional[int] = None,
                disk_bytes_per_s: Optional[float] = None, gpu_layers: int = 0) -> MemoryPlan:
    """The plan for ``info`` with ``n_cached`` experts per layer (and ``n_spare`` more slots that
    read ahead) and a context of ``n_ctx``. available: a budget in bytes (default: what is free now).
    disk_bytes_per_s: the disk's speed (default: probed with :func:`probe_disk` when the cache
    streams, not probed when every expert is cached). ``gpu_layers`` of the layers have their dense
    part and KV cache on a GPU (:func:`gpu_layers`): RAM holds the rest's share, as
    :func:`auto_cache_size` counts it."""
    budget_from = "budget" if available is not None else _free_source()
    available = _available_memory() if available is None else available
    if disk_bytes_per_s is None:
        disk_bytes_per_s = probe_disk(info.path, info.expert_bytes) if n_cached < info.n_expert else 0.0
    dense, kv = _on_host(info, n_ctx, gpu_layers)
    return MemoryPlan(available=available, budget_from=budget_from, dense=dense, kv=kv, n_ctx=n_ctx, n_cached=n_cached, n_spare=n_spare,
                      n_expert=info.n_expert, n_expert_used=info.n_expert_used, n_moe_layer=info.n_moe_layer,
                      slot_bytes=info.cache_bytes, expert_bytes=info.expert_bytes,
                      disk_bytes_per_s=disk_bytes_per_s)


def total_memory() -> int:
    """Physical memory in bytes (what ``--ram 50%`` is a share of); 0 where unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
