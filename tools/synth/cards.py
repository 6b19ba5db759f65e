"""Model cards: a JSON next to each file with the spec, seed, size, sha256 and tensor types; up-to-date checks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import gguf

from .spec import ModelSpec, SYNTH_VERSION
from .vocab import vocab_path


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
