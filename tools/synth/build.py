"""Building fixtures, all of them with quantized copies, and models of a target size for benchmarks."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path


from .layout import tensor_plan
from .spec import BENCH_SPEC, FIXTURES, QUANT_TYPES, ModelSpec
from .writer import _tensor_nbytes, _write_gguf
from .cards import _is_up_to_date, _make_card, _write_card
from .quantize import quantize


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------

def build_fixture(name: str, out_dir: str | os.PathLike, seed: int = 0, force: bool = False) -> Path:
    """Write fixture ``name`` (a key of FIXTURES) as ``<out_dir>/<name>.gguf``.

    Weights are F32 except token_embd/output (F16, to keep files small).
    An existing file whose card matches the spec and seed is kept unless
    ``force`` is set. Returns the path of the .gguf file.
    """
    spec = FIXTURES[name]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.gguf"
    if not force and _is_up_to_date(path, spec, seed, "base"):
        return path
    _write_gguf(spec, path, seed)
    _write_card(_make_card(spec, path, seed, "base"), path)
    return path


def build_all(out_dir: str | os.PathLike, seed: int = 0, force: bool = False,
              verbose: bool = True) -> list[Path]:
    """Build every fixture, plus Q8_0 and Q4_K_M copies of the MoE ones.

    Files already built from the same spec and seed are skipped (unless
    ``force``). Returns the paths of all model files, base files first.
    """
    out_dir = Path(out_dir)
    paths = []
    for name, spec in FIXTURES.items():
        t0 = time.perf_counter()
        base = out_dir / f"{name}.gguf"
        base_fresh = force or not _is_up_to_date(base, spec, seed, "base")
        build_fixture(name, out_dir, seed, force=force)
        paths.append(base)
        if verbose:
            _report(base, base_fresh, t0)
        if spec.n_expert == 0:
            continue
        for qname in QUANT_TYPES:
            t0 = time.perf_counter()
            qpath = out_dir / f"{name}.{qname}.gguf"
            fresh = base_fresh or not _is_up_to_date(qpath, spec, seed, qname)
            if fresh:
                quantize(base, qpath, qname)
            paths.append(qpath)
            if verbose:
                _report(qpath, fresh, t0)
    return paths


def _report(path: Path, built: bool, t0: float) -> None:
    size_mb = path.stat().st_size / 1e6
    what = f"built in {time.perf_counter() - t0:.1f}s" if built else "up to date"
    print(f"{path}: {size_mb:.1f} MB, {what}", flush=True)


def build_model(spec: ModelSpec, out_path: str | os.PathLike, seed: int = 0, force: bool = False,
                experts_last: bool = False) -> Path:
    """Write any ``spec`` to ``out_path`` with a progress bar (skipped if up to date)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    variant = "experts-last" if experts_last else "base"
    if not force and _is_up_to_date(out_path, spec, seed, variant):
        return out_path
    _write_gguf(spec, out_path, seed, progress=True, experts_last=experts_last)
    _write_card(_make_card(spec, out_path, seed, variant), out_path)
    return out_path


def build_bench_model(out_path: str | os.PathLike, target_mb: float = 320, seed: int = 0,
                      force: bool = False) -> Path:
    """Write the large qwen2moe-style benchmark model (Q8_0 weights) to ``out_path``.

    n_embd 1024, 60 experts top-4, n_ff_exp 128, at least 8 layers; layers are
    added until the file is about ``target_mb`` MB. Shows a tqdm progress bar.
    Skipped if the file is up to date (same spec and seed) unless ``force``.
    """
    spec = bench_spec(target_mb)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if not force and _is_up_to_date(out_path, spec, seed, "base"):
        return out_path
    _write_gguf(spec, out_path, seed, progress=True)
    _write_card(_make_card(spec, out_path, seed, "base"), out_path)
    return out_path


def bench_spec(target_mb: float = 320, base_spec: "ModelSpec | None" = None) -> ModelSpec:
    """``base_spec`` (default BENCH_SPEC) with enough layers (at least its own) for the file to reach target_mb."""
    base_spec = base_spec or BENCH_SPEC
    base = dataclasses.replace(base_spec, n_layer=1)
    plan = tensor_plan(base)
    per_layer = sum(_tensor_nbytes(t) for t in plan if t.name.startswith("blk."))
    fixed = sum(_tensor_nbytes(t) for t in plan if not t.name.startswith("blk."))
    n_layer = math.ceil((target_mb * 1e6 - fixed) / per_layer)
    return dataclasses.replace(base_spec, n_layer=max(base_spec.n_layer, n_layer))
