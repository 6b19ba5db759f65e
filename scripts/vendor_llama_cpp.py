#!/usr/bin/env python3
"""Populate vendor/llama.cpp from the pinned llama-cpp-python sdist and apply patches/.

    python scripts/vendor_llama_cpp.py            # fetch (once), extract, patch; no-op if up to date
    python scripts/vendor_llama_cpp.py --force    # throw away vendor/llama.cpp and start again

The sdist is fetched with pip (PyPI only), checked against PIN_SHA256 and kept in .cache/.
vendor/llama.cpp becomes a small git repository: the pristine upstream tree is tagged
`pristine`, and every patch is applied with `git am` as one commit. That is what lets
scripts/regen_patches.py turn an edited tree back into patch files.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_pin() -> str:
    """The llama-cpp-python version pyproject.toml pins (the one place it is written)."""
    m = re.search(r'"llama-cpp-python==([0-9][0-9.]*)"', (ROOT / "pyproject.toml").read_text())
    if not m:
        sys.exit("[vendor] error: pyproject.toml pins no llama-cpp-python==X.Y.Z")
    return m.group(1)


PIN_VERSION = read_pin()
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # of that version's sdist
VENDOR = ROOT / "vendor" / "llama.cpp"
PATCHES = ROOT / "patches"
CACHE = ROOT / ".cache"
SDIST_NAME = f"llama_cpp_python-{PIN_VERSION}.tar.gz"
STAMP = VENDOR / ".pymoecache-stamp"

GIT_ID = ["-c", "user.name=pymoecache-vendor", "-c", "user.email=vendor@pymoecache.invalid",
          "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false"]


def log(msg: str) -> None:
    print(f"[vendor] {msg}", flush=True)


def die(msg: str) -> None:
    print(f"[vendor] ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def git(*args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    # GIT_CEILING_DIRECTORIES keeps git from walking up into the pymoecache repository
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(VENDOR.parent))
    return subprocess.run(["git", *GIT_ID, *args], cwd=VENDOR, env=env, check=check,
                          text=True, capture_output=capture)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def patch_files() -> list[Path]:
    return sorted(PATCHES.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def wanted_stamp() -> str:
    """Identity of a correctly vendored tree: the pin plus the content of every patch."""
    lines = [f"llama-cpp-python {PIN_VERSION} {PIN_SHA256}"]
    for p in patch_files():
        lines.append(f"{p.name} {sha256(p)}")
    return "\n".join(lines) + "\n"


def fetch_sdist() -> Path:
    CACHE.mkdir(exist_ok=True)
    sdist = CACHE / SDIST_NAME
    if sdist.exists() and sha256(sdist) == PIN_SHA256:
        return sdist
    log(f"downloading llama-cpp-python=={PIN_VERSION} sdist from PyPI")
    # --no-build-isolation: pip would otherwise build cmake from source just to read metadata
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", str(CACHE), f"llama-cpp-python=={PIN_VERSION}"]
    r = subprocess.run(cmd)
    if r.returncode != 0 or not sdist.exists():
        die("could not download the llama-cpp-python sdist (is PyPI reachable? is scikit-build-core "
            "installed? `pip install scikit-build-core`)")
    got = sha256(sdist)
    if got != PIN_SHA256:
        sdist.unlink()
        die(f"sha256 mismatch for {SDIST_NAME}: got {got}, pinned {PIN_SHA256}")
    return sdist


def extract(sdist: Path) -> None:
    prefix = f"llama_cpp_python-{PIN_VERSION}/vendor/llama.cpp/"
    tmp = VENDOR.with_name("llama.cpp.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"extracting {prefix} -> vendor/llama.cpp")
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            m.name = m.name[len(prefix):]
            if m.name and m.name != ".git":  # the sdist keeps upstream's submodule pointer file
                members.append(m)
        tar.extractall(tmp, members=members, filter="data") if sys.version_info >= (3, 12) \
            else tar.extractall(tmp, members=members)
    shutil.rmtree(VENDOR, ignore_errors=True)
    tmp.rename(VENDOR)
    git("init", "-q")
    git("add", "-A", "-f")
    git("commit", "-q", "-m", f"pristine llama.cpp from llama-cpp-python {PIN_VERSION}")
    git("tag", "pristine")


def apply_patches() -> None:
    for p in patch_files():
        r = git("am", "-q", "--keep-cr", str(p), check=False, capture=True)
        if r.returncode != 0:
            git("am", "--abort", check=False, capture=True)
            die(f"patch {p.name} does not apply to llama.cpp from llama-cpp-python {PIN_VERSION}:\n"
                f"{r.stdout}{r.stderr}\n"
                "Fix the hook by hand in vendor/llama.cpp, commit it there, then run "
                "scripts/regen_patches.py.")
        log(f"applied {p.name}")


def tree_is_dirty() -> bool:
    r = git("status", "--porcelain", "--untracked-files=no", check=False, capture=True)
    return r.returncode == 0 and bool(r.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="discard vendor/llama.cpp (and any edits in it) and redo")
    ap.add_argument("--print-pin", action="store_true", help="print the pinned llama-cpp-python version and exit")
    args = ap.parse_args()
    if args.print_pin:
        print(PIN_VERSION)
        return

    stamp = wanted_stamp()
    if VENDOR.exists() and STAMP.exists() and STAMP.read_text() == stamp and not args.force:
        log(f"vendor/llama.cpp is up to date (llama-cpp-python {PIN_VERSION}, {len(patch_files())} patches)")
        return
    if VENDOR.exists() and (VENDOR / ".git").exists() and tree_is_dirty() and not args.force:
        die("vendor/llama.cpp has uncommitted edits; commit them there and run scripts/regen_patches.py, "
            "or pass --force to discard them")

    extract(fetch_sdist())
    apply_patches()
    STAMP.write_text(stamp)
    log("done")


if __name__ == "__main__":
    main()
