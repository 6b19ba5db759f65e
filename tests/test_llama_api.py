"""pymoecache.Llama is a llama_cpp.Llama: everything of llama-cpp-python works, plus the cache API."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import llama_cpp

import pymoecache
from pymoecache import CacheConfig, Prior, TopK
from pymoecache.moecache import MoECache
from conftest import ROOT, model_path

QWEN = "qwen2moe-60x4"


@pytest.fixture(scope="module")
def llm(fixture_dir):
    m = pymoecache.Llama(str(model_path(fixture_dir, QWEN)), cache=CacheConfig(size=0.5), routing=Prior(0.5),
                         n_ctx=256, verbose=False, seed=3)
    yield m
    m.close()


def test_is_a_llama_cpp_llama(llm):
    assert isinstance(llm, llama_cpp.Llama)


def test_completion_streaming_and_tokenization(llm):
    out = llm("The cat", max_tokens=8, temperature=0.0)
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 8
    pieces = [c["choices"][0]["text"] for c in llm("The cat", max_tokens=8, temperature=0.0, stream=True)]
    assert "".join(pieces) == out["choices"][0]["text"]  # same greedy text, streamed
    toks = llm.tokenize(b"Hello world")
    assert llm.detokenize(toks).decode().strip() == "Hello world"


def test_chat_completion(llm):
    r = llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"


def test_grammar_constrains_output(llm):
    g = llama_cpp.LlamaGrammar.from_string('root ::= ("yes" | "no")', verbose=False)
    text = llm("Answer:", max_tokens=4, grammar=g, temperature=0.0)["choices"][0]["text"]
    assert text in ("yes", "no")


def test_moe_stats_fields_and_reset(llm):
    llm.reset_moe_stats()
    llm("Once upon a time", max_tokens=10, temperature=0.0)
    st = llm.moe_stats()
    n_layer = len(st.moe_layers)
    for name in ("tokens_per_layer", "hits_per_layer", "misses_per_layer", "evictions_per_layer"):
        arr = getattr(st, name)
        assert isinstance(arr, np.ndarray) and arr.shape == (n_layer,)
    assert st.n_expert_used == 4 and st.tokens > 0
    assert st.hit_rate == pytest.approx(1 - st.miss_rate)
    assert st.bytes_loaded == st.misses * llm.model_info.expert_bytes > 0
    assert st.lifetime > 0
    llm.reset_moe_stats()
    assert llm.moe_stats().tokens == 0 and llm.moe_stats().misses == 0


def test_memory_budget_becomes_a_per_layer_size(fixture_dir):
    path = str(model_path(fixture_dir, QWEN))
    info = pymoecache.model_info(path)
    m = pymoecache.Llama(path, cache=CacheConfig(size="512KiB"), routing=TopK(), n_ctx=64, verbose=False)
    expect = int(512 * 1024 // (info.expert_bytes * info.n_moe_layer))
    assert 0 < expect < info.n_expert
    m("Hi", max_tokens=2)
    assert m.moe_stats().capacity_per_layer.tolist() == [expect] * info.n_moe_layer
    assert expect == info.cache_size_for_budget(512 * 1024)
    m.close()
    # a budget above all experts keeps all of them (as `info --ram` says), resident
    m = pymoecache.Llama(path, cache=CacheConfig(size="1GiB"), n_ctx=64, verbose=False)
    m("Hi", max_tokens=2)
    assert m.moe_stats().capacity_per_layer.tolist() == [info.n_expert] * info.n_moe_layer
    assert m.moe_stats().residency.residency == "none"
    m.close()


def test_config_objects_validate_and_parse():
    assert pymoecache.parse_routing("prior:0.5") == Prior(0.5)
    assert pymoecache.parse_routing("max-rank:4:j=2") == pymoecache.MaxRank(4, top_j=2)
    assert pymoecache.parse_routing("cumsum:0.7").spec() == "cumsum:0.7"
    assert pymoecache.parse_routing("prune:3") == pymoecache.Prune(3)
    assert pymoecache.parse_routing("lru") == TopK()
    for bad in ("prior:-1", "cumsum:1.5", "prune:0", "max-rank:-2", "warp:3", "prior:x", "lru:3"):
        with pytest.raises(pymoecache.ConfigError):
            pymoecache.parse_routing(bad)
    for bad in (-1, 1.5, "lots", True):
        with pytest.raises(pymoecache.ConfigError):
            CacheConfig(size=bad)
    with pytest.raises(pymoecache.ConfigError):
        CacheConfig(insertion="middle-out")


def test_default_model_is_the_trained_qwen2moe():
    p = pymoecache.default_model_path()
    assert p.exists() and p.suffix == ".gguf"
    info = pymoecache.model_info(p)
    assert info.is_moe and info.n_expert == 60 and info.n_expert_used == 4


def test_a_context_too_large_for_the_memory_limit_is_a_config_error(fixture_dir):
    """Issue 25 item 8: under a memory limit, llama-cpp-python's n_ctx x n_vocab score array raised a
    bare MemoryError; now ConfigError naming n_ctx."""
    import subprocess
    import sys

    code = f"""
import resource, sys
sys.path.insert(0, {str(ROOT)!r})
import pymoecache
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
try:
    pymoecache.Llama({str(model_path(fixture_dir, "qwen2moe-60x4"))!r}, n_ctx=200000, logits_all=True, verbose=False)
    print("LOADED")
except pymoecache.ConfigError as e:
    print("ConfigError", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1000:]
    assert "ConfigError not enough memory for a context of n_ctx=200000" in r.stdout, r.stdout


# --- the object's life cycle (issue 41 item 9) ----------------------------------------------------

def test_with_block_closes_and_every_use_after_close_raises(fixture_dir):
    """``with Llama(...) as llm`` closes it at the end; after close() every method and attribute of the
    API raises ClosedError (a pymoecache.Error) instead of reaching freed memory (a segfault)."""
    path = str(model_path(fixture_dir, QWEN))
    with pymoecache.Llama(path, cache=CacheConfig(size=0.5), n_ctx=64, verbose=False) as llm:
        assert llm("The cat", max_tokens=2)["usage"]["completion_tokens"] == 2
    assert isinstance(llm, pymoecache.Llama)
    calls = [lambda: llm("The cat", max_tokens=2), lambda: llm.eval([1, 2]), lambda: llm.tokenize(b"x"),
             lambda: llm.detokenize([1]), lambda: llm.moe_stats(), lambda: llm.set_routing("lru"),
             lambda: llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}]),
             lambda: llm.n_ctx(), lambda: llm.save_state(), lambda: llm.reset(), lambda: llm.ctx,
             lambda: llm.save_cache_state("x"), lambda: llm.memory_plan(), lambda: llm.set_eviction("lfu")]
    for call in calls:
        with pytest.raises(pymoecache.ClosedError, match="closed"):
            call()
    llm.close()  # a second close does nothing
    with pytest.raises(pymoecache.ClosedError):
        with llm:
            pass
    assert llm.model_path == path  # what describes the file stays readable


_KEPT_OBJECTS = r"""
import sys
import pymoecache
from pymoecache import CacheConfig, ClosedError

def uses(mc, tok, tok_):
    return {
        "mc.stats": mc.stats, "mc.residency_stats": mc.residency_stats, "mc.trace": mc.trace,
        "mc.set_routing": lambda: mc.set_routing("lru"), "mc.cached": lambda: mc.cached(0),
        "mc.clear": mc.clear, "mc.reset_stats": mc.reset_stats, "mc.begin_request": mc.begin_request,
        "mc.set_eviction": lambda: mc.set_eviction("lfu"), "mc.profile_counts": mc.profile_counts,
        "mc.timeline_start": mc.timeline_start, "mc.take_io_error": mc.take_io_error,
        "mc.vram_cached": lambda: mc.vram_cached(0), "mc.detach": mc.detach, "mc.save": lambda: mc.save("x.state"),
        "tokenizer().tokenize": lambda: tok.tokenize(b"x"), "tokenizer().decode": lambda: tok.decode([1]),
        "tokenizer_.tokenize": lambda: tok_.tokenize(b"x"), "tokenizer_.detokenize": lambda: tok_.detokenize([1]),
    }

for how in ("close", "with"):
    llm = pymoecache.Llama(sys.argv[1], cache=CacheConfig(size=0.5), n_ctx=64, verbose=False)
    kept = (llm.moecache, llm.tokenizer(), llm.tokenizer_)
    for name, use in uses(*kept).items():  # all of them work while it is open
        if name not in ("mc.detach", "mc.clear"):
            use()
    if how == "close":
        llm.close()
    else:
        with llm:
            llm("The cat", max_tokens=2)
    for name, use in uses(*kept).items():
        try:
            use()
            print(how, name, "returned")
        except ClosedError as e:
            print(how, name, "ClosedError", e)
    del llm, kept
print("exited normally")
"""


def test_objects_kept_from_a_closed_llama_raise_closed_error(fixture_dir, tmp_path):
    """Issue 53 item 2: ``mc = llm.moecache; llm.close(); mc.stats()`` was a segmentation fault, and so
    were set_routing, trace, ``llm.tokenizer().tokenize`` and a kept ``llm.tokenizer_``: each read freed
    memory. In a fresh process of the installed package, every one of them raises ClosedError after close()
    and after a with block."""
    r = subprocess.run([sys.executable, "-c", _KEPT_OBJECTS, str(model_path(fixture_dir, QWEN))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]  # (-11: a segmentation fault)
    lines = r.stdout.splitlines()
    assert lines[-1] == "exited normally"
    assert len(lines) == 1 + 2 * 19, r.stdout
    for line in lines[:-1]:
        assert " ClosedError " in line and "closed" in line, line


_BAD_KEYWORDS = r"""
import sys
import pymoecache
bad = {
    "lora_path": "/nonexistent.gguf", "lora_base": sys.argv[2], "type_k": 999, "type_v": -1,
    "chat_format": "nonexistent", "draft_model": 5, "cache": 0, "flash_attn": "maybe",
}
for name, value in bad.items():
    try:
        pymoecache.Llama(sys.argv[1], verbose=False, n_ctx=64, **{name: value})
        print(name, "ACCEPTED")
    except pymoecache.ConfigError as e:
        print(name, "ConfigError", str(e).splitlines()[0])
print("exited normally")
"""


def test_keywords_that_reach_llama_cpp_are_checked_at_construction(fixture_dir, tmp_path):
    """Issue 53 item 3: lora_path to a missing file loaded and the first generation crashed, type_k=999 aborted
    on a GGML_ASSERT, chat_format="nonexistent" failed later, draft_model=5 and cache=0 were accepted. Each is
    a ConfigError at construction now, in a fresh process of the installed package."""
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    r = subprocess.run([sys.executable, "-c", _BAD_KEYWORDS, str(model_path(fixture_dir, QWEN)), str(text)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    said = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert said.pop("exited") == "normally"
    assert said == {
        "lora_path": "ConfigError lora_path /nonexistent.gguf: No such file or directory",
        "lora_base": f"ConfigError lora_base {text} is not a GGUF file",
        "type_k": said["type_k"], "type_v": said["type_v"], "chat_format": said["chat_format"],
        "draft_model": said["draft_model"],
        "flash_attn": "ConfigError flash_attn must be True, False, 'on', 'off' or 'auto' (llama.cpp decides: on where "
                      "the devices support it), got 'maybe'",
        "cache": "ConfigError cache size '0' is zero: give at least 1 expert per layer (a streamed token needs K "
                 "slots anyway), a share such as 0.25, a budget such as 4G, or auto",
    }, said
    assert said["type_k"].startswith("ConfigError type_k must be a ggml type") and "F16 (1)" in said["type_k"]
    assert said["type_v"].startswith("ConfigError type_v must be a ggml type")
    assert said["chat_format"].startswith("ConfigError unknown chat_format 'nonexistent'") and "chatml" in said["chat_format"]
    assert said["draft_model"].startswith("ConfigError draft_model must be a llama_cpp.llama_speculative.LlamaDraftModel")
    # what is valid still loads
    ok = ("import sys, pymoecache\nllm = pymoecache.Llama(sys.argv[1], verbose=False, n_ctx=64, type_k=8, "
          "chat_format='chatml', cache=0.5)\nprint(llm('Hi', max_tokens=2)['usage']['completion_tokens'])")
    r = subprocess.run([sys.executable, "-c", ok, str(model_path(fixture_dir, QWEN))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]


def test_close_waits_for_no_one_and_a_dense_llama_closes_too(fixture_dir):
    llm = pymoecache.Llama(str(model_path(fixture_dir, QWEN)), cache=CacheConfig(size=0.5), n_ctx=64, verbose=False)
    llm.close()
    with pytest.raises(pymoecache.Error):
        llm.eval([1])
    del llm  # (no second free at collection)


# --- a setting is validated whole before it applies, and the same given at load or later (item 6) ---

def _misses(llm, tokens):
    llm.moecache.clear()
    llm.reset_moe_stats()
    llm.reset()
    for t in tokens:
        llm.eval([t])
    return llm.moe_stats().misses_per_layer.tolist()


def test_a_refused_routing_applies_nowhere(fixture_dir, llm):
    before = llm.moecache.routing
    n = llm.moecache.n_layer
    bad = "prior:0.2:j=1:layers=" + "/".join(["1"] * (n + 1))
    with pytest.raises(pymoecache.ConfigError, match="per-layer scales"):
        llm.set_routing(bad)
    assert llm.moecache.routing == before
    # what the C side routes with is still the old policy: the same selections as a fresh one
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, llm.n_vocab(), 24)]
    now = _misses(llm, tokens)
    llm.set_routing(before)
    assert _misses(llm, tokens) == now
    with pytest.warns(UserWarning, match=r"keeps? scale 1"):
        llm.set_routing("prior:0.2:j=1:layers=0")
    llm.set_routing(before)


def test_every_preset_and_eviction_changed_later_equals_a_fresh_load(fixture_dir):
    """After every other setting, each preset (and each eviction) set on a loaded model routes and
    evicts as a fresh load with it: the previous one's decay does not carry over."""
    path = str(model_path(fixture_dir, QWEN))
    kw = dict(n_ctx=96, verbose=False)
    tokens = [int(t) for t in np.random.default_rng(2).integers(3, 1000, 48)]
    settings = [("routing", "preset:quality"), ("routing", "preset:balanced"), ("routing", "preset:speed"),
                ("eviction", "lru"), ("eviction", "lfu"), ("eviction", "router-mass"), ("eviction", "freq-prob")]

    def fresh(kind, value):
        cache = CacheConfig(size=0.25, residency="none", **({"eviction": value} if kind == "eviction" else {}))
        with pymoecache.Llama(path, cache=cache, routing=value if kind == "routing" else "prior:0.5", **kw) as m:
            return _misses(m, tokens), m.moecache.eviction, m.moecache.eviction_decay

    want = {s: fresh(*s) for s in settings}
    with pymoecache.Llama(path, cache=CacheConfig(size=0.25, residency="none"), routing="prior:0.5", **kw) as llm:
        for first in settings:
            for then in settings:
                if first == then:
                    continue
                for kind, value in (first, then):
                    if kind == "routing":
                        llm.set_routing(value)
                    else:
                        llm.set_eviction(value)
                if then[0] == "eviction":
                    llm.set_routing("prior:0.5")  # (the fresh load with an eviction routes with prior:0.5)
                got = (_misses(llm, tokens), llm.moecache.eviction, llm.moecache.eviction_decay)
                assert got == want[then], (first, then, got[1:], want[then][1:])


# --- the Python object as llama-cpp-python users expect it (issue 43 item 3) ------------------------

def test_no_path_is_the_default_model_and_cache_takes_what_the_cli_takes(tmp_path):
    with pymoecache.Llama(cache="25%", n_ctx=64, verbose=False) as llm:
        assert llm.model_path == str(pymoecache.default_model_path())
        assert llm.cache_config.size == 0.25
        assert llm.moecache.layer_row(llm.model_info.moe_layers[0])[0][1] == llm.model_info.n_expert // 4
    for size, want in ((30, 30), (0.5, 0.5), ("30", 30), ("auto", None)):
        with pymoecache.Llama(cache=size, n_ctx=64, verbose=False) as llm:
            assert want is None or llm.cache_config.size == want
    with pytest.raises(pymoecache.ConfigError, match="cache size"):
        pymoecache.Llama(cache="lots", n_ctx=64, verbose=False)
    with pytest.raises(pymoecache.ConfigError, match="cache must be"):
        pymoecache.Llama(cache=[1], n_ctx=64, verbose=False)


def test_unknown_keywords_are_refused_with_a_guess():
    with pytest.raises(pymoecache.ConfigError, match="unknown keyword 'cache_size'; did you mean 'cache'"):
        pymoecache.Llama(cache_size=0.25)
    with pytest.raises(pymoecache.ConfigError, match="unknown keyword 'n_gpu_layer'; did you mean 'n_gpu_layers'"):
        pymoecache.Llama(n_gpu_layer=1)


def test_verbose_false_is_quiet():
    """llama.cpp's warnings (here: a context longer than the model was trained for) stay unprinted."""
    import subprocess
    import sys

    code = ("import pymoecache\n"
            "llm = pymoecache.Llama(n_ctx=4096, verbose=False)\n"
            "llm('Once', max_tokens=2)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", code.replace("False", "True")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert "n_ctx_seq (4096) > n_ctx_train" in r.stderr  # verbose=True: llama.cpp's whole log, as stock


@pytest.mark.parametrize("routing", ["prior:0.5", "preset:balanced", None])
def test_a_llama_is_built_from_its_configuration_resolved_once(fixture_dir, monkeypatch, routing):
    """Issue 43 item 4: the routing spec is parsed once and the native parameters are built once,
    from the resolved values (it went back and forth between llama.py and config.py)."""
    import pymoecache.config as config
    import pymoecache.llama as llama_mod
    import pymoecache.moecache as moecache_mod

    parses, builds = [], []
    parse = config.parse_routing

    def counting_parse(spec, *a, **k):
        parses.append(spec)
        return parse(spec, *a, **k)

    for mod in (config, llama_mod, moecache_mod):  # every name it is reached by
        monkeypatch.setattr(mod, "parse_routing", counting_parse)
    build = MoECache._params
    monkeypatch.setattr(MoECache, "_params", staticmethod(lambda *a, **k: builds.append(1) or build(*a, **k)))
    llm = pymoecache.Llama(str(model_path(fixture_dir, "qwen2moe-60x4")), cache=0.5, routing=routing, n_ctx=128,
                           verbose=False)
    try:
        assert parses == ([routing] if routing else [])
        assert len(builds) == 1
        if routing == "prior:0.5":
            assert llm.moecache.routing.spec() == "prior:0.5" and llm.preset is None
        else:  # a preset (named, or the default), resolved into a policy for this cache
            assert llm.preset is not None and llm.preset.name == (routing.split(":")[1] if routing else llm.preset.name)
        assert llm.moe_stats().capacity_per_layer[0] == 30  # built from the resolved size
    finally:
        llm.close()


def test_a_completion_goes_on_past_a_byte_that_is_not_utf8(llm):
    """A model can sample a lone UTF-8 lead byte (seen: b"\\xcb" then " Dez", the 60-expert fixture behind a
    VRAM tier): llama-cpp-python's stream held back everything after it, re-decoding all of it at every
    token (a 4000-token `run` never ended), and the text dropped the byte. Forced here by a logits
    processor: the lone byte, plain text, then a character whose three bytes come as three tokens. The
    stream goes on token by token, the byte is U+FFFD as in the text returned whole, and the split
    character arrives whole."""
    byte = {}  # a token of each single byte
    for t in range(llm.n_vocab()):
        b = llm.detokenize([t])
        if len(b) == 1:
            byte.setdefault(b[0], t)
    words = llm.tokenize(b"Dez and more words", add_bos=False)  # (" Dez", " and", ...: SPM puts the space in)
    end = llm.tokenize(b"end", add_bos=False)
    before = llm.tokenize(b"But soft", add_bos=False)
    forced = before + [byte[0xCB]] + words + [byte[0xE2], byte[0x81], byte[0xB8]] + end
    n_prompt = len(llm.tokenize(b"ROMEO:"))

    def force(input_ids, scores):
        out = np.full_like(scores, -1e9)
        out[forced[len(input_ids) - n_prompt]] = 0.0
        return out

    kw = dict(max_tokens=len(forced), temperature=0.0, logits_processor=[force])
    chunks, at = [], []
    for c in llm("ROMEO:", stream=True, **kw):
        chunks.append(c["choices"][0]["text"])
        at.append(llm.n_tokens)
    want = llm.detokenize(before).decode() + "\ufffd" + llm.detokenize(words).decode() + "\u2078" + llm.detokenize(end).decode()
    assert "".join(chunks) == want, chunks
    whole = llm("ROMEO:", **kw)
    assert whole["choices"][0]["text"] == want
    assert sum(1 for c in chunks if c) >= len(words), chunks  # (token by token, not all at the end)
    first = next(i for i, c in enumerate(chunks) if "Dez" in c)
    assert at[first] < n_prompt + len(forced) - 2, (at, chunks)
    assert "\u2078" in chunks  # (the three bytes yielded as one character)
