"""``pymoecache`` command line (also ``python -m pymoecache``).

    pymoecache run [MODEL] -p "Once upon a time" -n 64 --prior 0.5 --cache-size 0.5
    pymoecache info MODEL [--ram 4GiB]
    pymoecache bench MODEL --routing lru,prior:0.5,max-rank:8 [--csv out.csv]
    pymoecache ppl MODEL --text FILE --sweep prior=0,0.25,0.5,1 --plot pareto.png
    pymoecache trace MODEL --text FILE --out trace.npz ; pymoecache plot-timeline trace.npz --layer 1 out.png
    pymoecache serve MODEL --prior 0.5 --port 8000

User errors (bad files, parameters, state files, I/O) print one line and exit with code 2; an
internal error prints one line and exits with code 1 (PYMOECACHE_DEBUG=1 adds the traceback).
Never a traceback otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from . import cli_eval, server

from .errors import Error

EXIT_USAGE = 2
EXIT_INTERNAL = 1


class UserError(Error):
    """An error caused by the command's input: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage stays in --help); subcommands inherit it."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_routing_options(p: argparse.ArgumentParser, multi_cache_size: bool = False) -> None:
    g = p.add_argument_group("routing (pick one; default: lru, the model's own top-K)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--prior", type=float, metavar="L",
                   help="logit prior: rank cached experts up by L x the layer's logit range (typical 0.1-1.0; 0.5 is the usual "
                        "point; default: off)")
    x.add_argument("--max-rank", type=int, metavar="M", help="cached experts among the router's top M jump ahead (default: off)")
    x.add_argument("--cumsum", type=float, metavar="T", help="max-rank with M = first rank where cumulative probability >= T (default: off)")
    x.add_argument("--prune", type=int, metavar="R", help="run only the top R experts of each token (default: off)")
    x.add_argument("--routing", metavar="SPEC", help="a spec string: lru, prior:0.5, max-rank:4, cumsum:0.7, prune:3 (default: lru)")
    g.add_argument("--top-j", type=int, default=None, metavar="J",
                   help="the router's top J experts are always used, cached or not (default 1)")
    g.add_argument("--scope", choices=["all", "decode"], default="all",
                   help="route every token through the policy (all, default) or generated tokens only (decode)")
    _add_cache_options(p, multi_cache_size)


def _add_cache_options(p: argparse.ArgumentParser, multi: bool = False) -> None:
    c = p.add_argument_group("cache")
    what = ("experts cached per MoE layer, default 0.5: a count (30), a share of the routed experts (0.5), "
            "a memory budget for all layers (4GiB), or auto (free memory less the non-expert weights, "
            "the KV cache and a margin)")
    if multi:
        c.add_argument("--cache-size", nargs="+", default=["0.5"], metavar="N|F|BYTES",
                       help=what + "; several values sweep several sizes")
    else:
        c.add_argument("--cache-size", default="0.5", metavar="N|F|BYTES", help=what)
    c.add_argument("--insertion", choices=["top-bottom", "bottom-top"], default="top-bottom",
                   help="order in which one token's new experts enter the cache (default top-bottom)")
    if multi:  # ppl: quality does not depend on where the experts live; evaluation keeps them resident
        return
    c.add_argument("--residency", choices=["auto", "stream", "mmap", "none"], default="auto",
                   help="where expert weights live: stream (cached experts in an mlocked slot arena, misses read "
                        "from the GGUF with direct I/O), mmap (experts mmapped, cached ones mlocked, evicted ones "
                        "dropped), none (all resident, the cache only counts); auto = stream when the cache is "
                        "smaller than all experts, else none (default auto)")
    c.add_argument("--io-threads", type=int, default=8, metavar="T",
                   help="expert reads in flight at once on a miss (default 8)")
    c.add_argument("--no-mlock", action="store_true",
                   help="do not mlock the expert cache (default: lock it; if the OS refuses, one warning)")
    c.add_argument("--no-direct-io", action="store_true",
                   help="stream: read experts through the page cache, then drop them (default: O_DIRECT)")


def _add_runtime_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--ctx", type=int, default=0, help="context length (default 0: the model's training context)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: llama.cpp's choice)")


def _add_hub_options(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("download (instead of MODEL)")
    h.add_argument("--hf-repo", metavar="REPO", help="Hugging Face repository to download the GGUF from (default: none, use MODEL)")
    h.add_argument("--hf-file", metavar="FILE", help="GGUF file in --hf-repo (downloaded once, with progress; default: none)")


def _routing_from_args(args):
    from .config import CumsumThreshold, MaxRank, Prior, Prune, TopK, parse_routing

    j = 1 if args.top_j is None else args.top_j
    if args.prior is not None:
        return Prior(args.prior, top_j=j)
    if args.max_rank is not None:
        return MaxRank(args.max_rank, top_j=j)
    if args.cumsum is not None:
        return CumsumThreshold(args.cumsum, top_j=j)
    if args.prune is not None:
        return Prune(args.prune, top_j=j)
    if args.routing is not None:  # "" is refused by the parser, not taken for lru
        routing = parse_routing(args.routing, top_j=args.top_j)
    else:
        routing = TopK()
    if isinstance(routing, TopK) and args.top_j is not None:
        raise UserError("--top-j needs a policy that changes the ranking (--prior, --max-rank, --cumsum, --prune)")
    return routing


def _cache_from_args(args):
    from .config import CacheConfig, parse_cache_size

    return CacheConfig(size=parse_cache_size(args.cache_size), insertion=args.insertion,
                       residency=getattr(args, "residency", "auto"), io_threads=getattr(args, "io_threads", 8),
                       lock_memory=not getattr(args, "no_mlock", False),
                       direct_io=not getattr(args, "no_direct_io", False))


def _resolve_model(path: Optional[str], args=None) -> str:
    """MODEL argument, a Hugging Face download (--hf-repo/--hf-file), or the default model."""
    from .models import default_model_path

    repo, file = getattr(args, "hf_repo", None), getattr(args, "hf_file", None)
    if repo or file:
        if path:
            raise UserError("give either MODEL or --hf-repo/--hf-file, not both")
        if not (repo and file):
            raise UserError("--hf-repo and --hf-file go together (e.g. --hf-repo OWNER/SOME-MOE-GGUF "
                            "--hf-file some-moe-q4_k_m.gguf)")
        from .hub import HubError, download

        try:
            return str(download(repo, file))
        except HubError as e:
            raise UserError(str(e))
    if path:
        return path
    p = default_model_path()
    print(f"using the embedded default model: {p}", file=sys.stderr)
    return str(p)


def _perf(llm):
    """llama.cpp's own timings since the last reset: (prompt tokens, prompt s, decoded tokens, decode s)."""
    import llama_cpp

    d = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return d.n_p_eval, d.t_p_eval_ms / 1e3, d.n_eval, d.t_eval_ms / 1e3


def _perf_reset(llm) -> None:
    import llama_cpp

    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)


def cmd_run(args) -> int:
    import pymoecache

    routing = _routing_from_args(args)
    cache = _cache_from_args(args)
    model = _resolve_model(args.model, args)
    llm = pymoecache.Llama(model, cache=cache, routing=routing, routing_scope=args.scope, n_ctx=args.ctx,
                           n_threads=args.threads, seed=args.seed, verbose=False)
    if llm.moecache is None:
        raise UserError(f"{model} has no MoE layers (a dense model): there are no experts to cache")

    out = sys.stdout
    _perf_reset(llm)
    text = []
    if not args.chat:
        n_prompt_tokens = len(llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=False))
        if n_prompt_tokens + max(args.n, 1) > llm.n_ctx():
            raise UserError(f"the prompt ({n_prompt_tokens} tokens) and -n {args.n} do not fit in the context of "
                            f"{llm.n_ctx()} tokens: raise --ctx or shorten them")
    # llama-cpp-python reads max_tokens 0 as "until the context is full": -n 0 evaluates the prompt only
    kw = dict(max_tokens=args.n, temperature=args.temp, seed=args.seed, stream=True)
    if args.n == 0:
        import llama_cpp

        llm.eval(llm.tokenize(args.prompt.encode("utf-8"), add_bos=True))
        llama_cpp.llama_synchronize(llm._ctx.ctx)  # llama.cpp counts a prompt's time when it syncs
        pieces = iter(())
    elif args.chat:
        stream = llm.create_chat_completion(messages=[{"role": "user", "content": args.prompt}], **kw)
        pieces = (c["choices"][0]["delta"].get("content", "") for c in stream)
    else:
        stream = llm(args.prompt, **kw)
        pieces = (c["choices"][0]["text"] for c in stream)
    if not args.json:
        out.write(args.prompt if not args.chat else "")
    try:
        for piece in pieces:
            text.append(piece)
            if not args.json:
                out.write(piece)
                out.flush()
    except ValueError as e:  # llama-cpp-python: "Requested tokens (...) exceed context window of ..."
        raise UserError(str(e)) from None
    n_prompt, t_prompt, n_decoded, t_gen = _perf(llm)
    n_gen = n_decoded + 1 if text else 0  # the last sampled token is never decoded
    st = llm.moe_stats()
    res = {
        "model": model,
        "routing": routing.spec(),
        "prompt_tokens": n_prompt,
        "generated_tokens": n_gen,
        "prompt_tok_s": n_prompt / t_prompt if t_prompt > 0 else 0.0,
        "decode_tok_s": n_decoded / t_gen if t_gen > 0 else 0.0,
        **st.summary_dict(),
        "text": "".join(text),
    }
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print()
        print(f"[{res['routing']}, cache {res['cache_size']}/{res['n_expert']} experts per layer] "
              f"prompt {n_prompt} tok {res['prompt_tok_s']:.1f} tok/s | decode {n_gen} tok {res['decode_tok_s']:.1f} tok/s | "
              f"hit rate {100 * res['hit_rate']:.1f}% | misses/token {res['misses_per_token']:.2f} | "
              f"layer hit rate min {100 * res['layer_hit_rate_min']:.1f}% max {100 * res['layer_hit_rate_max']:.1f}%"
              + (f" | {st.residency.summary()}" if st.residency and st.residency.residency != "none" else ""),
              file=sys.stderr if args.stats_stderr else sys.stdout)
    llm.close()
    return 0


DEFAULT_BENCH_PROMPTS = [
    "Once upon a time",
    "The history of the city begins in",
    "Q: What is a Mixture-of-Experts model?\nA:",
    "def fibonacci(n):",
]


def cmd_bench(args) -> int:
    import pymoecache
    from .config import parse_routing

    routings = [parse_routing(spec, top_j=args.top_j) for spec in args.routing.split(",") if spec.strip()]
    if not routings:
        raise UserError("--routing needs at least one spec, e.g. lru,prior:0.5")
    if args.prompts:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                prompts = [ln.rstrip("\n") for ln in f if ln.strip()]
        except OSError as e:
            raise UserError(f"cannot read --prompts {args.prompts}: {e.strerror}")
        if not prompts:
            raise UserError(f"--prompts {args.prompts} has no non-empty line")
    else:
        prompts = DEFAULT_BENCH_PROMPTS
    if args.reps < 1:
        raise UserError("--reps must be >= 1")
    model = _resolve_model(args.model, args)
    llm = pymoecache.Llama(model, cache=_cache_from_args(args), routing=routings[0], routing_scope=args.scope,
                           n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    if llm.moecache is None:
        raise UserError(f"{model} has no MoE layers (a dense model): there are no experts to cache")

    for prompt in prompts:  # warm-up, untimed: builds the graph of every prompt length, pages in weights
        llm.reset()
        llm(prompt, max_tokens=2, temperature=0.0)
    acc = {r.spec(): dict(pt=0, ps=0.0, dt=0, ds=0.0, misses=0, routed=0, layer_tokens=0, lifetime=[], loaded=0,
                          dec=0, read=0, io=0.0, route=0.0, rss=0) for r in routings}
    total = args.reps * len(routings)
    done = 0
    for rep in range(args.reps):
        order = routings[rep % len(routings):] + routings[:rep % len(routings)]  # rotate: no setting always first
        for routing in order:
            a = acc[routing.spec()]
            llm.moecache.clear()
            llm.reset_moe_stats()
            llm.set_routing(routing)
            for prompt in prompts:
                llm.reset()
                _perf_reset(llm)
                llm(prompt, max_tokens=args.n, temperature=0.0, seed=args.seed)
                pt, ps, dt, ds = _perf(llm)
                a["pt"] += pt
                a["ps"] += ps
                a["dt"] += dt
                a["ds"] += ds
            st = llm.moe_stats()
            a["misses"] += st.misses
            a["routed"] += st.tokens
            a["layer_tokens"] += int(st.tokens_per_layer.sum())  # miss rate: misses / (K x tokens), all layers
            a["lifetime"].append(st.lifetime)
            a["loaded"] += st.bytes_loaded
            rs = st.residency
            a["dec"] += rs.decode_tokens
            a["read"] += rs.decode_bytes_read
            a["io"] += rs.decode_t_io_ms
            a["route"] += rs.decode_t_route_ms
            a["rss"] = max(a["rss"], rs.rss_bytes)
            done += 1
            print(f"\r[{done}/{total}] {routing.spec():<24}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    K = llm.moecache.n_expert_used
    cache_size = llm.moe_stats().summary_dict()["cache_size"]
    rows = []
    for spec, a in acc.items():
        rows.append({
            "routing": spec,
            "cache_size": cache_size,
            "n_expert": llm.moecache.n_expert,
            "prompt_tok_s": a["pt"] / a["ps"] if a["ps"] else 0.0,
            "decode_tok_s": a["dt"] / a["ds"] if a["ds"] else 0.0,
            "miss_rate": a["misses"] / (K * a["layer_tokens"]) if a["layer_tokens"] else 0.0,
            "misses_per_token": a["misses"] / a["routed"] if a["routed"] else 0.0,
            "lifetime": sum(a["lifetime"]) / len(a["lifetime"]),
            "mib_loaded_per_run": a["loaded"] / args.reps / 2**20,
            "residency": llm.moe_stats().residency.residency,
            "mib_read_per_token": a["read"] / a["dec"] / 2**20 if a["dec"] else 0.0,
            "io_ms_per_token": a["io"] / a["dec"] if a["dec"] else 0.0,
            "route_ms_per_token": a["route"] / a["dec"] if a["dec"] else 0.0,
            "compute_ms_per_token": max(0.0, 1e3 * a["ds"] / a["dt"] - (a["io"] + a["route"]) / a["dec"])
            if a["dt"] and a["dec"] else 0.0,
            "rss_mib": a["rss"] / 2**20,
        })
    llm.close()
    _write_rows(rows, args.csv, args.json)
    hdr = (f"{'routing':<16} {'cache':>7} {'prompt tok/s':>12} {'decode tok/s':>12} {'miss %':>7} {'miss/tok':>8} "
           f"{'lifetime':>8} {'MiB loaded':>10} {'MiB read/tok':>12} {'compute ms':>10} {'I/O ms':>7} {'route ms':>8} {'RSS MiB':>8}")
    print(hdr)
    for r in rows:
        print(f"{r['routing']:<16} {r['cache_size']:>3}/{r['n_expert']:<3} {r['prompt_tok_s']:>12.1f} {r['decode_tok_s']:>12.1f} "
              f"{100 * r['miss_rate']:>7.1f} {r['misses_per_token']:>8.2f} {r['lifetime']:>8.1f} {r['mib_loaded_per_run']:>10.2f} "
              f"{r['mib_read_per_token']:>12.3f} {r['compute_ms_per_token']:>10.2f} {r['io_ms_per_token']:>7.2f} "
              f"{r['route_ms_per_token']:>8.3f} {r['rss_mib']:>8.0f}")
    return 0


def _write_rows(rows, csv_path: Optional[str], json_path: Optional[str]) -> None:
    if csv_path:
        import csv

        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


def cmd_info(args) -> int:
    from .config import parse_bytes
    from .model_info import model_info

    info = model_info(_resolve_model(args.model, args))
    budget = None
    if args.ram:
        budget = parse_bytes(args.ram)
        if budget is None:
            raise UserError(f"cannot parse --ram {args.ram!r} (e.g. 4GiB, 512MB)")
    if args.json:
        d = {k: v for k, v in vars(info).items()}
        d.update(n_moe_layer=info.n_moe_layer, expert_share=info.expert_share, is_moe=info.is_moe)
        if budget is not None:
            d["cache_size_for_budget"] = info.cache_size_for_budget(budget)
        print(json.dumps(d, indent=2))
    else:
        print(info.table(budget))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="pymoecache",
        description="Run Mixture-of-Experts GGUF models with a per-layer expert cache and cache-aware routing.",
        epilog="Run `pymoecache COMMAND --help` for the options of each command.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="generate text and print cache statistics",
                       description="Generate text from a prompt, then print one line of speed and cache statistics.")
    r.add_argument("model", nargs="?", help="GGUF model file (default: the embedded default model)")
    r.add_argument("-p", "--prompt", default="Once upon a time", help="prompt text (default: %(default)r)")
    r.add_argument("-n", type=int, default=64, metavar="N", help="tokens to generate (default %(default)s)")
    r.add_argument("--chat", action="store_true", help="treat the prompt as a user message with the model's chat template")
    r.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default %(default)s)")
    _add_runtime_options(r)
    r.add_argument("--json", action="store_true", help="print one JSON object (text and stats) instead of streaming")
    r.add_argument("--stats-stderr", action="store_true", help="print the stats line on stderr")
    _add_hub_options(r)
    _add_routing_options(r)
    r.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="compare routing policies on the same prompts (tok/s, miss rate, lifetime)",
                       description="Run the same prompts under each routing setting (settings rotate between "
                                   "repetitions, the cache starts empty for each) and print one row per setting. "
                                   "Timings are llama.cpp's own prompt and decode counters.")
    b.add_argument("model", nargs="?", help="GGUF model file (default: the embedded default model)")
    b.add_argument("--routing", default="lru,prior:0.5,max-rank:8,cumsum:0.9", metavar="SPECS",
                   help="comma-separated routing specs (default %(default)s)")
    b.add_argument("--top-j", type=int, default=None, metavar="J", help="Top-J for every spec (default 1)")
    b.add_argument("--scope", choices=["all", "decode"], default="all",
                   help="route every token (all, default) or generated tokens only (decode)")
    b.add_argument("--prompts", metavar="FILE", help="prompts, one per line (default: four built-in prompts)")
    b.add_argument("-n", type=int, default=64, metavar="N", help="tokens generated per prompt (default %(default)s)")
    b.add_argument("--reps", type=int, default=1, help="repetitions of every setting (default %(default)s)")
    _add_runtime_options(b)
    b.add_argument("--csv", metavar="FILE", help="also write the table as CSV (default: no file)")
    b.add_argument("--json", metavar="FILE", help="also write the table as JSON (default: no file)")
    _add_hub_options(b)
    _add_cache_options(b)
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("info", help="describe a GGUF model from its header (experts, sizes)",
                       description="Architecture, layers, experts and bytes per expert, read from the GGUF header only.")
    i.add_argument("model", nargs="?", help="GGUF model file (default: the embedded default model)")
    i.add_argument("--ram", metavar="BYTES", help="also suggest a cache size for this budget, e.g. 4GiB (default: none)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=cmd_info)

    cli_eval.add_commands(sub)  # ppl, trace, plot-timeline
    server.add_command(sub)     # serve
    return ap


def _validate(args) -> None:
    """Integer options are checked here, before anything reaches ctypes (no wrap-around)."""
    from .config import INT32_MAX

    n = getattr(args, "n", None)
    if n is not None and not 0 <= n <= INT32_MAX:
        raise UserError(f"-n must be in [0, {INT32_MAX}], got {n}")
    top_j = getattr(args, "top_j", None)
    if top_j is not None and not 0 <= top_j <= INT32_MAX:
        raise UserError(f"--top-j must be in [0, {INT32_MAX}], got {top_j}")
    if getattr(args, "routing", None) is not None and not args.routing.strip():
        raise UserError("--routing needs a spec, e.g. lru or prior:0.5")
    for name in ("max_rank", "prune", "io_threads", "reps", "tokens", "chunks", "layer", "ctx", "threads"):
        v = getattr(args, name, None)
        if v is not None and not -INT32_MAX <= v <= INT32_MAX:
            raise UserError(f"--{name.replace('_', '-')} = {v} is out of range")
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "command", None):
        ap.print_help()
        return EXIT_USAGE
    where = f"pymoecache {args.command}"
    try:
        _validate(args)
        return args.func(args)
    except Error as e:  # every user error of the package: files, parameters, state, I/O
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a file the user named cannot be read or written
        print(f"{where}: error: {e.strerror or _one_line(e)}" + (f": {e.filename}" if e.filename else ""),
              file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug of ours: one line, the traceback on request
        if os.environ.get("PYMOECACHE_DEBUG"):
            raise
        print(f"{where}: internal error: {type(e).__name__}: {_one_line(e)[:500]} "
              "(PYMOECACHE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
