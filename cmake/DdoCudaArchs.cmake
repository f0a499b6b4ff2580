# The CUDA architectures ddo's kernels are built for: one list, here.
#
#   DDO_CUDA_ARCHITECTURES   CMake's form ("75-real;...;120-real;120-virtual"), for nvcc
#   DDO_TORCH_CUDA_ARCH_LIST the same list in torch's form ("7.5;...;12.0+PTX"), given to torch's
#                            CMake package (TORCH_CUDA_ARCH_LIST) when the caller set none, so
#                            that find_package(Torch) never compiles and runs a GPU probe
#
# Note [Architecture list]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The default is the list the CUDA 13.0 build of torch 2.11.0 carries (read from the gencode
# flags recorded in its libtorch_cuda.so on 2026-12-06: sm_75, sm_80, sm_86, sm_90, sm_100,
# sm_120): real code (a cubin) for each, so every card torch runs on runs ddo's kernels without a
# JIT, plus the PTX of the newest (compute_120), which the driver compiles for a card newer than
# the list. A cubin runs on later minor versions of its major (sm_86 on an RTX 40's sm_89, sm_120
# on sm_121), which is why 8.9 needs no image of its own. A developer build may name one
# architecture (-DDDO_CUDA_ARCHITECTURES=90); a device with no image in the built library runs
# the reference path instead of failing (Note [Kernel images] in sdnq/src/kernel_status.cpp).
set(DDO_CUDA_ARCHITECTURES_DEFAULT "75-real;80-real;86-real;90-real;100-real;120-real;120-virtual")

# ddo_torch_arch_list(<out var> <CMake architecture list>): "90-real;120" -> "9.0;12.0+PTX".
# CMake's keywords (all, all-major, native) have no torch form: the default list's is used.
function(ddo_torch_arch_list out archs)
  set(result "")
  set(ptx "")
  foreach(item IN LISTS archs)
    if(item MATCHES "^(all|all-major|native)$")
      ddo_torch_arch_list(result "${DDO_CUDA_ARCHITECTURES_DEFAULT}")
      set(${out} "${result}" PARENT_SCOPE)
      return()
    endif()
    if(NOT item MATCHES "^([0-9]+)([0-9])([a-z]?)(-real|-virtual)?$")
      message(FATAL_ERROR "ddo: '${item}' in DDO_CUDA_ARCHITECTURES is not a CUDA architecture; "
                          "use CMake's form, e.g. 86 or 86-real or 120-virtual")
    endif()
    set(name "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    if(NOT CMAKE_MATCH_4 STREQUAL "-virtual")
      list(APPEND result "${name}")
    endif()
    if(NOT CMAKE_MATCH_4 STREQUAL "-real")
      list(APPEND ptx "${name}")
    endif()
  endforeach()
  foreach(name IN LISTS ptx)
    list(FIND result "${name}" at)
    if(at EQUAL -1)
      list(APPEND result "${name}+PTX")
    else()
      list(REMOVE_AT result ${at})
      list(INSERT result ${at} "${name}+PTX")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES result)
  set(${out} "${result}" PARENT_SCOPE)
endfunction()
