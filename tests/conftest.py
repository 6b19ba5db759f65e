"""Shared fixtures: the project's own GGUF test models, built once (seconds) into
tests/fixtures/models by pymoecache.synth and reused across runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "models"
SHARED = ROOT.parent / "shared"

# run against the source tree (its build/*/bin library) even when pytest is started elsewhere
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYMOECACHE_HOME", str(ROOT / "tests" / "fixtures" / "home"))

import pymoecache  # noqa: E402  (loads our libllama before anything imports llama_cpp)
from pymoecache import synth  # noqa: E402

MOE_FIXTURES = [name for name, spec in synth.FIXTURES.items() if spec.n_expert > 0]
DENSE_FIXTURES = [name for name, spec in synth.FIXTURES.items() if spec.n_expert == 0]
VARIANTS = ["", ".Q8_0", ".Q4_K_M"]


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    synth.build_all(FIXTURE_DIR, verbose=False)
    return FIXTURE_DIR


def model_path(fixture_dir: Path, name: str, variant: str = "") -> Path:
    return fixture_dir / f"{name}{variant}.gguf"
