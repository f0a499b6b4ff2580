#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 5) on one core, starting from the corpus kept
# in the repository (fuzz/corpus/<target>/) plus a work corpus in the build folder, which keeps
# what earlier runs found. A crash, a leak, a sanitizer report or a slow input (over 10 s) fails
# the run; libFuzzer then saves the input as crash-*/leak-*/timeout-* in BUILD_DIR/fuzz/ and the
# log's end is printed. Reproduce with: BUILD_DIR/fuzz/fuzz_<target> <that file>.
#
#   fuzz/run.sh build-fuzz 5      # CI: a few seconds per target
#   fuzz/run.sh build-fuzz 600    # a longer run
set -euo pipefail
build=$(cd "${1:?usage: fuzz/run.sh BUILD_DIR [SECONDS]}" && pwd)
seconds=${2:-5}
here=$(cd "$(dirname "$0")" && pwd)
for target in profile_loader host_context settings patterns safetensors_header; do
  case $target in
    settings) dict=$here/dict/settings.dict ;;
    safetensors_header) dict=$here/dict/safetensors.dict ;;
    patterns) dict="" ;;
    *) dict=$here/dict/json.dict ;;
  esac
  work=$build/fuzz/corpus/$target
  log=$build/fuzz/$target.log
  mkdir -p "$work"
  rc=0
  (cd "$build/fuzz" && ./fuzz_$target -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=8192 -print_final_stats=1 ${dict:+-dict="$dict"} "$work" "$here/corpus/$target") \
    >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 || true)
  echo "fuzz_$target: ${seconds}s, ${execs:-?} inputs, $cov, corpus $(ls "$work" | wc -l) files, exit $rc"
  if [ "$rc" != 0 ]; then
    tail -n 40 "$log"
    exit "$rc"
  fi
done
