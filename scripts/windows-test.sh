#!/usr/bin/env bash
# Windows build of core + engine (settings, profile store with its locking and atomic replace,
# host contexts, planner, platform facts, the engine on the simulation device): cross-compiled with
# Debian's MinGW-w64, tests run under Wine. .ci/run runs it; by hand:
#
#   bash scripts/windows-test.sh        # DDO_MINGW_BUILD (build-mingw), DDO_JOBS, DDO_WINE_TIMEOUT
#
# The dependency prefix (<build>-deps) holds Linux-only Debian packages made usable for the
# cross build: nlohmann-json and fmt are header-only (fmt as FMT_HEADER_ONLY), CLI11's CMake
# package, and GoogleTest compiled from Debian's source package (/usr/src/googletest) by the
# toolchain. Nothing is downloaded. Compiles go through ccache (scripts/common.sh), and only the
# two test programs are built (no torch, no python, no `ddo` command).
#
# Where the platforms differ, core has one file per platform (core/src/os_file_posix.cpp and
# os_file_win32.cpp, Note [File semantics per platform]; core/src/sha256.cpp, Note [SHA-256 per
# platform]); the multi-process tests start their children through core/tests/child_process.h
# (fork on POSIX, the test program started again on Windows).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/common.sh"
build=${DDO_MINGW_BUILD:-$root/build-mingw}
deps=$build-deps
jobs=${DDO_JOBS:-$(nproc)}
wine_timeout=${DDO_WINE_TIMEOUT:-600}  # seconds per test program (each takes about 10 s)
toolchain=$root/cmake/mingw-w64-x86_64.cmake

# Tests that cannot work on Windows, each with the reason. They are compiled out there
# (#ifndef _WIN32) and filtered out here as well, so the list below is the whole story.
excluded=(
  "ProfileStoreTest.ReadOnlyDirectoryFailsAndKeepsTheSavedProfile|a directory's read-only attribute does not stop creating files in it on Windows (only an ACL would); DirectoryThatIsAFileIsAClearError covers the unwritable directory"
  "HostileFilesTest.FifoInPlaceOfAProfileIsNamedAndNeverBlocks|Windows has no FIFOs in the file system (named pipes live under \\\\.\\pipe\\); DirectoryInPlaceOfAProfileIsNamed covers a non-file in a profile's place"
  "CalibrationRegionLockTest.ALinkAtTheLockNameIsRefusedAndItsTargetIsNeverCreated|creating a symbolic link needs a privilege on Windows; the lock opens with FILE_FLAG_OPEN_REPARSE_POINT and refuses a reparse point (os_file_win32.cpp)"
  "CalibrationRegionLockTest.AnotherUsersFileOrANonRegularFileIsRefused|no FIFOs or POSIX owners on Windows, whose temporary folder is per user"
  "HostileFilesTest.CheckWritableFailsBeforeARunWhenTheDirectoryCannotBeWritten (its read-only-directory half only)|the same read-only attribute; its other half (a directory under a file) runs"
)
echo "windows: excluded under Wine:" >&2
filter=""
for entry in "${excluded[@]}"; do
  echo "  ${entry%%|*}: ${entry#*|}" >&2
  name=${entry%%|*}
  [[ $name == *" "* ]] || filter="$filter:$name"
done

if [ ! -f "$deps/.ready" ]; then
  echo "windows: making the dependency prefix $deps" >&2
  rm -rf "$deps"
  mkdir -p "$deps/include" "$deps/share/cmake" "$deps/lib/cmake/fmt"
  cp -r /usr/include/nlohmann "$deps/include/"
  cp -r /usr/share/cmake/nlohmann_json "$deps/share/cmake/"
  cp -r /usr/share/cmake/CLI11 "$deps/share/cmake/"
  cp -r /usr/include/CLI "$deps/include/"
  cp -r /usr/include/fmt "$deps/include/"
  cat >"$deps/lib/cmake/fmt/fmt-config.cmake" <<'CMAKE'
# fmt, header-only, for the MinGW build (Debian ships the library for Linux only).
if(NOT TARGET fmt::fmt)
  add_library(fmt::fmt INTERFACE IMPORTED)
  get_filename_component(_fmt_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
  set_target_properties(fmt::fmt PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_fmt_prefix}/include"
    INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
endif()
set(fmt_FOUND TRUE)
CMAKE
  cmake -S /usr/src/googletest -B "$deps/gtest-build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DDDO_MINGW_DEPS="$deps" \
    -DCMAKE_INSTALL_PREFIX="$deps" -DBUILD_GMOCK=OFF "${DDO_CCACHE_ARGS[@]}" >/dev/null
  cmake --build "$deps/gtest-build" -j "$jobs"
  cmake --install "$deps/gtest-build" >/dev/null
  touch "$deps/.ready"
fi

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$toolchain" -DDDO_MINGW_DEPS="$deps" \
  -DDDO_WITH_TORCH=OFF -DDDO_WITH_CUDA=OFF -DDDO_BUILD_BENCH=OFF "${DDO_CCACHE_ARGS[@]}" >/dev/null
cmake --build "$build" -j "$jobs" --target ddo_core_tests ddo_engine_tests

# One Wine prefix, made once beside the ccache (its first start takes tens of seconds) and reused
# by later builds and clones.
export WINEPREFIX=${DDO_WINEPREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/ddo/wine-prefix} WINEDEBUG=-all
if [ ! -f "$WINEPREFIX/system.reg" ]; then
  mkdir -p "$WINEPREFIX"
  wineboot --init >/dev/null 2>&1 || true
fi
status=0
for test in core/ddo_core_tests engine/ddo_engine_tests; do
  echo "windows: $test.exe under Wine" >&2
  log=$build/$(basename "$test").wine.log
  rc=0
  timeout "$wine_timeout" wine "$build/$test.exe" --gtest_brief=1 ${filter:+--gtest_filter="-${filter#:}"} \
    >"$log" 2>&1 || rc=$?
  # gtest's summary lines, and every failure with its message.
  grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\]|tests? from .* ran' "$log" >&2 || true
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "windows: $test.exe ran past ${wine_timeout} s" >&2
    tail -n 60 "$log" >&2
    status=1
  fi
done
exit $status
