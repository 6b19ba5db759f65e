"""``pymoecache serve`` as llama-server users expect it, against a real server process: /health,
/props, /slots, /metrics (Prometheus text), --api-key, --alias, -np with the queue, -c 0 from the
model, and the openai client streaming with ``stream_options.include_usage``."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from pymoecache import server
from conftest import http_request, model_path, running_server

MISSING = [m for m in server._EXTRAS if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"server extras not installed: {server.PIP_SERVER}")
MODEL = "qwen2moe-60x4"
KEY = "sekrit-123"


def _get(url, key=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def _post(url, body, key=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=300) as r:
        return r.status, r.read().decode()


def _metrics(text):
    """{name: value} of Prometheus' text format; every sample must have its HELP and TYPE."""
    out, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            assert name in typed, f"{name} has no # TYPE line"
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def keyed(fixture_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("parity") / "server.log"
    with running_server(model_path(fixture_dir, MODEL), log, "--api-key", KEY, "--alias", "tiny-moe", "-np", "2",
                        "--max-queue", "1", "--cache-size", "30", "--prior", "0.5") as (base, _):
        yield base, log


def test_api_key_alias_props_slots_health(keyed, fixture_dir):
    from pymoecache.model_info import model_info

    base, log = keyed
    n_ctx_train = model_info(model_path(fixture_dir, MODEL)).n_ctx_train
    assert _get(base + "/health")[0] == 200  # public, as llama-server's
    for path in ("/v1/models", "/props", "/slots", "/metrics", "/moecache/stats", "/docs", "/openapi.json"):
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(base + path)
        assert e.value.code == 401, path
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(base + path, key="wrong")
        assert e.value.code == 401, path
    for path in ("/v1/completions", "/completion", "/tokenize", "/detokenize", "/embedding"):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(base + path, {"prompt": "Hi", "max_tokens": 2})
        assert e.value.code == 401, path
        err = json.loads(e.value.read())["error"]  # OpenAI's error body, as every status
        assert err["type"] == "authentication_error" and err["code"] == 401 and err["message"]
    assert json.loads(_get(base + "/openapi.json", KEY)[2])["info"]["title"] == "pymoecache"
    assert "swagger" in _get(base + "/docs", KEY)[2].lower()
    models = json.loads(_get(base + "/v1/models", KEY)[2])
    assert [m["id"] for m in models["data"]] == ["tiny-moe"]
    res = json.loads(_post(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, KEY)[1])
    assert res["model"] == "tiny-moe"
    props = json.loads(_get(base + "/props", KEY)[2])
    assert props["total_slots"] == 2 and props["model_alias"] == "tiny-moe"
    # -c 0 (the default): the model's context, half of it each of the 2 slots' (issue 77: llama-server's slots)
    assert props["n_ctx"] == n_ctx_train and props["default_generation_settings"]["n_ctx"] == n_ctx_train // 2
    assert props["moecache"]["routing"] == "prior:0.5"
    slots = json.loads(_get(base + "/slots", KEY)[2])
    assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
    assert f"context {n_ctx_train} (the model's) ({n_ctx_train // 2} per slot; -kvu shares it), 2 slot(s) + 1 queued" \
        in log.read_text()


def test_metrics_count_tokens_and_the_cache(keyed):
    base, _ = keyed
    status, ctype, text = _get(base + "/metrics", KEY)
    assert status == 200 and ctype.startswith("text/plain")
    before = _metrics(text)
    res = json.loads(_post(base + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                                      "temperature": 0}, KEY)[1])
    after = _metrics(_get(base + "/metrics", KEY)[2])
    n = res["usage"]["completion_tokens"]
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] in (n - 1, n)
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and after["llamacpp:requests_deferred"] == 0
    assert after["pymoecache:tokens_total"] - before["pymoecache:tokens_total"] == res["moecache"]["tokens"]
    assert after["pymoecache:cache_misses_total"] - before["pymoecache:cache_misses_total"] == res["moecache"]["misses"]
    assert 0 < after["pymoecache:cache_hit_rate"] <= 1
    assert "pymoecache:bytes_read_total" in after


def test_slots_take_turns_and_the_queue_holds_the_rest(fixture_dir, tmp_path):
    """-np 2 --max-queue 1: three requests are in the server at once (one decodes, two wait); a
    fourth gets 503; all three finish, in turn."""
    results, errors = [], []

    def request(base, n):
        try:
            results.append(json.loads(_post(base + "/v1/completions", {"prompt": "Once", "max_tokens": n,
                                                                       "min_tokens": n, "temperature": 0})[1]))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    with running_server(model_path(fixture_dir, MODEL), tmp_path / "log", "-np", "2", "--max-queue", "1",
                        "-c", "2048", "--cache-size", "30", "-kvu") as (base, _):  # (-kvu: 1500 tokens in one slot)
        threads = [threading.Thread(target=request, args=(base, 1500))]
        threads[0].start()
        deadline = time.monotonic() + 60
        while not json.loads(_get(base + "/health")[2])["generating"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for _ in range(2):
            threads.append(threading.Thread(target=request, args=(base, 20)))
            threads[-1].start()
        while json.loads(_get(base + "/health")[2])["waiting"] < 2:
            assert time.monotonic() < deadline, errors
            time.sleep(0.02)
        slots = json.loads(_get(base + "/slots")[2])
        assert [s["state"] for s in slots] == ["generating", "waiting"] and slots[0]["is_processing"]
        assert _metrics(_get(base + "/metrics")[2])["llamacpp:requests_deferred"] == 2
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert e.value.code == 503 and e.value.headers["Retry-After"]
        for t in threads:
            t.join(timeout=300)
    # (llama-cpp-python finishes a character whose UTF-8 bytes span tokens past max_tokens: up to 3 more)
    assert not errors and len(results) == 3
    got = sorted(r["usage"]["completion_tokens"] for r in results)
    assert 20 <= got[0] <= got[1] <= 23 and 1500 <= got[2] <= 1503, got


def test_n_greater_than_one_is_refused(keyed):
    base, _ = keyed
    for path, body in (("/v1/completions", {"prompt": "Hi", "n": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 3})):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(base + path, body, KEY)
        assert e.value.code == 400 and "'n' must be 1" in e.value.read().decode()


def test_stream_options_are_checked(keyed):
    base, _ = keyed
    for body, code in (({"prompt": "Hi", "stream_options": {"include_usage": True}}, 400),  # without stream
                       ({"prompt": "Hi", "stream": True, "stream_options": "yes"}, 400)):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(base + "/v1/completions", body, KEY)
        assert e.value.code == code and "stream_options" in e.value.read().decode()


@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")
def test_openai_client_streams_with_include_usage(keyed):
    import openai

    base, _ = keyed
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["tiny-moe"]
    whole = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                                       whole.usage.completion_tokens)
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(model="tiny-moe", prompt="Once upon a time", max_tokens=5, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert plain[-1].usage.completion_tokens == 5 and plain[-1].usage.total_tokens > 5
    without = list(client.completions.create(model="tiny-moe", prompt="Once", max_tokens=3, stream=True))
    assert all(c.usage is None for c in without)


@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")
def test_max_completion_tokens_and_n_predict_are_limits(keyed):
    """What current OpenAI SDKs send (max_completion_tokens) and llama-server's n_predict limit the
    answer as max_tokens does; two different limits are a 400 (issue 43 item 1)."""
    import openai

    base, _ = keyed
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Hello"}],
                                          max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert 1 <= chat.usage.completion_tokens <= 3
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Hello"}],
                                                 max_completion_tokens=4, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens <= 4
    for body in ({"prompt": "Once upon a time", "n_predict": 3}, {"prompt": "Once upon a time", "max_completion_tokens": 3},
                 {"prompt": "Once upon a time", "max_tokens": 3, "n_predict": 3}):
        res = json.loads(_post(base + "/v1/completions", dict(body, temperature=0, logit_bias={}), KEY)[1])
        assert 1 <= res["usage"]["completion_tokens"] <= 3, (body, res)
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(base + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "max_completion_tokens": 5}, KEY)
    assert e.value.code == 400 and "give one limit" in e.value.read().decode()


def test_serve_context_is_capped_by_memory():
    from pymoecache.plan import memory_context as serve_context
    from pymoecache.model_info import ModelInfo

    info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=4 << 30, n_layer=32, moe_layers=[1],
                     n_expert=8, n_expert_used=2, n_expert_shared=0, gating="softmax", n_expert_groups=0,
                     expert_bytes=1, expert_bytes_total=8, n_embd=4096, n_ctx_train=131072)
    assert serve_context(info, available=1 << 40) == (131072, " (the model's)")
    # 4 B x 32 layers x 4096 = 512 KiB per position; (8 GiB - 4 GiB dense) / 4 = 1 GiB for the KV cache
    n, note = serve_context(info, available=8 << 30)
    assert n == 2048 and "capped by the free memory" in note
    assert serve_context(info, available=1 << 20)[0] == 512  # never below 512


def _post_raw(url, raw: bytes, key=None):
    req = urllib.request.Request(url, data=raw, method="POST", headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=300) as r:
        return r.status, r.read().decode()


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                                   "frequency_penalty"])
@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "1e400", "9" * 400])
def test_numbers_that_overflow_are_400(keyed, path, field, number):
    """Issue 53 item 6: Infinity or a 400-digit integer in a sampling field was a 500 with an OverflowError
    traceback; it is a 400 that names the problem, and the server answers the next request."""
    base, log = keyed
    head = ('"messages": [{"role": "user", "content": "Hi"}]' if "chat" in path else '"prompt": "Hi"')
    raw = ("{" + head + f', "max_tokens": 2, "n_predict": 2, "{field}": {number}' + "}").encode()
    with pytest.raises(urllib.error.HTTPError) as e:
        _post_raw(base + path, raw, KEY)
    text = e.value.read().decode()
    assert e.value.code == 400, text
    assert "Traceback" not in text and ("no field takes" in text or field in text), text
    assert "OverflowError" not in log.read_text()
    assert http_request(base + "/health")[0] == 200


@pytest.mark.parametrize("path, body, says", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 10 ** 6}, "'top_logprobs' must be an integer in [0, "),
    ("/v1/completions", {"logprobs": 10 ** 6}, "'logprobs' must be an integer in [0, "),
    ("/v1/completions", {"logprobs": 2, "echo": True}, "'logprobs' with 'echo' needs the logits"),
])
def test_logprobs_a_server_cannot_answer_are_400_not_503(keyed, path, body, says):
    """Issue 53 item 7: these were 503 model_error, which OpenAI clients retry; they are the client's errors."""
    base, _ = keyed
    body = dict(body, max_tokens=2, **({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path
                                        else {"prompt": "Hi"}))
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(base + path, body, KEY)
    text = e.value.read().decode()
    assert e.value.code == 400 and says in text and "model_error" not in text, text


def test_big_tokenize_and_detokenize_requests_are_bounded_and_health_answers_meanwhile(keyed):
    """Issue 53 item 5: /detokenize with 2,000,000 ids got no answer in 300 s and /health stopped answering;
    /tokenize of 7 MiB with pieces blocked /health for minutes. The sizes are bounded by the context (413
    beyond), the work runs off the event loop, and /health answers within a second while a big request runs."""
    base, _ = keyed
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        _post_raw(base + "/detokenize", b'{"tokens": [' + b",".join([b"1"] * 2_000_000) + b"]}", KEY)
    assert e.value.code == 413 and "more than this server takes at once" in e.value.read().decode()
    text = "the cat sat on the mat. " * (7 * 2**20 // 24)  # 7 MiB
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(base + "/tokenize", {"content": text, "with_pieces": True}, KEY)
    assert e.value.code == 413 and "with_pieces answers at most" in e.value.read().decode()
    assert time.monotonic() - t0 < 120
    # a big request that is answered: /health meanwhile, each within a second
    done, answer = threading.Event(), {}

    def tokenize():  # (3 MiB: long enough to poll /health during it, short enough that its JSON, written
        answer["r"] = _post(base + "/tokenize", {"content": text[: 3 << 20]}, KEY)  # holding the GIL, stays brief)
        done.set()

    worker = threading.Thread(target=tokenize)
    worker.start()
    slowest, samples = 0.0, 0
    while not done.is_set():
        t = time.monotonic()
        assert http_request(base + "/health", timeout=5)[0] == 200
        slowest, samples = max(slowest, time.monotonic() - t), samples + 1
        time.sleep(0.05)
    worker.join()
    assert samples >= 1
    assert answer["r"][0] == 200 and len(json.loads(answer["r"][1])["tokens"]) > 3 * 10**5
    assert slowest < 1.0, slowest
