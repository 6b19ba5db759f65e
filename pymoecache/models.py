"""Models the project ships or builds: the embedded default model and the test fixtures.

The default model is built on first use into ``$PYMOECACHE_HOME`` (default
``~/.cache/pymoecache``) from the deterministic generator in :mod:`pymoecache.synth`.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "qwen2moe-60x4"  # 60 routed experts, top-4, shared experts (Qwen1.5-MoE layout)


def home_dir() -> Path:
    """Where pymoecache keeps models it builds: ``$PYMOECACHE_HOME`` or ``~/.cache/pymoecache``."""
    return Path(os.environ.get("PYMOECACHE_HOME") or Path.home() / ".cache" / "pymoecache")


def default_model_path() -> Path:
    """Path of the embedded default model, building it (a few seconds, offline) if needed.

    >>> default_model_path().suffix
    '.gguf'
    """
    from .synth import build_fixture

    return build_fixture(DEFAULT_MODEL, home_dir() / "models")
