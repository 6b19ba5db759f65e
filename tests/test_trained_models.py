"""The three trained MoE models in models/ (scripts/train_tiny_moe.py): the files match their cards,
they load in pymoecache and in plain llama-cpp-python, write recognisable text, and beat a
unigram model on the held-out slice of Tiny Shakespeare by a wide margin.

The unigram baseline is computed here, from the training slice tokenized by llama.cpp, with
add-one smoothing; the model's perplexity is measured here too, on the first held-out chunks.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

import pymoecache
import llama_cpp
import synth
from pymoecache import CacheConfig
from pymoecache.evaluate import load_for_eval, perplexity
from conftest import ROOT, SHARED

MODELS = {  # name: (routed experts, experts per token, shared expert)
    "tiny-shakespeare-qwen2moe-60x4": (60, 4, True),
    "tiny-shakespeare-mixtral-8x2": (8, 2, False),
    "tiny-shakespeare-qwen2moe-32x4-w256": (32, 4, True),  # model C: widths of 256, Q8_0
}
CTX = 256
N_CHUNKS = 8

needs_corpus = pytest.mark.skipif(not (SHARED / "data" / "tinyshakespeare" / "input.txt").is_file(),
                                  reason="../shared/data/tinyshakespeare is not here")


def _train_script():
    """scripts/train_tiny_moe.py, for its split of the corpus (the one the models were trained with)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny_moe

    return train_tiny_moe


def card(name: str) -> dict:
    return json.loads((ROOT / "models" / f"{name}.json").read_text())


@pytest.mark.parametrize("name", MODELS)
def test_model_file_matches_its_card(name):
    path = ROOT / "models" / f"{name}.gguf"
    c = card(name)
    assert path.stat().st_size == c["file_size"] <= 30 * 2**20
    assert synth._sha256(path) == c["sha256"]
    n_expert, n_used, shared = MODELS[name]
    info = pymoecache.model_info(path)
    assert info.is_moe and (info.n_expert, info.n_expert_used) == (n_expert, n_used)
    assert (c["preset"]["n_ff_shexp"] > 0) == shared
    if name.endswith("-w256"):  # every width a multiple of 256: K-quants and IQ2/IQ3 apply to its experts
        assert c["preset"]["n_embd"] % 256 == 0 and c["preset"]["n_ff_exp"] % 256 == 0
        assert info.expert_types == ["Q8_0"]
    # the card's quality numbers are measured again, not read back: test_held_out_perplexity_*


def _words(text: str) -> list:
    return re.findall(r"[A-Za-z']+", text)


@needs_corpus
@pytest.mark.parametrize("name", MODELS)
def test_generates_recognisable_text_in_plain_llama_cpp_and_in_pymoecache(name):
    path = str(ROOT / "models" / f"{name}.gguf")
    train_text, _, _ = _train_script().split_text()
    known = {w.lower() for w in _words(train_text)}

    plain = llama_cpp.Llama(path, n_ctx=CTX, n_threads=2, verbose=False)
    text = plain("ROMEO:", max_tokens=48, temperature=0.0)["choices"][0]["text"]
    plain.close()
    words = _words(text)
    assert len(words) >= 8, text
    assert sum(w.lower() in known for w in words) / len(words) >= 0.8, text

    llm = pymoecache.Llama(path, cache=CacheConfig(size=0.5), routing="prior:0.5", n_ctx=CTX, n_threads=2,
                           verbose=False)
    text2 = llm("ROMEO:", max_tokens=48, temperature=0.0)["choices"][0]["text"]
    st = llm.moe_stats()
    llm.close()
    words2 = _words(text2)
    assert len(words2) >= 8 and sum(w.lower() in known for w in words2) / len(words2) >= 0.8, text2
    assert st.hits > 0 and st.misses > 0


@needs_corpus
@pytest.mark.parametrize("name", MODELS)
def test_held_out_perplexity_is_far_below_unigram(name):
    script = _train_script()
    train_text, held_text, _ = script.split_text()
    llm = load_for_eval(ROOT / "models" / f"{name}.gguf", 1.0, CTX, n_threads=2)
    try:
        train_ids = llm.tokenize(train_text.encode(), add_bos=False)
        held_ids = llm.tokenize(held_text.encode(), add_bos=False)
        res = perplexity(llm, held_ids[:N_CHUNKS * CTX], CTX, progress=False)
        n_vocab = llm.n_vocab()
    finally:
        llm.close()
    # the same add-one unigram the model card reports, on llama.cpp's tokens of the same split
    unigram_ppl = script.unigram_ppl(np.array(train_ids), np.array(held_ids[:res.n_tokens]), n_vocab)
    assert unigram_ppl > 100  # a real baseline: ~2k-token vocabulary, not a degenerate count
    assert res.ppl < 0.5 * unigram_ppl, (res.ppl, unigram_ppl)
