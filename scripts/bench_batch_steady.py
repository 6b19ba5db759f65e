#!/usr/bin/env python3
"""Batching in steady state: one warm `pymoecache serve -np N` per routing, the same N requests one after another
and then all at once, several times over, in the same process (bench_parallel.py starts a cold server per way).

A server is started (page cache of the model dropped; under --cap-share S in a memory cgroup of the file's size / S,
the page cache charged to it, as on a small machine), warmed by the N requests one after another --warm times
(not counted: its cache then holds what these requests use), then --reps rounds of [one after another, together] (the
order alternating). Reported per way: generated tok/s (median of the rounds) and the ratio against one after
another, the decode steps, reads per generated token, and what a step's tokens share: the distinct experts of each
step and MoE layer against their selections (union / selections: 1.00 = nothing shared, 1/N = all alike), from the
server's counters decode_union and decode_selections.

    python scripts/bench_batch_steady.py --model trained --np 4,16 --routings default,lru,no-share
    python scripts/bench_batch_steady.py --model models/_bench/real-qwen3-30b-a3b.gguf --cap-share 3 --tokens 16
    python scripts/bench_batch_steady.py --np 4 --routings lru --rpc local --serve-args "-ngl 99 --vram-size 8"

--rpc local: the GPU layers on an RPC server of this machine (its CPU as the device: counts and texts, not a
GPU's speed); "vram hits" is the share of the decoded selections computed from the VRAM tier's slots.

--model trained: the trained benchmark model (model C widened to 2048, bench_residency.py), Tiny Shakespeare
prompts; a path: that GGUF, WikiText-2 prompts. Routings: default (the server's defaults), lru (top-k + LRU),
no-share (the defaults with --no-batch-share), together and lru-together (default and lru with --batch-order
together: every running request in every step, as before serve's step order; serve's default measures that against
one request at a time in turns and takes the faster), or any --routing spec. "of them one ahead": the steps that
decoded one request while others waited (step_order.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "scripts")]

from bench_parallel import get, post, prompts_of, server  # noqa: E402
from bench_residency import trained_bench_model  # noqa: E402
from memcap import MemoryCap  # noqa: E402

ROUTING_ARGS = {"default": [], "lru": ["--routing", "lru"], "no-share": ["--no-batch-share"],
                "together": ["--batch-order", "together"], "lru-together": ["--routing", "lru", "--batch-order", "together"]}


@contextlib.contextmanager
def warm_server(model: Path, args: list, cap: int):
    """A fresh `pymoecache serve` (bench_parallel.server), in a memory cgroup of ``cap`` bytes where cap > 0."""
    with (MemoryCap(cap) if cap else contextlib.nullcontext()) as c:
        with server(model, args, None, cap=c, wait_s=900) as base:
            yield base, c


def run_way(base: str, prompts: list, tokens: int, together: bool) -> dict:
    """The prompts through the running server, at once or one after another; its counters' change."""
    before = get(base + "/moecache/stats")
    out = [None] * len(prompts)

    def ask(i):
        out[i] = post(base + "/v1/completions", {"prompt": prompts[i], "max_tokens": tokens, "temperature": 0})

    t0 = time.perf_counter()
    if together:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(prompts)):
            ask(i)
    wall = time.perf_counter() - t0
    after = get(base + "/moecache/stats")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("decode_steps", "decode_tokens", "decode_loads",
                                                         "decode_selections", "decode_union", "vram_hits")}
    d["alone_steps"] = (after.get("batch_order", {}).get("alone_steps", 0)
                        - before.get("batch_order", {}).get("alone_steps", 0))  # (steps one ahead: step_order.py)
    n = sum(o["usage"]["completion_tokens"] for o in out)
    return dict(tok_s=n / wall, wall=wall, tokens=n, steps=d["decode_steps"],
                reads_per_token=d["decode_loads"] / d["decode_tokens"] if d["decode_tokens"] else 0.0,
                union=d["decode_union"] / d["decode_selections"] if d["decode_selections"] else 0.0,
                alone_steps=d["alone_steps"], vram_hits=d["vram_hits"] / d["decode_selections"] if d["decode_selections"] else 0.0,
                texts=[o["choices"][0]["text"] for o in out])


def bench(model: Path, routing: str, n: int, a, cap: int) -> list:
    prompts = prompts_of(model, n)
    args = ["-np", str(n), "-c", str(a.ctx * n), "--cache-size", a.cache_size, "-t", str(a.threads),
            *ROUTING_ARGS.get(routing, ["--routing", routing]), *a.extra]
    runs = {"one after another": [], "together": []}
    with warm_server(model, args, cap) as (base, c):
        t0 = time.monotonic()
        for _ in range(a.warm):  # warm: the cache now holds what these requests use
            run_way(base, prompts, a.tokens, False)
        print(f"  {routing} -np {n}: warmed in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        for rep in range(a.reps):
            for label in (("one after another", "together") if rep % 2 == 0 else ("together", "one after another")):
                r = run_way(base, prompts, a.tokens, label == "together")
                runs[label].append(r)
                print(f"  {routing} -np {n} {label}: {r['tok_s']:.2f} tok/s, union {r['union']:.3f}",
                      file=sys.stderr, flush=True)
        peak = c.peak() if c else None
        kills = c.oom_kills() if c else 0
    rows = []
    alone = statistics.median(r["tok_s"] for r in runs["one after another"])
    for label, rs in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in rs)
        rows.append(dict(model=model.name, routing=routing, np=n, way=label, tok_s=tok_s, x=tok_s / alone,
                         steps=int(statistics.median(r["steps"] for r in rs)),
                         alone_steps=int(statistics.median(r["alone_steps"] for r in rs)),
                         tokens=int(statistics.median(r["tokens"] for r in rs)),
                         reads_per_token=statistics.mean(r["reads_per_token"] for r in rs),
                         union=statistics.mean(r["union"] for r in rs), peak=peak, oom_kills=kills,
                         vram_hits=statistics.mean(r["vram_hits"] for r in rs),
                         tok_s_runs=[round(r["tok_s"], 3) for r in rs]))
    return rows


def table(rows: list, title: str) -> str:
    out = [title, "", "| routing | -np | way | tok/s | x | steps / tokens | of them one ahead | reads/tok | "
           "union / selections | vram hits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['routing']} | {r['np']} | {r['way']} | {r['tok_s']:.2f} | {r['x']:.2f}x | "
                   f"{r['steps']} / {r['tokens']} | {r['alone_steps']} | {r['reads_per_token']:.2f} | {r['union']:.3f} | "
                   f"{r['vram_hits']:.1%} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="trained", help="trained, or a GGUF path (default %(default)s)")
    ap.add_argument("--np", default="4,16", help="requests at once, serve -np; comma-separated (default %(default)s)")
    ap.add_argument("--routings", default="default,lru,no-share",
                    help="default, lru, no-share, together, lru-together or --routing specs, comma-separated (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    ap.add_argument("--cache-size", default="0.25", help="serve --cache-size (default %(default)s; auto under a cap)")
    ap.add_argument("--cap-share", type=float, default=0.0,
                    help="a memory cgroup of the file's size / this (e.g. 3: a third; default: none)")
    ap.add_argument("-c", "--ctx", type=int, default=256, help="context per slot (serve -c is this x -np; default %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="serve -t (default %(default)s)")
    ap.add_argument("--warm", type=int, default=1, help="rounds one after another before the measured ones "
                                                         "(default %(default)s; under a cap the first rounds are slower)")
    ap.add_argument("--reps", type=int, default=3, help="rounds of both ways in the warm server (default %(default)s)")
    ap.add_argument("--serve-args", default="", help="more serve flags, e.g. \"-ngl 99 --vram-size 8\"")
    ap.add_argument("--rpc", help="the GPU layers' RPC server: HOST:PORT, or local (one started on this machine)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        a.extra = shlex.split(a.serve_args)
        if a.rpc:
            from pymoecache import rpc
            endpoint = stack.enter_context(rpc.LocalServer(register=False)).endpoint if a.rpc == "local" else a.rpc
            a.extra += ["--rpc", endpoint]
        return run(a)


def run(a) -> int:
    model = trained_bench_model() if a.model == "trained" else Path(a.model).resolve()
    cap = int(model.stat().st_size / a.cap_share) if a.cap_share else 0
    rows = []
    for n in (int(x) for x in a.np.split(",")):
        for routing in a.routings.split(","):
            rows.extend(bench(model, routing.strip(), n, a, cap))
            if a.json:
                Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    title = (f"{model.name}: warm server, {a.tokens} tokens a request, -t {a.threads}, --cache-size {a.cache_size}"
             + (f", memory cap {cap / 2**30:.2f} GiB (a {a.cap_share:g}th of the file)" if cap else "")
             + (f", serve {' '.join(a.extra)}" if a.extra else "") + f"; medians of {a.reps} rounds")
    print(table(rows, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
