# Shared by the scripts: the project's virtual environment and its build folder.
# The venv lives in a cache folder (reused across clones, created when missing): torch alone is
# a few GB, installed once.
set -euo pipefail
DDO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DDO_PY=${DDO_PYTHON:-python3}
DDO_VENV=${DDO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ddo/venv-torch2.11.0}
DDO_BUILD=${DDO_BUILD:-$DDO_ROOT/build}
# The CUDA architectures (ddo's kernels, and torch's CMake package, which would otherwise probe
# the GPU) come from CMake: cmake/DdoCudaArchs.cmake. -DDDO_CUDA_ARCHITECTURES=86 picks one.
# ccache, when installed (scripts/install-deps.sh installs it): every build of the scripts and of
# .ci/run compiles through it, with its cache beside the venv so fresh clones reuse it.
# CCACHE_BASEDIR makes paths inside the clone relative, so another clone's objects hit.
DDO_CCACHE_ARGS=()
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_DIR=${CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ddo/ccache}
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$DDO_ROOT}
  DDO_CCACHE_ARGS=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

# ddo_venv: creates the venv and installs the pinned requirements when they changed.
ddo_venv() {
  local stamp="$DDO_VENV/.ddo-requirements"
  local want
  want=$(cat "$DDO_ROOT"/python/requirements-*.txt | sha256sum | cut -c1-16)
  if [ ! -x "$DDO_VENV/bin/python" ]; then
    echo "ddo: creating the virtual environment in $DDO_VENV" >&2
    "$DDO_PY" -m venv "$DDO_VENV"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "ddo: installing pinned Python packages (torch 2.11.0 first time: a few GB)" >&2
    "$DDO_VENV/bin/pip" install -q --disable-pip-version-check \
      $(for f in "$DDO_ROOT"/python/requirements-*.txt; do echo -r "$f"; done)
    echo "$want" > "$stamp"
  fi
}

# ddo_configure [extra cmake args]: configures the full build against the venv's LibTorch.
ddo_configure() {
  ddo_venv
  local torch_prefix
  torch_prefix=$("$DDO_VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  if [ ! -f "$DDO_BUILD/build.ninja" ]; then
    cmake -S "$DDO_ROOT" -B "$DDO_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${DDO_CCACHE_ARGS[@]}" \
      -DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$DDO_VENV/bin/python" "$@" >&2
  fi
}

ddo_build() {
  ddo_configure "$@"
  cmake --build "$DDO_BUILD" -j "${DDO_JOBS:-$(nproc)}"
}
