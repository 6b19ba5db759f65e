"""Tensor layouts per architecture: what llama.cpp's loader expects, with shapes and init."""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

from .spec import F32, ModelSpec
from .vocab import vocab_size


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
