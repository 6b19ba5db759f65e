# Cross compiling for aarch64 Linux with Debian's toolchain (apt-get install g++-aarch64-linux-gnu).
# Used by scripts/test_aarch64.sh; the binaries run under qemu-aarch64 -L /usr/aarch64-linux-gnu.
#
#   cmake -S . -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=scripts/toolchains/aarch64-linux-gnu.cmake \
#         -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8-a
#
# Set MOECACHE_AARCH64_CC=clang to cross compile with clang (--target=aarch64-linux-gnu) instead.
set(CMAKE_SYSTEM_NAME      Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(_triple aarch64-linux-gnu)
if ("$ENV{MOECACHE_AARCH64_CC}" STREQUAL "clang")
    set(CMAKE_C_COMPILER           clang)
    set(CMAKE_CXX_COMPILER         clang++)
    set(CMAKE_C_COMPILER_TARGET    ${_triple})
    set(CMAKE_CXX_COMPILER_TARGET  ${_triple})
else()
    set(CMAKE_C_COMPILER   ${_triple}-gcc)
    set(CMAKE_CXX_COMPILER ${_triple}-g++)
endif()

set(CMAKE_FIND_ROOT_PATH /usr/${_triple})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# lets CMake run test programs (try_run) under emulation
find_program(_qemu NAMES qemu-aarch64 qemu-aarch64-static)
if (_qemu)
    set(CMAKE_CROSSCOMPILING_EMULATOR ${_qemu};-L;/usr/${_triple})
endif()
