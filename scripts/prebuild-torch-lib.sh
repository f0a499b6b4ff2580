#!/usr/bin/env bash
# Fills .prebuilt/ (git-ignored) with libddo_torch.so from this machine's build, stripped of debug
# information, and the libfmt it needs, for `scripts/gpu.sh pydiag` to swap in on the GPU machine:
# an A/B of the same sources built by this machine's compiler against the GPU image's own build.
#   scripts/prebuild-torch-lib.sh [BUILD_DIR]      (default: build, configured with CUDA)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${1:-$ROOT/build}
cmake --build "$BUILD" --target ddo_torch
grep -q "DDO_WITH_CUDA:BOOL=ON" "$BUILD/CMakeCache.txt" || { echo "$BUILD is not a CUDA build" >&2; exit 1; }
rm -rf "$ROOT/.prebuilt" && mkdir -p "$ROOT/.prebuilt"
strip --strip-debug -o "$ROOT/.prebuilt/libddo_torch.so" "$BUILD/torch/libddo_torch.so"
fmt=$(ldd "$BUILD/torch/libddo_torch.so" | awk '/libfmt/ {print $3}')
[ -n "$fmt" ] && cp -L "$fmt" "$ROOT/.prebuilt/$(basename "$(ldd "$BUILD/torch/libddo_torch.so" | awk '/libfmt/ {print $1}')")"
echo "commit $(git -C "$ROOT" rev-parse --short HEAD), $(c++ --version | head -1)" >"$ROOT/.prebuilt/ORIGIN"
ls -la "$ROOT/.prebuilt"
