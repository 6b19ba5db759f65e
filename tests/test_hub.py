"""Hugging Face downloads (pymoecache.hub), offline only: a closed local port stands for an
unreachable hub, HF_HUB_OFFLINE for offline mode, a small HTTP server on 127.0.0.1 for the hub's
answers (a file, an unknown repository, an unknown file), and a cache built in tmp_path for files
downloaded before. HF_ENDPOINT is read when huggingface_hub is imported, so those cases run in a
subprocess."""

from __future__ import annotations

import hashlib
import http.server
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from pymoecache import hub
from conftest import ROOT

needs_hub = pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is None,
                               reason=f"huggingface_hub not installed: {hub.PIP_HUB}")

CONTENT = b"GGUF" + bytes(60)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free, so nothing listens there once closed


def _fake_cache(root, repo="own/repo", filename="m.gguf"):
    """A file downloaded before, in the layout of the Hugging Face cache (without symlinks)."""
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(COMMIT)
    p = d / "snapshots" / COMMIT / filename
    p.parent.mkdir(parents=True)
    p.write_bytes(CONTENT)
    return p


def _hub_env(tmp_path, endpoint):
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_CACHE=str(tmp_path / "hf-cache"), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_HUB_OFFLINE", None)
    return env


def _download_in_subprocess(env, *files):
    """hub.download of each (repo, file) in a fresh process: {"path": ...} or {"error": message}."""
    code = ("import json, sys\nfrom pymoecache import hub\nres = []\n"
            "for repo, f in json.loads(sys.argv[1]):\n"
            "    try:\n        res.append({'path': str(hub.download(repo, f, progress=False))})\n"
            "    except hub.HubError as e:\n        res.append({'error': str(e)})\n"
            "print(json.dumps(res))\n")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(files)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for this process (huggingface_hub read the variable at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def fake_hub():
    """A hub on 127.0.0.1 with one repository, own/repo, holding one file, m.gguf."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body):
            parts = self.path.split("?")[0].split("/")  # /OWNER/NAME/resolve/REVISION/FILE
            is_file = len(parts) >= 6 and parts[3] == "resolve"
            repo, name = "/".join(parts[1:3]), "/".join(parts[5:])
            if is_file and repo != "own/repo":
                return self._status(404, RepoNotFound="Repository not found")
            if is_file and name != "m.gguf":
                return self._status(404, EntryNotFound="Entry not found")
            self.send_response(200)
            data = CONTENT if is_file else b""
            if is_file:
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(CONTENT).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _status(self, code, **error):
            (name, message), = error.items()
            self.send_response(code)
            self.send_header("X-Error-Code", name)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_not_a_gguf_name(tmp_path):
    for fn in (hub.download, hub.resolve):
        with pytest.raises(hub.HubError, match=r"^config\.json is not a GGUF file \(the name must end in \.gguf\)$"):
            fn("own/repo", "config.json", cache_dir=tmp_path)


def test_missing_huggingface_hub_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import huggingface_hub now raises ImportError
    with pytest.raises(hub.HubError, match=r"needs huggingface_hub: pip install \"huggingface-hub"):
        hub.download("own/repo", "m.gguf")


@needs_hub
def test_cached_file_is_found_offline(tmp_path, offline):
    p = _fake_cache(tmp_path)
    assert hub.resolve("own/repo", "m.gguf", cache_dir=tmp_path) == p
    assert hub.resolve("own/repo", "other.gguf", cache_dir=tmp_path) is None
    assert hub.resolve("own/other", "m.gguf", cache_dir=tmp_path) is None
    assert hub.download("own/repo", "m.gguf", cache_dir=tmp_path, progress=False) == p


@needs_hub
def test_offline_mode_and_not_cached(tmp_path, offline):
    with pytest.raises(hub.HubError) as e:
        hub.download("own/repo", "m.gguf", cache_dir=tmp_path)
    msg = str(e.value)
    assert "could not reach the Hugging Face Hub (HF_HUB_OFFLINE is set)" in msg
    assert "own/repo/m.gguf is not in the local cache" in msg and "pass its path as MODEL" in msg
    assert "\n" not in msg


@needs_hub
def test_unreachable_hub(tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = _hub_env(tmp_path, endpoint)
    cached = _fake_cache(tmp_path / "hf-cache", "own/cached")
    res = _download_in_subprocess(env, ("own/repo", "m.gguf"), ("own/cached", "m.gguf"))
    msg = res[0]["error"]
    assert f"could not reach the Hugging Face Hub (no connection to {endpoint})" in msg
    assert "download the file elsewhere and pass its path as MODEL" in msg and "\n" not in msg
    assert res[1] == {"path": str(cached)}  # downloaded before: found without the hub


@needs_hub
def test_fake_hub_download_and_not_found(tmp_path, fake_hub):
    res = _download_in_subprocess(_hub_env(tmp_path, fake_hub), ("own/repo", "m.gguf"), ("own/repo", "m.gguf"),
                                  ("nobody/nothing", "m.gguf"), ("own/repo", "missing.gguf"))
    p = res[0]["path"]
    assert p.startswith(str(tmp_path / "hf-cache")) and p.endswith("m.gguf") and open(p, "rb").read() == CONTENT
    assert res[1] == res[0]
    assert res[2]["error"].startswith("repository nobody/nothing not found on the Hugging Face Hub")
    assert res[3]["error"].startswith("missing.gguf not found in repository own/repo")


@needs_hub
def test_cli_run_with_unreachable_hub(tmp_path):
    # depends on cli.py: run --hf-repo/--hf-file -> hub.download, HubError -> UserError (exit 2, one line)
    env = _hub_env(tmp_path, f"http://127.0.0.1:{_closed_port()}")
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", "--hf-repo", "x/y", "--hf-file", "m.gguf"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pymoecache run: error: could not reach the Hugging Face Hub")


@needs_hub
def test_run_hf_repo_with_a_quant_picks_the_file_llama_cpp_would(tmp_path, fixture_dir):
    """-hf OWNER/REPO[:QUANT] offline: the cached repository's files are listed and the one whose
    name carries the quantization (default Q4_K_M) runs; -hff overrides the quant."""
    model = fixture_dir / "qwen2moe-60x4.gguf"
    root = tmp_path / "hf-cache" / "models--own--moe"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name in ("moe-Q8_0.gguf", "moe-Q4_K_M.gguf", "mmproj-moe-f16.gguf"):
        (snap / name).symlink_to(model)
    (snap / "README.md").write_text("a model card")
    env = dict(_hub_env(tmp_path, f"http://127.0.0.1:{_closed_port()}"), HF_HUB_OFFLINE="1")

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "pymoecache", "run", *args, "-n", "2", "--json"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        return r, (json.loads(r.stdout)["model"] if r.returncode == 0 else None)

    for args, want in ((["-hf", "own/moe:q8_0"], "moe-Q8_0.gguf"), (["-hf", "own/moe"], "moe-Q4_K_M.gguf"),
                       (["--hf-repo", "own/moe:Q8_0", "-hff", "moe-Q4_K_M.gguf"], "moe-Q4_K_M.gguf")):
        r, path = run(*args)
        assert r.returncode == 0, r.stderr
        assert path == str(snap / want)
    r, _ = run("-hf", "own/moe:IQ1_S")
    assert r.returncode == 2 and "own/moe has no GGUF file for quantization IQ1_S" in r.stderr
    assert "moe-Q8_0.gguf" in r.stderr  # says what there is
    r, _ = run("-hf", "own/unknown")
    assert r.returncode == 2 and "no file of own/unknown is in the local cache" in r.stderr


def test_from_pretrained_offline_is_one_pymoecache_error(tmp_path):
    """llama-cpp-python's from_pretrained raised huggingface_hub's and httpx's own errors; ours is a
    pymoecache.Error of one line (issue 43 item 3)."""
    code = ("import pymoecache\n"
            "try:\n    pymoecache.Llama.from_pretrained('own/moe', '*.gguf', n_ctx=64)\n"
            "except pymoecache.Error as e:\n    print(type(e).__name__, '|', e)\n")
    for env in (dict(_hub_env(tmp_path, f"http://127.0.0.1:{_closed_port()}"), HF_HUB_OFFLINE="1"),
                _hub_env(tmp_path, f"http://127.0.0.1:{_closed_port()}")):
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        kind, _, msg = r.stdout.strip().partition(" | ")
        assert kind == "HubError" and "own/moe" in msg and "\n" not in r.stdout.strip(), r.stdout
        # the CLI's reason and fix (issue 56 item 6), not the resolver's errno
        assert "could not reach the Hugging Face Hub" in msg and "pass its path" in msg and "Errno" not in msg, msg
