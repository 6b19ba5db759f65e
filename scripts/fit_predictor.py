#!/usr/bin/env python3
"""Fit the predictors that read experts ahead (prefetch="gate") on a calibration text.

    python scripts/fit_predictor.py                                # the 2.2 GB bench model, WikiText-2
    python scripts/fit_predictor.py MODEL.gguf --text train.txt --tokens 2000 -o model.pred

The gate predictor applies layer l + 1's router to layer l's FFN input. The fitted one adds a ridge
regression of what that misses (pymoecache.tune.fit_predictor), learned from --tokens tokens of the
text decoded one at a time, in --contexts fresh contexts --skip tokens apart (the benchmarks
measure the text's start: the fit never sees it). Load the result with Llama.load_predictor, bench_residency.py --predictor
FILE --prefetch gate:s=2:f=1, or miss_anatomy.py --predictor FILE --prefetch gate:s=2:a=0:f=1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "scripts")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: scripts/bench_residency.py's 2.2 GB model)")
    ap.add_argument("--text", help="calibration text (default: WikiText-2's validation text)")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens decoded to fit on (default %(default)s)")
    ap.add_argument("--skip", type=int, default=4000, help="tokens of the text skipped first (default %(default)s)")
    ap.add_argument("--contexts", type=int, default=8,
                    help="the tokens come from this many places of the text, each decoded in a fresh context, "
                         "--skip tokens apart (default %(default)s)")
    ap.add_argument("--lam", type=float, default=1000.0, help="ridge strength: larger stays nearer the router "
                                                             "(default %(default)s)")
    ap.add_argument("-o", "--output", help="predictor file (default: MODEL with .pred)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: llama.cpp's)")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.skip < 0 or args.contexts < 1 or not args.lam > 0:
        ap.error("--tokens must be >= 2, --skip >= 0, --contexts >= 1, --lam > 0")

    import bench_residency as br
    import pymoecache
    from pymoecache import tune

    model = Path(args.model) if args.model else br.bench_model(2200)
    text = Path(args.text) if args.text else br.TEXT
    for p, what in ((model, "model"), (text, "text")):
        if not p.is_file():
            ap.error(f"no such {what} file: {p}")
    out = Path(args.output) if args.output else model.with_suffix(".pred")
    try:
        import llama_cpp  # (after pymoecache: our libllama)

        vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
        ids = vocab.tokenize(text.read_text(encoding="utf-8", errors="replace").encode(), add_bos=False)
        per = max(2, args.tokens // args.contexts)
        contexts = [ids[args.skip * (i + 1): args.skip * (i + 1) + per] for i in range(args.contexts)]
        contexts = [c for c in contexts if len(c) >= 2]
        if not contexts:
            ap.error(f"{text} has fewer than --skip + 2 tokens")
        ids = [t for c in contexts for t in c]
        t0 = time.perf_counter()
        predictors = tune.fit_predictor(model, contexts, lam=args.lam, n_threads=args.threads)
        tune.save_predictor(out, predictors, model=model.name)
    except pymoecache.Error as e:
        ap.error(str(e))
    print(f"{out}: predictors of {len(predictors)} layers, fitted on {len(ids)} tokens in "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
