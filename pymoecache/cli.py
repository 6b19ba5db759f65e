"""``pymoecache`` command line (also ``python -m pymoecache``).

    pymoecache run [MODEL] -p "Once upon a time" -n 64 --prior 0.5 --cache-size 0.5
    pymoecache info MODEL [--ram 4GiB]

User errors print one line and exit with code 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

EXIT_USAGE = 2


class UserError(Exception):
    """An error caused by the command's input: one line on stderr, exit code 2."""


def _add_routing_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing (pick one; default: lru, the model's own top-K)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--prior", type=float, metavar="L",
                   help="logit prior: rank cached experts up by L x the layer's logit range (typical 0.1-1.0; 0.5 is the usual point)")
    x.add_argument("--max-rank", type=int, metavar="M", help="cached experts among the router's top M jump ahead")
    x.add_argument("--cumsum", type=float, metavar="T", help="max-rank with M = first rank where cumulative probability >= T")
    x.add_argument("--prune", type=int, metavar="R", help="run only the top R experts of each token")
    x.add_argument("--routing", metavar="SPEC", help="a spec string: lru, prior:0.5, max-rank:4, cumsum:0.7, prune:3")
    g.add_argument("--top-j", type=int, default=None, metavar="J",
                   help="the router's top J experts are always used, cached or not (default 1)")
    g.add_argument("--scope", choices=["all", "decode"], default="all",
                   help="route every token through the policy (all, default) or generated tokens only (decode)")
    c = p.add_argument_group("cache")
    c.add_argument("--cache-size", default="0.5", metavar="N|F|BYTES",
                   help="experts cached per MoE layer: a count (30), a share of the routed experts (0.5, default) "
                        "or a memory budget for all layers (4GiB)")
    c.add_argument("--insertion", choices=["top-bottom", "bottom-top"], default="top-bottom",
                   help="order in which one token's new experts enter the cache (default top-bottom)")


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
    if args.routing:
        return parse_routing(args.routing, top_j=args.top_j)
    return TopK()


def _cache_from_args(args):
    from .config import CacheConfig, parse_cache_size

    return CacheConfig(size=parse_cache_size(args.cache_size), insertion=args.insertion)


def _resolve_model(path: Optional[str]) -> str:
    from .models import default_model_path

    if path:
        return path
    p = default_model_path()
    print(f"using the embedded default model: {p}", file=sys.stderr)
    return str(p)


def cmd_run(args) -> int:
    import pymoecache

    routing = _routing_from_args(args)
    cache = _cache_from_args(args)
    model = _resolve_model(args.model)
    llm = pymoecache.Llama(model, cache=cache, routing=routing, routing_scope=args.scope, n_ctx=args.ctx,
                           n_threads=args.threads, seed=args.seed, verbose=False)
    if llm.moecache is None:
        raise UserError(f"{model} has no MoE layers (a dense model): there are no experts to cache")

    out = sys.stdout
    t0 = time.perf_counter()
    t_first = None
    n_gen = 0
    text = []
    kw = dict(max_tokens=args.n, temperature=args.temp, seed=args.seed, stream=True)
    if args.chat:
        stream = llm.create_chat_completion(messages=[{"role": "user", "content": args.prompt}], **kw)
        pieces = (c["choices"][0]["delta"].get("content", "") for c in stream)
    else:
        stream = llm(args.prompt, **kw)
        pieces = (c["choices"][0]["text"] for c in stream)
    if not args.json:
        out.write(args.prompt if not args.chat else "")
    for piece in pieces:
        if t_first is None:
            t_first = time.perf_counter()
        n_gen += 1
        text.append(piece)
        if not args.json:
            out.write(piece)
            out.flush()
    t_end = time.perf_counter()
    n_prompt = len(llm.tokenize(args.prompt.encode("utf-8")))
    st = llm.moe_stats()
    t_first = t_first or t_end
    res = {
        "model": model,
        "routing": routing.spec(),
        "cache_size": int(st.capacity_per_layer[0]) if st.capacity_per_layer.size else 0,
        "n_expert": st.n_expert,
        "n_expert_used": st.n_expert_used,
        "prompt_tokens": n_prompt,
        "generated_tokens": n_gen,
        "prompt_tok_s": n_prompt / max(t_first - t0, 1e-9),
        "decode_tok_s": (n_gen - 1) / (t_end - t_first) if n_gen > 1 and t_end > t_first else 0.0,
        "hit_rate": st.hit_rate,
        "miss_rate": st.miss_rate,
        "misses_per_token": st.misses_per_token,
        "layer_hit_rate_min": float(st.hit_rate_per_layer.min()) if st.tokens else 0.0,
        "layer_hit_rate_max": float(st.hit_rate_per_layer.max()) if st.tokens else 0.0,
        "lifetime": st.lifetime,
        "bytes_loaded": st.bytes_loaded,
        "text": "".join(text),
    }
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print()
        print(f"[{res['routing']}, cache {res['cache_size']}/{res['n_expert']} experts per layer] "
              f"prompt {n_prompt} tok {res['prompt_tok_s']:.1f} tok/s | decode {n_gen} tok {res['decode_tok_s']:.1f} tok/s | "
              f"hit rate {100 * res['hit_rate']:.1f}% | misses/token {res['misses_per_token']:.2f} | "
              f"layer hit rate min {100 * res['layer_hit_rate_min']:.1f}% max {100 * res['layer_hit_rate_max']:.1f}%",
              file=sys.stderr if args.stats_stderr else sys.stdout)
    llm.close()
    return 0


def cmd_info(args) -> int:
    from .config import parse_bytes
    from .model_info import model_info

    info = model_info(_resolve_model(args.model))
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
    ap = argparse.ArgumentParser(
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
    r.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    r.add_argument("--ctx", type=int, default=0, help="context length (default 0: the model's training context)")
    r.add_argument("--threads", type=int, default=None, help="CPU threads (default: llama.cpp's choice)")
    r.add_argument("--json", action="store_true", help="print one JSON object (text and stats) instead of streaming")
    r.add_argument("--stats-stderr", action="store_true", help="print the stats line on stderr")
    _add_routing_options(r)
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("info", help="describe a GGUF model from its header (experts, sizes)",
                       description="Architecture, layers, experts and bytes per expert, read from the GGUF header only.")
    i.add_argument("model", nargs="?", help="GGUF model file (default: the embedded default model)")
    i.add_argument("--ram", metavar="BYTES", help="also suggest a cache size for this budget (e.g. 4GiB)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=cmd_info)
    return ap


def _validate(args) -> None:
    if getattr(args, "n", 1) is not None and getattr(args, "n", 1) < 0:
        raise UserError("-n must be >= 0")
    if getattr(args, "top_j", None) is not None and args.top_j < 0:
        raise UserError("--top-j must be >= 0")


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "command", None):
        ap.print_help()
        return EXIT_USAGE
    try:
        _validate(args)
        from .config import ConfigError
        from .model_info import ModelFileError

        try:
            return args.func(args)
        except (ConfigError, ModelFileError, FileNotFoundError) as e:
            raise UserError(str(e))
    except UserError as e:
        print(f"pymoecache {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
