#!/usr/bin/env bash
# aarch64 Linux, our stand-in for Termux and Android (both are Linux on aarch64): cross build with
# Debian's toolchain, run under qemu-user, compare with the x86-64 build on this machine.
#
#   bash scripts/test_aarch64.sh            # everything below; exit 0 = all passed
#
#   1. src_cpp/ compiles warning-free (-Wall -Wextra -Werror) with gcc and clang, for x86-64 and
#      aarch64 (scripts/check_warnings.sh)
#   2. cross build of libllama (patched llama.cpp + src_cpp), tests/cpp/test-moecache and
#      tools/moecache-run for aarch64 into build/aarch64 (ccache'd; GGML_CPU_ARM_ARCH from
#      $AARCH64_ARCH, default armv8.2-a+dotprod: any phone since 2018)
#   3. the C++ unit tests under qemu-aarch64
#   4. moecache-run --trace on the two trained models and the fixtures, under qemu (aarch64) and
#      natively (x86-64, against the package's libllama): with F16 weights the reports (selected
#      experts of every layer and token, hit masks, generated tokens, per-layer and total
#      hits/misses) must be identical or part at a near-tie that the router logits show
#      (scripts/compare_traces.py); quantized models are compared and reported (see CASES)
#
# Needs: the Python setup (bash scripts/setup.sh --no-run, run here if .venv is missing), and
# Debian's g++-aarch64-linux-gnu, qemu-user and clang (installed with apt-get when run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$(date +%s)
step() { printf '\n==> %s\n' "$*"; }
die() { echo "test_aarch64: $*" >&2; exit 2; }

need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || command -v qemu-aarch64-static >/dev/null || need+=(qemu-user)
command -v clang++ >/dev/null || need+=(clang)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        step "apt-get install ${need[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        die "missing ${need[*]}: sudo apt-get install ${need[*]}"
    fi
fi
QEMU=$(command -v qemu-aarch64 || command -v qemu-aarch64-static)
export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu

[ -x .venv/bin/python ] || bash scripts/setup.sh --no-run
VPY=$ROOT/.venv/bin/python
LIB_DIR=$("$VPY" -c "from pymoecache._lib import find_lib_dir; print(find_lib_dir())")

step "1. src_cpp: gcc and clang, x86-64 and aarch64, -Wall -Wextra -Werror"
bash scripts/check_warnings.sh

step "2. cross build for aarch64 (build/aarch64)"
ARCH=${AARCH64_ARCH:-armv8.2-a+dotprod}
cmake -S . -B build/aarch64 -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE=scripts/toolchains/aarch64-linux-gnu.cmake \
    -DMOECACHE_VENDOR=OFF -DMOECACHE_BUILD_TESTS=ON -DMOECACHE_BUILD_TOOLS=ON \
    -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$ARCH" >build/aarch64.configure.log 2>&1 \
    || { tail -30 build/aarch64.configure.log; die "cmake configure failed (build/aarch64.configure.log)"; }
cmake --build build/aarch64 --target test-moecache moecache-run -j"$(nproc)" >build/aarch64.build.log 2>&1 \
    || { tail -30 build/aarch64.build.log; die "cross build failed (build/aarch64.build.log)"; }
file build/aarch64/bin/moecache-run build/aarch64/bin/libllama.so | sed 's/, BuildID[^,]*//'

step "3. C++ unit tests under qemu-aarch64"
"$QEMU" build/aarch64/bin/test-moecache | tail -1

step "4. fixture decodes: aarch64 (qemu) vs x86-64 (native)"
"$VPY" scripts/make_test_models.py >/dev/null
mkdir -p build/x86_64
c++ -std=c++17 -O2 -Wall -Wextra -Werror tools/moecache-run.cpp -Isrc_cpp -Ivendor/llama.cpp/include \
    -Ivendor/llama.cpp/ggml/include -L"$LIB_DIR" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB_DIR" \
    -o build/x86_64/moecache-run
OUT=build/aarch64-compare
rm -rf "$OUT" && mkdir -p "$OUT"
M=tests/fixtures/models
T=models
build/x86_64/moecache-run --quantize $T/tiny-shakespeare-qwen2moe-60x4.gguf "$OUT/A.Q4_K_M.gguf" Q4_K_M 2>/dev/null
build/x86_64/moecache-run --quantize $T/tiny-shakespeare-mixtral-8x2.gguf "$OUT/B.Q8_0.gguf" Q8_0 2>/dev/null
# exact | model | routing | cache | prompt [| residency of the aarch64 run: stream or mmap; x86-64 keeps every expert resident]
# exact=1 (F16 weights): the reports must be byte-identical. exact=0: reported only (Q8_0, Q4_K,
# and the random-weight olmoe, whose router has near-ties in its top-8 even at F16).
# The quantized dot products of ggml sum in a different order with AVX2 than with NEON, so a
# logit that is within rounding of another (router near-ties, greedy near-ties) may flip, and from
# there the runs part ways. F16 kernels also sum in blocks as wide as the SIMD registers, so F16
# runs can part too, less often. exact=1 (F16) means: identical, or parted at a near-tie, which
# scripts/compare_traces.py checks from the router logits (`z` lines): every z agrees within
# rounding up to the selection that differs. A larger difference fails. exact=0: reported only.
CASES=(
    "1|$T/tiny-shakespeare-qwen2moe-60x4.gguf|prior:0.5|0.5|ROMEO:"
    "1|$T/tiny-shakespeare-qwen2moe-60x4.gguf|max-rank:8:j=2|15|KING HENRY:"
    "1|$T/tiny-shakespeare-mixtral-8x2.gguf|prior:0.5:j=1|4|ROMEO:"
    "1|$T/tiny-shakespeare-mixtral-8x2.gguf|topk|0.25|First Citizen:"
    "1|$M/qwen2moe-60x4.gguf|prior:0.5|0.5|It was a bright cold day"
    "1|$M/mixtral-8x2.gguf|prior:0.5:j=1|4|It was a bright cold day"
    "1|$M/deepseek2-sigmoid-64x6.gguf|topk|0.25|It was a bright cold day"
    "1|$T/tiny-shakespeare-qwen2moe-60x4.gguf|prior:0.5|0.25|ROMEO:|stream"
    "1|$M/deepseek2-sigmoid-64x6.gguf|prior:0.5|4|It was a bright cold day|stream"
    "1|$M/mixtral-8x2.gguf|topk|0.5|It was a bright cold day|mmap"
    "0|$M/olmoe-64x8.gguf|cumsum:0.9|32|It was a bright cold day"
    "0|$OUT/A.Q4_K_M.gguf|max-rank:8:j=2|15|KING HENRY:"
    "0|$OUT/B.Q8_0.gguf|prior:0.5:j=1|4|KING HENRY:"
    "0|$M/qwen2moe-60x4.Q8_0.gguf|prior:0.5|0.5|Once upon a time, in a land far away"
)
fail=0
for c in "${CASES[@]}"; do
    IFS='|' read -r exact model routing cache prompt residency <<<"$c"
    residency=${residency:-none}
    name=$(basename "$model" .gguf)_${routing//:/-}_${residency}
    args=(-m "$model" -p "$prompt" -n 24 -t 2 --cache "$cache" --routing "$routing" --trace)
    build/x86_64/moecache-run "${args[@]}" >"$OUT/$name.x86_64.txt" 2>"$OUT/$name.x86_64.log"
    "$QEMU" build/aarch64/bin/moecache-run "${args[@]}" --residency "$residency" \
        >"$OUT/$name.aarch64.txt" 2>"$OUT/$name.aarch64.log"
    n_sel=$(grep -c '^sel ' "$OUT/$name.x86_64.txt" || true)
    total=$(grep '^total ' "$OUT/$name.aarch64.txt" | sed 's/^total //')
    if [ "$n_sel" -gt 0 ] && cmp -s "$OUT/$name.x86_64.txt" "$OUT/$name.aarch64.txt"; then
        echo "same  $name: $n_sel (layer, token) selections, $total"
    elif [ "$exact" = 1 ] && verdict=$("$VPY" scripts/compare_traces.py "$OUT/$name.x86_64.txt" "$OUT/$name.aarch64.txt"); then
        case "$verdict" in
            same*) echo "same  $name: $n_sel (layer, token) selections, $total (router logits within rounding)";;
            *)     echo "tie   $name: $verdict";;
        esac
    elif [ "$exact" = 1 ]; then
        echo "DIFF  $name ($n_sel selections): $verdict"
        diff <(grep -v '^z ' "$OUT/$name.x86_64.txt") <(grep -v '^z ' "$OUT/$name.aarch64.txt") | head -8 || true
        fail=1
    else
        # the first line where the two reports part, and how much of the trace still agrees
        first=$( (cmp "$OUT/$name.x86_64.txt" "$OUT/$name.aarch64.txt" || true) | sed 's/.*line //')
        n_same=$(grep '^sel ' "$OUT/$name.x86_64.txt" | grep -cxFf <(grep '^sel ' "$OUT/$name.aarch64.txt") || true)
        echo "near  $name (reported only): reports part at line $first" \
             "($(sed -n "${first}p" "$OUT/$name.x86_64.txt" | cut -c1-40)...); $n_same of $n_sel selection lines identical"
        echo "      x86-64:  $(grep '^total ' "$OUT/$name.x86_64.txt" | sed 's/^total //')"
        echo "      aarch64: $total"
    fi
done
echo "reports: $OUT/*.txt (stdout of moecache-run), logs: $OUT/*.log"
echo "wall time: $(( $(date +%s) - T0 )) s"
[ "$fail" = 0 ] || die "aarch64 and x86-64 differ"
echo "test_aarch64: passed"
