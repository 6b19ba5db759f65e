#!/usr/bin/env bash
# Android (arm64-v8a) with the NDK: the shared libraries (libllama with our src_cpp, libggml*) and
# two programs to run with `adb shell`: moecache-run (tools/moecache-run.cpp: load a GGUF, route,
# generate, print the selected experts and hit rates) and test-moecache (the C++ unit tests).
#
#   ANDROID_NDK=/path/to/android-ndk-r27 bash scripts/build_android.sh [extra cmake args]
#
# Environment:
#   ANDROID_NDK (or ANDROID_NDK_HOME, ANDROID_NDK_ROOT)  the NDK (r23 or newer); required
#   ANDROID_PLATFORM   minimum API level (default android-28)
#   ANDROID_ARCH       GGML_CPU_ARM_ARCH (default armv8.2-a+dotprod: any phone since 2018)
#   BUILD_DIR          (default build/android-arm64-v8a)
#
# Output: $BUILD_DIR/bin/{moecache-run,test-moecache,libllama.so,libggml*.so}. On the phone:
#
#   adb shell mkdir -p /data/local/tmp/pymoecache
#   adb push build/android-arm64-v8a/bin/. /data/local/tmp/pymoecache/
#   adb push model.gguf /data/local/tmp/pymoecache/
#   adb shell 'cd /data/local/tmp/pymoecache && LD_LIBRARY_PATH=. ./test-moecache | tail -1'
#   adb shell 'cd /data/local/tmp/pymoecache && LD_LIBRARY_PATH=. ./moecache-run -m model.gguf \
#              -p "Once upon a time" -n 64 -t 4 --cache 0.5 --routing prior:0.5'
#
# mlock on Android: RLIMIT_MEMLOCK of `adb shell` and of apps is small (64 KiB on most devices)
# and cannot be raised without root, so --mlock warns and the run continues unlocked. With root:
# adb shell su -c 'ulimit -l unlimited && cd /data/local/tmp/pymoecache && LD_LIBRARY_PATH=. ./moecache-run ... --mlock'.
# This script is not run by CI (no NDK there); scripts/test_aarch64.sh tests the same code on
# aarch64 Linux under qemu.
set -euo pipefail
cd "$(dirname "$0")/.."

NDK=${ANDROID_NDK:-${ANDROID_NDK_HOME:-${ANDROID_NDK_ROOT:-}}}
if [ -z "$NDK" ]; then
    echo "build_android: set ANDROID_NDK to the Android NDK (r23 or newer), e.g." >&2
    echo "  ANDROID_NDK=\$HOME/Android/Sdk/ndk/27.2.12479018 bash scripts/build_android.sh" >&2
    echo "  (Android Studio > SDK Manager > SDK Tools > NDK, or https://developer.android.com/ndk/downloads)" >&2
    exit 2
fi
TOOLCHAIN=$NDK/build/cmake/android.toolchain.cmake
if [ ! -f "$TOOLCHAIN" ]; then
    echo "build_android: $NDK is not an NDK: $TOOLCHAIN is missing" >&2
    exit 2
fi
BUILD_DIR=${BUILD_DIR:-build/android-arm64-v8a}

python3 scripts/vendor_llama_cpp.py
# OpenMP off: the NDK's libomp is not on the device; ggml's own thread pool is used instead
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN" -DANDROID_ABI=arm64-v8a \
    -DANDROID_PLATFORM="${ANDROID_PLATFORM:-android-28}" \
    -DMOECACHE_VENDOR=OFF -DMOECACHE_BUILD_TESTS=ON -DMOECACHE_BUILD_TOOLS=ON \
    -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="${ANDROID_ARCH:-armv8.2-a+dotprod}" -DGGML_OPENMP=OFF \
    "$@"
cmake --build "$BUILD_DIR" --target test-moecache moecache-run -j"$(nproc 2>/dev/null || echo 4)"
echo
echo "built for Android arm64-v8a in $BUILD_DIR/bin:"
ls -1 "$BUILD_DIR"/bin | sed 's/^/  /'
echo "next: adb push $BUILD_DIR/bin/. /data/local/tmp/pymoecache/ (see the top of this script)"
