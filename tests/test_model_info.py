"""model_info reads GGUF headers itself (fast); gguf.GGUFReader is the independent reference."""

from __future__ import annotations

import gguf
import pytest

import pymoecache
from pymoecache import model_info
from conftest import ROOT
from conftest import MOE_FIXTURES, VARIANTS, model_path
import synth


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_header_reader_agrees_with_gguf_reader(fixture_dir, name, variant):
    path = model_path(fixture_dir, name, variant)
    info = model_info(path)
    r = gguf.GGUFReader(str(path))
    exps = [t for t in r.tensors if "_exps." in t.name]
    assert info.expert_bytes_total == sum(int(t.n_bytes) for t in exps)
    assert info.expert_types == sorted({t.tensor_type.name for t in exps})
    assert info.moe_layers == sorted({int(t.name.split(".")[1]) for t in exps})
    spec = synth.FIXTURES[name]
    assert (info.n_expert, info.n_expert_used, info.n_layer) == (spec.n_expert, spec.n_expert_used, spec.n_layer)
    assert info.gating == spec.gating
    assert info.expert_bytes * info.n_expert * info.n_moe_layer == pytest.approx(info.expert_bytes_total)


def test_a_vocabulary_with_a_repeated_token_is_refused_at_the_door(fixture_dir, tmp_path):
    """Issue 25 item 6: llama.cpp aborts (GGML_ASSERT in llama_vocab::load, no message) on a
    repeated token; model_info, and so Llama and every command, refuses the file first."""
    import subprocess
    import sys

    import gguf
    import gguf_edit as ge

    src = fixture_dir / "qwen2moe-60x4.gguf"
    field = gguf.GGUFReader(str(src)).fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    tokens[7] = tokens[3]
    g = ge.Gguf.parse(src.read_bytes()).set("tokenizer.ggml.tokens", ge.ARRAY, (ge.STRING, tokens))
    bad = tmp_path / "dup.gguf"
    bad.write_bytes(g.to_bytes())
    with pytest.raises(pymoecache.ModelFileError, match=r"twice, as ids 3 and 7"):
        model_info(bad)
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(bad), "-n", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "twice, as ids 3 and 7" in r.stderr, r.stderr
    # the unchanged vocabulary passes
    g = ge.Gguf.parse(src.read_bytes())
    ok = tmp_path / "ok.gguf"
    ok.write_bytes(g.to_bytes())
    assert model_info(ok).is_moe


VOCAB_CASES = [
    # (name, edit of the fixture's header, what `pymoecache run` must say; None = it runs)
    ("bos-out-of-range", lambda g, ge: g.set("tokenizer.ggml.bos_token_id", ge.UINT32, 10**6), None),
    ("unk-out-of-range", lambda g, ge: g.set("tokenizer.ggml.unknown_token_id", ge.UINT32, 4000000000), None),
    ("no-tokens", lambda g, ge: g.drop("tokenizer.ggml.tokens"), "cannot find tokenizer"),
    ("unknown-tokenizer", lambda g, ge: g.set("tokenizer.ggml.model", ge.STRING, "nonsense"), "unknown tokenizer"),
    ("bpe-without-merges", lambda g, ge: g.set("tokenizer.ggml.model", ge.STRING, "gpt2"), "merges"),
    ("wordpiece-with-byte-tokens", lambda g, ge: g.set("tokenizer.ggml.model", ge.STRING, "bert"), "WordPiece"),
    ("no-tokenizer-given-text", lambda g, ge: g.set("tokenizer.ggml.model", ge.STRING, "none"), "has no tokenizer"),
    ("rwkv", lambda g, ge: g.set("tokenizer.ggml.model", ge.STRING, "rwkv"), None),
    ("t5", lambda g, ge: g.set("tokenizer.ggml.model", ge.STRING, "t5"), None),
    ("plamo2", lambda g, ge: g.set("tokenizer.ggml.model", ge.STRING, "plamo2"), None),
    ("scores-short", lambda g, ge: g.set("tokenizer.ggml.scores", ge.ARRAY, (ge.FLOAT32, [0.0] * 10)), "Index out of"),
]


@pytest.mark.parametrize("name, edit, says", VOCAB_CASES, ids=[c[0] for c in VOCAB_CASES])
def test_vocabulary_content_llama_cpp_asserts_on(fixture_dir, tmp_path, name, edit, says):
    """Issue 25 item 6: vocabularies that reach a GGML_ASSERT/GGML_ABORT in llama.cpp are refused
    with a message; the ones llama.cpp runs still run. Never a signal."""
    import subprocess
    import sys

    import gguf_edit as ge

    g = ge.Gguf.parse((fixture_dir / "qwen2moe-60x4.gguf").read_bytes())
    edit(g, ge)
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(g.to_bytes())
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(path), "-n", "4", "-p", "Hello world"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    if says is None:
        assert r.returncode == 0, r.stderr[-1500:]
    else:
        assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stderr[-1500:])
