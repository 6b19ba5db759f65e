"""Weights with NaN or inf (issue 25 item 10): generation stops with a clear error at the first
logits instead of producing empty text and exit 0, whether the bad values sit in the dense part or
in an expert that is streamed in."""

from __future__ import annotations

import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

import pymoecache
from conftest import ROOT, model_path

QWEN = "qwen2moe-60x4"


def _poison(src, dst, tensor: str, value: float, n: int = 64):
    """A copy of ``src`` whose tensor ``tensor`` starts with ``n`` copies of ``value``."""
    shutil.copy(src, dst)
    t = next(t for t in gguf.GGUFReader(str(dst)).tensors if t.name == tensor)
    dtype = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}[t.tensor_type]
    with open(dst, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(np.full(n, value, dtype).tobytes())
    return dst


@pytest.mark.parametrize("tensor, residency", [
    ("token_embd.weight", "none"),
    ("output_norm.weight", "stream"),
    ("blk.0.ffn_down_exps.weight", "stream"),   # expert 0 of layer 0, read from the file on a miss
    ("blk.1.ffn_gate_exps.weight", "mmap"),
])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_weights_stop_with_a_clear_error(fixture_dir, tmp_path, tensor, residency, value):
    bad = _poison(model_path(fixture_dir, QWEN), tmp_path / "bad.gguf", tensor, value, n=4096)
    llm = pymoecache.Llama(str(bad), cache=pymoecache.CacheConfig(size=1.0 if residency == "none" else 0.5,
                                                                 residency=residency), verbose=False)
    with pytest.raises(pymoecache.ModelFileError, match="non-finite logits"):
        # every expert of every layer gets its turn within a few tokens of a 60-expert top-4 model
        for t in range(64):
            llm.eval([(t * 37) % 500 + 10])
    llm.close()


@pytest.mark.parametrize("where", ["sample", "logits_all", "next eval"])
def test_the_first_non_finite_logits_are_caught_where_they_are_read(fixture_dir, tmp_path, where):
    """eval does not synchronize with the device to check the logits: the sampler that reads them
    does (sample), eval itself where it copies them (logits_all), or the next decode at the latest."""
    bad = _poison(model_path(fixture_dir, QWEN), tmp_path / "bad.gguf", "output_norm.weight", float("nan"))
    llm = pymoecache.Llama(str(bad), logits_all=where == "logits_all", verbose=False)
    if where == "logits_all":
        with pytest.raises(pymoecache.ModelFileError, match="non-finite logits"):
            llm.eval([10, 11])
    else:
        llm.eval([10, 11])  # (not checked yet)
        with pytest.raises(pymoecache.ModelFileError, match="non-finite logits"):
            llm.sample(top_k=1) if where == "sample" else llm.eval([12])
        llm.eval([13])  # one error per decode: the next decode's logits are its own to check
    llm.close()


def test_cli_exits_2_on_nan_weights(fixture_dir, tmp_path):
    bad = _poison(model_path(fixture_dir, QWEN), tmp_path / "bad.gguf", "output_norm.weight", float("nan"))
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(bad), "-p", "Hello", "-n", "8"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "non-finite logits" in r.stderr, (r.returncode, r.stderr)


def test_finite_weights_are_untouched(fixture_dir):
    llm = pymoecache.Llama(str(model_path(fixture_dir, QWEN)), verbose=False)
    assert llm("Hello", max_tokens=4, temperature=0)["choices"][0]["text"]
    llm.close()
