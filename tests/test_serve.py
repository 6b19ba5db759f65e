"""``pymoecache serve`` as a real process: OpenAI-style requests over HTTP on 127.0.0.1, then the
cache statistics at /moecache/stats. Skipped when the server extras are not installed."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import urllib.error

import pytest

from pymoecache import server
from conftest import ROOT, http_request, model_path, running_server

MISSING = [m for m in server._EXTRAS if importlib.util.find_spec(m) is None]
needs_extras = pytest.mark.skipif(bool(MISSING), reason=f"server extras not installed ({', '.join(MISSING)}): "
                                                        f"{server.PIP_SERVER}")
_request = http_request


def _post(url: str, body):
    status, text = _request(url, body)
    assert status == 200
    return json.loads(text)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pymoecache", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def url(fixture_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(model_path(fixture_dir, "qwen2moe-60x4"), log, "--prior", "0.5", "--cache-size", "30") as (base, _):
        yield base


@needs_extras
def test_defaults_auto_cache_and_llama_cpp_flags(fixture_dir, tmp_path):
    """No --cache-size: auto, which keeps all experts of this small model; -c, -t, -ngl as in llama-server."""
    with running_server(model_path(fixture_dir, "qwen2moe-60x4"), tmp_path / "log", "-c", "256", "-t", "1",
                        "-ngl", "0") as (base, _):
        st = json.loads(_request(base + "/moecache/stats")[1])
        assert st["cache_size"] == 60 and st["cache_choice"].startswith("auto: 60 of 60 experts per layer fit in")
        with pytest.raises(urllib.error.HTTPError) as e:
            _request(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 300})
        status, text = e.value.code, e.value.read().decode()
        assert status == 400 and "max_tokens" in text and "256" in text  # -c 256 is the context


def _check_request_stats(res) -> None:
    mc = res["moecache"]  # this request's own counters
    assert mc["tokens"] > 0
    assert mc["hits"] + mc["misses"] > 0 and mc["bytes_loaded"] >= 0
    assert 0.0 <= mc["hit_rate"] <= 1.0 and mc["hit_rate"] + mc["miss_rate"] == pytest.approx(1.0)


@needs_extras
def test_chat_completion(url):
    res = _post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}],
                                               "max_tokens": 8, "temperature": 0})
    assert res["object"] == "chat.completion" and res["id"]
    msg = res["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert res["choices"][0]["finish_reason"] in ("stop", "length")
    u = res["usage"]
    assert u["prompt_tokens"] > 0 and 0 < u["completion_tokens"] <= 8
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    _check_request_stats(res)


@needs_extras
def test_completion(url):
    res = _post(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    assert res["object"] == "text_completion"
    assert isinstance(res["choices"][0]["text"], str) and res["choices"][0]["finish_reason"] in ("stop", "length")
    assert res["usage"]["prompt_tokens"] > 0
    _check_request_stats(res)


@needs_extras
def test_streamed_completion_ends_with_stats(url):
    _, text = _request(url + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "stream": True})
    events = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    _check_request_stats(chunks[-1])


@needs_extras
def test_stats(url):
    before = json.loads(_request(url + "/moecache/stats")[1])
    res = _post(url + "/v1/completions", {"prompt": "The history of the city", "max_tokens": 8, "temperature": 0})
    st = json.loads(_request(url + "/moecache/stats")[1])
    assert st["tokens"] == before["tokens"] + res["moecache"]["tokens"] > 0
    assert st["routing"] == "prior:0.5" and st["top_j"] == 2 and st["routing_scope"] == "all"
    assert (st["n_expert"], st["n_expert_used"], st["cache_size"]) == (60, 4, 30)
    assert 0.0 < st["hit_rate"] <= 1.0 and st["hit_rate"] + st["miss_rate"] == pytest.approx(1.0)
    assert st["misses_per_token"] == pytest.approx(st["misses"] / st["tokens"])
    assert st["bytes_loaded"] == int(st["misses"] * st["expert_bytes"]) > 0
    assert st["lifetime"] > 0
    assert len(st["moe_layers"]) == len(st["hit_rate_per_layer"]) == len(st["cache_size_per_layer"]) > 0
    assert all(0.0 <= h <= 1.0 for h in st["hit_rate_per_layer"])
    # the per-layer counters are there, so the miss rate can be recomputed from them
    assert len(st["tokens_per_layer"]) == len(st["misses_per_layer"]) == len(st["moe_layers"])
    assert sum(st["misses_per_layer"]) == st["misses"]
    assert st["miss_rate"] == pytest.approx(sum(st["misses_per_layer"]) / (4 * sum(st["tokens_per_layer"])))


@needs_extras
def test_port_in_use_is_a_user_error(fixture_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _cli("serve", str(model_path(fixture_dir, "qwen2moe-60x4")), "--port", str(s.getsockname()[1]))
    assert r.returncode == 2
    assert "cannot listen on 127.0.0.1" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_extras_say_what_to_install(monkeypatch):
    from pymoecache import Error

    monkeypatch.setattr(server, "_EXTRAS", ("fastapi", "no_such_module_for_pymoecache"))
    with pytest.raises(Error, match=r"no_such_module_for_pymoecache.*pip install .*fastapi"):
        server.create_app("model.gguf")


@needs_extras
def test_profile_saved_at_shutdown_and_loaded_warm(fixture_dir, tmp_path):
    """serve --profile: the requests served go into the profile, written when the server stops
    (SIGTERM); the next server starts warm from it with the hottest experts pinned."""
    prof = tmp_path / "serve.moeprofile"
    model = model_path(fixture_dir, "qwen2moe-60x4")
    with running_server(model, tmp_path / "log1", "--cache-size", "30", "--profile", str(prof)) as (base, _):
        for prompt in ("Once upon a time", "The king said"):
            _post(base + "/v1/completions", {"prompt": prompt, "max_tokens": 8})
        assert not prof.exists()  # written at shutdown
    assert prof.is_file()
    with running_server(model, tmp_path / "log2", "--cache-size", "30", "--profile", str(prof), "--pin-hot", "3") \
            as (base, _):
        st = json.loads(_request(base + "/moecache/stats")[1])
        assert st["pinned"] == 3 * len(st["moe_layers"])
        assert "usage profile" in (tmp_path / "log2").read_text()


def test_a_client_that_hangs_up_before_its_body_leaves_no_traceback(fixture_dir, tmp_path):
    """A request whose client leaves halfway through sending it is logged as one line, not a traceback,
    and the server goes on."""
    import socket
    import time
    from urllib.parse import urlparse

    log = tmp_path / "server.log"
    with running_server(model_path(fixture_dir, "qwen2moe-60x4"), log, "-c", "256") as (base, _):
        host, port = urlparse(base).hostname, urlparse(base).port
        for path in ("/v1/completions", "/v1/chat/completions"):
            with socket.create_connection((host, port)) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: 100\r\n\r\n{{\"prompt\":".encode())
                time.sleep(0.3)
            time.sleep(0.3)
        assert http_request(base + "/health")[0] == 200
        status, text = http_request(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200
    text = log.read_text()
    assert "Traceback" not in text and "ClientDisconnect" not in text, text[-3000:]
    assert "failed" not in text, text[-3000:]
