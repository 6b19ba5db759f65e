#!/usr/bin/env python3
"""Where a decoded token's time goes on the device path, side by side in one process.

Every layer and expert on the device (-ngl 99, a GPU or ggml's RPC backend), the model resident
(residency none). Three contexts on the same library and device, measured in turns (rounds rotate
the order; medians over rounds):
  stock   llama_cpp.Llama: no moecache
  device  pymoecache.Llama, top-k: llama.cpp's selection stays on the device, one read per token
  default pymoecache.Llama with nothing chosen (a model that fits: every expert resident, the
          default preset, which is top-k where every expert is cached)
  prior   pymoecache.Llama, prior:0.5 counting a quarter cache: the prior as ggml ops on the device,
          its boosts uploaded and the token's rows read once per token
  op      pymoecache.Llama, top-k through our CPU routing op (what recording the router keeps): a
          CPU split per MoE layer, the path of a routing without device ops (max-rank, cumsum, ...)
  with --tier N, two more, every expert cached in RAM (streamed) and N per layer in a VRAM tier, top-k:
  tier    the tier with its round trip: the CPU routes each layer and computes the tier's misses
  direct  the direct tier (--unified on): routed on the device, the misses computed by the device from
          the host slots over the bus (a device that wraps host memory: Vulkan, Metal, CUDA with our patch)
Two timings each, in ms per token: `llama_decode` alone (the library: graph, splits, our hooks),
each token ended by llama_synchronize as llama-bench ends a generated one; and a generated token as
`generate` makes one, `eval` then `sample` (greedy, the sampler chain built once), the Python layers
on top included (llama-cpp-python's and ours); what pymoecache.Llama's eval and sample add to
llama-cpp-python's (tokens made alternately by the two, paired); and the graph splits of a decoded token.

    python scripts/bench_device.py --model models/tiny-shakespeare-qwen2moe-60x4.gguf --rpc local
    python scripts/bench_device.py --model bench.gguf --gpu-layers 99 --tokens 200 --rounds 5   # a GPU
    python scripts/bench_device.py --model models/tiny-shakespeare-qwen2moe-60x4.gguf --rpc local --count-rpc
    python scripts/bench_device.py --model models/tiny-shakespeare-qwen2moe-60x4.gguf --tier 15   # Vulkan / a GPU

--parallel N: instead, N sequences decoded together (pymoecache.BatchDecoder, a step of one token per
sequence), --tokens each, tok/s of stock llama.cpp's batch (its context made for N sequences), ours on the
device path (top-k, residency none: a staging row per sequence) and ours through the CPU routing op:

    python scripts/bench_device.py --model models/tiny-shakespeare-qwen2moe-60x4.gguf --rpc local --parallel 4

--count-rpc (with --rpc): no timing; every context talks to the server through a proxy on the
loopback that counts the commands ggml's RPC client sends (| cmd: 1 byte | size: 8 bytes | data |),
and the table gives the commands per decoded token, by kind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


RPC_COMMANDS = ["ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
                "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
                "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR"]
# (ggml-rpc.cpp's enum rpc_cmd, in its order)


class CommandCounter:
    """A TCP proxy in front of a ggml RPC server that counts the commands its clients send; with
    ``mbps``, a link of that many MB/s from the client to the server (each piece forwarded once the
    link would have carried it: a GPU machine across a network, on one machine); with ``cut_after``,
    a link that drops each connection once its client has sent that many bytes (a server lost mid-way)."""

    def __init__(self, target: str, mbps: float = 0.0, cut_after: int = 0):
        import socket
        import threading

        self.target = target
        self.mbps = mbps
        self.cut_after = cut_after
        self.counts: dict = {}
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.counts)

    def during(self, ctx, run) -> dict:
        """The commands by kind that run() sends through this proxy: each count taken after
        llama_synchronize(ctx) (ggml's RPC client sends from a queue, and a token's logits are read
        asynchronously until then)."""
        import llama_cpp

        llama_cpp.llama_synchronize(ctx)
        before = self.snapshot()
        run()
        llama_cpp.llama_synchronize(ctx)
        after = self.snapshot()
        return {k: after.get(k, 0) - before.get(k, 0) for k in after}

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            client, _ = self.listener.accept()
            host, _, port = self.target.rpartition(":")
            server = socket.create_connection((host, int(port)))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()

    def _pipe(self, src, dst, count: bool) -> None:
        buf = b""
        need = 9  # the header of the next command
        in_data = False
        sent = 0
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            sent += len(data) if count else 0
            if not data or (self.cut_after and sent > self.cut_after):
                # (shutdown, not only close: the other direction's thread is blocked reading)
                import socket

                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                        s.close()
                    except OSError:
                        pass
                return
            if not count:
                dst.sendall(data)
                continue
            if self.mbps > 0:
                import time

                time.sleep(len(data) / (self.mbps * 1e6))
            buf += data
            while len(buf) >= need:
                if not in_data:
                    cmd, size = buf[0], int.from_bytes(buf[1:9], "little")
                    name = RPC_COMMANDS[cmd] if cmd < len(RPC_COMMANDS) else f"cmd {cmd}"
                    with self.lock:  # (and the bytes each kind sends, under "<name> bytes")
                        self.counts[name] = self.counts.get(name, 0) + 1
                        self.counts[name + " bytes"] = self.counts.get(name + " bytes", 0) + size
                    buf, need, in_data = buf[9:], size, True
                else:
                    buf, need, in_data = buf[need:], 9, False
            dst.sendall(data)  # (after counting: a client that got its answer finds its command counted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", required=True, help="a MoE GGUF")
    ap.add_argument("--gpu-layers", type=int, default=99, help="layers on the device (default 99: all)")
    ap.add_argument("--rpc", default=None, help="HOST:PORT of a ggml RPC server, or 'local' to start one here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per timing (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each times every context (default 5)")
    ap.add_argument("--count-rpc", action="store_true",
                    help="with --rpc: count the RPC commands per decoded token (through a counting proxy) instead of timing")
    ap.add_argument("--tier", type=int, default=0, metavar="N",
                    help="also the VRAM tier of N experts per layer, with its round trip and direct (see above)")
    ap.add_argument("--json", help="also write each context's medians, graph splits and reads here")
    ap.add_argument("--parallel", type=int, default=0, metavar="N",
                    help="time N sequences decoded together (BatchDecoder) instead of one token at a time")
    args = ap.parse_args()
    if args.count_rpc and not args.rpc:
        ap.error("--count-rpc needs --rpc")

    import pymoecache  # (first: it loads our libllama, which llama_cpp then uses)
    import llama_cpp
    from pymoecache import CacheConfig, rpc
    from pymoecache import _moecache_cpp as C

    servers = contextlib.ExitStack()
    kw = dict(n_ctx=64 + args.tokens * 2 + 16, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
              n_gpu_layers=args.gpu_layers)
    counter = None
    if args.rpc:
        local = args.rpc == "local"
        endpoint = servers.enter_context(rpc.LocalServer(threads=args.threads, register=not args.count_rpc and local)
                                         ).endpoint if local else args.rpc
        if args.count_rpc:
            counter = CommandCounter(endpoint)
            endpoint = counter.endpoint
        if not local or args.count_rpc:
            rpc.add_server(endpoint)
    if args.parallel > 0:
        parallel(args, kw)
        servers.close()
        return
    n_all = 2 * args.tokens + 8
    contexts = {
        "stock": llama_cpp.Llama(args.model, **kw),
        "device": pymoecache.Llama(args.model, cache=CacheConfig(size=1.0, residency="none"), routing="lru", **kw),
        "default": pymoecache.Llama(args.model, **kw),  # what a user gets: the cache size and routing chosen
        "prior": pymoecache.Llama(args.model, cache=CacheConfig(size=0.25, residency="none"), routing="prior:0.5", **kw),
        "op": pymoecache.Llama(args.model, cache=CacheConfig(size=1.0, residency="none", router_record=n_all * 4),
                               routing="lru", **kw),
    }
    if args.tier:
        for name, unified in (("tier", "off"), ("direct", "on")):
            contexts[name] = pymoecache.Llama(args.model, cache=CacheConfig(size=1.0, residency="stream", prefetch="off",
                                                                            vram_size=args.tier, unified=unified),
                                              routing="lru", **kw)
    names = list(contexts)
    prompt = list(range(100, 108))
    decodes = [200 + (i * 7) % 500 for i in range(args.tokens)]

    def timed(llm, step, sync=True) -> float:  # ms per decoded token, each ended as llama-bench ends one
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for i, t in enumerate(decodes):
            step(llm, i, t)
            if sync:  # (a token is decoded when its logits can be read; a sampler has read them)
                llama_cpp.llama_synchronize(llm._ctx.ctx)
        return (time.perf_counter() - t0) / len(decodes) * 1e3

    def decode_only(llm, i, t):  # llama_decode alone: the library
        llm._batch.set_batch([t], n_past=len(prompt) + i, logits_all=False)
        llm._ctx.decode(llm._batch)

    def raw(llm) -> float:
        return timed(llm, decode_only)

    def generated(llm) -> float:  # eval + sample, as Llama.generate makes a token
        llm._sampler = llm._init_sampler(top_k=1)
        try:
            return timed(llm, lambda llm, i, t: (llm.eval([t]), llm.sample()), sync=False)
        finally:
            llm._sampler = None

    if counter is not None:
        per = {}
        for name, llm in contexts.items():
            llm.reset()
            llm.eval(prompt)

            def decode(llm=llm):
                for t in decodes:
                    llm.eval([t])
                    llama_cpp.llama_synchronize(llm._ctx.ctx)

            per[name] = {k: v / len(decodes) for k, v in counter.during(llm._ctx.ctx, decode).items()}
        kinds = sorted({k for d in per.values() for k, v in d.items() if v and not k.endswith(" bytes")})
        print(f"{Path(args.model).name}: -ngl {args.gpu_layers} over RPC, {args.tokens} decoded tokens: RPC commands "
              "per decoded token (eval, then llama_synchronize), and the bytes they carry")
        print("\n| context | all | " + " | ".join(kinds) + " | KiB sent |")
        print("|---|---|" + "---|" * len(kinds) + "---|")
        for name in names:
            sent = sum(v for k, v in per[name].items() if k.endswith(" bytes")) / 1024
            print(f"| {name} | {sum(per[name].get(k, 0) for k in kinds):.2f} | "
                  + " | ".join(f"{per[name].get(k, 0):.2f}" for k in kinds) + f" | {sent:.1f} |")
        for llm in contexts.values():
            llm.close()
        servers.close()
        return
    times = {(name, how): [] for name in contexts for how in ("decode", "eval")}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            times[(name, "decode")].append(raw(contexts[name]))
            times[(name, "eval")].append(generated(contexts[name]))
    splits = {name: C.moecache_context_graph_splits(llm._ctx.ctx) for name, llm in contexts.items()}
    reads = {name: (llm.moecache.residency_stats().device_reads_per_token if name != "stock" else 0.0)
             for name, llm in contexts.items()}
    med = {k: statistics.median(v) for k, v in times.items()}

    def ours_over_theirs(llm) -> float:
        """What pymoecache.Llama's eval and sample add per token to llama-cpp-python's (its checks and
        counting), in us: tokens made alternately by the two on the same context, each pair's difference,
        the median of the pairs (the two tokens of a pair cost the library the same)."""
        llm.reset()
        llm.eval(prompt)
        llm._sampler = llm._init_sampler(top_k=1)
        diffs = []
        try:
            for _ in range(args.rounds):
                for i in range(0, len(decodes) - 1, 2):
                    t0 = time.perf_counter()
                    llm.eval([decodes[i]])
                    llm.sample()
                    t1 = time.perf_counter()
                    llama_cpp.Llama.eval(llm, [decodes[i + 1]])
                    llama_cpp.Llama.sample(llm)
                    diffs.append(2 * t1 - t0 - time.perf_counter())
                llm.reset()
                llm.eval(prompt)
        finally:
            llm._sampler = None
        return statistics.median(diffs) * 1e6

    python_us = {name: ours_over_theirs(llm) for name, llm in contexts.items() if name != "stock"}
    print(f"{Path(args.model).name}: -ngl {args.gpu_layers}" + (f" over RPC {args.rpc}" if args.rpc else "")
          + f", {args.threads} thread(s), {args.tokens} decoded tokens, medians of {args.rounds} rounds")
    print("\n| context | llama_decode ms/token | of stock | eval + sample ms/token | of stock | ours over "
          "llama-cpp-python's us/token | graph splits/token | device reads/token |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        print(f"| {name} | {med[(name, 'decode')]:.4f} | {med[('stock', 'decode')] / med[(name, 'decode')]:.2f}x | "
              f"{med[(name, 'eval')]:.4f} | {med[('stock', 'eval')] / med[(name, 'eval')]:.2f}x | "
              + (f"{python_us[name]:.1f}" if name in python_us else "-") + f" | {splits[name]} | {reads[name]:.2f} |")
    print("\nours over llama-cpp-python's: what pymoecache.Llama's eval and sample add to llama-cpp-python's per token "
          "(its checks and counting), tokens made alternately by the two on the same context, median of the pairs")
    if args.json:
        Path(args.json).write_text(json.dumps({name: dict(decode_ms=med[(name, "decode")], eval_ms=med[(name, "eval")],
                                                          splits=splits[name], reads=reads[name]) for name in names},
                                              indent=1) + "\n")
    for llm in contexts.values():
        llm.close()
    servers.close()


def parallel(args, kw) -> None:
    """--parallel N: tok/s of N sequences decoded together, stock / device path / CPU op, medians of rounds."""
    import pymoecache
    import llama_cpp
    from llama_cpp._internals import LlamaContext
    from pymoecache import BatchDecoder, CacheConfig

    n = args.parallel
    kw = dict(kw, n_ctx=n * (args.tokens + 16) + 64)
    stock = llama_cpp.Llama(args.model, **kw)
    stock.context_params.n_seq_max, stock.context_params.kv_unified = n, True
    stock._ctx = LlamaContext(model=stock._model, params=stock.context_params, verbose=False)
    contexts = {
        "stock": stock,
        "device": pymoecache.Llama(args.model, cache=CacheConfig(size=1.0, residency="none"), routing="lru",
                                   n_seq_max=n, **kw),
        "op": pymoecache.Llama(args.model, cache=CacheConfig(size=1.0, residency="none", router_record=1 << 20),
                               routing="lru", n_seq_max=n, **kw),
    }
    prompts = [[1] + [100 + 37 * i + j for j in range(4)] for i in range(n)]
    speeds = {name: [] for name in contexts}
    for r in range(args.rounds):
        for name in list(contexts)[r % 3:] + list(contexts)[: r % 3]:
            dec = BatchDecoder(contexts[name])
            seqs = [dec.add(p, max_tokens=args.tokens) for p in prompts]
            t0 = time.perf_counter()
            dec.run()
            speeds[name].append(sum(len(s.tokens) for s in seqs) / (time.perf_counter() - t0))
            dec.close()
    med = {k: statistics.median(v) for k, v in speeds.items()}
    print(f"{Path(args.model).name}: -ngl {args.gpu_layers}" + (f" over RPC {args.rpc}" if args.rpc else "")
          + f", {n} sequences together, {args.tokens} tokens each (prompts included in the time), medians of "
          f"{args.rounds} rounds")
    print("\n| context | tok/s | of stock | reads of the device per step |")
    print("|---|---|---|---|")
    for name, llm in contexts.items():  # (the reads: every round's decode steps, prompts' included)
        rs = llm.moe_stats().residency if name != "stock" else None
        reads = f"{rs.device_reads / max(1, rs.decode_steps):.3f}" if rs else "-"
        print(f"| {name} | {med[name]:.1f} | {med[name] / med['stock']:.2f}x | {reads} |")
    for llm in contexts.values():
        llm.close()


if __name__ == "__main__":
    sys.exit(main())
