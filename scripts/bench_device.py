#!/usr/bin/env python3
"""Where a decoded token's time goes on the device path, side by side in one process.

Every layer and expert on the device (-ngl 99, a GPU or ggml's RPC backend), the model resident
(residency none). Three contexts on the same library and device, measured in turns (rounds rotate
the order; medians over rounds):
  stock   llama_cpp.Llama: no moecache
  device  pymoecache.Llama, top-k: llama.cpp's selection stays on the device, one read per token
  op      pymoecache.Llama, top-k through our CPU routing op (what recording the router keeps): a
          CPU split per MoE layer, the path every routing that changes the selection takes
Two timings each: `llama_decode` alone (the library: graph, splits, our hooks) and `eval`
(the Python layer on top: llama-cpp-python's and ours), in ms per token, each token ended by
llama_synchronize as llama-bench ends a generated one, and the graph splits of a decoded token.

    python scripts/bench_device.py --model models/tiny-shakespeare-qwen2moe-60x4.gguf --rpc local
    python scripts/bench_device.py --model bench.gguf --gpu-layers 99 --tokens 200 --rounds 5   # a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", required=True, help="a MoE GGUF")
    ap.add_argument("--gpu-layers", type=int, default=99, help="layers on the device (default 99: all)")
    ap.add_argument("--rpc", default=None, help="HOST:PORT of a ggml RPC server, or 'local' to start one here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per timing (default 128)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each times every context (default 5)")
    args = ap.parse_args()

    import pymoecache  # (first: it loads our libllama, which llama_cpp then uses)
    import llama_cpp
    from pymoecache import CacheConfig, rpc
    from pymoecache import _moecache_cpp as C

    servers = contextlib.ExitStack()
    kw = dict(n_ctx=64 + args.tokens * 2 + 16, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
              n_gpu_layers=args.gpu_layers)
    if args.rpc:
        endpoint = servers.enter_context(rpc.LocalServer(threads=args.threads)).endpoint if args.rpc == "local" else args.rpc
        if args.rpc != "local":
            rpc.add_server(endpoint)
    n_all = 2 * args.tokens + 8
    contexts = {
        "stock": llama_cpp.Llama(args.model, **kw),
        "device": pymoecache.Llama(args.model, cache=CacheConfig(size=1.0, residency="none"), routing="lru", **kw),
        "op": pymoecache.Llama(args.model, cache=CacheConfig(size=1.0, residency="none", router_record=n_all * 4),
                               routing="lru", **kw),
    }
    prompt = list(range(100, 108))
    decodes = [200 + (i * 7) % 500 for i in range(args.tokens)]

    def raw(llm) -> float:
        llm.reset()
        llm.eval(prompt)
        batch = llm._batch
        t0 = time.perf_counter()
        for i, t in enumerate(decodes):
            batch.set_batch([t], n_past=len(prompt) + i, logits_all=False)
            llm._ctx.decode(batch)
            llama_cpp.llama_synchronize(llm._ctx.ctx)  # (a token is decoded when its logits can be read)
        return (time.perf_counter() - t0) / len(decodes) * 1e3

    def evals(llm) -> float:
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for t in decodes:
            llm.eval([t])
            llama_cpp.llama_synchronize(llm._ctx.ctx)
        return (time.perf_counter() - t0) / len(decodes) * 1e3

    times = {(name, how): [] for name in contexts for how in ("decode", "eval")}
    names = list(contexts)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            times[(name, "decode")].append(raw(contexts[name]))
            times[(name, "eval")].append(evals(contexts[name]))
    splits = {name: C.moecache_context_graph_splits(llm._ctx.ctx) for name, llm in contexts.items()}
    reads = {name: (llm.moecache.residency_stats().device_reads_per_token if name != "stock" else 0.0)
             for name, llm in contexts.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{Path(args.model).name}: -ngl {args.gpu_layers}" + (f" over RPC {args.rpc}" if args.rpc else "")
          + f", {args.threads} thread(s), {args.tokens} decoded tokens, medians of {args.rounds} rounds")
    print("\n| context | llama_decode ms/token | of stock | eval ms/token | of stock | graph splits/token | device reads/token |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        print(f"| {name} | {med[(name, 'decode')]:.4f} | {med[('stock', 'decode')] / med[(name, 'decode')]:.2f}x | "
              f"{med[(name, 'eval')]:.4f} | {med[('stock', 'eval')] / med[(name, 'eval')]:.2f}x | {splits[name]} | "
              f"{reads[name]:.1f} |")
    for llm in contexts.values():
        llm.close()
    servers.close()


if __name__ == "__main__":
    sys.exit(main())
