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
