#!/usr/bin/env bash
# ddo as a C++ user gets it: installs ddo from an existing build folder into a temporary prefix,
# then builds and runs, against that prefix only, the out-of-tree project examples/cpp/consumer/
# (find_package(ddo) + ddo::torch) and a core-only program through pkg-config (ddo.pc). Fails
# when a file is missing from the install, the installed headers are not exactly
# cmake/public-headers.txt (or one includes a ddo header that is not installed), the consumer
# does not configure, build or run, or its offloaded output differs from the plain forward.
#
#   bash scripts/consumer-test.sh                 # installs from build/ (after scripts/test.sh)
#   DDO_BUILD=build-other bash scripts/consumer-test.sh
#
# It installs what the build folder holds, as `cmake --install` does (it builds nothing: run it
# after scripts/test.sh or another full build of that folder), and compiles one consumer file, so
# CI pays a minute, not a second torch build.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [ ! -f "$DDO_BUILD/build.ninja" ] && [ ! -f "$DDO_BUILD/Makefile" ]; then
  echo "consumer-test: $DDO_BUILD is not a configured build folder; run scripts/test.sh first" \
    "or set DDO_BUILD" >&2
  exit 1
fi
start=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/ddo-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"

if ! grep -q '^DDO_WITH_TORCH:BOOL=ON' "$DDO_BUILD/CMakeCache.txt"; then
  echo "consumer-test: $DDO_BUILD was configured with DDO_WITH_TORCH=OFF; the consumer needs" \
    "ddo::torch" >&2
  exit 1
fi

echo "consumer-test: cmake --install $DDO_BUILD --prefix <temporary>" >&2
cmake --install "$DDO_BUILD" --prefix "$prefix" >"$work/install.log"
libdir=$(sed -n 's/^CMAKE_INSTALL_LIBDIR:[A-Z]*=//p' "$DDO_BUILD/CMakeCache.txt")
libdir=${libdir:-lib}
missing=0
for f in include/ddo/core/settings.h include/ddo/core/presets.h \
  include/ddo/torch/enable_offload.h \
  "$libdir/libddo_core.so" "$libdir/libddo_engine.a" "$libdir/libddo_sdnq.so" \
  "$libdir/libddo_torch.so" "$libdir/cmake/ddo/ddoConfig.cmake" \
  "$libdir/cmake/ddo/ddoConfigVersion.cmake" "$libdir/cmake/ddo/ddoTargets.cmake" \
  "$libdir/pkgconfig/ddo.pc" "$libdir/pkgconfig/ddo-torch.pc" bin/ddo; do
  if [ ! -e "$prefix/$f" ]; then
    echo "consumer-test: the install lacks $f" >&2
    missing=1
  fi
done
[ "$missing" = 0 ] || exit 1
# The installed include tree is exactly cmake/public-headers.txt (Note [Installed headers] in
# cmake/DdoInstall.cmake): an internal header installed again fails here, and so does a listed
# header that includes a ddo header the list lacks.
sed -n 's|^[a-z]*/include/\(ddo/.*\.h\)$|include/\1|p' "$DDO_ROOT/cmake/public-headers.txt" |
  sort >"$work/headers-expected.txt"
(cd "$prefix" && find include -type f -o -type l) | sort >"$work/headers-installed.txt"
if ! diff -u "$work/headers-expected.txt" "$work/headers-installed.txt" >"$work/headers.diff"; then
  echo "consumer-test: the installed headers differ from cmake/public-headers.txt" \
    "(-: listed, not installed; +: installed, not listed):" >&2
  tail -n +3 "$work/headers.diff" | grep '^[-+]' >&2
  exit 1
fi
unlisted=0
while read -r header; do
  for included in $(sed -n 's|^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]\(ddo/[^">]*\)[">].*|\1|p' \
    "$prefix/$header"); do
    if [ ! -e "$prefix/include/$included" ]; then
      echo "consumer-test: the installed $header includes $included, which is not installed" \
        "(add it to cmake/public-headers.txt, or include it from a source file)" >&2
      unlisted=1
    fi
  done
done <"$work/headers-installed.txt"
[ "$unlisted" = 0 ] || exit 1
echo "consumer-test: $(wc -l <"$work/headers-installed.txt") installed headers, as listed" >&2
# The FLUX model (FluxDiT) lives in the build-only ddo_flux_dit target, not in what users link.
if nm -DC "$prefix/$libdir/libddo_torch.so" | grep -q 'FluxDiT'; then
  echo "consumer-test: the installed libddo_torch.so carries the FluxDiT test model" >&2
  exit 1
fi
if [ -e "$prefix/include/ddo/torch/testing" ]; then
  echo "consumer-test: the install carries the testing headers (include/ddo/torch/testing)" >&2
  exit 1
fi
# Note [Installed RPATH] in cmake/DdoInstall.cmake: the libraries find each other by $ORIGIN.
if ! readelf -d "$prefix/$libdir/libddo_torch.so" | grep -q 'R.*PATH.*\$ORIGIN'; then
  echo "consumer-test: the installed libddo_torch.so has no \$ORIGIN in its RUNPATH:" >&2
  readelf -d "$prefix/$libdir/libddo_torch.so" | grep -i path >&2 || true
  exit 1
fi
# The installed command runs from the prefix (its RUNPATH finds libddo_torch.so in ../lib).
"$prefix/bin/ddo" presets >"$work/presets.txt"
grep -q one_shot_fast "$work/presets.txt" || {
  echo "consumer-test: the installed ddo presets did not list one_shot_fast" >&2
  exit 1
}

torch_prefix=$("$DDO_VENV/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
echo "consumer-test: configuring examples/cpp/consumer against the installed ddo" >&2
# As a user on a build machine without a GPU: no TORCH_CUDA_ARCH_LIST, so torch's CMake package
# would compile and run a GPU probe unless ddo's package gives it the list (ddoConfig.cmake).
unset TORCH_CUDA_ARCH_LIST
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if ! cmake -S "$DDO_ROOT/examples/cpp/consumer" -B "$work/consumer" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix;$torch_prefix" \
  >"$work/configure.log" 2>&1; then
  cat "$work/configure.log" >&2
  exit 1
fi
echo "consumer-test: building it" >&2
cmake --build "$work/consumer" -j "${DDO_JOBS:-$(nproc)}"
echo "consumer-test: running it" >&2
"$work/consumer/ddo_consumer" | tee "$work/consumer.txt"
grep -q '^ddo_consumer: ok$' "$work/consumer.txt"

# pkg-config (ddo.pc): a core-only program, no CMake. ddo-torch.pc says what torch flags to add.
echo "consumer-test: a core-only program through pkg-config ddo" >&2
cat >"$work/presets.cpp" <<'EOF'
#include <cstdio>

#include "ddo/core/presets.h"

int main() {
  ddo::core::PresetInfo info;
  const ddo::Status s = ddo::core::resolve_preset("auto", &info);
  std::printf("auto -> %s\n", info.name.c_str());
  return s.ok() && info.name == "one_shot_fast" ? 0 : 1;
}
EOF
export PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
# shellcheck disable=SC2046
"${CXX:-c++}" -std=c++20 "$work/presets.cpp" -o "$work/presets" $(pkg-config --cflags --libs ddo)
"$work/presets"

echo "consumer-test: passed in $(($(date +%s) - start)) s (install, configure, build, run)" >&2
