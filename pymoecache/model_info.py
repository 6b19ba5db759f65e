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
    n_embd: int = 0                    # embedding width (sizes the KV cache for --cache-size auto)
    n_ctx_train: int = 0               # context the model was trained with

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
                slots = max(n, self.n_expert_used) * self.expert_bytes * self.n_moe_layer
                rows.append(("streamed, in memory", f"{_fmt_bytes(slots)} of slots + {_fmt_bytes(self.non_expert_bytes)} "
                             f"of other weights (+ KV cache and buffers)"
                             + (f"; streaming needs at least K = {self.n_expert_used} slots per layer"
                                if n < self.n_expert_used else "")))
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


class _Header:
    """The parts of a GGUF header model_info needs: scalar key/values and tensor infos.

    A small reader of the GGUF v2/v3 layout (magic, version, counts, key/values, tensor infos,
    aligned data). Arrays (the tokenizer's 30k+ strings) are skipped, not decoded, which makes
    this ~50x faster than gguf.GGUFReader on a model with a vocabulary.
    """

    _SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: Path):
        import mmap
        import struct

        self.path, self.size = path, path.stat().st_size
        self.unpack_from = struct.unpack_from
        self.calcsize = struct.calcsize
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.pos = 4
        version, n_tensors, n_kv = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version not in (2, 3) or n_tensors > self.size or n_kv > self.size:
            raise ModelFileError(f"{path} has an unsupported or damaged GGUF header (version {version}, "
                                 f"{n_tensors} tensors, {n_kv} keys)")
        self.kv: Dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.kv[key] = self._value(self._read("<I"))
        self.tensors = []  # (name, ggml type, n_elements, offset from the data start)
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            if n_dims > 8:
                raise ModelFileError(f"{path}: tensor {name!r} has {n_dims} dimensions: damaged header")
            n = 1
            for _ in range(n_dims):
                n *= self._read("<Q")
            self.tensors.append((name, self._read("<I"), n, self._read("<Q")))
        align = int(self.kv.get("general.alignment", 32) or 32)
        self.data_start = (self.pos + align - 1) // align * align
        self.buf.close()

    def _read(self, fmt: str):
        n = self.calcsize(fmt)
        if self.pos + n > self.size:
            raise ModelFileError(f"{self.path} is truncated inside its header")
        (v,) = self.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def _string(self) -> str:
        n = self._read("<Q")
        if self.pos + n > self.size:
            raise ModelFileError(f"{self.path} is truncated inside its header")
        v = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return v

    def _value(self, vtype: int):
        if vtype in self._SCALAR:
            return self._read(self._SCALAR[vtype])
        if vtype == self._STRING:
            return self._string()
        if vtype == self._ARRAY:  # skipped: model_info needs no array
            etype, count = self._read("<I"), self._read("<Q")
            if etype in self._SCALAR:
                self.pos += count * self.calcsize(self._SCALAR[etype])
            elif etype == self._STRING:
                for _ in range(count):
                    self.pos += 8 + self._read("<Q")
            else:
                for _ in range(count):
                    self._value(etype)
            if self.pos > self.size:
                raise ModelFileError(f"{self.path} is truncated inside its header")
            return None
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype}: damaged header")


def model_info(path: "os.PathLike[str] | str") -> ModelInfo:
    """Read a GGUF header and describe the model; raise ModelFileError for a bad file.

    >>> model_info("missing.gguf")
    Traceback (most recent call last):
    ...
    FileNotFoundError: model file not found: missing.gguf
    """
    import gguf  # type sizes only; imported here: reading a header must not need the native library

    p = check_gguf_file(path)
    h = _Header(p)

    def kv(key: str, default=None):
        v = h.kv.get(key)
        return default if v is None else v

    def n_bytes(ggml_type: int, n_elements: int) -> int:
        try:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ModelFileError(f"{p}: unknown ggml tensor type {ggml_type}") from None
        return n_elements // block * size

    tensors = [(name, t, h.data_start + off, n_bytes(t, n)) for name, t, n, off in h.tensors]
    arch = kv("general.architecture")
    if not arch:
        raise ModelFileError(f"{p} has no general.architecture key: not a llama.cpp model")
    file_bytes = p.stat().st_size
    end = max((start + size for _, _, start, size in tensors), default=0)
    if end > file_bytes:
        raise ModelFileError(f"{p} is truncated: its tensors need {end} bytes, the file has {file_bytes}")

    n_expert = int(kv(f"{arch}.expert_count", 0) or 0)
    per_layer: Dict[int, int] = {}
    types = set()
    for name, ggml_type, _, size in tensors:
        m = _EXPS_RE.match(name)
        if m:
            il = int(m.group(1))
            per_layer[il] = per_layer.get(il, 0) + size
            types.add(gguf.GGMLQuantizationType(ggml_type).name)
    moe_layers = sorted(per_layer)
    n_shared = int(kv(f"{arch}.expert_shared_count", 0) or 0)
    if n_shared == 0 and any("_shexp." in name for name, *_ in tensors):
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
        n_embd=int(kv(f"{arch}.embedding_length", 0) or 0),
        n_ctx_train=int(kv(f"{arch}.context_length", 0) or 0),
    )
