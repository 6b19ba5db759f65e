#!/usr/bin/env python3
"""The seeds' scenario, in counters: every expert in host memory, the device holding a share of
them, and how many of a decoded token's expert selections the device computes.

Ours: `-ngl 99`, the cache holding every expert (residency stream), a VRAM tier of
``--share`` of each layer's experts, the default routing (a preset resolved for the tier's share:
it prefers the experts in device memory) and top-k + LRU. llama.cpp's static split at the same
device bytes: `--n-cpu-moe` keeps the experts of all but round(share x L) MoE layers in host
memory, so the device computes the selections of those layers only, whatever the routing: a share
of (L - n_cpu_moe) / L of every token's selections, counted from the layer count (deterministic).
Perplexity with `--ppl-chunks` of both routings: the ppl protocol of docs/method.md (the held-out
tenth of Tiny Shakespeare, chunks of 256 tokens) with every token decoded alone.

    python scripts/bench_vram_share.py --model models/tiny-shakespeare-qwen2moe-60x4.gguf --rpc local
    python scripts/bench_vram_share.py --model MODEL --speed --reps 3     # also decode tok/s against stock
    python scripts/bench_vram_share.py --model MODEL --speed --link-mbps 117   # the server across 1 Gbit Ethernet
    python scripts/bench_vram_share.py --model MODEL --routings default,lru,prior:0.3:j=1 --ppl-chunks 20

--host-share H with --exclusive: the host cache holds H of each layer's experts (not all of them) and
the rows compare the two tiers inclusive (the VRAM tier copies part of the host cache, so RAM and
VRAM together hold H) and exclusive (an expert in VRAM keeps no host slot: together H + share),
counting the experts read from the file per decoded token after --warmup decoded tokens (with a
warm-up, tokens are decoded in windows of the trained context, the KV cache emptied between them).

    python scripts/bench_vram_share.py --model MODEL --host-share 0.75 --exclusive --warmup 256

--lowbit COMPANION (`pymoecache lowbit MODEL --type Q8_0`): our rows hold the companion's copies in
both tiers (lowbit-cache), so the same device bytes hold more experts (the placement says how many,
the "experts' device MiB" column what they take), and
a row of top-k at full precision (no companion) is added: "vs top-k" compares each row's perplexity
with the top-k row of the same tiers, "vs full top-k" with that one. --vram-fill copy makes every
counter deterministic (auto decides each copy from measured times).

    python scripts/bench_vram_share.py --model MODEL --lowbit MODEL.lowbit-Q8_0.gguf --vram-fill copy --ppl-chunks 20

--device-fit: the local server reports as its memory what the --share's tier needs beside the dense part,
the KV cache and llama.cpp's 1 GiB margin (`rpc-server --mem`), and a row runs `-ngl 99` with nothing
else: the tier the device fit gives by itself (Llama, residency auto), beside the rows asked for explicitly.
With --host-share below 1 that row gives the cache's size too (a machine whose RAM holds fewer than every
expert: the fit makes the tiers exclusive), and a row runs the same without a tier (what it did before).

    python scripts/bench_vram_share.py --model MODEL --device-fit --ppl-chunks 20
    python scripts/bench_vram_share.py --model MODEL --device-fit --host-share 0.5 --exclusive --warmup 256
    python scripts/bench_vram_share.py --model MODEL --device-fit --host-share 0.5 --speed --storage-mbps 25

--count-rpc (with --rpc local): each row's ggml RPC commands per decoded token, counted by a proxy in
front of the server (scripts/bench_device.py's): reads of device tensors (GET_TENSOR, each a round trip
the scheduler waits for), writes (SET_TENSOR: graph inputs, what the CPU's splits send back, copies
up) and graphs computed (GRAPH_COMPUTE: the device's splits), stock `--n-cpu-moe` beside ours.

    python scripts/bench_vram_share.py --model MODEL --count-rpc

--speed: decode tok/s of each row, the same teacher-forced tokens timed one by one (each ended by
llama_synchronize, as llama-bench ends one), medians of --reps passes, against stock llama.cpp
(llama_cpp.Llama on the same library and server) with the `--n-cpu-moe` placement: a tensor buffer
override keeps the experts of the first n_cpu_moe layers in CPU memory, as llama-cli's flag does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rpc", default="local",
                    help="HOST:PORT of a ggml RPC server, 'local' (default: one on this machine's CPU) or 'none' (this "
                         "machine's own GPU)")
    ap.add_argument("--share", type=float, default=0.25, help="share of each layer's experts in device memory")
    ap.add_argument("--tokens", type=int, default=256, help="decoded tokens for the counters (default 256)")
    ap.add_argument("--ppl-chunks", type=int, default=0, help="also perplexity over this many chunks of 128 tokens")
    ap.add_argument("--text", help="the text decoded (default: the held-out tenth of Tiny Shakespeare)")
    ap.add_argument("--vram-fill", choices=["auto", "copy", "cpu"], default="auto",
                    help="CacheConfig.vram_fill: what a selection outside device memory does (default auto)")
    ap.add_argument("--unified", choices=["auto", "on", "off"], default="auto",
                    help="CacheConfig.unified; on with --host-share 1: the direct tier, each token's layers on the "
                         "device alone, the misses read over the bus (a device that wraps host memory; not RPC)")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--speed", action="store_true", help="also decode tok/s of each row and of stock llama.cpp")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per row with --speed (default 3)")
    ap.add_argument("--prompt", type=int, default=0, metavar="N",
                    help="with --speed: also prompt tok/s of an N-token prompt (e.g. 512), stock beside ours")
    ap.add_argument("--threads", type=int, default=1, help="client threads (default 1)")
    ap.add_argument("--routings", default="default,lru",
                    help="comma-separated routings of our rows (default: default,lru; 'default' = none given, the "
                         "preset resolved for the tier; the first 'lru' row is the perplexity baseline)")
    ap.add_argument("--host-share", type=float, default=1.0,
                    help="share of each layer's experts the host cache holds (default 1: every expert in RAM)")
    ap.add_argument("--exclusive", action="store_true",
                    help="rows with the tiers exclusive (vram_exclusive) beside inclusive ones at the same sizes")
    ap.add_argument("--warmup", type=int, default=0,
                    help="decoded tokens before the counted ones (default 0: the tier fills while counted)")
    ap.add_argument("--count-rpc", action="store_true",
                    help="also each row's RPC commands per decoded token (reads, writes, graphs), through a counting "
                         "proxy in front of the local server")
    ap.add_argument("--link-mbps", type=float, default=0.0,
                    help="with --rpc local: the server behind a link of this many MB/s from this process (a GPU "
                         "machine across a network: 1 Gbit Ethernet is about 117)")
    ap.add_argument("--timeline", action="store_true",
                    help="also where a decoded token's time goes in each of our rows (the library's timeline)")
    ap.add_argument("--device-fit", action="store_true",
                    help="the local server reports as its memory llama.cpp's 1 GiB margin, the dense part, the KV "
                         "cache and the device bytes of the --share (every row runs against it), and a row runs "
                         "`-ngl 99` with nothing else: the tier the device fit gives, against the explicit rows")
    ap.add_argument("--storage-mbps", type=float, default=None, metavar="MBPS",
                    help="this process's reads from the model's disk throttled to MBPS MB/s (root: a cgroup, "
                         "scripts/storage.py): where a model larger than RAM reads the experts it does not hold "
                         "(our reads are direct I/O, past the page cache)")
    ap.add_argument("--lowbit", metavar="COMPANION",
                    help="a low-bit companion of MODEL: our rows hold its copies (miss lowbit-cache), plus a top-k row at "
                         "full precision")
    args = ap.parse_args()

    import pymoecache
    from pymoecache import CacheConfig, evaluate, rpc

    proxied = args.count_rpc or args.link_mbps > 0
    if proxied and args.rpc != "local":
        ap.error("--count-rpc and --link-mbps need --rpc local")
    if args.device_fit and args.rpc not in ("local", "none"):
        ap.error("--device-fit needs --rpc local (a server reporting the device bytes) or none (a GPU of this "
                 "build, reporting its own free memory)")
    info = pymoecache.model_info(args.model)
    n_vram = max(1, round(args.share * info.n_expert))
    mem = None
    if args.device_fit and args.rpc == "local":  # the server's memory: margin, dense part, KV, n_vram experts + half
        from pymoecache.plan import DEVICE_MARGIN, _kv_bytes

        one = info.expert_bytes * info.n_moe_layer
        mem = DEVICE_MARGIN + info.non_expert_bytes + _kv_bytes(info, 512) + int((n_vram + 0.5) * one)
    servers = contextlib.ExitStack()
    endpoint = servers.enter_context(rpc.LocalServer(threads=1, register=not proxied, mem=mem)).endpoint \
        if args.rpc == "local" else args.rpc
    if args.storage_mbps is not None:  # (after the server started: it reads no model)
        from storage import ReadThrottle

        throttle = servers.enter_context(ReadThrottle(args.model, args.storage_mbps))
        throttle.join()
        servers.callback(throttle.leave)
    counter = None
    if proxied:
        from bench_device import CommandCounter

        link = CommandCounter(endpoint, mbps=args.link_mbps)
        endpoint = link.endpoint
        counter = link if args.count_rpc else None
    device = {} if args.rpc == "none" else {"rpc_servers": endpoint}
    n_layers = info.n_moe_layer
    on_device = round(args.share * n_layers)
    rows = [{"placement": f"--n-cpu-moe {n_layers - on_device} (stock llama.cpp)", "routing": "any",
             "device_share": on_device / n_layers, "vram_experts_per_layer": info.n_expert,
             "vram_bytes": on_device * info.n_expert * info.expert_bytes}]
    if args.text:
        text = evaluate.load_text(args.text)
    else:
        from train_tiny_moe import split_text

        text = split_text()[1]
    if args.speed:
        llm = stock_llama(args.model, n_layers - on_device, n_ctx=max(512, args.prompt + 32), verbose=False, n_threads=args.threads,
                          n_threads_batch=args.threads, **device)
        rows[0]["tok_s"] = decode_tok_s(llm, evaluate.tokenize_text(llm, text), args)
        if args.prompt:
            rows[0]["prompt_tok_s"] = prompt_tok_s(llm, evaluate.tokenize_text(llm, text), args)
        llm.close()
    if counter is not None:
        llm = stock_llama(args.model, n_layers - on_device, n_ctx=max(512, args.prompt + 32), verbose=False, n_threads=args.threads,
                          n_threads_batch=args.threads, **device)
        rows[0]["rpc"] = count_commands(llm, evaluate.tokenize_text(llm, text), counter)
        llm.close()
    n_host = min(info.n_expert, max(1, round(args.host_share * info.n_expert)))
    routings = [None if r.strip() == "default" else r.strip() for r in args.routings.split(",") if r.strip()]
    if "lru" not in routings:
        ap.error("--routings needs lru (the top-k row perplexities are compared with)")
    runs = [(r, x, args.lowbit) for x in ([False, True] if args.exclusive else [False]) for r in routings]
    if args.lowbit:  # the baseline at full precision: top-k, no companion
        runs.append(("lru", False, None))
    if args.device_fit:  # -ngl 99 and nothing else: what the device fit makes of the server's memory
        runs.append(("fit", False, None))
        if n_host < info.n_expert:  # and what -ngl 99 with that cache did before it: no tier, the experts streamed
            runs.append(("no-tier", False, None))
    for routing, exclusive, lowbit in runs:
        miss = dict(miss="lowbit-cache", lowbit=lowbit) if lowbit else dict(miss="full")
        cache = CacheConfig(size=n_host, residency="stream", vram_size=n_vram, prefetch="off", vram_fill=args.vram_fill,
                            vram_exclusive=exclusive, unified=args.unified, **miss)
        fit, notier = routing == "fit", routing == "no-tier"
        if notier:
            cache, routing = CacheConfig(size=n_host, residency="stream", **miss), None  # (prefetch as it was: auto)
        # (the fit row: -ngl 99 alone, or with the host cache's size where it holds fewer than every expert, as
        # --cache-size auto would on a machine whose RAM is smaller than the model)
        asked = (dict(cache=n_host) if n_host < info.n_expert else {}) if fit else dict(cache=cache, routing=routing)
        llm = pymoecache.Llama(args.model, **asked, n_gpu_layers=99,
                               n_ctx=max(512, args.prompt + 32), verbose=False, **device, logits_all=bool(args.ppl_chunks),
                               n_threads=args.threads, n_threads_batch=args.threads)
        routing = None if fit else routing
        used = llm.moecache.routing.spec()
        tokens = evaluate.tokenize_text(llm, text)
        speed = decode_tok_s(llm, tokens, args) if args.speed else None
        commands = count_commands(llm, tokens, counter) if counter is not None else None
        times = layer_times(llm, tokens) if args.timeline else None
        if args.warmup:  # warm-up and counted tokens in windows of the model's trained context (KV reset between)
            window = max(32, (info.n_ctx_train or 512) - 16)
            decode_windows(llm, tokens[:args.warmup], window)
            llm.reset_moe_stats()
            decode_windows(llm, tokens[args.warmup:args.warmup + args.tokens], window)
        else:
            llm.reset()
            llm.eval(tokens[:16])
            llm.reset_moe_stats()
            for t in tokens[16:16 + args.tokens]:
                llm.eval([t])
        st = llm.moe_stats()
        rs = st.residency
        n = rs.vram_hits + rs.vram_from_ram + rs.vram_from_file
        held = int(st.capacity_per_layer[0])
        ram = ("every expert" if held >= info.n_expert else f"{held}/{info.n_expert} per layer") + " in RAM"
        alone = "-ngl 99" + (f" --cache-size {n_host}" if n_host < info.n_expert else "") + " alone"
        row = {"placement": (f"ours, {alone} (the device fit): " if fit else
                             "ours, no tier (-ngl 99 before the device fit): " if notier else "ours: ")
                            + f"{ram}, {rs.vram_slots}/{info.n_expert} per layer in VRAM"
                            + (f" ({Path(lowbit).name}'s copies)" if lowbit else ", full precision" if args.lowbit else "")
                            + (", exclusive" if rs.vram_exclusive_layers else ", inclusive" if args.exclusive and rs.vram_slots else "")
                            + (", copied up from pinned memory" if rs.vram_pinned_bytes else "")
                            + (f", the direct tier's trial chose {rs.direct_choice} ({rs.direct_ms:.2f} against "
                               f"{rs.round_trip_ms:.2f} ms/token)" if rs.direct_choice else ""),
               "routing": "default: " + used if routing is None else used, "device_share": rs.vram_hits / max(1, n),
               "vram_experts_per_layer": rs.vram_slots, "vram_bytes": rs.vram_bytes,
               "full_precision": not lowbit, "copies_up_per_token": rs.vram_copies / max(1, rs.decode_tokens),
               "on_cpu_per_token": rs.vram_cpu / max(1, rs.decode_tokens),
               "reads_per_token": rs.decode_loads / max(1, rs.decode_tokens) / max(1, len(st.moe_layers)),
               "copies_down_per_token": rs.vram_copies_down / max(1, rs.decode_tokens),
               "copy_ms_per_token": rs.vram_t_copy_ms / max(1, rs.decode_tokens),
               "route_ms_per_token": rs.t_route_ms_per_token, "pinned_bytes": rs.vram_pinned_bytes}
        if speed is not None:
            row["tok_s"] = speed
            if args.prompt:
                row["prompt_tok_s"] = prompt_tok_s(llm, tokens, args)
        if commands is not None:
            row["rpc"] = commands
        if times:
            row["times"] = times
        if args.ppl_chunks:
            llm.moecache.clear()
            res = evaluate.perplexity(llm, tokens, 256, limit_chunks=args.ppl_chunks, decode=True, progress=False)
            row["ppl"] = res.ppl
        rows.append(row)
        llm.close()
    servers.close()
    base = next(r for r in rows if r["routing"] == "lru")  # (top-k, the tiers as the first ours row has them)
    full = next((r for r in rows[1:] if r["routing"] == "lru" and r["full_precision"]), None) if args.lowbit else None
    print(f"{Path(args.model).name}: {n_layers} MoE layers, {info.n_expert} experts top-{info.n_expert_used}; device memory "
          f"for {args.share:.0%} of the experts (vram_fill {args.vram_fill}); {args.tokens} decoded tokens of "
          f"{Path(args.text).name if args.text else 'the held-out tenth of Tiny Shakespeare'}"
          + (f", counted after {args.warmup} decoded ones" if args.warmup else "")
          + (f"; the RPC server behind a {args.link_mbps:g} MB/s link" if args.link_mbps else "")
          + (f"; reads from the model's disk at most {args.storage_mbps:g} MB/s" if args.storage_mbps else ""))
    speed = "tok_s" in rows[0]
    prompt = "prompt_tok_s" in rows[0]
    cmds = "rpc" in rows[0]
    print("\n| placement | routing | experts' device MiB | selections computed on the device | vs --n-cpu-moe "
          "| expert reads per token and layer | ppl | vs top-k |" + (" vs full top-k |" if full else "")
          + " copies up / down per token | copying ms/token | on the CPU per token | routing ms/token |"
          + (" decode tok/s | vs stock --n-cpu-moe |" if speed else "")
          + (f" prompt tok/s ({args.prompt} tokens) | vs stock |" if prompt else "")
          + (" RPC reads / writes / graphs per token | KiB sent per token |" if cmds else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if full else "") + "---|---|---|---|" + ("---|---|" if speed else "")
          + ("---|---|" if prompt else "") + ("---|---|" if cmds else ""))

    def vs(r, b):
        return f"{100 * (r['ppl'] / b['ppl'] - 1):+.2f}%" if b and "ppl" in r and "ppl" in b else "-"

    def share_vs(r):  # (a share so small that --n-cpu-moe puts no layer's experts on the device: none to compare)
        return f"{r['device_share'] / rows[0]['device_share']:.2f}x" if rows[0]["device_share"] else "-"

    for r in rows:
        own = full if full and r.get("full_precision") else base  # (top-k on the same tiers)
        ppl = f"{r['ppl']:.4f}" if "ppl" in r else "-"
        reads = f"{r['reads_per_token']:.3f}" if "reads_per_token" in r else "-"
        print(f"| {r['placement']} | {r['routing']} | {r['vram_bytes'] / 2**20:.2f} | {100 * r['device_share']:.1f}% | "
              f"{share_vs(r)} | {reads} | {ppl} | "
              f"{vs(r, own)} |"
              + (f" {vs(r, full)} |" if full else "")
              + (f" {r['copies_up_per_token']:.2f} / {r['copies_down_per_token']:.2f} | {r['copy_ms_per_token']:.3f} |"
                 f" {r['on_cpu_per_token']:.2f} | {r['route_ms_per_token']:.3f} |" if "copy_ms_per_token" in r else
                 " - | - | - | - |")
              + (f" {r['tok_s']:.1f} | {r['tok_s'] / rows[0]['tok_s']:.2f}x |" if speed else "")
              + (f" {r['prompt_tok_s']:.1f} | {r['prompt_tok_s'] / rows[0]['prompt_tok_s']:.2f}x |" if prompt else "")
              + (" {GET_TENSOR:.2f} / {SET_TENSOR:.2f} / {GRAPH_COMPUTE:.2f} | {KIB:.1f} |".format(**r["rpc"]) if cmds else ""))
    timed = [r for r in rows if "times" in r]
    if timed:
        print(f"\nwhere a decoded token's time goes (the timeline of 64 tokens, microseconds per token; "
              f"{timed[0]['times']['n_moe']} MoE layers):\n")
        print("| placement | routing | token period | routing ops | residency ops | between a layer's experts and the "
              "next layer's routing, each | the rest | copies up |")
        print("|---|---|---|---|---|---|---|---|")
        for r in timed:
            t = r["times"]
            print(f"| {r['placement']} | {r['routing']} | {t['period_us']:.0f} | {t['routing_us']:.0f} | "
                  f"{t['waits_us']:.0f} | {t['between_us']:.0f} | {t['rest_us']:.0f} | {t['copy_up_us']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def layer_times(llm, tokens, n: int = 64) -> dict:
    """Where a decoded token's time goes, from the timeline of n tokens (each ended by llama_synchronize):
    per token, the routing ops and the residency ops (waits, copies up sent) of its MoE layers, the time
    between one layer's residency op and the next layer's routing op (the CPU's expert matmuls, the write
    to the device, the device's matmuls, the next layer's attention on the device and the read back), and
    the rest of the token's period (the last layer's experts, the output, Python, the next token's first
    layer), in microseconds."""
    import numpy as np

    import llama_cpp

    from pymoecache.timeline import KIND

    llm.reset()
    llm.eval(tokens[:16])
    for t in tokens[16:32]:
        llm.eval([t])
    llm.start_timeline()
    for t in tokens[32:32 + n + 1]:
        llm.eval([t])
        llama_cpp.llama_synchronize(llm._ctx.ctx)
    ev = llm.timeline().events
    ev = ev[(ev["thread"] == 0) & (ev["n_tokens"] == 1) | (ev["kind"] == KIND["copy_up"])]

    def of(kind):
        e = ev[ev["kind"] == kind]
        return e[np.argsort(e["t_start_us"], kind="stable")]

    route, wait, up = of(KIND["route"]), of(KIND["wait"]), of(KIND["copy_up"])
    wait = wait[wait["expert"] == -1]
    n_moe = len(set(route["layer"].tolist()))
    n_tok = min(len(route), len(wait)) // max(1, n_moe) - 1  # (the last token: its period's end not seen)
    if n_moe == 0 or n_tok < 1:
        return {}
    r = route[:(n_tok + 1) * n_moe].reshape(n_tok + 1, n_moe)
    w = wait[:(n_tok + 1) * n_moe].reshape(n_tok + 1, n_moe)
    period = (r["t_start_us"][1:, 0] - r["t_start_us"][:-1, 0]).mean()
    routing = (r["t_end_us"] - r["t_start_us"])[:-1].sum(axis=1).mean()
    waits = (w["t_end_us"] - w["t_start_us"])[:-1].sum(axis=1).mean()
    between = (r["t_start_us"][:-1, 1:] - w["t_end_us"][:-1, :-1]).mean() if n_moe > 1 else 0.0
    copy = (up["t_end_us"] - up["t_start_us"]).sum() / n_tok if len(up) else 0.0
    return {"period_us": period, "routing_us": routing, "waits_us": waits, "between_us": between,
            "rest_us": period - routing - waits - between * (n_moe - 1), "copy_up_us": copy, "n_moe": n_moe}


def decode_windows(llm, tokens, window: int) -> None:
    """tokens decoded one by one in windows of `window`, each from an empty KV cache (the expert cache
    carries over): positions stay within the trained context however many tokens are decoded."""
    for i in range(0, len(tokens), window):
        llm.reset()
        for t in tokens[i:i + window]:
            llm.eval([t])


def decode_tok_s(llm, tokens, args) -> float:
    """Median over --reps passes of decode tok/s: a 16-token prompt, 16 untimed tokens, then --tokens timed
    one by one, each ended by llama_synchronize."""
    import statistics
    import time

    import llama_cpp

    speeds = []
    for _ in range(args.reps):
        llm.reset()
        llm.eval(tokens[:16])
        for t in tokens[16:32]:
            llm.eval([t])
        t0 = time.perf_counter()
        for t in tokens[32:32 + args.tokens]:
            llm.eval([t])
            llama_cpp.llama_synchronize(llm._ctx.ctx)
        speeds.append(min(args.tokens, len(tokens) - 32) / (time.perf_counter() - t0))
    return statistics.median(speeds)


def prompt_tok_s(llm, tokens, args) -> float:
    """Median over --reps passes of prompt tok/s: --prompt tokens evaluated at once from an empty context, ended
    by llama_synchronize."""
    import statistics
    import time

    import llama_cpp

    n = min(args.prompt, len(tokens))
    speeds = []
    for _ in range(args.reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens[:n])
        llama_cpp.llama_synchronize(llm._ctx.ctx)
        speeds.append(n / (time.perf_counter() - t0))
    return statistics.median(speeds)


def count_commands(llm, tokens, counter, n: int = 64) -> dict:
    """ggml RPC commands per decoded token, by kind: a 16-token prompt and 16 decoded tokens, then n
    decoded ones counted (CommandCounter.during)."""
    llm.reset()
    llm.eval(tokens[:16])
    for t in tokens[16:32]:
        llm.eval([t])

    def decode():
        for t in tokens[32:32 + n]:
            llm.eval([t])

    got = counter.during(llm._ctx.ctx, decode)
    per = {k: got.get(k, 0) / n for k in ("GET_TENSOR", "SET_TENSOR", "GRAPH_COMPUTE")}
    per["KIB"] = sum(v for k, v in got.items() if k.endswith(" bytes")) / n / 1024  # (what they carry)
    return per


def stock_llama(model, n_cpu_moe: int, **kw):
    """Stock llama.cpp (llama_cpp.Llama) with every layer offloaded but the experts of the first
    ``n_cpu_moe`` layers, which a tensor buffer override keeps in CPU memory (llama-cli's --n-cpu-moe:
    llama-cpp-python takes no overrides, so its model parameters get them here)."""
    import ctypes

    import llama_cpp

    import pymoecache
    from pymoecache.placement import buffer_overrides as _buffer_overrides, cpu_patterns as _cpu_patterns

    n_layer = pymoecache.model_info(model).n_layer
    overrides = _buffer_overrides(_cpu_patterns(n_cpu_moe, None, n_layer))  # (what pymoecache's n_cpu_moe makes)
    if "rpc_servers" in kw:  # (registered in the process: llama.cpp finds its device)
        from pymoecache import rpc

        rpc.add_server(kw.pop("rpc_servers"))
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def with_overrides():
        p = default_params()
        p.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        return p

    llama_cpp.llama_cpp.llama_model_default_params = with_overrides
    try:
        llm = llama_cpp.Llama(str(model), n_gpu_layers=99, **kw)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default_params
    llm._overrides = overrides  # (llama.cpp reads them at load only; kept alive with the model anyway)
    return llm


if __name__ == "__main__":
    sys.exit(main())
