#!/usr/bin/env bash
# Fails when a library or program of ddo carries its own copy of core instead of loading
# libddo_core.so (Note [One core per process] in core/CMakeLists.txt): each file must name
# libddo_core.so among its NEEDED libraries and define none of core's functions or data itself.
# Functions inlined from core's headers (weak or unique symbols) are allowed: they hold no state.
# ctest runs it (test core_linked_once, label torch):
#   bash scripts/check-one-core.sh <nm> <readelf> build/sdnq/libddo_sdnq.so build/torch/libddo_torch.so ...
set -euo pipefail
nm_tool=$1
readelf_tool=$2
shift 2
failed=0
for file in "$@"; do
  if [ ! -e "$file" ]; then
    echo "core_linked_once: $file does not exist (build it first)" >&2
    failed=1
    continue
  fi
  if ! "$readelf_tool" -d "$file" | grep -q 'NEEDED.*\[libddo_core\.so\]'; then
    echo "core_linked_once: $(basename "$file") does not load libddo_core.so:" >&2
    "$readelf_tool" -d "$file" | grep NEEDED >&2 || true
    failed=1
  fi
  # Global text, data and bss (T, D, R, B) are core's code compiled in; local data and bss (d, b)
  # are state. Weak and unique symbols (W, V, u) and local text (t: an inline function's copy,
  # or its clone) hold no state, nor do type descriptions (typeinfo, vtables).
  own=$("$nm_tool" -C --defined-only "$file" | awk '$2 ~ /^[TDRBdb]$/' |
    grep -E '^[0-9a-f]+ [A-Za-z] (guard variable for )?ddo::core::' || true)
  if [ -n "$own" ]; then
    echo "core_linked_once: $(basename "$file") defines core's symbols itself ($(echo "$own" | wc -l)), e.g.:" >&2
    echo "$own" | head -5 >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
echo "core_linked_once: $# files load libddo_core.so and carry no copy of core"
