#!/usr/bin/env python3
"""The decode speed forecast against what `pymoecache bench` measures (issue 56 item 5): both benchmark
models, each cache size, with and without the companion beside the model, every cell a fresh process of
the installed CLI as a user runs it (`pymoecache bench MODEL --cache-size S --routing preset:quality`,
the default routing; `--miss full` for the rows without the companion).

    python scripts/bench_forecast.py                       # 2 models x 1/2, 1/4 x companion or not
    python scripts/bench_forecast.py --cache-sizes 0.5 --models trained --reps 2

Prints a markdown table: the forecast with its band, the measured decode tok/s (llama.cpp's counters,
bench's 4 prompts x --n tokens), whether it falls inside, and how many cells do. The companion (Q4_K for
the Q8_0 benchmark models) is made beside each model once; `--miss full` ignores it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def models(which):
    from bench_residency import bench_model, trained_bench_model

    out = []
    for kind in which:
        out.append((kind, bench_model(2200) if kind == "random" else trained_bench_model()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="random,trained", help="random, trained or both (default %(default)s)")
    ap.add_argument("--cache-sizes", default="0.5,0.25", help="shares of the experts (default %(default)s)")
    ap.add_argument("--n", type=int, default=64, help="tokens per prompt (default %(default)s)")
    ap.add_argument("--reps", type=int, default=1, help="bench repetitions per cell (default %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: bench's)")
    args = ap.parse_args()
    from pymoecache import lowbit

    rows = []
    for kind, model in models(args.models.split(",")):
        try:
            lowbit.check_companion(model)
        except lowbit.CompanionError:
            print(f"making the companion of {model.name} (once) ...", file=sys.stderr)
            lowbit.make_companion(model, progress=False)
        for size in args.cache_sizes.split(","):
            for companion in (False, True):
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "rows.json"
                    cmd = [sys.executable, "-m", "pymoecache", "bench", str(model), "--cache-size", size, "--routing",
                           "preset:quality", "-n", str(args.n), "--reps", str(args.reps), "--json", str(out)]
                    cmd += [] if companion else ["--miss", "full"]
                    cmd += ["-t", str(args.threads)] if args.threads else []
                    r = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
                    if r.returncode != 0:
                        sys.exit(f"bench failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
                    row = json.loads(out.read_text())[0]
                fc = next((ln for ln in r.stderr.splitlines() if ln.startswith("forecast: ")), "")
                inside = row["forecast_low"] <= row["decode_tok_s"] <= row["forecast_high"]
                rows.append((kind, size, companion, row, inside))
                print(f"{kind} {size} {'companion' if companion else 'full'}: measured {row['decode_tok_s']:.1f}, "
                      f"forecast {row['forecast_tok_s']:.1f} ({row['forecast_low']:.1f} to {row['forecast_high']:.1f})"
                      f" {'inside' if inside else 'OUTSIDE'}; {fc}", file=sys.stderr)
    print("| model | cache | experts from | forecast tok/s | band | measured tok/s | miss rate | inside |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, size, companion, row, inside in rows:
        print(f"| {kind} | {size} | {'the companion (lowbit-cache)' if companion else 'the model (--miss full)'} | "
              f"{row['forecast_tok_s']:.1f} | {row['forecast_low']:.1f} to {row['forecast_high']:.1f} | "
              f"{row['decode_tok_s']:.1f} | {100 * row['miss_rate']:.1f}% | {'yes' if inside else 'no'} |")
    n_in = sum(1 for *_, inside in rows if inside)
    print(f"\n{n_in} of {len(rows)} cells inside the band")
    return 0


if __name__ == "__main__":
    sys.exit(main())
