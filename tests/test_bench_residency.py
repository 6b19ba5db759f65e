"""scripts/bench_residency.py as a user runs it: a failed setting is reported, not a lost hour.

(Its speeds are not checked here: benchmarks measure, tests do not time.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, str(ROOT / "scripts" / "bench_residency.py"), "--model", "random", "--size-mb", "40", "--reps", "1",
         "--tokens", "2", "--warmup", "1", "--prompt-tokens", "8", "--cache-sizes", "0.5", "--no-mmap",
         "--routings", "lru,bogus:1"]


def test_keep_going_reports_a_failed_setting_and_runs_the_others():
    r = subprocess.run(BENCH + ["--keep-going"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line.split("|")[2].strip(): line for line in r.stdout.splitlines() if line.startswith("| stream")}
    assert rows["bogus:1"].rstrip().endswith("failed: exit status 1 |")
    assert float(rows["lru"].split("|")[6]) > 0  # decode tok/s of the setting that ran
    assert "unknown routing policy 'bogus'" in r.stderr  # the failed process's own message, passed on
    assert "bogus:1 / lru = - (failed)" in r.stdout


def test_without_keep_going_the_first_failure_stops_with_its_status():
    r = subprocess.run(BENCH, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "stream bogus:1 0.5 off lru failed (exit status 1)" in r.stderr
    assert "| stream |" not in r.stdout


def test_the_low_bit_miss_path_is_a_setting_of_its_own():
    """m=lowbit after a prefetch mode: the misses from a companion the bench makes once beside its
    model, with what a token's reads on the critical path were against the full-precision row."""
    r = subprocess.run(BENCH[:BENCH.index("--routings")] + ["--routings", "lru", "--no-resident",
                                                            "--prefetch", "off,off:m=lowbit"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| stream | lru | 30/60 | off:m=lowbit | lru |" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "experts/token from the companion" in x)
    assert "x fewer)" in line and float(line.split(": ")[1].split()[0]) > 0


def test_both_benchmark_models_side_by_side():
    """--model random,trained: a table per model; the trained one is model C widened to the random
    model's expert (its logits are C's: tests/test_widen.py), decoding C's held-out text."""
    import csv

    out = ROOT / "models" / "_bench" / "test-both.csv"
    r = subprocess.run(BENCH[:BENCH.index("--model")] + ["--model", "random,trained"]
                       + BENCH[BENCH.index("--size-mb"):BENCH.index("--routings")]
                       + ["--routings", "default", "--no-resident", "--csv", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "bench-residency-40mb.gguf:" in r.stdout and "bench-trained-" in r.stdout
    rows = {}
    for kind in ("random", "trained"):
        path = out.with_name(f"{out.stem}-{kind}{out.suffix}")
        with open(path) as f:
            rows[kind] = list(csv.DictReader(f))
        path.unlink()
    trained, random = rows["trained"][0], rows["random"][0]
    assert trained["tokens"] == "tinyshakespeare-held-out" and random["tokens"] == "wikitext-2"
    assert trained["n_expert"] == "32" and random["n_expert"] == "60"
    # the widened expert has the random model's bytes (1024 x 512 x 3 at Q8_0 = 256 x 2048 x 3)
    from pymoecache import model_info

    models = ROOT / "models" / "_bench"
    wide = [p for p in models.glob("bench-trained-*-w2048.gguf")]  # (the Q8_0 build; --quant copies are named apart)
    assert wide and model_info(wide[0]).expert_bytes == 3 * 256 * 2048 * 34 // 32
