"""``pymoecache run``, ``bench`` and ``info``: generate text with the expert cache, compare routing
policies on the same prompts, describe a GGUF from its header.

    pymoecache run [MODEL] -p "Once upon a time" -n 64 --prior 0.5 --cache-size 0.5
    pymoecache bench MODEL --routing lru,prior:0.5,max-rank:8 [--csv out.csv]
    pymoecache info MODEL [--ram 4GiB]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from ..config import DEFAULT_PRESET, resolved_top_j
from .loading import cache_line, decode_forecast, llama_from_args, miss_asked, print_plan
from .options import (UserError, add_cache_options, add_conversation_options, add_hub_options, add_model_argument,
                      add_routing_options, add_runtime_options, add_sampling_options, chat_template_from_args,
                      check_profile_args, load_profile_from_args, prompt_text, read_text_file, resolve_model,
                      routing_from_args, sampling_kwargs, save_profile_from_args, system_prompt, use_color)


def _perf(llm):
    """llama.cpp's own timings since the last reset: (prompt tokens, prompt s, decoded tokens, decode s)."""
    import llama_cpp

    d = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return d.n_p_eval, d.t_p_eval_ms / 1e3, d.n_eval, d.t_eval_ms / 1e3


def _perf_reset(llm) -> None:
    import llama_cpp

    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)


def print_prompt(llm, text: str, special: bool = False, add_bos: bool = True) -> None:
    """--verbose-prompt, as llama-cli prints it before generating: the prompt, its token count, then
    each token's id and piece (on stderr)."""
    ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
    lines = [f"prompt: {text!r}", f"number of tokens in prompt = {len(ids)}"]
    for t in ids:
        piece = llm.detokenize([t], special=True).decode("utf-8", "replace")
        lines.append(f"{t:6d} -> {piece!r}")
    print("\n".join(lines) + "\n", file=sys.stderr, flush=True)


def _progress(line: str) -> None:
    """bench's progress on stderr: rewritten in place on a terminal, a line each in a pipe or a file (where a
    carriage return ran them together)."""
    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    print("\r" + line if tty else line.rstrip(), end="" if tty else "\n", file=sys.stderr, flush=True)


def all_fit(llm) -> bool:
    """Every routed expert of every MoE layer is cached: misses are first uses, and cache-aware
    routing picks the model's own experts."""
    return all(llm.moecache.layer_row(il)[0][1] >= llm.moecache.n_expert for il in llm.model_info.moe_layers)


def prompt_from_args(args) -> str:
    """-p TEXT or -f FILE (as llama.cpp); the default prompt when neither is given."""
    prompt = prompt_text(args)
    return DEFAULT_PROMPT if prompt is None else prompt


def check_timeline_args(args) -> None:
    """--timeline / --timeline-plot: targets that can be written, matplotlib for a picture (before any work)."""
    from ..errors import Error
    from ..files import writable_target

    for path, what in ((args.timeline, "timeline"), (args.timeline_plot, "timeline plot")):
        if path is not None:
            writable_target(path, what, Error)
    if args.timeline_plot is not None:
        from .._mpl import check_image_path

        check_image_path(args.timeline_plot, "--timeline-plot")
        if args.timeline is not None and os.path.realpath(args.timeline) == os.path.realpath(args.timeline_plot):
            raise UserError(f"--timeline and --timeline-plot both name {args.timeline}: one would overwrite the other")


def write_timeline(args, llm) -> None:
    """Writes what --timeline / --timeline-plot asked for and says where, with the overlap, on stderr."""
    tl = llm.timeline()
    if args.timeline:
        tl.save_chrome(args.timeline, model=str(llm.model_path), routing=llm.moecache.routing.spec(),
                       residency=llm.cache_config.residency, cache_size=str(llm.cache_config.size),
                       prefetch=llm.moecache.prefetch)
        print(f"timeline: {len(tl)} events{f' ({tl.dropped} past the capacity left out)' if tl.dropped else ''} "
              f"written to {args.timeline} (Chrome trace-event JSON: open it in https://ui.perfetto.dev or "
              f"chrome://tracing)", file=sys.stderr)
    if args.timeline_plot:
        if len(tl.decode_tokens()) == 0:
            print("timeline: no token was decoded, so there is nothing to plot", file=sys.stderr)
        else:
            tl.plot(args.timeline_plot)
            print(f"timeline: the median decoded token and the next drawn in {args.timeline_plot}", file=sys.stderr)
    print(f"timeline: {tl.overlap().summary()}", file=sys.stderr)


def cmd_run(args) -> int:
    args.system = system_prompt(args)
    routing = routing_from_args(args)
    prompt = prompt_from_args(args)
    check_profile_args(args)
    check_timeline_args(args)
    model = resolve_model(args.model, args)
    llm = llama_from_args(args, routing, model, dense_ok=True)
    if llm.moecache is None and (args.profile or args.timeline or args.timeline_plot):
        llm.close()
        raise UserError(f"{model} is a dense model: --profile and --timeline record experts, and it has none")
    args.prompt = prompt
    if not (args.chat or args.system is not None):
        given = [f for f, v in (("--chat-template", args.chat_template), ("--chat-template-file",
                                                                          args.chat_template_file)) if v is not None]
        if given:
            chat_template_from_args(args, llm)  # (an unknown name or a bad file is said first)
            llm.close()
            raise UserError(f"{given[0]} is the template of a chat turn: add --chat (or -sys, or -cnv for a "
                            "conversation); without one, run completes the prompt as it is given")
    note = load_profile_from_args(args, llm)
    if note:
        print(note, file=sys.stderr)

    if args.timeline or args.timeline_plot:
        llm.start_timeline()
    out = sys.stdout
    _perf_reset(llm)
    text = []
    if not (args.chat or args.system is not None):
        n_prompt_tokens = len(llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=False))
        if n_prompt_tokens + max(args.n, 1) > llm.n_ctx():
            raise UserError(f"the prompt ({n_prompt_tokens} tokens) and -n {args.n} do not fit in the context of "
                            f"{llm.n_ctx()} tokens: raise -c (--ctx-size) or shorten them")
    # llama-cpp-python reads max_tokens 0 as "until the context is full": -n 0 evaluates the prompt only
    kw = dict(max_tokens=args.n, stream=True, **sampling_kwargs(args, llm))
    llm.special_text = args.special
    print_plan(llm, asked=miss_asked(args))
    if args.n == 0:
        import llama_cpp

        llm.eval(llm.tokenize(args.prompt.encode("utf-8"), add_bos=True))
        llama_cpp.llama_synchronize(llm._ctx.ctx)  # llama.cpp counts a prompt's time when it syncs
        pieces = iter(())
    elif args.chat or args.system is not None:  # one turn through the chat template (templates.py)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        template = chat_template_from_args(args, llm)
        if template.fallback:
            print(f"pymoecache run: using {template.label}", file=sys.stderr)
        if args.verbose_prompt:
            rendered, has_bos = template.render(messages)
            print_prompt(llm, rendered, special=True, add_bos=not has_bos)
        llm.chat_handler = template.handler()
        stream = llm.create_chat_completion(messages=messages, **kw)
        pieces = (c["choices"][0]["delta"].get("content", "") for c in stream)
    else:
        if args.verbose_prompt:
            print_prompt(llm, args.prompt)
        stream = llm(args.prompt, **kw)
        pieces = (c["choices"][0]["text"] for c in stream)
    if not args.json and not (args.chat or args.system is not None) and args.display_prompt:
        out.write(f"\x1b[33m{args.prompt}\x1b[0m" if use_color(args, out) else args.prompt)  # llama.cpp's yellow prompt
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
    st = llm.moe_stats() if llm.moecache is not None else None
    res = {
        "model": model,
        "routing": llm.moecache.routing.spec() if llm.moecache is not None else routing.spec(),
        "preset": llm.preset.name if getattr(llm, "preset", None) is not None else None,
        "top_j": (resolved_top_j(llm.moecache.routing, llm.model_info.n_expert_used)
                  if llm.moecache is not None and hasattr(llm.moecache.routing, "top_j") else None),
        "eviction": llm.cache_config.eviction,
        "n_ctx": llm.n_ctx(),
        "n_threads": llm.context_params.n_threads,
        "seed": args.seed,
        "prompt_tokens": n_prompt,
        "generated_tokens": n_gen,
        "prompt_tok_s": n_prompt / t_prompt if t_prompt > 0 else 0.0,
        "decode_tok_s": n_decoded / t_gen if t_gen > 0 else 0.0,
        **(st.summary_dict() if st is not None else {}),
        "cache_choice": str(llm.cache_choice) if llm.cache_choice is not None else None,
        "text": "".join(text),
    }
    stats_out = sys.stdout if args.stats_stdout else sys.stderr  # (stdout holds the text alone, as llama-cli's)
    if not args.json and (text or (args.display_prompt and not (args.chat or args.system is not None))):
        print()  # (the text ends its line; the stats line follows, on stderr)
    if args.json:
        print(json.dumps(res, indent=2))
    elif st is None:  # a dense model: llama.cpp's speed, nothing about experts
        print(f"[dense model, no expert cache] prompt {n_prompt} tok {res['prompt_tok_s']:.1f} tok/s | decode {n_gen} "
              f"tok {res['decode_tok_s']:.1f} tok/s" + (f" | seed {args.seed}" if args.temp > 0 else ""),
              file=stats_out)
    else:
        print(f"{cache_line(llm, res['routing'])} "
              f"prompt {n_prompt} tok {res['prompt_tok_s']:.1f} tok/s | decode {n_gen} tok {res['decode_tok_s']:.1f} tok/s | "
              f"hit rate {100 * res['hit_rate']:.1f}% | misses/token {res['misses_per_token']:.2f}"
              f"{' (first uses: every expert fits)' if res['misses_per_token'] > 0 and all_fit(llm) else ''} | "
              f"layer hit rate min {100 * res['layer_hit_rate_min']:.1f}% max {100 * res['layer_hit_rate_max']:.1f}%"
              + (f" | {st.routing_cost()}" if st.routing_cost() else "")
              + (f" | {st.residency.summary()}" if st.residency and (st.residency.residency != "none" or
                                                                     st.residency.device_summary()) else "")
              + (f" | seed {args.seed}" if args.temp > 0 else ""),
              file=stats_out)
    if args.timeline or args.timeline_plot:
        write_timeline(args, llm)
    save_profile_from_args(args, llm)
    llm.close()
    return 0


DEFAULT_PROMPT = "Once upon a time"
DEFAULT_BENCH_PROMPTS = [
    "Once upon a time",
    "The history of the city begins in",
    "Q: What is a Mixture-of-Experts model?\nA:",
    "def fibonacci(n):",
]


def cmd_bench(args) -> int:
    from ..config import parse_routing
    from ..evaluate import write_rows

    routings = [parse_routing(spec, top_j=args.top_j) for spec in args.routing.split(",") if spec.strip()]
    if not routings:
        raise UserError("--routing needs at least one spec, e.g. lru,prior:0.5")
    if args.prompts:
        text = read_text_file(args.prompts, "--prompts", 1 << 22)  # (a FIFO or a device refused, not waited on)
        prompts = [ln for ln in text.split("\n") if ln.strip()]
        if not prompts:
            raise UserError(f"--prompts {args.prompts} has no non-empty line")
    else:
        prompts = DEFAULT_BENCH_PROMPTS
    if args.reps < 1:
        raise UserError("--reps must be >= 1")
    if not 1 <= args.parallel <= 256:
        raise UserError(f"--parallel must be in [1, 256], got {args.parallel}")
    model = resolve_model(args.model, args)
    if args.parallel > 1:
        return bench_parallel(args, routings, prompts, model)
    llm = llama_from_args(args, routings[0], model)
    if llm.cache_choice is not None:
        print(f"cache size {llm.cache_choice}", file=sys.stderr)
    sampling_kwargs(args, llm)  # a bad --grammar is an error now
    print_plan(llm, forecast=True, asked=miss_asked(args))
    if all_fit(llm) and len(routings) > 1:
        print("note: every expert is cached, so cache-aware routing (prior, max-rank, cumsum) picks the model's own "
              "experts: those rows differ from lru only by noise; give --cache-size below the experts to compare",
              file=sys.stderr)

    for prompt in prompts:  # warm-up, untimed: builds the graph of every prompt length, pages in weights
        llm.reset()
        llm(prompt, max_tokens=2, temperature=0.0)
    acc = {r.spec(): dict(pt=0, ps=0.0, dt=0, ds=0.0, misses=0, routed=0, layer_tokens=0, lifetime=[], loaded=0,
                          dec=0, read=0, io=0.0, route=0.0, rss=0, reps=0) for r in routings}
    total = args.reps * len(routings)
    done, t0 = 0, time.monotonic()
    K, n_expert = llm.moecache.n_expert_used, llm.moecache.n_expert
    cache_size = llm.moe_stats().summary_dict()["cache_size"]
    residency = llm.moe_stats().residency.residency

    fc = decode_forecast(llm) if llm.memory_plan() is not None else None  # (None with GPU layers)

    def rows_so_far() -> list:  # one row per setting with at least one finished repetition
        return [dict(bench_row(spec, a, K, n_expert, cache_size, residency),
                     **({"forecast_tok_s": fc.tok_s, "forecast_low": fc.low, "forecast_high": fc.high} if fc else {}))
                for spec, a in acc.items() if a["reps"]]

    try:
        for rep in range(args.reps):
            order = routings[rep % len(routings):] + routings[:rep % len(routings)]  # rotate: no setting always first
            for routing in order:
                bench_one(llm, routing, prompts, args, acc[routing.spec()])
                done += 1
                for path, fmt in ((args.csv, "csv"), (args.json, "json")):  # rows written as they finish
                    if path:
                        write_rows(rows_so_far(), path, fmt)
                left = (time.monotonic() - t0) / done * (total - done)
                _progress(f"[{done} of {total}] {routing.spec():<24}" + (f" about {left:.0f} s left " if done < total
                                                                           else " " * 20))
    except KeyboardInterrupt:  # Ctrl-C: the finished repetitions are kept, printed, and said where
        print(file=sys.stderr)
        llm.close()
        rows = rows_so_far()
        if rows:
            print_bench_table(rows)
        kept = [p for p in (args.csv, args.json) if p]
        print(f"interrupted after {done} of {total} runs: "
              + (f"{len(rows)} row(s) from the finished repetitions kept" + (f" in {' and '.join(kept)}" if kept else "")
                 if rows else "no run had finished"), file=sys.stderr)
        return 130
    print(file=sys.stderr)
    rows = rows_so_far()
    llm.close()
    print_bench_table(rows)
    if fc is not None:  # the forecast is the default routing's: beside the rows of a preset (the default is one)
        for r in rows:
            if r["routing"].startswith("preset:"):
                print(f"forecast for {r['routing']}: {fc.tok_s:.1f} tok/s (band {fc.low:.1f} to {fc.high:.1f}); "
                      f"measured {r['decode_tok_s']:.1f}: " + ("inside the band" if fc.contains(r["decode_tok_s"])
                                                               else "outside the band"))
    return 0


def bench_parallel(args, routings: list, prompts: list, model: str) -> int:
    """``bench --parallel N``: N sequences (the prompts, cycled to N) decoded together against the same N
    one after another, per routing, each run from an empty cache; one row per routing and way, the
    together row with its throughput as a multiple of one after another."""
    from ..batch import BatchDecoder

    n = args.parallel
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    llm = llama_from_args(args, routings[0], model, n_seq_max=n)
    if llm.cache_choice is not None:
        print(f"cache size {llm.cache_choice}", file=sys.stderr)
    kw = sampling_kwargs(args, llm)
    if kw.get("grammar") is not None or kw.get("logit_bias") or kw.get("stop"):
        llm.close()
        raise UserError("bench --parallel samples as serve -np batches: without --grammar, --ignore-eos or -r")
    print_plan(llm, asked=miss_asked(args))
    toks = [llm.tokenize(p.encode("utf-8")) for p in prompts]
    dec = BatchDecoder(llm)
    seed = kw["seed"] if kw.get("seed") is not None and kw["seed"] >= 0 else 0
    sample = dict(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"], min_p=kw["min_p"], seed=seed,
                  penalties=(kw["repeat_penalty"], kw["frequency_penalty"], kw["presence_penalty"]))

    def one_run(together: bool) -> dict:
        dec.forget()
        llm.moecache.clear()
        llm.reset_moe_stats()
        t0 = time.perf_counter()
        seqs = []
        for t in toks:
            seqs.append(dec.add(t, max_tokens=args.n, **sample))
            if not together:
                dec.run()
        dec.run()
        wall = time.perf_counter() - t0
        st = llm.moe_stats()
        rs = st.residency
        return dict(wall=wall, tokens=sum(len(q.tokens) for q in seqs), lat=[q.latency_s for q in seqs],
                    steps=rs.decode_steps if rs else 0, dec=rs.decode_tokens if rs else 0,
                    loads=rs.decode_loads if rs else 0, read=rs.decode_bytes_read if rs else 0,
                    misses=st.misses, routed=st.tokens)

    rows = []
    try:
        llm.set_routing(routings[0])
        for t in toks:  # warm-up, untimed: the graphs of one and of n sequences, the weights paged in
            dec.add(t, max_tokens=2)
        dec.run()
        for routing in routings:
            llm.set_routing(routing)
            acc = {False: [], True: []}
            for rep in range(args.reps):
                for together in ((False, True) if rep % 2 == 0 else (True, False)):  # neither always first
                    acc[together].append(one_run(together))
                    _progress(f"{routing.spec():<24} repetition {rep + 1} of {args.reps}")
            base = None
            for together in (False, True):
                runs = acc[together]
                tok_s = sorted(r["tokens"] / r["wall"] for r in runs)[len(runs) // 2]  # the median
                lat = [x for r in runs for x in r["lat"]]
                dec_tokens = sum(r["dec"] for r in runs)
                row = {"routing": routing.spec(), "sequences": n, "way": "together" if together else "one after another",
                       "reps": len(runs), "tok_s": tok_s, "x_one_after_another": tok_s / base if base else 1.0,
                       "latency_mean_s": sum(lat) / len(lat), "latency_max_s": max(lat),
                       "decode_steps": sum(r["steps"] for r in runs) // len(runs),
                       "reads_per_token": sum(r["loads"] for r in runs) / dec_tokens if dec_tokens else 0.0,
                       "mib_read_per_token": sum(r["read"] for r in runs) / dec_tokens / 2**20 if dec_tokens else 0.0,
                       "misses_per_token": sum(r["misses"] for r in runs) / max(1, sum(r["routed"] for r in runs))}
                base = base or tok_s
                rows.append(row)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        dec.close()
        llm.close()
        if rows:
            print_parallel_table(rows)
        print(f"interrupted: {len(rows)} row(s) finished", file=sys.stderr)
        return 130
    print(file=sys.stderr)
    dec.close()
    llm.close()
    from ..evaluate import write_rows

    for path, fmt in ((args.csv, "csv"), (args.json, "json")):
        if path:
            write_rows(rows, path, fmt)
    print_parallel_table(rows)
    return 0


def print_parallel_table(rows: list) -> None:
    print(f"{'routing':<18} {'way':<18} {'tok/s':>8} {'x':>6} {'latency s':>15} {'steps':>6} {'reads/tok':>9} "
          f"{'MiB/tok':>8}")
    for r in rows:
        print(f"{r['routing']:<18} {r['way']:<18} {r['tok_s']:>8.1f} {r['x_one_after_another']:>5.2f}x "
              f"{r['latency_mean_s']:>6.2f} (max {r['latency_max_s']:>4.2f}) {r['decode_steps']:>6} "
              f"{r['reads_per_token']:>9.2f} {r['mib_read_per_token']:>8.2f}")


def bench_one(llm, routing, prompts, args, a: dict) -> None:
    """One repetition of one routing setting over every prompt, from an empty cache, added to ``a``."""
    from ..config import Preset

    if not isinstance(routing, Preset):  # (a preset sets its own eviction; the others run with --eviction)
        llm.set_eviction(args.eviction or "lru")
    llm.moecache.clear()
    llm.reset_moe_stats()
    llm.set_routing(routing)
    for prompt in prompts:
        llm.reset()
        _perf_reset(llm)
        llm(prompt, max_tokens=args.n, **sampling_kwargs(args, llm))
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
    a["reps"] += 1


def bench_row(spec: str, a: dict, K: int, n_expert: int, cache_size: int, residency: str) -> dict:
    """A bench row from one setting's sums over its finished repetitions."""
    return {
        "routing": spec,
        "cache_size": cache_size,
        "n_expert": n_expert,
        "reps": a["reps"],
        "prompt_tok_s": a["pt"] / a["ps"] if a["ps"] else 0.0,
        "decode_tok_s": a["dt"] / a["ds"] if a["ds"] else 0.0,
        "miss_rate": a["misses"] / (K * a["layer_tokens"]) if a["layer_tokens"] else 0.0,
        "misses_per_token": a["misses"] / a["routed"] if a["routed"] else 0.0,
        "lifetime": sum(a["lifetime"]) / len(a["lifetime"]),
        "mib_loaded_per_run": a["loaded"] / a["reps"] / 2**20,
        "residency": residency,
        "mib_read_per_token": a["read"] / a["dec"] / 2**20 if a["dec"] else 0.0,
        "io_ms_per_token": a["io"] / a["dec"] if a["dec"] else 0.0,
        "route_ms_per_token": a["route"] / a["dec"] if a["dec"] else 0.0,
        "compute_ms_per_token": max(0.0, 1e3 * a["ds"] / a["dt"] - (a["io"] + a["route"]) / a["dec"])
        if a["dt"] and a["dec"] else 0.0,
        "rss_mib": a["rss"] / 2**20,
    }


def print_bench_table(rows: list) -> None:
    hdr = (f"{'routing':<16} {'cache':>7} {'prompt tok/s':>12} {'decode tok/s':>12} {'miss %':>7} {'miss/tok':>8} "
           f"{'lifetime':>8} {'MiB loaded':>10} {'MiB read/tok':>12} {'compute ms':>10} {'I/O ms':>7} {'route ms':>8} {'RSS MiB':>8}")
    print(hdr)
    for r in rows:
        print(f"{r['routing']:<16} {r['cache_size']:>3}/{r['n_expert']:<3} {r['prompt_tok_s']:>12.1f} {r['decode_tok_s']:>12.1f} "
              f"{100 * r['miss_rate']:>7.1f} {r['misses_per_token']:>8.2f} {r['lifetime']:>8.1f} {r['mib_loaded_per_run']:>10.2f} "
              f"{r['mib_read_per_token']:>12.3f} {r['compute_ms_per_token']:>10.2f} {r['io_ms_per_token']:>7.2f} "
              f"{r['route_ms_per_token']:>8.3f} {r['rss_mib']:>8.0f}")


def _info_gpu_memory(args, info):
    """(free bytes, the words for where) of the GPU ``info`` plans GPU layers for: ``--gpu-mem SIZE``
    as given; by default (``auto``) what this build's GPUs and the ``--rpc`` servers report free, as
    ``run -ngl`` reads it, where there is one; (None, "") where none is planned (``none``, no GPU,
    a GPU that shares the host's memory, a dense model)."""
    from ..config import parse_bytes
    from ..plan import device_free_memory, has_gpu

    spec = (args.gpu_mem or "auto").strip().lower()
    if spec == "none":
        return None, ""
    if spec != "auto":
        n = parse_bytes(args.gpu_mem)
        if not n:
            raise UserError(f"--gpu-mem {args.gpu_mem}: give the GPU's free memory with a unit (8G, 512MiB), auto or "
                            "none")
        if not info.is_moe:
            raise UserError(f"--gpu-mem is for MoE models: {info.path} has no routed experts")
        return n, f"a GPU with {args.gpu_mem} free"
    asked = args.gpu_mem is not None or args.rpc is not None
    if args.rpc is not None:
        from .. import rpc
        from ..errors import Error
        from .options import device_kwargs

        endpoints = device_kwargs(args)["rpc_servers"]  # (parsed as run's --rpc is; UserError if malformed)
        try:
            for endpoint in endpoints:
                rpc.add_server(endpoint)
        except Error as e:
            raise UserError(f"--rpc: {e}") from None
    if not info.is_moe:
        if asked:
            raise UserError(f"--gpu-mem / --rpc plan GPU layers for MoE models: {info.path} has no routed experts")
        return None, ""
    seen = has_gpu()
    free = device_free_memory() if seen else None
    if free is None:
        if asked:
            flag = "--gpu-mem auto" if args.gpu_mem is not None else "--rpc"
            raise UserError(f"{flag}: " + (
                "the GPU reports no memory of its own (it shares the host's, which the memory plan counts)" if seen else
                "ggml sees no GPU here (this build's backends found none, and no --rpc server was given): give its "
                "free memory instead, e.g. --gpu-mem 8G"))
        return None, ""
    where = "the --rpc server's device" if args.rpc is not None else "this machine's GPU"
    return free, f"{where} (its free memory as it reports it)"


def cmd_info(args) -> int:
    from ..config import parse_memory
    from ..errors import Error
    from ..model_info import model_info
    from ..plan import auto_cache_size, gpu_plan_rows, memory_plan, total_memory

    info = model_info(resolve_model(args.model, args))
    try:
        budget = parse_memory(args.ram, total_memory()) if args.ram else None
    except Error as e:
        raise UserError(f"--ram: {e}") from None
    if args.ctx is not None and args.ctx < 0:
        raise UserError(f"-c must be >= 0 (0: the model's training context), got {args.ctx}")
    n_ctx = args.ctx or info.n_ctx_train or 512
    plan = companion = fc = gpu = None
    gpu_mem, gpu_where = _info_gpu_memory(args, info)
    if args.forecast and not info.is_moe:
        raise UserError(f"--forecast is for MoE models: {info.path} has no routed experts")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"-t/--threads must be at least 1, got {args.threads}")
    if info.is_moe:  # what --cache-size auto picks with this budget (default: the free memory), all of it planned
        choice = auto_cache_size(info, n_ctx, available=budget)
        n_cached = choice.n_cached
        stated = args.cache_size is not None and args.cache_size.strip() != "auto"
        if stated:
            from ..config import CacheConfig, parse_cache_size

            try:
                n_cached = CacheConfig(size=parse_cache_size(args.cache_size)).n_cached_for(
                    info.n_expert, info.cache_bytes, info.n_moe_layer)
            except Error as e:
                raise UserError(f"--cache-size: {e}") from None
        plan = memory_plan(info, n_ctx, n_cached, available=budget)
        companion = _companion_rows(info, n_cached)
        gpu = gpu_plan_rows(info, n_ctx, gpu_mem, n_cached, keep_ram=stated) if gpu_mem else None
        if args.forecast:
            fc = _forecast_with_companion(info, plan, args)
    if args.json:
        d = {k: v for k, v in vars(info).items()}
        d.update(n_moe_layer=info.n_moe_layer, expert_share=info.expert_share, is_moe=info.is_moe)
        if budget is not None:
            d["cache_size_for_budget"] = plan.n_cached if plan else 0
        d["plan"] = plan.as_dict() if plan else None
        d["lowbit"] = dict(companion) if companion else None
        d["gpu_plan"] = dict(gpu) if gpu else None
        d["gpu_free"] = gpu_mem if gpu else None
        if fc is not None:
            d["forecast"] = dataclasses.asdict(fc)
        print(json.dumps(d, indent=2))
        return 0
    print(info.table())
    if plan is not None:
        where = f"a budget of {args.ram}" if budget is not None else "this machine's free memory"
        size = args.cache_size.strip() if args.cache_size is not None else "auto"
        print(f"\nmemory plan with --cache-size {size}, {where}, a context of {n_ctx} tokens:")
        rows = plan.rows()
        w = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    if gpu:
        print(f"\nGPU layers on {gpu_where}, a context of {n_ctx} tokens:")
        w = max(len(k) for k, _ in gpu)
        print("\n".join(f"{k:<{w}}  {v}" for k, v in gpu))
    if companion:
        print("\nlow-bit companion (--miss; by default a usable one runs lowbit-cache):")
        w = max(len(k) for k, _ in companion)
        print("\n".join(f"{k:<{w}}  {v}" for k, v in companion))
    if fc is not None:
        print(f"\nforecast, the default routing with {fc.share * 100:.0f}% of the experts cached"
              + (" (the companion's copies)" if plan.miss == "lowbit-cache" else "") + f", {args.threads or _threads()} "
              f"thread(s): decode {fc.text()}")
    return 0


def _threads() -> int:
    """llama-cpp-python's default thread count, which run and bench use without -t."""
    return max(1, (os.cpu_count() or 2) // 2)


def _forecast_with_companion(info, plan, args):
    """The forecast of what run does with ``plan``'s cache: with a usable companion beside the model (the
    default, lowbit-cache) its copies, as many as fit in the same memory."""
    import dataclasses

    from .. import lowbit
    from ..forecast import forecast

    try:
        c = lowbit.check_companion(info.path)
    except lowbit.CompanionError:
        c = None
    path = info.path
    if c is not None and plan.streamed:
        n = min(info.n_expert, int(plan.n_cached * c.ratio))
        plan = dataclasses.replace(plan, miss="lowbit-cache", n_cached=n, slot_bytes=c.expert_bytes,
                                   expert_bytes=c.expert_bytes)
        path = c.path
    return forecast(plan, info.n_layer, args.threads or _threads(), model_expert_bytes=info.expert_bytes, path=path)


def _companion_rows(info, n_cached: "int | None" = None) -> list:
    """(what, value) rows of the low-bit companion beside the model: what a miss reads from it, what
    its pools cost, how many copies a cache of ``n_cached`` experts holds, or how to make one."""
    from .. import lowbit
    from ..plan import _fmt

    try:
        c = lowbit.check_companion(info.path)
    except lowbit.CompanionError as e:
        return [("file", f"none usable: {e}")]
    n = info.n_moe_layer
    return [("file", f"{c.path} ({', '.join(c.types)})"),
            ("per miss", f"{_fmt(c.expert_bytes)} against {_fmt(c.model_expert_bytes)} at full precision "
                         f"({c.ratio:.2f}x fewer bytes on the critical path)"),
            ("pool", f"{_fmt((info.n_expert_used + 1) * c.expert_bytes * n)}: {info.n_expert_used} slots and a zero "
                     "slot per layer, read per token"),
            ("--lowbit-in-ram", f"{_fmt((info.n_expert + 1) * c.expert_bytes * n)}: every copy in memory, no read on "
                                "the critical path"),
            ("lowbit-cache", f"the cache holds its copies, {c.ratio:.2f}x as many in the same memory"
                             + (f": {min(info.n_expert, int(n_cached * c.ratio))} of {info.n_expert} per layer "
                                f"for the plan's {n_cached}" if n_cached is not None else ""))]


def add_commands(sub) -> None:
    """Register ``run``, ``bench`` and ``info`` on the CLI's subparsers."""
    r = sub.add_parser("run", help="generate text and print cache statistics",
                       description="Generate text from a prompt, then print one line of speed and cache statistics.",
                       epilog="Coming from llama.cpp: -m, -p, -f, -n, -c, -t, -tb, -b, -ub, -fa, -ngl, -s, -sys, -cnv, -st, "
                              "-co, -hf/-hff, --mlock, --no-mmap, -v and the sampling options mean what they mean "
                              "in llama-cli; --cpu-moe, -ncmoe and -ot ...=CPU are what this runtime does anyway.")
    add_model_argument(r)
    r.add_argument("-p", "--prompt", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    r.add_argument("-f", "--file", default=None, metavar="FILE", help="read the prompt from a UTF-8 text file (default: none)")
    r.add_argument("-n", "--n-predict", "--predict", dest="n", type=int, default=64, metavar="N",
                   help="tokens to generate; 0 = evaluate the prompt only (default %(default)s)")
    r.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message with the model's chat template (for a conversation: "
                        "-cnv or pymoecache chat)")
    r.add_argument("-cnv", "--conversation", "-i", "--interactive", dest="conversation", action="store_true",
                   help="an interactive conversation, as llama-cli -cnv (the same as pymoecache chat; -p is the "
                        "first message); -i, llama-cli's interactive mode, is one too (with the chat template) "
                        "(default: off, complete the prompt once)")
    r.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_false",
                   help="complete the prompt once (the default)")
    add_conversation_options(r)  # -sys without -cnv: one turn with that system prompt
    add_runtime_options(r)
    add_sampling_options(r)
    r.add_argument("--json", action="store_true", help="print one JSON object (text and stats) instead of streaming")
    r.add_argument("--stats-stderr", action="store_true",
                   help="print the stats line on stderr: the default now, as llama-cli writes its timings there "
                        "(stdout holds the prompt and the text alone)")
    r.add_argument("--stats-stdout", action="store_true",
                   help="print the stats line on stdout after the text, as earlier versions did (default: stderr)")
    r.add_argument("--no-display-prompt", dest="display_prompt", action="store_false",
                   help="do not print the prompt before the text, as llama-cli (default: printed)")
    r.add_argument("-sp", "--special", action="store_true",
                   help="print special tokens (end of text, chat markers) in the text, as llama-cli (default: not)")
    r.add_argument("--simple-io", action="store_true",
                   help="accepted for llama-cli's command lines: the output is plain text already")
    r.add_argument("--timeline", metavar="FILE", default=None,
                   help="record what every token did (each layer's routing, its experts' matmuls in the order "
                        "they arrived and each wait for one, each expert read on the reader threads: queued, "
                        "started, finished, bytes) and write it as Chrome "
                        "trace-event JSON, which https://ui.perfetto.dev opens; also prints the overlap: the share "
                        "of read time hidden behind compute (default: none)")
    r.add_argument("--timeline-plot", metavar="PNG", default=None,
                   help="draw the median decoded token and the next of that recording as a picture (needs "
                        "matplotlib; default: none)")
    add_hub_options(r)
    add_routing_options(r, profile=True)
    r.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="compare routing policies on the same prompts (tok/s, miss rate, lifetime)",
                       description="Run the same prompts under each routing setting (settings rotate between "
                                   "repetitions, the cache starts empty for each) and print one row per setting. "
                                   "Timings are llama.cpp's own prompt and decode counters.")
    add_model_argument(b)
    b.add_argument("--routing", default=f"preset:{DEFAULT_PRESET},lru,prior:0.5,max-rank:8,cumsum:0.9", metavar="SPECS",
                   help="comma-separated routing specs; the decode speed forecast (the default routing's) is printed "
                        "beside the rows of a preset (default %(default)s: the default routing first)")
    b.add_argument("--top-j", type=int, default=None, metavar="J", help="Top-J for every spec (default: by the model's K, 1 for K <= 3, 2 for K >= 4)")
    b.add_argument("--scope", choices=["all", "decode"], default="all",
                   help="route every token (all, default) or generated tokens only (decode)")
    b.add_argument("-f", "--file", "--prompts", dest="prompts", metavar="FILE",
                   help="prompts, one per line (default: four built-in prompts)")
    b.add_argument("-n", "--n-predict", "--predict", dest="n", type=int, default=64, metavar="N",
                   help="tokens generated per prompt (default %(default)s)")
    b.add_argument("--reps", type=int, default=1, help="repetitions of every setting (default %(default)s)")
    b.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="N sequences (the prompts, cycled to N) decoded together, as serve -np N batches them, "
                        "against the same N one after another: total tok/s and its ratio, latency, reads per "
                        "token, per routing (default %(default)s: the routing comparison above)")
    add_runtime_options(b)
    add_sampling_options(b)
    b.add_argument("--csv", metavar="FILE", help="also write the table as CSV (default: no file)")
    b.add_argument("--json", metavar="FILE", help="also write the table as JSON (default: no file)")
    add_hub_options(b)
    add_cache_options(b)
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("info", help="describe a GGUF model and plan its memory on this machine",
                       description="Architecture, layers, experts and bytes per expert, read from the GGUF header "
                                   "only; then the memory plan: what --cache-size auto keeps in the free memory "
                                   "(or --ram), the dense part, the KV cache, the headroom, and the reads a decoded "
                                   "token costs against a quick probe of the disk.")
    add_model_argument(i)
    i.add_argument("--ram", metavar="SIZE",
                   help="plan for this much memory instead of what is free now: bytes (8G, 512MiB, 4GB) or a "
                        "share of the machine's (50%%); the dense part, the KV cache and the expert cache all "
                        "come out of it (default: the free memory)")
    i.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=None, metavar="N",
                   help="context to plan the KV cache for (default: the model's training context)")
    i.add_argument("--gpu-mem", metavar="SIZE|auto|none",
                   help="also plan GPU layers for a GPU with this much free memory (8G, 512MiB): what -ngl 99 and "
                        "-ngl auto put on it, and whether the experts fit there or stay in RAM with a VRAM tier of "
                        "what fits (as run decides from the GPU's own report). auto (the default where ggml sees a "
                        "GPU, or with --rpc): the free memory this machine's GPU or the --rpc server reports, as run "
                        "-ngl reads it; none: no GPU plan")
    i.add_argument("--rpc", dest="rpc", default=None, metavar="HOST:PORT,...",
                   help="plan GPU layers for the devices of these ggml RPC servers, as run -ngl N --rpc would "
                        "place them (their reported free memory; default: none)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.add_argument("--forecast", action="store_true",
                   help="also forecast the decode speed (tok/s, with a band) of run with the planned cache, the "
                        "default routing and the companion beside the model if any, from the header, the default "
                        "routing's measured miss rates and quick probes of the disk and the memory")
    i.add_argument("--cache-size", metavar="SIZE", default=None,
                   help="plan (and forecast) this cache size instead of what --cache-size auto picks: experts per "
                        "layer (30), a share (0.25, 25%%) or bytes (4G)")
    i.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="threads the forecast assumes (default: llama.cpp's choice, as run)")
    i.set_defaults(func=cmd_info)
