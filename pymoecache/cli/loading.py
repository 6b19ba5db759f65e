"""The model a generating command (run, chat, bench) runs: its Llama made from the options, the line that says
what it caches, the memory plan's line and the decode forecast after it."""

from __future__ import annotations

import shlex
import sys
import weakref
from pathlib import Path

from .options import UserError, cache_from_args, resolve_seed, runtime_kwargs

_forecasts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a Llama -> its forecast, made once


def llama_from_args(args, routing, model: str, dense_ok: bool = False, **kw):
    """``pymoecache.Llama`` for a generating command (run, chat, bench). A dense model runs as
    plain llama.cpp where ``dense_ok`` (run, chat), with a note; elsewhere it is refused."""
    import warnings

    from ..llama import Llama

    runtime = runtime_kwargs(args)
    if args.ctx == 0:  # (-c 0, the default: the model's training context, capped by the memory as serve's)
        from ..model_info import model_info
        from ..plan import memory_context

        runtime["n_ctx"], note = memory_context(model_info(model))
        if "capped" in note:
            print(f"context {runtime['n_ctx']} tokens{note}; -c N sets it", file=sys.stderr, flush=True)
    with warnings.catch_warnings():  # a dense model's warning: said below in the CLI's words
        warnings.filterwarnings("ignore", message=r".*no MoE layers")
        llm = Llama(model, cache=cache_from_args(args), routing=routing, routing_scope=args.scope,
                    seed=resolve_seed(args), **runtime, **kw)
    if llm.moecache is None:
        if dense_ok:
            print(f"note: {model} is a dense model (no routed experts): it runs as plain llama.cpp, without an "
                  "expert cache; the cache and routing options do nothing here", file=sys.stderr, flush=True)
            return llm
        llm.close()
        raise UserError(f"{model} has no MoE layers (a dense model): there are no experts to cache")
    return llm


def cache_line(llm, routing_spec: str) -> str:
    """``[prior:0.5, cache 30/60 experts per layer]``, with what ``auto`` chose and why."""
    if llm.moecache is None:
        return "[dense model, no expert cache]"
    n = llm.moecache.layer_row(llm.model_info.moe_layers[0])[0][1]  # capacity, known before any token
    why = f"; {llm.cache_choice}" if llm.cache_choice is not None else ""
    if getattr(llm, "preset", None) is not None:  # which preset ran, as what, and what it costs
        p = llm.preset
        routing_spec = (f"preset {p.name}: {llm.moecache.routing.spec()}, {llm.cache_config.eviction} eviction"
                        + ("" if n >= llm.moecache.n_expert else f" ({p.measured()} on our reference models)"))
    return f"[{routing_spec}, cache {n}/{llm.moecache.n_expert} experts per layer{why}]"


def print_plan(llm, forecast: bool = False, asked: "str | None" = None) -> None:
    """The memory plan, one line on stderr, once the command's checks have passed and work begins; where
    the cache streams (or ``forecast``), the decode speed forecast after it (pymoecache.forecast), and where
    a companion the model has not got would read less, how to make it (:func:`companion_tip`; ``asked``: the
    --miss or --lowbit given, which silence it)."""
    plan = llm.memory_plan()
    if plan is not None:
        print(plan.summary(), file=sys.stderr, flush=True)
        if (plan.streamed or forecast) and decode_forecast(llm) is not None:
            print("forecast: decode " + decode_forecast(llm).text(), file=sys.stderr, flush=True)
        tip = companion_tip(plan, llm.model_path, asked, sized_by_memory=llm.cache_choice is not None)
        if tip:
            print(tip, file=sys.stderr, flush=True)


def miss_asked(args) -> "str | None":
    """The --miss or --lowbit given on the command line (None: neither), which silence :func:`companion_tip`."""
    return getattr(args, "miss", None) or getattr(args, "lowbit", None)


def companion_tip(plan, model: str, asked: "str | None", sized_by_memory: bool) -> "str | None":
    """Where the memory left the cache short (``sized_by_memory``: --cache-size auto, the default, chose to stream),
    a miss reads a whole expert by default (no low-bit companion beside the model, no --miss or --lowbit ``asked``)
    and a companion can be made smaller: the command that makes it and what a miss would read then. A model over
    its memory reads most of its decode (Mixtral-8x7B's shape at a third of its file: 4.7x stock's mmap with the
    model alone, 12.1x with a Q2_K companion: docs/benchmarks.md)."""
    from .. import lowbit
    from ..plan import _fmt

    if plan is None or not sized_by_memory or not plan.streamed or plan.miss != "full" or asked:
        return None
    if lowbit.companions_beside(model):
        return None  # (one is there and unused: the load said why)
    c = lowbit.companion_estimate(model)
    if c is None or c.ratio < 1.2:
        return None
    size = c.expert_bytes * plan.n_expert * plan.n_moe_layer
    return (f"tip: a miss reads a whole expert ({_fmt(c.model_expert_bytes)}); "
            f"`pymoecache lowbit {shlex.quote(str(model))}`, once, makes {Path(c.path).name} beside it "
            f"({_fmt(size)}), which later runs take by default: the cache then holds {c.ratio:.2f}x as many "
            f"experts in the same memory and a miss reads {c.ratio:.2f}x fewer bytes"
            + (" (--type Q2_K: fewer still, at about 1% perplexity)" if c.type == "Q3_K" else ""))


def decode_forecast(llm):
    """The decode speed forecast of ``llm`` as loaded (its plan, its threads), computed once; None where
    layers are on a GPU or an RPC server (the forecast knows the CPU's costs only)."""
    from .._lib import has_gpu_device
    from ..forecast import forecast

    if llm.model_params.n_gpu_layers != 0 and has_gpu_device():
        return None
    if llm not in _forecasts:
        plan = llm.memory_plan()
        lowbit = llm.cache_config.lowbit if llm.moecache is not None else None
        source = lowbit if plan.miss == "lowbit-cache" and lowbit else llm.model_path
        _forecasts[llm] = forecast(plan, llm.model_info.n_layer, llm.context_params.n_threads,
                                   model_expert_bytes=llm.model_info.expert_bytes, path=source)
    return _forecasts[llm]
