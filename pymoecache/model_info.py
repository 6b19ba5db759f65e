"""What a GGUF file holds, from its header alone (no weights loaded): architecture, layers,
experts, bytes per expert, and checks that turn a bad file into a clear error.

>>> info = model_info(default_model_path())          # doctest: +SKIP
>>> info.n_expert, info.n_expert_used                  # doctest: +SKIP
(60, 4)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

GGUF_MAGIC = b"GGUF"
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.")
_GATING = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax-weight", 4: "sqrt-softplus"}


class ModelFileError(ValueError):
    """The file is missing, not a GGUF file, truncated or otherwise unusable."""


@dataclass
class ModelInfo:
    path: str
    arch: str
    name: str
    file_bytes: int
    n_layer: int
    moe_layers: List[int]              # layers with routed experts
    n_expert: int                      # N routed experts per MoE layer (0: dense model)
    n_expert_used: int                 # K
    n_expert_shared: int               # shared experts (always run, never cached)
    gating: str                        # softmax / sigmoid / ...
    n_expert_groups: int
    expert_bytes: float                # bytes of one routed expert (gate+up+down) in one layer
    expert_bytes_total: int            # all routed experts of all layers
    expert_types: List[str] = field(default_factory=list)  # ggml types of the expert tensors

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 1 and bool(self.moe_layers)

    @property
    def n_moe_layer(self) -> int:
        return len(self.moe_layers)

    @property
    def expert_share(self) -> float:
        """Share of the file's bytes in routed experts."""
        return self.expert_bytes_total / self.file_bytes if self.file_bytes else 0.0

    @property
    def non_expert_bytes(self) -> int:
        return self.file_bytes - self.expert_bytes_total

    def cache_size_for_budget(self, budget_bytes: int) -> int:
        """Experts per layer whose bytes, over all MoE layers, fit in ``budget_bytes`` (at most N)."""
        if not self.is_moe or self.expert_bytes <= 0:
            return 0
        return int(min(self.n_expert, budget_bytes // (self.expert_bytes * self.n_moe_layer)))

    def table(self, ram_budget: Optional[int] = None) -> str:
        rows = [
            ("file", f"{self.path}"),
            ("architecture", f"{self.arch}  ({self.name})" if self.name else self.arch),
            ("file size", _fmt_bytes(self.file_bytes)),
            ("layers", f"{self.n_layer} ({self.n_moe_layer} MoE)"),
        ]
        if self.is_moe:
            rows += [
                ("routed experts N", str(self.n_expert)),
                ("experts per token K", str(self.n_expert_used)),
                ("shared experts", str(self.n_expert_shared)),
                ("gating", self.gating + (f", {self.n_expert_groups} groups" if self.n_expert_groups > 1 else "")),
                ("expert tensor types", ", ".join(self.expert_types)),
                ("bytes per expert", _fmt_bytes(self.expert_bytes)),
                ("bytes per layer (experts)", _fmt_bytes(self.expert_bytes * self.n_expert)),
                ("routed experts, all layers", f"{_fmt_bytes(self.expert_bytes_total)} ({100 * self.expert_share:.1f}% of the file)"),
                ("everything else", _fmt_bytes(self.non_expert_bytes)),
            ]
            if ram_budget is not None:
                n = self.cache_size_for_budget(ram_budget)
                rows.append((f"cache size for {_fmt_bytes(ram_budget)}", f"{n} of {self.n_expert} experts per layer"))
        else:
            rows.append(("experts", "none: dense model, no MoE layers to cache"))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def check_gguf_file(path: "os.PathLike[str] | str") -> Path:
    """Raise ModelFileError (or FileNotFoundError) unless ``path`` looks like a GGUF file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelFileError(f"{p} is a directory, not a GGUF model file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    return p


def model_info(path: "os.PathLike[str] | str") -> ModelInfo:
    """Read a GGUF header and describe the model; raise ModelFileError for a bad file.

    >>> model_info("missing.gguf")
    Traceback (most recent call last):
    ...
    FileNotFoundError: model file not found: missing.gguf
    """
    import gguf  # imported here: reading a header must not need the native library

    p = check_gguf_file(path)
    try:
        r = gguf.GGUFReader(str(p), "r")
    except Exception as e:  # gguf raises ValueError/IndexError/... on damaged headers
        raise ModelFileError(f"{p} is not a readable GGUF file ({type(e).__name__}: {e})") from None

    def kv(key: str, default=None):
        f = r.fields.get(key)
        if f is None or not f.data:
            return default
        v = f.parts[f.data[0]]
        if f.types and f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(v).decode("utf-8", "replace")
        return v.tolist()[0] if hasattr(v, "tolist") else v

    arch = kv("general.architecture")
    if not arch:
        raise ModelFileError(f"{p} has no general.architecture key: not a llama.cpp model")
    file_bytes = p.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in r.tensors), default=0)
    if end > file_bytes:
        raise ModelFileError(f"{p} is truncated: its tensors need {end} bytes, the file has {file_bytes}")

    n_expert = int(kv(f"{arch}.expert_count", 0) or 0)
    per_layer: Dict[int, int] = {}
    types = set()
    for t in r.tensors:
        m = _EXPS_RE.match(t.name)
        if m:
            il = int(m.group(1))
            per_layer[il] = per_layer.get(il, 0) + int(t.n_bytes)
            types.add(t.tensor_type.name)
    moe_layers = sorted(per_layer)
    n_shared = int(kv(f"{arch}.expert_shared_count", 0) or 0)
    if n_shared == 0 and any("_shexp." in t.name for t in r.tensors):
        n_shared = 1  # qwen2moe stores one shared expert without a count key
    total = sum(per_layer.values())
    expert_bytes = total / (len(moe_layers) * n_expert) if moe_layers and n_expert else 0.0
    return ModelInfo(
        path=str(p),
        arch=arch,
        name=kv("general.name", "") or "",
        file_bytes=file_bytes,
        n_layer=int(kv(f"{arch}.block_count", 0) or 0),
        moe_layers=moe_layers,
        n_expert=n_expert,
        n_expert_used=int(kv(f"{arch}.expert_used_count", 0) or 0),
        n_expert_shared=n_shared,
        gating=_GATING.get(int(kv(f"{arch}.expert_gating_func", 1 if n_expert else 0) or 0), "?"),
        n_expert_groups=int(kv(f"{arch}.expert_group_count", 1) or 1),
        expert_bytes=expert_bytes,
        expert_bytes_total=total,
        expert_types=sorted(types),
    )
