#!/usr/bin/env python3
"""A MoE larger than this machine's RAM: streaming residency next to stock llama.cpp's mmap.

    python scripts/bench_over_ram.py                  # model of 1.15 x RAM (built once, F16 random weights)
    python scripts/bench_over_ram.py --size-gb 28 --tokens 24 --cache 0.25

The model is a synthetic qwen2moe (60 experts top-4, n_embd 2048, experts of 12 MiB in F16) in
models/_bench/. Two runs, each in a fresh process after the page cache was dropped:
- pymoecache, residency stream, prior:0.5, the given cache size: memory is the slot arena, the
  non-expert weights and the usual buffers, whatever the file's size;
- stock llama.cpp through llama_cpp.Llama (no moecache), mmap as llama.cpp does it: the kernel
  pages the file in and out, the page cache is the cache.
Both decode the same WikiText-2 tokens one at a time. Reported: load time, decode tok/s, the
resident set after decoding and at its peak, and the machine's memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_residency import (MiB, ROOT, add_decode_options, decode_text, drop_page_cache,  # noqa: E402
                             proc_kib_field, vm_hwm)


def mem_total() -> int:
    return proc_kib_field("/proc/meminfo", "MemTotal")


def over_ram_model(size_gb: float) -> Path:
    import synth  # tools/

    base = dataclasses.replace(synth.BENCH_SPEC, name="bench-over-ram", n_layer=4, n_embd=2048, n_head=16, n_head_kv=16,
                               n_ff=4096, n_ff_exp=1024, n_ff_shexp=1024, embd_type="F16", weight_type="F16")
    spec = synth.bench_spec(size_gb * 1000, base)
    return synth.build_model(spec, ROOT / "models" / "_bench" / f"bench-over-ram-{size_gb:g}gb.gguf")


def worker(args) -> None:
    import pymoecache
    import llama_cpp

    how = drop_page_cache(Path(args.model))
    t0 = time.perf_counter()
    kw = dict(n_ctx=args.prompt_tokens + args.warmup + args.tokens + 16, n_threads=args.threads,
              n_threads_batch=args.threads, seed=0, verbose=False)
    if args.mode == "stock":
        llm = llama_cpp.Llama(args.model, **kw)
    else:
        llm = pymoecache.Llama(args.model, cache=pymoecache.CacheConfig(size=args.cache, residency="stream"),
                               routing="prior:0.5", **kw)
    t_load = time.perf_counter() - t0
    dt = decode_text(llm, args)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * 4096
    out = {"mode": args.mode, "load_s": t_load, "tok_s": args.tokens / dt, "rss_mib": rss / MiB,
           "peak_rss_mib": vm_hwm() / MiB, "page_cache": how}
    if args.mode != "stock":
        st = llm.moe_stats()
        out.update(miss_rate=st.miss_rate, cache_size=int(st.capacity_per_layer[0]),
                   mib_read_per_token=st.residency.bytes_read_per_token / MiB, arena_mib=st.residency.arena_bytes / MiB)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.0, help="model size in GB (default: 1.15 x RAM)")
    ap.add_argument("--cache", type=float, default=0.25, help="stream: share of experts cached (default %(default)s)")
    add_decode_options(ap, tokens=16, warmup=8, prompt_tokens=16)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        worker(args)
        return
    size_gb = args.size_gb or round(1.15 * mem_total() / 1e9, 1)
    model = over_ram_model(size_gb)
    print(f"model: {model} ({model.stat().st_size / 1e9:.1f} GB), RAM {mem_total() / 1e9:.1f} GB", file=sys.stderr)
    rows = []
    for mode in ("stream", "stock"):
        cmd = [sys.executable, __file__, "--mode", mode, "--model", str(model), "--cache", str(args.cache),
               "--tokens", str(args.tokens), "--warmup", str(args.warmup), "--prompt-tokens", str(args.prompt_tokens),
               "--threads", str(args.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{mode}: failed (rc {r.returncode})\n{r.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr, flush=True)
    print(f"\n{model.name}: {model.stat().st_size / 1e9:.1f} GB file, {mem_total() / 1e9:.1f} GB RAM; "
          f"{args.tokens} decode tokens after {args.prompt_tokens} prompt + {args.warmup} warm-up tokens\n")
    print("| run | load s | decode tok/s | RSS MiB | peak RSS MiB | notes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        notes = (f"prior:0.5, cache {r['cache_size']}/60, slots {r['arena_mib']:.0f} MiB, miss rate "
                 f"{100 * r['miss_rate']:.1f}%, {r['mib_read_per_token']:.1f} MiB read/token"
                 if r["mode"] != "stock" else "llama_cpp.Llama, mmap (prefetch), top-k")
        label = "pymoecache stream" if r["mode"] != "stock" else "stock llama.cpp mmap"
        print(f"| {label} | {r['load_s']:.1f} | {r['tok_s']:.2f} | {r['rss_mib']:.0f} | {r['peak_rss_mib']:.0f} | {notes} |")


if __name__ == "__main__":
    main()
