#!/usr/bin/env bash
# The TorchScript path against the Python path on the GPU machine, after
# scripts/gpu.sh has built ddo: FLUX (random weights) traced on the GPU in bf16 by
# examples/python/trace_diffusers.py, then for each VRAM cap the C++ program
# (tools/examples/torchscript_flow: torch::jit::load, a calibration run, a reuse run) and the same
# loop under ddo from Python on the eager model (trace_diffusers.py --python-flow), with the same
# inputs, steps and warm-up; one table side by side.
#
#   scripts/gpu-prepare-deps.sh                           # here, once: .deps/ and .whl/
#   device run, carry [".deps", ".whl"]:
#     DDO_COMMIT=<sha> bash scripts/gpu.sh jit
#   without a GPU, the tiny model on the host simulation (checks the script end to end):
#     DDO_GPU_BUILD=<build> DDO_PYTHON=<venv>/bin/python DDO_JIT_SIZE=tiny DDO_JIT_DEVICE=sim:0 \
#       bash scripts/gpu-jit.sh
#
# gpu.sh's mode "jit" builds, then calls this script (which also runs alone on a build that is
# there: DDO_GPU_BUILD, DDO_PYTHON). Results go under $OUT/jit/: jit.json (a row per cap and path:
# per-step times of the calibration run and the reuse run, attach and load seconds, profile
# status, resident and streamed bytes; versions, GPU, commit), jit.md (the table) and log.txt;
# the table is appended to $OUT/summary.txt too.
#
# Both programs time alike: --steps steps inside profile_run(), each ended by reading the latents
# back, and the median of the steps after the first --warmup ones. Each run gets its own profile
# folder, so every cap calibrates and then reuses what it calibrated; the cap is DDO_VRAM_CAP_GB,
# which both paths read through the same settings loader.
#
# Knobs: DDO_JIT_SIZE (full), DDO_JIT_DEVICE (cuda:0; sim:N runs on the host simulation),
# DDO_JIT_CAPS ("8 16", GiB), DDO_JIT_STEPS (6), DDO_JIT_WARMUP (2), DDO_JIT_DTYPE (bfloat16 on
# CUDA, float32 on the simulation), DDO_JIT_ARGS (more flags for both programs, e.g.
# --stream-all), DDO_JIT_PY_TRACED=1 (a third run per cap: the traced file under ddo from Python),
# DDO_JIT_WORK (traces, profiles and raw reports; /tmp/ddo-jit: a trace made there from the same
# trace_diffusers.py, size, dtype, device, torch and diffusers is reused), DDO_JIT_BUDGET
# (seconds this script may end by, counted from DDO_T_START, gpu.sh's start: 570).
#
# Time on the H200 (FLUX, 23.8 GB bf16): the trace is about a minute (build on the GPU, one traced
# forward, writing the file), each C++ run loads that file and each Python run builds the model on
# the GPU and moves it to the host, then both attach twice and run 2 x 6 steps; with two caps the
# whole stays within about 6 minutes (not counting the build: on a machine that has built already,
# DDO_SKIP_BUILD=1 bash scripts/gpu.sh jit). A run that would start with under 30 s of the budget
# left is skipped and says so in the summary and the table.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-$ROOT/out/gpu}
JITOUT="$OUT/jit"
mkdir -p "$JITOUT"
BUILD=${DDO_GPU_BUILD:-$ROOT/build-gpu}
PY=${DDO_PYTHON:-python3}
T_START=${DDO_T_START:-$(date +%s)}
BUDGET=${DDO_JIT_BUDGET:-570}
SUMMARY="$OUT/summary.txt"
LOG="$JITOUT/log.txt"
: >"$LOG"
export PYTHONUNBUFFERED=1 DDO_COMMIT=${DDO_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

say() { echo "gpu-jit.sh [$(($(date +%s) - T_START))s] $*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - ($(date +%s) - T_START) - 15)); }

SIZE=${DDO_JIT_SIZE:-full}
DEVICE=${DDO_JIT_DEVICE:-cuda:0}
CAPS=${DDO_JIT_CAPS:-8 16}
# Two warm-up steps: ddo learns its fetch order in the first, and the TorchScript executor
# profiles the graph in its first call and optimizes it in its second (the tiny FLUX here: 0.5 s,
# 0.19 s, then 1 ms); the median of the four after them holds one more outlier.
STEPS=${DDO_JIT_STEPS:-6}
WARMUP=${DDO_JIT_WARMUP:-2}
WORK=${DDO_JIT_WORK:-/tmp/ddo-jit}
case "$DEVICE" in
  cuda*) TRACE_DEVICE=cuda; DTYPE=${DDO_JIT_DTYPE:-bfloat16} ;;
  sim*) TRACE_DEVICE=cpu; DTYPE=${DDO_JIT_DTYPE:-float32} ;;
  *) say "FATAL: DDO_JIT_DEVICE=$DEVICE; use cuda:N or sim:N"; exit 2 ;;
esac
FLOW="$BUILD/tools/torchscript_flow"
TRACER="$ROOT/examples/python/trace_diffusers.py"
# shellcheck disable=SC2206
EXTRA=(${DDO_JIT_ARGS:-})

# The ddo package from the build tree, the wheels (.whl: diffusers, ...) from /tmp/ddo-site
# (scripts/gpu-lib.sh, as gpu.sh and gpu-w2.sh install them).
# shellcheck source=scripts/gpu-lib.sh
. "$ROOT/scripts/gpu-lib.sh"
install_wheels diffusers
[ -x "$FLOW" ] || { say "FATAL: $FLOW is not built (scripts/gpu.sh build)"; exit 1; }
if ! "$PY" -c 'import ddo, diffusers' >>"$LOG" 2>&1; then
  say "FATAL: cannot import ddo and diffusers ($LOG)"
  exit 1
fi
VERSIONS=$("$PY" -c 'import torch, diffusers; print(torch.__version__, diffusers.__version__)' \
  2>>"$LOG")
say "jit: FLUX $SIZE $DTYPE on $DEVICE, caps $CAPS GiB, $STEPS steps (median after $WARMUP);" \
  "torch, diffusers: $VERSIONS"

# --- 1. the trace (reused when nothing it depends on changed) ------------------------------------
stamp=$( (cat "$TRACER"; echo "$SIZE $DTYPE $TRACE_DEVICE $VERSIONS") | sha256sum | cut -c1-12)
TRACE="$WORK/trace-$stamp"
mkdir -p "$WORK"
trace_s=null
if [ -f "$TRACE/.done" ]; then
  say "trace: reusing $TRACE"
else
  # One FLUX file is 24 GB: older traces go first (the machine's disk is 64 GiB).
  rm -rf "$WORK"/trace-*
  t0=$(date +%s)
  echo "== trace" >>"$LOG"
  timeout "$(left)" "$PY" "$TRACER" flux --size "$SIZE" --device "$TRACE_DEVICE" --dtype "$DTYPE" \
    --out "$TRACE" >>"$LOG" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then say "FAIL: trace rc=$rc ($LOG)"; tail -20 "$LOG"; exit 1; fi
  touch "$TRACE/.done"
  trace_s=$(($(date +%s) - t0))
  say "trace: $trace_s s, $(du -sh "$TRACE/model.pt" | cut -f1) in $TRACE"
fi

# --- 2. per cap: C++, Python (and optionally the traced file from Python) -------------------------
# run_one PATH CAP COMMAND...: the run's report goes to $WORK/PATH-CAP.json, its output to log.txt.
run_one() {
  local path=$1 cap=$2 limit
  shift 2
  limit=$(left)
  if [ "$limit" -lt 30 ]; then say "$path cap $cap: skipped, ${limit} s left"; return 1; fi
  rm -rf "$WORK/profiles/$path-$cap" "$WORK/$path-$cap.json"
  mkdir -p "$WORK/profiles/$path-$cap"
  echo "== $path cap $cap: $*" >>"$LOG"
  local t0 rc
  t0=$(date +%s)
  DDO_PROFILE_DIR="$WORK/profiles/$path-$cap" DDO_VRAM_CAP_GB="$cap" timeout "$limit" "$@" \
    --report "$WORK/$path-$cap.json" >>"$LOG" 2>&1
  rc=$?
  say "$path cap $cap: rc=$rc in $(($(date +%s) - t0)) s; $(grep -E '^timings' "$LOG" | tail -1)"
  return $rc
}
COMMON=(--steps "$STEPS" --warmup "$WARMUP" "${EXTRA[@]}")
PATHS="cpp py"
[ "${DDO_JIT_PY_TRACED:-0}" = 1 ] && PATHS="cpp py pyjit"
rm -f "$WORK"/cpp-*.json "$WORK"/py-*.json "$WORK"/pyjit-*.json  # an earlier call's reports
failed=0
for cap in $CAPS; do
  run_one cpp "$cap" "$FLOW" --model "$TRACE/model.pt" --inputs "$TRACE/inputs.pt" \
    --device "$DEVICE" --profile flux-cpp "${COMMON[@]}" || failed=$((failed + 1))
  run_one py "$cap" "$PY" "$TRACER" flux --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
    --python-flow --profile flux-py --inputs "$TRACE/inputs.pt" "${COMMON[@]}" ||
    failed=$((failed + 1))
  if [ "${DDO_JIT_PY_TRACED:-0}" = 1 ]; then
    run_one pyjit "$cap" "$PY" "$TRACER" flux --device "$DEVICE" --python-flow \
      --profile flux-pyjit --model "$TRACE/model.pt" --inputs "$TRACE/inputs.pt" \
      "${COMMON[@]}" || failed=$((failed + 1))
  fi
done

# --- 3. the table --------------------------------------------------------------------------------
DDO_JIT_TRACE_S=$trace_s DDO_JIT_CAPS_LIST="$CAPS" DDO_JIT_PATHS="$PATHS" DDO_JIT_STEPS="$STEPS" \
  DDO_JIT_WARMUP="$WARMUP" \
  DDO_JIT_SIZE="$SIZE" DDO_JIT_DTYPE="$DTYPE" DDO_JIT_DEVICE="$DEVICE" DDO_JIT_WORKDIR="$WORK" \
  DDO_JIT_OUT="$JITOUT" DDO_JIT_BUILD="$BUILD" "$PY" - <<'PYEOF' 2>>"$LOG"
import json, os, platform, subprocess

import diffusers
import torch

env = os.environ
work, out = env["DDO_JIT_WORKDIR"], env["DDO_JIT_OUT"]
GiB = 1 << 30
PATHS = {"cpp": "C++ (torch::jit::load)", "py": "Python (eager)",
         "pyjit": "Python (traced file)"}


def build_type():
    try:
        with open(os.path.join(env["DDO_JIT_BUILD"], "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_BUILD_TYPE:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        return None


def gpu():
    if not torch.cuda.is_available():
        return None, None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=20).stdout.strip().splitlines()[0]
    except Exception:
        driver = None
    return torch.cuda.get_device_name(0), driver


def phase(p, steps):
    run = p.get("offload", {}).get("run", {})
    setup = p.get("offload", {}).get("setup", {})
    return dict(attach_s=p["attach_s"], step_ms=p["step_ms"], first_ms=p["first_ms"],
                median_ms=p["steady_ms_per_step"], release_s=p["release_s"],
                profile=p.get("profile", {}).get("status"),
                resident_gib=setup.get("bytes", {}).get("resident", 0) / GiB,
                streamed_gb_per_step=run.get("bytes_streamed", 0) / 1e9 / steps,
                peak_vram_gb=run.get("peak_vram_gb"))


rows = []
for cap in env["DDO_JIT_CAPS_LIST"].split():
    for path in env["DDO_JIT_PATHS"].split():
        name = os.path.join(work, f"{path}-{cap}.json")
        row = dict(cap_gib=float(cap), path=path)
        try:
            with open(name) as f:
                r = json.load(f)
            row.update(model_class=r["model_class"], steps=r["steps"], warmup=r["warmup"],
                       load_s=r.get("load_s"), calibrate=phase(r["calibrate"], r["steps"]),
                       reuse=phase(r["reuse"], r["steps"]))
        except (OSError, KeyError, ValueError) as e:
            row["missing"] = f"no report ({type(e).__name__}): see log.txt"
        rows.append(row)

name, driver = gpu()
result = dict(
    benchmark="TorchScript in C++ vs ddo from Python",
    command="scripts/gpu.sh jit (scripts/gpu-jit.sh)",
    model=f"FluxTransformer2DModel ({env['DDO_JIT_SIZE']}, random weights, {env['DDO_JIT_DTYPE']})",
    device=env["DDO_JIT_DEVICE"], steps=int(env["DDO_JIT_STEPS"]),
    warmup=int(env["DDO_JIT_WARMUP"]),
    trace_s=None if env["DDO_JIT_TRACE_S"] == "null" else int(env["DDO_JIT_TRACE_S"]),
    commit=env.get("DDO_COMMIT"), build_type=build_type(),
    versions=dict(torch=torch.__version__, cuda=torch.version.cuda,
                  diffusers=diffusers.__version__, python=platform.python_version()),
    machine=dict(gpu=name, driver=driver, host=platform.node(), cpus=os.cpu_count()),
    rows=rows)
with open(os.path.join(out, "jit.json"), "w") as f:
    json.dump(result, f, indent=2)


def ms(v):
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def gb(v):
    return "n/a" if v is None else f"{v:.3g}"


lines = [
    f"### TorchScript from C++ vs ddo from Python: {result['model']} on "
    f"{name or result['device']}",
    "",
    f"commit {result['commit']}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
    f"diffusers {diffusers.__version__}, driver {driver}, build {result['build_type']}; "
    f"{result['steps']} steps per run, ms/step = median of the steps after the first "
    f"{result['warmup']}; trace "
    f"{'reused' if result['trace_s'] is None else str(result['trace_s']) + ' s'}",
    "",
    "load s: C++ torch::jit::load of the traced file; Python (eager) builds the model on the GPU "
    "and moves it to the host; Python (traced file) torch.jit.load. Resident, streamed and peak: "
    "the reuse run's.",
    "",
    "| cap GiB | path | load s | attach s (cal / reuse) | calibration run ms/step (first / median) "
    "| reuse run ms/step (first / median) | resident GiB | streamed GB/step | peak VRAM GiB "
    "| profile |",
    "|---|---|---|---|---|---|---|---|---|---|",
]
for row in rows:
    if "missing" in row:
        lines.append(f"| {row['cap_gib']:g} | {PATHS[row['path']]} | {row['missing']} ||||||||")
        continue
    c, r = row["calibrate"], row["reuse"]
    lines.append(
        f"| {row['cap_gib']:g} | {PATHS[row['path']]} | {row['load_s']:.1f} | "
        f"{c['attach_s']:.2f} / {r['attach_s']:.2f} | {ms(c['first_ms'])} / {ms(c['median_ms'])} | "
        f"{ms(r['first_ms'])} / {ms(r['median_ms'])} | {gb(r['resident_gib'])} | "
        f"{gb(r['streamed_gb_per_step'])} | {gb(r['peak_vram_gb'])} | "
        f"{c['profile']} -> {r['profile']} |")
lines.append("")
for cap in env["DDO_JIT_CAPS_LIST"].split():
    by = {row["path"]: row for row in rows if row["cap_gib"] == float(cap) and "reuse" in row}
    if "cpp" in by and "py" in by:
        cal = by["cpp"]["calibrate"]["median_ms"] / by["py"]["calibrate"]["median_ms"]
        reuse = by["cpp"]["reuse"]["median_ms"] / by["py"]["reuse"]["median_ms"]
        lines.append(f"- cap {cap} GiB: C++ / Python median step = {cal:.3f} (calibration run), "
                     f"{reuse:.3f} (reuse run)")
with open(os.path.join(out, "jit.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
PYEOF
rc=$?
[ $rc -ne 0 ] && say "FAIL: writing jit.json / jit.md rc=$rc ($LOG)"
[ -f "$JITOUT/jit.md" ] && tee -a "$SUMMARY" <"$JITOUT/jit.md"
[ "$failed" -gt 0 ] && rc=1
say "jit done rc=$rc ($failed runs failed or skipped)"
exit $rc
