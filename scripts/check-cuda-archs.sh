#!/usr/bin/env bash
# Checks that a built library holds device code for every architecture of a CMake list (';' or
# ',' between items): a cubin
# for each "NN-real" (and plain "NN"), PTX for each "NN-virtual" (and plain "NN"), as
# `cuobjdump --list-elf / --list-ptx` lists them. ctest runs it for libddo_sdnq.so (test
# cuda_archs_ddo_sdnq); by hand:
#
#   bash scripts/check-cuda-archs.sh <cuobjdump> build/sdnq/libddo_sdnq.so "75-real;120-virtual"
set -euo pipefail
tool=$1 lib=$2 list=$3
if [ -z "$tool" ] || [ ! -x "$tool" ]; then
  echo "cuda_archs: no cuobjdump ('$tool'); install the pinned test requirements" \
    "(python/requirements-test.txt: nvidia-cuda-cuobjdump) or the CUDA toolkit's cuobjdump," \
    "then configure again" >&2
  exit 1
fi
elf=$("$tool" --list-elf "$lib" 2>&1 || true)
ptx=$("$tool" --list-ptx "$lib" 2>&1 || true)
have_elf=$(grep -o 'sm_[0-9]*[a-z]*\.cubin' <<<"$elf" | sed 's/\.cubin//' | sort -u | tr '\n' ' ')
have_ptx=$(grep -o 'sm_[0-9]*[a-z]*\.ptx' <<<"$ptx" | sed 's/\.ptx//' | sort -u | tr '\n' ' ')
echo "cuda_archs: $lib: cubins: ${have_elf:-none}; PTX: ${have_ptx:-none}"
missing=""
IFS=';,' read -r -a items <<<"$list"
for item in "${items[@]}"; do
  arch=${item%%-*}
  case "$item" in
    *-real) want_elf=1 want_ptx=0 ;;
    *-virtual) want_elf=0 want_ptx=1 ;;
    *) want_elf=1 want_ptx=1 ;;
  esac
  if [ $want_elf = 1 ] && [[ " $have_elf" != *" sm_$arch "* ]]; then missing="$missing cubin sm_$arch;"; fi
  if [ $want_ptx = 1 ] && [[ " $have_ptx" != *" sm_$arch "* ]]; then missing="$missing PTX sm_$arch;"; fi
done
if [ -n "$missing" ]; then
  echo "cuda_archs: $lib lacks:$missing (built list: $list)" >&2
  exit 1
fi
echo "cuda_archs: every architecture of '$list' is in $lib"
