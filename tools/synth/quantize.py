"""Quantized copies through llama.cpp's own quantizer (llama-cpp-python on this checkout's libllama)."""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path


from .spec import ModelSpec
from .cards import _make_card, _sha256, _tensor_types, _write_card, card_path


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

    ``ftype_name`` is "Q8_0", "Q4_K_M" or "Q4_0". With the fixtures' small widths some
    tensors cannot use the requested type (K-quants need rows of 256), and
    llama.cpp picks a fallback type; the card written next to ``dst`` records
    the types actually used. If ``src`` has a card, the new card copies its
    spec fields and points back at the source.
    """
    llama_cpp = _load_llama_cpp()
    ftypes = {
        "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
        "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
        "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    }
    if ftype_name not in ftypes:
        raise ValueError(f"unsupported ftype {ftype_name!r}; choose from {sorted(ftypes)}")
    src, dst = Path(src), Path(dst)

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype_name]
    params.allow_requantize = True  # (the benchmark model is Q8_0 already)
    params.nthread = os.cpu_count() or 1
    tmp = dst.with_name(dst.name + ".tmp")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype_name}) failed with {rc}")
    tmp.replace(dst)

    src_card_path = card_path(src)
    src_card = json.loads(src_card_path.read_text()) if src_card_path.is_file() else {}
    if "spec" in src_card:  # a synthetic model's card (a trained model's card says other things)
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
