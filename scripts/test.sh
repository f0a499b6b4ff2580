#!/usr/bin/env bash
# The README's test command: builds everything against the pinned torch, runs the C++ tests
# (GPU-labelled tests skip, saying so, without a GPU) and the Python tests.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ddo_build
cd "$DDO_BUILD"
ctest --output-on-failure -j "${DDO_JOBS:-$(nproc)}" ${DDO_CTEST_ARGS:-}
if [ -d "$DDO_ROOT/python/tests" ] && [ -f "$DDO_ROOT/pyproject.toml" ]; then
  "$DDO_ROOT/scripts/python-tests.sh"
fi
