#!/usr/bin/env bash
# Builds ddo on the GPU machine against that machine's torch, runs every test (GPU ones included)
# and the benchmarks, and leaves logs and result files in $OUT. One device call; each step has
# its own time limit so the whole stays inside one call's 10 minutes.
#
#   scripts/gpu-prepare-deps.sh                       # here, once: fills .deps/ and .whl/ (ignored)
#   device run, carry [".deps", ".whl"]:
#     DDO_COMMIT=<sha> bash scripts/gpu.sh            # build, tests, micro-benchmarks, W1
#     DDO_COMMIT=<sha> bash scripts/gpu.sh test       # build and tests only
#     DDO_W1_CAPS=8,12 bash scripts/gpu.sh w1         # build and W1 for some caps only
#     DDO_SKIP_BUILD=1 bash scripts/gpu.sh py         # W1-py (diffusers) on the build already there
#     bash scripts/gpu.sh pydiag                      # how libddo_torch.so links; a Python crash's backtrace
#
# Steps (a mode runs a subset): build (C++ and, where Python headers exist, the ddo package),
# test (ctest, then pytest on the build tree), micro (copy_engine, op_overhead), w1, py (W1-py:
# bench/python/w1_py.py, diffusers from the wheels in .whl). DDO_W1_EXTRA: flags of a second W1
# invocation run after the first (its table goes to log.txt only). Knobs:
# DDO_GPU_JOBS (16), DDO_W1_SIZE (full), DDO_W1_CAPS (8,12,16,24,0), DDO_W1_STEPS (5),
# DDO_W1_ROUTES (calibrated,block,leaf), DDO_W1_ARGS (more w1 flags), DDO_BUILD_TYPE (Release),
# DDO_GPU_BUILD (build folder, build-gpu), DDO_SKIP_BUILD=1 (use the build folder as it is),
# DDO_FORCE_DEPS=1 (take every dependency from .deps, to test the carried copies), DDO_CMAKE_ARGS
# (more configure flags).
#
# The GPU machine reaches no registry: nlohmann-json, CLI11, fmt, GoogleTest and OpenSSL headers
# come from .deps/ when the machine lacks them (scripts/gpu-prepare-deps.sh says what and why).
# Without a GPU (here) the same script builds, runs the CPU tests and the benchmarks on the host
# simulation (tiny model), and GPU tests skip saying "no CUDA GPU".
#
# $OUT receives at most 8 files (the device tool's limit): summary.txt, log.txt (build, ctest,
# pytest and benchmark output), copy_engine.json, op_overhead.json, w1.json, w1.md, w1py.json,
# w1py.md.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
MODE=${1:-all}
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
BUILD=${DDO_GPU_BUILD:-$ROOT/build-gpu}
JOBS=${DDO_GPU_JOBS:-16}
PY=${DDO_PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
LOG="$OUT/log.txt"
T_START=$(date +%s)
export PYTHONUNBUFFERED=1 DDO_COMMIT=${DDO_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

say() { echo "gpu.sh [$(($(date +%s) - T_START))s] $*" | tee -a "$SUMMARY"; }

: >"$SUMMARY"
: >"$LOG"
say "mode=$MODE commit=$DDO_COMMIT"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$SUMMARY"
  HAVE_GPU=1
else
  say "no nvidia-smi: no GPU here; GPU tests skip and benchmarks run on the host simulation"
  HAVE_GPU=0
fi

# --- dependencies -------------------------------------------------------------------------------
TORCH_PREFIX=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || {
  say "FATAL: $PY cannot import torch; set DDO_PYTHON to the python that has torch 2.11"
  exit 1
}
say "torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)') at $TORCH_PREFIX"
DEPS_ROOT="$ROOT/.deps/root/usr"
have_cmake_pkg() {  # a CMake package config installed on the system
  local d
  for d in /usr/lib/cmake /usr/share/cmake /usr/lib/x86_64-linux-gnu/cmake /usr/local/lib/cmake \
    /usr/local/share/cmake; do
    [ -d "$d/$1" ] && return 0
  done
  return 1
}
missing=""
for pkg in nlohmann_json CLI11 fmt GTest; do have_cmake_pkg "$pkg" || missing="$missing $pkg"; done
[ -f /usr/include/openssl/evp.h ] || missing="$missing OpenSSL"
# DDO_FORCE_DEPS=1 uses .deps for everything (to test the carried copies on a full machine).
[ "${DDO_FORCE_DEPS:-0}" = 1 ] && missing=" nlohmann_json CLI11 fmt GTest OpenSSL"
PREFIX="$TORCH_PREFIX"
EXTRA=()
if [ -n "$missing" ]; then
  if [ ! -d "$DEPS_ROOT" ]; then
    say "FATAL: missing here:$missing; run scripts/gpu-prepare-deps.sh where apt works and carry .deps"
    exit 1
  fi
  say "using .deps for:$missing"
  PREFIX="$DEPS_ROOT;$TORCH_PREFIX"
  case "$missing" in *OpenSSL*)
    # Debian's OpenSSL keeps configuration.h in the multiarch include folder, which the compiler
    # searches only under /usr/include.
    EXTRA+=("-DOPENSSL_ROOT_DIR=$DEPS_ROOT" "-DCMAKE_CXX_FLAGS=-isystem $DEPS_ROOT/include/x86_64-linux-gnu")
    export LD_LIBRARY_PATH="$DEPS_ROOT/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
  case "$missing" in *fmt*)
    export LD_LIBRARY_PATH="$DEPS_ROOT/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
fi

# --- build --------------------------------------------------------------------------------------
# TORCH_CUDA_ARCH_LIST: torch's CMake otherwise compiles a GPU probe with the project's C++20
# setting, which nvcc's CMake support rejects; the H200 is compute capability 9.0.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
# The compiler: a distribution g++ where the image has one, else the image's own (/opt/gcc, GCC
# 13.3), whose static libstdc++ the probe below keeps out of the shared libraries.
if [ -z "${CXX:-}" ]; then
  for c in /usr/bin/g++ /usr/bin/g++-13 /usr/bin/g++-14 /usr/bin/g++-12; do
    if [ -x "$c" ]; then export CXX="$c" CUDAHOSTCXX="$c"; break; fi
  done
fi
if [ -z "${CXX:-}" ]; then
  # No distribution g++: the image's g++ is a wrapper around g++-real; use the real driver.
  gxx=$(command -v g++ || true)
  if [ -n "$gxx" ] && [ "$(head -c2 "$gxx" 2>/dev/null)" = "#!" ]; then
    { echo "== $gxx is a script:"; head -40 "$gxx"; } >>"$LOG"
    real=$(command -v g++-real || true)
    [ -z "$real" ] && [ -x "$(dirname "$gxx")/g++-real" ] && real="$(dirname "$gxx")/g++-real"
    [ -n "$real" ] && export CXX="$real" CUDAHOSTCXX="$real"
  fi
fi
say "C++ compiler: ${CXX:-$(command -v c++)} ($(${CXX:-c++} --version | head -1))"

# libstdc++ must be the process's one shared copy. The image's g++ linked a static copy into
# libddo_torch.so (iostream and locale code defined in the library); inside Python, next to torch's
# shared libstdc++.so.6, that copy crashed on its first formatted number
# (bench/results/2026-12-03-h200-python-crash/). Probe: link a small shared library that formats a
# number; if it defines std::locale::classic() itself, libstdc++ went in statically, and the
# shared libraries are linked against the libstdc++.so.6 torch loads instead, by the first way
# that gives a probe with no copy and no unresolved symbol.
STDLIB=()
# Matched in bash, not piped into grep -q: under pipefail an early grep exit fails the producer.
needs_shared_stdlib() { [[ $(readelf -d "$1" 2>&1) == *NEEDED*libstdc++* ]]; }
probe_stdlib() {  # probe_stdlib OUTPUT FLAGS...: 0 when OUTPUT links and holds no libstdc++ copy
  local so=$1
  shift
  "${CXX:-c++}" -shared -fPIC -O1 "$PROBE/p.cpp" -o "$so" -Wl,-z,defs "$@" >>"$LOG" 2>&1 || return 2
  needs_shared_stdlib "$so" && ! [[ $(nm --defined-only "$so" 2>&1) =~ _ZNSt6locale7classicEv|num_put ]]
}
PROBE="$OUT/.probe"
mkdir -p "$PROBE"
printf '%s\n' '#include <sstream>' '#include <string>' \
  'std::string ddo_probe(long v) { std::ostringstream s; s << v; return s.str(); }' >"$PROBE/p.cpp"
{
  echo "== libstdc++ probe"
  echo "libstdc++.so: $(${CXX:-c++} -print-file-name=libstdc++.so)  libstdc++.a: $(${CXX:-c++} -print-file-name=libstdc++.a)"
  ${CXX:-c++} -dumpspecs 2>/dev/null | grep -n -B1 -A1 -iE 'static-libstdc|lstdc' | head -20
} >>"$LOG"
if probe_stdlib "$PROBE/default.so"; then
  say "libstdc++: linked shared by default"
else
  SYS_STDCXX=$(ldd "$(dirname "$TORCH_PREFIX")/../lib/libc10.so" 2>/dev/null | awk '/libstdc\+\+/ {print $3}')
  [ -f "${SYS_STDCXX:-}" ] || SYS_STDCXX=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  say "libstdc++: the default link holds a static copy; torch loads ${SYS_STDCXX:-nothing found}"
  mkdir -p "$BUILD/stdlib" && ln -sf "$SYS_STDCXX" "$BUILD/stdlib/libstdc++.so"
  if probe_stdlib "$PROBE/a.so" "-L$BUILD/stdlib"; then
    STDLIB=("-L$BUILD/stdlib")
  elif probe_stdlib "$PROBE/b.so" -nostdlib++ "$SYS_STDCXX"; then
    STDLIB=(-nostdlib++ "$SYS_STDCXX")
  elif probe_stdlib "$PROBE/c.so" -nodefaultlibs "$SYS_STDCXX" -lm -lc -lgcc_s -lgcc; then
    STDLIB=(-nodefaultlibs "$SYS_STDCXX" -lm -lc -lgcc_s -lgcc)
  fi
  if [ ${#STDLIB[@]} -gt 0 ]; then
    say "libstdc++: shared libraries link with: ${STDLIB[*]}"
    EXTRA+=("-DCMAKE_SHARED_LINKER_FLAGS=${STDLIB[*]}" "-DCMAKE_MODULE_LINKER_FLAGS=${STDLIB[*]}"
      "-DCMAKE_EXE_LINKER_FLAGS=${STDLIB[*]}")
  else
    say "WARNING: no way found to link the shared libstdc++; the Python package may crash (log.txt)"
  fi
fi
rm -rf "$PROBE"

# The ddo Python package (ddo._C) is built in the same tree when the interpreter has its headers.
PYBUILD=()
if "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  PYBUILD=(-DDDO_BUILD_PYTHON=ON "-DCMAKE_PROJECT_INCLUDE_BEFORE=$ROOT/python/cmake/torch_prefix.cmake")
else
  say "no Python.h for $PY: the ddo Python package is not built (py step unavailable)"
fi
build() {
  if [ "${DDO_SKIP_BUILD:-0}" = 1 ]; then say "build skipped (DDO_SKIP_BUILD=1): using $BUILD"; return 0; fi
  echo "== build" >>"$LOG"
  # Configured every time: a build folder kept from an earlier call gets this call's flags.
  timeout 120 cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE="${DDO_BUILD_TYPE:-Release}" \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_CUDA_ARCHITECTURES=90 "${EXTRA[@]}" "${PYBUILD[@]}" \
    -DPython3_EXECUTABLE="$(command -v "$PY")" -DPython_EXECUTABLE="$(command -v "$PY")" \
    ${DDO_CMAKE_ARGS:-} \
    >>"$LOG" 2>&1 || { say "FAIL: configure (log.txt)"; tail -30 "$LOG"; return 1; }
  timeout "${DDO_BUILD_TIMEOUT:-330}" cmake --build "$BUILD" -j "$JOBS" >>"$LOG" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    say "FAIL: build rc=$rc (log.txt)"; grep -E "error|FAILED" "$LOG" | head -20; return 1
  fi
  say "build ok"
  local lib="$BUILD/torch/libddo_torch.so"
  if [ -f "$lib" ] && command -v nm >/dev/null 2>&1; then
    # iostream internals compiled into the library (see Note [No iostreams] in status.h).
    say "iostream symbols defined in libddo_torch.so: $(nm -C --defined-only "$lib" | grep -cE '_M_insert<|num_put<.*>::id|basic_ostream<')"
  fi
  if [ -f "$lib" ]; then
    if needs_shared_stdlib "$lib"; then
      say "libddo_torch.so needs the shared libstdc++"
    else
      say "WARNING: libddo_torch.so holds a static libstdc++ (no NEEDED libstdc++.so); the Python package will crash next to torch's shared one"
    fi
  fi
}

# Wheels the GPU machine lacks (diffusers, accelerate, ...), installed once into /tmp/site.
SITE=/tmp/ddo-site
install_wheels() {
  if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 && [ ! -f "$SITE/.done" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$ROOT"/.whl/*.whl >>"$LOG" 2>&1 && touch "$SITE/.done" ||
      say "wheel install from .whl failed (log.txt)"
  fi
  export PYTHONPATH="$BUILD/python${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
}

run_tests() {
  local tlog="$OUT/.ctest.txt"
  # GPU tests run alone (-j 1 for label gpu): they measure the card's memory.
  # Tests that use the card run one at a time: they measure its memory (label gpu, and the
  # CUDA cases of the torch and engine labels, which skip without a GPU).
  local rc=0
  if [ "${DDO_GPU_TESTS_ONLY:-0}" != 1 ]; then
    (cd "$BUILD" && timeout "${DDO_TEST_TIMEOUT:-150}" ctest --output-on-failure --timeout 120 \
      -j "${DDO_CTEST_JOBS:-4}" -LE 'gpu|torch' -E 'cuda|Cuda') >"$tlog" 2>&1 || rc=$?
    (cd "$BUILD" && timeout 200 ctest --output-on-failure --timeout 120 -L torch) >>"$tlog" 2>&1 || rc=$?
    (cd "$BUILD" && timeout 100 ctest --output-on-failure --timeout 60 -LE 'gpu|torch' -R 'cuda|Cuda') \
      >>"$tlog" 2>&1 || rc=$?
  fi
  (cd "$BUILD" && timeout 150 ctest --output-on-failure --timeout 120 -L gpu) >>"$tlog" 2>&1 || rc=$?
  cat "$tlog" >>"$LOG"
  say "ctest rc=$rc: $(grep -E 'tests passed|tests failed' "$tlog" | tr '\n' ' ')"
  grep -E "^\s*[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess)" "$tlog" | head -20 | tee -a "$SUMMARY"
  echo "GPU tests: $(grep -cE 'Test +#[0-9]+: CudaOffload.*Passed' "$tlog") CudaOffload passed; skipped for lack of a GPU: $(grep -c 'no CUDA GPU' "$tlog")" | tee -a "$SUMMARY"
  rm -f "$tlog"
  if [ ${#PYBUILD[@]} -gt 0 ]; then
    install_wheels
    echo "== pytest" >>"$LOG"
    (cd "$ROOT" && timeout 120 "$PY" -m pytest -q -p no:cacheprovider python/tests) >>"$LOG" 2>&1
    local prc=$?
    say "pytest rc=$prc: $(grep -E '[0-9]+ (passed|failed)' "$LOG" | tail -1)"
    [ $prc -ge 128 ] && py_crash_diag
  fi
}

# A crash of the Python tests: the pybind11 ABI of torch and ddo, a minimal repro and, where
# cuda-gdb exists, a native backtrace, all into log.txt.
py_crash_diag() {
  echo "== python crash diagnosis" >>"$LOG"
  cat >"$OUT/.repro.py" <<'PYEOF'
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
  timeout 60 "$PY" "$OUT/.repro.py" >>"$LOG" 2>&1
  echo "repro rc=$?" >>"$LOG"
  if command -v cuda-gdb >/dev/null 2>&1; then
    timeout 120 cuda-gdb -batch -ex run -ex "bt 40" -ex "info symbol \$pc" -ex "x/4i \$pc" \
      --args "$PY" "$OUT/.repro.py" 2>&1 | grep -vE "^\[(New|Thread)" | tail -60 >>"$LOG"
  fi
  rm -f "$OUT/.repro.py"
}

# Why the library crashes inside Python and not in executables: how libddo_torch.so was linked,
# which of its definitions are libstdc++'s and from which input, the compiler's libstdc++ macros,
# and a native backtrace of the first failing Python test.
link_diag() {
  local lib="$BUILD/torch/libddo_torch.so" cmd syms s
  install_wheels
  {
    echo "== link diagnosis"
    echo '#include <string>' | "${CXX:-c++}" -std=c++20 -dM -E -x c++ - 2>&1 |
      grep -E "EXTERN_TEMPLATE|_GLIBCXX_RELEASE |__GLIBCXX__ |USE_CXX11_ABI|_GLIBCXX_INLINE_VERSION"
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
      (cd "$BUILD" && eval "$(echo "$cmd" | sed -E "s# -o torch/libddo_torch.so # -o $OUT/.relink.so $s #")") 2>&1 |
        head -30
      rm -f "$OUT/.relink.so"
    fi
    echo "-- _C module"
    nm -C --defined-only "$BUILD"/python/ddo/_C*.so | grep -cE "std::locale|codecvt|num_put|_M_insert"
  } >>"$LOG" 2>&1
  if command -v cuda-gdb >/dev/null 2>&1; then
    echo "== native backtrace of the first failing Python test" >>"$LOG"
    (cd "$ROOT" && timeout 200 cuda-gdb -batch -ex run -ex "bt 30" -ex "info sharedlibrary libddo" \
      --args "$PY" -m pytest -x -q -p no:cacheprovider python/tests 2>&1) |
      grep -vE "^\[(New|Thread|Detaching)|^[.]+$" | tail -60 >>"$LOG"
  fi
}

bench() {  # bench NAME TIMEOUT ARGS...
  local name=$1 limit=$2
  shift 2
  local exe
  exe=$(find "$BUILD" -maxdepth 3 -type f -name "$name" -perm -u+x | head -1)
  if [ -z "$exe" ]; then say "FAIL: no $name executable"; return 1; fi
  echo "== $name $*" >>"$LOG"
  timeout "$limit" "$exe" "$@" >>"$LOG" 2>&1
  local rc=$?
  say "$name rc=$rc"
  return $rc
}

micro() {
  bench copy_engine 90 --out "$OUT/copy_engine.json" --commit "$DDO_COMMIT"
  bench op_overhead 60 --out "$OUT/op_overhead.json" --commit "$DDO_COMMIT"
}

w1() {
  local size=${DDO_W1_SIZE:-full} caps=${DDO_W1_CAPS:-8,12,16,24,0}
  if [ "$HAVE_GPU" = 0 ]; then size=${DDO_W1_SIZE:-tiny}; caps=${DDO_W1_CAPS:-0.02,0}; fi
  # What is left of a 9.5-minute call, less 20 s to write results.
  local left=$((570 - ($(date +%s) - T_START) - 20))
  [ $left -lt 60 ] && left=60
  # shellcheck disable=SC2086
  bench w1 "$left" --size "$size" --caps "$caps" --steps "${DDO_W1_STEPS:-5}" \
    --routes "${DDO_W1_ROUTES:-calibrated,block,leaf}" --out "$OUT/w1.json" --md "$OUT/w1.md" \
    --commit "$DDO_COMMIT" ${DDO_W1_ARGS:-}
  [ -f "$OUT/w1.md" ] && cat "$OUT/w1.md" | tee -a "$SUMMARY"
  if [ -n "${DDO_W1_EXTRA:-}" ]; then
    left=$((570 - ($(date +%s) - T_START) - 20))
    [ $left -lt 60 ] && left=60
    # shellcheck disable=SC2086
    bench w1 "$left" --size "$size" --steps "${DDO_W1_STEPS:-5}" --commit "$DDO_COMMIT" $DDO_W1_EXTRA
  fi
}

py() {
  if [ ${#PYBUILD[@]} -eq 0 ]; then say "FAIL: py step needs the ddo Python package"; return 1; fi
  install_wheels
  local left=$((570 - ($(date +%s) - T_START) - 20)) size=${DDO_W1_SIZE:-full} dev=()
  [ "$HAVE_GPU" = 0 ] && { size=${DDO_W1_SIZE:-tiny}; dev=(--device sim); }
  echo "== w1_py" >>"$LOG"
  # shellcheck disable=SC2086
  timeout "$left" "$PY" "$ROOT/bench/python/w1_py.py" --size "$size" "${dev[@]}" \
    ${DDO_W1PY_CAPS:+--caps "$DDO_W1PY_CAPS"} --steps "${DDO_W1_STEPS:-5}" \
    --out "$OUT/w1py.json" --md "$OUT/w1py.md" --commit "$DDO_COMMIT" ${DDO_W1PY_ARGS:-} >>"$LOG" 2>&1
  local rc=$?
  say "w1_py rc=$rc"
  [ -f "$OUT/w1py.md" ] && cat "$OUT/w1py.md" | tee -a "$SUMMARY"
  return $rc
}

case "$MODE" in
  build) build ;;
  test) build && run_tests ;;
  micro) build && micro ;;
  w1) build && w1 ;;
  bench) build && micro && w1 ;;
  py) build && py ;;
  all) build && { run_tests; micro; w1; } ;;
  everything) build && { run_tests; micro; w1; py; } ;;
  diag) build && { run_tests; w1; py; } ;;
  testpy) build && { run_tests; py; } ;;
  pydiag) build && link_diag ;;
  *) echo "usage: scripts/gpu.sh [all|everything|diag|testpy|pydiag|build|test|micro|w1|bench|py]" >&2; exit 2 ;;
esac
rc=$?
say "done rc=$rc"
exit $rc
