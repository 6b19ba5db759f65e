#!/usr/bin/env python3
"""real_size.py - a GGUF with the exact shape of a real MoE model, random weights, built in minutes.

    python scripts/real_size.py qwen3-30b-a3b               # 48 x 128 experts, Q4_K_M as llama-quantize lays it out
    python scripts/real_size.py mixtral-8x7b --layers 4     # the same shapes, 4 layers (where disk is short)
    python scripts/real_size.py deepseek-v2-lite            # 26 MoE layers x 64 experts + 2 shared, 6 used, MLA
    python scripts/real_size.py --list                      # the shapes, their sizes

The last line printed is the path of the file (models/_bench/real-SHAPE[-LN].gguf, git-ignored); a file already
built with the same shape, layers and seed is kept. What each file has is the real model's:

* hyperparameters (layers, widths, heads, head size, experts, experts used, context, rope, norm epsilon), under
  the architecture name llama.cpp's loader knows (qwen3moe, llama for Mixtral, olmoe, gpt-oss, deepseek2 with
  MLA, a dense first layer and shared experts for DeepSeek-V2-Lite; `--layers 1` drops the dense one), every tensor it
  asks for, by its name and shape (the pin's own model definitions load it: a missing or extra tensor is an error);
* the quantization mix llama-quantize writes: Q4_K_M (Q4_K; Q6_K for output, and for attn_v and ffn_down in the
  layers its use_more_bits picks; Q8_0 attn_k/attn_v and Q5_K attn_output where a model has 8 experts; F32 norms
  and routers) or MXFP4_MOE for gpt-oss (MXFP4 experts, Q8_0 other matrices);
* a real vocabulary of the real size, copied from llama.cpp's vocab-only GGUFs (Qwen's for qwen3, SentencePiece
  llama's for Mixtral, GPT-NeoX's for OLMoE: 50432 entries where OLMoE pads to 50304, Qwen's padded with reserved
  control tokens to gpt-oss's 201088).

The weights are random quantized blocks written directly (no F16 intermediate): the quantized values are
uniform, each block's scale set so that a matrix's weights have a standard deviation near 1/sqrt(its input
width), so every value is finite and activations stay bounded through the layers. The routers (F32) are
random normal: **routing is near uniform** over the experts, unlike a trained model's skewed, repetitive
choices. Hit rates measured on these files are a lower bound of what a cache keeps on the real model (LRU at
M of N slots keeps about M / N); the bytes read per token and the speeds under a memory cap are what the
real file's shapes cost. Say "random weights" beside every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from tools.synth.vocab import vocab_path  # noqa: E402

VERSION = 1  # bump when the bytes written change: a file of another version is built again
OUT_DIR = ROOT / "models" / "_bench"


@dataclasses.dataclass(frozen=True)
class Shape:
    """A real model's hyperparameters (as its GGUF carries them)."""
    arch: str              # llama.cpp's architecture name
    real: str              # the model it is the shape of
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int          # one expert's width
    n_ctx: int
    rope_base: float
    rms_eps: float
    vocab: str             # ggml-vocab-<vocab>.gguf of the pin
    n_vocab: int           # the real vocabulary size (the vocab is padded with control tokens to it)
    ftype: str             # "Q4_K_M" or "MXFP4_MOE"
    qk_norm: str = ""      # "head": per-head q/k norms (qwen3), "full": over all heads (olmoe)
    extra: Tuple[Tuple[str, object], ...] = ()  # further metadata keys (suffix after "<arch>."), e.g. gpt-oss' window
    # DeepSeek-V2's parts (0: none): dense layers first, shared experts, multi-head latent attention
    n_dense_lead: int = 0  # leading layers with a dense FFN instead of experts
    n_ff_dense: int = 0    # their FFN's width
    n_shared: int = 0      # shared experts per MoE layer (one FFN n_shared x n_ff_exp wide)
    mla: Tuple[int, int, int, int] = (0, 0, 0, 0)  # (kv_lora_rank, qk_nope, qk_rope, v_head_dim) of MLA heads


SHAPES: Dict[str, Shape] = {
    "qwen3-30b-a3b": Shape("qwen3moe", "Qwen3-30B-A3B", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx=40960, rope_base=1e6, rms_eps=1e-6,
                           vocab="qwen2", n_vocab=151936, ftype="Q4_K_M", qk_norm="head"),
    "mixtral-8x7b": Shape("llama", "Mixtral-8x7B", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
                          n_expert=8, n_expert_used=2, n_ff_exp=14336, n_ctx=32768, rope_base=1e6, rms_eps=1e-5,
                          vocab="llama-spm", n_vocab=32000, ftype="Q4_K_M"),
    "olmoe-1b-7b": Shape("olmoe", "OLMoE-1B-7B", n_layer=16, n_embd=2048, n_head=16, n_head_kv=16, head_dim=128,
                         n_expert=64, n_expert_used=8, n_ff_exp=1024, n_ctx=4096, rope_base=1e4, rms_eps=1e-5,
                         vocab="gpt-neox", n_vocab=50432, ftype="Q4_K_M", qk_norm="full"),
    "gpt-oss-20b": Shape("gpt-oss", "gpt-oss-20b", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
                         n_expert=32, n_expert_used=4, n_ff_exp=2880, n_ctx=131072, rope_base=150000.0, rms_eps=1e-5,
                         vocab="qwen2", n_vocab=201088, ftype="MXFP4_MOE",
                         extra=(("attention.sliding_window", 128), ("rope.scaling.type", "yarn"),
                                ("rope.scaling.factor", 32.0), ("rope.scaling.original_context_length", 4096))),
    # MLA as llama.cpp's converter writes it (one KV head of kv_lora + rope, K and V's up-projections split per
    # head); one dense layer first; 2 shared experts; expert rows of 1408 that Q4_K cannot hold (Q5_0 / Q8_0)
    "deepseek-v2-lite": Shape("deepseek2", "DeepSeek-V2-Lite", n_layer=27, n_embd=2048, n_head=16, n_head_kv=1,
                              head_dim=192, n_expert=64, n_expert_used=6, n_ff_exp=1408, n_ctx=163840,
                              rope_base=1e4, rms_eps=1e-6, vocab="deepseek-llm", n_vocab=102400, ftype="Q4_K_M",
                              n_dense_lead=1, n_ff_dense=10944, n_shared=2, mla=(512, 128, 64, 128),
                              extra=(("attention.q_lora_rank", 0), ("expert_weights_scale", 1.0),
                                     ("rope.scaling.type", "yarn"), ("rope.scaling.factor", 40.0),
                                     ("rope.scaling.original_context_length", 4096),
                                     ("rope.scaling.yarn_log_multiplier", 0.0707))),
}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: Tuple[int, ...]  # ggml order: ne[0] (the input width) first
    qtype: T
    kind: str = "matrix"    # "matrix" (quantized blocks), "norm" (ones), "router" / "bias" (random normal, F32)


def _use_more_bits(il: int, n: int) -> bool:
    """llama-quantize's choice of the layers that get more bits in attn_v and ffn_down (Q4_K_M)."""
    return il < n // 8 or il >= 7 * n // 8 or (il - n // 8) % 3 == 2


def _matrix_type(s: Shape, name: str, il: int, ne: Tuple[int, ...]) -> T:
    """The type llama-quantize gives matrix ``name`` of layer ``il`` (-1: not a layer's) for the shape's ftype."""
    if s.ftype == "MXFP4_MOE":
        return T.MXFP4 if len(ne) == 3 else T.Q8_0
    if name == "output.weight":
        return T.Q6_K
    t = T.Q4_K
    if ".attn_v." in name:
        t = T.Q8_0 if s.n_expert == 8 else T.Q6_K if _use_more_bits(il, s.n_layer) else T.Q4_K
    elif ".attn_k." in name and s.n_expert == 8:
        t = T.Q8_0
    elif ".attn_output." in name and s.n_expert == 8:
        t = T.Q5_K
    elif ".ffn_down" in name and _use_more_bits(il, s.n_layer):
        t = T.Q6_K
    if ne[0] % 256 and t in (T.Q4_K, T.Q5_K, T.Q6_K):  # (llama-quantize's fallbacks for rows a K-quant cannot hold)
        t = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}[t]
    return t


def tensors(s: Shape) -> List[Tensor]:
    """Every tensor of the shape, in file order (the layers' experts with their layer)."""
    out: List[Tensor] = []
    E, D, F, N = s.n_embd, s.head_dim, s.n_ff_exp, s.n_expert
    nq, nkv = s.n_head * D, s.n_head_kv * D

    def mat(name, il, *ne):
        out.append(Tensor(name, ne, _matrix_type(s, name, il, ne)))

    def vec(name, kind, *ne):
        out.append(Tensor(name, ne, T.F32, kind))

    mat("token_embd.weight", -1, E, s.n_vocab)
    vec("output_norm.weight", "norm", E)
    mat("output.weight", -1, E, s.n_vocab)
    for il in range(s.n_layer):
        b = f"blk.{il}"
        vec(f"{b}.attn_norm.weight", "norm", E)
        if s.arch == "deepseek2":
            _deepseek2_layer(s, il, mat, vec)
            continue
        mat(f"{b}.attn_q.weight", il, E, nq)
        mat(f"{b}.attn_k.weight", il, E, nkv)
        mat(f"{b}.attn_v.weight", il, E, nkv)
        mat(f"{b}.attn_output.weight", il, nq, E)
        if s.qk_norm:
            vec(f"{b}.attn_q_norm.weight", "norm", D if s.qk_norm == "head" else nq)
            vec(f"{b}.attn_k_norm.weight", "norm", D if s.qk_norm == "head" else nkv)
        if s.arch == "gpt-oss":
            vec(f"{b}.post_attention_norm.weight", "norm", E)
            vec(f"{b}.attn_sinks.weight", "bias", s.n_head)
            for n, w in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv), ("attn_output", E)):
                vec(f"{b}.{n}.bias", "bias", w)
            vec(f"{b}.ffn_gate_inp.bias", "bias", N)
            vec(f"{b}.ffn_gate_exps.bias", "bias", F, N)
            vec(f"{b}.ffn_up_exps.bias", "bias", F, N)
            vec(f"{b}.ffn_down_exps.bias", "bias", E, N)
        else:
            vec(f"{b}.ffn_norm.weight", "norm", E)
        vec(f"{b}.ffn_gate_inp.weight", "router", E, N)
        mat(f"{b}.ffn_gate_exps.weight", il, E, F, N)
        mat(f"{b}.ffn_up_exps.weight", il, E, F, N)
        mat(f"{b}.ffn_down_exps.weight", il, F, E, N)
    return out


def _deepseek2_layer(s: Shape, il: int, mat, vec) -> None:
    """One DeepSeek-V2 layer after its attn_norm: MLA (no q LoRA, as the Lite), then a dense FFN or the experts
    with the shared ones."""
    b, E, F, N = f"blk.{il}", s.n_embd, s.n_ff_exp, s.n_expert
    kv_lora, nope, rope, v = s.mla
    mat(f"{b}.attn_q.weight", il, E, s.n_head * (nope + rope))
    mat(f"{b}.attn_kv_a_mqa.weight", il, E, kv_lora + rope)
    vec(f"{b}.attn_kv_a_norm.weight", "norm", kv_lora)
    mat(f"{b}.attn_k_b.weight", il, nope, kv_lora, s.n_head)
    mat(f"{b}.attn_v_b.weight", il, kv_lora, v, s.n_head)
    mat(f"{b}.attn_output.weight", il, s.n_head * v, E)
    vec(f"{b}.ffn_norm.weight", "norm", E)
    if il < s.n_dense_lead:
        mat(f"{b}.ffn_gate.weight", il, E, s.n_ff_dense)
        mat(f"{b}.ffn_up.weight", il, E, s.n_ff_dense)
        mat(f"{b}.ffn_down.weight", il, s.n_ff_dense, E)
        return
    vec(f"{b}.ffn_gate_inp.weight", "router", E, N)
    mat(f"{b}.ffn_gate_exps.weight", il, E, F, N)
    mat(f"{b}.ffn_up_exps.weight", il, E, F, N)
    mat(f"{b}.ffn_down_exps.weight", il, F, E, N)
    mat(f"{b}.ffn_gate_shexp.weight", il, E, F * s.n_shared)
    mat(f"{b}.ffn_up_shexp.weight", il, E, F * s.n_shared)
    mat(f"{b}.ffn_down_shexp.weight", il, F * s.n_shared, E)


def nbytes(t: Tensor) -> int:
    block, size = GGML_QUANT_SIZES[t.qtype]
    return math.prod(t.shape) // block * size


# --- random quantized blocks with valid scales --------------------------------------------------------------
# each type: where its scales are, and what they are set to for a block of unit scale d = 1 (the other fields,
# the quantized values and the 6-bit or int8 sub-scales, stay random)

def _set_scale(blocks: np.ndarray, qtype: T, d: float) -> None:
    """Sets the scale fields of ``blocks`` ([n, bytes per block] uint8) for unit scale ``d``, centred weights."""
    f16 = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
    if qtype == T.Q4_K:        # d, dmin, scales[12], qs[128]: w = d * sc * q - dmin * m
        blocks[:, 0:2] = f16(d)
        blocks[:, 2:4] = f16(7.5 * d)
    elif qtype == T.Q5_K:      # d, dmin, scales[12], qh[32], qs[128]
        blocks[:, 0:2] = f16(d)
        blocks[:, 2:4] = f16(15.5 * d)
    elif qtype == T.Q6_K:      # ql[128], qh[64], scales[16] (int8), d: w = d * sc * (q - 32)
        blocks[:, 208:210] = f16(d)
    elif qtype in (T.Q8_0, T.Q5_0):  # d, then the values (int8; 5-bit less 16)
        blocks[:, 0:2] = f16(d)
    elif qtype == T.Q5_1:      # d, m, qh, qs: w = d * q + m
        blocks[:, 0:2] = f16(d)
        blocks[:, 2:4] = f16(-15.5 * d)
    elif qtype == T.MXFP4:     # e (E8M0: 2^(e - 127)), then 32 4-bit values
        blocks[:, 0] = np.uint8(max(1, min(254, 127 + round(math.log2(d)))))
    else:
        raise ValueError(f"no random blocks for {qtype.name}")


_UNIT_STD: Dict[T, float] = {}


def _unit_std(qtype: T, pool: np.ndarray) -> float:
    """The standard deviation of random blocks of ``qtype`` at unit scale (measured once, by gguf's dequantizer)."""
    if qtype not in _UNIT_STD:
        block, size = GGML_QUANT_SIZES[qtype]
        sample = pool[: 512 * size].reshape(512, size).copy()
        _set_scale(sample, qtype, 1.0)
        _UNIT_STD[qtype] = float(np.std(gguf.quants.dequantize(sample, qtype)))
    return _UNIT_STD[qtype]


def random_blocks(t: Tensor, pool: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes: the random pool from a random offset (each tensor its own stretch), the scales set
    for weights of standard deviation about 1/sqrt(ne[0])."""
    n = nbytes(t)
    out = np.empty(n, np.uint8)
    at, done = int(rng.integers(0, len(pool))), 0
    while done < n:
        k = min(n - done, len(pool) - at)
        out[done:done + k] = pool[at:at + k]
        done, at = done + k, 0
    size = GGML_QUANT_SIZES[t.qtype][1]
    _set_scale(out.reshape(-1, size), t.qtype, (1.0 / math.sqrt(t.shape[0])) / _unit_std(t.qtype, pool))
    return out


def small_tensor(t: Tensor, rng: np.random.Generator) -> np.ndarray:
    np_shape = tuple(reversed(t.shape))
    if t.kind == "norm":
        return np.ones(np_shape, np.float32)
    std = 1.0 if t.kind == "router" else 0.02
    return (rng.standard_normal(np_shape, dtype=np.float32) * np.float32(std))


# --- the file ----------------------------------------------------------------------------------------------

def _add_vocab(w: gguf.GGUFWriter, s: Shape) -> None:
    """The pin's vocabulary ``s.vocab`` (every tokenizer key, types unchanged), padded with reserved control
    tokens to ``s.n_vocab`` where the real model's is larger."""
    reader = gguf.GGUFReader(vocab_path(s.vocab))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            value = [bytes(field.parts[i]) for i in field.data] if sub == gguf.GGUFValueType.STRING \
                else list(field.contents())
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
                if len(value) > s.n_vocab:
                    raise ValueError(f"the {s.vocab} vocabulary has {len(value)} tokens, more than {s.n_vocab}")
                pad = s.n_vocab - len(value)
                value += ([f"<|reserved_{i}|>".encode() for i in range(pad)] if key.endswith("tokens") else
                          [int(gguf.TokenType.CONTROL)] * pad if key.endswith("token_type") else [0.0] * pad)
            w.add_key_value(key, value, main, sub_type=sub)
        elif main == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]), main)
        else:
            w.add_key_value(key, field.contents(), main)


def _add_hparams(w: gguf.GGUFWriter, s: Shape, name: str) -> None:
    a = s.arch
    w.add_name(name)
    w.add_file_type({"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "MXFP4_MOE": 38}[s.ftype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    kv_lora, nope, rope, v = s.mla
    if kv_lora:  # MLA: the cache holds one latent head of kv_lora + rope; the heads' own sizes are the _mla keys
        w.add_key_length(kv_lora + rope)
        w.add_value_length(kv_lora)
        w.add_uint32(f"{a}.attention.key_length_mla", nope + rope)
        w.add_uint32(f"{a}.attention.value_length_mla", v)
        w.add_uint32(f"{a}.attention.kv_lora_rank", kv_lora)
        w.add_rope_dimension_count(rope)
    else:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_feed_forward_length(s.n_ff_dense or s.n_ff_exp)  # (llama and olmoe read the expert's width here)
    if a in ("qwen3moe", "gpt-oss", "deepseek2"):
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.n_dense_lead:
        w.add_uint32(f"{a}.leading_dense_block_count", s.n_dense_lead)
    if s.n_shared:
        w.add_uint32(f"{a}.expert_shared_count", s.n_shared)
    for key, value in s.extra:
        if isinstance(value, str):
            w.add_string(f"{a}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{a}.{key}", value)
        else:
            w.add_uint32(f"{a}.{key}", value)


def _same_card(old: Optional[dict], new: dict) -> bool:
    """A file's card describes the shape asked: the same card, or one written before a field was added to Shape
    whose value here is its default (a field added for another shape does not rebuild an 18 GB file)."""
    if not isinstance(old, dict) or not isinstance(old.get("shape"), dict):
        return False
    defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(Shape)
                                      if f.default is not dataclasses.MISSING}))
    shape = {k: v for k, v in new["shape"].items() if k in old["shape"] or k not in defaults or v != defaults[k]}
    return {**old, "shape": old["shape"]} == {**new, "shape": shape}


def build(shape: str, layers: Optional[int] = None, seed: int = 0, out_dir: Path = OUT_DIR,
          progress: bool = True) -> Path:
    """The file of ``shape`` (``layers``: fewer layers of the same shapes), built unless one of the same shape,
    layers, seed and version is there. Written under a temporary name and renamed: an interrupted build leaves
    no file behind."""
    s = SHAPES[shape]
    if layers is not None:
        if not 1 <= layers <= s.n_layer:
            raise SystemExit(f"--layers must be 1 to {s.n_layer} for {shape}")
        # (at least one MoE layer: the dense lead shrinks first)
        s = dataclasses.replace(s, n_layer=layers, n_dense_lead=min(s.n_dense_lead, layers - 1))
    path = Path(out_dir) / (f"real-{shape}" + (f"-L{s.n_layer}" if s.n_layer != SHAPES[shape].n_layer else "")
                            + ".gguf")
    card = json.loads(json.dumps({"version": VERSION, "shape": dataclasses.asdict(s), "seed": seed}))  # (as read back)
    card_path = path.with_suffix(".json")
    if path.is_file() and card_path.is_file() and _same_card(json.loads(card_path.read_text()).get("card"), card):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = tensors(s)
    total = sum(nbytes(t) for t in plan)
    free = os.statvfs(path.parent).f_bavail * os.statvfs(path.parent).f_frsize
    if total > free - (1 << 30):
        raise SystemExit(f"{shape}: {total / 2**30:.1f} GiB to write, {free / 2**30:.1f} GiB free in {path.parent}: "
                         f"use --layers N (each layer is about {(total / s.n_layer) / 2**30:.2f} GiB)")
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, s.arch)
    _add_hparams(w, s, f"{s.real} shape, random weights" + (f", {s.n_layer} layers" if layers else ""))
    _add_vocab(w, s)
    for t in plan:
        np_shape = tuple(reversed(t.shape))
        if t.qtype == T.F32:
            w.add_tensor_info(t.name, np_shape, np.dtype(np.float32), nbytes(t))
        else:
            w.add_tensor_info(t.name, gguf.quant_shape_to_byte_shape(np_shape, t.qtype), np.dtype(np.uint8), nbytes(t),
                              raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, size=64 << 20, dtype=np.uint8)  # 64 MiB of random bytes, read from anywhere
    t0, done, said = time.monotonic(), 0, 0.0
    for t in plan:
        w.write_tensor_data(small_tensor(t, rng) if t.qtype == T.F32 else random_blocks(t, pool, rng))
        done += nbytes(t)
        if progress and (time.monotonic() - said > 0.5 or done == total):
            said = time.monotonic()
            dt = max(time.monotonic() - t0, 1e-6)
            print(f"\r{path.name}: {done / 2**30:6.2f} / {total / 2**30:.2f} GiB  {done / dt / 2**20:5.0f} MiB/s  ",
                  end="", file=sys.stderr, flush=True)
    w.close()
    if progress:
        print(file=sys.stderr)
    tmp.replace(path)
    card_path.write_text(json.dumps({"card": card, "bytes": path.stat().st_size,
                                     "seconds": round(time.monotonic() - t0, 1)}, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                 epilog="shapes: " + ", ".join(SHAPES))
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES), help="the real model whose shape to build")
    ap.add_argument("--layers", type=int, help="build this many layers of the same shapes (say so in every table)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    ap.add_argument("--list", action="store_true", help="print every shape and its size, build nothing")
    a = ap.parse_args(argv)
    if a.list or not a.shape:
        for name, s in SHAPES.items():
            plan = tensors(s)
            experts = sum(nbytes(t) for t in plan if "_exps.weight" in t.name)
            print(f"{name:15s} {s.arch:9s} {s.n_layer:3d} layers x {s.n_expert:3d} experts ({s.n_expert_used} used), "
                  f"{s.ftype:9s} {sum(nbytes(t) for t in plan) / 1e9:5.1f} GB, experts {experts / 1e9:5.1f} GB, "
                  f"one expert {experts / s.n_layer / s.n_expert / 2**20:.2f} MiB")
        return 0 if a.list else 2
    print(build(a.shape, a.layers, a.seed, a.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
