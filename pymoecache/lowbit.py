"""Low-bit companions: every routed expert of a model again, at a lower type, in a file of its own.

A miss that reads the low-bit copy waits for a fraction of the bytes (HOBBIT, EdgeMoE). The copy
is made by llama.cpp's own quantizer (``llama_model_quantize``, with a tensor-type override for the
routed expert matrices), and only those tensors go into the companion. The companion records the
model it belongs to: the model file's size and a hash of its tensor table (names, types, shapes,
offsets). :func:`check_companion` refuses a companion that is foreign, stale, truncated or not
lower-typed, with the reason.

    pymoecache lowbit model.gguf                    # model.lowbit-Q4_K.gguf beside it (Q8_0 experts: Q4_K;
                                                    # named by the types made: Q4_K+Q5_0 with llama.cpp's fallback)
    pymoecache lowbit model.gguf --type Q3_K -o small.gguf
    pymoecache lowbit model.gguf --check            # is the companion beside it usable?

>>> default_type("Q8_0"), default_type("Q4_K")
('Q4_K', 'Q3_K')
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from .errors import ModelFileError
from .files import writable_target
from .model_info import _EXPS_RE, _Header, check_gguf_file, model_info

FORMAT_VERSION = 1
KEY = "moecache.lowbit."  # the companion's own keys: KEY + version, type, parent.name, parent.size, parent.tensor_hash,
#                            parent.experts_sample (written since 2026-11-28; a companion without it is not checked so)

# The type a model's experts get by default, from their own type: a Q8_0 model's experts at Q4_K (about half
# the bits: +0.06-0.13% perplexity on model C), a 4-6 bit model's at Q3_K. Measured on the fine-grained trained
# model at Q4_K_M (128 experts, 8 used; docs/results.md, issue 76 item 5): Q3_K and IQ3_S copies cost nothing
# measurable (+0.2% and -0.6%, within a standard error), Q2_K +1.0-1.4% (two standard errors) for 24% fewer
# bytes than Q3_K; Q3_K over IQ3_S for its faster kernels on every backend. --type Q2_K where bytes matter more.
_DEFAULT = {"F32": "Q4_K", "F16": "Q4_K", "BF16": "Q4_K", "Q8_0": "Q4_K",
            "Q6_K": "Q3_K", "Q5_K": "Q3_K", "Q5_0": "Q3_K", "Q5_1": "Q3_K", "Q4_K": "Q3_K", "Q4_0": "Q3_K",
            "Q4_1": "Q3_K", "IQ4_NL": "Q3_K", "IQ4_XS": "Q3_K", "MXFP4": "Q3_K"}
# what --type takes (Q8_0: for F16/BF16/F32 experts, half the bytes at almost no cost; a companion
# must be smaller than the model's experts): llama.cpp makes these without an importance matrix
# (IQ1_*, IQ2_XXS, IQ2_XS and IQ2_S need one: llama_model_quantize refuses them without)
TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_K", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "Q3_K", "IQ3_S",
         "IQ3_XXS", "Q2_K")
_NEEDS_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
# what llama.cpp's quantizer writes instead where a tensor's rows are not a multiple of the asked type's block
# (tensor_type_fallback in vendor/llama.cpp/src/llama-quant.cpp; F16 where the fallback's block does not fit either)
_FALLBACK = {"IQ3_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
             "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


class CompanionError(ModelFileError):
    """A low-bit companion is missing, damaged, for another model, or cannot be made as asked."""


@dataclass
class Companion:
    """A checked companion: what it holds and what one expert costs in it."""

    path: str
    model: str
    type: str                            # the type asked for
    types: Dict[str, int] = field(default_factory=dict)  # type -> expert tensors llama.cpp made at it
    expert_bytes: float = 0.0            # one expert of one layer (its gate, up and down) in the companion
    model_expert_bytes: float = 0.0      # the same in the model

    @property
    def ratio(self) -> float:
        """How many times fewer bytes a miss reads from the companion."""
        return self.model_expert_bytes / self.expert_bytes if self.expert_bytes else 0.0

    def summary(self) -> str:
        used = ", ".join(f"{n} at {t}" for t, n in sorted(self.types.items()))
        fell = [t for t in self.types if t != self.type]
        note = (f" (llama.cpp's fallback for rows that are not a multiple of {self.type}'s block: {', '.join(fell)})"
                if fell else "")
        return (f"{self.path}: low-bit experts of {Path(self.model).name}, {used}{note}; one expert "
                f"{self.expert_bytes / 2**20:.3f} MiB against {self.model_expert_bytes / 2**20:.3f} MiB in the model: "
                f"a miss reads {self.ratio:.2f}x fewer bytes")


def companions_beside(model: "os.PathLike[str] | str") -> List[Path]:
    """The companions beside ``model`` (MODEL.lowbit-TYPE.gguf), the one the default uses first (see
    :func:`default_path`), then the others by name."""
    m = Path(model)
    stem = m.name[:-5] if m.name.endswith(".gguf") else m.name
    found = sorted(m.parent.glob(f"{_glob_escape(stem)}.lowbit-*.gguf"))
    if len(found) < 2:
        return found
    try:
        want = default_type(model_info(m).expert_types[0]) if m.exists() else "Q4_K"
    except Exception:  # (a model of a type with no default: Q4_K's name is as good as any)
        want = "Q4_K"

    def rank(p: Path):  # made for the default type first, then the most bits (the least lost), then the name
        asked, held = _asked_and_held(p, stem)
        try:
            bits = max(_bits(t) for t in held)
        except (KeyError, AttributeError, ValueError):
            bits = 0.0
        return (asked != want, -bits, p.name)

    return sorted(found, key=rank)


def default_path(model: "os.PathLike[str] | str", type: Optional[str] = None) -> Path:
    """Where :func:`make_companion` writes and ``--lowbit`` looks by default: beside the model. Of
    several companions there, the default type's (Q4_K for Q8_0 experts), else the one of the most
    bits: never the first by name (a Q2_K made once for a test would replace Q4_K)."""
    m = Path(model)
    stem = m.name[:-5] if m.name.endswith(".gguf") else m.name
    if type is None:
        found = companions_beside(m)
        if found:
            return found[0]
        type = default_type(model_info(m).expert_types[0]) if m.exists() else "Q4_K"
    return m.with_name(f"{stem}.lowbit-{type}.gguf")


def held_name(types: Dict[str, int]) -> str:
    """The name part of a companion holding ``types`` (type -> expert tensors): its types, the most used
    first, joined by '+' (a "Q4_K" companion of 1408-wide down matrices holds Q4_K+Q5_0).

    >>> held_name({"Q5_0": 8}), held_name({"Q5_0": 4, "Q4_K": 8})
    ('Q5_0', 'Q4_K+Q5_0')
    """
    return "+".join(sorted(types, key=lambda t: (-types[t], t)))


def _asked_and_held(p: Path, stem: str):
    """(the type a companion was made for, the types it holds) from its header; from its name where the
    header cannot be read (check_companion then says why)."""
    named = p.name[len(stem) + len(".lowbit-"):-len(".gguf")]
    try:
        h = _Header(p)
        held = {_type_name(t) for name, t, _, _ in h.tensors if _EXPS_RE.search(name)}
        return str(h.kv.get(KEY + "type", named)), held or set(named.split("+"))
    except Exception:  # (damaged, not a GGUF: ranked last among equals, refused when used)
        return named, set(named.split("+"))


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


def default_type(expert_type: str) -> str:
    """The companion type for experts of ``expert_type`` (a ggml type name)."""
    t = _DEFAULT.get(expert_type)
    if t is None:
        raise CompanionError(f"experts of type {expert_type} have no lower type that llama.cpp makes without an "
                             f"importance matrix; --type takes {', '.join(TYPES)}")
    return t


def made_type(type: str, ncols: int) -> str:
    """The type llama.cpp writes when asked for ``type`` on rows of ``ncols`` values: ``type`` where its block
    divides the rows, else its fallback.

    >>> made_type("Q2_K", 4096), made_type("Q2_K", 2880), made_type("Q4_K", 2880), made_type("Q4_K", 100)
    ('Q2_K', 'Q4_0', 'Q5_0', 'F16')
    """
    if ncols % _block(type) == 0:
        return type
    t = _FALLBACK.get(type, type)
    return t if ncols % _block(t) == 0 else "F16"


def _block(type_name: str) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def _bits(type_name: str) -> float:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return 8.0 * size / block


def tensor_table_hash(path: "os.PathLike[str] | str") -> str:
    """sha256 of a GGUF file's tensor table (name, type, shape, offset of each tensor, and where the data
    starts): it changes whenever a tensor does in any way a companion could notice."""
    return _table_hash(_Header(Path(path)))


def _table_hash(h: "_Header") -> str:
    d = hashlib.sha256()
    for name, t, shape, off in h.tensors:
        d.update(f"{name}\t{t}\t{','.join(map(str, shape))}\t{off}\n".encode())
    d.update(f"data\t{h.data_start}\n".encode())
    return d.hexdigest()


SAMPLE_BLOCKS, SAMPLE_BYTES = 8, 1024  # per routed expert matrix: 8 windows of 1 KiB, spread over its data


def experts_sample_hash(path: Path, h: "_Header") -> str:
    """sha256 of sampled bytes of every routed expert matrix of ``path`` (SAMPLE_BLOCKS windows of
    SAMPLE_BYTES, evenly spread): the experts' content, where the tensor table hash sees only their
    shapes and places. A same-shape fine-tune or a re-quantization in place changes it; reading it is
    a few hundred KiB at most."""
    d = hashlib.sha256()
    with open(path, "rb") as f:
        fd = f.fileno()
        for name, t, shape, off in _expert_matrices(h):
            start, n = h.data_start + off, _n_bytes(t, shape)
            d.update(name.encode() + b"\0")
            for i in range(SAMPLE_BLOCKS):
                at = start + (max(n - SAMPLE_BYTES, 0) * i) // (SAMPLE_BLOCKS - 1)
                d.update(os.pread(fd, min(SAMPLE_BYTES, n), at))
    return d.hexdigest()


def _expert_matrices(h: "_Header") -> List[tuple]:
    return [(name, t, shape, off) for name, t, shape, off in h.tensors
            if (m := _EXPS_RE.match(name)) and m.group(3) == "weight"]


def _type_name(t: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


def _n_bytes(t: int, shape: List[int]) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def companion_estimate(model: "os.PathLike[str] | str") -> Optional[Companion]:
    """The companion ``pymoecache lowbit MODEL`` would make, before it is made: where, at what types, and one
    expert's bytes in it against the model's. None where it would refuse (no type lower than the experts', as
    gpt-oss' rows of 2880 values) or ``model`` has no routed experts.

    >>> companion_estimate("mixtral.gguf").ratio   # doctest: +SKIP
    1.31
    """
    try:
        info = model_info(model)
        if not info.is_moe or not info.expert_types:
            return None
        type = default_type(info.expert_types[0])  # (as make_companion picks it)
        mats = _expert_matrices(_Header(Path(info.path)))
    except (ModelFileError, ValueError, KeyError, OSError):
        return None
    made = [(made_type(type, shape[0]), _type_name(t), _n_bytes(t, shape)) for _, t, shape, _ in mats]
    if not made or any(_bits(x) >= _bits(own) for x, own, _ in made):
        return None  # (make_companion refuses: a companion must be smaller)
    own_bytes = sum(n for _, _, n in made)
    low_bytes = sum(n * _bits(x) / _bits(own) for x, own, n in made)
    held: Dict[str, int] = {}
    for x, _, _ in made:
        held[x] = held.get(x, 0) + 1
    return Companion(path=str(default_path(info.path, held_name(held))), model=str(info.path), type=type, types=held,
                     expert_bytes=info.expert_bytes * low_bytes / own_bytes, model_expert_bytes=info.expert_bytes)


def check_companion(model: "os.PathLike[str] | str", companion: "os.PathLike[str] | str | None" = None) -> Companion:
    """Check that ``companion`` (default: the one beside ``model``) holds ``model``'s routed experts at
    a lower type, made from this very file; raise :class:`CompanionError` with the reason otherwise.

    >>> check_companion("missing.gguf")
    Traceback (most recent call last):
    ...
    pymoecache.errors.ModelNotFoundError: model file not found: missing.gguf
    """
    info = model_info(model)
    m = Path(info.path)
    c = Path(companion) if companion is not None else default_path(m)
    if not c.exists():
        raise CompanionError(f"no low-bit companion at {c}: make one with `pymoecache lowbit {m}`")
    try:
        check_gguf_file(c)
        h = _Header(c)
    except ModelFileError as e:
        raise CompanionError(f"{c} is not a usable low-bit companion: {e}") from None
    version = h.kv.get(KEY + "version")
    if version is None:
        raise CompanionError(f"{c} is not a low-bit companion (no {KEY}version key): make one with "
                             f"`pymoecache lowbit {m}`")
    if version != FORMAT_VERSION:
        raise CompanionError(f"{c} is a companion of format {version}; this pymoecache reads format {FORMAT_VERSION}: "
                             f"make it again with `pymoecache lowbit {m}`")
    parent, size, digest = (h.kv.get(KEY + "parent.name"), h.kv.get(KEY + "parent.size"),
                            h.kv.get(KEY + "parent.tensor_hash"))
    mh = _Header(m)  # (read once: the hash and the expert matrices)
    if size != m.stat().st_size or digest != _table_hash(mh):
        same_name = parent == m.name
        raise CompanionError(
            f"{c} was made from {'an earlier version of ' if same_name else ''}{parent!r} "
            f"({size} bytes), not from {m} as it is now ({m.stat().st_size} bytes"
            + (", same size, other tensors" if size == m.stat().st_size else "") + "): "
            + (f"the model changed since; make it again with `pymoecache lowbit {m}`" if same_name
               else "it belongs to another model"))
    sample = h.kv.get(KEY + "parent.experts_sample")
    if sample is not None and sample != experts_sample_hash(m, mh):
        raise CompanionError(f"{c} was made from other expert weights than {m} holds now (same size and tensor "
                             "table: a fine-tune or a re-quantization in place): its copies are stale; make it "
                             f"again with `pymoecache lowbit {m}`")
    try:
        end = max((h.data_start + off + _n_bytes(t, shape) for _, t, shape, off in h.tensors), default=0)
    except (KeyError, ValueError):
        raise CompanionError(f"{c} has a tensor of a type that is not a ggml type") from None
    if end > c.stat().st_size:
        raise CompanionError(f"{c} is truncated: its tensors need {end} bytes, the file has {c.stat().st_size}")
    theirs = {name: (t, list(shape), off) for name, t, shape, off in h.tensors}
    mine = _expert_matrices(mh)
    types: Dict[str, int] = {}
    low = full = 0
    for name, t, shape, _ in mine:
        if name not in theirs:
            raise CompanionError(f"{c} has no tensor {name!r}: not a complete companion of {m}")
        ct, cshape, _ = theirs.pop(name)
        if cshape != list(shape):
            raise CompanionError(f"{c}: tensor {name!r} has shape {cshape}, the model's has {list(shape)}")
        try:
            cbits, bits = _bits(_type_name(ct)), _bits(_type_name(t))
        except KeyError:
            raise CompanionError(f"{c}: tensor {name!r} has a type ({_type_name(ct)}) that is not a ggml type") from None
        if cbits >= bits:
            raise CompanionError(f"{c}: tensor {name!r} is {_type_name(ct)} ({cbits:.2f} bits per weight), not lower than "
                                 f"the model's {_type_name(t)} ({bits:.2f})")
        types[_type_name(ct)] = types.get(_type_name(ct), 0) + 1
        low += _n_bytes(ct, cshape)
        full += _n_bytes(t, shape)
    if theirs:
        raise CompanionError(f"{c} holds tensors the model's routed experts do not: {sorted(theirs)[:3]}")
    n = max(1, info.n_expert * info.n_moe_layer)
    return Companion(path=str(c), model=str(m), type=str(h.kv.get(KEY + "type", "")), types=types,
                     expert_bytes=low / n, model_expert_bytes=full / n)


def make_companion(model: "os.PathLike[str] | str", out: "os.PathLike[str] | str | None" = None, *,
                   type: Optional[str] = None, threads: Optional[int] = None, progress: bool = True,
                   verbose: bool = False) -> Companion:
    """Write ``model``'s routed experts at ``type`` (default: :func:`default_type` of theirs) into a
    companion GGUF (default: :func:`default_path`), through llama.cpp's quantizer; returns it checked.

    The file appears whole or not at all (written beside, then renamed); a companion already there is
    replaced. llama.cpp falls back to another type for tensors whose rows are not a multiple of
    ``type``'s block (256 for K-quants): the companion records what it made, and a file named by default
    is named by it (MODEL.lowbit-Q4_K+Q5_0.gguf, MODEL.lowbit-Q5_0.gguf where every tensor fell back). ``verbose``: llama.cpp's
    quantizer log (a line per tensor) on stderr; otherwise a progress bar (``progress``) and nothing else.
    """
    info = model_info(model)
    m = Path(info.path)
    if not info.is_moe:
        raise CompanionError(f"{m} has no routed experts: a low-bit companion is for MoE models")
    expert_type = info.expert_types[0]
    if type is None:
        type = default_type(expert_type)
    type = type.upper()
    if type in _NEEDS_IMATRIX:
        raise CompanionError(f"--type {type} needs an importance matrix, which pymoecache lowbit does not make; "
                             f"take one of {', '.join(TYPES)}")
    if type not in TYPES:
        raise CompanionError(f"unknown or unsupported --type {type!r}; take one of {', '.join(TYPES)}")
    lowest = min(info.expert_types, key=_bits)
    if _bits(type) >= _bits(lowest):
        raise CompanionError(f"{type} ({_bits(type):.2f} bits per weight) is not lower than the model's experts "
                             f"({lowest}, {_bits(lowest):.2f}): a companion must be smaller")
    _check_rows(m, type)
    named = out is None  # named by what it holds, once llama.cpp has made it (its fallbacks included)
    out = Path(out) if out is not None else default_path(m, type)
    if os.path.isdir(out):
        raise CompanionError(f"-o {out} is a directory; give a file name")
    # a regular file or a new name; a device, FIFO or link loop is refused before anything is written (a
    # rename over /dev/null would replace the device node); a link to a regular file is written through
    out = Path(writable_target(out, "companion", CompanionError))
    if out.resolve() == m.resolve():
        raise CompanionError(f"-o {out} is the model itself")
    full = out.with_name(out.name + ".quantized.tmp")  # llama.cpp's whole output, of which the experts are kept
    part = out.with_name(out.name + ".tmp")
    try:
        _quantize(m, full, type, threads, progress, verbose, len(_Header(m).tensors))
        _write_experts(m, full, part, type, progress)
        made = check_companion(m, part)  # (a companion that fails its check never takes the name)
        if named:
            out = Path(writable_target(default_path(m, held_name(made.types)), "companion", CompanionError))
        os.replace(part, out)
    finally:
        full.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
    return check_companion(m, out)


def _check_rows(m: Path, type: str) -> None:
    """CompanionError, before any work, where llama.cpp would write an expert tensor at a type no lower than the
    model's own: its rows are not a multiple of ``type``'s block and the fallback is larger (gpt-oss: rows of 2880
    values, no 256-value block; Q2_K falls back to Q4_0, 4.5 bits, above MXFP4's 4.25). Names the types that would
    be lower, or says that none is."""
    mats = _expert_matrices(_Header(m))
    for name, t, shape, _ in mats:
        made, own = made_type(type, shape[0]), _type_name(t)
        if _bits(made) < _bits(own):
            continue
        ok = [x for x in TYPES if all(_bits(made_type(x, sh[0])) < _bits(_type_name(tt)) for _, tt, sh, _ in mats)]
        raise CompanionError(
            f"{m.name}: the rows of {name} ({shape[0]} values) are not a multiple of {type}'s block of {_block(type)}: "
            f"llama.cpp would write them at {made} ({_bits(made):.2f} bits per weight), not lower than the model's "
            f"{own} ({_bits(own):.2f}); " + (f"--type {' or '.join(ok)} would be lower" if ok else
                                              "no type llama.cpp makes without an importance matrix is lower for "
                                              "rows of this width: this model cannot have a smaller companion"))


def quantize_experts(model: "os.PathLike[str] | str", out: "os.PathLike[str] | str", type: str, *,
                     threads: Optional[int] = None, progress: bool = True) -> Path:
    """The plain alternative to a companion: ``model`` whole, its routed experts at ``type`` and the
    rest at the model's own file type (Q8_0 for an unquantized model: llama.cpp applies tensor-type
    overrides only under a quantized file type), written to ``out`` whole or not at all. A cache of
    it holds more experts in the same memory; the benchmark compares the two
    (scripts/bench_residency.py --plain-lowbit, scripts/quality_lowbit.py)."""
    m = Path(model_info(model).path)
    out = Path(writable_target(out, "quantized model", CompanionError))  # (as make_companion's -o)
    if out.resolve() == m.resolve():
        raise CompanionError(f"{out} is the model itself")
    ftype = _Header(m).kv.get("general.file_type")
    part = out.with_name(out.name + ".tmp")
    try:
        _quantize(m, part, type.upper(), threads, progress, False, len(_Header(m).tensors),
                  ftype=None if ftype in (None, 0, 1, 32) else ftype)  # (F32, F16, BF16: Q8_0)
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
    return out


def _quantize(model: Path, dst: Path, type: str, threads: Optional[int], progress: bool, verbose: bool,
              n_tensors: int, ftype: Optional[int] = None) -> None:
    """llama_model_quantize of the whole model, the routed expert matrices overridden to ``type``, the
    rest at ``ftype`` (default Q8_0)."""
    import gguf

    from . import _llamalog  # loads our libllama; its log callback lets us count tensors
    import llama_cpp
    from ._logtail import LINES

    params = llama_cpp.llama_model_quantize_default_params()
    # (a companion keeps only the experts, the rest is thrown away: Q8_0 is the cheapest choice)
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0 if ftype is None else int(ftype)
    params.allow_requantize = True
    params.nthread = threads or os.cpu_count() or 1
    pattern = ctypes.c_char_p(rb"^blk\.[0-9]+\.ffn_(gate|up|down|gate_up)_exps\.weight$")
    overrides = (llama_cpp.llama_model_tensor_override * 2)()
    overrides[0].pattern = pattern
    overrides[0].type = int(gguf.GGMLQuantizationType[type])
    overrides[1].pattern = None
    params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    bar = None
    if progress and hasattr(sys.stderr, "isatty") and sys.stderr.isatty():  # (redraws in a log are lines each)
        from tqdm import tqdm

        bar = tqdm(total=n_tensors, unit="tensor", desc=f"quantizing experts to {type}", leave=False)
    done = re.compile(rb"^\[\s*\d+/\s*\d+\]")

    def count(level: int, text: bytes) -> None:
        if bar is not None and text and done.match(text):
            bar.update(1)

    logger = _llamalog.LLAMA_CPP_LOGGER.logger  # what llama.cpp's log reaches stderr through
    level = logger.level
    if not verbose:
        logger.setLevel(logging.CRITICAL + 1)
    _llamalog.LISTENERS.append(count)
    try:
        rc = _interruptible(lambda: llama_cpp.llama_model_quantize(str(model).encode(), str(dst).encode(),
                                                                   ctypes.byref(params)))
    finally:
        _llamalog.LISTENERS.remove(count)
        logger.setLevel(level)
        if bar is not None:
            bar.close()
    if rc != 0 or not dst.is_file():
        tail = " | ".join(list(LINES)[-3:])
        raise CompanionError(f"llama.cpp's quantizer failed on {model} (status {rc})" + (f": {tail}" if tail else ""))


def _interruptible(call):
    """``call()`` (a long C call) on a thread of its own, waited for here: Ctrl-C raises
    KeyboardInterrupt in this thread at once. Run here, the C call would take the signal into the
    log callback, where ctypes prints it and drops it ("Exception ignored"), and quantizing went on.
    After Ctrl-C the call runs on to its end in the background (C cannot be stopped), writing to a
    file the caller removes; the process may exit meanwhile."""
    import threading

    out: dict = {}

    def run() -> None:
        try:
            out["rc"] = call()
        except BaseException as e:  # (re-raised in the caller's thread)
            out["error"] = e

    t = threading.Thread(target=run, name="pymoecache-quantize", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
    if "error" in out:
        raise out["error"]
    return out["rc"]


def _write_experts(model: Path, quantized: Path, dst: Path, type: str, progress: bool) -> None:
    """The companion: the routed expert matrices of ``quantized``, and the keys naming ``model``."""
    import gguf

    reader = gguf.GGUFReader(quantized)
    arch = model_info(model).arch
    writer = gguf.GGUFWriter(dst, arch)
    writer.add_uint32(KEY + "version", FORMAT_VERSION)
    writer.add_string(KEY + "type", type)
    writer.add_string(KEY + "parent.name", model.name)
    writer.add_uint64(KEY + "parent.size", model.stat().st_size)
    writer.add_string(KEY + "parent.tensor_hash", tensor_table_hash(model))
    writer.add_string(KEY + "parent.experts_sample", experts_sample_hash(model, _Header(model)))
    for t in reader.tensors:
        m = _EXPS_RE.match(t.name)
        if m and m.group(3) == "weight":
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=progress)
    writer.close()
