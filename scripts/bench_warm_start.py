#!/usr/bin/env python3
"""Warm start from a usage profile: miss rate of the first decoded tokens of a new session with a
loaded profile against a cold (empty) cache, on the two trained models' held-out text.

    python scripts/bench_warm_start.py                  # both models, 64 tokens, 1/2 and 1/4 cache
    python scripts/bench_warm_start.py --tokens 64 --profile-passages 16 --test-passages 8

The held-out text is cut into passages of --tokens tokens. The first --profile-passages build the
profile: one Llama evaluates each as a request (Llama.reset between them) and saves the profile.
Each of the next --test-passages is then evaluated one token at a time (as generation decodes),
in a fresh Llama: cold, warm (profile loaded), and warm with the --pin-hot hottest experts per
layer pinned. Reported: the miss rate over those tokens, the mean over passages. Residency none:
the counters do not depend on where the experts live. Needs ../shared/data.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

MODELS = {"A": "tiny-shakespeare-qwen2moe-60x4.gguf", "B": "tiny-shakespeare-mixtral-8x2.gguf"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="A,B", help="A, B or both (default %(default)s)")
    ap.add_argument("--sizes", default="0.5,0.25", help="cache sizes, shares of the experts (default %(default)s)")
    ap.add_argument("--routings", default="lru,prior:0.5", help="routing specs (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per passage (default %(default)s)")
    ap.add_argument("--profile-passages", type=int, default=16, help="passages building the profile (default %(default)s)")
    ap.add_argument("--test-passages", type=int, default=8, help="passages measured (default %(default)s)")
    ap.add_argument("--pin-hot", type=int, default=4, help="experts pinned per layer in the pinned run (default %(default)s)")
    args = ap.parse_args()

    import numpy as np
    from train_tiny_moe import split_text

    from pymoecache import CacheConfig
    from pymoecache.evaluate import load_llama, tokenize_text

    text = split_text()[1]
    print("| model | cache | routing | cold miss rate | warm | warm + pin | warm / cold |")
    print("|---|---|---|---|---|---|---|")
    for key in args.models.split(","):
        model = ROOT / "models" / MODELS[key]
        for size in (float(s) for s in args.sizes.split(",")):
            for routing in args.routings.split(","):
                def fresh():
                    return load_llama(model, cache=CacheConfig(size=size, residency="none"), routing=routing,
                                      n_ctx=args.tokens + 8)

                llm = fresh()
                ids = tokenize_text(llm, text)
                n = args.tokens
                passages = [ids[i:i + n] for i in range(0, len(ids) - n, n)]
                need = args.profile_passages + args.test_passages
                if len(passages) < need:
                    sys.exit(f"the held-out text has {len(passages)} passages of {n} tokens, {need} needed")
                for p in passages[:args.profile_passages]:  # the profile: earlier sessions' requests
                    llm.reset()
                    llm.eval(p)
                with tempfile.TemporaryDirectory() as d:
                    prof = Path(d) / "p.moeprofile"
                    llm.save_profile(prof)
                    llm.close()
                    rates = {"cold": [], "warm": [], "pin": []}
                    for p in passages[args.profile_passages:need]:
                        for mode in rates:
                            llm = fresh()
                            if mode != "cold":
                                llm.load_profile(prof, pin_hot=args.pin_hot if mode == "pin" else 0)
                            for t in p:  # one token at a time, as generation decodes
                                llm.eval([t])
                            rates[mode].append(llm.moe_stats().miss_rate)
                            llm.close()
                cold, warm, pin = (float(np.mean(rates[m])) for m in ("cold", "warm", "pin"))
                cap = int(round(size * (60 if key == "A" else 8)))
                print(f"| {key} | {cap}/{60 if key == 'A' else 8} | {routing} | {100 * cold:.1f}% | {100 * warm:.1f}% | "
                      f"{100 * pin:.1f}% | {warm / cold:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
