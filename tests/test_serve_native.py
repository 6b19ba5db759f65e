"""llama-server's own endpoints on ``pymoecache serve`` (issue 43 item 1), against a real server
process: /completion (its request and response fields, streamed and not, stop words, token
prompts), /tokenize, /detokenize (bytes that are not UTF-8), /embedding refused with 501, every
error in OpenAI's shape, and /metrics counting from zero."""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.error
import urllib.request

import jinja2
import pytest

from pymoecache import server
from conftest import model_path, running_server

MISSING = [m for m in server._EXTRAS if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"server extras not installed: {server.PIP_SERVER}")
MODEL = "qwen2moe-60x4"
_open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open


def call(url, body=None, method=None):
    """(status, parsed JSON or text) of a request; HTTP errors are answers too."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with _open(req, timeout=300) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def stream(url, body):
    """The data lines of a streamed /completion, each parsed (a line that is not JSON fails)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with _open(req, timeout=300) as r:
        assert r.headers.get("Content-Type", "").startswith("text/event-stream")
        lines = [ln[len("data: "):] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    return [json.loads(x) for x in lines]


@pytest.fixture(scope="module")
def base(fixture_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("native") / "server.log"
    # top-k routing: a greedy answer does not depend on what the cache holds (the tests compare answers)
    with running_server(model_path(fixture_dir, MODEL), log, "--cache-size", "30", "--routing", "lru") as (url, _):
        yield url


def test_metrics_start_at_zero(base):  # (first: no request has reached this server yet)
    status, text = call(base + "/metrics")
    values = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
              if ln and not ln.startswith("#")}
    assert status == 200
    assert values["llamacpp:tokens_predicted_total"] == 0 and values["llamacpp:prompt_tokens_total"] == 0


def test_completion_answers_llama_servers_fields(base):
    status, r = call(base + "/completion", {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0,
                                            "cache_prompt": True})
    assert status == 200, r
    assert isinstance(r["content"], str) and r["stop"] is True
    assert r["stop_type"] in ("limit", "eos") and r["stopping_word"] == ""
    assert r["tokens_predicted"] == (6 if r["stop_type"] == "limit" else r["tokens_predicted"]) <= 6
    _, tok = call(base + "/tokenize", {"content": "Once upon a time", "add_special": True})
    assert r["tokens_evaluated"] == len(tok["tokens"])
    t = r["timings"]
    assert t["predicted_n"] == r["tokens_predicted"] and 1 <= t["prompt_n"] <= r["tokens_evaluated"] and t["prompt_ms"] > 0
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] == pytest.approx(1e3 * t["predicted_n"] / t["predicted_ms"])
    assert r["moecache"]["tokens"] > 0 and r["generation_settings"]["n_predict"] == 6
    # greedy: the same answer again, streamed piece by piece (no [DONE] line: every data line is JSON)
    chunks = stream(base + "/completion", {"prompt": "Once upon a time", "n_predict": 6, "temperature": 0})
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == r["content"]
    assert chunks[-1]["tokens_predicted"] == r["tokens_predicted"] and "timings" in chunks[-1]


def test_stop_words_and_token_prompts(base):
    _, r = call(base + "/completion", {"prompt": "The king", "n_predict": 24, "temperature": 0})
    text = r["content"]
    assert len(text) > 12, text
    word = text[6:9]
    _, s = call(base + "/completion", {"prompt": "The king", "n_predict": 24, "temperature": 0, "stop": [word]})
    assert s["stop_type"] == "word" and s["stopping_word"] == word and s["content"] == text[:text.find(word)]
    streamed = stream(base + "/completion", {"prompt": "The king", "n_predict": 24, "temperature": 0, "stop": word})
    assert "".join(c["content"] for c in streamed) == s["content"]  # a stop word is never sent, even in part
    _, ids = call(base + "/tokenize", {"content": "The king", "add_special": True})
    _, t = call(base + "/completion", {"prompt": ids["tokens"], "n_predict": 24, "temperature": 0})
    assert t["content"] == text
    _, z = call(base + "/completion", {"prompt": "The king", "n_predict": 0})
    assert z["content"] == "" and z["tokens_predicted"] == 0 and z["stop_type"] == "limit"


def test_tokenize_and_detokenize(base):
    _, r = call(base + "/tokenize", {"content": "Hello world", "with_pieces": True})
    pieces = r["tokens"]
    assert "".join(p["piece"] for p in pieces).strip() == "Hello world" and all(isinstance(p["id"], int) for p in pieces)
    _, plain = call(base + "/tokenize", {"content": "Hello world"})
    _, special = call(base + "/tokenize", {"content": "Hello world", "add_special": True})
    assert plain["tokens"] == [p["id"] for p in pieces] and len(special["tokens"]) == len(plain["tokens"]) + 1
    _, d = call(base + "/detokenize", {"tokens": plain["tokens"]})
    assert d["content"].strip() == "Hello world"
    # a byte token alone is not UTF-8: its piece is the byte, its text U+FFFD (llama-server's JSON writer)
    _, b = call(base + "/tokenize", {"content": "\U0001f999", "with_pieces": True})
    byte_pieces = [p for p in b["tokens"] if isinstance(p["piece"], list)]
    assert byte_pieces, b  # the fixture's vocabulary spells this emoji with byte tokens
    assert call(base + "/detokenize", {"tokens": [byte_pieces[0]["id"]]})[1]["content"] == "\ufffd"
    assert call(base + "/extras/detokenize", {"tokens": [byte_pieces[0]["id"]]})[1]["text"] == "\ufffd"
    assert call(base + "/detokenize", {"tokens": [p["id"] for p in b["tokens"]]})[1]["content"].strip() == "\U0001f999"


@pytest.mark.parametrize("path, body, status, param", [
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/extras/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/tokenize", {"content": 5}, 400, "content"),
    ("/completion", {"prompt": "Hi", "n_predict": "many"}, 400, "n_predict"),
    ("/completion", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("/completion", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("/completion", {"prompt": "Hi", "stop": [1]}, 400, "stop"),
    ("/completion", {"prompt": "Hi", "grammar": "root ::= nothing-defined"}, 400, "grammar"),
    ("/completion", b"{not json", 400, None),
])
def test_bad_requests_get_openai_shaped_errors(base, path, body, status, param):
    got, r = call(base + path, body)
    assert got == status, r
    assert set(r) == {"error"} and r["error"]["code"] == status and r["error"]["param"] == param
    assert r["error"]["type"] == ("invalid_request_error") and r["error"]["message"]


def test_every_status_has_the_same_error_body(base):
    for method, path, status, kind in (("GET", "/no/such/path", 404, "not_found_error"),
                                       ("GET", "/completion", 405, "invalid_request_error"),
                                       ("POST", "/embedding", 501, "not_supported_error"),
                                       ("POST", "/v1/embeddings", 501, "not_supported_error")):
        got, r = call(base + path, {"content": "x", "input": "x"} if method == "POST" else None, method)
        assert got == status and r["error"]["type"] == kind and r["error"]["code"] == status, (path, r)


@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")
def test_openai_client_embeddings_are_refused_at_once(base):
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none")  # default retries: the 501 says not to
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(model="x", input="hello")
    assert e.value.status_code == 501 and "embeddings" in str(e.value.message)
    assert time.monotonic() - t0 < 5  # no retry with back-off


def test_chat_templates_on_serve(base, fixture_dir, tmp_path):
    # a model without a template: ChatML, as llama-server (llama-cpp-python guessed llama-2), said in /props
    _, props = call(base + "/props")
    assert props["chat_template_source"] == "ChatML (the model has no chat template)", props
    # its text, as Jinja, renders what the server renders
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    _, applied = call(base + "/apply-template", {"messages": msgs})
    assert jinja2.Template(props["chat_template"]).render(messages=msgs, add_generation_prompt=True) == applied["prompt"]
    _, ids = call(base + "/tokenize", {"content": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                                       "add_special": True})
    status, r = call(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert status == 200 and r["usage"]["prompt_tokens"] == len(ids["tokens"])
    # --chat-template-file: that Jinja template renders every chat
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    log = tmp_path / "server.log"
    with running_server(model_path(fixture_dir, MODEL), log, "--chat-template-file", str(f)) as (url, _):
        _, props = call(url + "/props")
        assert props["chat_template"] == f.read_text() and props["chat_template_source"] == f"{f} (Jinja)"
        _, ids = call(url + "/tokenize", {"content": "[user] Hi\n[assistant] ", "add_special": True})
        status, r = call(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 1})
        assert status == 200 and r["usage"]["prompt_tokens"] == len(ids["tokens"])
    assert f"chat template: {f} (Jinja)" in log.read_text()
