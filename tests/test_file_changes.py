"""The model file changes under a running process (issue 25 item 5): truncated or replaced by
another process while a model generates. No signal may kill the process: a truncation inside a
decode is caught by the SIGBUS guard (src_cpp/moecache-guard.cpp) or the residency's own checks,
before a decode by the file check; either way MoECacheIOError. Each case runs in a child process,
so a SIGBUS fails the test instead of killing pytest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, http_request, model_path, running_server
from test_serve import needs_extras

QWEN = "qwen2moe-60x4"

_RACE = """
import os, sys, threading, time
sys.path.insert(0, {root!r})
import pymoecache
llm = pymoecache.Llama({path!r}, cache=pymoecache.CacheConfig(size={size}, residency={res!r}), verbose=False)
llm.eval(llm.tokenize(b"Hello"))
def truncate():
    time.sleep({delay})
    {action}
threading.Thread(target=truncate).start()
try:
    for i in range(4000):
        llm.eval([(i * 37) % 500 + 10])
    print("FINISHED")
except pymoecache.MoECacheIOError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("residency", ["none", "mmap", "stream"])
@pytest.mark.parametrize("action", ["truncate", "replace"])
def test_a_file_changed_during_generation_is_an_error_not_a_signal(fixture_dir, tmp_path, residency, action):
    outcomes = []
    for delay in (0.0, 0.01, 0.03, 0.06, 0.1):
        path = tmp_path / "m.gguf"
        shutil.copy(model_path(fixture_dir, QWEN), path)
        act = (f"os.truncate({str(path)!r}, os.path.getsize({str(path)!r}) // 3)" if action == "truncate" else
               f"open({str(path) + '.new'!r}, 'wb').write(b'GGUF' + bytes(4096)); os.replace({str(path) + '.new'!r}, "
               f"{str(path)!r})")
        code = _RACE.format(root=str(ROOT), path=str(path), size=1.0 if residency == "none" else 0.5, res=residency,
                            delay=delay, action=act)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"delay {delay}: exit {r.returncode} (a signal is negative)\n{r.stderr[-2000:]}"
        outcomes.append(r.stdout.strip().split(" ", 1)[0])
    # a replaced file leaves the old mapping intact, so generation may go on only until the check
    assert all(o == "REFUSED" for o in outcomes), outcomes


def test_every_decode_after_the_change_is_refused(fixture_dir, tmp_path):
    """Decoded tokens check the file every 10 ms (llama.CHECK_INTERVAL_S), not each one: a decode
    10 ms after the file was modified is refused, and so is one right after that (a retry): the
    refusal does not count as a check that passed."""
    import os
    import time

    import pymoecache

    path = tmp_path / "m.gguf"
    shutil.copy(model_path(fixture_dir, QWEN), path)
    llm = pymoecache.Llama(str(path), cache=pymoecache.CacheConfig(size=1.0), verbose=False)
    llm.eval(llm.tokenize(b"Hello"))
    llm.eval([42])
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # (its bytes unchanged: modified, as far as a stat says)
    time.sleep(2 * pymoecache.llama.CHECK_INTERVAL_S)
    for _ in range(3):
        with pytest.raises(pymoecache.MoECacheIOError, match="was modified since it was loaded"):
            llm.eval([43])
    llm.close()


def test_the_guard_answers_a_fault_inside_a_decode(fixture_dir, tmp_path):
    """No check before the decode (llama_cpp.Llama.eval directly): the truncated pages fault in the
    middle of the matmuls, the guard maps zeros and counts, and the process lives."""
    path = tmp_path / "m.gguf"
    shutil.copy(model_path(fixture_dir, QWEN), path)
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import pymoecache, llama_cpp
from pymoecache import _moecache_cpp as C
llm = pymoecache.Llama({str(path)!r}, cache=pymoecache.CacheConfig(size=1.0, residency="none"), verbose=False)
llm.eval(llm.tokenize(b"Hello"))
assert C.moecache_guard_faults(llm._guard) == 0
os.truncate({str(path)!r}, 4096)
llama_cpp.Llama.eval(llm, [100, 200, 300])
print("FAULTS", C.moecache_guard_faults(llm._guard))
try:
    llm.eval([5])
except pymoecache.MoECacheIOError as e:
    print("REFUSED", e)
llm.close()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    faults = int(r.stdout.split("FAULTS ")[1].split()[0])
    assert faults > 0 and "REFUSED" in r.stdout, r.stdout


def test_a_sigbus_elsewhere_still_kills(tmp_path):
    """The guard answers only faults inside a model's mapping: another mapped file that shrinks
    still raises SIGBUS (the previous handler, here the default action)."""
    f = tmp_path / "other.bin"
    f.write_bytes(bytes(1 << 16))
    code = f"""
import mmap, os, sys
sys.path.insert(0, {str(ROOT)!r})
import pymoecache
llm = pymoecache.Llama({str(ROOT / 'tests/fixtures/models/qwen2moe-60x4.gguf')!r}, verbose=False)  # installs the guard
fd = os.open({str(f)!r}, os.O_RDWR)
m = mmap.mmap(fd, 1 << 16)
os.truncate({str(f)!r}, 0)
print(m[40000])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -7, (r.returncode, r.stderr[-500:])  # SIGBUS


@needs_extras
def test_the_server_says_what_happened_and_keeps_answering(fixture_dir, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(model_path(fixture_dir, QWEN), path)
    with running_server(path, tmp_path / "server.log", "--cache-size", "30") as (base, proc):
        assert http_request(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 4})[0] == 200
        new = tmp_path / "m.gguf.new"
        new.write_bytes(b"GGUF" + bytes(4096))
        new.replace(path)
        import urllib.error
        with pytest.raises(urllib.error.HTTPError) as e:
            http_request(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert e.value.code == 503
        err = json.loads(e.value.read())["error"]
        assert err["type"] == "model_error" and "was replaced" in err["message"], err
        with pytest.raises(urllib.error.HTTPError) as e:  # a stream too: 503 before it starts, not an empty stream
            http_request(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "stream": True})
        assert e.value.code == 503
        assert json.loads(http_request(base + "/health")[1])["status"] == "ok"  # still serving what it can
        assert json.loads(http_request(base + "/moecache/stats")[1])["tokens"] > 0
        assert proc.poll() is None
