#!/usr/bin/env bash
# The Python tests (python/tests, pytest, CPU only on the "sim" device).
#
# Default: builds ddo._C in the project's build folder ($DDO_BUILD, shared with the C++ build,
# so ddo_torch is compiled once) and imports the package from the build tree
# (PYTHONPATH=$DDO_BUILD/python: CMake places _C next to copies of python/ddo/*.py).
# DDO_PY_INSTALL=1: instead installs the package into the venv the way users do
# (`pip install --no-build-isolation .`, scikit-build-core, build folder build-python/ reused),
# skipping the install when no source changed since the last one, and tests the installed copy.
#
# Exit status: pytest's (0 only when every test passed; "no tests collected" (5) fails too).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ddo_venv
PY="$DDO_VENV/bin/python"
TORCH_HOOK="-DCMAKE_PROJECT_INCLUDE_BEFORE=$DDO_ROOT/python/cmake/torch_prefix.cmake"

if [ "${DDO_PY_INSTALL:-0}" = 1 ]; then
  stamp="$DDO_VENV/.ddo-python-install"
  want=$(cd "$DDO_ROOT" && find pyproject.toml CMakeLists.txt cmake core engine sdnq torch tools python \
           -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.py' -o -name '*.txt' \
                      -o -name '*.cmake' -o -name '*.toml' \) -not -path 'python/tests/*' \
           -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c 'import ddo._C' 2>/dev/null; then
    echo "ddo: installing the ddo package into $DDO_VENV (pip install --no-build-isolation .)" >&2
    (cd "$DDO_ROOT" && CMAKE_BUILD_PARALLEL_LEVEL="${DDO_JOBS:-$(nproc)}" \
      "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps .)
    echo "$want" > "$stamp"
  else
    echo "ddo: the installed ddo package is up to date" >&2
  fi
  export PYTHONPATH=""
else
  ddo_configure "$TORCH_HOOK" -DDDO_BUILD_PYTHON=ON
  if ! grep -q '^DDO_BUILD_PYTHON:BOOL=ON' "$DDO_BUILD/CMakeCache.txt"; then
    cmake -S "$DDO_ROOT" -B "$DDO_BUILD" -DDDO_BUILD_PYTHON=ON "$TORCH_HOOK" >/dev/null
  fi
  cmake --build "$DDO_BUILD" --target ddo_python -j "${DDO_JOBS:-$(nproc)}"
  export PYTHONPATH="$DDO_BUILD/python"
fi

cd "$DDO_ROOT"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
"$PY" -m pytest -q -rs -p no:cacheprovider python/tests ${DDO_PYTEST_ARGS:-} 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
summary=$( (grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$log" || true) \
           | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
echo "== python tests: ${summary:-no summary} (pytest exit $rc) =="
if [ "$rc" = 5 ]; then echo "ddo: no Python tests were collected" >&2; fi
exit "$rc"
