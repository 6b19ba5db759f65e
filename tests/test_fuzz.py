"""Fuzzing the parsers of untrusted files, on a fixed budget (CI): GGUF headers (model_info) and
cache state files (moecache_state_load). Every input is accepted or refused with the package's
own error; a refused state file leaves the cache unchanged. Longer runs, with counts:
``python scripts/fuzz_inputs.py --headers 10000 --states 2000``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import model_path
import fuzz_inputs as fz

BUDGET = settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def header_fuzz(fixture_dir):
    return fz.HeaderFuzz(model_path(fixture_dir, "qwen2moe-60x4"))


@BUDGET
@given(seed=st.integers(0, 2**63 - 1))
def test_fuzz_gguf_header(seed, header_fuzz, tmp_path):
    path = header_fuzz.write(header_fuzz.mutant(np.random.default_rng(seed)), tmp_path / "m.gguf")
    assert fz.check_header(path) in ("ok", "refused")


@pytest.fixture(scope="module")
def warm_state():
    return fz.warm_synthetic_cache()


@settings(BUDGET, max_examples=300)
@given(seed=st.integers(0, 2**63 - 1))
def test_fuzz_state_file(seed, warm_state, tmp_path):
    mc, raw = warm_state
    p = tmp_path / "s.moecache"
    p.write_bytes(fz.state_mutant(np.random.default_rng(seed), raw))
    assert fz.check_state(mc, p) in ("ok", "refused")


def test_fuzz_mutators_reach_both_outcomes(header_fuzz, warm_state, tmp_path):
    """The fuzz is not vacuous: some mutants pass and some are refused, for both parsers."""
    rng = np.random.default_rng(1)
    seen = {fz.check_header(header_fuzz.write(header_fuzz.mutant(rng), tmp_path / "m.gguf")) for _ in range(60)}
    assert seen == {"ok", "refused"}
    mc, raw = warm_state
    outcomes = set()
    for _ in range(200):
        (tmp_path / "s").write_bytes(fz.state_mutant(rng, raw))
        outcomes.add(fz.check_state(mc, tmp_path / "s"))
    (tmp_path / "s").write_bytes(raw)
    outcomes.add(fz.check_state(mc, tmp_path / "s"))
    assert outcomes == {"ok", "refused"}


_GRAMMAR_SEEDS = ['root ::= "yes" | "no"', 'root ::= [a-z]+ " " [0-9]*', 'root ::= ("a" | "b")* "c"',
                  'root ::= item+\nitem ::= "x" [^\\n]? "\\n"', 'root ::= [\\x01-\\x7F]{1,3}',
                  'root ::= "\\u00e9" | "\\x41"']
_GRAMMAR_PIECES = ['"', "[", "]", "(", ")", "|", "*", "+", "?", "\\", "\\x00", "\\u0000", "\\x", "::=", "root", "\n",
                   "#", "^", "-", "{", "}", "{2,1}", "\x00", "é", "x ::= y", " "]


def grammar_mutants(n: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        g = _GRAMMAR_SEEDS[rng.integers(len(_GRAMMAR_SEEDS))]
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(g) + 1))
            op = rng.integers(3)
            if op == 0:
                g = g[:i] + _GRAMMAR_PIECES[rng.integers(len(_GRAMMAR_PIECES))] + g[i:]
            elif op == 1 and g:
                g = g[:i] + g[i + 1:]
            else:
                g = g[:i] + g[i:][::-1][: int(rng.integers(0, 6))] + g[i:]
        yield g


def test_fuzz_grammars_never_kill_the_process(fixture_dir, tmp_path):
    """Mutated grammars through pymoecache.Llama (issue 25 item 4): each is refused with
    GrammarError or constrains a short generation; a signal ends the child and fails the test."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    cases = tmp_path / "grammars.json"
    cases.write_text(json.dumps(list(grammar_mutants(300, seed=25))))
    code = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import pymoecache, llama_cpp
llm = pymoecache.Llama({str(model_path(fixture_dir, "qwen2moe-60x4"))!r}, verbose=False)
ok = refused = 0
for g in json.load(open({str(cases)!r})):
    try:
        llm("Hi", max_tokens=2, temperature=0, grammar=llama_cpp.LlamaGrammar.from_string(g, verbose=False))
        ok += 1
    except pymoecache.GrammarError:
        refused += 1
print("OK", ok, "REFUSED", refused)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    ok, refused = int(r.stdout.split()[1]), int(r.stdout.split()[3])
    assert ok + refused == 300 and ok > 20 and refused > 20, r.stdout  # both outcomes reached
