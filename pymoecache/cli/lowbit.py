"""``pymoecache lowbit``: a model's routed experts again at a lower type, in a companion file."""

from __future__ import annotations

import os
import sys

from .options import UserError, add_model_argument, model_arg


def cmd_lowbit(args) -> int:
    from .. import lowbit

    model = model_arg(args)
    if not model:
        raise UserError("give the model whose experts to copy: pymoecache lowbit MODEL.gguf")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"-t/--threads must be at least 1, got {args.threads}")
    if args.check:
        if args.type or args.threads:
            raise UserError("--check reads a companion; --type and -t are for making one")
        if args.output is not None:
            print(lowbit.check_companion(model, args.output).summary())
            return 0
        found = lowbit.companions_beside(model)
        if len(found) < 2:
            print(lowbit.check_companion(model, None).summary())
            return 0
        failed = 0  # several beside the model: each, the one run uses by default first
        for i, path in enumerate(found):
            print(("used by default: " if i == 0 else "also here: ") + str(path))
            try:
                print("  " + lowbit.check_companion(model, path).summary().replace("\n", "\n  "))
            except lowbit.CompanionError as e:
                failed += 1
                print(f"  refused: {e}")
        return 2 if failed == len(found) else 0
    try:
        c = lowbit.make_companion(model, args.output, type=args.type, threads=args.threads,
                                  progress=sys.stderr.isatty() and not args.verbose, verbose=args.verbose)
    except KeyboardInterrupt:  # (its partial files are removed): llama.cpp's quantizer, which cannot be
        sys.stderr.write("\n")  # stopped, runs on in a thread of its own: leave now, not at its end
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    print(c.summary())
    return 0


def add_command(sub) -> None:
    from ..lowbit import TYPES

    import argparse
    import textwrap

    about = ("Copies every routed expert matrix of MODEL at a lower ggml type into a companion GGUF, through "
             "llama.cpp's own quantizer (the rest of the model is not copied). The companion records the model it "
             "belongs to (file size, a hash of its tensor table, a sample of every expert's bytes) and is refused "
             "for any other. Default type: Q8_0 -> Q4_K, 4-6 bit -> Q3_K (on a fine-grained Q4_K_M model Q3_K "
             "costs no measurable perplexity, Q2_K about 1%; --type Q2_K for 24% fewer bytes). Tensors "
             "whose rows are not a multiple of the type's block (256 for K-quants) get llama.cpp's fallback type; "
             "the summary says which, and the file is named by the types it holds (MODEL.lowbit-Q4_K.gguf, "
             "MODEL.lowbit-Q4_K+Q5_0.gguf where some rows fell back).")
    use = ("What run, chat and serve do with it, found beside the model: by default the expert cache holds the "
           "companion's copies (--miss lowbit-cache: more experts in the same memory, every expert computed from "
           "its low-bit copy); --miss lowbit computes only the misses from it; --miss full ignores it. ppl "
           "--miss full lowbit-cache measures what it costs in perplexity.")
    p = sub.add_parser(
        "lowbit", help="write a low-bit companion: every routed expert of MODEL at a lower type",
        description=textwrap.fill(about, 79) + "\n\n" + textwrap.fill(use, 79),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  pymoecache lowbit model.gguf\n  pymoecache lowbit model.gguf --type Q3_K -o small.gguf\n"
               "  pymoecache lowbit model.gguf --check")
    add_model_argument(p)
    p.add_argument("--type", metavar="TYPE", type=str.upper,
                   help=f"the experts' type in the companion: {', '.join(TYPES)} (default: from the model's)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="the companion file (default: MODEL.lowbit-TYPES.gguf beside the model, named by the types "
                        "llama.cpp made; with --check: the one found there)")
    p.add_argument("-t", "--threads", type=int, metavar="N", help="quantizer threads (default: every core)")
    p.add_argument("--check", action="store_true",
                   help="check an existing companion against MODEL and describe it, instead of making one")
    p.add_argument("-v", "--verbose", action="store_true", help="print llama.cpp's quantizer log (a line per tensor)")
    p.set_defaults(func=cmd_lowbit)
