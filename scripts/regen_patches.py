#!/usr/bin/env python3
"""Rewrite patches/ from the commits in vendor/llama.cpp on top of the `pristine` tag.

Workflow for changing a hook (or bumping the pin):
    python scripts/vendor_llama_cpp.py          # vendor/llama.cpp = pristine + patches, one commit each
    cd vendor/llama.cpp && $EDITOR src/...      # edit
    git commit -a --amend     (or: git commit -a -m "subject of a new patch")
    cd ../.. && python scripts/regen_patches.py # patches/NNNN-subject.patch, numbered in commit order

Each commit becomes one numbered patch named after its subject (git format-patch), with
volatile header lines (commit hash, date, version trailer) removed so diffs stay small.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"
PATCHES = ROOT / "patches"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vendor_llama_cpp import STAMP, wanted_stamp  # noqa: E402


def main() -> None:
    if not (VENDOR / ".git").exists():
        sys.exit("vendor/llama.cpp is missing; run scripts/vendor_llama_cpp.py first")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(VENDOR.parent))
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=VENDOR,
                           env=env, text=True, capture_output=True, check=True).stdout
    if dirty.strip():
        sys.exit("vendor/llama.cpp has uncommitted edits; commit them there first:\n" + dirty)
    for old in PATCHES.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        old.unlink()
    out = subprocess.run(["git", "format-patch", "pristine..HEAD", "-o", str(PATCHES), "--zero-commit",
                          "--no-signature", "--no-stat", "--no-numbered", "--keep-subject"],
                         cwd=VENDOR, env=env, text=True, capture_output=True, check=True).stdout.split()
    for name in out:
        p = Path(name)
        lines = [ln for ln in p.read_text().splitlines(keepends=True) if not ln.startswith("Date: ")]
        p.write_text("".join(lines))
        print(f"wrote patches/{p.name}")
    STAMP.write_text(wanted_stamp())  # the tree now matches the patch files


if __name__ == "__main__":
    main()
