#!/usr/bin/env bash
# Installs the Debian packages the build needs (only those missing). Python packages go into
# the project's venv (scripts/common.sh), not here.
set -euo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
pkgs="cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev libssl-dev python3-venv pkg-config doxygen"
# clang and its libFuzzer (compiler-rt) for fuzz/, ccache for every build, MinGW-w64
# and Wine for the Windows build of core + engine (.ci/run).
pkgs="$pkgs clang libclang-rt-dev ccache g++-mingw-w64-x86-64-posix wine64"
missing=$(for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  echo "ddo: installing Debian packages:" $missing >&2
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q $missing
fi
