#!/usr/bin/env python3
"""Long fuzz runs of the two parsers of untrusted files, with counts (CI runs a short budget of the
same mutators in tests/test_fuzz.py).

    python scripts/fuzz_inputs.py --headers 10000 --states 2000            # about 10 minutes on 2 cores
    python scripts/fuzz_inputs.py --headers 2000 --load 300                # also load accepted headers

--load N hands up to N header mutants that model_info accepted to llama.cpp itself, each in its own
process: the header check must have refused every file llama.cpp aborts on, so every such load
must end with success or the package's error, never a signal. Exits 1 on any finding.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import fuzz_inputs as fz  # noqa: E402
import synth  # noqa: E402  (tools/)

LOAD = """
import sys
sys.path.insert(0, sys.argv[1])
import pymoecache
try:
    pymoecache.Llama(sys.argv[2], n_ctx=64, verbose=False, cache=pymoecache.CacheConfig(residency="none"))
    print("loaded")
except pymoecache.Error as e:
    print("refused:", type(e).__name__)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headers", type=int, default=10000, help="GGUF header mutants (default %(default)s)")
    ap.add_argument("--states", type=int, default=2000, help="cache state file mutants (default %(default)s)")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="load up to N accepted header mutants with llama.cpp, a process each (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    args = ap.parse_args()

    fixtures = ROOT / "tests" / "fixtures" / "models"
    synth.build_all(fixtures, verbose=False)
    hf = fz.HeaderFuzz(fixtures / "qwen2moe-60x4.gguf")
    rng = np.random.default_rng(args.seed)
    counts: "collections.Counter[str]" = collections.Counter()
    findings = []
    accepted = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.time()
        for i in tqdm(range(args.headers), desc="GGUF headers", unit="mutant"):
            header = hf.mutant(rng)
            path = hf.write(header, tmp / "m.gguf")
            try:
                outcome = fz.check_header(path)
            except Exception:
                outcome = "FINDING"
                findings.append(("header", i, traceback.format_exc(limit=3)))
                (tmp.parent / f"pymoecache-fuzz-header-{i}.gguf").write_bytes(header)
            counts[f"header {outcome}"] += 1
            if outcome == "ok" and len(accepted) < args.load and header != hf.header:
                accepted.append(hf.write(header, tmp / f"ok-{len(accepted)}.gguf"))
        t_headers = time.time() - t0

        mc, raw = fz.warm_synthetic_cache()
        t0 = time.time()
        for i in tqdm(range(args.states), desc="state files", unit="mutant"):
            p = tmp / "s.moecache"
            p.write_bytes(fz.state_mutant(rng, raw))
            try:
                outcome = fz.check_state(mc, p)
            except Exception:
                outcome = "FINDING"
                findings.append(("state", i, traceback.format_exc(limit=3)))
            counts[f"state {outcome}"] += 1
        t_states = time.time() - t0

        def load(path: Path) -> str:
            try:
                r = subprocess.run([sys.executable, "-c", LOAD, str(ROOT), str(path)], capture_output=True,
                                   text=True, timeout=120)
            except subprocess.TimeoutExpired:
                return "hang"
            if r.returncode < 0:
                keep = Path(tempfile.gettempdir()) / f"pymoecache-fuzz-{path.name}"
                keep.write_bytes(path.read_bytes())
                why = [ln for ln in r.stderr.splitlines() if "GGML_ASSERT" in ln or "error" in ln.lower()][-1:]
                return f"signal {-r.returncode} ({keep}: {why[0].strip() if why else 'no message'})"
            if r.returncode != 0:
                return "traceback: " + (r.stderr.strip().splitlines() or ["?"])[-1]
            return r.stdout.strip().split(":")[0]

        if accepted:
            with ThreadPoolExecutor(2) as pool:
                for path, outcome in zip(accepted, tqdm(pool.map(load, accepted), total=len(accepted),
                                                        desc="llama.cpp loads", unit="file")):
                    counts[f"load {outcome.split(' (')[0]}"] += 1
                    if outcome not in ("loaded", "refused"):
                        findings.append(("load", path.name, outcome))

    print(f"\nheaders: {args.headers} mutants in {t_headers:.0f} s; states: {args.states} mutants in {t_states:.0f} s")
    for k, v in sorted(counts.items()):
        print(f"  {k:<32} {v}")
    for f in findings[:20]:
        print("FINDING", *f)
    print(f"{len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
