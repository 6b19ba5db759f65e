"""llama.cpp is a dependency, never committed; our patches only insert hook calls."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_vendor_tree_is_not_tracked():
    files = subprocess.run(["git", "ls-files", "vendor"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert files in ([], ["vendor/README.md"])


_HOOK_CALL = re.compile(r"\bmoecache_hook_\w+\(")


def non_hook_lines(added: list) -> list:
    """The added lines of a patch that are not hook insertions. A hook insertion is the include of
    moecache-hook.h, a statement calling moecache_hook_*(...), the continuation lines of such a
    call, or a comment that starts with "// pymoecache:" (alone or after one of those)."""
    bad = []
    in_call = False
    for line in added:
        code, _, comment = line.partition("//")
        code = code.strip()
        if comment and not comment.startswith(" pymoecache:"):
            bad.append(line)
        elif not code:
            in_call = in_call and not comment  # a comment line ends nothing; a blank line ends a call
        elif code == '#include "moecache-hook.h"':
            in_call = False
        elif _HOOK_CALL.search(code) or in_call:
            in_call = not code.endswith((";", "{"))
        else:
            bad.append(line)
    return bad


def test_hook_line_check_can_fail():
    assert non_hook_lines(["    int x = 1; // moecache", "// moecache: a comment", "    foo(); // pymoecache: x"]) == \
        ["    int x = 1; // moecache", "// moecache: a comment", "    foo(); // pymoecache: x"]
    assert non_hook_lines(['#include "moecache-hook.h"', "    y = moecache_hook_a(b,", "        c);",
                           "        // pymoecache: why"]) == []
    assert non_hook_lines(["    y = moecache_hook_a(b);", "        c);"]) == ["        c);"]


def test_patches_are_small_hook_insertions():
    patches = sorted((ROOT / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch"))
    assert patches, "no patches"
    for p in patches:
        assert re.fullmatch(r"\d{4}-[a-z0-9_.-]+\.patch", p.name), p.name
        added = [l[1:] for l in p.read_text().splitlines() if l.startswith("+") and not l.startswith("+++")]
        removed = [l for l in p.read_text().splitlines() if l.startswith("-") and not l.startswith("---")]
        assert len(added) <= 40 and len(removed) <= 5, (p.name, len(added), len(removed))
        assert non_hook_lines(added) == [], p.name


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
