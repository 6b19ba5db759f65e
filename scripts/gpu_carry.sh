#!/usr/bin/env bash
# Prepare what scripts/gpu_check.sh needs on a lent GPU machine that reaches no network, in
# .devcarry/ (git-ignored through .git/info/exclude): a copy of vendor/llama.cpp without its docs,
# models, tests and other backends (20 MB: the tree that travels is limited to 64 MiB), the
# pure-Python packages the project takes from PyPI (llama-cpp-python's Python part, gguf,
# diskcache), the vocabulary the synthetic model is built with and the two texts the benchmark
# decodes. Run it here, after scripts/setup.sh, then (device tool) with carry [".devcarry"]:
#
#   mkdir -p ../shared/data && cp -r .devcarry/data/* ../shared/data/;
#   export PYTHONPATH=$PWD/.devcarry/site; GPU_CHECK_VENDOR=$PWD/.devcarry/llama.cpp bash scripts/gpu_check.sh
#
# The tracked trained models (70 MB) make the tree too large to travel: before the call,
# `git rm -q --cached` the two that gpu_check does not use (models/tiny-shakespeare-mixtral-8x2.gguf
# and models/tiny-shakespeare-qwen2moe-60x4.gguf) and move them out of the tree; after it, move them
# back and `git reset -q HEAD -- models/`.
set -euo pipefail
cd "$(dirname "$0")/.."
V=vendor/llama.cpp
SP=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ -f "$V/CMakeLists.txt" ] || { echo "gpu_carry: $V is missing: run scripts/setup.sh first" >&2; exit 1; }
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.devcarry/' >> .git/info/exclude; }
rm -rf .devcarry
mkdir -p .devcarry/site .devcarry/llama.cpp/ggml/src .devcarry/llama.cpp/models .devcarry/data
cp -r "$SP/llama_cpp" "$SP/diskcache" "$SP/gguf" .devcarry/site/
find .devcarry/site \( -name "*.so" -o -name __pycache__ \) -prune -exec rm -rf {} +
cp -r "$V/CMakeLists.txt" "$V/cmake" "$V/include" "$V/src" "$V/LICENSE" "$V/vendor" .devcarry/llama.cpp/
cp -r "$V/ggml/CMakeLists.txt" "$V/ggml/cmake" "$V/ggml/include" .devcarry/llama.cpp/ggml/
for f in "$V"/ggml/src/*; do
    case $(basename "$f") in
        ggml-sycl|ggml-opencl|ggml-hexagon|ggml-metal|ggml-et|ggml-vulkan|ggml-cann|ggml-musa|ggml-zdnn|ggml-webgpu|ggml-openvino|ggml-virtgpu) ;;
        *) cp -r "$f" .devcarry/llama.cpp/ggml/src/ ;;
    esac
done
cp "$V/models/ggml-vocab-llama-spm.gguf" .devcarry/llama.cpp/models/
for t in wikitext-2/valid.txt tinyshakespeare/input.txt; do
    mkdir -p ".devcarry/data/$(dirname $t)"
    cp "../shared/data/$t" ".devcarry/data/$t"
done
du -sh .devcarry
