"""scripts/pareto_default.py --report as a user runs it, on rows written the way the script writes
them: who dominates the default, and which settings nothing dominates (or that none is left)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pareto_default.py"
FIELDS = ["model_key", "cache_size", "n_expert", "setting", "spec", "eviction", "ppl", "miss_rate",
          "critical_mib_per_token", "tokens"]


def report(tmp_path, rows, models="M", chunks=None) -> str:
    path = tmp_path / "rows.csv"
    chunks = chunks or {}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS + ["chunk_nll"])
        for key, size, setting, ppl, miss in rows:
            w.writerow([key, size, 8, setting, setting, "lru", ppl, miss, 10 * miss, 100,
                        " ".join(map(str, chunks.get((size, setting), [])))])
    r = subprocess.run([sys.executable, str(SCRIPT), "--report", "--csv", str(path), "--models", models],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def candidates(out: str) -> list:
    tail = out.split("Settings that no row dominates")[1]
    return [line.split("`")[1] for line in tail.splitlines() if line.startswith("| `")]


def test_the_default_held_and_the_candidates_listed(tmp_path):
    # cell 4/8: the default has fewer misses than top-k and nothing has both fewer misses and a lower ppl
    out = report(tmp_path, [("M", 4, "lru", 10.0, 0.40), ("M", 4, "preset:quality", 10.05, 0.30),
                            ("M", 4, "preset:speed", 10.3, 0.20), ("M", 4, "flat", 10.1, 0.35)])
    row = next(line for line in out.splitlines() if line.startswith("| M | 4/8"))
    assert row.endswith("| nothing |")
    assert candidates(out) == ["lru", "preset:quality", "preset:speed"]  # "flat" is dominated by the default
    assert "+0.50%" in out  # the default's perplexity cost against top-k + LRU


def test_a_dominated_default_is_named_and_none_left_says_so(tmp_path):
    # two cells; every setting is dominated in one of them (the default in 2/8, the others in 4/8)
    out = report(tmp_path, [("M", 4, "lru", 10.0, 0.40), ("M", 4, "preset:quality", 9.9, 0.30),
                            ("M", 4, "flat", 10.1, 0.35),
                            ("M", 2, "lru", 12.0, 0.60), ("M", 2, "preset:quality", 12.2, 0.55),
                            ("M", 2, "flat", 12.1, 0.50)])
    row = next(line for line in out.splitlines() if line.startswith("| M | 2/8"))
    assert "`flat` (12.1000, 50.0%)" in row
    assert "| `preset:quality` | 1 of 2: M 2/8 |" in out
    assert candidates(out) == []
    assert "None: in these 2 cells every setting of the grid is dominated in at least one." in out


def test_a_domination_says_whether_it_is_beyond_the_noise(tmp_path):
    # per-chunk mean NLLs: "near" is lower in two chunks and higher in one (noise), "far" lower in all three
    base = [4.0, 4.2, 3.9]
    out = report(tmp_path, [("M", 4, "lru", 10.0, 0.40), ("M", 4, "preset:quality", 10.05, 0.30),
                            ("M", 4, "near", 10.04, 0.29), ("M", 4, "far", 9.5, 0.28)],
                 chunks={(4, "preset:quality"): base, (4, "near"): [3.98, 4.23, 3.88],
                         (4, "far"): [x - 0.05 for x in base], (4, "lru"): base})
    row = next(line for line in out.splitlines() if line.startswith("| M | 4/8"))
    near, far = row.split("`near`")[1].split("`far`")
    assert "within 2 SE" in near and "-0.33%" in near  # exp(-0.01 / 3 * 1) - 1
    assert "beyond 2 SE" in far and "-4.88%" in far    # exp(-0.05) - 1, the same in every chunk: no spread


def test_only_runs_the_default_and_the_named_setting_with_their_chunks(fixture_dir, tmp_path):
    # (fixture_dir: the fixture models built where the script looks for them, tests/fixtures/models)
    out_csv = tmp_path / "only.csv"
    r = subprocess.run([sys.executable, str(SCRIPT), "--models", "mixtral-8x2", "--sizes", "0.5", "--ctx", "32",
                        "--chunks", "3", "--only", "prior:0.3:j=1 router-mass", "--csv", str(out_csv)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(x["setting"] for x in rows) == ["lru", "lru router-mass", "preset:quality",
                                                  "prior:0.3:j=1 router-mass"]
    assert all(len(x["chunk_nll"].split()) == 3 and float(x["ppl_err"]) > 0 for x in rows)
    assert "| mixtral-8x2 | 4/8 |" in r.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--only", "prior:0.3:j=1 router-mass"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "name its --csv" in bad.stderr
