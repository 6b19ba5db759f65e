"""tools/synth/widen.py: experts widened with zeros compute what the model computes.

The trained benchmark model (scripts/bench_residency.py --model trained) is model C with every
expert widened to the random benchmark's bytes; its claim is that its logits are model C's. Here
the same widening of fixture models, at F16 and quantized as they are, against the originals.
"""

from __future__ import annotations

import numpy as np
import pytest

import pymoecache
from conftest import model_path
from pymoecache import CacheConfig, model_info

synth = pytest.importorskip("synth")
from synth.widen import widen_experts  # noqa: E402


def n_ff_exp(path) -> int:
    import gguf

    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    key = f"{arch}.expert_feed_forward_length"
    return int(r.fields[key if key in r.fields else f"{arch}.feed_forward_length"].contents())


def logits(path, tokens=None):
    llm = pymoecache.Llama(str(path), n_ctx=64, verbose=False, n_threads=2, logits_all=True,
                           cache=CacheConfig(size=1.0, residency="none"), routing="lru")
    tokens = tokens or llm.tokenize(b"Once upon a time there was a king who ruled the land", add_bos=True)
    llm.eval(tokens)
    out = np.array(llm.scores[:len(tokens)])
    llm.close()
    return out, tokens


# quantized: bit for bit (zero blocks add exact zeros to vec_dot's sums); F16 prompts go through
# llamafile's tiled sgemm, whose order of summation follows the row length: equal to rounding
@pytest.mark.parametrize("name,variant", [("qwen2moe-60x4", ".Q8_0"), ("mixtral-8x2", ".Q8_0"),
                                          ("qwen2moe-60x4", "")])
def test_widened_experts_give_the_same_logits(fixture_dir, tmp_path, name, variant):
    src = model_path(fixture_dir, name, variant)
    info = model_info(src)
    wide = widen_experts(src, tmp_path / "wide.gguf", 4 * n_ff_exp(src))
    got = model_info(wide)
    assert n_ff_exp(wide) == 4 * n_ff_exp(src) and got.expert_types == info.expert_types
    assert got.expert_bytes == pytest.approx(4 * info.expert_bytes, rel=0.02)
    want, tokens = logits(src)
    got_logits = logits(wide, tokens)[0]
    if variant:
        assert np.array_equal(got_logits, want)  # bit for bit
    else:
        assert not np.array_equal(want, 0 * want) and np.allclose(got_logits, want, rtol=1e-3, atol=1e-2)


def test_narrowing_is_refused(fixture_dir, tmp_path):
    src = model_path(fixture_dir, "qwen2moe-60x4", ".Q8_0")
    with pytest.raises(ValueError, match="cannot narrow"):
        widen_experts(src, tmp_path / "x.gguf", n_ff_exp(src) // 2)
    assert not (tmp_path / "x.gguf").exists()
