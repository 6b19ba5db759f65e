"""Evaluation commands of the ``pymoecache`` CLI: ``ppl``, ``trace`` and ``plot-timeline``.

    pymoecache ppl MODEL --text valid.txt --ctx 256 --sweep prior=0,0.25,0.5,1 --cache-size 0.5 0.25 --plot pareto.png
    pymoecache trace MODEL --text valid.txt --out trace.npz --tokens 256 --prior 0.5
    pymoecache plot-timeline trace.npz --layer 1 timeline.png

``cli.build_parser()`` calls :func:`add_commands`. Errors raise ``UserError`` (one line, exit 2).
Options shared with ``run`` (routing, cache) come from ``add_routing_options``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from .options import (UserError, add_device_options, add_model_argument, add_routing_options, cache_from_args,
                      device_kwargs, resolve_model, routing_from_args)


def _check_out_path(path) -> None:
    if path and not Path(path).resolve().parent.is_dir():
        raise UserError(f"cannot write {path}: the directory {Path(path).parent} does not exist")


def _routing_option_given(args) -> bool:
    return any(getattr(args, k) is not None for k in ("prior", "max_rank", "cumsum", "prune", "routing"))


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


def cmd_ppl(args) -> int:
    from ..config import parse_cache_size
    from ..evaluate import format_table, load_text, parse_sweep, sweep, write_rows

    if args.ctx < 2:
        raise UserError(f"--ctx must be >= 2, got {args.ctx}")
    if args.chunks is not None and args.chunks < 1:
        raise UserError(f"--chunks must be >= 1, got {args.chunks}")
    if args.scope != "all":
        raise UserError("ppl routes every token through the policy: --scope decode would leave the text unrouted")
    for path in (args.csv, args.json, args.plot):
        _check_out_path(path)
    if args.plot:
        from ..plots import require_matplotlib

        require_matplotlib()  # fail now, not after the sweep
    routings = parse_sweep(args.sweep, top_j=args.top_j) if args.sweep else []
    if _routing_option_given(args) or not args.sweep:
        routings.append(routing_from_args(args))
    sizes = [parse_cache_size(s) for s in args.cache_size]
    device = device_kwargs(args)
    load_text(args.text)  # a missing text file is reported before the model is loaded
    if args.prefetch == "auto":
        args.prefetch = "off"  # (auto reads ahead for streamed experts; ppl keeps them resident)
    if args.prefetch != "off" and not args.decode:
        raise UserError("--prefetch acts on decoded tokens only: add --decode (one token at a time, as generation)")
    misses = list(dict.fromkeys(_resolve_ppl_miss(m, args) for m in (args.miss or ["auto"])))
    if any(not 0.0 < p <= 1.0 for p in args.lowbit_max_p):
        raise UserError(f"--lowbit-max-p takes probabilities in (0, 1], got {args.lowbit_max_p}")
    if args.lowbit and misses == ["full"]:
        raise UserError("--lowbit names a companion, which only --miss lowbit, lowbit-all or lowbit-cache reads")
    stream = misses != ["full"]
    if stream and not args.decode:
        args.decode = True
        print(f"ppl: --miss {' '.join(m for m in misses if m != 'full')} streams the experts: evaluating one token at a "
              "time (--decode)", file=sys.stderr)
    t0, done = time.monotonic(), []

    def on_row(rows, total):  # "k of N" with an ETA; the files rewritten with every finished row
        done[:] = rows
        for path, fmt in ((args.csv, "csv"), (args.json, "json")):
            if path and rows:
                write_rows(rows, path, fmt)
        if not args.no_progress and len(rows) < total:
            eta = (time.monotonic() - t0) / len(rows) * (total - len(rows)) if rows else None
            print(f"[row {len(rows) + 1} of {total}" + (f", about {_duration(eta)} left]" if eta is not None else "]"),
                  file=sys.stderr, flush=True)

    model = resolve_model(args.model, args)
    rows: list = []
    paths = [(m, p) for m in misses for p in (args.lowbit_max_p if m == "lowbit" else [1.0])]
    try:
        for miss, max_p in paths:  # one sweep per miss path, the rows side by side
            before = list(rows)
            rows = before + sweep(
                model, args.text, routings, sizes, ctx=args.ctx, max_chunks=args.chunks, n_threads=args.threads,
                progress=not args.no_progress, insertion=args.insertion, decode=args.decode, prefetch=args.prefetch,
                prefetch_distance=args.prefetch_distance, prefetch_min_p=args.prefetch_min_p,
                eviction=args.eviction or "lru", eviction_decay=args.eviction_decay, miss=miss,
                lowbit=args.lowbit if miss != "full" else None, stream=stream, lowbit_max_p=max_p,
                on_row=lambda r, total, before=before: on_row(before + r, total * len(paths)), device=device)
    except KeyboardInterrupt:  # Ctrl-C: the finished rows are kept, printed, and said where they are
        if done:
            print(format_table(done))
        kept = [p for p in (args.csv, args.json) if p]
        print(f"\ninterrupted: {len(done)} finished row{'s' * (len(done) != 1)} kept"
              + (f" in {' and '.join(kept)}" if kept and done else " (above)" if done else "")
              + ("" if kept else "; give --csv FILE to keep rows in a file as they finish"), file=sys.stderr)
        return 130
    print(format_table(rows))
    for path in (args.csv, args.json):
        if path:
            print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        from ..plots import plot_pareto

        plot_pareto(rows, args.plot, title=f"{rows[0]['model']}: perplexity vs miss rate "
                                           f"(ctx {args.ctx}, {rows[0]['tokens']} tokens scored)")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _resolve_ppl_miss(miss: str, args) -> str:
    """--miss auto as run resolves it: lowbit-cache where a usable companion lies beside the model (or
    --lowbit names one), said on stderr, else full."""
    if miss != "auto":
        return miss
    from .. import lowbit as lb

    model = args.model or getattr(args, "model_opt", None)
    if not model or (args.lowbit is None and not lb.companions_beside(model)):
        return "full"
    try:
        c = lb.check_companion(model, args.lowbit)
    except lb.CompanionError as e:
        print(f"ppl: --miss auto: {e}; at full precision", file=sys.stderr)
        return "full"
    print(f"ppl: --miss auto: the companion {os.path.basename(str(c.path))} is the cache's source (lowbit-cache), as "
          "run does; --miss full lowbit-cache puts both side by side", file=sys.stderr)
    return "lowbit-cache"


def cmd_trace(args) -> int:
    from ..evaluate import check_loaded_model, load_llama, load_text, record_trace, save_trace_npz, tokenize_text
    from ..model_info import model_info

    if args.tokens < 1:
        raise UserError(f"--tokens must be >= 1, got {args.tokens}")
    _check_out_path(args.out)
    text = load_text(args.text)
    model = resolve_model(args.model, args)
    info = model_info(model)
    if not info.is_moe:
        raise UserError(f"{model} has no MoE layers (a dense model): there are no experts to trace")
    cache = dataclasses.replace(cache_from_args(args), trace=args.tokens * info.n_moe_layer)
    llm = load_llama(model, cache=cache, routing=routing_from_args(args), routing_scope=args.scope,
                     n_ctx=args.tokens, n_threads=args.threads)
    check_loaded_model(llm, args.tokens, what="--tokens")
    try:
        tokens = llm.tokenize(b"", add_bos=True) + tokenize_text(llm, text)
        d = record_trace(llm, tokens[:args.tokens], progress=not args.no_progress)
    finally:
        llm.close()
    save_trace_npz(args.out, d)
    T, L, K = d["selected"].shape
    miss = ((d["selected"] >= 0) & ~d["hit"]).sum() / (T * L * K)  # dropped slots are neither hit nor miss
    print(f"wrote {args.out}: {T} tokens x {L} MoE layers (layers {d['moe_layers'][0]}..{d['moe_layers'][-1]}), "
          f"{d['routing']}, cache {d['cache_size']}/{d['n_expert']} experts, miss rate {100 * miss:.1f}%")
    return 0


def cmd_plot_timeline(args) -> int:
    from ..evaluate import load_trace_npz
    from ..plots import plot_timeline

    if args.tokens is not None and args.tokens < 1:
        raise UserError(f"--tokens must be >= 1, got {args.tokens}")
    _check_out_path(args.out)
    d = load_trace_npz(args.trace)
    layer = int(d["moe_layers"][0]) if args.layer is None else args.layer
    plot_timeline(d, layer, args.out, max_tokens=args.tokens)
    print(f"wrote {args.out}")
    return 0


def add_commands(sub) -> None:
    """Register ``ppl``, ``trace``, ``plot-timeline`` and ``simulate`` on the CLI's subparsers."""
    p = sub.add_parser(
        "ppl", help="perplexity and cache miss rate of routing policies on a text (Pareto sweeps)",
        description="Perplexity and expert-cache miss rate on a text, as in the evaluation protocol: the text is "
                    "cut into chunks of --ctx tokens, each evaluated from an empty KV cache, every token routed "
                    "through the policy, the expert cache carried from chunk to chunk. LRU (stock top-K) is always "
                    "evaluated as the reference. Prints one table row per (cache size, routing): its perplexity with "
                    "the standard error of the per-token NLLs (±, as llama-perplexity's +/-), and under \"vs lru\" "
                    "how much higher it is than LRU's on the same chunks, with the standard error of the chunks' "
                    "differences (a gap under twice that is within the text's noise).",
        epilog="Example: pymoecache ppl model.gguf --text valid.txt --sweep prior=0,0.25,0.5,1 max-rank=2,4 "
               "--cache-size 0.5 0.25 --csv pareto.csv --plot pareto.png")
    add_model_argument(p)
    p.add_argument("-f", "--file", "--text", dest="text", required=True, metavar="FILE",
                   help="UTF-8 text file, e.g. WikiText-2 valid.txt, as llama-perplexity's -f (required)")
    p.add_argument("-c", "--ctx", "--ctx-size", dest="ctx", type=int, default=256, metavar="N",
                   help="chunk length in tokens (default %(default)s)")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="evaluate only the first N chunks (default: all)")
    p.add_argument("--decode", action="store_true",
                   help="evaluate one token at a time, as generation does, so --prefetch takes part (slower; "
                        "default: each chunk as one batch)")
    p.add_argument("--sweep", nargs="+", action="extend", metavar="POLICY=V1,V2",
                   help="policy knob values to sweep: prior=L1,L2 | max-rank=M1,M2 | cumsum=T1,T2 | prune=R1,R2 | lru; "
                        "several may be given (default: none, evaluate the routing options below)")
    p.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (default: no file)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON (default: no file)")
    p.add_argument("--plot", metavar="PNG", help="also draw the perplexity / miss rate plot, needs matplotlib (default: no plot)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads (default: llama.cpp's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_device_options(p, evaluation=True)
    add_routing_options(p, multi_cache_size=True, cache_default="0.5")
    lb = p.add_argument_group("low-bit miss path (quality of `run --miss lowbit`)")
    lb.add_argument("--miss", nargs="+", choices=["auto", "full", "lowbit", "lowbit-all", "lowbit-cache"], default=None,
                    metavar="MODE",
                    help="what a miss is computed from: full (its full copy), lowbit (its copy in the low-bit "
                         "companion, the full copy read behind), lowbit-all (every expert from the companion), "
                         "lowbit-cache (a cache of the companion's copies in the same memory, every read from it); "
                         "several give rows side by side, e.g. --miss full lowbit. Anything but full streams the "
                         "experts, evaluates one token at a time (--decode) and adds the columns low-bit/tok "
                         "(experts per token from the companion) and critical MiB/tok (what a token waited "
                         "for); a low-bit row beside the same setting at full precision gets a 'vs full' column. "
                         "auto (default): what run does, lowbit-cache where a usable companion lies beside the "
                         "model (or --lowbit names one), else full")
    lb.add_argument("--lowbit", metavar="FILE", default=None,
                    help="the low-bit companion (default: MODEL.lowbit-*.gguf beside the model; make one with "
                         "`pymoecache lowbit MODEL`)")
    lb.add_argument("--lowbit-max-p", type=float, nargs="+", default=[1.0], metavar="P",
                    help="with --miss lowbit: a miss whose router probability is at least P is read at full "
                         "precision (HOBBIT's rule); several values give a row each (default 1: every miss from "
                         "the companion)")
    p.set_defaults(func=cmd_ppl)

    t = sub.add_parser(
        "trace", help="record per-token expert selections, hits and cache contents to an .npz",
        description="Evaluate the first --tokens tokens of a text one at a time, from an empty cache, and record per "
                    "token and MoE layer: the selected experts, which were hits, and the cache contents after the "
                    "token. The .npz is read by `pymoecache plot-timeline`.")
    add_model_argument(t)
    t.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file (required)")
    t.add_argument("--out", required=True, metavar="NPZ", help="output .npz file (required)")
    t.add_argument("--tokens", type=int, default=256, metavar="N", help="tokens to trace, BOS included (default %(default)s)")
    t.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads (default: llama.cpp's choice)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_routing_options(t, cache_default="0.5")
    t.set_defaults(func=cmd_trace)

    v = sub.add_parser(
        "plot-timeline", help="draw one layer's hit/miss timeline from a trace .npz",
        description="Image of one MoE layer's cache over time: experts (y) x tokens (x), coloured not cached / "
                    "cached, not used / hit / miss. Needs matplotlib.")
    v.add_argument("trace", metavar="TRACE.npz", help="trace written by `pymoecache trace`")
    v.add_argument("out", metavar="OUT.png", help="output PNG file")
    v.add_argument("--layer", type=int, default=None, metavar="L",
                   help="model layer index, must be a MoE layer (default: the first MoE layer)")
    v.add_argument("--tokens", type=int, default=None, metavar="N", help="draw only the first N tokens (default: all)")
    v.set_defaults(func=cmd_plot_timeline)
    add_simulate_command(sub)


def cmd_simulate(args) -> int:
    from ..config import parse_cache_size, parse_routing
    from ..evaluate import load_text, write_rows
    from ..simulate import (EVICTIONS, eviction_table, format_eviction_table, load_router_trace, record_router_trace,
                            save_router_trace)

    for path in (args.csv, args.json, args.save_trace):
        if path:
            _check_out_path(path)
    routings = [parse_routing(s) for s in args.routing.split(",") if s.strip()]
    if not routings:
        raise UserError("--routing needs at least one spec, e.g. lru,prior:0.5")
    evictions = [e.strip() for e in args.eviction.split(",") if e.strip()]
    bad = [e for e in evictions if e not in EVICTIONS]
    if bad or not evictions:
        raise UserError(f"--eviction takes a comma-separated list of {', '.join(EVICTIONS)}; got {args.eviction!r}")
    sizes = [parse_cache_size(s) for s in args.cache_size]
    for given, size in zip(args.cache_size, sizes):
        if isinstance(size, str):  # "4GiB", "auto": they need a model's expert size and the memory, not a trace
            raise UserError(f"simulate takes cache sizes as counts (30) or shares of the experts (0.5), not {given!r}")
    if args.router_trace:
        if args.model or args.model_opt or args.text:
            raise UserError("give either --router-trace FILE or MODEL with --text, not both")
        try:
            trace = load_router_trace(args.router_trace)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read router trace {args.router_trace}: {e}") from None
    else:
        if not args.text:
            raise UserError("--text FILE is needed to record a router trace (or give --router-trace FILE)")
        if args.tokens < 1 or args.ctx < 2:
            raise UserError(f"--tokens must be >= 1 and --ctx >= 2, got {args.tokens} and {args.ctx}")
        text = load_text(args.text)
        trace = record_router_trace(resolve_model(args.model, args), text, tokens=args.tokens, ctx=args.ctx,
                                    n_threads=args.threads, progress=not args.no_progress)
        if args.save_trace:
            save_router_trace(args.save_trace, trace)
            print(f"wrote {args.save_trace}", file=sys.stderr)
    rows = eviction_table(trace, routings, sizes, evictions, eviction_decay=args.eviction_decay)
    print(f"{trace.n_tokens} tokens x {trace.n_layer} MoE layers, {trace.n_expert} experts, top-{trace.n_expert_used}")
    print(format_eviction_table(rows))
    if args.csv:
        write_rows(rows, args.csv, "csv")
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.json:
        write_rows(rows, args.json, "json")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_simulate_command(sub) -> None:
    s = sub.add_parser(
        "simulate", help="replay a model's router over a text: every eviction policy against LRU and Belady",
        description="Record the router outputs of MODEL on the first --tokens tokens of --text (or read a saved "
                    "router trace), then replay them through the expert cache under every (routing, cache size, "
                    "eviction) and print the miss rates next to LRU and Belady's optimum (the best any eviction "
                    "could do on the same selections), with the share of the LRU-Belady gap each policy closes. "
                    "Seconds, no model run per setting.",
        epilog="Example: pymoecache simulate model.gguf --text valid.txt --routing lru,prior:0.5 --cache-size 0.5 0.25")
    add_model_argument(s)
    s.add_argument("--text", metavar="FILE", help="UTF-8 text to record the router on (default: none; needs MODEL)")
    s.add_argument("--router-trace", metavar="NPZ", help="replay this saved router trace instead of recording one "
                                                          "(default: record)")
    s.add_argument("--save-trace", metavar="NPZ", help="also save the recorded router trace (default: no file)")
    s.add_argument("--tokens", type=int, default=4096, metavar="N", help="tokens to record (default %(default)s)")
    s.add_argument("-c", "--ctx", "--ctx-size", dest="ctx", type=int, default=256, metavar="N",
                   help="chunk length in tokens, each from an empty KV cache (default %(default)s)")
    s.add_argument("--routing", default="lru,prior:0.5", metavar="SPECS",
                   help="comma-separated routing specs (default %(default)s)")
    s.add_argument("--cache-size", nargs="+", default=["0.5", "0.25"], metavar="N|F",
                   help="cache sizes: counts or shares of the experts (default 0.5 0.25)")
    s.add_argument("--eviction", default="lru,lfu,activation,freq-prob,router-mass", metavar="LIST",
                   help="comma-separated eviction policies (default: all of them)")
    s.add_argument("--eviction-decay", type=float, default=0.95, metavar="G",
                   help="decay of lfu, freq-prob and router-mass, in (0, 1] (default %(default)s)")
    s.add_argument("--csv", metavar="FILE", help="also write the rows as CSV (default: no file)")
    s.add_argument("--json", metavar="FILE", help="also write the rows as JSON (default: no file)")
    s.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads (default: llama.cpp's choice)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    s.set_defaults(func=cmd_simulate)
