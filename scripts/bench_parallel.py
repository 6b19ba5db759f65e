#!/usr/bin/env python3
"""Several requests at once against the same requests one after another, through `pymoecache serve -np N`.

Each way runs in a fresh server process (the page cache dropped before it starts, its reads throttled with
--storage-mbps), which gets the --np prompts (Tiny Shakespeare lines for the trained benchmark model,
WikiText-2 lines for the random one) as greedy completions of --tokens tokens: one after another, or all
at once (the server decodes its slots together). Reported: total generated tok/s (medians of --reps) and
their ratio, the mean and longest latency of a request, the server's decode steps and expert reads per
generated token. On the random model the together way runs with and without batch-aware routing
(--no-batch-share), beside a bound: max(the same batch's time with every expert in memory, the bytes it
read over the disk's speed).

--ppl-chunks C: the ppl protocol (docs/method.md: the held-out tenth of Tiny Shakespeare, chunks of 128
tokens, every token decoded) on the trained model at the same cache: the default routing with each chunk
decoded alone, and the chunks decoded --np at a time, with and without batch-aware routing.

    python scripts/bench_parallel.py --storage-mbps max,300 --reps 3 --ppl-chunks 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "scripts")]

from bench_residency import SHAKESPEARE, TEXT, bench_model, trained_bench_model  # noqa: E402
from storage import ReadThrottle, drop_page_cache  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def server(model: Path, args: list, mbps, cap=None, wait_s: float = 300):
    """A fresh `pymoecache serve` (page cache of the model dropped, reads throttled; ``cap``: a memory.MemoryCap
    entered, which the server joins): yields its URL."""
    drop_page_cache(model)
    port = free_port()
    log = open(f"/tmp/bench_parallel_{port}.log", "w")
    with ReadThrottle(model, mbps) as throttle:
        def join():
            throttle.join()
            if cap is not None:
                cap.join()

        proc = subprocess.Popen([sys.executable, "-m", "pymoecache", "serve", str(model), "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=join)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + wait_s
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server ended: {open(log.name).read()[-2000:]}")
                try:
                    get(base + "/health")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit("the server did not answer")
                    time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()


def prompts_of(model: Path, n: int) -> list:
    text = SHAKESPEARE if "trained" in model.name else TEXT
    lines = [ln.strip() for ln in text.read_text(encoding="utf-8").splitlines() if len(ln.strip()) > 30]
    step = len(lines) // (n + 1)
    return [lines[(i + 1) * step][:120] for i in range(n)]


def one_way(model: Path, args: list, prompts: list, tokens: int, together: bool, mbps) -> dict:
    """The prompts through a fresh server, at once or one after another."""
    with server(model, args, mbps) as base:
        post(base + "/v1/completions", {"prompt": "The", "max_tokens": 2, "temperature": 0})  # (graphs built)
        before = get(base + "/moecache/stats")
        out = [None] * len(prompts)
        lat = [0.0] * len(prompts)

        def ask(i):
            t = time.perf_counter()
            out[i] = post(base + "/v1/completions", {"prompt": prompts[i], "max_tokens": tokens, "temperature": 0})
            lat[i] = time.perf_counter() - t

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
    n = sum(o["usage"]["completion_tokens"] for o in out)
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    dtok = after.get("decode_tokens", 0) - before.get("decode_tokens", 0)
    loads = after.get("decode_loads", 0) - before.get("decode_loads", 0)
    read = (after.get("decode_bytes_read", 0) - before.get("decode_bytes_read", 0)
            + after.get("prompt_bytes_read", 0) - before.get("prompt_bytes_read", 0))
    return dict(tok_s=n / wall, wall=wall, tokens=n, lat=lat, steps=steps, reads_per_token=loads / dtok if dtok else 0.0,
                bytes_read=read, texts=[o["choices"][0]["text"] for o in out])


def table(rows: list) -> None:
    print(f"{'model':<9} {'disk':>6} {'way':<28} {'tok/s':>7} {'x':>6} {'latency s':>16} {'steps':>6} {'reads/tok':>9}")
    for r in rows:
        print(f"{r['model']:<9} {r['disk']:>6} {r['way']:<28} {r['tok_s']:>7.1f} {r['x']:>5.2f}x "
              f"{r['lat_mean']:>6.2f} (max {r['lat_max']:>5.2f}) {r['steps']:>6} {r['reads_per_token']:>9.2f}")


def speed(args) -> list:
    rows = []
    for name in args.model.split(","):
        model = trained_bench_model() if name == "trained" else bench_model(args.size_mb)
        prompts = prompts_of(model, args.np)
        tokens = args.tokens if name == "trained" else args.random_tokens
        base_args = ["-np", str(args.np), "--cache-size", str(args.cache_size), "-c", str(args.ctx)]
        ways = [("one after another", False, []), ("together", True, [])]
        if name == "random":
            ways.append(("together, no batch share", True, ["--no-batch-share"]))
        for disk in args.storage_mbps.split(","):
            mbps = None if disk == "max" else float(disk)
            runs = {w[0]: [] for w in ways}
            for rep in range(args.reps):
                order = ways if rep % 2 == 0 else ways[::-1]  # (no way always first)
                for label, together, extra in order:
                    runs[label].append(one_way(model, base_args + extra, prompts, tokens, together, mbps))
                    print(f"{name} {disk} {label}: {runs[label][-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
            base = None
            for label, together, extra in ways:
                rs = runs[label]
                tok_s = statistics.median(r["tok_s"] for r in rs)
                base = base or tok_s
                lat = [x for r in rs for x in r["lat"]]
                rows.append(dict(model=name, disk=disk, way=label, tok_s=tok_s, x=tok_s / base,
                                 lat_mean=statistics.mean(lat), lat_max=max(lat),
                                 steps=int(statistics.median(r["steps"] for r in rs)),
                                 reads_per_token=statistics.mean(r["reads_per_token"] for r in rs),
                                 bytes_read=statistics.median(r["bytes_read"] for r in rs),
                                 same_text=all(r["texts"] == runs[ways[0][0]][0]["texts"] for r in rs)))
            if name == "random":  # the bound: the batch with every expert in memory, and its bytes over the disk
                comp = [one_way(model, ["-np", str(args.np), "--cache-size", "1.0", "-c", str(args.ctx)], prompts,
                                tokens, True, None) for _ in range(args.reps)]
                t_comp = statistics.median(r["wall"] for r in comp)
                together = next(r for r in rows if r["model"] == name and r["disk"] == disk and r["way"] == "together")
                bw = (mbps * 1e6) if mbps else args.disk_mbps * 1e6
                t_io = together["bytes_read"] / bw
                n = statistics.median(r["tokens"] for r in comp)
                rows.append(dict(model=name, disk=disk, way=f"bound (compute {t_comp:.1f} s, io {t_io:.1f} s)",
                                 tok_s=n / max(t_comp, t_io), x=n / max(t_comp, t_io) / base, lat_mean=0.0,
                                 lat_max=0.0, steps=0, reads_per_token=0.0, bytes_read=0, same_text=True))
    return rows


def quality(args) -> None:
    from pymoecache import CacheConfig, Llama
    from pymoecache.config import parse_cache_size
    from pymoecache.evaluate import perplexity, perplexity_batched

    model = trained_bench_model()
    text = SHAKESPEARE.read_text(encoding="utf-8")
    text = text[int(len(text) * 0.9):]  # the held-out tenth
    ctx = 128
    print(f"{'trained, ppl protocol':<44} {'ppl':>9} {'vs alone':>9} {'reads/tok':>9} {'reads/step':>10}")
    alone = None
    for label, cfg, batched in (("default routing, each chunk alone", {}, False),
                                (f"default, {args.np} chunks together", {}, True),
                                (f"default, {args.np} together, --batch-prior 1", dict(batch_prior=1.0), True),
                                (f"default, {args.np} together, --no-batch-share", dict(batch_share=False), True)):
        llm = Llama(str(model), cache=CacheConfig(size=parse_cache_size(args.cache_size), **cfg), n_seq_max=args.np,
                    n_ctx=ctx * args.np, logits_all=True, verbose=False)
        toks = llm.tokenize(text.encode("utf-8"))[:ctx * args.ppl_chunks]
        llm.moecache.clear()
        res = (perplexity_batched(llm, toks, ctx, args.np, progress=False) if batched
               else perplexity(llm, toks, ctx, decode=True, progress=False))
        rs = res.stats.residency
        alone = alone or res.ppl
        print(f"{label:<44} {res.ppl:>9.4f} {100 * (res.ppl / alone - 1):>+8.2f}% {rs.decode_loads / rs.decode_tokens:>9.3f} "
              f"{rs.decode_loads / max(1, rs.decode_steps):>10.3f}")
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="trained,random", help="trained and/or random (default %(default)s)")
    ap.add_argument("--size-mb", type=float, default=2200, help="the random model's size (default %(default)s)")
    ap.add_argument("--np", type=int, default=4, help="requests at once, serve -np (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request, trained model (default %(default)s)")
    ap.add_argument("--random-tokens", type=int, default=32, help="tokens per request, random model (default %(default)s)")
    ap.add_argument("--cache-size", default="0.25", help="serve --cache-size (default %(default)s)")
    ap.add_argument("-c", "--ctx", type=int, default=1024, help="serve -c (default %(default)s)")
    ap.add_argument("--storage-mbps", default="max", help="max and/or MB/s limits, e.g. max,300 (default %(default)s)")
    ap.add_argument("--disk-mbps", type=float, default=1150, help="the disk's speed for the bound where unthrottled "
                                                                  "(default %(default)s, what info probes here)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions, fresh servers each (default %(default)s)")
    ap.add_argument("--ppl-chunks", type=int, default=0, help="also the ppl protocol over this many chunks (default 0)")
    ap.add_argument("--no-speed", action="store_true", help="only the ppl protocol")
    ap.add_argument("--json", help="write the speed rows here")
    args = ap.parse_args()
    if not args.no_speed:
        rows = speed(args)
        table(rows)
        if not all(r["same_text"] for r in rows if r["model"] == "trained" and "no batch" not in r["way"]):
            print("note: the default routing follows the cache, so the texts of the two ways differ", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.ppl_chunks:
        quality(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
