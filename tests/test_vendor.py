"""llama.cpp is a dependency, never committed; our patches insert hook calls, or add a capability a backend lacks."""

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


def capability_problems(text: str) -> list:
    """What keeps a patch from being a capability patch (DEVELOPERS.md: where an issue needs a capability a backend
    lacks, a minimal patch of its own that says what it adds): its subject names one ggml backend ("ggml-cuda:
    ..."), its header says what it adds ("Adds ..."), it changes files of that backend only, at most 120 lines
    added and 5 removed. [] for such a patch."""
    m = re.search(r"^Subject: (ggml-[a-z]+): ", text, re.M)
    if not m:
        return ["its subject names no ggml backend"]
    header = text[:text.find("\ndiff --git")]
    files = re.findall(r"^diff --git a/(\S+)", text, re.M)
    added = [l for l in text.splitlines() if l.startswith("+") and not l.startswith("+++")]
    removed = [l for l in text.splitlines() if l.startswith("-") and not l.startswith("---")]
    problems = [] if "\nAdds " in header else ["its header does not say what it adds"]
    problems += [f for f in files if not f.startswith(f"ggml/src/{m.group(1)}/")]
    problems += [f"{len(added)} lines added"] if len(added) > 120 else []
    problems += [f"{len(removed)} lines removed"] if len(removed) > 5 else []
    return problems


def test_capability_check_can_fail():
    good = "Subject: ggml-cuda: x\n\nAdds y.\n\ndiff --git a/ggml/src/ggml-cuda/a.cu b/ggml/src/ggml-cuda/a.cu\n+z\n"
    assert capability_problems(good) == []
    assert capability_problems(good.replace("Adds", "Has")) == ["its header does not say what it adds"]
    assert capability_problems(good.replace("a/ggml/src/ggml-cuda/a.cu", "a/src/llama.cpp")) == ["src/llama.cpp"]
    assert capability_problems(good.replace("Subject: ggml-cuda:", "Subject: moecache")) != []
    assert capability_problems(good + "+z\n" * 120) == ["121 lines added"]


def test_patches_are_small_hook_insertions():
    """Every patch inserts hook calls only (at most 40 lines), or is a capability patch of one backend."""
    patches = sorted((ROOT / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch"))
    assert patches, "no patches"
    for p in patches:
        assert re.fullmatch(r"\d{4}-[a-z0-9_.-]+\.patch", p.name), p.name
        text = p.read_text()
        if re.search(r"^Subject: ggml-[a-z]+: ", text, re.M):
            assert capability_problems(text) == [], p.name
            continue
        added = [l[1:] for l in text.splitlines() if l.startswith("+") and not l.startswith("+++")]
        removed = [l for l in text.splitlines() if l.startswith("-") and not l.startswith("---")]
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
