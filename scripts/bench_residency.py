#!/usr/bin/env python3
"""Expert residency benchmark: stream vs mmap vs fully resident, top-k vs prior, on a >= 2 GB MoE.

    python scripts/bench_residency.py                      # 2.2 GB model, 3 reps, table on stdout
    python scripts/bench_residency.py --size-mb 2200 --reps 3 --tokens 64 --csv residency.csv
    python scripts/bench_residency.py --prefetch off,previous,gate --prompt-tokens 512 --no-mmap
    python scripts/bench_residency.py --leave-gib 1.45 --stock --no-resident --no-mmap   # a smaller device
    python scripts/bench_residency.py --eviction lru,router-mass --cache-sizes 0.25 --no-mmap
    python scripts/bench_residency.py --storage-mbps max,300 --timeline timelines/   # slower disks, timelines
    python scripts/bench_residency.py --quant Q4_K_M --cache-sizes 1.0,0.5 --no-mmap     # weights llama.cpp repacks
    python scripts/bench_residency.py --gpu-layers 99 --cpu-moe --stock --cache-sizes 0.25 --no-mmap --vram-size 8
                                                           # a GPU: streamed vs --cpu-moe vs all offloaded

Two benchmark models (--model), each its own table: "random", a synthetic qwen2moe (random Q8_0
weights, 60 experts top-4, 1.7 MB per expert), and "trained", model C (trained on Tiny Shakespeare,
32 experts top-4, 4 layers) with every expert widened by zeros to the same 1.7 MB and multiply-adds
(its logits are model C's; it decodes C's held-out text). Both are built once into models/_bench/
(--quant: a Q4_K_M or Q4_0 copy). Each measurement runs in a fresh process (so its resident set is
its own) after the page cache was dropped (as root: /proc/sys/vm/drop_caches; otherwise
posix_fadvise(DONTNEED) on the file), so every expert a run needs really comes from storage.
Each process decodes --warmup tokens (not timed: cold cache, non-expert weights paged in), then
--tokens timed decodes, after a --prompt-tokens prompt (read through the mapping one layer at a
time: the peak RSS column shows it stays bounded). The decoded tokens are WikiText-2 text fed one token at a time (teacher
forcing: every step is a real one-token decode), because greedy decoding of a random-weight model
soon repeats itself and would make any cache look good. Settings alternate within each repetition, and the tok/s ratio of
prior:0.5 to top-k at the same cache size is taken per repetition (side by side), then the median.

Columns: decode tok/s, miss rate, MiB read from storage per token, the time of one token split
into compute / I/O wait / routing, the resident set (RSS) after decoding and at its peak, and the
part of the RSS that is neither the slot arena nor the non-expert weights ("other"); the read
bandwidth a row reached while its reads were in flight against what the disk gave the probe, and
the overlap: the share of the read time hidden behind compute (1 - I/O wait / time with reads in
flight).

Storage: --storage-mbps runs every setting again with the measured processes' reads throttled by
the kernel on the model's disk (cgroup v1 blkio.throttle.read_bps_device or v2 io.max; root), and
each storage setting starts and ends with a probe of the disk as those processes see it: O_DIRECT
reads of one expert's size at random offsets, 1, 8 and 32 in flight (scripts/storage.py).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import faulthandler
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "scripts")]  # the package, tools/synth/, storage.py

from storage import ReadThrottle, ThrottleError, drop_page_cache, probe, probe_summary  # noqa: E402,F401

MiB = 2.0 ** 20
TEXT = ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
MODEL_C = ROOT / "models" / "tiny-shakespeare-qwen2moe-32x4-w256.gguf"  # trained (scripts/train_tiny_moe.py C)
TRAINED_WIDTH = 2048  # 256 x 2048 x 3 at Q8_0 = 1024 x 512 x 3: the random benchmark's expert
TRACE_REQUEST_TOKENS = 96  # a past request of --prefetch trace: half prompt, half one-token decodes


def bench_model(size_mb: float) -> Path:
    import synth  # tools/

    base = dataclasses.replace(synth.BENCH_SPEC, name="bench-residency", n_ff_exp=512, n_layer=4)
    spec = synth.bench_spec(size_mb, base)
    return synth.build_model(spec, ROOT / "models" / "_bench" / f"bench-residency-{int(size_mb)}mb.gguf")


def trained_bench_model(width: int = TRAINED_WIDTH) -> Path:
    """Model C with every routed expert widened by zeros to ``width`` (tools/synth/widen.py): at 2048
    the random model's 1.67 MB and multiply-adds per Q8_0 expert (at 4096 twice that), a trained
    model's routing; its logits are model C's. Built once into models/_bench/."""
    from synth.widen import widen_experts  # tools/

    out = ROOT / "models" / "_bench" / f"bench-trained-{MODEL_C.stem}-w{width}.gguf"
    if not out.exists() or out.stat().st_mtime < MODEL_C.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"widening {MODEL_C.name}'s experts to {width} (once) ...", file=sys.stderr)
        widen_experts(MODEL_C, out, width)
    return out


def text_of(model: "str | Path") -> tuple:
    """(name, path) of the text a benchmark model decodes: the trained model's held-out Tiny
    Shakespeare (the text it was trained for), WikiText-2 for the random one."""
    if Path(model).name.startswith("bench-trained"):
        return "tinyshakespeare-held-out", SHAKESPEARE
    return "wikitext-2", TEXT


def proc_kib_field(path: str, key: str) -> int:
    """A "Key:   123 kB" line of a /proc file, in bytes (0 if absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def vm_hwm() -> int:
    return proc_kib_field("/proc/self/status", "VmHWM")  # peak resident set of this process


def parse_prefetch(spec: str, distance: int = 1, predictor: "str | None" = None, lowbit: "str | None" = None) -> dict:
    """A --prefetch entry as CacheConfig fields: ``gate`` -> prefetch="gate"; after the mode,
    ``:p=0.3`` sets prefetch_min_p, ``:t=0`` prefetch_threads, ``:d=2`` prefetch_distance
    (``distance`` otherwise), ``:s=2`` prefetch_spare (read into spare slots, the cache left
    alone), ``:a=1`` prefetch_adaptive on (the timed trial), ``:o=0`` overlap_experts off (a layer waits for all
    its reads before its matmuls), ``:v=0`` prefetch_route off, ``:b=0.5`` prefetch_budget (``-1``: none), ``:c=sync`` vram_copy (``async``, ``sync``), ``:f=1`` CacheConfig.predictor = ``predictor`` (the fitted
    predictors of --predictor instead of the routers), ``:m=lowbit`` CacheConfig.miss (``lowbit``,
    ``lowbit-all``: misses from the companion ``lowbit``, made from --lowbit-type; ``lowbit-cache``:
    a cache of its copies in the same memory), ``:r=1``
    CacheConfig.lowbit_in_ram (the companion's copies held in memory), ``:w=0.2``
    CacheConfig.lowbit_max_p (heavier misses at full precision), e.g. ``gate:p=0.3:t=0``,
    ``gate:s=2``, ``off:o=0``, ``off:m=lowbit``, ``off:m=lowbit:r=1``."""
    def fitted(v: str):
        if v in ("0", "false", "no"):
            return None
        if predictor is None:
            raise ValueError("f=1 needs --predictor FILE (scripts/fit_predictor.py)")
        return predictor

    mode, *opts = spec.split(":")
    out = {"prefetch": mode, "prefetch_distance": distance, "miss": "full"}  # (not auto: a companion is beside the model)
    names = {"p": ("prefetch_min_p", float), "t": ("prefetch_threads", int), "d": ("prefetch_distance", int),
             "s": ("prefetch_spare", int), "a": ("prefetch_adaptive", lambda v: v not in ("0", "false", "no")),
             "o": ("overlap_experts", lambda v: v not in ("0", "false", "no")),
             "v": ("prefetch_route", lambda v: v not in ("0", "false", "no")),
             "b": ("prefetch_budget", float),
             "c": ("vram_copy", str),
             "f": ("predictor", fitted),
             "m": ("miss", str),
             "r": ("lowbit_in_ram", lambda v: v not in ("0", "false", "no")),
             "w": ("lowbit_max_p", float)}
    for o in opts:
        key, _, value = o.partition("=")
        if key not in names:
            raise ValueError(f"unknown prefetch option {o!r} (p=MIN_P, t=THREADS, d=DISTANCE, s=SPARE, a=0|1, o=0|1, "
                             "v=0|1, b=BUDGET, c=async|sync, f=0|1, m=lowbit|lowbit-all|lowbit-cache, r=0|1, w=MAX_P)")
        out[names[key][0]] = names[key][1](value)
    if out.get("miss", "full") != "full":
        out["lowbit"] = lowbit
    return out


def add_decode_options(ap: argparse.ArgumentParser, tokens: int, warmup: int, prompt_tokens: int) -> None:
    """The options of one measured run, shared with bench_over_ram.py."""
    ap.add_argument("--tokens", type=int, default=tokens, help="timed decode tokens per run (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=warmup, help="untimed decode tokens first (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=prompt_tokens, help="prompt length (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads (default %(default)s)")


def text_label(model) -> str:
    name, path = text_of(model)
    return name if path.exists() else "random"


def text_tokens(llm, n: int, skip: int = 0) -> list:
    """n tokens of the model's text (:func:`text_of`) after its first ``skip`` ones (fixed
    pseudo-random tokens without the corpus)."""
    import numpy as np

    name, path = text_of(llm.model_path)
    if path.exists():
        if name == "tinyshakespeare-held-out":  # the model's held-out text (scripts/train_tiny_moe.py)
            from train_tiny_moe import split_text

            text = split_text(path)[1]
        else:
            text = path.read_text(encoding="utf-8")
        text = text[:200_000 * (1 + (skip + n) // 40_000)]
        return llm.tokenize(text.encode(), add_bos=False)[skip: skip + n]
    return np.random.default_rng(skip).integers(300, min(30000, llm.n_vocab()), n).tolist()


def decode_text(llm, args) -> float:
    """Evaluate a --prompt-tokens prompt, --warmup untimed and --tokens timed one-token decodes of
    WikiText-2 (teacher-forced); returns the seconds of the timed ones. Statistics are reset after
    the warm-up when ``llm`` is a pymoecache.Llama. Each timed token ends when its logits can be read
    (llama_synchronize, as llama-bench times a generated token and as sampling waits for it): a
    backend that computes asynchronously (CUDA) cannot queue the next token ahead of this one."""
    import llama_cpp

    n = args.prompt_tokens + args.warmup + args.tokens
    stream = text_tokens(llm, n)
    t0 = time.perf_counter()
    llm.eval(stream[: args.prompt_tokens])
    llama_cpp.llama_synchronize(llm._ctx.ctx)  # (an asynchronous backend returns before the prompt is computed)
    args.prefill_s = time.perf_counter() - t0
    args.prefill_warm_s = 0.0
    if getattr(args, "residency", None) in ("none", "stock"):  # the reference: the prompt again, weights in memory
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(stream[: args.prompt_tokens])
        llama_cpp.llama_synchronize(llm._ctx.ctx)
        args.prefill_warm_s = time.perf_counter() - t0
    for t in stream[args.prompt_tokens: args.prompt_tokens + args.warmup]:
        llm.eval([t])
    if hasattr(llm, "reset_moe_stats"):
        llm.reset_moe_stats()
        if getattr(args, "timeline_file", None):
            llm.start_timeline()
    t0 = time.perf_counter()
    for t in stream[args.prompt_tokens + args.warmup:]:
        llm.eval([t])
        llama_cpp.llama_synchronize(llm._ctx.ctx)
    return time.perf_counter() - t0


def hold_memory(leave_bytes: int):
    """Make the memory the OS can give (MemAvailable) about ``leave_bytes``: the rest goes into
    shared anonymous mappings touched page by page, which cannot be reclaimed on a machine without
    swap. Returns the mappings (close them to give the memory back) and the bytes held."""
    import mmap

    import numpy as np

    maps, held = [], 0
    for _ in range(4):  # MemAvailable moves as the kernel settles: top up until it is within 16 MiB
        hold = proc_kib_field("/proc/meminfo", "MemAvailable") - leave_bytes
        if hold <= 16 << 20:
            break
        m = mmap.mmap(-1, hold, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        np.frombuffer(m, dtype=np.uint8)[::4096] = 1  # every page, now
        maps.append(m)
        held += hold
    return maps, held


def worker(args) -> None:
    """One measurement, in its own process: prints one JSON line."""
    import pymoecache

    if args.residency == "stock":
        stock_worker(args)
        return
    if args.residency == "profile":
        profile_worker(args)
        return
    if args.residency == "probe":  # the disk as this (possibly throttled) process sees it
        print(json.dumps({str(d): v for d, v in probe(args.model_file, int(args.cache), (1, 8, 32)).items()}))
        return
    how = drop_page_cache(Path(args.model_file))
    eviction, _, decay = args.eviction.partition(":")  # lfu:0.8 = lfu with decay 0.8
    prefetch = parse_prefetch(args.prefetch, args.prefetch_distance, args.predictor, args.lowbit)
    vram = ({"vram_size": args.vram_size, "vram_fill": args.vram_fill, "unified": args.unified}
            if args.residency == "stream" else {})
    cache = pymoecache.CacheConfig(size=args.cache, residency=args.residency, io_threads=args.io_threads,
                                   eviction=eviction, **({"eviction_decay": float(decay)} if decay else {}), **prefetch,
                                   **vram)
    t0 = time.perf_counter()
    routing = None if args.routing == "default" else args.routing  # default: what a user gets with no routing flag
    llm = pymoecache.Llama(args.model_file, cache=cache, routing=routing, n_ctx=args.prompt_tokens + args.warmup + args.tokens + 16,
                           n_threads=args.threads, n_threads_batch=args.threads, seed=0, verbose=False,
                           **gpu_kwargs(args))
    t_load = time.perf_counter() - t0
    if args.trace_profile and args.prefetch.split(":")[0] == "trace":
        llm.load_profile(args.trace_profile, warm=False)  # past requests to match; the cache starts cold all the same
    dt = decode_text(llm, args)
    st = llm.moe_stats()
    rs = st.residency
    info = llm.model_info
    print(json.dumps({
        "residency": rs.residency, "routing": args.routing, "cache": args.cache,
        "routing_used": llm.moecache.routing.spec(), "eviction_used": llm.moecache.eviction,
        "cache_size": int(st.capacity_per_layer[0]), "n_expert": st.n_expert, "page_cache": how,
        "load_s": t_load, "tok_s": args.tokens / dt, "miss_rate": st.miss_rate,
        "mib_read_per_token": rs.bytes_read_per_token / MiB,
        # the device path per decoded token: graph splits (each a copy between backends and a wait) and the
        # reads of device memory our hooks made after the graph
        "splits_per_token": rs.splits_per_token, "device_reads_per_token": rs.device_reads_per_token,
        # the wall time of a decoded token less its I/O wait and routing
        "compute_ms": max(0.0, 1e3 * dt / args.tokens - rs.t_io_ms_per_token - rs.t_route_ms_per_token),
        "io_ms": rs.t_io_ms_per_token, "route_ms": rs.t_route_ms_per_token,
        "rss_mib": rs.rss_bytes / MiB, "peak_rss_mib": vm_hwm() / MiB, "arena_mib": rs.arena_bytes / MiB,
        "non_expert_mib": info.non_expert_bytes / MiB, "file_mib": info.file_bytes / MiB,
        "locked": rs.locked, "direct_io": rs.direct_io, "tokens": text_label(args.model_file),
        "prefetch": args.prefetch, "eviction": args.eviction, "prefill_tok_s": args.prompt_tokens / args.prefill_s,
        "prefill_warm_tok_s": args.prompt_tokens / args.prefill_warm_s if args.prefill_warm_s else 0.0,
        "demand_mib_per_token": rs.demand_bytes_read / max(1, rs.decode_tokens) / MiB,
        "ahead_mib_per_token": rs.prefetch_bytes_read / max(1, rs.decode_tokens) / MiB,
        "wasted_mib_per_token": rs.wasted_bytes / max(1, rs.decode_tokens) / MiB,
        "recall": rs.recall, "prefetch_issued": rs.prefetch_issued, "prefetch_used": rs.prefetch_used,
        "read_ms": rs.decode_t_read_ms / max(1, rs.decode_tokens), "overlap": rs.overlap,
        "major_faults_per_token": rs.major_faults_per_token,
        "prefetch_on_share": rs.prefetch_tokens_on / max(1, rs.decode_tokens),
        "read_mb_s": rs.decode_bytes_read / 1e6 / (rs.decode_t_read_ms / 1e3) if rs.decode_t_read_ms > 0 else 0.0,
        "gpu_layers": args.gpu_layers, "vram_hit_rate": rs.vram_hit_rate, "vram_copies": rs.vram_copies,
        "vram_cpu": rs.vram_cpu, "vram_copy_ms": rs.vram_t_copy_ms / max(1, rs.decode_tokens),
        "vram_ahead": rs.vram_ahead,
        # the low-bit miss path (m=lowbit): experts per token from the companion, and what a token's reads on
        # its critical path were: the companion's copies and the full copies it demanded (not those read behind)
        "lowbit_per_token": rs.lowbit_loads / max(1, rs.decode_tokens),
        "critical_mib_per_token": (rs.lowbit_bytes_read + (rs.decode_loads - rs.lowbit_behind) * rs.expert_bytes)
                                  / max(1, rs.decode_tokens) / MiB,
    }))
    if args.timeline_file:
        tl = llm.timeline()
        tl.save_chrome(args.timeline_file, routing=args.routing, cache=args.cache, prefetch=args.prefetch,
                       eviction=args.eviction, storage=args.storage_label)
        if args.timeline_file.endswith("-rep0.json") and len(tl.decode_tokens()) > 1:
            try:
                tl.plot(args.timeline_file[:-5] + ".png")
            except Exception as e:  # (no matplotlib: the JSON is there all the same)
                print(f"bench_residency: no timeline picture: {e}", file=sys.stderr)


def profile_worker(args) -> None:
    """The past requests `--prefetch trace` matches the current one against: --trace-requests
    requests (a prompt, then one-token decodes) of the text that follows the measured tokens,
    saved as a usage profile."""
    import pymoecache

    llm = pymoecache.Llama(args.model_file, cache=pymoecache.CacheConfig(size=0.5, residency="stream"), routing="lru",
                           n_ctx=TRACE_REQUEST_TOKENS + 16, n_threads=args.threads, n_threads_batch=args.threads,
                           seed=0, verbose=False)
    skip = args.prompt_tokens + args.warmup + args.tokens
    tokens = text_tokens(llm, args.trace_requests * TRACE_REQUEST_TOKENS, skip)
    for i in range(args.trace_requests):
        request = tokens[i * TRACE_REQUEST_TOKENS: (i + 1) * TRACE_REQUEST_TOKENS]
        llm.reset()  # a request begins (the one before goes into the trace store)
        llm.eval(request[: TRACE_REQUEST_TOKENS // 2])
        for t in request[TRACE_REQUEST_TOKENS // 2:]:
            llm.eval([t])
    llm.reset()
    llm.save_profile(args.trace_profile)
    print(json.dumps({"requests": args.trace_requests, "profile": args.trace_profile}))


def build_trace_profile(model: Path, args) -> str:
    out = model.with_name(model.stem + f".trace-{args.trace_requests}.moeprofile")
    print(f"trace: {args.trace_requests} past requests of {TRACE_REQUEST_TOKENS} tokens into {out}", file=sys.stderr)
    cmd = [sys.executable, __file__, "--worker", "--model-file", str(model), "--residency", "profile",
           "--cache", "0.5", "--trace-profile", str(out), "--trace-requests", str(args.trace_requests),
           "--threads", str(args.threads),
           "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens), "--warmup", str(args.warmup)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bench_residency: building the trace profile failed:\n{r.stderr[-3000:]}")
    return str(out)


def gpu_kwargs(args) -> dict:
    """n_gpu_layers and the RPC server of --gpu-layers / --rpc for a Llama of the worker."""
    if not args.gpu_layers:
        return {}
    if args.rpc:
        import pymoecache.rpc

        pymoecache.rpc.add_server(args.rpc)  # (also for llama_cpp.Llama: its devices are registered in the process)
    return {"n_gpu_layers": args.gpu_layers}


def stock_worker(args) -> None:
    """The same measurement with plain llama_cpp.Llama: llama.cpp's own mmap, no moecache."""
    import llama_cpp

    how = drop_page_cache(Path(args.model_file))
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(args.model_file, n_ctx=args.prompt_tokens + args.warmup + args.tokens + 16,
                          n_threads=args.threads, n_threads_batch=args.threads, seed=0, verbose=False,
                          **gpu_kwargs(args))
    t_load = time.perf_counter() - t0
    dt = decode_text(llm, args)
    from pymoecache import _moecache_cpp as C  # (this process's libllama is ours: it counts a stock context's splits)

    splits = C.moecache_context_graph_splits(llm._ctx.ctx)  # the last graph: a decoded token's
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * 4096
    size = Path(args.model_file).stat().st_size
    print(json.dumps({
        "residency": "stock", "routing": "lru", "cache": 1.0, "cache_size": 0, "n_expert": 0, "page_cache": how,
        "load_s": t_load, "tok_s": args.tokens / dt, "miss_rate": 0.0, "mib_read_per_token": 0.0,
        "compute_ms": 0.0, "io_ms": 0.0, "route_ms": 0.0, "rss_mib": rss / MiB, "peak_rss_mib": vm_hwm() / MiB,
        "arena_mib": 0.0, "non_expert_mib": 0.0, "file_mib": size / MiB, "locked": False, "direct_io": False,
        "tokens": text_label(args.model_file), "prefetch": "off", "eviction": "lru",
        "prefill_tok_s": args.prompt_tokens / args.prefill_s, "demand_mib_per_token": 0.0,
        "prefill_warm_tok_s": args.prompt_tokens / args.prefill_warm_s if args.prefill_warm_s else 0.0,
        "ahead_mib_per_token": 0.0, "wasted_mib_per_token": 0.0, "recall": 0.0, "prefetch_issued": 0,
        "prefetch_used": 0, "read_ms": 0.0, "overlap": 0.0, "read_mb_s": 0.0, "major_faults_per_token": 0.0,
        "prefetch_on_share": 0.0, "gpu_layers": args.gpu_layers, "vram_hit_rate": 0.0, "vram_copies": 0,
        "vram_cpu": 0, "vram_copy_ms": 0.0, "vram_ahead": 0, "splits_per_token": float(splits),
        "device_reads_per_token": 0.0,
    }))


def run_one(model: Path, args, residency: str, routing: str, cache: str, prefetch: str = "off",
            eviction: str = "lru", rep: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model-file", str(model), "--residency", residency, "--routing", routing,
           "--cache", cache, "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--io-threads", str(args.io_threads),
           "--prefetch", prefetch, "--prefetch-distance", str(args.prefetch_distance), "--eviction", eviction,
           "--storage-label", args.storage_label, "--gpu-layers", str(args.gpu_layers),
           "--vram-size", str(args.vram_size), "--vram-fill", args.vram_fill, "--unified", args.unified]
    if args.rpc:
        cmd += ["--rpc", args.rpc]
    if args.trace_profile:
        cmd += ["--trace-profile", args.trace_profile]
    if args.predictor:
        cmd += ["--predictor", str(args.predictor)]
    if args.lowbit:
        cmd += ["--lowbit", str(args.lowbit)]
    if args.timeline and residency not in ("stock", "probe"):
        name = "-".join([args.storage_label, residency, routing.replace(":", ""), cache, prefetch.replace(":", "_"),
                         eviction, f"rep{rep}"]) + ".json"
        cmd += ["--timeline-file", str(Path(args.timeline) / name)]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=args.throttle.join)
    if r.returncode != 0:
        status = (f"killed by {signal.Signals(-r.returncode).name}" if r.returncode < 0
                  else f"exit status {r.returncode}")
        message = f"{residency} {routing} {cache} {prefetch} {eviction} failed ({status}):\n{r.stderr[-3000:]}"
        if not args.keep_going:
            sys.exit(f"bench_residency: {message}")
        print(f"bench_residency: {message}", file=sys.stderr, flush=True)
        args.failed[(residency, routing, cache, prefetch, eviction)] = status
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random,trained",
                    help="the benchmark models, each a table: random (random Q8_0 weights, --size-mb) and trained "
                         "(model C, trained on Tiny Shakespeare, its experts widened with zeros to the random model's "
                         "1.67 MB: a trained model's routing and predictability) (default %(default)s)")
    ap.add_argument("--size-mb", type=float, default=2200, help="the random model's file size in MB (default %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every setting (default %(default)s)")
    add_decode_options(ap, tokens=96, warmup=32, prompt_tokens=128)
    ap.add_argument("--io-threads", type=int, default=8, help="reads in flight (default %(default)s)")
    ap.add_argument("--prefetch", default="off",
                    help="comma-separated prefetch modes to compare on the stream runs, e.g. off,previous,gate; "
                         "options after the mode: gate:p=0.2 (prefetch_min_p), gate:t=0 (prefetch_threads), "
                         "gate:d=2 (distance), gate:s=2 (2 spare slots per layer: read ahead without inserting), "
                         "auto (as a user gets it: gate:s=2 where the experts stream), gate:s=2:a=1 (the timed on/off trial instead of "
                         "the budget), gate:s=2:b=-1 (no budget), gate:s=2:f=1 (the fitted predictors of --predictor), off:o=0 "
                         "(overlap_experts off: each layer waits for all its reads before its matmuls), "
                         "off:c=async (with --vram-size: copies up on a second stream; c=sync: one after the other), "
                         "gate:p=0.2:t=2 (default %(default)s)")
    ap.add_argument("--prefetch-distance", type=int, default=1, help="prefetch distance d (default %(default)s)")
    ap.add_argument("--predictor", help="fitted predictors (scripts/fit_predictor.py) for the prefetch entries with f=1")
    ap.add_argument("--lowbit-type", default="Q4_K", metavar="TYPE",
                    help="the prefetch entries with m=lowbit or m=lowbit-all read misses from a companion of the model "
                         "at this type, made once beside it with pymoecache lowbit (default %(default)s)")
    ap.add_argument("--lowbit", help=argparse.SUPPRESS)  # (the companion, given to the workers)
    ap.add_argument("--plain-lowbit", action="store_true",
                    help="also run each model with every expert at --lowbit-type (the plain alternative to the low-bit "
                         "miss path), each stream cache size larger by as much as its experts are smaller: the same "
                         "memory (the prefetch entries with m= are left out there)")
    ap.add_argument("--trace-requests", type=int, default=8,
                    help="prefetch trace: past requests it matches against, run once before the measurements on "
                         "the text after the measured tokens and loaded by every trace run (default %(default)s)")
    ap.add_argument("--trace-profile", help=argparse.SUPPRESS)
    ap.add_argument("--eviction", default="lru",
                    help="comma-separated eviction policies to compare on the stream runs, e.g. lru,router-mass,lfu:0.8 "
                         "(NAME:DECAY sets the decay; default %(default)s)")
    ap.add_argument("--routings", default="lru,prior:0.5",
                    help="comma-separated routings of the stream and mmap runs, e.g. lru,prior:0.5,preset:speed; "
                         "default = no routing given, what pymoecache.Llama picks (the quality preset with its "
                         "eviction where experts stream); the first is the reference of the routing ratios "
                         "(default %(default)s)")
    ap.add_argument("--no-mmap", action="store_true", help="skip the mmap residency runs")
    ap.add_argument("--no-resident", action="store_true", help="skip the fully resident reference run")
    ap.add_argument("--stock", action="store_true", help="also run stock llama.cpp (llama_cpp.Llama, its mmap)")
    ap.add_argument("--keep-going", action="store_true",
                    help="a setting whose process fails is reported as failed (with its exit status and the end of "
                         "its stderr) and the other settings still run; without it the first failure stops the bench")
    ap.add_argument("--cache-sizes", default="0.5,0.25", help="stream cache sizes, shares of N, or auto (what pymoecache.Llama picks from the free memory) "
                         "(default %(default)s)")
    ap.add_argument("--leave-gib", type=float, default=None,
                    help="a smaller device: hold all memory but this many GiB (MemAvailable) for the whole "
                         "benchmark, in memory that cannot be reclaimed, released at the end (default: all memory)")
    ap.add_argument("--storage-mbps", default="max",
                    help="comma-separated read limits in MB/s for the measured processes, each a full set of runs: "
                         "'max' = the disk as it is, e.g. max,1000,300 (cgroup blkio throttle on the model's disk; "
                         "needs root; default %(default)s)")
    ap.add_argument("--timeline", metavar="DIR",
                    help="write each run's timeline of its timed decodes (Chrome trace-event JSON, Perfetto opens "
                         "it) into DIR, and a picture of one token of each setting's first repetition")
    ap.add_argument("--quant", choices=["Q8_0", "Q4_K_M", "Q4_0"], default="Q8_0",
                    help="the model's weight type: Q4_K_M and Q4_0 are quantized from the Q8_0 model with "
                         "llama.cpp's quantizer (once, kept next to it); llama.cpp repacks them for its faster "
                         "kernels on AVX2 and ARM CPUs (default %(default)s)")
    ap.add_argument("--gpu-layers", type=int, default=0, metavar="N",
                    help="n_gpu_layers of every run (-1 or 99: all): the dense part on the GPU, the experts streamed "
                         "or cached in RAM; the resident row is then the fully offloaded model (default 0)")
    ap.add_argument("--rpc", metavar="HOST:PORT",
                    help="offload --gpu-layers to this ggml RPC server; 'local' starts one on this machine's CPU "
                         "for the run (what the tests use as their GPU: no GPU speed)")
    ap.add_argument("--cpu-moe", action="store_true",
                    help="also run llama.cpp's --cpu-moe placement: every expert in RAM (mmap residency, cache 1.0), "
                         "the dense part on the GPU with --gpu-layers")
    ap.add_argument("--vram-size", type=int, default=0, metavar="N",
                    help="stream runs with --gpu-layers: N experts per layer also in GPU memory (default 0)")
    ap.add_argument("--vram-fill", choices=["auto", "copy", "cpu"], default="auto",
                    help="what a stream run does with an expert not in GPU memory (default %(default)s)")
    ap.add_argument("--unified", choices=["auto", "on", "off"], default="auto",
                    help="stream runs with --gpu-layers: the GPU computes the experts in place on the host slots "
                         "(on), where it shares the host's memory (auto, the default), or never (off)")
    ap.add_argument("--csv", help="write every run to this CSV file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-file", help=argparse.SUPPRESS)
    ap.add_argument("--residency", help=argparse.SUPPRESS)
    ap.add_argument("--routing", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--storage-label", default="max", help=argparse.SUPPRESS)
    ap.add_argument("--timeline-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        faulthandler.enable()  # a crash in native code names the Python line that called into it
        args.cache = args.cache if args.cache == "auto" else float(args.cache)
        worker(args)
        return
    try:
        storages = [None if x.strip() in ("max", "0", "") else float(x) for x in args.storage_mbps.split(",")]
    except ValueError:
        sys.exit(f"bench_residency: --storage-mbps {args.storage_mbps!r}: give MB/s numbers or 'max', e.g. max,300")
    if any(m is not None and not (m > 0 and m < 1e7) for m in storages):
        sys.exit(f"bench_residency: --storage-mbps {args.storage_mbps!r}: each limit must be in (0, 1e7) MB/s")
    if args.timeline:
        Path(args.timeline).mkdir(parents=True, exist_ok=True)

    prefetches = [p.strip() for p in args.prefetch.split(",") if p.strip()]
    prefetches = ["off"] + [p for p in prefetches if p != "off"]  # the reference of the prefetch ratios
    from pymoecache.config import CacheConfig, ConfigError

    for p in prefetches:  # a typo fails now, not after an hour of runs
        try:
            CacheConfig(io_threads=args.io_threads, **{k: v for k, v in parse_prefetch(
                p, args.prefetch_distance, args.predictor, "x").items() if k != "lowbit"})
        except (ValueError, ConfigError) as e:
            sys.exit(f"bench_residency: --prefetch {p}: {e}")
    evictions = [e.strip() for e in args.eviction.split(",") if e.strip()]
    evictions = ["lru"] + [e for e in evictions if e != "lru"]  # the reference every ratio is taken against
    kinds = list(dict.fromkeys(k.strip() for k in args.model.split(",") if k.strip()))
    if not kinds or any(k not in ("random", "trained") for k in kinds):
        sys.exit(f"bench_residency: --model {args.model!r}: give random, trained or both (random,trained)")
    if "trained" in kinds and not MODEL_C.exists():
        sys.exit(f"bench_residency: --model trained needs {MODEL_C} (scripts/train_tiny_moe.py --preset C)")
    models = []  # (before any memory is held)
    for kind in kinds:
        models.append(prepare_model(kind, args, prefetches))
        if args.plain_lowbit:
            models.append(plain_lowbit_model(kind, models[-1][1], args))
    routings = [r.strip() for r in args.routings.split(",") if r.strip()]

    def plan(scale: float) -> tuple:  # (settings, cache pairs, prefetches) of a model whose experts are scale x smaller
        caches = [c.strip() if c.strip() == "auto" else f"{min(1.0, float(c) * scale):.4g}"
                  for c in args.cache_sizes.split(",")]
        pf_of = prefetches if scale == 1.0 else [p for p in prefetches if ":m=" not in p]
        pairs = [("stream", c) for c in caches] + ([] if args.no_mmap else [("mmap", "0.5")])
        settings = [(res, routing, cache, pf, ev) for res, cache in pairs for routing in routings
                    for pf in (pf_of if res == "stream" else ["off"])
                    for ev in (evictions if res == "stream" else ["lru"])]
        if args.cpu_moe:
            settings.append(("mmap", "lru", "1.0", "off", "lru"))
        if not args.no_resident:
            settings.append(("none", "lru", "1.0", "off", "lru"))
        if args.stock:
            settings.append(("stock", "lru", "1.0", "off", "lru"))
        return settings, pairs, pf_of
    held, n_held = hold_memory(int(args.leave_gib * 2**30)) if args.leave_gib is not None else (None, 0)
    if args.leave_gib is not None:
        print(f"holding {n_held / 2**30:.1f} GiB: {proc_kib_field('/proc/meminfo', 'MemAvailable') / 2**30:.2f} GiB "
              f"left to the runs", file=sys.stderr)
    results = []
    servers = contextlib.ExitStack()  # (--rpc local: the server, for the whole run)
    if args.rpc == "local":
        import pymoecache.rpc

        args.rpc = servers.enter_context(pymoecache.rpc.LocalServer(threads=args.threads, register=False)).endpoint
    try:
        for mbps in storages:
            args.storage_label = "max" if mbps is None else f"{mbps:g}MBps"
            for kind, model, companion, trace_profile, scale in models:
                args.lowbit, args.trace_profile = companion, trace_profile
                settings = plan(scale)[0]
                args.failed = {}  # setting -> how its process ended (--keep-going)
                print(f"model {kind}: {model.name}", file=sys.stderr)
                try:
                    with ReadThrottle(model, mbps) as throttle:
                        args.throttle = throttle
                        p0 = run_probe(model, args)
                        print(f"storage {throttle}: disk before the runs {probe_summary(p0)}", file=sys.stderr)
                        runs = measure(model, args, settings)
                        p1 = run_probe(model, args)
                        print(f"storage {throttle}: disk after the runs {probe_summary(p1)}", file=sys.stderr)
                except ThrottleError as e:
                    sys.exit(f"bench_residency: {e}")
                results.append((kind, model, scale, str(throttle), runs, (p0, p1), args.failed))
    finally:
        for m in held or []:
            m.close()
        servers.close()
    for kind, model, scale, label, runs, probes, failed in results:
        args.failed, args.model_tag = failed, kind.replace("@", "-") if len(models) > 1 else ""
        settings, pairs, pf_of = plan(scale)
        if scale != 1.0:
            print(f"\n{kind}: every expert at {args.lowbit_type}, {scale:.2f}x smaller, the cache sizes {scale:.2f}x "
                  "larger: the same memory as the rows of the model itself")
        report(model, args, settings, runs, pairs, pf_of, evictions, routings, n_held, probes, label)


def prepare_model(kind: str, args, prefetches) -> tuple:
    """(kind, model file, its low-bit companion or None, its trace profile or None): the benchmark
    model of --model KIND at --quant, built once, with what its runs read besides."""
    model = bench_model(args.size_mb) if kind == "random" else trained_bench_model()
    if args.quant != "Q8_0":
        quantized = model.with_name(f"{model.stem}.{args.quant}.gguf")
        if not quantized.exists():
            print(f"quantizing {model.name} to {args.quant} (once) ...", file=sys.stderr)
            import synth  # tools/
            synth.quantize(model, quantized, args.quant)
        model = quantized
    print(f"model {kind}: {model} ({model.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)
    companion = trace_profile = None
    if any(":m=" in p and ":m=full" not in p for p in prefetches):  # a companion of the model, made once
        from pymoecache import lowbit

        path = lowbit.default_path(model, args.lowbit_type.upper())
        try:
            lowbit.check_companion(model, path)
        except lowbit.CompanionError:
            print(f"making the low-bit companion {path.name} (once) ...", file=sys.stderr)
            lowbit.make_companion(model, path, type=args.lowbit_type)
        companion = str(path)
        print(lowbit.check_companion(model, path).summary(), file=sys.stderr)
    if any(p.split(":")[0] == "trace" for p in prefetches):
        if args.trace_requests < 1:
            sys.exit("bench_residency: --trace-requests must be at least 1 for --prefetch trace")
        trace_profile = build_trace_profile(model, args)
    return kind, model, companion, trace_profile, 1.0


def plain_lowbit_model(kind: str, model: Path, args) -> tuple:
    """The plain alternative to the low-bit miss path (--plain-lowbit): the model with every routed
    expert at --lowbit-type (llama.cpp's quantizer, made once beside it), its caches larger in the
    proportion its experts are smaller. (kind@TYPE, file, None, None, that proportion)."""
    from pymoecache import lowbit, model_info

    t = args.lowbit_type.upper()
    out = model.with_name(f"{model.stem}.experts-{t}.gguf")
    if not out.exists():
        print(f"quantizing {model.name}'s experts to {t} (once) ...", file=sys.stderr)
        lowbit.quantize_experts(model, out, t, progress=False)
    scale = model_info(model).expert_bytes / model_info(out).expert_bytes
    return f"{kind}@{t}", out, None, None, scale


def run_probe(model: Path, args) -> dict:
    """The disk as the measured processes see it (throttled or not), one expert per read: {depth: MB/s}."""
    from pymoecache import model_info

    cmd = [sys.executable, __file__, "--worker", "--model-file", str(model), "--residency", "probe",
           "--cache", str(model_info(model).expert_bytes)]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=args.throttle.join)
    if r.returncode != 0:
        sys.exit(f"bench_residency: the disk probe failed:\n{r.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def measure(model: Path, args, settings) -> list:
    runs = []
    for rep in range(args.reps):
        k = rep % len(settings)
        order = settings[k:] + settings[:k]  # rotate: no setting always runs first
        for residency, routing, cache, pf, ev in order:
            r = run_one(model, args, residency, routing, cache, pf, ev, rep)
            if r is None:  # --keep-going: reported, and left out of the table
                continue
            r["rep"] = rep
            r["storage"] = args.storage_label
            runs.append(r)
            print(f"[rep {rep + 1}/{args.reps}] {residency:<6} {routing:<10} cache {cache:<4} prefetch {pf:<8} "
                  f"eviction {ev:<11} "
                  f"{r['tok_s']:7.2f} tok/s  prefill {r['prefill_tok_s']:6.1f} tok/s  miss {100 * r['miss_rate']:5.1f}%  "
                  f"read {r['mib_read_per_token']:6.2f} MiB/tok  I/O wait {r['io_ms']:5.2f} ms  "
                  f"overlap {100 * r.get('overlap', 0):3.0f}%  rss {r['rss_mib']:6.0f} MiB  "
                  f"splits {r.get('splits_per_token', 0):.1f}/tok  device reads {r.get('device_reads_per_token', 0):.2f}/tok"
                  + (f"  prefetch on {100 * r['prefetch_on_share']:.0f}% of tokens" if ":s=" in pf else ""),
                  file=sys.stderr, flush=True)
    return runs


class _Runs:
    """The runs of one report, looked up by setting (residency, routing, cache, prefetch, eviction)."""

    def __init__(self, runs, reps: int):
        self.runs, self.reps = runs, reps

    def of(self, s):
        return [r for r in self.runs if (r["residency"], r["routing"], str(r["cache"]), r["prefetch"], r["eviction"]) ==
                (s[0], s[1], s[2] if s[2] == "auto" else str(float(s[2])), s[3], s[4])]

    @staticmethod
    def med(rows, key):  # nan for a setting whose every run failed (--keep-going)
        return statistics.median(r[key] for r in rows) if rows else float("nan")

    def ratio(self, a, b):  # median over repetitions of tok/s(a) / tok/s(b), each pair from the same repetition
        per_rep = []
        for rep in range(self.reps):
            x = [r for r in self.of(a) if r["rep"] == rep]
            y = [r for r in self.of(b) if r["rep"] == rep]
            if x and y:
                per_rep.append(x[0]["tok_s"] / y[0]["tok_s"])
        return (statistics.median(per_rep) if per_rep else float("nan")), per_rep


def _times(m):  # a ratio, or why there is none (--keep-going: a setting failed)
    return f"{m:.2f}x" if m == m else "- (failed)"


def report(model: Path, args, settings, runs, pairs, prefetches, evictions, routings, n_held, probes,
           storage: str) -> None:
    """One benchmark model's results under one storage setting: the CSV (--csv), the table, the
    prefill shares, the low-bit rows' critical bytes and the side-by-side ratios."""
    if not runs:
        failed = ", ".join(" ".join(k) + f" ({v})" for k, v in args.failed.items())
        print(f"\nstorage {storage}: every setting failed: {failed}")
        return
    if args.csv:
        _write_csv(args, runs)
    by = _Runs(runs, args.reps)
    resident = by.med(by.of(("none", "lru", "1.0", "off", "lru")), "tok_s") if not args.no_resident else None
    resident = None if resident != resident else resident  # (nan: the resident runs failed)
    _print_table(model, args, settings, by, resident, n_held, probes, storage)
    if resident:
        warm = by.med(by.of(("none", "lru", "1.0", "off", "lru")), "prefill_warm_tok_s")
        share = lambda x: f"{100 * x / warm:.0f}%" if x == x else "failed"  # noqa: E731
        print(f"prefill of the {args.prompt_tokens}-token prompt, weights in memory (resident, second time): "
              f"{warm:.1f} tok/s; streamed, share of it: " +
              ", ".join(f"{s[1]} {s[2]} {s[3]} {s[4]} {share(by.med(by.of(s), 'prefill_tok_s'))}"
                        for s in settings if s[0] == "stream"))
    _print_lowbit(settings, by)
    _print_ratios(args, settings, by, pairs, prefetches, evictions, routings)


def _write_csv(args, runs) -> None:
    out = Path(args.csv)
    if runs[0]["storage"] != "max":  # one file per storage setting
        out = out.with_name(f"{out.stem}-{runs[0]['storage']}{out.suffix}")
    if args.model_tag:  # and per benchmark model
        out = out.with_name(f"{out.stem}-{args.model_tag}{out.suffix}")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(runs[0]))
        w.writeheader()
        w.writerows(runs)


def _print_table(model: Path, args, settings, by: _Runs, resident, n_held, probes, storage: str) -> None:
    med, runs = by.med, by.runs
    left = f", {args.leave_gib:g} GiB of memory left to the runs ({n_held / 2**30:.1f} GiB held)" \
        if args.leave_gib is not None else ""
    print(f"\n{model.name}: {runs[0]['file_mib']:.0f} MiB file, {runs[0]['non_expert_mib']:.0f} MiB non-expert weights; "
          f"medians of {args.reps} runs, {args.prompt_tokens}-token prompt, {args.tokens} decode tokens each, "
          f"page cache dropped before every run{left}; storage {storage}: the disk gave expert-sized O_DIRECT reads "
          f"{probe_summary(probes[0])} before the runs, {probe_summary(probes[1])} after"
          + (f"; {args.gpu_layers} GPU layers" + (f" on the RPC server {args.rpc}" if args.rpc else "")
             + (f", {args.vram_size} experts per layer in GPU memory ({args.vram_fill})" if args.vram_size else "")
             + " (resident: every layer offloaded)" if args.gpu_layers else "") + "\n")
    disk = max(max(probes[0].values()), max(probes[1].values()))  # MB/s: the best the disk gave the probe
    bw = disk * 1e6 / MiB
    print(f"overlap bound: the tok/s if every read overlapped compute, 1 / max(compute + routing, MiB read / "
          f"{bw:.0f} MiB/s, the best the probe saw); of bound: the decode tok/s as a share of it; read MB/s: bytes "
          "read / time with reads in flight, with its share of the probe's best; overlap: the share of that time "
          "hidden behind compute (1 - I/O wait / time with reads in flight)\n")
    print("| residency | routing | cache | prefetch | eviction | decode tok/s | of resident | overlap bound | of bound | "
          "prefill tok/s | miss rate | "
          "MiB read/token (demand + ahead) | wasted MiB/token | recall | compute ms | I/O wait ms | reads in flight ms | "
          "read MB/s (of disk) | overlap | major faults/token | routing ms | RSS MiB | peak RSS MiB | slots MiB |"
          + (" in VRAM | copied up/token (+ ahead) | copy-up ms/token | on the CPU/token |" if args.vram_size else ""))
    print("|---" * (24 + (4 if args.vram_size else 0)) + "|")
    for s in settings:
        rows = by.of(s)
        if not rows:
            print(f"| {s[0]} | {s[1]} | {s[2]} | {s[3]} | {s[4]} | failed: {args.failed.get(s, '?')} |")
            continue
        share = f"{100 * med(rows, 'tok_s') / resident:.0f}%" if resident else "-"
        bound_ms = max(med(rows, "compute_ms") + med(rows, "route_ms"), 1e3 * med(rows, "mib_read_per_token") / bw)
        bound = f"{1e3 / bound_ms:.2f} | {100 * med(rows, 'tok_s') * bound_ms / 1e3:.0f}%" if s[0] == "stream" \
            else "- | -"
        label = "mmap (--cpu-moe)" if args.cpu_moe and s[:3] == ("mmap", "lru", "1.0") else s[0]
        vram = (f" {100 * med(rows, 'vram_hit_rate'):.0f}% | {med(rows, 'vram_copies') / args.tokens:.2f} "
                f"(+ {med(rows, 'vram_ahead') / args.tokens:.2f}) | "
                f"{med(rows, 'vram_copy_ms'):.2f} | {med(rows, 'vram_cpu') / args.tokens:.2f} |" if args.vram_size else "")
        routing = f"default ({rows[0]['routing_used']})" if s[1] == "default" and "routing_used" in rows[0] else s[1]
        print(f"| {label} | {routing} | {rows[0]['cache_size']}/{rows[0]['n_expert']} | {s[3]} | "
              f"{rows[0].get('eviction_used') or s[4]} | "
              f"{med(rows, 'tok_s'):.2f} | "
              f"{share} | {bound} | {med(rows, 'prefill_tok_s'):.1f} | {100 * med(rows, 'miss_rate'):.1f}% | "
              f"{med(rows, 'mib_read_per_token'):.2f} ({med(rows, 'demand_mib_per_token'):.2f} + "
              f"{med(rows, 'ahead_mib_per_token'):.2f}) | {med(rows, 'wasted_mib_per_token'):.2f} | "
              f"{100 * med(rows, 'recall'):.0f}% | {med(rows, 'compute_ms'):.2f} | {med(rows, 'io_ms'):.2f} | "
              f"{med(rows, 'read_ms'):.2f} | {med(rows, 'read_mb_s'):.0f} ({100 * med(rows, 'read_mb_s') / disk:.0f}%) | "
              f"{100 * med(rows, 'overlap'):.0f}% | {med(rows, 'major_faults_per_token'):.1f} | {med(rows, 'route_ms'):.3f} | {med(rows, 'rss_mib'):.0f} | {med(rows, 'peak_rss_mib'):.0f} | "
              f"{med(rows, 'arena_mib'):.0f} |" + vram)
    print()


def _print_lowbit(settings, by: _Runs) -> None:
    """The low-bit miss path: what a token waited for, in bytes, against the same full-precision row."""
    med = by.med
    for s in settings:
        rows = by.of(s)
        if rows and ":m=" in s[3] and rows[0].get("lowbit_per_token") is not None:
            ref = by.of((s[0], s[1], s[2], s[3].split(":m=")[0], s[4]))
            source = (f"every expert from the companion, {rows[0]['cache_size']}/{rows[0]['n_expert']} cached in "
                      "the same memory"
                      if ":m=lowbit-cache" in s[3] else
                      f"{med(rows, 'lowbit_per_token'):.2f} experts/token from the companion")
            print(f"{s[0]} {s[1]} cache {s[2]} prefetch {s[3]}: {source}; critical-path MiB/token "
                  f"{med(rows, 'critical_mib_per_token'):.2f}"
                  + (f" against {med(ref, 'critical_mib_per_token'):.2f} at full precision "
                     + (f"({med(ref, 'critical_mib_per_token') / med(rows, 'critical_mib_per_token'):.2f}x fewer)"
                        if med(rows, 'critical_mib_per_token') > 1e-6 else "(none on the critical path)")
                     if ref else ""))


def _print_ratios(args, settings, by: _Runs, pairs, prefetches, evictions, routings) -> None:
    """Side by side, per repetition: against stock llama.cpp, the routings against the first, the
    prefetch modes against off, the evictions against lru."""
    if args.stock:
        for s in settings:
            if s[0] != "stock":
                m, per = by.ratio(s, ("stock", "lru", "1.0", "off", "lru"))
                sp = (by.med(by.of(s), "splits_per_token"), by.med(by.of(("stock", "lru", "1.0", "off", "lru")),
                                                                    "splits_per_token"))
                print(f"{s[0]} {s[1]} cache {s[2]} prefetch {s[3]} eviction {s[4]}: decode tok/s / stock llama.cpp "
                      f"= {_times(m)} (per repetition: {', '.join(f'{x:.2f}' for x in per)}); graph splits per "
                      f"token {sp[0]:.1f} against stock's {sp[1]:.1f}, device reads per token "
                      f"{by.med(by.of(s), 'device_reads_per_token'):.2f}")
    for residency, cache in pairs:
        for routing in routings[1:]:
            m, per = by.ratio((residency, routing, cache, "off", "lru"), (residency, routings[0], cache, "off", "lru"))
            print(f"{residency} cache {cache}: decode tok/s {routing} / {routings[0]} = {_times(m)} "
                  f"(per repetition: {', '.join(f'{x:.2f}' for x in per)})")
        for routing in routings:
            for pf in prefetches:
                if pf != "off" and residency == "stream":
                    m, per = by.ratio((residency, routing, cache, pf, "lru"), (residency, routing, cache, "off", "lru"))
                    print(f"{residency} cache {cache} {routing}: decode tok/s prefetch {pf} / off = {_times(m)} "
                          f"(per repetition: {', '.join(f'{x:.2f}' for x in per)})")
            for ev in evictions:
                if ev != "lru" and residency == "stream":
                    m, per = by.ratio((residency, routing, cache, "off", ev), (residency, routing, cache, "off", "lru"))
                    a = statistics.median(r["mib_read_per_token"] for r in by.of((residency, routing, cache, "off", ev)))
                    b = statistics.median(r["mib_read_per_token"] for r in by.of((residency, routing, cache, "off", "lru")))
                    print(f"{residency} cache {cache} {routing}: decode tok/s eviction {ev} / lru = {_times(m)}, "
                          f"MiB read per token {a:.2f} vs {b:.2f} (per repetition: {', '.join(f'{x:.2f}' for x in per)})")

if __name__ == "__main__":
    main()
