#!/usr/bin/env bash
# The C++ staged flow (tools/examples/staged_pipeline.cpp) as a user runs it, on the host
# simulation: a calibration run saves the named profile, the next run applies it, and each prints
# the generation's report from GenerationMeter with its three stages and the bytes the denoiser
# streamed. ctest runs it (staged_pipeline_flow, label torch):
#
#   bash tools/tests/staged_pipeline_test.sh <path to the built staged_pipeline>
set -euo pipefail
program=$1
work=$(mktemp -d "${TMPDIR:-/tmp}/ddo-staged.XXXXXX")
trap 'rm -rf "$work"' EXIT
export DDO_PROFILE_DIR="$work/profiles" HOME="$work"
unset DDO_PRESET
run() {
  "$program" "$@" >"$work/out.txt" 2>&1 || { cat "$work/out.txt"; echo "staged_pipeline $* failed" >&2; exit 1; }
  cat "$work/out.txt"
}
expect() {  # expect <what> <extended regex>
  grep -Eq "$2" "$work/out.txt" || { echo "staged_pipeline: $1: no line matches '$2'" >&2; exit 1; }
}
check_generation() {
  expect "the generation report" '^generation: \{'
  # Stages in the order the flow ran them, and the denoiser as a component.
  expect "three stages" '"stages":\[\{[^]]*"name":"encode"[^]]*"name":"denoise"[^]]*"name":"decode"'
  expect "the denoiser's entry" '"components":\{"transformer":\{"bytes_streamed":'
}
run --calibrate
expect "a saved profile" '^profile: .*"status":"saved"'
check_generation
# Calibration runs with no resident budget: the denoiser's weights streamed.
expect "bytes streamed" '^generation: \{"bytes_streamed":[1-9]'
[ -n "$(ls -A "$work/profiles")" ] || { echo "staged_pipeline: no profile file written" >&2; exit 1; }
run
expect "the profile applied" '^profile: .*"status":"applied"'
check_generation
echo "staged_pipeline_flow: calibrated, applied, and reported"
