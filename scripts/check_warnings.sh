#!/usr/bin/env bash
# src_cpp/, tools/ and tests/cpp/ must compile warning-free with gcc and clang, -Wall -Wextra, for
# x86-64 and aarch64 (Debian's g++-aarch64-linux-gnu, clang --target). Each file is compiled to
# object code at -O2, so the optimiser's warnings count too; -Werror turns any warning into a
# failure. Compilers that are not installed are skipped with a note.
#
#   bash scripts/check_warnings.sh           (needs vendor/llama.cpp: scripts/vendor_llama_cpp.py)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f vendor/llama.cpp/include/llama.h ] || { echo "check_warnings: vendor/llama.cpp missing" >&2; exit 2; }

INC=(-Isrc_cpp -Ivendor/llama.cpp/include -Ivendor/llama.cpp/ggml/include -Ivendor/llama.cpp/src
     -Ivendor/llama.cpp/ggml/src)
FILES=(src_cpp/*.cpp tools/moecache-run.cpp
       tests/cpp/test-moecache.cpp)
# name | compiler and target flags
COMPILERS=(
    "gcc x86-64|g++"
    "clang x86-64|clang++"
    "gcc aarch64|aarch64-linux-gnu-g++"
    "clang aarch64|clang++ --target=aarch64-linux-gnu"
)
checked=0
for c in "${COMPILERS[@]}"; do
    IFS='|' read -r name cmd <<<"$c"
    read -r -a cc <<<"$cmd"
    if ! command -v "${cc[0]}" >/dev/null; then
        echo "skip  $name: ${cc[0]} not installed"
        continue
    fi
    for f in "${FILES[@]}"; do
        "${cc[@]}" -std=c++17 -O2 -Wall -Wextra -Werror -c -o /dev/null "${INC[@]}" "$f"
    done
    echo "clean $name: ${#FILES[@]} files, -Wall -Wextra -Werror"
    checked=$((checked + 1))
done
[ "$checked" -gt 0 ] || { echo "check_warnings: no compiler found" >&2; exit 2; }
