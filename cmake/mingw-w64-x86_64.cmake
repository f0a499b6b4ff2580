# Toolchain: core + engine for Windows x86-64, cross-compiled with Debian's MinGW-w64 (the
# "posix" thread model, which std::thread and std::mutex need) and run under Wine.
#
#   bash scripts/windows-test.sh              # deps, configure, build, tests under Wine
#
# or by hand, after scripts/windows-test.sh has made the dependency prefix once:
#   cmake -S . -B build-mingw -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/mingw-w64-x86_64.cmake \
#     -DDDO_MINGW_DEPS=$PWD/build-mingw-deps -DDDO_WITH_TORCH=OFF -DDDO_WITH_CUDA=OFF \
#     -DDDO_BUILD_BENCH=OFF
#
# DDO_MINGW_DEPS is a prefix holding what Debian ships only for Linux: nlohmann-json and fmt
# (header-only), CLI11's package, and GoogleTest built from /usr/src/googletest by this toolchain.
set(CMAKE_SYSTEM_NAME Windows)
set(CMAKE_SYSTEM_PROCESSOR x86_64)
set(CMAKE_C_COMPILER x86_64-w64-mingw32-gcc-posix)
set(CMAKE_CXX_COMPILER x86_64-w64-mingw32-g++-posix)
set(CMAKE_RC_COMPILER x86_64-w64-mingw32-windres)

# try_compile projects see the prefix too.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES DDO_MINGW_DEPS)
set(CMAKE_FIND_ROOT_PATH /usr/x86_64-w64-mingw32 ${DDO_MINGW_DEPS})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# Executables carry libstdc++, libgcc and winpthread, so Wine runs them without DLLs beside them.
set(CMAKE_EXE_LINKER_FLAGS_INIT "-static")
# Tests run under Wine; listing them at build time would start Wine once per test binary for
# nothing (scripts/windows-test.sh runs each binary once).
set(CMAKE_CROSSCOMPILING_EMULATOR wine)
set(CMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE PRE_TEST)
