"""The model specs: every hyperparameter of a synthetic model, the test fixtures, the benchmark spec."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf


# Bump when the generator changes in a way that changes the output bytes;
# it is part of the spec hash, so stale files get rebuilt.
SYNTH_VERSION = 1

REPO_ROOT = Path(__file__).resolve().parents[2]  # tools/synth/spec.py -> the checkout
VOCAB_DIR = REPO_ROOT / "vendor" / "llama.cpp" / "models"

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
