"""Options shared by the commands of the ``pymoecache`` CLI (routing, cache, runtime, download) and
the error type for the user's mistakes. A leaf module: it imports no other command module.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ..config import PRESET_NAMES, ConfigError, parse_override_tensor
from ..errors import Error
from .parser import (EXIT_INTERNAL, EXIT_USAGE, KV_CACHE_TYPES, Parser, _tensor_split,  # noqa: F401  (the parser,
                     gpu_layers, kv_cache_type, on_off, on_off_auto, vram_size)      # its exit codes, value types)

class UserError(Error):
    """An error caused by the command's input: one line on stderr, exit code 2."""


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """MODEL as a positional argument or, as in llama.cpp, ``-m/--model`` (read with :func:`model_arg`)."""
    p.add_argument("model", nargs="?", help="GGUF model file (default: the embedded default model)")
    p.add_argument("-m", "--model", dest="model_opt", metavar="FILE",
                   help="GGUF model file, as llama.cpp's -m (same as MODEL; default: the embedded default model)")


def model_arg(args) -> Optional[str]:
    pos, opt = getattr(args, "model", None), getattr(args, "model_opt", None)
    if pos and opt and pos != opt:
        raise UserError(f"two models given: {pos} and -m {opt}")
    return pos or opt


def add_routing_options(p: argparse.ArgumentParser, multi_cache_size: bool = False,
                        cache_default: str = "auto", profile: bool = False) -> None:
    g = p.add_argument_group("routing (pick one; default: --preset quality where the cache is smaller than the model, "
                             "else the model's own top-K; --routing lru for top-K everywhere)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--prior", type=float, metavar="L",
                   help="logit prior: rank cached experts up by L x the layer's logit range (typical 0.1-1.0; 0.5 is the usual "
                        "point; default: off)")
    x.add_argument("--max-rank", type=int, metavar="M", help="cached experts among the router's top M jump ahead (default: off)")
    x.add_argument("--cumsum", type=float, metavar="T", help="max-rank with M = first rank where cumulative probability >= T (default: off)")
    x.add_argument("--prune", type=int, metavar="R", help="run only the top R experts of each token (default: off)")
    x.add_argument("--routing", metavar="SPEC", help="a spec string: lru, prior:0.5, max-rank:4, cumsum:0.7, prune:3, preset:NAME (default: preset:quality)")
    x.add_argument("--preset", choices=list(PRESET_NAMES), default=None,
                   help="routing and eviction picked from the model's K and the share of experts cached, from what "
                        "they cost on our reference models: quality (prior 0.1, J=1, lfu eviction with decay 0.8; 0.05 for K >= 8: <= 1%% perplexity), balanced "
                        "(prior 0.2, router-mass eviction: <= 2%%), speed (prior 0.3, J=1, router-mass: <= 4%%); "
                        "where every expert is cached, top-k (routing changes nothing there) (default: quality)")
    g.add_argument("--top-j", type=int, default=None, metavar="J",
                   help="the router's top J experts are always used, cached or not (default: by the model's K, "
                        "the published choice: 1 for K <= 3 experts per token, 2 for K >= 4)")
    g.add_argument("--scope", choices=["all", "decode"], default="all",
                   help="route every token through the policy (all, default) or generated tokens only (decode)")
    add_cache_options(p, multi_cache_size, cache_default, profile)


def add_cache_options(p: argparse.ArgumentParser, multi: bool = False, default: str = "auto",
                      profile: bool = False) -> None:
    """The cache group; profile: --profile and --pin-hot too (the commands that save one: run, chat, serve)."""
    c = p.add_argument_group("cache")
    what = (f"experts cached per MoE layer, default {default}: a count (30), a share of the routed experts (0.5), "
            "a memory budget for all layers (4GiB), or auto (as many as fit in the free memory less the non-expert "
            "weights, the KV cache and a margin; all of them when the model fits, as plain llama.cpp)")
    if multi:
        c.add_argument("--cache-size", nargs="+", default=[default], metavar="N|F|BYTES",
                       help=what + "; several values sweep several sizes")
    else:
        c.add_argument("--cache-size", default=default, metavar="N|F|BYTES|auto", help=what)
    c.add_argument("--insertion", choices=["top-bottom", "bottom-top"], default="top-bottom",
                   help="order in which one token's new experts enter the cache (default top-bottom)")
    c.add_argument("--prefetch", choices=["auto", "off", "gate", "previous", "trace"], default="auto",
                   help="predict a later layer's experts while decoding and bring them in early: gate (that layer's "
                        "router on this layer's input), previous (what it selected for the previous token), trace "
                        "(this request's expert counts matched against past requests); with stream residency they "
                        "are read in the background. auto (default): with stream residency, gate reading ahead "
                        "into 2 spare slots per layer (the routing and the output stay those without it; it "
                        "switches itself off where it loses; a memory budget pays for the spare slots), off "
                        "otherwise")
    c.add_argument("--prefetch-distance", type=int, default=1, metavar="D",
                   help="predict layer l + D during layer l, 1..8 (default %(default)s)")
    c.add_argument("--prefetch-min-p", type=float, default=0.0, metavar="P",
                   help="gate and trace: prefetch a predicted expert only if its predicted probability is at least "
                        "P, in [0, 1]: fewer wasted reads on a slow disk, fewer experts brought in early "
                        "(default %(default)s: every predicted expert)")
    c.add_argument("--eviction", choices=["lru", "lfu", "activation", "freq-prob", "router-mass"], default=None,
                   help="which cached expert leaves for a new one: lru (least recently used), lfu (fewest recent "
                        "selections), activation (MoE-Infinity: lowest share of this request's selections), "
                        "freq-prob (fMoE: recent selections x the router's probability), router-mass (lowest "
                        "recent sum of router probability) (default lru, or the --preset's)")
    c.add_argument("--eviction-decay", type=float, default=0.95, metavar="G",
                   help="per-token decay of what lfu, freq-prob and router-mass count, in (0, 1]; 0.95 remembers "
                        "about 20 tokens (default %(default)s)")
    if multi:  # ppl: quality does not depend on where the experts live; evaluation keeps them resident
        return
    _add_residency_options(c)
    if not profile:
        return
    c.add_argument("--profile", metavar="FILE",
                   help="usage profile: which experts past runs selected. Loaded at start if FILE exists (the cache "
                        "starts with each layer's most used experts), saved back at the end with this run added "
                        "(default: none)")
    c.add_argument("--pin-hot", type=int, default=0, metavar="N",
                   help="with --profile: keep each layer's N most used experts cached, never evicted (at most the "
                        "cache size less K; default 0)")


def _add_residency_options(c) -> None:
    c.add_argument("--residency", choices=["auto", "stream", "mmap", "none"], default="auto",
                   help="where expert weights live: stream (cached experts in an mlocked slot arena, misses read "
                        "from the GGUF with direct I/O), mmap (experts mmapped, cached ones mlocked, evicted ones "
                        "dropped), none (all resident, the cache only counts); auto = stream when the cache is "
                        "smaller than all experts, else none (default auto)")
    c.add_argument("--io-threads", type=int, default=8, metavar="T",
                   help="expert reads in flight at once on a miss (default 8)")
    c.add_argument("--prefetch-threads", type=int, default=0, metavar="T",
                   help="stream with --prefetch: of the --io-threads readers, how many may read ahead at once, "
                        "0 = all; a miss waits at most for the prefetch chunks they are reading (default 0)")
    c.add_argument("--prefetch-spare", type=int, default=0, metavar="S",
                   help="stream with --prefetch: read the predicted experts into S spare slots per layer instead of "
                        "inserting them into the cache, so routing, hits and misses stay exactly those without "
                        "prefetch and only the waits change; costs S experts per layer of memory (default 0: a "
                        "prefetch is an insertion)")
    c.add_argument("--predictor", metavar="FILE",
                   help="gate prefetch: predict the next layers' experts with the predictors in FILE, fitted on a "
                        "text for this model (pymoecache.tune.fit_predictor, scripts/fit_predictor.py), instead of "
                        "their routers; only what is read ahead changes (default: the routers)")
    c.add_argument("--prefetch-budget", type=float, default=0.0, metavar="W",
                   help="with --prefetch-spare (and prefetch auto): the reads ahead of a layer may waste at most W "
                        "experts per read-ahead expert a token used (plus one per 32 tokens; one the routing picked "
                        "only because it was being read counts as unused), whatever the disk's timing, so the same "
                        "run reads the same experts; negative: no budget (default 0)")
    c.add_argument("--no-prefetch-route", dest="prefetch_route", action="store_false",
                   help="with --prefetch-spare (and prefetch auto): the routing does not count the experts being read "
                        "ahead as cached (default: the prior prefers them, so a token picks what is in flight over "
                        "what is not)")
    c.add_argument("--prefetch-adaptive", action=argparse.BooleanOptionalAction, default=False,
                   help="with --prefetch-spare (and prefetch auto): instead of --prefetch-budget, the reads ahead switch "
                        "themselves off unless tokens with them ran at least 2%% faster in a timed trial of 32 tokens, "
                        "with and without them in turn; the routing then does not count them, since it would follow "
                        "the clock (default: off)")
    c.add_argument("--vram-size", type=vram_size, default=0, metavar="N|auto",
                   help="with -ngl: keep N experts per layer in GPU memory as well (a VRAM tier over the cache; the "
                        "layers whose dense part is on a discrete GPU or an --rpc server), where a decoded token "
                        "computes them; the cache streams (a model that fits in RAM: every expert in it, the hot ones "
                        "on the GPU, the routing steered to them). auto: as many as fit in the GPUs' free memory "
                        "(less 1 GiB, as llama.cpp's --fit), others than the RAM cache's where it holds fewer than "
                        "every expert (--vram-exclusive). Without it, with --residency auto: every expert on the GPU "
                        "where they fit, else auto (a model larger than RAM: RAM and GPU together hold more); "
                        "--residency stream: none")
    c.add_argument("--no-batch-share", dest="batch_share", action="store_false",
                   help="sequences decoded together (serve -np, bench --parallel): route each as if alone, without "
                        "counting the experts the other sequences of the step select as cached, and with the "
                        "prior's own strength (default: counted, the prior --batch-prior times stronger)")
    c.add_argument("--batch-prior", type=float, default=3.0, metavar="X",
                   help="sequences decoded together under a prior: its strength times X in a step of several (one "
                        "cache serves them all, so each finds less of its own in it); 1 = as alone (default "
                        "%(default)s: on the trained benchmark model at a quarter cache, half the reads of a step "
                        "for +0.07%% perplexity against the default routing alone)")
    c.add_argument("--vram-exclusive", action="store_true",
                   help="with --vram-size: an expert in GPU memory keeps no host slot, so RAM and VRAM together hold "
                        "--cache-size + --vram-size experts per layer (a model larger than the RAM cache; none read "
                        "again after warm-up where that is all of them); an expert the tier evicts moves down into "
                        "RAM (default: the tier copies part of the RAM cache)")
    c.add_argument("--vram-fill", choices=["auto", "copy", "cpu"], default="auto",
                   help="with --vram-size: a selected expert not in GPU memory is copied up (copy, evicting by "
                        "--eviction as the cache does), computed on the CPU (cpu; only free GPU slots are filled), or "
                        "copied when the measured copy time beats the CPU's time for it (auto, the default)")
    c.add_argument("--miss", choices=["full", "lowbit", "lowbit-all", "lowbit-cache", "auto"], default=None,
                   help="with streaming, what a decoded token's miss is computed from: its full copy, read now "
                        "(full); its copy in the low-bit companion, a fraction of the bytes, the full "
                        "copy read behind the token for its next use (lowbit); every selection from the companion "
                        "(lowbit-all); a cache of the companion's copies, as many as fit in the cache's memory, "
                        "every read from the companion (lowbit-cache: every expert at the low type; faster and no "
                        "worse than lowbit on every measured model); lowbit-cache where a usable companion is "
                        "found, else full (auto). Default: auto, quietly where the model has no companion (the plan "
                        "line says which ran). Make one with `pymoecache lowbit MODEL`")
    c.add_argument("--lowbit", metavar="FILE", default=None,
                   help="the low-bit companion --miss reads (default: MODEL.lowbit-*.gguf beside the model)")
    c.add_argument("--lowbit-in-ram", action="store_true",
                   help="with --miss lowbit: read every expert's low-bit copy into memory at load (costs the "
                        "companion's size, shown by the plan line) so that a miss computed from it waits for no "
                        "read (default: a few slots per layer, read from the companion per token)")
    c.add_argument("--lowbit-max-p", type=float, default=1.0, metavar="P",
                   help="with --miss lowbit: a miss whose router probability is at least P is read at full "
                        "precision, on the token's critical path (HOBBIT's rule: the experts that weigh most); "
                        "1 = every miss from the companion (default %(default)s)")
    c.add_argument("--vram-copy", choices=["async", "sync"], default="async",
                   help="with --vram-size: copies up go to a second GPU stream while the CPU computes its own "
                        "experts, waited for just before the GPU's, and with prefetch the next layer's predicted "
                        "experts go up ahead of its routing (async, the default); or they are made one after the "
                        "other before any expert matmul (sync)")
    c.add_argument("--unified", choices=["auto", "on", "off"], default="auto",
                   help="with -ngl and stream residency: the GPU computes the experts in place on the host slots, "
                        "wrapped as GPU buffers (no copies): auto (the default) where the GPU shares the host's memory "
                        "(Apple silicon, integrated GPUs), on also for a discrete GPU that can wrap host memory "
                        "(Vulkan; CUDA with our patch), off leaves them to the CPU as llama.cpp's --cpu-moe. With "
                        "--vram-size and --cache-size 1.0 a token's MoE layers then run on the GPU alone (the direct "
                        "tier): on takes it, auto takes it on a discrete GPU where a trial of the first 32 decoded "
                        "tokens finds it faster than the tier's round trip to the CPU")
    c.add_argument("--no-mlock", action="store_true",
                   help="do not mlock the expert cache nor the model's dense part (default: lock both, so that the OS "
                        "cannot drop them and read them back every token; if it refuses, one warning)")
    c.add_argument("--no-direct-io", action="store_true",
                   help="stream: read experts through the page cache, then drop them (default: O_DIRECT)")


def add_device_options(p: argparse.ArgumentParser, evaluation: bool = False) -> None:
    """-ngl and --rpc, as llama.cpp takes them (``run``, ``serve``, ``chat``, ``bench``; ``ppl`` with
    ``evaluation``: every expert where llama.cpp puts it, the cache counting)."""
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=gpu_layers, default=None,
                   metavar="N|all|auto",
                   help="layers to offload to a GPU or an --rpc server, as in llama.cpp: a number, all, or auto "
                        "(default 0): perplexity at a GPU's speed. Their experts go there too, as llama.cpp puts "
                        "them, the cache counting what it would hold (the rows do not depend on where the experts "
                        "are); with a streamed miss path (--miss lowbit-cache) they stay in the cache in RAM"
                        if evaluation else
                        "layers to offload to a GPU or an --rpc server, as in llama.cpp: a number, all, or auto "
                        "(those whose dense part and KV cache fit in the GPU's free memory, less 1 GiB, as llama.cpp's "
                        "--fit; experts that do not fit beside stay in RAM, the GPU keeping what fits) (default 0). "
                        "With --residency stream or mmap their dense part (attention, "
                        "norms, routers, shared experts) goes to the device and the routed experts stay in this "
                        "process's cache, as llama.cpp's --cpu-moe places them")
    p.add_argument("--rpc", dest="rpc", default=None, metavar="HOST:PORT,...",
                   help="ggml RPC servers whose devices take the -ngl layers, as llama.cpp's --rpc "
                        "(`pymoecache rpc-server` or llama.cpp's rpc-server runs there) (default: none)")
    p.add_argument("-sm", "--split-mode", dest="split_mode", choices=("none", "layer", "row"), default=None,
                   help="how -ngl layers spread over several GPUs, as llama.cpp: none (one GPU, -mg), layer (whole "
                        "layers each) or row (rows of each weight) (default: layer)")
    p.add_argument("-ts", "--tensor-split", dest="tensor_split", type=_tensor_split, default=None, metavar="N0,N1,...",
                   help="the share of the offloaded layers each GPU takes, as llama.cpp, e.g. 3,1 (default: by their "
                        "free memory)")
    p.add_argument("-mg", "--main-gpu", dest="main_gpu", type=int, default=None, metavar="I",
                   help="the GPU that takes the model with -sm none, and the intermediate results with -sm row, as "
                        "llama.cpp (default 0)")
    p.add_argument("-fit", "--fit", dest="fit", type=on_off, nargs="?", const="on", default=None, metavar="on|off",
                   help="llama.cpp's --fit: on (a bare -fit too) sets -ngl to auto where -ngl is not given: the "
                        "layers whose dense part and KV cache fit in the GPU's free memory; off leaves -ngl as given "
                        "(default here: off, -ngl 0, the CPU)")
    if evaluation:  # (run, chat, serve, bench take it with the runtime options)
        p.add_argument("-fa", "--flash-attn", dest="flash_attn", type=on_off_auto, default="auto",
                       metavar="on|off|auto", help="flash attention, as llama-perplexity's -fa (default: auto)")


def add_runtime_options(p: argparse.ArgumentParser, ctx_default: int = 0, seed: bool = True) -> None:
    """Context, threads, batches, GPU layers, memory flags and seed, with llama.cpp's short and long
    names (its multi-letter short flags such as -tb and -fa are whole options here too, as there)."""
    if seed:
        p.add_argument("-s", "--seed", type=int, default=-1, metavar="N",
                       help="random seed; -1 = a random one, printed (default %(default)s, as llama.cpp)")
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=ctx_default, metavar="N",
                   help=f"context length in tokens (default {ctx_default}"
                        + (": the model's training context" if ctx_default == 0 else "; 0: the model's training context")
                        + ", halved while its KV cache would take over a quarter of the memory left beside the "
                          "dense part)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads while generating (default: llama.cpp's choice)")
    p.add_argument("-tb", "--threads-batch", dest="threads_batch", type=int, default=None, metavar="N",
                   help="CPU threads for prompts and batches (default: same as --threads)")
    p.add_argument("-b", "--batch-size", dest="batch_size", type=int, default=None, metavar="N",
                   help="logical batch: prompt tokens submitted at once (default: llama-cpp-python's 512)")
    p.add_argument("-ub", "--ubatch-size", dest="ubatch_size", type=int, default=None, metavar="N",
                   help="physical batch: prompt tokens computed at once (default: llama-cpp-python's 512)")
    p.add_argument("-fa", "--flash-attn", dest="flash_attn", type=on_off_auto, default="auto", metavar="on|off|auto",
                   help="flash attention, as llama.cpp: auto lets llama.cpp turn it on where every device computing "
                        "attention supports it (the CPU does) (default: auto, as llama.cpp)")
    p.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", type=kv_cache_type, default=None, metavar="TYPE",
                   help="the KV cache's type of K, as llama.cpp: " + ", ".join(KV_CACHE_TYPES) + " (default f16)")
    p.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", type=kv_cache_type, default=None, metavar="TYPE",
                   help="the KV cache's type of V, as -ctk; a quantized V needs flash attention (-fa on or auto, "
                        "which the CPU supports) (default f16)")
    p.add_argument("-nkvo", "--no-kv-offload", dest="no_kv_offload", action="store_true",
                   help="keep the KV cache in CPU memory when -ngl offloads layers, as llama.cpp (default: the KV "
                        "cache of an offloaded layer is on its device)")
    p.add_argument("-cb", "--cont-batching", dest="cont_batching", action="store_true",
                   help="accepted for llama.cpp's command lines: serve -np N batches its slots continuously anyway")
    add_device_options(p)
    p.add_argument("-cmoe", "--cpu-moe", dest="cpu_moe", action="store_true",
                   help="keep the experts in CPU memory beside -ngl layers, as llama.cpp; with --residency stream or "
                        "mmap they are there anyway (streamed or cached in RAM)")
    p.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", type=int, default=None, metavar="N",
                   help="keep the experts of the first N layers in CPU memory beside -ngl layers, as llama.cpp "
                        "(its static split: the device computes the other layers' experts; with --residency stream "
                        "or mmap every expert is in CPU memory anyway)")
    p.add_argument("-ot", "--override-tensor", dest="override_tensor", default=None, metavar="PATTERN=BUFT,...",
                   help="llama.cpp's tensor buffer overrides: the tensors PATTERN matches go to CPU memory (only =CPU "
                        "is available: the expert cache places the experts in CPU memory, -ngl the other weights); "
                        "other buffer types are refused")
    p.add_argument("--mlock", action="store_true",
                   help="lock the model in RAM, as llama.cpp; the expert cache and the dense part are locked by "
                        "default already, this adds the rest with --residency none (default: off)")
    p.add_argument("--no-mmap", dest="no_mmap", action="store_true",
                   help="read the whole model into memory instead of mapping it, as llama.cpp; only with "
                        "--residency none: streamed and mapped experts are read from the mapped file (default: off)")
    p.add_argument("-nr", "--no-repack", dest="no_repack", action="store_true",
                   help="keep the dense part's weights in the file's layout, as llama.cpp's --no-repack; by default "
                        "llama.cpp copies those of some types (Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2 or ARM) into faster "
                        "layouts at load (the routed experts stay in the file's either way)")
    p.add_argument("--no-warmup", dest="no_warmup", action="store_true",
                   help="accepted for llama.cpp's command lines: pymoecache runs no warm-up pass, so there is "
                        "nothing to skip (said once)")
    p.add_argument("-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
                   help="print llama.cpp's log on stderr (default: off)")
    p.add_argument("--log-disable", dest="verbose", action="store_false",
                   help="no llama.cpp log (the default here)")


def use_color(args, stream=None) -> bool:
    """-co/--color: on, off, or auto (a terminal, TERM is not dumb and NO_COLOR is unset)."""
    mode = getattr(args, "color", "off")
    if mode != "auto":
        return mode == "on"
    stream = stream if stream is not None else sys.stdout
    return (hasattr(stream, "isatty") and stream.isatty() and os.environ.get("TERM", "") != "dumb"
            and "NO_COLOR" not in os.environ)


def resolve_seed(args) -> int:
    """-s/--seed, with -1 (the default) replaced by a random seed, kept in args so it can be printed."""
    if getattr(args, "seed", 0) < 0:
        import random

        args.seed = random.randrange(2**31)
    return args.seed


def runtime_kwargs(args) -> dict:
    """Keyword arguments of ``pymoecache.Llama`` for the runtime options; UserError for a flag that
    cannot mean anything with the residency in force (said before anything loads)."""
    if getattr(args, "n_cpu_moe", None) is not None and args.n_cpu_moe < 0:
        raise UserError(f"--n-cpu-moe must be >= 0, got {args.n_cpu_moe}")
    ot = getattr(args, "override_tensor", None)
    if ot is not None:
        try:
            parse_override_tensor(ot)
        except ConfigError as e:
            raise UserError(f"-ot {e}") from None
    if getattr(args, "mlock", False) and getattr(args, "no_mlock", False):
        raise UserError("give either --mlock or --no-mlock, not both")
    for name in ("threads_batch", "batch_size", "ubatch_size"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    kw = dict(n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
              verbose=bool(getattr(args, "verbose", False)))
    if getattr(args, "cpu_moe", False) or getattr(args, "n_cpu_moe", None):  # (buffer overrides, as llama-cli's)
        kw["n_cpu_moe"] = "all" if getattr(args, "cpu_moe", False) else args.n_cpu_moe
    if ot:
        kw["override_tensor"] = ot
    if getattr(args, "repeat_last_n", None) is not None:
        kw["last_n_tokens_size"] = args.repeat_last_n  # (llama-cpp-python's window of the penalties)
    if getattr(args, "threads_batch", None) is not None:
        kw["n_threads_batch"] = args.threads_batch
    if getattr(args, "batch_size", None) is not None:
        kw["n_batch"] = args.batch_size
    if getattr(args, "ubatch_size", None) is not None:
        kw["n_ubatch"] = args.ubatch_size
    if getattr(args, "flash_attn", None) is not None:
        kw["flash_attn"] = {"on": True, "off": False}.get(args.flash_attn, args.flash_attn)  # ('auto': llama.cpp's)
    for name, key in (("cache_type_k", "type_k"), ("cache_type_v", "type_v")):
        if getattr(args, name, None) is not None:
            kw[key] = KV_CACHE_TYPES[getattr(args, name)]
    if kw.get("type_v", 1) not in (0, 1, 30) and kw.get("flash_attn") is False:
        raise UserError(f"-ctv {args.cache_type_v} needs flash attention (llama.cpp keeps a quantized V only with "
                        "it): drop -fa off, or keep V at f16")
    if getattr(args, "no_kv_offload", False):
        kw["offload_kqv"] = False
    if getattr(args, "mlock", False):
        kw["use_mlock"] = True
    if getattr(args, "no_mmap", False):
        kw["use_mmap"] = False
    if getattr(args, "no_repack", False):
        kw["repack"] = False
    kw.update(device_kwargs(args))
    return kw


def device_kwargs(args) -> dict:
    """``n_gpu_layers`` and ``rpc_servers`` of ``pymoecache.Llama`` from -ngl and --rpc (add_device_options)."""
    kw = dict(n_gpu_layers=getattr(args, "n_gpu_layers", 0) or 0)
    if getattr(args, "fit", None) == "on" and getattr(args, "n_gpu_layers", None) is None:  # (-ngl not given)
        kw["n_gpu_layers"] = "auto"
    if getattr(args, "split_mode", None) is not None:
        kw["split_mode"] = {"none": 0, "layer": 1, "row": 2}[args.split_mode]
    if getattr(args, "tensor_split", None) is not None:
        kw["tensor_split"] = args.tensor_split
    if getattr(args, "main_gpu", None) is not None:
        if args.main_gpu < 0:
            raise UserError(f"-mg must be >= 0, got {args.main_gpu}")
        kw["main_gpu"] = args.main_gpu
    if getattr(args, "flash_attn", "auto") != "auto":
        kw["flash_attn"] = args.flash_attn == "on"
    if getattr(args, "rpc", None) is not None:
        from ..rpc import parse_endpoints

        try:
            kw["rpc_servers"] = parse_endpoints(args.rpc)
        except Error as e:
            raise UserError(f"--rpc: {e}") from None
    return kw


def add_template_options(p, serve: bool = False) -> None:
    """llama.cpp's chat-template options (pymoecache.templates), on ``run``, ``chat`` and ``serve``."""
    p.add_argument("--jinja", action="store_true",
                   help="render the model's chat template with Jinja, as llama-server --jinja"
                        + (" (serve: always the case, the flag is accepted)" if serve else
                           " (default: llama.cpp applies it, as llama-cli)"))
    p.add_argument("--chat-template", metavar="NAME", default=None,
                   help="one of llama.cpp's built-in templates instead of the model's: chatml, llama2, llama3, "
                        "mistral-v7, gemma, phi3, deepseek3, ... (an unknown name lists them all)")
    p.add_argument("--chat-template-file", metavar="FILE", default=None,
                   help="a Jinja chat template file instead of the model's (default: the model's; ChatML for a "
                        "model without one, said at start)")


def chat_template_from_args(args, llm, serve: bool = False):
    """The ChatTemplate these options choose for ``llm`` (UserError for a bad name or file)."""
    from ..errors import ConfigError
    from ..templates import ChatTemplate

    try:
        return ChatTemplate(llm, name=getattr(args, "chat_template", None), file=getattr(args, "chat_template_file", None),
                            jinja=getattr(args, "jinja", False), default_jinja=serve)
    except ConfigError as e:
        raise UserError(str(e)) from None


def add_conversation_options(p) -> None:
    """The options of a conversation, shared by ``chat`` and ``run -cnv``."""
    add_template_options(p)
    p.add_argument("-sys", "--system-prompt", dest="system", default=None, metavar="TEXT",
                   help="system prompt, as llama-cli's -sys (default: none)")
    p.add_argument("-sysf", "--system-prompt-file", dest="system_file", default=None, metavar="FILE",
                   help="read the system prompt from a UTF-8 text file (default: none)")
    p.add_argument("-st", "--single-turn", dest="single_turn", action="store_true",
                   help="answer the first message (-p or -f, else the first line read) and leave, as llama-cli "
                        "(default: go on until /quit or Ctrl-D)")
    p.add_argument("--verbose-prompt", action="store_true",
                   help="print each turn's whole prompt, as the chat template renders it, on stderr (default: off)")
    p.add_argument("-co", "--color", dest="color", type=on_off_auto, default="auto", metavar="on|off|auto",
                   help="colour the prompt and your messages apart from the model's text, as llama.cpp; auto: "
                        "when printing to a terminal and NO_COLOR is not set (default auto)")


def add_sampling_options(p: argparse.ArgumentParser, temp_default: float = 0.0) -> None:
    """llama.cpp's sampling options (same names, same defaults except where said)."""
    g = p.add_argument_group("sampling")
    g.add_argument("-r", "--reverse-prompt", dest="reverse_prompt", action="append", default=None, metavar="TEXT",
                   help="stop generating where TEXT appears (not printed), as llama.cpp's -r; may be given more "
                        "than once (default: none)")
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=temp_default, metavar="T",
                   help=f"temperature; 0 = greedy, always the most likely token (default {temp_default:g})")
    g.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="sample among the K most likely tokens; 0 = all (default %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, metavar="P",
                   help="sample among the most likely tokens whose probabilities sum to P; 1.0 = off (default %(default)s)")
    g.add_argument("--min-p", type=float, default=0.05, metavar="P",
                   help="drop tokens less likely than P x the most likely one; 0.0 = off (default %(default)s)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R",
                   help="penalize tokens of the last --repeat-last-n; 1.0 = off (default %(default)s)")
    g.add_argument("--repeat-last-n", type=int, default=64, metavar="N",
                   help="how many of the last tokens the penalties look at; 0 = none (default %(default)s, as llama.cpp)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="A",
                   help="subtract A from the logit of every token already in the last --repeat-last-n; 0.0 = off "
                        "(default %(default)s)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="A",
                   help="subtract A x its count from the logit of every token in the last --repeat-last-n; 0.0 = "
                        "off (default %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="never stop at an end-of-text token, generate until -n or the context is full (default: stop)")
    g.add_argument("--grammar", metavar="GBNF", default=None,
                   help="constrain the output to a GBNF grammar with a 'root' rule, as llama.cpp (default: none)")
    g.add_argument("--grammar-file", metavar="FILE", default=None, help="--grammar read from FILE (default: none)")
    g.add_argument("-j", "--json-schema", dest="json_schema", metavar="SCHEMA", default=None,
                   help="constrain the output to JSON that a JSON schema admits, as llama.cpp's -j, e.g. "
                        "'{\"type\": \"object\"}'; {} is any JSON object (default: none)")
    g.add_argument("-jf", "--json-schema-file", dest="json_schema_file", metavar="FILE", default=None,
                   help="-j read from FILE (default: none)")
    add_escape_options(g)
    g.add_argument("--keep", type=int, default=None, metavar="N",
                   help="llama.cpp's tokens kept when the context shifts: refused here, no context shifts (the "
                        "prompt and -n must fit in -c; chat drops the oldest turns instead)")


def sampling_kwargs(args, llm) -> dict:
    """Keyword arguments of ``Llama.__call__`` / ``create_completion`` for the sampling options."""
    kw = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
              repeat_penalty=args.repeat_penalty, seed=args.seed,
              presence_penalty=getattr(args, "presence_penalty", 0.0),
              frequency_penalty=getattr(args, "frequency_penalty", 0.0))
    if getattr(args, "reverse_prompt", None):
        kw["stop"] = [process_escapes(r) if getattr(args, "escape", False) else r for r in args.reverse_prompt]
    if args.ignore_eos:
        import llama_cpp

        eog = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)]
        kw["logit_bias"] = {t: float("-inf") for t in eog}
    grammar = getattr(args, "grammar", None)
    if getattr(args, "grammar_file", None) is not None:
        if grammar is not None:
            raise UserError("give either --grammar or --grammar-file, not both")
        grammar = read_text_file(args.grammar_file, "grammar file")
    schema = text_or_file(args, "json_schema", "json_schema_file", "-j and -jf", "JSON schema")
    if schema is not None:
        if grammar is not None:
            raise UserError("give either a grammar (--grammar, --grammar-file) or a JSON schema (-j, -jf), not both")
        grammar = _schema_grammar(schema)
    if grammar is not None:
        import llama_cpp

        from ..grammar import check_grammar

        check_grammar(grammar, llm._model.vocab)  # before any work: GrammarError, exit 2
        kw["grammar"] = llama_cpp.LlamaGrammar.from_string(grammar, verbose=False)
    return kw


def _schema_grammar(text: str) -> str:
    """-j: the grammar of a JSON schema given as JSON text (llama.cpp's converter's strings); UserError where it
    is not a schema this can turn into one."""
    import json

    from ..grammar import JSON_GRAMMAR, GrammarError, check_schema_size, json_schema_grammar

    try:
        schema = json.loads(text)
    except ValueError as e:
        raise UserError(f"-j: not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise UserError("-j: a JSON schema is an object, such as {\"type\": \"object\"}")
    try:
        check_schema_size(schema)
        return json_schema_grammar(schema) if schema else JSON_GRAMMAR
    except GrammarError as e:
        raise UserError(f"-j: {e}") from None
    except Exception as e:  # (the converter raises anything from KeyError to RecursionError)
        raise UserError(f"-j: this schema cannot be turned into a grammar: {str(e)[:200]}") from None


def text_or_file(args, text: str, file: str, flags: str, what: str) -> Optional[str]:
    """The text of option ``text`` or the contents of option ``file`` (-p or -f, -sys or -sysf; the
    two ``flags`` name them in the error), not both; None when neither was given."""
    t, f = getattr(args, text, None), getattr(args, file, None)
    if f is None:
        return t
    if t is not None:
        raise UserError(f"give either {flags}, not both")
    return read_text_file(f, what, context_tokens(args))


def system_prompt(args) -> Optional[str]:
    """-sys TEXT or -sysf FILE."""
    return text_or_file(args, "system", "system_file", "-sys/--system-prompt or -sysf/--system-prompt-file",
                        "system prompt file")


def prompt_text(args) -> Optional[str]:
    """-p TEXT (its escapes processed, as llama.cpp, unless --no-escape) or -f FILE (as llama.cpp)."""
    text = text_or_file(args, "prompt", "file", "-p/--prompt or -f/--file", "prompt file")
    if text is not None and getattr(args, "prompt", None) is not None and getattr(args, "escape", False):
        text = process_escapes(text)
    return text


def add_escape_options(p) -> None:
    """llama.cpp's -e/--escape (its default) and --no-escape, for -p and -r."""
    p.add_argument("-e", "--escape", dest="escape", action="store_true", default=True,
                   help="process escapes in -p and -r: \\n, \\r, \\t, \\', \\\", \\\\, \\xHH (default: on, as "
                        "llama.cpp)")
    p.add_argument("--no-escape", dest="escape", action="store_false", help="take -p and -r as typed")


def process_escapes(text: str) -> str:
    r"""llama.cpp's escapes: \n, \r, \t, \', \", \\ and \xHH (two hex digits: one byte, so \xc3\xa9 is
    é); any other backslash stays as typed.

    >>> process_escapes(r"a\nb\tc \x41\xc3\xa9 \q \\n")
    'a\nb\tc Aé \\q \\n'
    """
    raw, out, i = text.encode("utf-8", "surrogateescape"), bytearray(), 0
    simple = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("'"): 39, ord('"'): 34, ord("\\"): 92}
    while i < len(raw):
        if raw[i] == 92 and i + 1 < len(raw):  # a backslash and what follows it
            d = raw[i + 1]
            if d in simple:
                out.append(simple[d])
                i += 2
                continue
            hex2 = raw[i + 2:i + 4]
            if d == ord("x") and len(hex2) == 2 and all(h in b"0123456789abcdefABCDEF" for h in hex2):
                out.append(int(hex2, 16))
                i += 4
                continue
        out.append(raw[i])
        i += 1
    return out.decode("utf-8", "replace")


# No token of any vocabulary we know is longer than this many bytes: a text of more than
# n_ctx x this cannot fit a context of n_ctx tokens, and is refused before it is read whole
# (llama.cpp's tokenizer would otherwise allocate for all of it: std::bad_alloc aborts).
MAX_TOKEN_BYTES = 256


def read_text_file(path: str, what: str, max_tokens: int = 0) -> str:
    """A UTF-8 text file the user named (a prompt), as one string; UserError when it cannot be read,
    is not a regular file (a FIFO would block, /dev/zero never end), or is longer than a context of
    ``max_tokens`` tokens could hold (0: no bound)."""
    from ..files import read_user_text

    limit = max_tokens * MAX_TOKEN_BYTES if max_tokens > 0 else None
    text = read_user_text(path, what, limit, UserError,
                          too_large=f"is too long for the context: more than {limit} bytes cannot fit {max_tokens} "
                                    f"tokens; use a shorter file or a larger context (-c)")
    return text.replace("\r\n", "\n").replace("\r", "\n")  # (universal newlines, as text mode reads it)


def context_tokens(args) -> int:
    """The context the command will have, in tokens, as far as it is known before the model loads:
    -c N, else the local model's training context (its header), else 262144 (no larger is common)."""
    if getattr(args, "ctx", 0):
        return int(args.ctx)
    path = model_arg(args) if not (getattr(args, "hf_repo", None) or getattr(args, "hf_file", None)) else None
    try:
        from ..model_info import model_info
        from ..models import default_model_path

        n = model_info(path or default_model_path()).n_ctx_train
    except Exception:  # (no such file, or not a model: the load says so, with its own message)
        n = 0
    return int(n) if n and n > 0 else 262144


def add_hub_options(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("download (instead of MODEL)")
    h.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", metavar="OWNER/REPO[:QUANT]",
                   help="Hugging Face repository to download the GGUF from, as llama.cpp's -hf: the file whose name "
                        "carries QUANT (case-insensitive; default Q4_K_M, else the first GGUF), downloaded once with "
                        "progress into the Hugging Face cache (default: none, use MODEL)")
    h.add_argument("-hff", "--hf-file", dest="hf_file", metavar="FILE",
                   help="this GGUF file of --hf-repo instead of the one QUANT picks (default: none)")


def routing_from_args(args):
    from ..config import DEFAULT_PRESET, CumsumThreshold, MaxRank, Preset, Prior, Prune, TopK, parse_routing

    j = args.top_j  # None: the model's default (1 for K <= 3, 2 for K >= 4)
    if getattr(args, "preset", None) is not None:
        if j is not None:
            raise UserError("--top-j with --preset: the preset picks J (give --prior L --top-j J instead)")
        return Preset(args.preset, eviction=getattr(args, "eviction", None))
    if args.prior is not None:
        return Prior(args.prior, top_j=j)
    if args.max_rank is not None:
        return MaxRank(args.max_rank, top_j=j)
    if args.cumsum is not None:
        return CumsumThreshold(args.cumsum, top_j=j)
    if args.prune is not None:
        return Prune(args.prune, top_j=j)
    if args.routing is None:  # nothing given: the default preset (top-k wherever every expert is cached)
        if j is not None:
            raise UserError("--top-j needs a policy that changes the ranking (--prior, --max-rank, --cumsum, --prune)")
        return Preset(DEFAULT_PRESET, eviction=getattr(args, "eviction", None))
    routing = parse_routing(args.routing, top_j=args.top_j)  # "" is refused by the parser, not taken for lru
    if isinstance(routing, TopK) and args.top_j is not None:
        raise UserError("--top-j needs a policy that changes the ranking (--prior, --max-rank, --cumsum, --prune)")
    return routing


def cache_from_args(args):
    from ..config import CacheConfig, parse_cache_size

    return CacheConfig(size=parse_cache_size(args.cache_size), insertion=args.insertion,
                       prefetch=getattr(args, "prefetch", "auto"), prefetch_distance=getattr(args, "prefetch_distance", 1),
                       prefetch_min_p=getattr(args, "prefetch_min_p", 0.0),
                       eviction=getattr(args, "eviction", None) or "lru", eviction_decay=getattr(args, "eviction_decay", 0.95),
                       residency=getattr(args, "residency", "auto"), io_threads=getattr(args, "io_threads", 8),
                       prefetch_threads=getattr(args, "prefetch_threads", 0),
                       prefetch_spare=getattr(args, "prefetch_spare", 0),
                       prefetch_adaptive=getattr(args, "prefetch_adaptive", False),
                       prefetch_route=getattr(args, "prefetch_route", True),
                       prefetch_budget=getattr(args, "prefetch_budget", 0.0),
                       predictor=getattr(args, "predictor", None),
                       vram_size=getattr(args, "vram_size", 0), vram_fill=getattr(args, "vram_fill", "auto"),
                       vram_exclusive=getattr(args, "vram_exclusive", False),
                       batch_share=getattr(args, "batch_share", True),
                       batch_prior=getattr(args, "batch_prior", 3.0),
                       unified=getattr(args, "unified", "auto"), vram_copy=getattr(args, "vram_copy", "async"),
                       miss=getattr(args, "miss", None), lowbit=getattr(args, "lowbit", None),
                       lowbit_in_ram=getattr(args, "lowbit_in_ram", False),
                       lowbit_max_p=getattr(args, "lowbit_max_p", 1.0),
                       lock_memory=not getattr(args, "no_mlock", False),
                       lock_dense=not getattr(args, "no_mlock", False),
                       direct_io=not getattr(args, "no_direct_io", False))


def check_profile_args(args) -> None:
    """--pin-hot needs --profile; a --profile path must be a file that can be written."""
    profile, pin = getattr(args, "profile", None), getattr(args, "pin_hot", 0)
    if pin < 0:
        raise UserError(f"--pin-hot must be >= 0, got {pin}")
    if pin and not profile:
        raise UserError("--pin-hot needs --profile FILE: the hottest experts come from the usage profile")
    if profile is not None:
        d = os.path.dirname(os.path.abspath(profile))
        if os.path.isdir(profile) or not os.path.isdir(d):
            raise UserError(f"--profile {profile}: not a file in an existing directory")


def load_profile_from_args(args, llm) -> Optional[str]:
    """--profile FILE: loads it into llm if it exists and starts warm (pinning --pin-hot per layer).
    Returns a line for the user, or None without --profile."""
    profile = getattr(args, "profile", None)
    if profile is None:
        return None
    if not os.path.exists(profile):
        return f"[profile {profile}: new, saved at the end]"
    pinned = llm.load_profile(profile, pin_hot=args.pin_hot)
    return f"[profile {profile}: warm start" + (f", {pinned} experts pinned" if args.pin_hot else "") + "]"


def save_profile_from_args(args, llm) -> None:
    if getattr(args, "profile", None) is not None and llm.moecache is not None:
        llm.save_profile(args.profile)


def resolve_model(path: Optional[str], args=None) -> str:
    """MODEL argument (or -m), a Hugging Face download (--hf-repo/--hf-file), or the default model."""
    from ..models import default_model_path

    if args is not None:
        path = model_arg(args)
    repo, file = getattr(args, "hf_repo", None), getattr(args, "hf_file", None)
    for flag, v in (("-hf/--hf-repo", repo), ("-hff/--hf-file", file)):
        if v is not None and not v.strip():
            raise UserError(f"{flag} is empty: give OWNER/REPO[:QUANT] (and a file name for -hff)")
    if repo or file:
        if path:
            raise UserError("give either MODEL or --hf-repo/--hf-file, not both")
        if not repo:
            raise UserError("--hf-file needs --hf-repo (e.g. -hf OWNER/SOME-MOE-GGUF -hff some-moe-q4_k_m.gguf)")
        from ..hub import HubError, download_spec

        try:
            return str(download_spec(repo, file))
        except HubError as e:
            raise UserError(str(e))
    if path:
        return path
    p = default_model_path()
    print(f"using the embedded default model: {p}", file=sys.stderr)
    return str(p)


def add_prompt_cache_options(p) -> None:
    """--prompt-cache-dir / --prompt-cache-size (chat, serve): conversations kept on disk by their tokens."""
    p.add_argument("--prompt-cache-dir", metavar="DIR", default=None,
                   help="keep conversations on disk by their tokens (made if missing): a prompt that begins with "
                        "a kept one is not prefilled again, across conversations, requests and restarts "
                        "(default: none)")
    p.add_argument("--prompt-cache-size", metavar="SIZE", default="2GiB",
                   help="most bytes of --prompt-cache-dir, the least recently used dropped first (default %(default)s)")


def prompt_cache_from_args(args):
    """The PromptCache of --prompt-cache-dir, or None; UserError for a bad size or directory."""
    from ..config import parse_bytes
    from ..errors import Error
    from ..prompt_cache import PromptCache

    if getattr(args, "prompt_cache_dir", None) is None:
        return None
    size = parse_bytes(args.prompt_cache_size)
    if not size:
        raise UserError(f"--prompt-cache-size {args.prompt_cache_size!r}: give bytes such as 2GiB, 512M")
    try:
        return PromptCache(args.prompt_cache_dir, size)
    except Error as e:
        raise UserError(f"--prompt-cache-dir: {e}") from None
