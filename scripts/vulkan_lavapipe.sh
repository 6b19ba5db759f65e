#!/usr/bin/env bash
# Prepare a Debian/Ubuntu machine without a GPU to build and test pymoecache's Vulkan path on
# Mesa's lavapipe (a Vulkan driver that runs shaders on the CPU): tests/test_gpu_layers_vulkan.py.
# Installs glslc, the Vulkan loader and headers, SPIR-V headers (ggml-vulkan's find_package(SPIRV-Headers))
# and lavapipe with apt (as root), and where the
# distribution's headers are older than ggml's Vulkan backend needs (VK_EXT_layer_settings, from
# Vulkan-Headers 1.3.272; Debian 12 has 1.3.239) fetches Debian 13's libvulkan-dev package and
# unpacks only its headers into build/vulkan-headers (the system's apt sources are not touched).
#
# On success prints the CMake options for the build on stdout, e.g.
#   CMAKE_ARGS="$(bash scripts/vulkan_lavapipe.sh)" bash scripts/test.sh
# and exits 1 with the reason on stderr where it cannot (not root, no apt, no network): the
# Vulkan tests are then skipped. .ci/run does this.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "vulkan_lavapipe: $*" >&2; }

# every Debian package the Vulkan build and its tests need; has_all checks one file of each
PKGS=(glslc libvulkan-dev spirv-headers mesa-vulkan-drivers)
has_all() {
    command -v glslc >/dev/null && [ -f /usr/include/vulkan/vulkan_core.h ] &&
        compgen -G "/usr/*/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null &&
        ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1
}
if ! has_all; then
    command -v apt-get >/dev/null || { say "no apt-get: install glslc, the Vulkan headers and lavapipe yourself"; exit 1; }
    [ "$(id -u)" = 0 ] || { say "not root: cannot apt-get install ${PKGS[*]}"; exit 1; }
    say "apt-get install ${PKGS[*]}"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${PKGS[@]}"; } >&2 || { say "apt-get failed"; exit 1; }
    has_all || { say "still missing glslc, the Vulkan or SPIR-V headers or lavapipe after apt-get"; exit 1; }
fi

INC=/usr/include
if ! grep -q VkLayerSettingEXT /usr/include/vulkan/vulkan_core.h; then
    INC=$PWD/build/vulkan-headers/usr/include
    if ! grep -qs VkLayerSettingEXT "$INC/vulkan/vulkan_core.h"; then
        say "the system's Vulkan headers are too old for ggml; fetching Debian 13's libvulkan-dev for its headers"
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        mkdir -p "$tmp/lists/partial" "$tmp/archives/partial"
        echo "deb http://deb.debian.org/debian trixie main" >"$tmp/sources.list"
        APT=(-o Dir::Etc::SourceList="$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o Dir::State::Lists="$tmp/lists" -o Dir::Cache="$tmp/cache" -o Dir::Cache::Archives="$tmp/archives"
             -o APT::Sandbox::User=root)
        { apt-get "${APT[@]}" update -qq && (cd "$tmp" && apt-get "${APT[@]}" download libvulkan-dev); } >&2 ||
            { say "could not fetch libvulkan-dev from Debian 13"; exit 1; }
        rm -rf build/vulkan-headers
        mkdir -p build/vulkan-headers
        dpkg-deb -x "$tmp"/libvulkan-dev_*.deb "$tmp/pkg"
        cp -r "$tmp/pkg/usr" build/vulkan-headers/
        grep -qs VkLayerSettingEXT "$INC/vulkan/vulkan_core.h" || { say "Debian 13's headers lack it too"; exit 1; }
    fi
fi
echo "-DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$INC"
