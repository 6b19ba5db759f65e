"""Mutators and checks for fuzzing the two parsers that read untrusted files: the GGUF header
reader (pymoecache.model_info) and the cache state loader (moecache_state_load).

Used by tests/test_fuzz.py (hypothesis, a fixed budget in CI) and scripts/fuzz_inputs.py (long local
runs with counts). A check passes when the parser accepts the input or raises the package's own
error type; anything else (another exception, a crash) is a finding.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import numpy as np

import pymoecache
import gguf_edit as ge

_INTS = [0, 1, 2, 3, 4, 7, 59, 60, 61, 512, 513, 1024, 1025, 2**31 - 1, 2**32 - 1, 2**63 - 1]
_VALUES = ([(ge.UINT32, v) for v in _INTS if v < 2**32] + [(ge.UINT64, v) for v in _INTS]
           + [(ge.INT32, v) for v in (-1, -2**31, 4)] + [(ge.INT64, -1)]
           + [(ge.FLOAT32, v) for v in (math.nan, math.inf, -math.inf, 0.5, 32.0, -0.0)]
           + [(ge.FLOAT64, v) for v in (math.nan, 1e308, 4.0)] + [(ge.BOOL, True), (ge.STRING, ""), (ge.STRING, "x" * 300)]
           + [(ge.ARRAY, (ge.UINT32, [4, 4])), (ge.ARRAY, (ge.STRING, ["a"])), (ge.ARRAY, (ge.FLOAT32, []))])
_KEYS = ["expert_count", "expert_used_count", "block_count", "expert_group_count", "expert_group_used_count",
         "embedding_length", "context_length", "expert_shared_count", "expert_gating_func", "nextn_predict_layers",
         "rope.dimension_count", "attention.head_count", "attention.head_count_kv", "attention.key_length",
         "rope.scaling.type", "expert_feed_forward_length", "feed_forward_length"]


class HeaderFuzz:
    """Mutants of one GGUF model's header; the data section is replaced by a hole (sparse file)."""

    def __init__(self, model: Path):
        raw = model.read_bytes()
        self.base = ge.Gguf.parse(raw)
        self.data_len = len(self.base.data)
        self.header = raw[:len(raw) - self.data_len]
        self.arch = self.base.get("general.architecture")

    def mutant(self, rng: np.random.Generator) -> bytes:
        """A mutated header (its data is a hole of the original length, see write())."""
        kind = rng.choice(["flip", "cut", "kv", "tensor", "counts"], p=[0.4, 0.1, 0.25, 0.2, 0.05])
        if kind == "flip":
            b = bytearray(self.header)
            for _ in range(int(rng.integers(1, 5))):
                lo, hi = self.base.spans[int(rng.integers(len(self.base.spans)))]
                b[int(rng.integers(lo, hi))] = int(rng.integers(256))
            return bytes(b)
        if kind == "cut":
            return self.header[:int(rng.integers(0, len(self.header)))]
        g = ge.Gguf.parse(self.header)  # a fresh copy; its data section is empty (see write())
        if kind == "kv":
            key = (f"{self.arch}.{_KEYS[int(rng.integers(len(_KEYS)))]}" if rng.random() < 0.7 else
                   g.kv[int(rng.integers(len(g.kv)))][0])
            vtype, value = _VALUES[int(rng.integers(len(_VALUES)))]
            if rng.random() < 0.1:
                g.drop(key)
            else:
                g.set(key, vtype, value)
        elif kind == "tensor":
            t = g.tensors[int(rng.integers(len(g.tensors)))]
            what = rng.choice(["dim", "ndims", "type", "offset", "name"])
            if what == "dim":
                t.shape[int(rng.integers(len(t.shape)))] = int(rng.choice([0, 1, 59, 61, 2**40, t.shape[0] + 1]))
            elif what == "ndims":
                t.shape = t.shape[:-1] if rng.random() < 0.5 else t.shape + [1] * int(rng.integers(1, 4))
            elif what == "type":
                t.ggml_type = int(rng.integers(0, 45))
            elif what == "offset":
                t.offset = max(0, t.offset + int(rng.choice([-32, -1, 1, 16, 32, 2**40])))
            else:
                t.name = g.tensors[int(rng.integers(len(g.tensors)))].name
        else:
            g.extra_kv_count = int(rng.choice([-1, 1, 2**40])) if rng.random() < 0.5 else 0
            g.extra_tensor_count = int(rng.choice([-1, 1, 1000])) if not g.extra_kv_count else 0
            g.extra_kv_count = max(g.extra_kv_count, -len(g.kv))
            g.extra_tensor_count = max(g.extra_tensor_count, -len(g.tensors))
        return g.to_bytes()

    def write(self, header: bytes, path: Path) -> Path:
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + self.data_len)
        return path


def check_header(path: Path) -> str:
    """'ok' or 'refused'; any exception other than the package's own propagates (a finding)."""
    try:
        pymoecache.model_info(path)
        return "ok"
    except pymoecache.Error:
        return "refused"


def resum_state(raw: bytes) -> bytes:
    """``raw`` with its trailing FNV-1a checksum recomputed (so a mutant reaches the field checks)."""
    h = 0xcbf29ce484222325
    for b in raw[:-8]:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return raw[:-8] + struct.pack("<Q", h)


def state_mutant(rng: np.random.Generator, raw: bytes) -> bytes:
    """A mutated state file; half of them get a repaired checksum so the field checks are reached."""
    b = bytearray(raw)
    kind = rng.choice(["flip", "cut", "word", "grow"])
    if kind == "flip":
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
    elif kind == "cut":
        b = b[:int(rng.integers(len(b)))]
    elif kind == "word" and len(b) >= 8:
        i = int(rng.integers(0, len(b) - 8))
        fmt, v = [("<i", -1), ("<i", 2**31 - 1), ("<i", 0), ("<q", -1), ("<d", math.nan), ("<d", -1.0),
                  ("<d", math.inf), ("<d", 1e300), ("<I", 2**32 - 1)][int(rng.integers(9))]
        struct.pack_into(fmt, b, i, v)
    else:
        i = int(rng.integers(len(b) + 1))
        b[i:i] = bytes(rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8))
    out = bytes(b)
    return resum_state(out) if len(out) >= 16 and rng.random() < 0.5 else out


def check_state(mc: "pymoecache.MoECache", path: Path) -> str:
    """'ok' or 'refused'. A refused file must leave the cache as it was; a loaded one must hold
    valid contents (unique ids in range, within capacity, a finite Delta >= 0)."""
    before = [mc.cached(il) for il in range(mc.n_layer)]
    try:
        mc.load(path)
    except pymoecache.StateFileError:
        assert [mc.cached(il) for il in range(mc.n_layer)] == before, "a refused state file changed the cache"
        return "refused"
    st = mc.stats()  # every layer of the synthetic cache has routed, so row il is layer il
    for il in range(mc.n_layer):
        ids = mc.cached(il)
        assert len(set(ids)) == len(ids) and all(0 <= e < mc.n_expert for e in ids), ids
        assert len(ids) <= st.capacity_per_layer[il], ids
    assert np.all(np.isfinite(st.delta_per_layer)) and np.all(st.delta_per_layer >= 0), st.delta_per_layer
    return "ok"


def warm_synthetic_cache() -> "tuple[pymoecache.MoECache, bytes]":
    """A synthetic cache (8 layers, 16 experts, K = 2, 8 cached) after some routing, and its saved state."""
    import tempfile

    mc = pymoecache.MoECache.synthetic(n_layer=8, n_expert=16, n_expert_used=2,
                                       cache=pymoecache.CacheConfig(size=8), routing="prior:0.5")
    rng = np.random.default_rng(0)
    for il in range(8):
        mc.route(il, rng.normal(size=(20, 16)).astype(np.float32))
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "s.moecache")
        mc.save(p)
        raw = Path(p).read_bytes()
    return mc, raw
