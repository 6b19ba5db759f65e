#!/usr/bin/env python3
"""A real-size MoE under a memory cap, as users have it: stock llama.cpp's mmap against pymoecache's defaults.

    python scripts/bench_real_size.py qwen3-30b-a3b                     # caps of a third and a sixth of the file
    python scripts/bench_real_size.py mixtral-8x7b --layers 8 --caps 1/3
    python scripts/bench_real_size.py qwen3-30b-a3b --ways stock,default --tokens 32

The model is scripts/real_size.py's file of that shape (random weights: near-uniform routing, a lower bound of
what a cache keeps on the real model; built once). Each way runs in a fresh process in a memory cgroup of its own
(cgroup v1 memory.limit_in_bytes or v2 memory.max; the page cache the run reads is charged to it, as on a phone
or in a container), after the page cache was dropped:

* stock:         llama.cpp through llama_cpp.Llama (no expert cache) with its defaults: mmap, and on a CPU with
                 repacked layouts (x86 AVX2, ARM) the weights of those types copied into anonymous memory at load;
* stock-no-repack: the same with llama-cli's --no-repack: the weights stay in the mapping, and the kernel pages
                 the experts in and out within the cap (what a user with a model over RAM should run);
* stock-no-mmap: the same reading the whole file into memory first (--no-mmap): more than the cap, so the cap's
                 OOM killer ends it (said in the table);
* default:       pymoecache.Llama(M) with nothing but the model, as `pymoecache run M` (cache size auto, which
                 reads the cgroup's limit; the quality preset);
* no-repack:     the defaults with --no-repack (pymoecache.Llama(M, repack=False)): the dense part in the file's
                 layout, as stock-no-repack has it;
* companion:     the same with a low-bit companion (made once, beside the model; `pymoecache lowbit M`).

Each decodes a 128-token prompt and then 64 tokens (8 untimed first), one at a time, or as many as --budget-s
allows. Columns: load s, prompt tok/s (and again: a second prompt after the decode, as every turn of a
conversation after the first), decode tok/s, the cgroup's peak memory, bytes read from storage per token
(/proc/self/io), major page faults per token, hit rate, the I/O bound (the disk's speed over the bytes a token
reads) and the share of it reached, and the forecast's band (pymoecache). A progress line while it runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import real_size  # noqa: E402
from memcap import MemoryCap  # noqa: E402
from storage import drop_page_cache, probe  # noqa: E402

WAYS = ("stock", "stock-no-repack", "stock-no-mmap", "default", "no-repack", "companion")
GiB = float(1 << 30)
MiB = float(1 << 20)


def _io_read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return 0


def _timed_prompt(llm, toks) -> tuple:
    """One prompt through ``llm``: (tok/s, bytes read from storage, major faults)."""
    import llama_cpp

    faults0, read0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, _io_read_bytes(), time.perf_counter()
    llm.eval(toks)
    llama_cpp.llama_synchronize(llm._ctx.ctx)
    return (len(toks) / (time.perf_counter() - t0), _io_read_bytes() - read0,
            resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0)


def worker(a) -> None:
    """One way in this (capped) process: load, prompt, decode; one JSON line."""
    import numpy as np

    out = {"way": a.way}
    t0 = time.perf_counter()
    kw = dict(n_ctx=2 * a.prompt_tokens + a.warmup + a.tokens + 16, n_threads=a.threads, n_threads_batch=a.threads,
              verbose=False)
    if a.way.startswith("stock"):
        import llama_cpp

        if a.way == "stock-no-repack":  # llama-cli's --no-repack: no extra buffer types, the weights stay mapped
            default_params = llama_cpp.llama_cpp.llama_model_default_params

            def no_repack():
                p = default_params()
                p.use_extra_bufts = False
                return p

            llama_cpp.llama_cpp.llama_model_default_params = no_repack
        llm = llama_cpp.Llama(a.model, use_mmap=a.way != "stock-no-mmap", **kw)
    else:
        import pymoecache

        cache = pymoecache.CacheConfig(lowbit=a.companion) if a.way == "companion" else None
        llm = pymoecache.Llama(a.model, cache=cache, repack=a.way != "no-repack", **kw)
        plan = llm.memory_plan()
        out.update(budget_from=plan.budget_from, n_cached=int(plan.n_cached), miss=plan.miss)
        from pymoecache.cli.loading import decode_forecast

        f = decode_forecast(llm)
        if f is not None:
            out.update(forecast=[round(f.low, 3), round(f.tok_s, 3), round(f.high, 3)])
    import llama_cpp

    out["load_s"] = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n_vocab = llm.n_vocab()
    toks = [int(t) for t in rng.integers(100, n_vocab - 100, size=a.prompt_tokens + a.warmup + a.tokens)]
    # (the prompt reads every expert: bytes over the file's size say what was read twice)
    out.update(zip(("prompt_tok_s", "prompt_read", "prompt_faults"), _timed_prompt(llm, toks[: a.prompt_tokens])))
    for t in toks[a.prompt_tokens: a.prompt_tokens + a.warmup]:
        llm.eval([t])
    if hasattr(llm, "reset_moe_stats"):
        llm.reset_moe_stats()
    faults0, read0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, _io_read_bytes()
    t0, n = time.perf_counter(), 0
    for t in toks[a.prompt_tokens + a.warmup:]:
        llm.eval([t])
        llama_cpp.llama_synchronize(llm._ctx.ctx)
        n += 1
        if time.perf_counter() - t0 > a.budget_s:
            break
    dt = time.perf_counter() - t0
    out.update(tokens=n, decode_tok_s=n / dt, read_per_token=(_io_read_bytes() - read0) / n,
               faults_per_token=(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0) / n)
    if hasattr(llm, "moe_stats") and llm.moecache is not None:
        out["hit_rate"] = llm.moe_stats().hit_rate
    # a second prompt in the same conversation (as every turn after the first): the cache is warm now
    more = [int(t) for t in rng.integers(100, n_vocab - 100, size=a.prompt_tokens)]
    if llm.n_tokens + len(more) <= llm.n_ctx():
        out.update(zip(("prompt_again_tok_s", "prompt_again_read", "prompt_again_faults"), _timed_prompt(llm, more)))
    print(json.dumps(out), flush=True)


def companion_for(model: Path, threads: int) -> Path:
    """A low-bit companion of ``model`` in a folder of its own (not beside the model, where the default would
    take it), made once; its build time is said."""
    d = model.parent / "companions"
    d.mkdir(exist_ok=True)
    found = sorted(d.glob(model.stem + ".lowbit-*.gguf"))
    if found:
        return found[0]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pymoecache", "lowbit", str(model), "-t", str(threads), "-o",
                        str(d / (model.stem + ".lowbit.gguf"))], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cannot make a companion of {model}: {r.stderr[-1500:]}")
    found = sorted(d.glob(model.stem + ".lowbit*.gguf"))
    print(f"companion {found[0].name}: {found[0].stat().st_size / GiB:.2f} GiB, made in {time.monotonic() - t0:.0f} s",
          file=sys.stderr)
    return found[0]


def run_way(model: Path, way: str, cap: int, a, companion) -> dict:
    how = drop_page_cache(model)
    cmd = [sys.executable, __file__, "--worker", way, "--model", str(model), "--threads", str(a.threads),
           "--tokens", str(a.tokens), "--warmup", str(a.warmup), "--prompt-tokens", str(a.prompt_tokens),
           "--budget-s", str(a.budget_s)] + (["--companion", str(companion)] if companion else [])
    with MemoryCap(cap) as c:
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, preexec_fn=c.join, capture_output=True, text=True, timeout=a.timeout_s)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:  # (subprocess.run killed it)
            rc, stdout, stderr = None, e.stdout or "", e.stderr or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        row = {"way": way, "cap": cap, "cgroup": c.kind, "page_cache": how, "peak": c.peak(), "oom_kills": c.oom_kills(),
               "rc": rc, "wall_s": time.monotonic() - t0}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        row.update(json.loads(lines[-1]))
    elif rc is None:
        row["error"] = f"no result in {a.timeout_s:.0f} s (stopped; thrashing at the cap)"
    else:
        text = stderr.decode() if isinstance(stderr, bytes) else stderr
        row["error"] = ("killed by the cap (OOM)" if row["oom_kills"] or rc in (-9, 137)
                        else (text.strip().splitlines() or ["exit %d" % rc])[-1][:200])
    return row


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows, disk_bps: float, model: Path, shape: str, layers) -> str:
    head = ("| cap | way | load s | prompt tok/s | again | decode tok/s | x best stock | peak GiB | MiB read/tok | faults/tok | hit rate "
            "| I/O bound tok/s | of bound | forecast |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    stock = {}  # per cap: the best stock way that ran
    for r in rows:
        if r["way"].startswith("stock") and "error" not in r:
            stock[r["cap"]] = max(stock.get(r["cap"], 0.0), r["decode_tok_s"])
    for r in rows:
        if "error" in r:
            out.append(f"| {r['cap'] / GiB:.2f} GiB | {r['way']} | {r['error']} (peak {_f((r['peak'] or 0) / GiB, '.2f')}"
                       f" GiB) |" + " |" * 11)
            continue
        read = r.get("read_per_token") or 0
        bound = disk_bps / read if read > 0 else None
        x = r["decode_tok_s"] / stock[r["cap"]] if stock.get(r["cap"]) else None
        fc = r.get("forecast")
        out.append(f"| {r['cap'] / GiB:.2f} GiB | {r['way']} | {r['load_s']:.1f} | {r['prompt_tok_s']:.2f} | "
                   f"{_f(r.get('prompt_again_tok_s'), '.2f')} | {r['decode_tok_s']:.3f} ({r['tokens']} tok) | {_f(x, '.1f')} | {_f((r['peak'] or 0) / GiB, '.2f')} | "
                   f"{read / MiB:.0f} | {r['faults_per_token']:.0f} | {_f(r.get('hit_rate'), '.2f')} | "
                   f"{_f(bound, '.2f')} | {_f(r['decode_tok_s'] / bound if bound else None, '.2f')} | "
                   + (f"{fc[0]:.2f}-{fc[2]:.2f}" if fc else "-") + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("shape", nargs="?", choices=sorted(real_size.SHAPES))
    ap.add_argument("--layers", type=int, help="the shape with fewer layers (real_size.py --layers)")
    ap.add_argument("--out-dir", type=Path, default=real_size.OUT_DIR,
                    help="where the model is built, or found built (default %(default)s)")
    ap.add_argument("--caps", default="1/3,1/6", help="caps as fractions of the file (default %(default)s)")
    ap.add_argument("--ways", default=",".join(WAYS), help="which runs, of " + ", ".join(WAYS))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop decoding a way after this long (seconds)")
    ap.add_argument("--timeout-s", type=float, default=900.0,
                    help="stop a way that has not finished after this long, load included (default %(default)s)")
    ap.add_argument("--json", type=Path, help="also write every row here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--companion", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.way = a.worker
        worker(a)
        return 0
    if not a.shape:
        ap.error("name a shape")
    ways = [w for w in a.ways.split(",") if w]
    bad = [w for w in ways if w not in WAYS]
    if bad:
        ap.error(f"unknown way {bad[0]!r}: one of {', '.join(WAYS)}")
    model = real_size.build(a.shape, a.layers, out_dir=a.out_dir)
    size = model.stat().st_size
    caps = [int(size * Fraction(c)) for c in a.caps.split(",")]
    companion = companion_for(model, a.threads) if "companion" in ways else None
    info_expert = max(1 << 20, int(sum(real_size.nbytes(t) for t in real_size.tensors(real_size.SHAPES[a.shape])
                                       if "_exps.weight" in t.name) / real_size.SHAPES[a.shape].n_layer
                                   / real_size.SHAPES[a.shape].n_expert / 3))
    disk = probe(model, info_expert, depths=(8, 32))
    disk_bps = max(disk.values()) * 1e6
    rows = []
    n = len(caps) * len(ways)
    for cap in caps:
        for way in ways:
            print(f"[{len(rows) + 1}/{n}] cap {cap / GiB:.2f} GiB: {way} ...", file=sys.stderr, flush=True)
            row = run_way(model, way, cap, a, companion)
            rows.append(row)
            said = row.get("error") or "%.3f tok/s decode, %.2f prompt" % (row["decode_tok_s"], row["prompt_tok_s"])
            print(f"      {said} ({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    layers = f", {a.layers} of {real_size.SHAPES[a.shape].n_layer} layers" if a.layers else ""
    print(f"\n{a.shape} shape{layers}, random weights: {model.name} {size / GiB:.2f} GiB; disk {disk_bps / 1e6:.0f} MB/s "
          f"(O_DIRECT, the best of depths 8 and 32); {a.threads} threads; prompt {a.prompt_tokens} tokens, decode {a.tokens} "
          f"(+{a.warmup} untimed), each way in a fresh process in its own memory cgroup ({rows[0]['cgroup']}), page cache "
          "dropped first\n")
    print(table(rows, disk_bps, model, a.shape, a.layers))
    if a.json:
        a.json.write_text(json.dumps({"shape": a.shape, "layers": a.layers, "disk_bps": disk_bps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
