#!/usr/bin/env bash
# W2 on the GPU machine: bench/python/w2_py.py (FLUX transformer quantized by sdnq, int8 and
# uint4, under ddo at caps 4, 6, 8, 12 GiB and uncapped; sdnq's own resident forward; sdnq +
# diffusers' leaf group offload; ddo bf16 at the same caps), after scripts/gpu.sh has built ddo:
#
#   scripts/gpu-prepare-deps.sh                           # here, once: .deps/ and .whl/ (sdnq too)
#   device run, carry [".deps", ".whl"]:
#     DDO_COMMIT=<sha> DDO_PYTHON=python3 bash scripts/gpu.sh w2
#
# gpu.sh's mode "w2" builds, then calls this script (which also runs alone on a build that is
# there: DDO_GPU_BUILD, DDO_PYTHON). Everything goes under $OUT/w2/: w2.json (rows, quantization,
# environment), w2.md (the table and the targets), env.json, log.txt; the table is appended to
# $OUT/summary.txt too. Without a GPU it runs the tiny size on the host simulation.
#
# Knobs: DDO_W2_SIZE (full), DDO_W2_CAPS (4,6,8,12,0; 0 = uncapped), DDO_W2_VARIANTS
# (int8,uint4,bf16), DDO_W2_ROUTES (resident,ddo,group), DDO_W2_STEPS (5), DDO_W2_ARGS (more
# w2_py.py flags), DDO_W2_BUDGET (seconds of the call this script may end by, counted from
# DDO_T_START, gpu.sh's start: 570).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out/gpu}
W2OUT="$OUT/w2"
mkdir -p "$W2OUT"
BUILD=${DDO_GPU_BUILD:-$ROOT/build-gpu}
PY=${DDO_PYTHON:-python3}
T_START=${DDO_T_START:-$(date +%s)}
SUMMARY="$OUT/summary.txt"
LOG="$W2OUT/log.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1 DDO_COMMIT=${DDO_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# sdnq compiles its kernels with torch.compile at import unless told not to; W2 compares ddo's
# op with sdnq's eager dequantize path.
export SDNQ_USE_TORCH_COMPILE=${SDNQ_USE_TORCH_COMPILE:-0}

say() { echo "gpu-w2.sh [$(($(date +%s) - T_START))s] $*" | tee -a "$SUMMARY"; }

# The ddo package from the build tree, the wheels (.whl: diffusers, accelerate, sdnq, ...) from
# /tmp/ddo-site, installed again when anything W2 imports is missing (scripts/gpu-lib.sh).
# shellcheck source=scripts/gpu-lib.sh
. "$ROOT/scripts/gpu-lib.sh"
install_wheels "diffusers, accelerate, sdnq"
"$PY" -c 'import os; os.environ["SDNQ_USE_TORCH_COMPILE"] = "0"
import torch, diffusers, sdnq
from importlib.metadata import version
print("torch", torch.__version__, "diffusers", diffusers.__version__, "sdnq", version("sdnq"))' \
  2>>"$LOG" | sed 's/^/w2 versions: /' | tee -a "$SUMMARY"
"$PY" -c 'import ddo' >>"$LOG" 2>&1 || say "WARNING: cannot import ddo from $BUILD/python: only the resident and group rows will run"

size=${DDO_W2_SIZE:-full}
dev=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  size=${DDO_W2_SIZE:-tiny}
  dev=(--device sim)
fi
left=$((${DDO_W2_BUDGET:-570} - ($(date +%s) - T_START) - 15))
[ $left -lt 60 ] && left=60
say "w2_py: size $size, ${left} s left"
echo "== w2_py" >>"$LOG"
# shellcheck disable=SC2086
timeout "$left" "$PY" "$ROOT/bench/python/w2_py.py" --size "$size" "${dev[@]}" \
  ${DDO_W2_CAPS:+--caps "$DDO_W2_CAPS"} ${DDO_W2_VARIANTS:+--variants "$DDO_W2_VARIANTS"} \
  ${DDO_W2_ROUTES:+--routes "$DDO_W2_ROUTES"} --steps "${DDO_W2_STEPS:-5}" \
  --deadline-s $((left - 40)) --out "$W2OUT" --commit "$DDO_COMMIT" ${DDO_W2_ARGS:-} >>"$LOG" 2>&1
rc=$?
[ $rc = 124 ] && say "w2_py ran out of its ${left} s: the rows written so far are in w2.json and w2.md"
say "w2_py rc=$rc"
[ -f "$W2OUT/w2.md" ] && tee -a "$SUMMARY" <"$W2OUT/w2.md"
exit $rc
