"""Widen a model's routed experts with zeros: the trained benchmark model.

``widen_experts(src, dst, n_ff_exp)`` copies a GGUF (any weight type) and gives every routed expert
a hidden width of ``n_ff_exp`` instead of its own: ``ffn_gate_exps`` and ``ffn_up_exps`` get zero
rows, ``ffn_down_exps`` zero columns, and ``<arch>.expert_feed_forward_length`` (Mixtral's layout:
``feed_forward_length``) the new width.
Each added hidden unit computes silu(0) * 0 = 0 and the down projection multiplies it by 0, so the
model's outputs do not change; but every expert now has the bytes and the multiply-adds of a wider
one. From model C (hidden 256, experts 256 wide) at 2048 and Q8_0, an expert is 3 x 256 x 2048 x
34/32 bytes = 1.67 MB, the random-weight benchmark's (1024 x 512): a benchmark with the bytes of
the 2.2 GB model per expert and the routing of a trained model. Zero blocks quantize to zero
blocks, and the first blocks of a row are the unwidened row's, so the widened model at a type
computes what the model does at that type; a quantized model is widened as it is (an all-zero
block is zero in every ggml type), which keeps its bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

_SKIP = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")


def widen_experts(src: str | os.PathLike, dst: str | os.PathLike, n_ff_exp: int) -> Path:
    """Write ``dst``: ``src`` with every routed expert ``n_ff_exp`` wide (zeros added). Returns dst."""
    src, dst = Path(src), Path(dst)
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    key = f"{arch}.expert_feed_forward_length"
    if key not in r.fields:  # (llama-layout MoE, Mixtral: the experts' width is the feed-forward length)
        key = f"{arch}.feed_forward_length"
    old = int(r.fields[key].contents())
    if n_ff_exp < old:
        raise ValueError(f"{src.name}: experts are {old} wide, cannot narrow them to {n_ff_exp}")
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    for f in r.fields.values():
        if f.name in _SKIP:
            continue
        value = n_ff_exp if f.name == key else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, value, f.types[0], sub_type=sub)
    for t in r.tensors:
        a = np.asarray(t.data)  # numpy order, the reversed ggml shape; quantized: [..., bytes of a row]
        raw = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):  # [E, n_ff_exp, n_embd]: rows
            a = np.concatenate([a, np.zeros((a.shape[0], n_ff_exp - old, a.shape[2]), a.dtype)], axis=1)
        elif t.name.endswith("ffn_down_exps.weight"):                        # [E, n_embd, n_ff_exp]: columns
            add = (n_ff_exp - old) * a.shape[2] // old  # (in bytes for a quantized row: all-zero blocks are 0)
            a = np.concatenate([a, np.zeros((a.shape[0], a.shape[1], add), a.dtype)], axis=2)
        w.add_tensor(t.name, np.ascontiguousarray(a), raw_dtype=t.tensor_type if raw else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)
    return dst
