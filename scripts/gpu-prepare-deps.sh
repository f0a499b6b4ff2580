#!/usr/bin/env bash
# Fills .deps/ (ignored by git) with the build dependencies the GPU machine lacks, so that
# scripts/gpu.sh can build ddo there: that machine reaches no registry and has no apt.
#
#   scripts/gpu-prepare-deps.sh        # here, once (needs apt-get download: a Debian/Ubuntu host)
#   device run: carry [".deps"], command "bash scripts/gpu.sh"
#
# What travels and why (see docs/design/0002-measurement.md, "The GPU script"):
#   nlohmann-json3-dev, libcli11-dev    header-only, with CMake package files
#   libfmt-dev + libfmt9                fmt headers and the shared library the fmt::fmt target links
#   libgtest-dev + libgmock-dev         GoogleTest's static libraries and CMake package files
#   libssl-dev + libssl3                OpenSSL headers and libcrypto (core hashes profile names)
# They are Debian 12 builds (glibc 2.36, GCC 12): they load on any newer glibc/libstdc++, which is
# what the GPU image (Ubuntu 24.04 with torch 2.11) has. Everything is unpacked with dpkg -x into
# .deps/root (never into /); gpu.sh points CMAKE_PREFIX_PATH at .deps/root/usr only for the
# packages the machine lacks.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEPS="$ROOT/.deps"
PKGS="nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libgtest-dev libgmock-dev libssl-dev libssl3"

mkdir -p "$DEPS/debs" "$DEPS/root"
cd "$DEPS/debs"
if ! apt-get download $PKGS >/dev/null 2>&1; then
  echo "gpu-prepare-deps: apt-get download failed; running apt-get update first" >&2
  apt-get update -q >/dev/null
  apt-get download $PKGS
fi
for deb in "$DEPS"/debs/*.deb; do dpkg -x "$deb" "$DEPS/root"; done
# Keep the tree small (it travels with every device call, 64 MiB in all): no docs, no static
# OpenSSL (the shared libcrypto is what links).
rm -rf "$DEPS/root/usr/share/doc" "$DEPS/root/usr/share/man" "$DEPS/debs"
rm -f "$DEPS"/root/usr/lib/x86_64-linux-gnu/libssl.a "$DEPS"/root/usr/lib/x86_64-linux-gnu/libcrypto.a
# dpkg -x keeps absolute symlinks of some -dev packages; make them relative so they resolve
# inside .deps wherever the tree lands.
find "$DEPS/root" -type l | while read -r link; do
  target=$(readlink "$link")
  case "$target" in
    /*) ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$DEPS/root$target")" "$link" ;;
  esac
done
grep -qx '/.deps/' "$ROOT/.gitignore" 2>/dev/null || echo "gpu-prepare-deps: add /.deps/ to .gitignore" >&2
du -sh "$DEPS" | sed 's/^/gpu-prepare-deps: .deps is /'

# Python wheels for the W1-py and W2 benchmarks (bench/python/w1_py.py, w2_py.py): the GPU image
# has torch 2.11, transformers, huggingface_hub, psutil and accelerate 1.15 but not diffusers,
# nor importlib_metadata, nor sdnq (W2's quantizer, GPL-3.0: benchmarks and tests only; it needs
# torch, diffusers, transformers and accelerate, all there then), nor diffusers-dynamic-offloader
# (W6's row beside ddo; pure Python). Pure-Python or manylinux wheels
# for CPython 3.12; gpu.sh (and gpu-w2.sh) install them into /tmp/ddo-site there. Pinned to the
# versions of python/requirements-test.txt and the project venv's sdnq.
WHL="$ROOT/.whl"
mkdir -p "$WHL"
cd "$ROOT"  # the working folder so far was .deps/debs, removed above
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHL" diffusers==0.42.1 importlib_metadata==10.2.0 lazy-importer==0.1.0 accelerate==1.15.0 \
  psutil==7.2.2 pyyaml==6.0.4 sdnq==0.2.8 diffusers-dynamic-offloader==0.1.0rc2
# The build backend of `pip install .` (scikit-build-core and what it imports), for the check that
# the package installs and runs there without gpu.sh's build (gpu.sh pipcheck).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d "$WHL" scikit_build_core==1.1.2 pathspec==1.1.1 packaging==26.4
echo "gpu-prepare-deps: .whl holds $(du -sh "$WHL" | cut -f1) of wheels" >&2
