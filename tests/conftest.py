"""Shared fixtures: the project's own GGUF test models, built once (seconds) into
tests/fixtures/models by tools/synth/ and reused across runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "models"
SHARED = ROOT.parent / "shared"

# run against the source tree (its build/*/bin library) even when pytest is started elsewhere
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # synth: the fixture model builder (a dev tool, not in the wheel)
os.environ.setdefault("PYMOECACHE_HOME", str(ROOT / "tests" / "fixtures" / "home"))

import pymoecache  # noqa: E402  (loads our libllama before anything imports llama_cpp)

# A test run started as a background job (`cmd &` in a shell without job control, as CI runners and
# nohup do) inherits SIGINT ignored, and so would every process a test starts: the Ctrl-C tests of
# chat, bench and ppl would then see nothing. A handler here (rather than SIG_IGN) is reset to the
# default in every child at exec, so the children get Ctrl-C as a user's terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
import synth  # noqa: E402

MOE_FIXTURES = [name for name, spec in synth.FIXTURES.items() if spec.n_expert > 0]
DENSE_FIXTURES = [name for name, spec in synth.FIXTURES.items() if spec.n_expert == 0]
VARIANTS = ["", ".Q8_0", ".Q4_K_M"]


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    synth.build_all(FIXTURE_DIR, verbose=False)
    return FIXTURE_DIR


def model_path(fixture_dir: Path, name: str, variant: str = "") -> Path:
    return fixture_dir / f"{name}{variant}.gguf"


# --- `pymoecache serve` as a real process on 127.0.0.1 ------------------------------------------
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight there, whatever HTTP_PROXY says


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_request(url: str, body=None, timeout: float = 120, raw: bytes = None, method: str = None):
    """(status, text) of one request; a JSON ``body`` or ``raw`` bytes. HTTP errors raise."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method=method)
    with _opener.open(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def http_json(url: str, body=None):
    """(status, JSON answer) of one request, an HTTP error's included."""
    import urllib.error

    try:
        status, text = http_request(url, body)
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    return status, json.loads(text)


@contextlib.contextmanager
def running_server(model, log: Path, *args):
    """Start `pymoecache serve -m MODEL ARGS` on a free port, yield its base URL, stop it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "pymoecache", "serve", "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                http_request(base + "/health", timeout=5)
                break
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    pytest.fail(f"server did not answer within 60 s:\n{log.read_text()[-3000:]}")
                time.sleep(0.25)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def gpu():
    """A local RPC server (`pymoecache rpc-server`) for the whole session, the device of the RPC tests:
    one for all of them (its device stays registered in this process, and llama.cpp would abort a load
    that finds a registered server gone, or offload to two)."""
    from pymoecache import rpc

    with rpc.LocalServer(threads=1) as server:
        yield server.endpoint


def not_a_regular_file(tmp_path: Path, kind: str, name: str) -> Path:
    """``tmp_path / name`` made as something a writer must refuse: "dev-full" (a character device
    numbered as /dev/full, made by mknod: root only, the test is skipped otherwise), "fifo",
    "link-loop", "directory" or "link-to-fifo". Made here, in the test's own folder: a test never points
    a writer at a system path (a broken fix would replace that node)."""
    import stat

    path = tmp_path / name
    if kind == "dev-full":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        except (PermissionError, AttributeError):
            pytest.skip("making a device node needs root")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-loop":
        os.symlink(path, path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / (name + ".fifo"))
        os.symlink(tmp_path / (name + ".fifo"), path)
    else:
        raise ValueError(kind)
    return path
