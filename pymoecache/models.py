"""Models the project ships or builds: the embedded default model and the test fixtures.

The default model is ``tiny-shakespeare-qwen2moe-60x4``: a small MoE (qwen2moe layout, 60 routed
experts, top-4, one shared expert) whose router and experts were really trained, on Tiny
Shakespeare, by ``scripts/train_tiny_moe.py --preset A``. Its GGUF and model card live in
``models/`` of the repository and are installed into the wheel as ``pymoecache/data/``.
Random-weight models for tests are built by tools/synth/ in a source checkout (not installed).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "tiny-shakespeare-qwen2moe-60x4"  # trained; 60 routed experts, top-4, a shared expert

_PKG_DIR = Path(__file__).resolve().parent


def home_dir() -> Path:
    """Where pymoecache keeps models it builds: ``$PYMOECACHE_HOME`` or ``~/.cache/pymoecache``."""
    return Path(os.environ.get("PYMOECACHE_HOME") or Path.home() / ".cache" / "pymoecache")


def default_model_path() -> Path:
    """Path of the embedded default model (the installed copy, else the checkout's ``models/``).

    >>> default_model_path().name
    'tiny-shakespeare-qwen2moe-60x4.gguf'
    """
    name = f"{DEFAULT_MODEL}.gguf"
    places = (_PKG_DIR / "data" / name, _PKG_DIR.parent / "models" / name)
    for p in places:
        if p.is_file():
            return p
    from .errors import ModelNotFoundError

    raise ModelNotFoundError(
        f"the default model {name} is missing (looked in {', '.join(str(p.parent) for p in places)}); "
        "reinstall pymoecache, or rebuild it with `python scripts/train_tiny_moe.py --preset A`")
