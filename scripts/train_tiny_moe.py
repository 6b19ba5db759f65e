#!/usr/bin/env python3
"""Train a small Mixture-of-Experts language model on Tiny Shakespeare and export it to GGUF.

Everything is deterministic for a given ``--seed`` and ``--steps`` (torch CPU, fixed thread
count): the tokenizer (sentencepiece BPE trained on the training slice), the batches, the
initialisation and the optimiser. ``--minutes`` is a safety budget: if the wall clock runs out
first, training stops early and the card says so (the run is then not reproducible bit for bit).

Data split: the last 10% of ``tinyshakespeare/input.txt`` (cut at a line start) is held out
and never trained on, nor used to train the tokenizer.

Presets (``--preset``):

* ``A``: qwen2moe layout (Qwen1.5-MoE-like): 60 routed experts, top-4, softmax without
  renormalisation, one sigmoid-gated shared expert, q/k/v biases, NEOX RoPE.
* ``B``: Mixtral layout (llama arch with experts): 8 experts, top-2, top-k weights renormalised,
  normal RoPE, no shared expert.
* ``C``: A's layout with every width a multiple of 256 (hidden 256, 32 routed experts of width
  256, top-4): llama.cpp's K-quants and IQ2/IQ3 types (256-element blocks) apply to its experts,
  so the low-bit miss path can be measured at 2-3 bits.
* ``D``: fine-grained like Qwen3-30B-A3B: 128 experts of width 256, top-8, softmax with the top-k
  weights renormalised, no shared expert (written as llama.cpp's llama arch with experts, whose
  router is exactly that); widths of 256 as in ``C``.

Both are written through tools/synth's GGUF writer (``export_trained``) with the
sentencepiece vocabulary as a llama-style SPM tokenizer, then checked: llama.cpp must tokenize
the held-out text exactly as sentencepiece does, and its logits must match PyTorch's.

Usage::

    python scripts/train_tiny_moe.py --preset A --out models/ --threads 1
    python scripts/train_tiny_moe.py --preset B --out models/ --threads 1

Needs torch (CPU build) and sentencepiece; they are not runtime dependencies of pymoecache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tools")]  # the package, and tools/synth/

DATA = (REPO / ".." / "shared" / "data" / "tinyshakespeare" / "input.txt").resolve()
HELDOUT_FRACTION = 0.10


@dataclass(frozen=True)
class Preset:
    name: str
    arch: str           # "qwen2moe" or "llama" (Mixtral layout)
    n_layer: int
    n_embd: int
    n_head: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int     # 0: no shared expert
    qkv_bias: bool
    norm_topk: bool     # renormalise the top-k weights (Mixtral) or not (Qwen)
    vocab: int = 2048
    ctx: int = 256      # training sequence length = GGUF context length
    batch: int = 16
    steps: int = 1200
    lr: float = 3e-3
    warmup: int = 100
    aux_coef: float = 0.01   # Switch-style load-balancing loss
    z_coef: float = 1e-3     # router z-loss
    rope_base: float = 10000.0
    eps: float = 1e-5


PRESETS = {
    "A": Preset(name="tiny-shakespeare-qwen2moe-60x4", arch="qwen2moe", n_layer=4, n_embd=192, n_head=6,
                n_expert=60, n_expert_used=4, n_ff_exp=64, n_ff_shexp=256, qkv_bias=True, norm_topk=False),
    "B": Preset(name="tiny-shakespeare-mixtral-8x2", arch="llama", n_layer=4, n_embd=192, n_head=6,
                n_expert=8, n_expert_used=2, n_ff_exp=384, n_ff_shexp=0, qkv_bias=False, norm_topk=True),
    # every width a multiple of 256, so K-quants and IQ2/IQ3 types apply to its experts as they are
    "C": Preset(name="tiny-shakespeare-qwen2moe-32x4-w256", arch="qwen2moe", n_layer=4, n_embd=256, n_head=8,
                n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff_shexp=512, qkv_bias=True, norm_topk=False),
    # fine-grained as Qwen3-30B-A3B is: 128 experts, 8 used, softmax then the top-k weights renormalised, no
    # shared expert; widths of 256 for the K-quants and IQ3 types (the llama arch with experts is that router)
    "D": Preset(name="tiny-shakespeare-fine-128x8-w256", arch="llama", n_layer=4, n_embd=256, n_head=8,
                n_expert=128, n_expert_used=8, n_ff_exp=256, n_ff_shexp=0, qkv_bias=False, norm_topk=True),
}


# --------------------------------------------------------------------------------------------
# data and tokenizer

def split_text(path: Path = DATA, fraction: float = HELDOUT_FRACTION) -> tuple[str, str, int]:
    """(train text, held-out text, held-out start offset in characters). The cut is at a line start."""
    text = path.read_text(encoding="utf-8")
    cut = int(len(text) * (1 - fraction))
    cut = text.index("\n", cut) + 1
    return text[:cut], text[cut:], cut


def train_tokenizer(train_text: str, vocab: int, prefix: Path, seed: int) -> None:
    import sentencepiece as spm

    prefix.parent.mkdir(parents=True, exist_ok=True)
    lines = [ln for ln in train_text.split("\n") if ln.strip()]
    tmp = prefix.with_suffix(".train.txt")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(tmp), model_prefix=str(prefix), vocab_size=vocab, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        minloglevel=2, shuffle_input_sentence=False)
    tmp.unlink()


def spm_vocab(model_file: Path) -> dict:
    """The sentencepiece model as llama.cpp's SPM tokenizer keys (tokens, scores, token types)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        if sp.is_unknown(i):
            t = 2
        elif sp.is_control(i):
            t = 3
        elif sp.is_byte(i):
            t = 6
        elif sp.is_unused(i):
            t = 5
        else:
            t = 1
        types.append(t)
    return {"tokens": tokens, "scores": scores, "token_types": types,
            "bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}


# --------------------------------------------------------------------------------------------
# model (mirrors llama.cpp's qwen2moe / llama graphs exactly)

def build_model(P: Preset):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + P.eps) * self.weight

    hd = P.n_embd // P.n_head
    inv_freq = P.rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def rope_tables(T):
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
        return torch.cos(ang).float(), torch.sin(ang).float()

    def apply_rope(x, cos, sin):
        # x [B, H, T, hd]
        if P.arch == "qwen2moe":          # NEOX: pairs (i, i + hd/2)
            x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
            return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]   # NORM: pairs (2i, 2i+1)
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            d = P.n_embd
            self.q = nn.Linear(d, d, bias=P.qkv_bias)
            self.k = nn.Linear(d, d, bias=P.qkv_bias)
            self.v = nn.Linear(d, d, bias=P.qkv_bias)
            self.o = nn.Linear(d, d, bias=False)

        def forward(self, x, cos, sin):
            B, T, D = x.shape
            q = self.q(x).view(B, T, P.n_head, hd).transpose(1, 2)
            k = self.k(x).view(B, T, P.n_head, hd).transpose(1, 2)
            v = self.v(x).view(B, T, P.n_head, hd).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(B, T, D))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            E, D, Fx = P.n_expert, P.n_embd, P.n_ff_exp
            self.router = nn.Linear(D, E, bias=False)
            self.gate = nn.Parameter(torch.randn(E, Fx, D) / math.sqrt(D))
            self.up = nn.Parameter(torch.randn(E, Fx, D) / math.sqrt(D))
            self.down = nn.Parameter(torch.randn(E, D, Fx) / math.sqrt(Fx))
            if P.n_ff_shexp:
                self.sh_gate_inp = nn.Parameter(torch.zeros(D))
                self.sh_gate = nn.Linear(D, P.n_ff_shexp, bias=False)
                self.sh_up = nn.Linear(D, P.n_ff_shexp, bias=False)
                self.sh_down = nn.Linear(P.n_ff_shexp, D, bias=False)
            self.stats = None

        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            N, E, K = x.shape[0], P.n_expert, P.n_expert_used
            logits = self.router(x)
            probs = torch.softmax(logits, dim=-1)
            w, idx = torch.topk(probs, K, dim=-1)
            if P.norm_topk:
                w = w / w.sum(-1, keepdim=True)
            # tokens sorted by expert, then one small SwiGLU per expert on its own rows (no padding,
            # so an unbalanced router early in training costs no extra compute)
            flat = idx.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E)
            tok = order // K
            xs = x[tok]
            # unbind once: indexing the parameter per expert would make each expert's gradient a
            # full [E, F, D] tensor (128 experts: 20 s a step instead of 2)
            gate, up, down = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
            parts = []
            for e, (rows, n) in enumerate(zip(torch.split(xs, counts.tolist()), counts.tolist())):
                if n == 0:
                    continue
                h = F.silu(rows @ gate[e].t()) * (rows @ up[e].t())
                parts.append(h @ down[e].t())
            contrib = torch.cat(parts) * w.reshape(-1)[order, None]
            out = torch.zeros_like(x).index_add_(0, tok, contrib)
            if P.n_ff_shexp:
                g = torch.sigmoid(x @ self.sh_gate_inp)[:, None]
                out = out + g * self.sh_down(F.silu(self.sh_gate(x)) * self.sh_up(x))
            # load balancing (Switch): E * sum_e f_e * P_e; router z-loss
            f = counts.float() / (N * K)
            aux = E * (f * probs.mean(0)).sum()
            z = torch.logsumexp(logits, -1).pow(2).mean()
            self.stats = (aux, z, counts.detach())
            return out.reshape(shape)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm = RMSNorm(P.n_embd)
            self.attn = Attention()
            self.ffn_norm = RMSNorm(P.n_embd)
            self.moe = MoE()

        def forward(self, x, cos, sin):
            x = x + self.attn(self.attn_norm(x), cos, sin)
            return x + self.moe(self.ffn_norm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embd = nn.Embedding(P.vocab, P.n_embd)
            nn.init.normal_(self.embd.weight, std=0.02 * math.sqrt(P.n_embd) / 4)
            self.blocks = nn.ModuleList(Block() for _ in range(P.n_layer))
            self.norm = RMSNorm(P.n_embd)
            self.out = nn.Linear(P.n_embd, P.vocab, bias=False)
            nn.init.normal_(self.out.weight, std=1 / math.sqrt(P.n_embd))
            for b in self.blocks:   # small residual branches at init
                nn.init.normal_(b.attn.o.weight, std=0.5 / math.sqrt(P.n_embd * 2 * P.n_layer))
                with torch.no_grad():
                    b.moe.down.mul_(0.5 / math.sqrt(2 * P.n_layer))

        def forward(self, ids):
            T = ids.shape[1]
            cos, sin = rope_tables(T)
            x = self.embd(ids)
            for b in self.blocks:
                x = b(x, cos, sin)
            return self.out(self.norm(x))

        def moe_losses(self):
            aux = sum(b.moe.stats[0] for b in self.blocks) / len(self.blocks)
            z = sum(b.moe.stats[1] for b in self.blocks) / len(self.blocks)
            return aux, z

    return Model()


def gguf_tensors(model, P: Preset) -> dict:
    """Weights under llama.cpp's tensor names, numpy arrays in numpy order (ggml shape reversed)."""
    t = {}

    def a(x):
        return x.detach().cpu().float().numpy().copy()

    t["token_embd.weight"] = a(model.embd.weight)
    t["output_norm.weight"] = a(model.norm.weight)
    t["output.weight"] = a(model.out.weight)
    for i, b in enumerate(model.blocks):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = a(b.attn_norm.weight)
        t[p + "attn_q.weight"] = a(b.attn.q.weight)
        t[p + "attn_k.weight"] = a(b.attn.k.weight)
        t[p + "attn_v.weight"] = a(b.attn.v.weight)
        if P.qkv_bias:
            t[p + "attn_q.bias"] = a(b.attn.q.bias)
            t[p + "attn_k.bias"] = a(b.attn.k.bias)
            t[p + "attn_v.bias"] = a(b.attn.v.bias)
        t[p + "attn_output.weight"] = a(b.attn.o.weight)
        t[p + "ffn_norm.weight"] = a(b.ffn_norm.weight)
        t[p + "ffn_gate_inp.weight"] = a(b.moe.router.weight)
        t[p + "ffn_gate_exps.weight"] = a(b.moe.gate)
        t[p + "ffn_up_exps.weight"] = a(b.moe.up)
        t[p + "ffn_down_exps.weight"] = a(b.moe.down)
        if P.n_ff_shexp:
            t[p + "ffn_gate_inp_shexp.weight"] = a(b.moe.sh_gate_inp)
            t[p + "ffn_gate_shexp.weight"] = a(b.moe.sh_gate.weight)
            t[p + "ffn_up_shexp.weight"] = a(b.moe.sh_up.weight)
            t[p + "ffn_down_shexp.weight"] = a(b.moe.sh_down.weight)
    return t


def model_spec(P: Preset):
    from synth import ModelSpec

    return ModelSpec(
        name=P.name, arch=P.arch, n_layer=P.n_layer, n_embd=P.n_embd, n_head=P.n_head, n_head_kv=P.n_head,
        n_ctx=P.ctx, n_ff=0, n_expert=P.n_expert, n_expert_used=P.n_expert_used, n_ff_exp=P.n_ff_exp,
        n_ff_shexp=P.n_ff_shexp, n_expert_shared=0, gating="softmax", n_expert_groups=0, n_group_used=0,
        n_dense_lead=0, expert_weights_norm=P.norm_topk, expert_weights_scale=0.0,
        attn_qkv_bias=P.qkv_bias, tie_output=False, q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0,
        qk_rope_head_dim=0, v_head_dim=0, embd_type="F16", weight_type="F16", embd_std=0.0, output_std=0.0,
        router_std=0.0, probs_bias_std=0.0, rms_eps=P.eps, rope_freq_base=P.rope_base, vocab="custom")


# --------------------------------------------------------------------------------------------
# training and evaluation

def lr_at(step: int, P: Preset) -> float:
    if step < P.warmup:
        return P.lr * (step + 1) / P.warmup
    frac = (step - P.warmup) / max(1, P.steps - P.warmup)
    return P.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def heldout_eval(model, P: Preset, ids: np.ndarray, bos: int, max_chunks: int | None = None):
    """Perplexity on chunks of ctx tokens with the first token replaced by BOS (as
    pymoecache.evaluate.perplexity does), expert-usage counts per layer."""
    import torch

    n = len(ids) // P.ctx
    if max_chunks:
        n = min(n, max_chunks)
    chunks = torch.tensor(ids[:n * P.ctx].reshape(n, P.ctx).astype(np.int64))
    chunks[:, 0] = bos
    total, count = 0.0, 0
    usage = np.zeros((P.n_layer, P.n_expert), dtype=np.int64)
    model.eval()
    with torch.no_grad():
        for i in range(0, n, 8):
            x = chunks[i:i + 8]
            logits = model(x)
            lp = torch.log_softmax(logits[:, :-1].double(), -1)
            total += float(-lp.gather(-1, x[:, 1:, None]).sum())
            count += x[:, 1:].numel()
            for il, b in enumerate(model.blocks):
                usage[il] += b.moe.stats[2].numpy()
    model.train()
    nll = total / count
    return math.exp(nll), nll, count, usage


def usage_entropy(usage: np.ndarray) -> dict:
    p = usage / usage.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    E = usage.shape[1]
    return {"entropy_nats_per_layer": [round(float(x), 4) for x in h],
            "max_entropy_nats": round(math.log(E), 4),
            "normalised_per_layer": [round(float(x / math.log(E)), 4) for x in h],
            "min_share_per_layer": [round(float(x), 5) for x in p.min(axis=1)],
            "max_share_per_layer": [round(float(x), 5) for x in p.max(axis=1)]}


def unigram_ppl(train_ids: np.ndarray, held_ids: np.ndarray, vocab: int) -> float:
    """Add-one smoothed unigram model fitted on the training tokens, scored on held-out tokens."""
    c = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    lp = np.log(c / c.sum())
    return float(np.exp(-lp[held_ids].mean()))


def train(P: Preset, out_dir: Path, seed: int, threads: int, minutes: float, log_every: int = 50) -> dict:
    import sentencepiece as spm
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)

    train_text, held_text, cut = split_text()
    tok_prefix = out_dir / f"tiny-shakespeare-spm{P.vocab}"
    if not tok_prefix.with_suffix(".model").is_file():
        train_tokenizer(train_text, P.vocab, tok_prefix, seed)
    sp = spm.SentencePieceProcessor(model_file=str(tok_prefix.with_suffix(".model")))
    train_ids = np.array(sp.encode(train_text), dtype=np.int32)
    held_ids = np.array(sp.encode(held_text), dtype=np.int32)
    print(f"{P.name}: {len(train_ids)} training tokens, {len(held_ids)} held-out tokens", flush=True)

    model = build_model(P)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=P.lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0 = time.time()
    steps_done, stopped_early = 0, False
    log = []
    for step in range(P.steps):
        if minutes and time.time() - t0 > minutes * 60:
            stopped_early = True
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, P)
        starts = rng.integers(0, len(train_ids) - P.ctx, size=P.batch)
        x = torch.from_numpy(np.stack([train_ids[s:s + P.ctx] for s in starts]).astype(np.int64))
        x[:, 0] = sp.bos_id()
        logits = model(x)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, P.vocab), x[:, 1:].reshape(-1))
        aux, z = model.moe_losses()
        loss = ce + P.aux_coef * aux + P.z_coef * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        if step % log_every == 0 or step == P.steps - 1:
            el = time.time() - t0
            tps = steps_done * P.batch * P.ctx / el
            print(f"step {step:5d} ce {ce.item():.4f} aux {aux.item():.3f} z {z.item():.2f} "
                  f"lr {lr_at(step, P):.2e} {el:7.1f}s {tps:6.0f} tok/s", flush=True)
            log.append({"step": step, "ce": round(ce.item(), 4), "aux": round(aux.item(), 4), "s": round(el, 1)})
    wall = time.time() - t0

    ppl, nll, n_scored, usage = heldout_eval(model, P, held_ids, sp.bos_id())
    uni = unigram_ppl(train_ids, held_ids, P.vocab)
    print(f"held-out ppl {ppl:.3f} (unigram {uni:.1f}), {wall:.0f}s", flush=True)
    card = {
        "name": P.name,
        "file": f"{P.name}.gguf",
        "what": "trained MoE language model (not a random-weight fixture)",
        "arch": P.arch,
        "layout": layout(P),
        "preset": asdict(P),
        "n_params": int(n_params),
        "n_params_active_per_token": int(active_params(P)),
        "tokenizer": {"kind": "sentencepiece BPE, byte fallback, identity normalisation, dummy prefix",
                      "vocab": P.vocab, "file": tok_prefix.with_suffix(".model").name,
                      "trained_on": "the training slice only"},
        "data": {"corpus": "../shared/data/tinyshakespeare/input.txt (Tiny Shakespeare, public domain text)",
                 "train": f"characters [0, {cut})", "held_out": f"characters [{cut}, end): the last "
                 f"{HELDOUT_FRACTION:.0%}, cut at a line start; never trained on",
                 "train_tokens": int(len(train_ids)), "held_out_tokens": int(len(held_ids))},
        "training": {"seed": seed, "steps": steps_done, "steps_planned": P.steps, "stopped_early_by_time_budget":
                     stopped_early, "batch": P.batch, "seq_len": P.ctx,
                     "tokens_seen": steps_done * P.batch * P.ctx,
                     "epochs": round(steps_done * P.batch * P.ctx / len(train_ids), 2),
                     "wall_s": round(wall, 1), "threads": threads, "torch": torch.__version__,
                     "optimizer": f"AdamW lr {P.lr} (warmup {P.warmup}, cosine to 10%), betas (0.9, 0.95), wd 0.1, "
                                  "grad clip 1.0",
                     "losses": f"cross-entropy + {P.aux_coef} x Switch load-balancing loss + {P.z_coef} x router z-loss",
                     "log": log},
        "held_out": {"ppl_torch_f32": round(ppl, 4), "nll_torch_f32": round(nll, 5),
                     "tokens_scored": n_scored, "chunk": f"{P.ctx} tokens, first token replaced by BOS, not scored",
                     "unigram_ppl": round(uni, 2),
                     "unigram": "add-one smoothed token frequencies of the training slice"},
        "expert_usage_held_out": usage_entropy(usage),
    }
    return card, model, sp, held_ids, train_ids


def layout(P: Preset) -> str:
    if P.arch == "qwen2moe":
        return f"Qwen1.5-MoE-like: many small experts, top-{P.n_expert_used}, gated shared expert"
    if P.n_expert >= 64:
        return (f"Qwen3-MoE-like: {P.n_expert} fine-grained experts, top-{P.n_expert_used}, "
                "renormalised top-k weights, no shared expert")
    return f"Mixtral-like: few large experts, top-{P.n_expert_used}, renormalised top-k weights"


def active_params(P: Preset) -> int:
    d = P.n_embd
    attn = 4 * d * d + (3 * d if P.qkv_bias else 0)
    moe = P.n_expert_used * 3 * d * P.n_ff_exp + P.n_expert * d + (3 * d * P.n_ff_shexp + d if P.n_ff_shexp else 0)
    return P.n_layer * (attn + moe + 2 * d) + 2 * P.vocab * d + d


# --------------------------------------------------------------------------------------------
# export and checks

def export(P: Preset, model, out_dir: Path, tok_model: Path, weight_type: str = "F16",
           path: Path | None = None) -> Path:
    from synth import export_trained

    spec = replace(model_spec(P), weight_type=weight_type, embd_type=weight_type)
    path = path or out_dir / f"{P.name}.gguf"
    export_trained(spec, gguf_tensors(model, P), spm_vocab(tok_model), path)
    return path


def check_export(P: Preset, model, sp, gguf_path: Path, held_text: str, n_tok: int = 64) -> dict:
    """llama.cpp tokenization of the held-out text == sentencepiece's; llama.cpp logits vs torch's."""
    import torch

    import pymoecache  # noqa: F401  (points llama_cpp at our libllama)
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_path), n_ctx=P.ctx, n_batch=P.ctx, logits_all=True, verbose=False,
                          n_threads=1)
    ref = sp.encode(held_text)
    got = llm.tokenize(held_text.encode("utf-8"), add_bos=False)
    tok_equal = list(got) == list(ref)
    first_diff = None
    if not tok_equal:
        first_diff = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    ids = [sp.bos_id()] + ref[:n_tok - 1]
    llm.reset()
    llm.eval(ids)
    lc = np.array(llm.scores[:len(ids)], dtype=np.float64)
    model.eval()
    with torch.no_grad():
        tl = model(torch.tensor([ids])).double().numpy()[0]
    model.train()
    llm.close()
    rel = float(np.abs(lc - tl).max() / np.abs(tl).max())
    return {"tokenization_equal_on_held_out": tok_equal, "held_out_tokens": len(ref),
            "first_token_mismatch": first_diff, "logits_tokens_compared": len(ids),
            "logits_max_abs_diff": float(np.abs(lc - tl).max()),
            "logits_max_rel_diff": rel,
            "argmax_agreement": float((lc.argmax(-1) == tl.argmax(-1)).mean())}


def llama_cpp_heldout(gguf_path: Path, P: Preset, held_ids: np.ndarray) -> dict:
    """Held-out perplexity of the exported file through pymoecache (llama.cpp), stock routing."""
    from pymoecache.evaluate import load_for_eval, perplexity

    llm = load_for_eval(gguf_path, 1.0, P.ctx, n_threads=1)
    try:
        res = perplexity(llm, list(map(int, held_ids)), P.ctx, progress=False)
    finally:
        llm.close()
    return {"ppl": round(res.ppl, 4), "nll": round(res.nll, 5), "tokens_scored": res.n_tokens, "chunks": res.n_chunks}


def sample(gguf_path: Path, prompt: str = "ROMEO:", n: int = 80) -> str:
    import pymoecache

    llm = pymoecache.Llama(str(gguf_path), verbose=False, n_ctx=256, seed=0, n_threads=1)
    try:
        return llm(prompt, max_tokens=n, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()


def write_md(card: dict, path: Path) -> None:
    P = card["preset"]
    h, tr, u = card["held_out"], card["training"], card["expert_usage_held_out"]
    lines = [
        f"# {card['name']}", "",
        f"{card['what']}. {card['layout']}.", "",
        f"- file: `{card['file']}` ({card.get('file_size', 0) / 1e6:.1f} MB, {card.get('weight_type', '')}), "
        f"sha256 `{card.get('sha256', '')[:16]}...`",
        f"- architecture: llama.cpp `{card['arch']}`, {P['n_layer']} layers, d={P['n_embd']}, {P['n_head']} heads, "
        f"{P['n_expert']} routed experts (width {P['n_ff_exp']}), top-{P['n_expert_used']}"
        + (f", shared expert width {P['n_ff_shexp']}" if P['n_ff_shexp'] else "") + f", context {P['ctx']}",
        f"- parameters: {card['n_params'] / 1e6:.2f} M total, {card['n_params_active_per_token'] / 1e6:.2f} M active per token",
        f"- tokenizer: {card['tokenizer']['kind']}, {P['vocab']} tokens (`{card['tokenizer']['file']}`)",
        f"- data: {card['data']['corpus']}; train {card['data']['train']} ({card['data']['train_tokens']} tokens), "
        f"held out {card['data']['held_out']} ({card['data']['held_out_tokens']} tokens)",
        f"- training: {tr['steps']} steps x {tr['batch']} x {tr['seq_len']} tokens = {tr['tokens_seen']} tokens "
        f"({tr['epochs']} epochs), {tr['wall_s'] / 60:.1f} min on {tr['threads']} CPU thread(s), seed {tr['seed']}, "
        f"torch {tr['torch']}; {tr['losses']}",
        f"- held-out perplexity: {h['ppl_torch_f32']:.2f} (PyTorch, f32), "
        f"{card.get('held_out_llama_cpp', {}).get('ppl', float('nan')):.2f} (llama.cpp, this file); "
        f"unigram baseline {h['unigram_ppl']:.1f}",
        f"- expert usage entropy on held-out (normalised to log N): "
        + ", ".join(f"{x:.3f}" for x in u["normalised_per_layer"]),
        f"- export check: {json.dumps(card.get('export_check', {}))}",
        "", "Greedy sample (`ROMEO:`):", "", "```", card.get("sample", ""), "```", "",
        "Reproduce: `" + card.get("command", "") + "`", "",
    ]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", type=Path, default=REPO / "models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--minutes", type=float, default=70.0, help="wall-clock safety budget in minutes (default 70)")
    ap.add_argument("--ckpt-dir", default=os.path.expanduser("~/.cache/pymoecache/train"),
                    help="where the PyTorch checkpoint is kept (default ~/.cache/pymoecache/train)")
    ap.add_argument("--export-only", action="store_true", help="export the checkpoint of a finished run")
    ap.add_argument("--measure", type=int, default=0, help="only time this many steps and exit")
    args = ap.parse_args(argv)

    P = PRESETS[args.preset]
    if args.steps is not None:
        P = replace(P, steps=args.steps)
    if args.measure:
        P = replace(P, steps=args.measure)
        card, *_ = train(P, args.out / "_measure", args.seed, args.threads, 0, log_every=1)
        return 0
    import torch

    ckpt = Path(args.ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    if args.export_only:   # re-export a finished training run (no retraining)
        import sentencepiece as spm

        card = json.loads((ckpt / f"{P.name}.card.json").read_text())
        model = build_model(P)
        model.load_state_dict(torch.load(ckpt / f"{P.name}.pt"))
        sp = spm.SentencePieceProcessor(model_file=str(args.out / card["tokenizer"]["file"]))
        held_ids = np.array(sp.encode(split_text()[1]), dtype=np.int32)
    else:
        card, model, sp, held_ids, train_ids = train(P, args.out, args.seed, args.threads, args.minutes)
        torch.save(model.state_dict(), ckpt / f"{P.name}.pt")
        (ckpt / f"{P.name}.card.json").write_text(json.dumps(card, indent=1))
    tok_model = args.out / card["tokenizer"]["file"]
    _, held_text, _ = split_text()
    # exactness check on an F32 export, then the F16 file that is shipped
    f32 = export(P, model, args.out, tok_model, "F32", path=args.out / f"{P.name}.f32.gguf.tmp")
    card["export_check_f32"] = check_export(P, model, sp, f32, held_text)
    f32.unlink()
    path = export(P, model, args.out, tok_model, "F16")
    card["export_check"] = check_export(P, model, sp, path, held_text)
    card["held_out_llama_cpp"] = llama_cpp_heldout(path, P, held_ids)
    card["sample"] = sample(path)
    from synth import _sha256

    card["weight_type"] = "F16 matrices, F32 norms/router/biases"
    card["file_size"] = path.stat().st_size
    card["sha256"] = _sha256(path)
    card["command"] = (f"python scripts/train_tiny_moe.py --preset {args.preset} --seed {args.seed} "
                       f"--steps {P.steps} --threads {args.threads}")
    (args.out / f"{P.name}.json").write_text(json.dumps(card, indent=1) + "\n")
    write_md(card, args.out / f"{P.name}.md")
    print(json.dumps({k: card[k] for k in ("held_out", "held_out_llama_cpp", "export_check_f32", "export_check")},
                     indent=1))
    print(card["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
