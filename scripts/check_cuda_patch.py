#!/usr/bin/env python3
"""Compile-check of ggml-cuda with our patches, on a machine without a GPU or a CUDA toolkit.

    python scripts/check_cuda_patch.py               # toolkit into build/cuda-toolkit (once), then nvcc
    python scripts/check_cuda_patch.py --arch sm_89  # another target

patches/0004 adds `buffer_from_host_ptr` to ggml-cuda (src_cpp/moecache-unified.cpp wraps the slot arena with
it). A GPU machine is lent rarely, so this compiles the patched `ggml-cuda.cu` here: NVIDIA's compiler and headers
come from PyPI (nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt, nvidia-cuda-runtime, nvidia-cuda-cccl and
nvidia-cublas's headers; about 500 MB downloaded, 180 MB kept, nothing installed into the environment), then
`nvcc -c` builds the one translation unit the patch changes, with the options ggml's CMake gives it. Running the
path is gpu_check.sh's (step `unified`). Exit 0 when it compiles without a warning in the patch's code; 2 when the toolkit cannot be had (no network).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"
TOOLKIT = ROOT / "build" / "cuda-toolkit"
# CUDA 13's wheels: the 12.x nvcc wheels hold ptxas alone
WHEELS = ["nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-runtime", "nvidia-cuda-cccl",
          "nvidia-cublas"]


def toolkit() -> Path:
    """build/cuda-toolkit/nvidia/cu13 with bin/nvcc, nvvm/ and include/, fetched from PyPI once."""
    home = TOOLKIT / "nvidia" / "cu13"
    if (home / "bin" / "nvcc").exists() and (home / "include" / "cublas_v2.h").exists():
        return home
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading {', '.join(WHEELS)} from PyPI ...", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *WHEELS],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"cannot download the CUDA toolkit's wheels:\n{r.stderr[-1500:]}", file=sys.stderr)
            sys.exit(2)
        for whl in sorted(Path(tmp).glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    if ".so" in Path(info.filename).name or ".dist-info" in info.filename:
                        continue  # (cuBLAS's libraries: only its headers are needed)
                    z.extract(info, TOOLKIT)
                    mode = info.external_attr >> 16
                    if mode & 0o111:
                        (TOOLKIT / info.filename).chmod(0o755)
    for exe in list((home / "bin").glob("*")) + list((home / "nvvm" / "bin").glob("*")):
        if exe.is_file():
            exe.chmod(0o755)
    return home


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_80", help="the GPU architecture to compile for (default %(default)s)")
    a = ap.parse_args(argv)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "vendor_llama_cpp.py")], check=True)
    home = toolkit()
    ggml = VENDOR / "ggml"
    src = ggml / "src" / "ggml-cuda" / "ggml-cuda.cu"
    if "ggml_backend_cuda_device_buffer_from_host_ptr" not in src.read_text():
        print(f"{src} lacks patches/0004 (buffer_from_host_ptr)", file=sys.stderr)
        return 1
    out = ROOT / "build" / "cuda-check" / "ggml-cuda.o"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(home / "bin" / "nvcc"), "-c", str(src), "-o", str(out), f"-arch={a.arch}", "-std=c++17",
           "-I", str(ggml / "include"), "-I", str(ggml / "src"), "-I", str(ggml / "src" / "ggml-cuda"),
           "-I", str(home / "include"), "-I", str(home / "include" / "cccl"),
           "-DGGML_SCHED_MAX_COPIES=4", "-DGGML_CUDA_USE_GRAPHS", "-D_GNU_SOURCE",
           "-Xcompiler", "-fPIC", "-Xcompiler", "-Wall"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and not ln.startswith("Remark")]
    ours = [ln for ln in said if "host_ptr" in ln]  # (warnings of the patch's own code; upstream has its own)
    if r.returncode != 0 or ours:
        print("\n".join(ours or said[-40:]), file=sys.stderr)
        print(f"ggml-cuda.cu with patches/0004 does not compile ({home / 'bin' / 'nvcc'}, {a.arch})", file=sys.stderr)
        return 1
    version = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    release = next((ln.strip() for ln in version.splitlines() if "release" in ln), "?")
    print(f"ggml-cuda.cu with patches/0004 compiles: {release}, {a.arch}, {time.monotonic() - t0:.0f} s, "
          f"{out.stat().st_size >> 10} KiB object")
    return 0


if __name__ == "__main__":
    sys.exit(main())
