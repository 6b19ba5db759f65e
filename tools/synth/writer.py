"""Writing a GGUF: metadata (hparams, a copied real vocabulary), deterministic random tensors, trained weights."""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from pathlib import Path

import gguf
import numpy as np

from .spec import F16, F32, ModelSpec
from .vocab import _copy_vocab, vocab_size
from .layout import TensorPlan, tensor_plan


def _file_type(spec: ModelSpec) -> int:
    return {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[spec.weight_type]


def _add_hparams(writer: gguf.GGUFWriter, spec: ModelSpec, n_vocab: int | None = None) -> None:
    """Write the ``general.*`` and ``<arch>.*`` keys llama.cpp reads for ``spec``
    (``n_vocab``: the vocabulary size when it is not a vendored vocab file's)."""
    writer.add_name(spec.name)
    writer.add_file_type(_file_type(spec))
    if spec.weight_type == "Q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_vocab_size(vocab_size(spec.vocab) if n_vocab is None else n_vocab)
    writer.add_context_length(spec.n_ctx)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_rope_freq_base(spec.rope_freq_base)

    # llama and olmoe read the expert width from feed_forward_length
    if spec.arch in ("llama", "olmoe") and spec.n_expert > 0:
        writer.add_feed_forward_length(spec.n_ff_exp)
    else:
        writer.add_feed_forward_length(spec.n_ff)

    if spec.n_expert > 0:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
    if spec.arch in ("qwen2moe", "deepseek2"):
        writer.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.n_ff_shexp:
        writer.add_expert_shared_feed_forward_length(spec.n_ff_shexp)

    if spec.arch == "deepseek2":
        # MLA: the KV cache holds the compressed latent (MQA with one kv head);
        # key/value_length_mla are the decompressed per-head sizes.
        writer.add_rope_dimension_count(spec.qk_rope_head_dim)
        writer.add_q_lora_rank(spec.q_lora_rank)
        writer.add_kv_lora_rank(spec.kv_lora_rank)
        writer.add_key_length(spec.kv_lora_rank + spec.qk_rope_head_dim)
        writer.add_value_length(spec.kv_lora_rank)
        writer.add_key_length_mla(spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        writer.add_value_length_mla(spec.v_head_dim)
        writer.add_leading_dense_block_count(spec.n_dense_lead)
        writer.add_expert_shared_count(spec.n_expert_shared)
    else:
        writer.add_rope_dimension_count(spec.head_dim)

    if spec.n_expert > 0 and spec.arch == "deepseek2":
        gating = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX,
                  "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}[spec.gating]
        writer.add_expert_gating_func(gating)
        writer.add_expert_weights_norm(spec.expert_weights_norm)
        if spec.expert_weights_scale:
            writer.add_expert_weights_scale(spec.expert_weights_scale)
    if spec.n_expert_groups:
        writer.add_expert_group_count(spec.n_expert_groups)
        writer.add_expert_group_used_count(spec.n_group_used)


def _make_tensor(t: TensorPlan, seed: int) -> np.ndarray:
    """Data of one tensor, in numpy order (reversed ggml shape), ready to write.

    Each tensor has its own generator seeded with (seed, crc32(name)), so the
    data does not depend on the order tensors are written in.
    """
    np_shape = tuple(reversed(t.shape))
    if t.std is None:
        data = np.ones(np_shape, dtype=np.float32)
    else:
        rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
        data = rng.standard_normal(np_shape, dtype=np.float32)
        data *= np.float32(t.std)
    if t.dtype == F32:
        return data
    if t.dtype == F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, t.dtype)


def _tensor_nbytes(t: TensorPlan) -> int:
    np_shape = tuple(reversed(t.shape))
    if t.dtype in (F32, F16):
        return math.prod(np_shape) * (4 if t.dtype == F32 else 2)
    return math.prod(gguf.quant_shape_to_byte_shape(np_shape, t.dtype))


def _write_gguf(spec: ModelSpec, path: Path, seed: int, progress: bool = False, experts_last: bool = False) -> None:
    """Write ``spec`` to ``path`` tensor by tensor (never holds the whole model).

    The file is written under a temporary name and renamed at the end, so an
    interrupted build never leaves a truncated ``.gguf`` behind. ``experts_last`` puts the
    routed-expert tensors after all others (same data: each tensor has its own seed).
    """
    plan = tensor_plan(spec)
    if experts_last:
        plan = sorted(plan, key=lambda t: "_exps." in t.name)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, spec.arch)
    _add_hparams(writer, spec)
    _copy_vocab(writer, spec.vocab)
    for t in plan:
        if t.dtype in (F32, F16):
            dtype = np.float32 if t.dtype == F32 else np.float16
            writer.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(dtype), _tensor_nbytes(t))
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(tuple(reversed(t.shape)), t.dtype)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), _tensor_nbytes(t), raw_dtype=t.dtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(_tensor_nbytes(t) for t in plan), unit="B", unit_scale=True,
                   desc=path.name)
    for t in plan:
        writer.write_tensor_data(_make_tensor(t, seed))
        if progress:
            bar.update(_tensor_nbytes(t))
    if progress:
        bar.close()
    writer.close()
    tmp.replace(path)


def export_trained(spec: ModelSpec, tensors: dict, vocab: dict, path: str | os.PathLike) -> Path:
    """Write a model with given (trained) weights and its own SPM tokenizer to ``path``.

    ``tensors``: llama.cpp tensor name -> float numpy array in numpy order (the reversed ggml
    shape, e.g. ``token_embd.weight`` is ``[n_vocab, n_embd]``). Matrices (2-D and 3-D) are stored
    as ``spec.weight_type`` (F32 or F16); 1-D tensors and the routers (``ffn_gate_inp``) stay F32.
    ``vocab``: a llama-style sentencepiece vocabulary: ``tokens``, ``scores``, ``token_types``
    (llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte) and the ``bos``, ``eos``,
    ``unk`` ids. The names and shapes must match :func:`tensor_plan` for ``spec`` (checked).
    Used by scripts/train_tiny_moe.py. Returns the path.
    """
    path = Path(path)
    n_vocab = len(vocab["tokens"])
    expected = {t.name: tuple(reversed(t.shape)) for t in tensor_plan(dataclasses.replace(spec, vocab="llama-spm"))}
    expected = {k: ((n_vocab, spec.n_embd) if k in ("token_embd.weight", "output.weight") else v)
                for k, v in expected.items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))
        raise ValueError(f"tensors do not match the layout llama.cpp expects for {spec.arch}: {diff[:6]}")
    wtype = {"F32": np.float32, "F16": np.float16}[spec.weight_type]
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, spec.arch)
    _add_hparams(writer, spec, n_vocab=n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores([float(x) for x in vocab["scores"]])
    writer.add_token_types([int(x) for x in vocab["token_types"]])
    writer.add_bos_token_id(int(vocab["bos"]))
    writer.add_eos_token_id(int(vocab["eos"]))
    writer.add_unk_token_id(int(vocab["unk"]))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    for name in expected:
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if a.ndim >= 2 and not name.endswith("ffn_gate_inp.weight"):
            a = a.astype(wtype)
        writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path
