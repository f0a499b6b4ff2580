# One libstdc++ per process: ddo's shared libraries link the shared libstdc++.so.6 that torch loads.
#
# A compiler whose own library folder holds only libstdc++.a (the GPU image's g++, GCC 13.3 in
# /opt/gcc) puts a private copy of libstdc++ into every `-shared` link. Executables work with it;
# inside Python, next to torch's libstdc++.so.6, the copy's locale facets disagree with the shared
# ones and the process crashes on its first formatted number
# (bench/results/2026-12-03-h200-python-crash/).
#
#   include(cmake/DdoSharedStdlib.cmake)        # once, in the top-level CMakeLists.txt
#   add_library(ddo_sdnq SHARED ...)
#   ddo_use_shared_stdlib(ddo_sdnq)             # links libstdc++.so.6; adds a ctest check (label torch)
#
# The first call probes, once per build folder: it builds a small shared library that formats a
# number (try_compile) and reads it with ddo_stdlib_copy_reason below. When the default link holds a
# copy it tries, in order, and keeps the first whose probe holds none:
#   1. -L<build>/ddo-stdlib, a folder with a libstdc++.so link to the libstdc++.so.6 torch loads
#      (torch's lib folder, the one ldd finds for libc10.so, or ldconfig's);
#   2. -nostdlib++ <that libstdc++.so.6>;
#   3. -nodefaultlibs <that libstdc++.so.6> -lm -lc -lgcc_s -lgcc.
# With the distribution's g++ the default link is already shared and nothing is added. The options
# are PUBLIC: an executable that loads the library (tests, benchmarks, tools) links the same shared
# copy instead of a static one beside it. -DDDO_SHARED_STDLIB=OFF skips the probe (to see the check
# fail on such a toolchain).
#
# Run as a script, the same file is the check (the ctest test ddo_use_shared_stdlib adds):
#   cmake -DDDO_STDLIB_CHECK="a.so;b.so" [-DDDO_READELF=readelf] [-DDDO_NM=nm] -P DdoSharedStdlib.cmake
# It fails for a library without NEEDED libstdc++.so.6 or that defines libstdc++'s own locale and
# ostream internals.

include_guard(GLOBAL)

# Mangled names only libstdc++'s compiled sources define (its headers declare them extern):
# std::locale::classic(), std::ios_base::Init::Init(), std::ostream::_M_insert<T>(T) and
# std::num_put<char>::id. A shared library that defines any of them carries its own libstdc++.
set(DDO_STDLIB_INTERNALS
    "_ZNSt6locale7classicEv|_ZNSt8ios_base4InitC[12]Ev|_ZNSo9_M_insertI|_ZNSt7num_putIcSt19ostreambuf_iteratorIcSt11char_traitsIcEEE2idE")

# ddo_stdlib_copy_reason(<file> <out-var>): <out-var> is empty when <file> needs libstdc++.so.6
# and defines none of DDO_STDLIB_INTERNALS, otherwise it says what was seen. Uses DDO_READELF
# (readelf -d, or objdump -p) and DDO_NM.
function(ddo_stdlib_copy_reason file out)
  if(NOT EXISTS "${file}")
    set(${out} "${file} does not exist" PARENT_SCOPE)
    return()
  endif()
  if(DDO_READELF MATCHES "objdump")
    set(dynamic_flag -p)
  else()
    set(dynamic_flag -d)
  endif()
  execute_process(COMMAND "${DDO_READELF}" ${dynamic_flag} "${file}"
    OUTPUT_VARIABLE dynamic ERROR_VARIABLE dynamic_err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    set(${out} "${DDO_READELF} ${dynamic_flag} ${file} failed: ${dynamic_err}" PARENT_SCOPE)
    return()
  endif()
  if(NOT dynamic MATCHES "NEEDED[^\n]*libstdc\\+\\+\\.so")
    set(${out} "no NEEDED libstdc++.so.6: libstdc++ is linked in statically" PARENT_SCOPE)
    return()
  endif()
  if(DDO_NM)
    # The symbol table, and the dynamic one for a stripped library (an installed wheel).
    execute_process(COMMAND "${DDO_NM}" --defined-only "${file}" OUTPUT_VARIABLE symbols ERROR_QUIET)
    execute_process(COMMAND "${DDO_NM}" -D --defined-only "${file}" OUTPUT_VARIABLE dynamic_symbols
      ERROR_QUIET)
    string(REGEX MATCHALL " (${DDO_STDLIB_INTERNALS})[^\n]*" found "${symbols}\n${dynamic_symbols}")
    if(found)
      list(TRANSFORM found STRIP)
      list(REMOVE_DUPLICATES found)
      list(LENGTH found count)
      list(SUBLIST found 0 4 shown)
      string(REPLACE ";" ", " shown "${shown}")
      set(${out} "defines ${count} of libstdc++'s own symbols (${shown}): a static copy" PARENT_SCOPE)
      return()
    endif()
  endif()
  set(${out} "" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE)
  if(NOT DDO_READELF)
    find_program(DDO_READELF NAMES readelf objdump REQUIRED)
  endif()
  if(NOT DDO_NM)
    find_program(DDO_NM nm)
  endif()
  foreach(lib IN LISTS DDO_STDLIB_CHECK)
    ddo_stdlib_copy_reason("${lib}" reason)
    if(reason)
      message(SEND_ERROR "${lib}: ${reason}. Inside Python it crashes next to torch's "
        "libstdc++.so.6. The configure output's 'ddo: libstdc++' lines say how the probe of "
        "cmake/DdoSharedStdlib.cmake linked; a g++ that links libstdc++.so needs no probe.")
    else()
      message(STATUS "${lib}: needs the shared libstdc++.so.6, defines none of its internals")
    endif()
  endforeach()
  return()
endif()

option(DDO_SHARED_STDLIB "Link ddo's shared libraries against the shared libstdc++.so.6" ON)
set(DDO_STDLIB_MODULE "${CMAKE_CURRENT_LIST_FILE}")

# The libstdc++.so.6 torch loads: torch's own lib folder, what ldd finds for libc10.so, else the
# system's (ldconfig).
function(_ddo_find_shared_stdlib out)
  set(torch_lib "")
  if(TORCH_INSTALL_PREFIX)
    set(torch_lib "${TORCH_INSTALL_PREFIX}/lib")
  elseif(Torch_DIR)
    get_filename_component(torch_lib "${Torch_DIR}/../../../lib" ABSOLUTE)
  endif()
  if(torch_lib AND EXISTS "${torch_lib}/libstdc++.so.6")
    set(${out} "${torch_lib}/libstdc++.so.6" PARENT_SCOPE)
    return()
  endif()
  if(torch_lib AND EXISTS "${torch_lib}/libc10.so")
    execute_process(COMMAND ldd "${torch_lib}/libc10.so" OUTPUT_VARIABLE ldd_out ERROR_QUIET)
    if(ldd_out MATCHES "libstdc\\+\\+\\.so\\.6 => ([^ \n]+)" AND EXISTS "${CMAKE_MATCH_1}")
      set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
      return()
    endif()
  endif()
  execute_process(COMMAND ldconfig -p OUTPUT_VARIABLE ldconfig_out ERROR_QUIET)
  if(ldconfig_out MATCHES "libstdc\\+\\+\\.so\\.6 \\([^)]*x86-64[^)]*\\) => ([^ \n]+)")
    set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
  elseif(ldconfig_out MATCHES "libstdc\\+\\+\\.so\\.6 [^\n]*=> ([^ \n]+)")
    set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

# _ddo_probe_stdlib(<name> <out-reason> OPTIONS ... LIBRARIES ...): builds the probe shared
# library with these link options and libraries (as the real targets get them) and reads it.
function(_ddo_probe_stdlib name out)
  cmake_parse_arguments(P "" "" "OPTIONS;LIBRARIES" ${ARGN})
  set(dir "${CMAKE_BINARY_DIR}/CMakeFiles/ddo-stdlib-probe/${name}")
  file(REMOVE_RECURSE "${dir}")
  file(WRITE "${dir}/src/probe.cpp" [=[
#include <sstream>
#include <string>
std::string ddo_stdlib_probe(long v) { std::ostringstream s; s << v; return s.str(); }
]=])
  # Unresolved symbols fail the link (-z defs), so a way that drops libstdc++ entirely fails too.
  set(options "")
  foreach(item IN LISTS P_OPTIONS)
    string(APPEND options " [==[${item}]==]")
  endforeach()
  set(libraries "")
  foreach(item IN LISTS P_LIBRARIES)
    string(APPEND libraries " [==[${item}]==]")
  endforeach()
  file(WRITE "${dir}/src/CMakeLists.txt" "cmake_minimum_required(VERSION 3.25)
project(ddo_stdlib_probe CXX)
add_library(probe SHARED probe.cpp)
set_target_properties(probe PROPERTIES LIBRARY_OUTPUT_DIRECTORY [==[${dir}/out]==])
target_link_options(probe PRIVATE -Wl,-z,defs${options})
target_link_libraries(probe PRIVATE${libraries})
")
  try_compile(linked "${dir}/build" "${dir}/src" ddo_stdlib_probe probe
    CMAKE_FLAGS "-DCMAKE_CXX_FLAGS=${CMAKE_CXX_FLAGS}"
    "-DCMAKE_SHARED_LINKER_FLAGS=${CMAKE_SHARED_LINKER_FLAGS}"
    OUTPUT_VARIABLE log)
  file(WRITE "${dir}/log.txt" "${log}")
  if(NOT linked)
    set(${out} "the probe did not link (${dir}/log.txt)" PARENT_SCOPE)
    return()
  endif()
  ddo_stdlib_copy_reason("${dir}/out/libprobe.so" reason)
  set(${out} "${reason}" PARENT_SCOPE)
endfunction()

# Fills the cache entries DDO_STDLIB_LINK_OPTIONS / DDO_STDLIB_LINK_LIBRARIES once per build
# folder (and again when the compiler or the linker flags change).
function(_ddo_configure_shared_stdlib)
  set(key "${CMAKE_CXX_COMPILER}|${CMAKE_CXX_FLAGS}|${CMAKE_SHARED_LINKER_FLAGS}|${DDO_SHARED_STDLIB}")
  if(DEFINED CACHE{DDO_STDLIB_SUMMARY} AND "$CACHE{DDO_STDLIB_PROBED}" STREQUAL "${key}")
    return()
  endif()
  set(options "")
  set(libraries "")
  set(summary "shared libraries link libstdc++.so.6 the default way")
  if(NOT DDO_SHARED_STDLIB)
    set(summary "not probed (DDO_SHARED_STDLIB=OFF)")
  elseif(NOT DDO_READELF)
    set(summary "not probed: neither readelf nor objdump found")
    message(WARNING "ddo: neither readelf nor objdump found: cannot check how libstdc++ links")
  else()
    _ddo_probe_stdlib(default reason)
    if(reason)
      _ddo_find_shared_stdlib(stdlib)
      message(STATUS "ddo: libstdc++: a shared library linked the default way: ${reason}; "
        "torch loads ${stdlib}")
      set(ways link_folder nostdlibxx nodefaultlibs)
      if(NOT stdlib)
        set(ways "")
      endif()
      set(folder "${CMAKE_BINARY_DIR}/ddo-stdlib")
      foreach(way IN LISTS ways)
        if(way STREQUAL "link_folder")
          file(MAKE_DIRECTORY "${folder}")
          file(CREATE_LINK "${stdlib}" "${folder}/libstdc++.so" SYMBOLIC)
          set(try_options "-L${folder}")
          set(try_libraries "")
        elseif(way STREQUAL "nostdlibxx")
          set(try_options "-nostdlib++")
          set(try_libraries "${stdlib}")
        else()
          set(try_options "-nodefaultlibs")
          set(try_libraries "${stdlib};-lm;-lc;-lgcc_s;-lgcc")
        endif()
        _ddo_probe_stdlib(${way} reason OPTIONS ${try_options} LIBRARIES ${try_libraries})
        if(NOT reason)
          set(options "${try_options}")
          set(libraries "${try_libraries}")
          break()
        endif()
        string(JOIN " " how ${try_options} ${try_libraries})
        message(STATUS "ddo: libstdc++: not with ${how}: ${reason}")
      endforeach()
      string(JOIN " " how ${options} ${libraries})
      set(summary "shared libraries link with ${how}")
      if(NOT options)
        set(summary "no way found to link libstdc++.so.6: shared libraries carry their own copy")
        message(WARNING "ddo: no way found to link the shared libstdc++.so.6 (probes in "
          "${CMAKE_BINARY_DIR}/CMakeFiles/ddo-stdlib-probe); ddo's Python package will crash "
          "inside Python. Use a g++ whose library folder has libstdc++.so.")
      endif()
    endif()
  endif()
  set(DDO_STDLIB_LINK_OPTIONS "${options}" CACHE INTERNAL "ddo: link options for libstdc++.so.6")
  set(DDO_STDLIB_LINK_LIBRARIES "${libraries}" CACHE INTERNAL "ddo: libraries for libstdc++.so.6")
  set(DDO_STDLIB_SUMMARY "${summary}" CACHE INTERNAL "ddo: what the libstdc++ probe found")
  set(DDO_STDLIB_PROBED "${key}" CACHE INTERNAL "ddo: what the libstdc++ probe ran for")
endfunction()

# ddo_use_shared_stdlib(<target>...): each target (a SHARED or MODULE library) links the shared
# libstdc++.so.6, and, when tests are built, a ctest test (stdlib_<target>, label torch) checks
# the built file.
function(ddo_use_shared_stdlib)
  set(DDO_READELF "${CMAKE_READELF}")
  if(NOT DDO_READELF)
    set(DDO_READELF "${CMAKE_OBJDUMP}")
  endif()
  set(DDO_NM "${CMAKE_NM}")
  _ddo_configure_shared_stdlib()
  if(NOT TARGET ddo_shared_stdlib)
    # Said on every configure (the probe runs only on the first): gpu.sh copies it into its summary.
    message(STATUS "ddo: libstdc++: ${DDO_STDLIB_SUMMARY}")
    add_library(ddo_shared_stdlib INTERFACE)
    target_link_options(ddo_shared_stdlib INTERFACE ${DDO_STDLIB_LINK_OPTIONS})
    target_link_libraries(ddo_shared_stdlib INTERFACE ${DDO_STDLIB_LINK_LIBRARIES})
  endif()
  foreach(target IN LISTS ARGN)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "MODULE_LIBRARY")
      target_link_libraries(${target} PRIVATE ddo_shared_stdlib)
    else()
      target_link_libraries(${target} PUBLIC ddo_shared_stdlib)
    endif()
    if(DDO_BUILD_TESTS AND DDO_READELF)
      add_test(NAME stdlib_${target}
        COMMAND "${CMAKE_COMMAND}" "-DDDO_STDLIB_CHECK=$<TARGET_FILE:${target}>"
        "-DDDO_READELF=${DDO_READELF}" "-DDDO_NM=${DDO_NM}" -P "${DDO_STDLIB_MODULE}")
      set_tests_properties(stdlib_${target} PROPERTIES LABELS torch)
    endif()
  endforeach()
endfunction()
