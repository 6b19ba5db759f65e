"""``pymoecache`` command line (also ``python -m pymoecache``).

    pymoecache run [MODEL] -p "Once upon a time" -n 64 --prior 0.5 --cache-size 0.5
    pymoecache chat [MODEL] --prior 0.5
    pymoecache info MODEL [--ram 4GiB]
    pymoecache bench MODEL --routing lru,prior:0.5,max-rank:8 [--csv out.csv]
    pymoecache ppl MODEL --text FILE --sweep prior=0,0.25,0.5,1 --plot pareto.png
    pymoecache trace MODEL --text FILE --out trace.npz ; pymoecache plot-timeline trace.npz --layer 1 out.png
    pymoecache serve MODEL --prior 0.5 --port 8080
    pymoecache rpc-server --port 50052 ; pymoecache run MODEL -ngl 99 --rpc 127.0.0.1:50052
    pymoecache lowbit MODEL [--type Q4_K]       # the routed experts at a lower type, in a companion file

User errors (bad files, parameters, state files, I/O) print one line and exit with code 2; an
internal error prints one line and exits with code 1 (PYMOECACHE_DEBUG=1 adds the traceback).
Never a traceback otherwise. One module per group of commands (generate: run, bench, info; chat;
evaluation: ppl, trace, plot-timeline, simulate; serve: serve, rpc-server; lowbit), their shared options in
``options``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import List, Optional

from ..errors import Error
from . import chat, evaluation, generate, lowbit, serve
from .options import EXIT_INTERNAL, EXIT_USAGE, Parser, UserError  # noqa: F401  (UserError: for callers)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="pymoecache",
        description="Run Mixture-of-Experts GGUF models with a per-layer expert cache and cache-aware routing.",
        epilog="Run `pymoecache COMMAND --help` for the options of each command.")
    ap.add_argument("--version", action=_VersionAction,
                    help="print the package version, the llama.cpp it runs on and the CPU features it uses")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    generate.add_commands(sub)    # run, bench, info
    chat.add_command(sub)         # chat
    evaluation.add_commands(sub)  # ppl, trace, plot-timeline, simulate
    serve.add_command(sub)        # serve
    serve.add_rpc_command(sub)    # rpc-server
    lowbit.add_command(sub)       # lowbit
    return ap


def version_text() -> str:
    """What --version prints: the package, the llama-cpp-python (and so llama.cpp) it runs on, and
    the CPU backend's features as llama.cpp reports them."""
    from .. import __version__

    try:
        from .. import _lib  # noqa: F401  (points llama-cpp-python at our libllama)
        import llama_cpp

        system = llama_cpp.llama_print_system_info().decode(errors="replace").strip(" |")
        runtime = f"llama-cpp-python {llama_cpp.__version__} (its pinned llama.cpp, with pymoecache's patches)"
    except Exception as e:  # (--version must print even where the library does not load)
        system, runtime = f"unavailable ({type(e).__name__}: {e})", "llama-cpp-python: not loaded"
    return f"pymoecache {__version__}\n{runtime}\nbackend: {system}"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


def _validate(args) -> None:
    """Integer options are checked here, before anything reaches ctypes (no wrap-around), and text
    options must be UTF-8 (bytes that are not arrive from the command line as surrogates)."""
    from ..config import INT32_MAX

    for name, flag in (("prompt", "-p/--prompt"), ("system", "-sys/--system-prompt"), ("grammar", "--grammar")):
        v = getattr(args, name, None)
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise UserError(f"{flag} is not UTF-8 text (an undecodable byte at character {e.start})") from None

    n = getattr(args, "n", None)
    if n is not None and not -1 <= n <= INT32_MAX:
        raise UserError(f"-n must be in [-1, {INT32_MAX}] (-1: until the context is full), got {n}")
    top_j = getattr(args, "top_j", None)
    if top_j is not None and not 0 <= top_j <= INT32_MAX:
        raise UserError(f"--top-j must be in [0, {INT32_MAX}], got {top_j}")
    if getattr(args, "routing", None) is not None and not args.routing.strip():
        raise UserError("--routing needs a spec, e.g. lru or prior:0.5")
    for name in ("max_rank", "prune", "io_threads", "reps", "tokens", "chunks", "layer", "ctx", "threads",
                 "top_k", "n_gpu_layers", "main_gpu", "threads_http", "threads_batch", "batch_size", "ubatch_size", "n_cpu_moe", "repeat_last_n",
                 "keep"):
        v = getattr(args, name, None)
        if isinstance(v, int) and not -INT32_MAX <= v <= INT32_MAX:
            raise UserError(f"--{name.replace('_', '-')} = {v} is out of range")
    seed = getattr(args, "seed", None)
    if seed is not None and not -1 <= seed <= 2**32 - 1:
        raise UserError(f"-s/--seed must be in [-1, {2**32 - 1}] (-1: a random seed), got {seed}")
    if isinstance(getattr(args, "n_gpu_layers", None), int) and args.n_gpu_layers < -1:
        raise UserError(f"-ngl must be >= -1 (-1: all layers), got {args.n_gpu_layers}")
    if getattr(args, "threads_http", None) is not None and args.threads_http < 1:
        raise UserError(f"--threads-http must be >= 1, got {args.threads_http}")
    if getattr(args, "top_k", None) is not None and args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0: all tokens), got {args.top_k}")
    if getattr(args, "keep", None) is not None:
        raise UserError("--keep: this runtime never shifts the context (the prompt and -n must fit in -c; chat drops "
                        "the oldest turns instead), so there are no tokens to keep")
    if getattr(args, "repeat_last_n", None) is not None and args.repeat_last_n < 0:
        raise UserError(f"--repeat-last-n must be >= 0 (0: the penalties look at nothing), got {args.repeat_last_n}")
    for name, lo, hi in (("temp", 0.0, 1e6), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0), ("repeat_penalty", 1e-6, 1e6),
                         ("presence_penalty", -1e6, 1e6), ("frequency_penalty", -1e6, 1e6)):
        v = getattr(args, name, None)
        if v is not None and not lo <= v <= hi:  # also refuses nan
            raise UserError(f"--{name.replace('_', '-')} must be in [{lo:g}, {hi:g}], got {v}")
    if hasattr(args, "override_tensor"):  # llama.cpp's flags that cannot mean anything here: said now
        from .options import runtime_kwargs

        runtime_kwargs(args)
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if getattr(args, "no_warmup", False):
        print(f"pymoecache {args.command}: note: --no-warmup: pymoecache runs no warm-up pass, nothing to skip",
              file=sys.stderr)
    if getattr(args, "n_gpu_layers", 0) and getattr(args, "rpc", None) is None:
        from ..plan import has_gpu

        if not has_gpu():
            print(f"pymoecache {args.command}: note: -ngl {args.n_gpu_layers}: this build has no GPU device (no GPU "
                  "backend found one, and no --rpc server): the layers stay on the CPU", file=sys.stderr)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _stdout_to_devnull() -> None:
    """After EPIPE: what Python still flushes at exit goes nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "command", None):
        ap.print_help()
        return EXIT_USAGE
    where = f"pymoecache {args.command}"
    # a warning of the package is one line in the CLI's words, not Python's "file:line: UserWarning:" and source
    python_format, warnings.formatwarning = warnings.formatwarning, \
        lambda message, category, *_a, **_k: f"{where}: warning: {message}\n"
    try:
        return _main(args, where)
    finally:
        warnings.formatwarning = python_format  # (main called in a process that goes on: tests, scripts)


def _main(args, where: str) -> int:
    try:
        _validate(args)
        if args.command == "run" and args.conversation:  # llama-cli -cnv: a conversation, -p its first message
            return chat.cmd_chat(args)
        return args.func(args)
    except Error as e:  # every user error of the package: files, parameters, state, I/O
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `pymoecache run | head -1`: the reader left; quiet, like other Unix tools
        _stdout_to_devnull()
        return 0
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
