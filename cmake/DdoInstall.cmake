# `cmake --install`: ddo's headers, libraries, the `ddo` command, a CMake package and pkg-config
# files, so a C++ project outside this tree uses ddo the usual way:
#
#   cmake --install build --prefix /opt/ddo
#   # a consumer's CMakeLists.txt, configured with -DCMAKE_PREFIX_PATH="/opt/ddo;<torch's prefix>":
#   find_package(ddo REQUIRED)                     # finds Torch (and ddo's other dependencies) too
#   target_link_libraries(app PRIVATE ddo::torch)  # ddo::core for settings and profiles alone
#
# Layout under the prefix (GNUInstallDirs):
#   include/ddo/{core,torch}/...                   the API: cmake/public-headers.txt
#                                                  (Note [Installed headers])
#   lib/libddo_core.so                             shared: one copy of core's process-wide state
#                                                  (Note [One core per process]; libddo_core.a
#                                                  without torch and on Windows)
#   lib/libddo_engine.a                            static: linked into libddo_torch.so only
#   lib/libddo_sdnq.so, libddo_torch.so            shared: their TORCH_LIBRARY blocks are static
#                                                  constructors a static archive would drop
#   lib/cmake/ddo/ddoConfig.cmake, ddoConfigVersion.cmake, ddoTargets.cmake
#   lib/pkgconfig/ddo.pc, ddo-torch.pc
#   bin/ddo
#
# Imported targets: ddo::core, ddo::engine and, in a torch build, ddo::sdnq and ddo::torch. They
# carry their include folder, compile definitions and dependencies; the same names exist inside
# this tree (ALIAS targets) for a project that adds ddo with add_subdirectory. ddo::engine and
# ddo::sdnq install no headers: they are what ddo::torch links.
#
# See Note [Installed RPATH] and Note [Installed libstdc++] below. Included once, from the
# top-level CMakeLists.txt, after every library's subdirectory (it reads their targets) and
# before python/ (whose pip install sets its own RPATH on the same two libraries).
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DDO_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/ddo"
  CACHE STRING "Where the ddo CMake package goes, relative to the install prefix")

set(_ddo_export_targets ddo_core ddo_engine)
if(DDO_WITH_TORCH)
  list(APPEND _ddo_export_targets ddo_sdnq ddo_torch)
endif()
foreach(target IN LISTS _ddo_export_targets)
  string(REGEX REPLACE "^ddo_" "" name "${target}")
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
  add_library(ddo::${name} ALIAS ${target})
endforeach()

# Note [Installed RPATH]
# ~~~~~~~~~~~~~~~~~~~~~~
# An installed libddo_torch.so finds libddo_sdnq.so beside it ($ORIGIN), and torch's and CUDA's
# runtime libraries in the folders this build linked: the loader resolves a library's own NEEDED
# entries through its own RUNPATH only, not the executable's, so the library must name them
# itself. They are named explicitly (torch's lib folder, CUDA's library folder) rather than by
# INSTALL_RPATH_USE_LINK_PATH, which also copies the MKL folders torch's package lists whether
# they exist or not. A consumer whose torch sits elsewhere (the same version: LibTorch has no
# stable ABI) sets LD_LIBRARY_PATH. The `ddo` command finds the libraries in ../lib. pip's install
# (python/) sets its own RPATH on the same two libraries, after this file.
set(_ddo_runtime_dirs "")
if(DDO_WITH_TORCH AND Torch_DIR)
  get_filename_component(DDO_TORCH_LIBDIR "${Torch_DIR}/../../../lib" ABSOLUTE)
  list(APPEND _ddo_runtime_dirs "${DDO_TORCH_LIBDIR}")
endif()
if(DDO_WITH_CUDA AND CUDAToolkit_LIBRARY_DIR)
  list(APPEND _ddo_runtime_dirs "${CUDAToolkit_LIBRARY_DIR}")
endif()
foreach(target IN LISTS _ddo_export_targets)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "SHARED_LIBRARY")
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN;${_ddo_runtime_dirs}")
  endif()
endforeach()
file(RELATIVE_PATH _ddo_bin_to_lib "/p/${CMAKE_INSTALL_BINDIR}" "/p/${CMAKE_INSTALL_LIBDIR}")
set_target_properties(ddo PROPERTIES
  INSTALL_RPATH "$ORIGIN/${_ddo_bin_to_lib};${_ddo_runtime_dirs}")

# Note [Installed libstdc++]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# ddo_sdnq and ddo_torch link ddo_shared_stdlib PUBLIC (cmake/DdoSharedStdlib.cmake), so an
# executable that loads them links the same shared libstdc++.so.6 as torch; an installed consumer
# must too, or on a compiler whose own folder holds only libstdc++.a (the GPU image's g++) it
# carries a static copy beside the shared one. The target is exported as ddo::shared_stdlib with
# the probe's options. One of them names a folder of this build (-L<build>/ddo-stdlib, holding a
# libstdc++.so link to torch's libstdc++.so.6): that link is installed to <libdir>/ddo-stdlib and
# the installed option names it there. The other ways (-nostdlib++ or -nodefaultlibs plus the
# absolute path of torch's libstdc++.so.6) hold no build path and are exported as they are. With
# the distribution's g++ the target is empty.
if(TARGET ddo_shared_stdlib)
  set(_ddo_stdlib_folder "${CMAKE_BINARY_DIR}/ddo-stdlib")
  set(_ddo_stdlib_options "")
  foreach(option IN LISTS DDO_STDLIB_LINK_OPTIONS)
    list(APPEND _ddo_stdlib_options "$<BUILD_INTERFACE:${option}>")
    if(option STREQUAL "-L${_ddo_stdlib_folder}")
      list(APPEND _ddo_stdlib_options
        "$<INSTALL_INTERFACE:-L$<INSTALL_PREFIX>/${CMAKE_INSTALL_LIBDIR}/ddo-stdlib>")
      install(FILES "${_ddo_stdlib_folder}/libstdc++.so"
        DESTINATION "${CMAKE_INSTALL_LIBDIR}/ddo-stdlib" COMPONENT devel)
    else()
      list(APPEND _ddo_stdlib_options "$<INSTALL_INTERFACE:${option}>")
    endif()
  endforeach()
  set_target_properties(ddo_shared_stdlib PROPERTIES
    EXPORT_NAME shared_stdlib INTERFACE_LINK_OPTIONS "${_ddo_stdlib_options}")
  list(APPEND _ddo_export_targets ddo_shared_stdlib)
endif()

install(TARGETS ${_ddo_export_targets} EXPORT ddoTargets
  ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT devel
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT runtime
  INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(TARGETS ddo RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}" COMPONENT runtime)

# Note [Installed headers]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# An installed header is a promise: a user may include it, and ddo keeps it working across
# releases of the same minor version. So only the API is installed: the headers a user includes
# (enable_offload.h, profile_run.h, pipeline_offload.h, loader.h, generation.h) and exactly the
# ddo headers they include, listed once in cmake/public-headers.txt (DDO_PUBLIC_HEADERS; also the
# input of scripts/docs.sh). The rest (file locks, the checkpoint reader, the memory probe, the
# engine's and SDNQ's headers, ...) stays in the build tree, where ddo's own targets and tests
# include it. scripts/consumer-test.sh checks the installed tree against the list and that the
# list includes nothing outside itself.
file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/public-headers.txt" DDO_PUBLIC_HEADERS REGEX "^[^#]")
set_property(DIRECTORY "${PROJECT_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
  "${CMAKE_CURRENT_LIST_DIR}/public-headers.txt")
foreach(header IN LISTS DDO_PUBLIC_HEADERS)
  if(NOT header MATCHES "^(core|engine|sdnq|torch)/include/(ddo/.+)/[^/]+\\.h$")
    message(FATAL_ERROR "cmake/public-headers.txt: '${header}' is not a header under "
      "<layer>/include/ddo/ (core, engine, sdnq, torch)")
  endif()
  set(_ddo_layer "${CMAKE_MATCH_1}")
  set(_ddo_subdir "${CMAKE_MATCH_2}")
  if(NOT EXISTS "${PROJECT_SOURCE_DIR}/${header}")
    message(FATAL_ERROR "cmake/public-headers.txt lists ${header}, which does not exist")
  endif()
  if(NOT TARGET ddo_${_ddo_layer})  # sdnq and torch in a build without torch
    continue()
  endif()
  install(FILES "${PROJECT_SOURCE_DIR}/${header}"
    DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${_ddo_subdir}" COMPONENT devel)
endforeach()
unset(_ddo_layer)
unset(_ddo_subdir)

install(EXPORT ddoTargets NAMESPACE ddo:: DESTINATION "${DDO_INSTALL_CMAKEDIR}" COMPONENT devel)

# What ddoConfig.cmake needs to know about this build: which layers exist, whether the CUDA
# backend is in (ddo_engine links CUDA::cudart), and which torch it was built against (its
# version is checked; its folder is a hint, after the consumer's own CMAKE_PREFIX_PATH).
set(DDO_CONFIG_WITH_TORCH ${DDO_WITH_TORCH})
set(DDO_CONFIG_WITH_CUDA ${DDO_WITH_CUDA})
set(DDO_CONFIG_TORCH_VERSION "")
set(DDO_CONFIG_TORCH_CUDA_ARCH_LIST "${DDO_TORCH_CUDA_ARCH_LIST}")
set(DDO_CONFIG_TORCH_DIR "")
set(DDO_CONFIG_TORCH_LIBDIR "")
if(DDO_WITH_TORCH AND Torch_DIR)
  set(DDO_CONFIG_TORCH_DIR "${Torch_DIR}")
  set(DDO_CONFIG_TORCH_LIBDIR "${DDO_TORCH_LIBDIR}")
  file(STRINGS "${Torch_DIR}/TorchConfigVersion.cmake" _ddo_torch_version_line
    REGEX "set\\(PACKAGE_VERSION \"[^\"]+\"\\)" LIMIT_COUNT 1)
  string(REGEX REPLACE ".*\"([^\"]+)\".*" "\\1" DDO_CONFIG_TORCH_VERSION
    "${_ddo_torch_version_line}")
endif()
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/ddoConfig.cmake.in"
  "${CMAKE_BINARY_DIR}/ddoConfig.cmake" INSTALL_DESTINATION "${DDO_INSTALL_CMAKEDIR}")
# 0.x: a minor version may change the API, so only the same minor version is compatible.
write_basic_package_version_file("${CMAKE_BINARY_DIR}/ddoConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_BINARY_DIR}/ddoConfig.cmake" "${CMAKE_BINARY_DIR}/ddoConfigVersion.cmake"
  DESTINATION "${DDO_INSTALL_CMAKEDIR}" COMPONENT devel)

# pkg-config: prefix relative to the .pc file, so `cmake --install --prefix` anywhere works.
file(RELATIVE_PATH _ddo_pc_to_prefix "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
string(REGEX REPLACE "/$" "" _ddo_pc_to_prefix "${_ddo_pc_to_prefix}")
set(DDO_PC_PREFIX "\${pcfiledir}/${_ddo_pc_to_prefix}")
set(_ddo_pc_files ddo)
if(DDO_WITH_TORCH)
  list(APPEND _ddo_pc_files ddo-torch)
endif()
set(DDO_PC_CUDA_LIBS "")
if(DDO_WITH_CUDA)
  # ddo_engine's CUDA backend calls the runtime API (shared cudart, the one torch loads).
  set(DDO_PC_CUDA_LIBS "-L${CUDAToolkit_LIBRARY_DIR} -lcudart")
endif()
# A static core brings its dependencies into the consumer's link; a shared one has its own.
get_target_property(_ddo_core_type ddo_core TYPE)
if(_ddo_core_type STREQUAL "SHARED_LIBRARY")
  set(DDO_PC_CORE_REQUIRES "Requires: nlohmann_json\nRequires.private: fmt libcrypto")
  set(DDO_PC_CORE_LIBS "-Wl,-rpath,\${libdir} -lddo_core")
else()
  set(DDO_PC_CORE_REQUIRES "Requires: nlohmann_json fmt libcrypto")
  set(DDO_PC_CORE_LIBS "-lddo_core")
endif()
foreach(pc IN LISTS _ddo_pc_files)
  configure_file("${CMAKE_CURRENT_LIST_DIR}/${pc}.pc.in" "${CMAKE_BINARY_DIR}/${pc}.pc" @ONLY)
  install(FILES "${CMAKE_BINARY_DIR}/${pc}.pc"
    DESTINATION "${CMAKE_INSTALL_LIBDIR}/pkgconfig" COMPONENT devel)
endforeach()
