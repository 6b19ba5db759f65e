"""llama.cpp is a dependency, never committed; our patches only insert hook calls."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_vendor_tree_is_not_tracked():
    files = subprocess.run(["git", "ls-files", "vendor"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert files in ([], ["vendor/README.md"])


def test_patches_are_small_hook_insertions():
    patches = sorted((ROOT / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch"))
    assert patches, "no patches"
    for p in patches:
        assert re.fullmatch(r"\d{4}-[a-z0-9_.-]+\.patch", p.name), p.name
        added = [l[1:] for l in p.read_text().splitlines() if l.startswith("+") and not l.startswith("+++")]
        removed = [l for l in p.read_text().splitlines() if l.startswith("-") and not l.startswith("---")]
        assert len(added) <= 40 and len(removed) <= 5, (p.name, len(added), len(removed))
        # every added line is a hook: a call into moecache, its include, or a continuation of one
        for line in added:
            assert "moecache" in line or line.strip().startswith(("gating_op", "//")), line


def test_vendoring_is_idempotent():
    r = subprocess.run([sys.executable, "scripts/vendor_llama_cpp.py"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stdout


def test_vendor_tree_is_pristine_plus_one_commit_per_patch():
    n = len(list((ROOT / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch")))
    vendor = ROOT / "vendor" / "llama.cpp"
    out = subprocess.run(["git", "rev-list", "--count", "pristine..HEAD"], cwd=vendor, capture_output=True,
                         text=True, env={"GIT_CEILING_DIRECTORIES": str(vendor.parent), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == n
