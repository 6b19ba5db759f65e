"""logprobs without logits_all (issue 43 item 1): the values equal llama-cpp-python's own (computed
from its logits_all matrix) on the same greedy answer, through the Python API, chat, streaming, and
the server with the official openai client."""

from __future__ import annotations

import importlib.util

import pytest

import pymoecache
from conftest import model_path, running_server

MODEL = "qwen2moe-60x4"


@pytest.fixture(scope="module")
def models(fixture_dir):
    path = str(model_path(fixture_dir, MODEL))
    ours = pymoecache.Llama(path, n_ctx=256, verbose=False)
    stock = pymoecache.Llama(path, n_ctx=256, verbose=False, logits_all=True)  # llama-cpp-python's own path
    yield ours, stock
    ours.close()
    stock.close()


def test_the_values_are_llama_cpp_pythons(models):
    ours, stock = models
    a = ours.create_completion("Once upon a time", max_tokens=8, temperature=0, logprobs=3)["choices"][0]
    b = stock.create_completion("Once upon a time", max_tokens=8, temperature=0, logprobs=3)["choices"][0]
    assert a["text"] == b["text"] and len(a["logprobs"]["tokens"]) == 8
    la, lb = a["logprobs"], b["logprobs"]
    assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
    assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
    for ta, tb in zip(la["top_logprobs"], lb["top_logprobs"]):
        assert ta.keys() == tb.keys() and list(ta.values()) == pytest.approx(list(tb.values()), abs=1e-4)
        assert max(ta.values()) <= 0 and len(ta) >= 3  # the top 3 and the sampled token
    # greedy: the sampled token is the most likely one
    assert all(lp == pytest.approx(max(top.values())) for lp, top in zip(la["token_logprobs"], la["top_logprobs"]))


def test_streamed_chunks_and_chat_carry_them(models):
    ours, _ = models
    whole = ours.create_completion("Once upon a time", max_tokens=6, temperature=0, logprobs=2)["choices"][0]
    chunks = list(ours.create_completion("Once upon a time", max_tokens=6, temperature=0, logprobs=2, stream=True))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("text")]
    assert [t for lp in streamed for t in lp["tokens"]] == whole["logprobs"]["tokens"]
    assert [x for lp in streamed for x in lp["token_logprobs"]] == pytest.approx(whole["logprobs"]["token_logprobs"])
    chat = ours.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert len(chat) == 4 and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in chat)


def test_what_still_needs_logits_all_says_so(models):
    ours, _ = models
    with pytest.raises(pymoecache.ConfigError, match="echo=True needs logits_all=True"):
        ours.create_completion("Hi", max_tokens=2, logprobs=1, echo=True)
    with pytest.raises(pymoecache.ConfigError, match="logprobs must be an integer"):
        ours.create_completion("Hi", max_tokens=2, logprobs=-1)


@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed")
def test_the_openai_client_gets_logprobs_from_serve(fixture_dir, tmp_path):
    import openai

    with running_server(model_path(fixture_dir, MODEL), tmp_path / "server.log") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="x", prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == 4 and all(len(t) >= 2 for t in lp.top_logprobs)
        c = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0, logprobs=True, top_logprobs=2)
        assert len(c.choices[0].logprobs.content) == 3
        assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)
