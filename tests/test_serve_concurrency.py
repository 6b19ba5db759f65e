"""``pymoecache serve`` under concurrent clients (issue 25 item 3): a real server process on the
loopback, real clients in threads. Requests queue (bounded: 503 + Retry-After past the bound),
/moecache/stats and /health answer during a generation, nothing is cut, a client that disconnects
frees its place and stops its generation."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
from urllib.parse import urlparse

import pytest

from conftest import http_request, model_path, running_server
from test_serve import needs_extras

pytestmark = needs_extras

LONG = 600  # tokens of a long answer; min_tokens keeps the end-of-text token away until then


def _completion(base, n=LONG, stream=False, prompt="Once upon a time"):
    return http_request(base + "/v1/completions", {"prompt": prompt, "max_tokens": n, "min_tokens": n,
                                                   "temperature": 0, "stream": stream}, timeout=300)


def _in_thread(fn, *args, **kw):
    out = {}

    def run():
        try:
            out["result"] = fn(*args, **kw)
        except urllib.error.HTTPError as e:
            out["result"] = (e.code, e.read().decode(), {k.lower(): v for k, v in e.headers.items()})
        except Exception as e:  # noqa: BLE001 (reported by the test)
            out["error"] = repr(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _stats(base):
    return json.loads(http_request(base + "/moecache/stats", timeout=60)[1])


def _health(base):
    return json.loads(http_request(base + "/health", timeout=60)[1])


def _wait_idle(base, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = _health(base)
        if not h["generating"] and h["waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"server still busy: {h}")


def _wait_generating(base, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not _health(base)["generating"]:
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.02)


def _stream_tokens(text: str):
    events = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    return events, [json.loads(e) for e in events if e != "[DONE]"]


@pytest.fixture(scope="module")
def base(fixture_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-conc") / "server.log"
    with running_server(model_path(fixture_dir, "qwen2moe-60x4"), log, "--cache-size", "30", "--prior", "0.5",
                        "--max-queue", "2", "-c", "2048") as (url, _):
        yield url


def test_stats_and_health_answer_during_a_generation(base):
    _wait_idle(base)
    t, out = _in_thread(_completion, base)
    _wait_generating(base)
    polls = []
    while t.is_alive():
        polls.append(_stats(base)["tokens"])
        h = _health(base)
        assert h["status"] == "ok"
        time.sleep(0.01)
    t.join()
    assert "error" not in out, out
    status, text = out["result"][:2]
    assert status == 200, text
    assert json.loads(text)["usage"]["completion_tokens"] == LONG
    assert len(polls) >= 3 and polls == sorted(polls)  # snapshots between tokens, never going back
    assert polls[-1] > polls[0]


def test_two_streams_at_once_both_run_to_their_end(base):
    _wait_idle(base)
    threads = [_in_thread(_completion, base, 200, True, p) for p in ("Once upon a time", "It was a bright day")]
    for t, _ in threads:
        t.join()
    for _, out in threads:
        assert "error" not in out, out
        status, text = out["result"][:2]
        assert status == 200, text
        events, chunks = _stream_tokens(text)
        assert events[-1] == "[DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 190  # the whole answer, not cut


def test_a_full_queue_answers_503_with_retry_after(base):
    _wait_idle(base)
    first = _in_thread(_completion, base)
    _wait_generating(base)
    waiting = [_in_thread(_completion, base, 20) for _ in range(2)]  # max_queue 2: both may wait
    deadline = time.monotonic() + 60
    while _health(base)["waiting"] < 2:
        assert time.monotonic() < deadline, _health(base)
        time.sleep(0.02)
    t, out = _in_thread(_completion, base, 20)
    t.join()
    status, text, headers = out["result"]
    assert status == 503, text
    assert headers.get("retry-after") == "1"
    assert json.loads(text)["error"]["type"] == "unavailable_error"  # (llama-server's type of a 503)
    for t, out in [first] + waiting:  # the queued ones are served in turn
        t.join()
        assert out["result"][0] == 200, out


def _raw_post(base, body: dict) -> socket.socket:
    u = urlparse(base)
    s = socket.create_connection((u.hostname, u.port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_stops_its_generation(base, stream):
    _wait_idle(base)
    before = _stats(base)["tokens"]
    s = _raw_post(base, {"prompt": "Once upon a time", "max_tokens": 1500, "min_tokens": 1500, "temperature": 0,
                         "stream": stream})
    _wait_generating(base)
    time.sleep(0.3)
    s.close()
    _wait_idle(base)
    generated = _stats(base)["tokens"] - before
    assert 0 < generated < 1000, generated  # stopped soon after the disconnect, far from 1500 tokens
    status, text = _completion(base, 10)  # and the server serves the next request
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 10


def test_a_waiting_client_that_disconnects_frees_its_place(base):
    _wait_idle(base)
    first = _in_thread(_completion, base)
    _wait_generating(base)
    gone = [_raw_post(base, {"prompt": "x", "max_tokens": 50, "temperature": 0}) for _ in range(2)]
    deadline = time.monotonic() + 60
    while _health(base)["waiting"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for s in gone:
        s.close()
    first[0].join()
    assert first[1]["result"][0] == 200
    _wait_idle(base)  # the two that left do not hold the queue
    status, _ = _completion(base, 5)
    assert status == 200
