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
#     bash scripts/gpu.sh pydiag                      # build, then scripts/gpu-pydiag.sh link
#     DDO_COMMIT=<sha> bash scripts/gpu.sh w2         # build, then W2 (scripts/gpu-w2.sh: sdnq models, $OUT/w2/)
#     DDO_COMMIT=<sha> bash scripts/gpu.sh cards      # build, device code per library, SDNQ tests under PTX JIT
#     DDO_COMMIT=<sha> bash scripts/gpu.sh testw4     # build, GPU tests, W4 (quantized compute, $OUT/w4.json)
#     DDO_COMMIT=<sha> bash scripts/gpu.sh testprofile  # build, GPU tests, W4's kernel table
#     DDO_COMMIT=<sha> bash scripts/gpu.sh lora         # build, the LoRA benchmark ($OUT/lora.json)
#     DDO_COMMIT=<sha> bash scripts/gpu.sh profilelora  # build, the kernel table, then the LoRA benchmark
#     DDO_COMMIT=<sha> bash scripts/gpu.sh testprofilelora  # build, GPU tests, kernel table, LoRA benchmark
#     DDO_COMMIT=<sha> bash scripts/gpu.sh w6         # whole generations (DDO_W6_FAMILY flux|wan,
#       DDO_W6_CAPS 8,16, DDO_W6_QUANTIZE fp8,int8: ddo rows with generate.py --quantize,
#       DDO_W6_DDO_ARGS: generate.py flags for ddo's rows only, DDO_W6_OTHERS: generate.py --offload routes beside ddo, default
#       diffusers-group-leaf; DDO_W6_NO_RESIDENT=1 skips the reference row; rows are saved as
#       they finish, so a call cut short by its time limit keeps them)
#
# Steps (a mode runs a subset): build (C++ and, where Python headers exist, the ddo package),
# test (ctest, then pytest on the build tree), micro (copy_engine, op_overhead x DDO_OP_REPEATS),
# testmicro (both), w1, py (W1-py: bench/python/w1_py.py, diffusers from the wheels in .whl); the W1 and W1-py tables come from
# scripts/gpu-bench-table.py. DDO_W1_EXTRA: flags of a second W1 invocation run after the first
# (its JSON goes to log.txt only). Knobs:
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
# The CUDA architectures: CMake's default list (cmake/DdoCudaArchs.cmake), which also keeps torch's
# CMake from probing the GPU; the build's ctest checks that libddo_sdnq.so holds each of them.
# The compiler: a distribution g++ where the image has one, else the image's own (/opt/gcc, GCC
# 13.3), which links libstdc++ statically into shared libraries unless told otherwise; CMake's
# configure-time probe (cmake/DdoSharedStdlib.cmake) tells it, and the ctest tests stdlib_<target>
# check the result.
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
    -DCMAKE_PREFIX_PATH="$PREFIX" "${EXTRA[@]}" "${PYBUILD[@]}" \
    -DPython3_EXECUTABLE="$(command -v "$PY")" -DPython_EXECUTABLE="$(command -v "$PY")" \
    ${DDO_CMAKE_ARGS:-} \
    >>"$LOG" 2>&1 || { say "FAIL: configure (log.txt)"; tail -30 "$LOG"; return 1; }
  timeout "${DDO_BUILD_TIMEOUT:-330}" cmake --build "$BUILD" -j "$JOBS" >>"$LOG" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    say "FAIL: build rc=$rc (log.txt)"; grep -E "error|FAILED" "$LOG" | head -20; return 1
  fi
  say "build ok"
  # How the shared libraries link libstdc++ (cmake/DdoSharedStdlib.cmake), and the check of the
  # built files that the tests run too.
  grep -E "^-- ddo: libstdc\+\+" "$LOG" | tail -3 | sed 's/^-- //' | tee -a "$SUMMARY"
  (cd "$BUILD" && ctest -R '^stdlib_' --output-on-failure) >>"$LOG" 2>&1 ||
    say "WARNING: a shared library carries its own libstdc++ (ctest -R stdlib_, log.txt); the Python package will crash"
}

# Wheels the GPU machine lacks (diffusers, accelerate, ...), installed once into /tmp/ddo-site:
# install_wheels (scripts/gpu-lib.sh).
# shellcheck source=scripts/gpu-lib.sh
. "$ROOT/scripts/gpu-lib.sh"

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
  echo "GPU tests: $(grep -cE 'Test +#[0-9]+: .*Passed' "$tlog") passed; skipped for lack of a GPU: $(grep -c 'no CUDA GPU' "$tlog")" | tee -a "$SUMMARY"
  rm -f "$tlog"
  # DDO_SKIP_PYTEST=1: the Python tests run elsewhere in this call (testpip: on the installed
  # package).
  if [ ${#PYBUILD[@]} -gt 0 ] && [ "${DDO_SKIP_PYTEST:-0}" != 1 ]; then
    install_wheels
    echo "== pytest" >>"$LOG"
    (cd "$ROOT" && timeout "${DDO_PYTEST_TIMEOUT:-120}" "$PY" -m pytest -q -p no:cacheprovider \
      ${DDO_GPU_PYTEST_ARGS:-python/tests}) >>"$LOG" 2>&1
    local prc=$?
    say "pytest rc=$prc: $(grep -E '[0-9]+ (passed|failed)' "$LOG" | tail -1)"
    [ $prc -ge 128 ] && DDO_GPU_BUILD="$BUILD" DDO_PYTHON="$PY" bash "$ROOT/scripts/gpu-pydiag.sh" crash >>"$LOG" 2>&1
    [ $prc -eq 0 ] || rc=$prc
  fi
  return $rc
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

# table JSON MD: the markdown table of a W1 or W1-py result (scripts/gpu-bench-table.py, the one
# writer), also into the summary; rows written before a timeout still make a table.
table() {
  [ -f "$1" ] || return 0
  "$PY" "$ROOT/scripts/gpu-bench-table.py" "$1" >"$2" 2>>"$LOG" && tee -a "$SUMMARY" <"$2"
}

micro() {
  bench copy_engine 90 --out "$OUT/copy_engine.json" --commit "$DDO_COMMIT"
  # Per-op host time moves by a few us between runs of one build: DDO_OP_REPEATS runs, all kept.
  local k
  for k in $(seq 1 "${DDO_OP_REPEATS:-3}"); do
    bench op_overhead 60 --out "$OUT/op_overhead_$k.json" --commit "$DDO_COMMIT"
  done
}

w1() {
  local size=${DDO_W1_SIZE:-full} caps=${DDO_W1_CAPS:-8,12,16,24,0}
  if [ "$HAVE_GPU" = 0 ]; then size=${DDO_W1_SIZE:-tiny}; caps=${DDO_W1_CAPS:-0.02,0}; fi
  # What is left of a 9.5-minute call, less 20 s to write results.
  local left=$((570 - ($(date +%s) - T_START) - 20))
  [ $left -lt 60 ] && left=60
  # shellcheck disable=SC2086
  bench w1 "$left" --size "$size" --caps "$caps" --steps "${DDO_W1_STEPS:-5}" \
    --routes "${DDO_W1_ROUTES:-calibrated,block,leaf}" --out "$OUT/w1.json" \
    --commit "$DDO_COMMIT" ${DDO_W1_ARGS:-}
  table "$OUT/w1.json" "$OUT/w1.md"
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
    --out "$OUT/w1py.json" --commit "$DDO_COMMIT" ${DDO_W1PY_ARGS:-} >>"$LOG" 2>&1
  local rc=$?
  say "w1_py rc=$rc"
  table "$OUT/w1py.json" "$OUT/w1py.md"
  return $rc
}

# W4 (quantized compute): the GEMM table, bf16/int8/fp8 resident, fp8 and dequantize rows per cap
# (bench/python/w4_quantized.py); its JSON holds every figure. DDO_W4_FAMILY=wan: the Wan 2.1-14B
# row (bf16 resident against fp8 at 8 GiB) into w4-wan.json.
w4() {
  if [ ${#PYBUILD[@]} -eq 0 ]; then say "FAIL: w4 step needs the ddo Python package"; return 1; fi
  install_wheels
  local left=$((570 - ($(date +%s) - T_START) - 20)) size=${DDO_W1_SIZE:-full} dev=()
  [ "$HAVE_GPU" = 0 ] && { size=${DDO_W1_SIZE:-tiny}; dev=(--device sim); }
  echo "== w4" >>"$LOG"
  # shellcheck disable=SC2086
  timeout "$left" "$PY" "$ROOT/bench/python/w4_quantized.py" --size "$size" "${dev[@]}" \
    --family "${DDO_W4_FAMILY:-flux}" ${DDO_W4_CAPS:+--caps "$DDO_W4_CAPS"} \
    --steps "${DDO_W1_STEPS:-5}" --out "$OUT/w4${DDO_W4_FAMILY:+-$DDO_W4_FAMILY}.json" \
    --commit "$DDO_COMMIT" ${DDO_W4_ARGS:-} >>"$LOG" 2>&1
  local rc=$?
  say "w4 rc=$rc"
  return $rc
}

# W4's kernel table (bench/python/w4_profile.py): the GEMM variants per shape, bf16 and fp8
# resident steps, one profiled step of each by kernel category; DDO_PROFILE_FAMILIES (flux,wan).
profile() {
  if [ ${#PYBUILD[@]} -eq 0 ]; then say "FAIL: profile step needs the ddo Python package"; return 1; fi
  install_wheels
  local size=${DDO_W1_SIZE:-full} dev=() fam rc=0
  [ "$HAVE_GPU" = 0 ] && { size=${DDO_W1_SIZE:-tiny}; dev=(--device sim); }
  for fam in $(echo "${DDO_PROFILE_FAMILIES:-flux,wan}" | tr ',' ' '); do
    local left=$((570 - ($(date +%s) - T_START) - 20))
    [ $left -lt 30 ] && { say "w4_profile $fam: no time left"; rc=1; break; }
    echo "== w4_profile $fam" >>"$LOG"
    # shellcheck disable=SC2086
    timeout "$left" "$PY" "$ROOT/bench/python/w4_profile.py" --family "$fam" --size "$size" \
      "${dev[@]}" --out "$OUT/w4-profile-$fam.json" --commit "$DDO_COMMIT" ${DDO_PROFILE_ARGS:-} \
      2>&1 | tee -a "$LOG" | grep -E "gemm |resident|graphed|profiled|host|cpu (self|total)|  [a-z_0-9]+ +[0-9.]+ ms" >>"$SUMMARY"
    local r=${PIPESTATUS[0]}
    say "w4_profile $fam rc=$r"
    [ $r -eq 0 ] || rc=$r
  done
  return $rc
}

# LoRA under ddo (bench/python/lora_bench.py): unfused and fused steps against the model without
# adapters, fuse/unfuse seconds while attached, a switch; DDO_LORA_CAP (8), DDO_LORA_RANK (64).
lora() {
  if [ ${#PYBUILD[@]} -eq 0 ]; then say "FAIL: lora step needs the ddo Python package"; return 1; fi
  install_wheels
  local left=$((570 - ($(date +%s) - T_START) - 20)) size=${DDO_W1_SIZE:-full} dev=() cap=${DDO_LORA_CAP:-8}
  [ "$HAVE_GPU" = 0 ] && { size=${DDO_W1_SIZE:-tiny}; dev=(--device sim); cap=${DDO_LORA_CAP:-0.2}; }
  echo "== lora_bench" >>"$LOG"
  timeout "$left" "$PY" "$ROOT/bench/python/lora_bench.py" --size "$size" "${dev[@]}" --cap "$cap" \
    --rank "${DDO_LORA_RANK:-64}" --steps "${DDO_W1_STEPS:-5}" --out "$OUT/lora.json" \
    --commit "$DDO_COMMIT" 2>&1 | tee -a "$LOG" | grep -E "^\[lora" >>"$SUMMARY"
  local rc=${PIPESTATUS[0]}
  say "lora_bench rc=$rc"
  return $rc
}

# W6 (docs/benchmarks.md): whole generations with examples/python/generate.py, a cold process per row
# (bench/python/w6_generation.py): all resident, then ddo at each cap with host RAM capped. The
# random folder is written once under DDO_W6_DIR and kept between calls of a warm machine.
w6() {
  if [ ${#PYBUILD[@]} -eq 0 ]; then say "FAIL: w6 step needs the ddo Python package"; return 1; fi
  install_wheels
  local left=$((570 - ($(date +%s) - T_START) - 20)) family=${DDO_W6_FAMILY:-flux}
  local size=${DDO_W6_SIZE:-full} dev=cuda
  [ "$HAVE_GPU" = 0 ] && { size=${DDO_W6_SIZE:-tiny}; dev=sim; }
  echo "== w6 $family $size" >>"$LOG"
  # shellcheck disable=SC2086
  timeout "$left" "$PY" "$ROOT/bench/python/w6_generation.py" --family "$family" --size "$size" \
    --device "$dev" --folder "${DDO_W6_DIR:-/tmp/ddo-w6-$family-$size}" \
    --caps "${DDO_W6_CAPS:-8,16}" --host-ram-cap "${DDO_W6_HOST_RAM_GB:-32}" \
    ${DDO_W6_ARGS:+--generate-args="$DDO_W6_ARGS"} ${DDO_W6_DDO_ARGS:+--ddo-args="$DDO_W6_DDO_ARGS"} \
    ${DDO_W6_QUANTIZE:+--quantize "$DDO_W6_QUANTIZE"} \
    --others "${DDO_W6_OTHERS-diffusers-group-leaf}" ${DDO_W6_NO_RESIDENT:+--no-resident} \
    --out "$OUT/w6-$family.json" --commit "$DDO_COMMIT" >>"$LOG" 2>&1
  local rc=$?
  say "w6 rc=$rc"
  return $rc
}

# W1-py from disk: writes the model to the machine's disk once (kept between calls
# of a warm machine under DDO_LOAD_DIR), then ddo's loader cold/warm at each cap and diffusers'
# from_pretrained + group offload (bench/python/load_from_disk.py).
load() {
  if [ ${#PYBUILD[@]} -eq 0 ]; then say "FAIL: load step needs the ddo Python package"; return 1; fi
  install_wheels
  local left=$((570 - ($(date +%s) - T_START) - 20)) dir=${DDO_LOAD_DIR:-/tmp/ddo-w1py-disk} dev=()
  local size=${DDO_W1_SIZE:-full}
  [ "$HAVE_GPU" = 0 ] && { size=${DDO_W1_SIZE:-tiny}; dev=(--device sim); }
  echo "== load_from_disk" >>"$LOG"
  # shellcheck disable=SC2086
  timeout "$left" "$PY" "$ROOT/bench/python/load_from_disk.py" --dir "$dir" --size "$size" \
    "${dev[@]}" --caps "${DDO_LOAD_CAPS:-8,16}" --out "$OUT/load.json" --commit "$DDO_COMMIT" \
    ${DDO_LOAD_ARGS:-} 2>&1 | tee -a "$SUMMARY" >>"$LOG"
  local rc=${PIPESTATUS[0]}
  say "load_from_disk rc=$rc"
  return $rc
}

# `pip install .` as a user runs it: scikit-build-core drives the project's CMake with no
# help from this script (its own build folder, build-python/), into a fresh target folder; then the
# installed package, not the build tree, imports and runs the Python tests (the CUDA ones too).
pipcheck() {
  # Every carried wheel (the tests' diffusers and sdnq too), then scikit-build-core where the image
  # has none (a site made before it travelled).
  install_wheels
  install_wheels scikit_build_core
  local target=/tmp/ddo-pip
  rm -rf "$target"
  echo "== pip install --no-build-isolation --no-deps --target $target ." >>"$LOG"
  local t0=$(date +%s)
  # This machine lacks some build dependencies (apt would install them for a user): CMake finds
  # the carried copies through the environment variables it reads itself, nothing of build().
  local -a env_deps=()
  if [ -n "$missing" ]; then
    env_deps+=("CMAKE_PREFIX_PATH=${PREFIX//;/:}")
    case "$missing" in *OpenSSL*)
      env_deps+=("OPENSSL_ROOT_DIR=$DEPS_ROOT" "CXXFLAGS=-isystem $DEPS_ROOT/include/x86_64-linux-gnu") ;;
    esac
  fi
  (cd "$ROOT" && env "${env_deps[@]}" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" PYTHONPATH="$SITE" \
    timeout "${DDO_PIP_TIMEOUT:-300}" "$PY" -m pip install --no-build-isolation --no-deps --no-index \
    --target "$target" .) >>"$LOG" 2>&1
  local rc=$?
  say "pip install . rc=$rc in $(($(date +%s) - t0)) s"
  [ $rc -eq 0 ] || { tail -30 "$LOG"; return 1; }
  # From outside the tree, with only the installed package and the wheels' site on the path.
  (cd /tmp && PYTHONPATH="$target:$SITE" "$PY" -c \
    'import ddo, torch; print("installed ddo at", ddo.__file__, "cuda", torch.cuda.is_available())') \
    2>&1 | tee -a "$SUMMARY" >>"$LOG"
  echo "== pytest on the installed package" >>"$LOG"
  # -P: the working folder (the repository root) is not put on the path, so neither its sdnq/
  # sources nor anything else there stand in for an installed package.
  (cd "$ROOT" && PYTHONPATH="$target:$SITE" timeout "${DDO_PYTEST_TIMEOUT:-150}" "$PY" -P -m pytest -q -rs \
    -p no:cacheprovider ${DDO_PIP_PYTEST_ARGS:-python/tests}) >"$OUT/.pip-pytest.txt" 2>&1
  rc=$?
  cat "$OUT/.pip-pytest.txt" >>"$LOG"
  grep -m1 "^ddo package:" "$OUT/.pip-pytest.txt" | tee -a "$SUMMARY"
  say "pytest (installed package) rc=$rc: $(grep -E '[0-9]+ (passed|failed)' "$OUT/.pip-pytest.txt" | tail -1)"
  rm -f "$OUT/.pip-pytest.txt"
  return $rc
}

# cards: what a card other than this one would meet (Note [Architecture list], Note [Kernel
# images]): the device code in each built library, the ctest that checks it, then the SDNQ GPU
# tests and SDNQ pytest again with CUDA_FORCE_PTX_JIT=1 (the driver compiles the PTX, as on a
# card newer than the list).
cards() {
  local tool
  tool=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
  for lib in "$BUILD"/core/libddo_core.so "$BUILD"/sdnq/libddo_sdnq.so "$BUILD"/torch/libddo_torch.so "$BUILD"/python/ddo/_C*.so; do
    [ -e "$lib" ] || continue
    if [ -n "$tool" ]; then
      say "cuobjdump --list-elf $(basename "$lib"): $("$tool" --list-elf "$lib" 2>&1 | grep -o 'sm_[0-9]*\.cubin' | tr '\n' ' ')"
      say "cuobjdump --list-ptx $(basename "$lib"): $("$tool" --list-ptx "$lib" 2>&1 | grep -o 'sm_[0-9]*\.ptx' | tr '\n' ' ')"
    fi
  done
  [ -z "$tool" ] && say "no cuobjdump on this machine: the device-code lists above are missing"
  (cd "$BUILD" && ctest --output-on-failure -R 'cuda_archs|KernelStatus') >>"$LOG" 2>&1
  say "ctest cuda_archs + KernelStatus rc=$?"
  local jlog="$OUT/.ptxjit.txt"
  (cd "$BUILD" && CUDA_FORCE_PTX_JIT=1 timeout 200 ctest --output-on-failure --timeout 180 \
    -L gpu -R 'Dequantize|Sdnq|sdnq') >"$jlog" 2>&1
  say "CUDA_FORCE_PTX_JIT=1 ctest (SDNQ GPU) rc=$?: $(grep -E 'tests passed|tests failed' "$jlog" | tr '\n' ' ')"
  cat "$jlog" >>"$LOG"
  if [ ${#PYBUILD[@]} -gt 0 ]; then
    install_wheels
    (cd "$ROOT" && CUDA_FORCE_PTX_JIT=1 timeout 240 "$PY" -m pytest -q \
      -p no:cacheprovider python/tests/test_sdnq.py python/tests/test_sdnq_loader.py) >"$jlog" 2>&1
    say "CUDA_FORCE_PTX_JIT=1 pytest (SDNQ) rc=$?: $(grep -E '[0-9]+ (passed|failed)' "$jlog" | tail -1)"
    cat "$jlog" >>"$LOG"
  fi
  rm -f "$jlog"
  # ddo's kernels built for other lists than this card's cubin, torch untouched (its wheel has
  # PTX for its newest architecture only, so CUDA_FORCE_PTX_JIT above also JIT-compiles torch):
  # PTX only (90-virtual: the driver compiles ddo's PTX for this card), and no image for this
  # card (80-real: the reference path, the image tests skipping with the reason and
  # DequantizeKernelStatus.ThePathFollowsTheBuiltArchitectures checking the path).
  local arch vbuild
  for arch in $(echo "${DDO_CARDS_ARCHS:-90-virtual,80-real}" | tr ',' ' '); do
    vbuild="$BUILD-arch-$arch"
    timeout 120 cmake -S "$ROOT" -B "$vbuild" -G Ninja -DCMAKE_BUILD_TYPE="${DDO_BUILD_TYPE:-Release}" \
      -DCMAKE_PREFIX_PATH="$PREFIX" "${EXTRA[@]}" -DDDO_BUILD_PYTHON=OFF \
      -DPython3_EXECUTABLE="$(command -v "$PY")" -DPython_EXECUTABLE="$(command -v "$PY")" \
      -DDDO_CUDA_ARCHITECTURES="$arch" >>"$LOG" 2>&1 &&
      timeout 300 cmake --build "$vbuild" -j "$JOBS" --target ddo_sdnq_gpu_tests >>"$LOG" 2>&1
    if [ $? -ne 0 ]; then say "FAIL: build of ddo_sdnq_gpu_tests for $arch (log.txt)"; continue; fi
    jlog="$OUT/.arch-$arch.txt"
    (cd "$vbuild" && timeout 200 ./sdnq/ddo_sdnq_gpu_tests --gtest_brief=0) >"$jlog" 2>&1
    say "ddo_sdnq_gpu_tests built for $arch rc=$?: $(grep -E '^\[  PASSED|^\[  SKIPPED|^\[  FAILED' "$jlog" | tr '\n' ' ')"
    grep -m1 -E "runs the reference path on this card" "$jlog" | sed 's/^/  skip reason: /' | tee -a "$SUMMARY"
    grep -E "^\[  FAILED" "$jlog" | head -10 | tee -a "$SUMMARY"
    cat "$jlog" >>"$LOG"
    rm -f "$jlog"
  done
}

case "$MODE" in
  build) build ;;
  pipcheck) pipcheck ;;
  # ctest on the build tree, pytest once, on the pip-installed package (the same tests).
  testpip) build && { DDO_SKIP_PYTEST=1 run_tests; r1=$?; pipcheck; r2=$?; [ $r1 -eq 0 ] && [ $r2 -eq 0 ]; } ;;
  load) build && load ;;
  testload) build && { DDO_GPU_TESTS_ONLY=1 run_tests; load; } ;;
  test) build && run_tests ;;
  testmicro) build && { run_tests; micro; } ;;
  micro) build && micro ;;
  w1) build && w1 ;;
  bench) build && micro && w1 ;;
  py) build && py ;;
  w4) build && w4 ;;
  testw4) build && { DDO_GPU_TESTS_ONLY=1 run_tests; w4; } ;;
  w6) build && w6 ;;
  profile) build && profile ;;
  lora) build && lora ;;
  profilelora) build && { profile; lora; } ;;
  testprofile) build && { DDO_GPU_TESTS_ONLY=1 DDO_SKIP_PYTEST=1 run_tests; profile; } ;;
  testprofilelora) build && { DDO_GPU_TESTS_ONLY=1 DDO_SKIP_PYTEST=1 run_tests; profile; lora; } ;;
  w2) build && DDO_GPU_BUILD="$BUILD" DDO_PYTHON="$PY" DDO_T_START=$T_START bash "$ROOT/scripts/gpu-w2.sh" ;;
  jit) build && DDO_GPU_BUILD="$BUILD" DDO_PYTHON="$PY" DDO_T_START=$T_START bash "$ROOT/scripts/gpu-jit.sh" ;;
  # SDNQ in one call: build, the GPU tests (kernels, streamed units, probe lifecycle), pytest,
  # then W2 as DDO_W2_* select.
  sdnq) build && { DDO_GPU_TESTS_ONLY=1 run_tests; DDO_GPU_BUILD="$BUILD" DDO_PYTHON="$PY" DDO_T_START=$T_START bash "$ROOT/scripts/gpu-w2.sh"; } ;;
  all) build && { run_tests; micro; w1; } ;;
  everything) build && { run_tests; micro; w1; py; } ;;
  diag) build && { run_tests; w1; py; } ;;
  testpy) build && { run_tests; py; } ;;
  cards) build && cards ;;
  pydiag) build && install_wheels && DDO_GPU_BUILD="$BUILD" DDO_PYTHON="$PY" bash "$ROOT/scripts/gpu-pydiag.sh" link >>"$LOG" 2>&1 ;;
  *) echo "usage: scripts/gpu.sh [all|everything|diag|testpy|pydiag|build|test|testmicro|micro|w1|bench|py|w2|sdnq|load|testload|cards|w4|testw4|w6|profile|testprofile|lora|profilelora|jit|pipcheck|testpip]" >&2; exit 2 ;;
esac
rc=$?
say "done rc=$rc"
exit $rc
