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
from typing import Dict, List, Optional, Tuple

from .errors import ModelFileError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"
# the routed-expert tensors: .weight is the [n_in, n_out, n_expert] matrix the cache moves; llama.cpp
# also loads per-expert .bias [n_out, n_expert] (gpt-oss), .scale and .input_scale [n_expert]
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(\w+)$")
_TOKEN_TYPE_BYTE = 6     # llama_token_type: LLAMA_TOKEN_TYPE_BYTE
# tokenizer.ggml.model values whose vocabulary type turns byte tokens into text with
# token_to_byte, which aborts for them (GGML_ABORT in llama_vocab::impl::token_to_byte, reached
# while the vocab loads): WPM. (rwkv, test and plamo2 render byte tokens their own way.)
_NO_BYTE_TOKENS = frozenset({"bert"})
_GATING = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax-weight", 4: "sqrt-softplus"}

# llama.cpp's limits: beyond them it aborts (GGML_ASSERT) instead of failing the load
MAX_LAYERS = 512         # LLAMA_MAX_LAYERS (src/llama-hparams.h)
MAX_EXPERTS = 1024       # LLAMA_MAX_EXPERTS
MAX_DIMS = 4             # GGML_MAX_DIMS
MAX_NAME = 64            # GGML_MAX_NAME, with its terminating NUL
TENSOR_ALIGNMENT = 32    # ggml's CPU buffers: a tensor's bytes must start 32-byte aligned in the mapping
_IO_ALIGN = 4096         # MOECACHE_IO_ALIGN: direct I/O offsets, lengths and buffers
_IN_PLACE_MIN = 16 * 4096  # MOECACHE_IN_PLACE_MIN: expert tensors this large are read into padded slots in place
_INT64_MAX = 2**63 - 1
_ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")  # llama_rope_scaling_type_from_string
# architectures whose llama.cpp graph asserts rope.dimension_count == the attention head size
# (GGML_ASSERT(n_embd_head == n_rot) in vendor/llama.cpp/src/models/*.cpp, llama-cpp-python 0.3.36)
_FULL_ROPE_ARCHS = frozenset(
    "apertus arcee arctic baichuan chameleon codeshell cogvlm cohere2moe dbrx deci deepseek dots1 dream ernie4_5 "
    "ernie4_5-moe exaone exaone-moe exaone4 falcon granite granite_swa graniteswitch grok grovemoe hunyuan-moe "
    "hunyuan_vl hy_v3 internlm2 jais2 llada llada-moe llama llama4 maincoder mellum minimax-01 minimax-m2 mistral3 "
    "nemotron olmo olmo2 olmoe orion paddleocr pangu-embedded plamo pockettts qwen2 qwen2moe qwen2vl qwen3 qwen3moe "
    "qwen3vl qwen3vlmoe rnd1 seed_oss smallthinker smollm3 starcoder2 talkie xverse".split())


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
    n_embd: int = 0                    # embedding width
    n_embd_kv: int = 0                 # K and V elements of one token in one layer, KV heads x (key + value size):
                                       #   what llama.cpp's KV cache holds (0: unknown, 2 x n_embd is planned)
    n_ctx_train: int = 0               # context the model was trained with
    slot_bytes: float = 0.0            # memory of one expert's slot when streamed (0: expert_bytes): expert_bytes,
                                       #   plus a page per tensor read in place (direct I/O with no copy)
    input_bytes: int = 0               # the input layer (token_embd.*): llama.cpp keeps it on the CPU whatever -ngl says
    output_bytes: int = 0              # the output layer in the file (output.weight, output_norm.*): the first layer
                                       #   -ngl offloads
    output_tied_bytes: int = 0         # without output.weight, the copy of token_embd.weight the output layer's
                                       #   device gets (llama.cpp duplicates it there)

    @property
    def cache_bytes(self) -> float:
        """Memory one cached expert of one layer takes (a streamed slot; a slot is at least as large
        as the expert's bytes): what cache sizes in bytes are divided by."""
        return max(self.slot_bytes, self.expert_bytes)

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

    def dense_bytes(self, gpu_layers: int = 0) -> Tuple[int, int]:
        """(host, GPU) bytes of the non-expert weights with the last ``gpu_layers`` repeating layers on a
        GPU (pymoecache.plan.gpu_layers: -ngl N is the output layer and N - 1 of them): the input layer
        stays on the host, the output layer goes first, the repeating layers' share in proportion.

        >>> info = ModelInfo(path="m.gguf", arch="qwen2moe", name="", file_bytes=1000, n_layer=4, moe_layers=[0, 1, 2, 3],
        ...                  n_expert=8, n_expert_used=2, n_expert_shared=0, gating="softmax", n_expert_groups=0,
        ...                  expert_bytes=20, expert_bytes_total=640, input_bytes=100, output_bytes=100)
        >>> info.dense_bytes(0), info.dense_bytes(2), info.dense_bytes(4)   # 160 bytes in the 4 repeating layers
        ((360, 0), (180, 180), (100, 260))
        """
        dense = max(0, self.non_expert_bytes)
        n_gpu = min(max(gpu_layers, 0), self.n_layer)
        if n_gpu == 0:
            return dense, 0
        layers = int(max(0, dense - self.input_bytes - self.output_bytes) * n_gpu / max(self.n_layer, 1))
        return dense - self.output_bytes - layers, self.output_bytes + self.output_tied_bytes + layers

    def cache_size_for_budget(self, budget_bytes: int) -> int:
        """Experts per layer whose bytes, over all MoE layers, fit in ``budget_bytes`` (at most N)."""
        if not self.is_moe or self.expert_bytes <= 0:
            return 0
        return int(min(self.n_expert, budget_bytes // (self.cache_bytes * self.n_moe_layer)))

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
                slots = max(n, self.n_expert_used) * self.cache_bytes * self.n_moe_layer
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
    """Raise ModelFileError (ModelNotFoundError for a missing path) unless ``path`` is a regular
    file that starts like a GGUF file. FIFOs, devices and directories are refused without opening
    them, so a bad path never blocks."""
    import stat

    try:
        p = Path(os.fspath(path))
        if "\0" in str(p):
            raise ModelFileError(f"model path {str(p)!r} contains a NUL byte")
        st = p.stat()
    except FileNotFoundError:
        raise ModelNotFoundError(f"model file not found: {path}") from None
    except (OSError, TypeError, ValueError) as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"cannot open model file {path}: {getattr(e, 'strerror', None) or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFileError(f"{p} is a directory, not a GGUF model file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(f"{p} is not a regular file (a FIFO, device or socket): give a GGUF model file")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {p}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    return p


class _Array:
    """A GGUF array value, skipped: its element type and count only."""

    def __init__(self, etype: int, count: int):
        self.etype, self.count = etype, count


class _Header:
    """The parts of a GGUF header model_info needs: scalar key/values and tensor infos.

    A small reader of the GGUF v2/v3 layout (magic, version, counts, key/values, tensor infos,
    aligned data). Arrays (the tokenizer's 30k+ strings) are skipped, not decoded, which makes
    this ~50x faster than gguf.GGUFReader on a model with a vocabulary. Every read is bounds-
    checked; anything malformed raises ModelFileError.
    """

    _SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: Path):
        import mmap
        import struct

        self.path, self.size = path, path.stat().st_size
        self.unpack_from = struct.unpack_from
        self.calcsize = struct.calcsize
        if self.size < 24:
            raise ModelFileError(f"{path} is truncated inside its header ({self.size} bytes)")
        with open(path, "rb") as f:
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        finally:
            self.buf.close()

    def _bad(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: damaged GGUF header: {what}")

    def _parse(self) -> None:
        self.pos = 4
        version, n_tensors, n_kv = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version not in (2, 3):
            raise ModelFileError(f"{self.path}: unsupported GGUF version {version} (llama.cpp reads versions 2 and 3)")
        if n_tensors > self.size or n_kv > self.size:
            raise ModelFileError(f"{self.path} has a damaged or truncated GGUF header ({n_tensors} tensors and "
                                 f"{n_kv} keys in a file of {self.size} bytes)")
        self.kv: Dict[str, object] = {}
        self.array_at: Dict[str, int] = {}  # where each array value starts (its element type)
        for _ in range(n_kv):
            key = self._string()
            if not key or key in self.kv:
                raise self._bad(f"empty or repeated key {key!r}")
            vtype = self._read("<I")
            if vtype == self._ARRAY:
                self.array_at[key] = self.pos
            self.kv[key] = self._value(vtype)
        align = self.kv.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise self._bad(f"general.alignment = {align!r} is not a power of two")
        self.tensors = []  # (name, ggml type, shape, offset from the data start)
        names = set()
        for _ in range(n_tensors):
            name = self._string()
            if not name or len(name.encode()) >= MAX_NAME or name in names:
                raise self._bad(f"tensor name {name[:80]!r} is empty, too long or repeated")
            names.add(name)
            n_dims = self._read("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._bad(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
            shape, n = [], 1
            for _ in range(n_dims):
                d = self._read("<Q")
                if d < 1 or n * d > _INT64_MAX:
                    raise self._bad(f"tensor {name!r} has an impossible shape (dimension {d})")
                shape.append(d)
                n *= d
            ggml_type, offset = self._read("<I"), self._read("<Q")
            if offset % align:
                raise self._bad(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {align}")
            self.tensors.append((name, ggml_type, shape, offset))
        self.alignment = align
        self.data_start = (self.pos + align - 1) // align * align
        self.duplicate_token = self._duplicate_string("tokenizer.ggml.tokens")
        self.has_byte_tokens = self._array_has("tokenizer.ggml.token_type", _TOKEN_TYPE_BYTE)

    def _array_has(self, key: str, value: int) -> bool:
        """Whether the int32 array ``key`` holds ``value`` (False when there is no such array)."""
        arr = self.kv.get(key)
        if not isinstance(arr, _Array) or arr.etype not in (4, 5):  # uint32, int32
            return False
        import array

        start = self.array_at[key] + 12
        if start + 4 * arr.count > self.size:
            return False
        values = array.array("i")
        values.frombytes(bytes(self.buf[start:start + 4 * arr.count]))
        return value in values

    def _duplicate_string(self, key: str):
        """(earlier index, index, text) of the first string of array ``key`` equal to an earlier one as llama.cpp
        reads them, or None. llama.cpp aborts the process on a vocabulary with a repeated token
        (GGML_ASSERT in llama_vocab::load), so model_info reads this one array the way it does: a
        string ends at its first NUL byte (a C string), and an empty one is named ``[EMPTY_i]``."""
        if key not in self.array_at or self.kv[key].etype != self._STRING:
            return None
        self.pos = self.array_at[key] + 12
        seen = {}
        buf, size = self.buf, self.size
        for i in range(self.kv[key].count):
            (n,) = self.unpack_from("<Q", buf, self.pos)
            b = bytes(buf[self.pos + 8:self.pos + 8 + n]).split(b"\0", 1)[0]
            self.pos += 8 + n
            if self.pos > size:
                break
            b = b or b"[EMPTY_%d]" % i
            if b in seen:
                return seen[b], i, b.decode("utf-8", "replace")
            seen[b] = i
        return None

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
                    if self.pos > self.size:
                        break
            else:  # llama.cpp reads no arrays of arrays
                raise self._bad(f"array of GGUF type {etype} (nested arrays are not supported)")
            if self.pos > self.size:
                raise ModelFileError(f"{self.path} is truncated inside its header")
            return _Array(etype, count)
        raise self._bad(f"unknown GGUF value type {vtype}")


def _check_attention(p: Path, kv: Dict[str, object], arch: str, kv_int) -> None:
    """The attention geometry llama.cpp's graph builders assert on (when the model has heads and
    they are one value for all layers): KV heads dividing the heads, the rope dimensions even and
    at most the head size (equal to it where the architecture's graph requires), a known rope scaling."""
    scaling = kv.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in _ROPE_SCALINGS:
        raise ModelFileError(f"{p}: {arch}.rope.scaling.type = {scaling!r} is not one of {', '.join(_ROPE_SCALINGS)}")
    if isinstance(kv.get(f"{arch}.attention.head_count"), _Array) or isinstance(
            kv.get(f"{arch}.attention.head_count_kv"), _Array):
        return  # per-layer head counts: llama.cpp's own per-layer checks apply
    n_head = kv_int(f"{arch}.attention.head_count", 0, 0, 1 << 20)
    if n_head == 0:
        return
    n_head_kv = kv_int(f"{arch}.attention.head_count_kv", n_head, 0, n_head)
    if n_head_kv < 1 or n_head % n_head_kv:
        raise ModelFileError(f"{p}: {n_head} attention heads cannot share {n_head_kv} KV heads")
    n_embd = kv_int(f"{arch}.embedding_length", 0, 0, 2**31 - 1)
    head = kv_int(f"{arch}.attention.key_length", n_embd // n_head, 0, 2**31 - 1)
    if head == 0:
        return  # no embedding length: a required key llama.cpp reports missing itself
    n_rot = kv_int(f"{arch}.rope.dimension_count", head, 0, 2**31 - 1)
    if n_rot % 2 or n_rot > head or (arch in _FULL_ROPE_ARCHS and n_rot != head):
        raise ModelFileError(f"{p}: {arch}.rope.dimension_count = {n_rot} does not fit attention heads of size {head}"
                             + (f" ({arch} rotates whole heads)" if arch in _FULL_ROPE_ARCHS else ""))


def _kv_width(kv: Dict[str, object], arch: str, kv_int) -> int:
    """K and V elements per token and layer (KV heads x (key + value size), as llama.cpp sizes its KV
    cache where every layer has the same heads); 0 where the heads are unknown or given per layer. MLA
    (deepseek2): key and value of the latent, more than llama.cpp keeps (no V): an upper bound."""
    if isinstance(kv.get(f"{arch}.attention.head_count"), _Array) or isinstance(
            kv.get(f"{arch}.attention.head_count_kv"), _Array):
        return 0
    n_head = kv_int(f"{arch}.attention.head_count", 0, 0, 1 << 20)
    n_embd = kv_int(f"{arch}.embedding_length", 0, 0, 2**31 - 1)
    if n_head == 0 or n_embd == 0:
        return 0
    n_head_kv = kv_int(f"{arch}.attention.head_count_kv", n_head, 0, n_head)
    k = kv_int(f"{arch}.attention.key_length", n_embd // n_head, 0, 2**31 - 1)
    v = kv_int(f"{arch}.attention.value_length", k, 0, 2**31 - 1)
    return n_head_kv * (k + v)


def model_info(path: "os.PathLike[str] | str") -> ModelInfo:
    """Read a GGUF header and describe the model; raise ModelFileError for a bad file.

    Besides the GGUF layout, the expert layout is checked against llama.cpp's own limits (it
    aborts the process on some of them instead of failing the load): layers, expert counts,
    groups, tensor offsets, sizes and alignment, expert tensor shapes.

    >>> model_info("missing.gguf")
    Traceback (most recent call last):
    ...
    pymoecache.errors.ModelNotFoundError: model file not found: missing.gguf
    """
    import gguf  # type sizes only; imported here: reading a header must not need the native library

    p = check_gguf_file(path)
    h = _Header(p)

    def kv_int(key: str, default: int, lo: int = 0, hi: int = 2**32 - 1) -> int:
        v = h.kv.get(key)
        if v is None:
            return default
        if isinstance(v, _Array):
            raise ModelFileError(f"{p}: {key} is an array (per-layer values); pymoecache supports one value "
                                 "for all layers")
        if type(v) is not int:
            raise ModelFileError(f"{p}: {key} = {v!r} is not an integer")
        if not lo <= v <= hi:
            raise ModelFileError(f"{p}: {key} = {v} is out of range ({lo} to {hi})")
        return v

    def kv_str(key: str) -> str:
        v = h.kv.get(key)
        return v if isinstance(v, str) else ""

    def n_bytes(name: str, ggml_type: int, shape: List[int]) -> int:
        try:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ModelFileError(f"{p}: tensor {name!r} has an unknown ggml type {ggml_type}") from None
        if shape[0] % block:
            raise ModelFileError(f"{p}: tensor {name!r} has rows of {shape[0]} elements, not a multiple of its "
                                 f"type's block of {block}")
        n = 1
        for d in shape:
            n *= d
        return n // block * size

    tokenizer = kv_str("tokenizer.ggml.model")
    if h.has_byte_tokens and tokenizer in _NO_BYTE_TOKENS:
        raise ModelFileError(f"{p}: a '{tokenizer}' (WordPiece) vocabulary with byte tokens (token type 6): "
                             "llama.cpp aborts on this file")
    if h.duplicate_token is not None:
        first, i, text = h.duplicate_token
        raise ModelFileError(f"{p}: the vocabulary has token {text[:40]!r} twice, as ids {first} and {i} (as llama.cpp "
                             "reads them: a token ends at a NUL byte); llama.cpp aborts on such a file")
    arch = kv_str("general.architecture")
    if not arch:
        raise ModelFileError(f"{p} has no general.architecture key: not a llama.cpp model")
    file_bytes = p.stat().st_size
    tensors = []
    for name, t, shape, off in h.tensors:
        start, size = h.data_start + off, n_bytes(name, t, shape)
        if start % TENSOR_ALIGNMENT:
            raise ModelFileError(f"{p}: tensor {name!r} starts at byte {start}, not {TENSOR_ALIGNMENT}-byte aligned "
                                 f"(general.alignment {h.alignment}): llama.cpp cannot map it")
        tensors.append((name, t, shape, start, size))
    end = max((start + size for *_, start, size in tensors), default=0)
    if end > file_bytes:
        raise ModelFileError(f"{p} is truncated: its tensors need {end} bytes, the file has {file_bytes}")

    # the hyperparameters llama.cpp asserts on (llama_model::load_hparams)
    n_layer = kv_int(f"{arch}.block_count", 0, 0, MAX_LAYERS)
    if n_layer < 1:
        known = any(k.startswith(f"{arch}.") for k in h.kv)
        raise ModelFileError(f"{p}: {arch}.block_count is missing or 0: a model needs 1 to {MAX_LAYERS} layers"
                             + ("" if known else f" (no '{arch}.*' keys at all: unknown or damaged architecture)"))
    kv_int(f"{arch}.nextn_predict_layers", 0, 0, n_layer)
    n_expert = kv_int(f"{arch}.expert_count", 0, 0, MAX_EXPERTS)
    n_used = kv_int(f"{arch}.expert_used_count", 0, 0, MAX_EXPERTS)
    n_groups = kv_int(f"{arch}.expert_group_count", 0, 0, MAX_EXPERTS)
    n_group_used = kv_int(f"{arch}.expert_group_used_count", 0, 0, MAX_EXPERTS)
    if n_used > n_expert:
        raise ModelFileError(f"{p}: {arch}.expert_used_count = {n_used} is larger than expert_count = {n_expert}")
    if n_expert > 0 and n_used < 1:
        raise ModelFileError(f"{p}: {n_expert} experts but expert_used_count = 0")
    if n_expert > 0 and n_groups >= n_expert:
        raise ModelFileError(f"{p}: expert_group_count = {n_groups} must be smaller than expert_count = {n_expert}")
    if n_expert > 0 and n_groups > 1 and (n_expert % n_groups or not 0 < n_group_used < n_groups):
        raise ModelFileError(f"{p}: {n_expert} experts cannot form {n_groups} groups with {n_group_used} used")
    if n_expert == 0 and n_groups:
        raise ModelFileError(f"{p}: expert_group_count = {n_groups} without experts")

    _check_attention(p, h.kv, arch, kv_int)

    per_layer: Dict[int, int] = {}
    slot_pad = 0  # streamed: a page per expert slot whose reads land in place (src_cpp/moecache-impl.h)
    types = set()
    for name, ggml_type, shape, start, size in tensors:
        m = _EXPS_RE.match(name)
        if m:
            # what llama.cpp's loader accepts: one entry per expert in the last dimension, and the
            # matrices three-dimensional; the cache moves the matrices, the rest stays with the dense part
            il, is_matrix = int(m.group(1)), m.group(3) == "weight"
            if shape[-1] != n_expert or n_expert < 2 or il >= n_layer or (is_matrix and len(shape) != 3):
                raise ModelFileError(f"{p}: expert tensor {name!r} of shape {shape} does not fit the model's "
                                     f"{n_expert} experts in {n_layer} layers ({arch}.expert_count"
                                     + (": an expert matrix has 3 dimensions)" if is_matrix else ")"))
            if is_matrix:
                per_layer[il] = per_layer.get(il, 0) + size
                types.add(gguf.GGMLQuantizationType(ggml_type).name)
                one = size // n_expert
                if one % _IO_ALIGN == 0 and one >= _IN_PLACE_MIN and start % _IO_ALIGN:
                    slot_pad += _IO_ALIGN
    moe_layers = sorted(per_layer)
    n_shared = kv_int(f"{arch}.expert_shared_count", 0, 0, MAX_EXPERTS)
    if n_shared == 0 and any("_shexp." in t[0] for t in tensors):
        n_shared = 1  # qwen2moe stores one shared expert without a count key
    total = sum(per_layer.values())
    input_bytes = sum(t[4] for t in tensors if t[0].startswith(("token_embd", "token_types.", "position_embd.")))
    output_bytes = sum(t[4] for t in tensors if t[0].startswith(("output.", "output_norm.")))
    tied = 0 if any(t[0] == "output.weight" for t in tensors) else sum(t[4] for t in tensors if t[0] == "token_embd.weight")
    expert_bytes = total / (len(moe_layers) * n_expert) if moe_layers and n_expert else 0.0
    slot_bytes = expert_bytes + (slot_pad / len(moe_layers) if moe_layers else 0.0)
    return ModelInfo(
        path=str(p),
        arch=arch,
        name=kv_str("general.name"),
        file_bytes=file_bytes,
        n_layer=n_layer,
        moe_layers=moe_layers,
        n_expert=n_expert,
        n_expert_used=n_used,
        n_expert_shared=n_shared,
        gating=_GATING.get(kv_int(f"{arch}.expert_gating_func", 1 if n_expert else 0), "?"),
        n_expert_groups=max(1, n_groups),
        expert_bytes=expert_bytes,
        expert_bytes_total=total,
        slot_bytes=slot_bytes,
        expert_types=sorted(types),
        n_embd=kv_int(f"{arch}.embedding_length", 0, 0, 2**31 - 1),
        n_embd_kv=_kv_width(h.kv, arch, kv_int),
        n_ctx_train=kv_int(f"{arch}.context_length", 0, 0, 2**31 - 1),
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        output_tied_bytes=tied,
    )
