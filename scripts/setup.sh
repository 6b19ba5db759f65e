#!/usr/bin/env bash
# Set up pymoecache on a fresh Linux or macOS machine (Python >= 3.10, a C++17 compiler, cmake),
# then run the main job: `pymoecache run --prior 0.5 --cache-size 0.5` on the embedded default model.
#
#   bash scripts/setup.sh            # set up (idempotent) + run
#   bash scripts/setup.sh --no-run   # set up only (used by scripts/test.sh)
#
# Everything goes into .venv/ of this checkout. Extra CMake options: CMAKE_ARGS="-DGGML_METAL=ON" ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RUN=1
[ "${1:-}" = "--no-run" ] && RUN=0

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
    step "creating .venv"
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

step "build tools and Python dependencies"
"$VPY" -m pip install -q "scikit-build-core>=0.10"
PIN=$("$VPY" scripts/vendor_llama_cpp.py --print-pin)   # pyproject.toml is the one place it is written
if ! "$VPY" -c "import llama_cpp" 2>/dev/null; then
    step "llama-cpp-python $PIN, Python part only (it runs on our libllama, not a second build)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$VPY" -m pip install -q "llama-cpp-python==$PIN"
fi

step "vendor/llama.cpp: pinned sdist + patches/"
"$VPY" scripts/vendor_llama_cpp.py

step "building pymoecache (patched llama.cpp + src_cpp; several minutes the first time) with its extras"
"$VPY" -m pip install --no-build-isolation -q ".[test,plot,hub,server]"

if [ "$RUN" = 1 ]; then
    step "pymoecache run --prior 0.5 --cache-size 0.5 (embedded default model, half of its experts cached)"
    .venv/bin/pymoecache run --prior 0.5 --cache-size 0.5
fi
