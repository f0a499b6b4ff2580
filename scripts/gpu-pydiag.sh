#!/usr/bin/env bash
# One-off diagnosis of a crash of the ddo Python package, kept out of gpu.sh's orchestration.
# Everything goes to stdout.
#
#   bash scripts/gpu-pydiag.sh link     # how libddo_torch.so linked: libstdc++, the link line, which
#                                       # inputs define libstdc++'s symbols; a native backtrace of
#                                       # the first failing Python test (cuda-gdb, where it exists)
#   bash scripts/gpu-pydiag.sh crash    # the pybind11 ABI of torch and ddo, a minimal repro and its
#                                       # native backtrace
#   bash scripts/gpu-pydiag.sh          # both
#
# gpu.sh runs `crash` after pytest dies of a signal, and `link` as its pydiag mode. Knobs:
# DDO_GPU_BUILD (build folder, build-gpu), DDO_PYTHON (python3), CXX. The ddo package is imported
# from <build>/python ahead of PYTHONPATH. How libstdc++ must link, and why:
# cmake/DdoSharedStdlib.cmake (the ctest tests stdlib_<target> check it on every build).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHAT=${1:-all}
BUILD=${DDO_GPU_BUILD:-$ROOT/build-gpu}
PY=${DDO_PYTHON:-python3}
export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Why a library crashes inside Python and not in executables: how it was linked, which of its
# definitions are libstdc++'s and from which input, the compiler's libstdc++ macros.
link_diag() {
  local lib="$BUILD/torch/libddo_torch.so" cmd syms s x
  echo "== link diagnosis"
  echo '#include <string>' | "${CXX:-c++}" -std=c++20 -dM -E -x c++ - 2>&1 |
    grep -E "EXTERN_TEMPLATE|_GLIBCXX_RELEASE |__GLIBCXX__ |USE_CXX11_ABI|_GLIBCXX_INLINE_VERSION"
  echo "probe choice: $(grep -E '^DDO_STDLIB_LINK_(OPTIONS|LIBRARIES)' "$BUILD/CMakeCache.txt" | tr '\n' ' ')"
  cmd=$(cd "$BUILD" && ninja -t commands torch/libddo_torch.so | tail -1)
  echo "link: $cmd" | sed -E 's/ [^ ]+\.o / /g'
  readelf -d "$lib" | grep -E "NEEDED|FLAGS|SYMBOLIC|RUNPATH"
  echo "-- libstdc++-looking definitions (nm: lower case = local, u = unique, W/V = weak)"
  nm -C --defined-only "$lib" | grep -E "std::locale|codecvt|num_put|_M_insert|ios_base" | head -30
  syms=$(nm --defined-only "$lib" | awk '$3 ~ /(locale|codecvt|num_put|_M_insert)/ {print $3}' | head -6)
  echo "-- which inputs define them"
  s=""
  for x in $syms; do s="$s -Wl,-y,$x"; done
  if [ -n "$s" ]; then
    (cd "$BUILD" && eval "$(echo "$cmd" | sed -E "s# -o torch/libddo_torch.so # -o $TMP/relink.so $s #")") 2>&1 |
      head -30
  fi
  echo "-- _C module"
  nm -C --defined-only "$BUILD"/python/ddo/_C*.so | grep -cE "std::locale|codecvt|num_put|_M_insert"
  echo "-- the check of the built libraries (cmake/DdoSharedStdlib.cmake)"
  cmake -DDDO_STDLIB_CHECK="$lib;$(ls "$BUILD"/python/ddo/_C*.so 2>/dev/null | head -1)" \
    -P "$ROOT/cmake/DdoSharedStdlib.cmake" 2>&1
  if command -v cuda-gdb >/dev/null 2>&1; then
    echo "== native backtrace of the first failing Python test"
    (cd "$ROOT" && timeout 200 cuda-gdb -batch -ex run -ex "bt 30" -ex "info sharedlibrary libddo" \
      --args "$PY" -m pytest -x -q -p no:cacheprovider python/tests 2>&1) |
      grep -vE "^\[(New|Thread|Detaching)|^[.]+$" | tail -60
  fi
}

# A crash of the Python tests: the pybind11 ABI of torch and ddo, a minimal repro and, where
# cuda-gdb exists, a native backtrace.
crash_diag() {
  echo "== python crash diagnosis"
  cat >"$TMP/repro.py" <<'PYEOF'
import faulthandler, sys
faulthandler.enable()
import torch
print("torch pybind11:", [getattr(torch._C, n, None) for n in
      ("_PYBIND11_COMPILER_TYPE", "_PYBIND11_STDLIB", "_PYBIND11_BUILD_ABI")], flush=True)
import ddo
print("ddo imported from", ddo.__file__, flush=True)
for what, call in [("code_of_exception", lambda: ddo._C.code_of_exception("invalid_argument")),
                   ("config_apply bad value", lambda: ddo._C.config_apply(None, {"pin_cpu_workers": 0})),
                   ("config_apply unknown", lambda: ddo._C.config_apply(None, {"pin_memory": True}))]:
    print("try", what, flush=True)
    try:
        print("  ->", call(), flush=True)
    except Exception as e:
        print("  raised", type(e).__name__, str(e)[:120], flush=True)
PYEOF
  timeout 60 "$PY" "$TMP/repro.py" 2>&1
  echo "repro rc=$?"
  if command -v cuda-gdb >/dev/null 2>&1; then
    timeout 120 cuda-gdb -batch -ex run -ex "bt 40" -ex "info symbol \$pc" -ex "x/4i \$pc" \
      --args "$PY" "$TMP/repro.py" 2>&1 | grep -vE "^\[(New|Thread)" | tail -60
  fi
}

case "$WHAT" in
  link) link_diag ;;
  crash) crash_diag ;;
  all) link_diag; crash_diag ;;
  *) echo "usage: scripts/gpu-pydiag.sh [link|crash|all]" >&2; exit 2 ;;
esac
