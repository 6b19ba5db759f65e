#!/usr/bin/env python3
"""Build the synthetic GGUF models used by the tests (and optionally the benchmark model).

Run from the repository root:

    python scripts/make_test_models.py                 # fixtures into tests/fixtures/models
    python scripts/make_test_models.py --bench /tmp/bench.gguf

See tools/synth/spec.py for the model specs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# `import pymoecache` from this checkout (synth.quantize() uses it to point llama-cpp-python at
# this project's libllama), and tools/synth/, the model builder
for _p in (REPO_ROOT, REPO_ROOT / "tools"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import synth  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line options."""
    fixture_lines = "\n".join(
        f"  {name:24s} arch={spec.arch}, {spec.n_expert} experts, top-{spec.n_expert_used}"
        if spec.n_expert else f"  {name:24s} arch={spec.arch}, dense (no experts)"
        for name, spec in synth.FIXTURES.items()
    )
    parser = argparse.ArgumentParser(
        description=(
            "Write deterministic random-weight GGUF models (real llama.cpp vocabularies, "
            "random weights) for the pymoecache tests. Each fixture <name>.gguf (F32 weights, "
            "F16 embeddings) gets a JSON card <name>.json; the MoE fixtures also get "
            "<name>.Q8_0.gguf and <name>.Q4_K_M.gguf made with llama.cpp's quantizer, which "
            "needs llama-cpp-python and libllama (set LLAMA_CPP_LIB_PATH to the folder with "
            "libllama.so; build/dev/bin is used when it is unset). Files already built from "
            "the same spec and seed are skipped. Same seed -> byte-identical files."
        ),
        epilog="fixtures:\n" + fixture_lines,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "models",
                        help="output folder for the fixtures (default: tests/fixtures/models)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--bench", type=Path, metavar="PATH",
                        help="also write the large qwen2moe-style benchmark model (Q8_0, "
                             "~320 MB, takes a while) to PATH; never commit it")
    parser.add_argument("--bench-mb", type=float, default=320,
                        help="approximate size of the benchmark model in MB (default: 320)")
    parser.add_argument("--bench-only", action="store_true",
                        help="with --bench: build only the benchmark model, not the fixtures")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even when up-to-date files exist")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the fixtures and/or the benchmark model."""
    args = parse_args(argv)
    if args.bench_only and args.bench is None:
        print("--bench-only needs --bench PATH", file=sys.stderr)
        return 2

    if not args.bench_only:
        t0 = time.perf_counter()
        paths = synth.build_all(args.out, seed=args.seed, force=args.force)
        total_mb = sum(p.stat().st_size for p in paths) / 1e6
        print(f"{len(paths)} fixture files, {total_mb:.1f} MB, in {args.out} "
              f"({time.perf_counter() - t0:.1f}s)")

    if args.bench is not None:
        t0 = time.perf_counter()
        path = synth.build_bench_model(args.bench, target_mb=args.bench_mb, seed=args.seed,
                                       force=args.force)
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
