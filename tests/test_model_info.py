"""model_info reads GGUF headers itself (fast); gguf.GGUFReader is the independent reference."""

from __future__ import annotations

import gguf
import pytest

from pymoecache import model_info
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
