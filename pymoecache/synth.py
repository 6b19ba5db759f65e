"""Deterministic random-weight GGUF models for tests and benchmarks.

The project's tests need real Mixture-of-Experts GGUF files that llama.cpp can
load and run, but the model hubs are not reachable. This module writes small
models with random weights instead:

* the architecture metadata and tensor layout follow what llama.cpp's loader
  expects for each architecture (see vendor/llama.cpp/src/models/<arch>.cpp);
* the tokenizer is a real vocabulary copied from one of the vocab-only files
  shipped with llama.cpp (vendor/llama.cpp/models/ggml-vocab-*.gguf);
* every weight comes from a numpy generator seeded with (seed, tensor name), so
  the same spec and seed always give a byte-identical file.

Public functions:

* ``build_fixture(name, out_dir, seed)`` writes one of the ``FIXTURES``;
* ``quantize(src, dst, ftype_name)`` makes a Q8_0 / Q4_K_M copy through
  llama.cpp's own quantizer (llama-cpp-python's ctypes API);
* ``build_all(out_dir, seed)`` writes every fixture plus quantized copies of
  the MoE ones, skipping files that are already up to date;
* ``build_bench_model(out_path, target_mb, seed)`` writes one large
  qwen2moe-style model (Q8_0 weights) for speed benchmarks.

Each model file ``<name>.gguf`` gets a JSON card ``<name>.json`` next to it
that records the hyperparameters, the seed, the file size and sha256, and for
quantized copies the ggml types the quantizer actually chose.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

# Bump when the generator changes in a way that changes the output bytes;
# it is part of the spec hash, so stale files get rebuilt.
SYNTH_VERSION = 1

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = REPO_ROOT / "vendor" / "llama.cpp" / "models"
PACKAGE_DATA_DIR = Path(__file__).resolve().parent / "data"

# Quantized variants made by build_all() for every MoE fixture.
QUANT_TYPES = ("Q8_0", "Q4_K_M")

F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@dataclass(frozen=True)
class ModelSpec:
    """Every hyperparameter of one synthetic model.

    Widths follow llama.cpp's naming: ``n_ff`` is the dense FFN width (dense
    models, and the leading dense block of deepseek2), ``n_ff_exp`` the width
    of one routed expert. Shared experts come in two flavours: Qwen's single
    gated shared expert of width ``n_ff_shexp``, or DeepSeek's
    ``n_expert_shared`` experts of width ``n_ff_exp`` each.
    """

    name: str
    arch: str                       # llama.cpp architecture name
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ctx: int                      # context_length written to the file
    n_ff: int                       # dense FFN width (0: no dense FFN)
    n_expert: int                   # routed experts per MoE layer (0: dense model)
    n_expert_used: int              # top-k
    n_ff_exp: int                   # width of one routed expert
    n_ff_shexp: int                 # qwen2moe shared expert width (0: none)
    n_expert_shared: int            # deepseek2 shared expert count (0: none)
    gating: str                     # "softmax" or "sigmoid"
    n_expert_groups: int            # 0: no group-limited routing
    n_group_used: int
    n_dense_lead: int               # leading dense blocks before the MoE blocks
    expert_weights_norm: bool       # renormalise the top-k weights
    expert_weights_scale: float     # 0.0: key not written
    # (llama, qwen2moe and olmoe hard-code softmax gating and the norm flag in
    #  llama.cpp; for them these fields only describe what llama.cpp does.
    #  deepseek2 reads gating, norm, scale and groups from the file.)
    attn_qkv_bias: bool             # q/k/v bias tensors (Qwen style)
    tie_output: bool                # no output.weight, llama.cpp reuses token_embd
    # MLA attention (deepseek2 only, all 0 otherwise)
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # weights
    embd_type: str                  # token_embd / output: "F16", "F32" or "Q8_0"
    weight_type: str                # other matrices: "F32", "F16" or "Q8_0"
    embd_std: float                 # std of token_embd entries (small: the layers, not the
                                    # input token, should dominate the residual stream)
    output_std: float               # std of output.weight entries (large: peaked logits,
                                    # so greedy decoding is stable under quantization)
    router_std: float               # std of ffn_gate_inp entries (absolute, not / sqrt(fan_in))
    probs_bias_std: float           # std of exp_probs_b (sigmoid selection bias)
    rms_eps: float
    rope_freq_base: float
    vocab: str                      # ggml-vocab-<vocab>.gguf in VOCAB_DIR

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def moe_layers(self) -> list[int]:
        if self.n_expert == 0:
            return []
        return list(range(self.n_dense_lead, self.n_layer))


FIXTURES: dict[str, ModelSpec] = {
    # Qwen1.5-MoE layout: 60 experts, top-4, softmax without renormalisation,
    # one sigmoid-gated shared expert per layer.
    "qwen2moe-60x4": ModelSpec(
        name="qwen2moe-60x4", arch="qwen2moe",
        n_layer=4, n_embd=64, n_head=4, n_head_kv=4, n_ctx=512, n_ff=128,
        n_expert=60, n_expert_used=4, n_ff_exp=32,
        n_ff_shexp=128, n_expert_shared=0,
        gating="softmax", n_expert_groups=0, n_group_used=0, n_dense_lead=0,
        expert_weights_norm=False, expert_weights_scale=0.0,
        attn_qkv_bias=True, tie_output=False,
        q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
        embd_type="F16", weight_type="F32",
        embd_std=0.5, output_std=1.0, router_std=1.0, probs_bias_std=0.0,
        rms_eps=1e-6, rope_freq_base=1000000.0, vocab="llama-spm",
    ),
    # OLMoE layout: 64 experts, top-8, softmax, q/k norms, no shared expert.
    "olmoe-64x8": ModelSpec(
        name="olmoe-64x8", arch="olmoe",
        n_layer=4, n_embd=64, n_head=4, n_head_kv=4, n_ctx=512, n_ff=0,
        n_expert=64, n_expert_used=8, n_ff_exp=32,
        n_ff_shexp=0, n_expert_shared=0,
        gating="softmax", n_expert_groups=0, n_group_used=0, n_dense_lead=0,
        expert_weights_norm=False, expert_weights_scale=0.0,
        attn_qkv_bias=False, tie_output=False,
        q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
        embd_type="F16", weight_type="F32",
        embd_std=0.5, output_std=1.0, router_std=1.0, probs_bias_std=0.0,
        rms_eps=1e-5, rope_freq_base=10000.0, vocab="llama-spm",
    ),
    # Mixtral layout (arch "llama" with expert tensors): 8 experts, top-2.
    "mixtral-8x2": ModelSpec(
        name="mixtral-8x2", arch="llama",
        n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ctx=512, n_ff=0,
        n_expert=8, n_expert_used=2, n_ff_exp=64,
        n_ff_shexp=0, n_expert_shared=0,
        gating="softmax", n_expert_groups=0, n_group_used=0, n_dense_lead=0,
        expert_weights_norm=True, expert_weights_scale=0.0,
        attn_qkv_bias=False, tie_output=True,
        q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
        embd_type="F16", weight_type="F32",
        embd_std=0.5, output_std=1.0, router_std=1.0, probs_bias_std=0.0,
        rms_eps=1e-5, rope_freq_base=1000000.0, vocab="llama-spm",
    ),
    # DeepSeek-V3 style routing on the deepseek2 arch (MLA attention):
    # sigmoid scores + selection bias, 8 groups of 8 experts with the best 4
    # groups kept, top-6, renormalised and scaled by 2.5, one shared expert,
    # and a leading dense block. router_std/probs_bias_std are chosen so the
    # bias changes the expert set of most tokens (~4.5 of 6 experts kept) while
    # every expert still gets used.
    "deepseek2-sigmoid-64x6": ModelSpec(
        name="deepseek2-sigmoid-64x6", arch="deepseek2",
        n_layer=4, n_embd=64, n_head=4, n_head_kv=1, n_ctx=512, n_ff=128,
        n_expert=64, n_expert_used=6, n_ff_exp=32,
        n_ff_shexp=0, n_expert_shared=1,
        gating="sigmoid", n_expert_groups=8, n_group_used=4, n_dense_lead=1,
        expert_weights_norm=True, expert_weights_scale=2.5,
        attn_qkv_bias=False, tie_output=True,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        embd_type="F16", weight_type="F32",
        embd_std=0.5, output_std=1.0, router_std=0.25, probs_bias_std=0.05,
        rms_eps=1e-6, rope_freq_base=10000.0, vocab="llama-spm",
    ),
    # A plain dense llama: no MoE layers at all.
    "dense-llama": ModelSpec(
        name="dense-llama", arch="llama",
        n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ctx=512, n_ff=128,
        n_expert=0, n_expert_used=0, n_ff_exp=0,
        n_ff_shexp=0, n_expert_shared=0,
        gating="none", n_expert_groups=0, n_group_used=0, n_dense_lead=0,
        expert_weights_norm=False, expert_weights_scale=0.0,
        attn_qkv_bias=False, tie_output=True,
        q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
        embd_type="F16", weight_type="F32",
        embd_std=0.5, output_std=1.0, router_std=0.0, probs_bias_std=0.0,
        rms_eps=1e-5, rope_freq_base=10000.0, vocab="llama-spm",
    ),
}

# Large qwen2moe-style model for benchmarks. n_layer is a minimum:
# build_bench_model() adds layers until the file reaches target_mb.
# output_std 0.25 = 8 / sqrt(n_embd): logits std ~8, as in the small fixtures.
BENCH_SPEC = ModelSpec(
    name="bench-qwen2moe-60x4", arch="qwen2moe",
    n_layer=8, n_embd=1024, n_head=16, n_head_kv=16, n_ctx=4096, n_ff=2048,
    n_expert=60, n_expert_used=4, n_ff_exp=128,
    n_ff_shexp=512, n_expert_shared=0,
    gating="softmax", n_expert_groups=0, n_group_used=0, n_dense_lead=0,
    expert_weights_norm=False, expert_weights_scale=0.0,
    attn_qkv_bias=True, tie_output=False,
    q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
    embd_type="Q8_0", weight_type="Q8_0",
    embd_std=0.5, output_std=0.25, router_std=1.0, probs_bias_std=0.0,
    rms_eps=1e-6, rope_freq_base=1000000.0, vocab="llama-spm",
)


# ---------------------------------------------------------------------------
# tensor layout
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: ggml shape (ne[0] first), init std, storage type.

    ``std`` None means "all ones" (norm weights).
    """

    name: str
    shape: tuple[int, ...]
    std: float | None
    dtype: gguf.GGMLQuantizationType


def _qtype(type_name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[type_name]


def tensor_plan(spec: ModelSpec) -> list[TensorPlan]:
    """List every tensor of ``spec`` in file order, with its shape and init.

    Shapes are in ggml order: ``ne[0]`` is the input (contracted) dimension,
    so matrices are initialised with std ``1/sqrt(ne[0])``.
    """
    embd_t = _qtype(spec.embd_type)
    weight_t = _qtype(spec.weight_type)
    plan: list[TensorPlan] = []

    def norm(name: str, n: int) -> None:
        plan.append(TensorPlan(name, (n,), None, F32))

    def matrix(name: str, *shape: int) -> None:
        plan.append(TensorPlan(name, tuple(shape), 1.0 / math.sqrt(shape[0]), weight_t))

    def small(name: str, std: float, *shape: int) -> None:
        # 1-D vectors and routers stay F32 (llama.cpp never quantizes them)
        plan.append(TensorPlan(name, tuple(shape), std, F32))

    n_vocab = vocab_size(spec.vocab)
    plan.append(TensorPlan("token_embd.weight", (spec.n_embd, n_vocab), spec.embd_std, embd_t))
    norm("output_norm.weight", spec.n_embd)
    if not spec.tie_output:
        plan.append(TensorPlan("output.weight", (spec.n_embd, n_vocab), spec.output_std, embd_t))

    for il in range(spec.n_layer):
        blk = f"blk.{il}"
        norm(f"{blk}.attn_norm.weight", spec.n_embd)
        if spec.arch == "deepseek2":
            _plan_mla_attention(spec, blk, norm, matrix)
        else:
            _plan_attention(spec, blk, norm, matrix, small)

        norm(f"{blk}.ffn_norm.weight", spec.n_embd)
        if il not in spec.moe_layers:
            matrix(f"{blk}.ffn_gate.weight", spec.n_embd, spec.n_ff)
            matrix(f"{blk}.ffn_up.weight", spec.n_embd, spec.n_ff)
            matrix(f"{blk}.ffn_down.weight", spec.n_ff, spec.n_embd)
            continue

        # routed experts
        small(f"{blk}.ffn_gate_inp.weight", spec.router_std, spec.n_embd, spec.n_expert)
        if spec.gating == "sigmoid":
            small(f"{blk}.exp_probs_b.bias", spec.probs_bias_std, spec.n_expert)
        matrix(f"{blk}.ffn_gate_exps.weight", spec.n_embd, spec.n_ff_exp, spec.n_expert)
        matrix(f"{blk}.ffn_up_exps.weight", spec.n_embd, spec.n_ff_exp, spec.n_expert)
        matrix(f"{blk}.ffn_down_exps.weight", spec.n_ff_exp, spec.n_embd, spec.n_expert)

        # shared experts
        n_ff_shared = spec.n_ff_shexp or spec.n_ff_exp * spec.n_expert_shared
        if spec.n_ff_shexp:
            # qwen2moe: a 1-row gate, sigmoid(x . w) scales the shared expert output
            small(f"{blk}.ffn_gate_inp_shexp.weight", 1.0 / math.sqrt(spec.n_embd), spec.n_embd)
        if n_ff_shared:
            matrix(f"{blk}.ffn_gate_shexp.weight", spec.n_embd, n_ff_shared)
            matrix(f"{blk}.ffn_up_shexp.weight", spec.n_embd, n_ff_shared)
            matrix(f"{blk}.ffn_down_shexp.weight", n_ff_shared, spec.n_embd)
    return plan


def _plan_attention(spec, blk, norm, matrix, small) -> None:
    """Standard multi-head / grouped-query attention tensors."""
    n_q = spec.n_head * spec.head_dim
    n_kv = spec.n_head_kv * spec.head_dim
    matrix(f"{blk}.attn_q.weight", spec.n_embd, n_q)
    matrix(f"{blk}.attn_k.weight", spec.n_embd, n_kv)
    matrix(f"{blk}.attn_v.weight", spec.n_embd, n_kv)
    if spec.attn_qkv_bias:
        small(f"{blk}.attn_q.bias", 0.1, n_q)
        small(f"{blk}.attn_k.bias", 0.1, n_kv)
        small(f"{blk}.attn_v.bias", 0.1, n_kv)
    if spec.arch == "olmoe":
        norm(f"{blk}.attn_q_norm.weight", n_q)
        norm(f"{blk}.attn_k_norm.weight", n_kv)
    matrix(f"{blk}.attn_output.weight", n_q, spec.n_embd)


def _plan_mla_attention(spec, blk, norm, matrix) -> None:
    """DeepSeek-V2/V3 multi-head latent attention, in the split k_b / v_b form
    that current convert_hf_to_gguf.py writes."""
    qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    norm(f"{blk}.attn_q_a_norm.weight", spec.q_lora_rank)
    norm(f"{blk}.attn_kv_a_norm.weight", spec.kv_lora_rank)
    matrix(f"{blk}.attn_q_a.weight", spec.n_embd, spec.q_lora_rank)
    matrix(f"{blk}.attn_q_b.weight", spec.q_lora_rank, spec.n_head * qk_head)
    matrix(f"{blk}.attn_kv_a_mqa.weight", spec.n_embd, spec.kv_lora_rank + spec.qk_rope_head_dim)
    matrix(f"{blk}.attn_k_b.weight", spec.qk_nope_head_dim, spec.kv_lora_rank, spec.n_head)
    matrix(f"{blk}.attn_v_b.weight", spec.kv_lora_rank, spec.v_head_dim, spec.n_head)
    matrix(f"{blk}.attn_output.weight", spec.n_head * spec.v_head_dim, spec.n_embd)


# ---------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------

def vocab_path(vocab: str) -> Path:
    """Path of the vocab-only GGUF ``ggml-vocab-<vocab>.gguf``: shipped in the wheel
    (``pymoecache/data``, installed by CMakeLists.txt) or in a source checkout's vendor tree."""
    name = f"ggml-vocab-{vocab}.gguf"
    for d in (PACKAGE_DATA_DIR, VOCAB_DIR):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"vocab file {name} not found in {PACKAGE_DATA_DIR} or {VOCAB_DIR} "
                            "(reinstall pymoecache, or run scripts/vendor_llama_cpp.py in a checkout)")


@functools.lru_cache(maxsize=None)
def vocab_size(vocab: str) -> int:
    """Number of tokens in a vendored vocab file."""
    reader = gguf.GGUFReader(vocab_path(vocab))
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _copy_vocab(writer: gguf.GGUFWriter, vocab: str) -> None:
    """Copy every ``tokenizer.*`` key of a vendored vocab file, types unchanged."""
    reader = gguf.GGUFReader(vocab_path(vocab))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main_type = field.types[0]
        if main_type == gguf.GGUFValueType.ARRAY:
            sub_type = field.types[-1]
            if sub_type == gguf.GGUFValueType.STRING:
                # keep strings as raw bytes so the copy is byte-exact
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = field.contents()
            writer.add_key_value(key, value, main_type, sub_type=sub_type)
        elif main_type == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), main_type)
        else:
            writer.add_key_value(key, field.contents(), main_type)


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


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# cards
# ---------------------------------------------------------------------------

def spec_hash(spec: ModelSpec) -> str:
    """Short hash of every hyperparameter plus SYNTH_VERSION."""
    payload = json.dumps({"synth_version": SYNTH_VERSION, "spec": dataclasses.asdict(spec)},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def card_path(model_path: Path) -> Path:
    """``<name>.json`` next to ``<name>.gguf``."""
    return Path(model_path).with_suffix(".json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tensor_types(path: Path) -> dict[str, dict[str, int]]:
    """Read a GGUF back: {tensor kind (layer number removed): {ggml type: count}}."""
    reader = gguf.GGUFReader(path)
    types: dict[str, Counter] = defaultdict(Counter)
    for t in reader.tensors:
        kind = re.sub(r"^blk\.\d+\.", "", t.name)
        types[kind][t.tensor_type.name] += 1
    return {kind: dict(sorted(c.items())) for kind, c in sorted(types.items())}


def _make_card(spec: ModelSpec, path: Path, seed: int, variant: str) -> dict:
    tensor_types = _tensor_types(path)
    return {
        "name": spec.name,
        "file": path.name,
        "variant": variant,
        "arch": spec.arch,
        "n_layer": spec.n_layer,
        "moe_layers": spec.moe_layers,
        "n_expert": spec.n_expert,
        "n_expert_used": spec.n_expert_used,
        "shared_experts": {
            "qwen_gated_shexp_n_ff": spec.n_ff_shexp,
            "deepseek_n_expert_shared": spec.n_expert_shared,
        },
        "gating": spec.gating,
        "expert_groups": {"count": spec.n_expert_groups, "used": spec.n_group_used},
        "n_embd": spec.n_embd,
        "n_ff_exp": spec.n_ff_exp,
        "vocab_source": vocab_path(spec.vocab).name,
        "seed": seed,
        "spec_hash": spec_hash(spec),
        "synth_version": SYNTH_VERSION,
        "file_size": path.stat().st_size,
        "sha256": _sha256(path),
        "expert_tensor_types": {k: v for k, v in tensor_types.items() if "_exps." in k},
        "tensor_types": tensor_types,
        "spec": dataclasses.asdict(spec),
    }


def _write_card(card: dict, model_path: Path) -> None:
    card_path(model_path).write_text(json.dumps(card, indent=2) + "\n")


def _is_up_to_date(model_path: Path, spec: ModelSpec, seed: int, variant: str) -> bool:
    """True if the file exists and its card says it was built from this spec+seed."""
    cpath = card_path(model_path)
    if not Path(model_path).is_file() or not cpath.is_file():
        return False
    try:
        card = json.loads(cpath.read_text())
    except (OSError, ValueError):
        return False
    return (card.get("spec_hash") == spec_hash(spec)
            and card.get("seed") == seed
            and card.get("variant") == variant
            and card.get("file_size") == Path(model_path).stat().st_size)


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------

def build_fixture(name: str, out_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> Path:
    """Write fixture ``name`` (a key of FIXTURES) as ``<out_dir>/<name>.gguf``.

    Weights are F32 except token_embd/output (F16, to keep files small).
    An existing file whose card matches the spec and seed is kept unless
    ``force`` is set. Returns the path of the .gguf file.
    """
    spec = FIXTURES[name]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.gguf"
    if not force and _is_up_to_date(path, spec, seed, "base"):
        return path
    _write_gguf(spec, path, seed)
    _write_card(_make_card(spec, path, seed, "base"), path)
    return path


def _load_llama_cpp():
    """Import llama_cpp, loaded on this project's libllama when possible.

    If llama_cpp is not imported yet and LLAMA_CPP_LIB_PATH is unset, importing
    the pymoecache package sets it (pymoecache/_lib.py finds the build).
    """
    if "llama_cpp" not in sys.modules and "LLAMA_CPP_LIB_PATH" not in os.environ:
        try:
            import pymoecache  # noqa: F401
        except ImportError:
            pass
    try:
        import llama_cpp
    except (ImportError, OSError) as e:
        raise RuntimeError(
            "quantization needs llama-cpp-python and libllama; set LLAMA_CPP_LIB_PATH "
            f"to the folder holding libllama.so ({e})") from e
    return llama_cpp


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype_name: str) -> Path:
    """Quantize ``src`` to ``dst`` with llama.cpp's quantizer (llama_model_quantize).

    ``ftype_name`` is "Q8_0" or "Q4_K_M". With the fixtures' small widths some
    tensors cannot use the requested type (K-quants need rows of 256), and
    llama.cpp picks a fallback type; the card written next to ``dst`` records
    the types actually used. If ``src`` has a card, the new card copies its
    spec fields and points back at the source.
    """
    llama_cpp = _load_llama_cpp()
    ftypes = {
        "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
        "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    }
    if ftype_name not in ftypes:
        raise ValueError(f"unsupported ftype {ftype_name!r}; choose from {sorted(ftypes)}")
    src, dst = Path(src), Path(dst)

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype_name]
    params.nthread = os.cpu_count() or 1
    tmp = dst.with_name(dst.name + ".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype_name}) failed with {rc}")
    tmp.replace(dst)

    src_card_path = card_path(src)
    if src_card_path.is_file():
        src_card = json.loads(src_card_path.read_text())
        spec = ModelSpec(**src_card["spec"])
        card = _make_card(spec, dst, src_card["seed"], ftype_name)
        card["spec_hash"] = src_card["spec_hash"]
        card["source_file"] = src.name
        card["source_sha256"] = src_card["sha256"]
    else:
        tensor_types = _tensor_types(dst)
        card = {
            "file": dst.name,
            "variant": ftype_name,
            "source_file": src.name,
            "file_size": dst.stat().st_size,
            "sha256": _sha256(dst),
            "expert_tensor_types": {k: v for k, v in tensor_types.items() if "_exps." in k},
            "tensor_types": tensor_types,
        }
    _write_card(card, dst)
    return dst


def build_all(out_dir: str | os.PathLike, seed: int = 0, force: bool = False,
              verbose: bool = True) -> list[Path]:
    """Build every fixture, plus Q8_0 and Q4_K_M copies of the MoE ones.

    Files already built from the same spec and seed are skipped (unless
    ``force``). Returns the paths of all model files, base files first.
    """
    out_dir = Path(out_dir)
    paths = []
    for name, spec in FIXTURES.items():
        t0 = time.perf_counter()
        base = out_dir / f"{name}.gguf"
        base_fresh = force or not _is_up_to_date(base, spec, seed, "base")
        build_fixture(name, out_dir, seed, force=force)
        paths.append(base)
        if verbose:
            _report(base, base_fresh, t0)
        if spec.n_expert == 0:
            continue
        for qname in QUANT_TYPES:
            t0 = time.perf_counter()
            qpath = out_dir / f"{name}.{qname}.gguf"
            fresh = base_fresh or not _is_up_to_date(qpath, spec, seed, qname)
            if fresh:
                quantize(base, qpath, qname)
            paths.append(qpath)
            if verbose:
                _report(qpath, fresh, t0)
    return paths


def _report(path: Path, built: bool, t0: float) -> None:
    size_mb = path.stat().st_size / 1e6
    what = f"built in {time.perf_counter() - t0:.1f}s" if built else "up to date"
    print(f"{path}: {size_mb:.1f} MB, {what}", flush=True)


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


def bench_spec(target_mb: float = 320, base_spec: "ModelSpec | None" = None) -> ModelSpec:
    """``base_spec`` (default BENCH_SPEC) with enough layers (at least its own) for the file to reach target_mb."""
    base_spec = base_spec or BENCH_SPEC
    base = dataclasses.replace(base_spec, n_layer=1)
    plan = tensor_plan(base)
    per_layer = sum(_tensor_nbytes(t) for t in plan if t.name.startswith("blk."))
    fixed = sum(_tensor_nbytes(t) for t in plan if not t.name.startswith("blk."))
    n_layer = math.ceil((target_mb * 1e6 - fixed) / per_layer)
    return dataclasses.replace(base_spec, n_layer=max(base_spec.n_layer, n_layer))


def build_model(spec: ModelSpec, out_path: str | os.PathLike, seed: int = 0, force: bool = False,
                experts_last: bool = False) -> Path:
    """Write any ``spec`` to ``out_path`` with a progress bar (skipped if up to date)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    variant = "experts-last" if experts_last else "base"
    if not force and _is_up_to_date(out_path, spec, seed, variant):
        return out_path
    _write_gguf(spec, out_path, seed, progress=True, experts_last=experts_last)
    _write_card(_make_card(spec, out_path, seed, variant), out_path)
    return out_path


def build_bench_model(out_path: str | os.PathLike, target_mb: float = 320, seed: int = 0,
                      force: bool = False) -> Path:
    """Write the large qwen2moe-style benchmark model (Q8_0 weights) to ``out_path``.

    n_embd 1024, 60 experts top-4, n_ff_exp 128, at least 8 layers; layers are
    added until the file is about ``target_mb`` MB. Shows a tqdm progress bar.
    Skipped if the file is up to date (same spec and seed) unless ``force``.
    """
    spec = bench_spec(target_mb)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if not force and _is_up_to_date(out_path, spec, seed, "base"):
        return out_path
    _write_gguf(spec, out_path, seed, progress=True)
    _write_card(_make_card(spec, out_path, seed, "base"), out_path)
    return out_path
