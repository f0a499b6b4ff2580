# Included before project() (CMAKE_PROJECT_INCLUDE_BEFORE, set by pyproject.toml; scripts may
# pass it too) so that find_package(Torch) in torch/CMakeLists.txt works without arguments: it
# appends torch.utils.cmake_prefix_path of the building interpreter (Python_EXECUTABLE, as
# scikit-build-core passes it) to CMAKE_PREFIX_PATH, unless Torch_DIR is given.
# The CUDA architecture list torch's package is given comes from cmake/DdoCudaArchs.cmake.

if(NOT (DEFINED Torch_DIR AND EXISTS "${Torch_DIR}"))
  set(ddo_python_for_torch "")
  foreach(candidate IN ITEMS "${Python_EXECUTABLE}" "${Python3_EXECUTABLE}" "${PYTHON_EXECUTABLE}")
    if(candidate AND NOT ddo_python_for_torch)
      set(ddo_python_for_torch "${candidate}")
    endif()
  endforeach()
  if(ddo_python_for_torch)
    execute_process(
      COMMAND "${ddo_python_for_torch}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE ddo_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE ddo_torch_prefix_rc ERROR_QUIET)
    if(ddo_torch_prefix_rc EQUAL 0 AND ddo_torch_prefix)
      list(APPEND CMAKE_PREFIX_PATH "${ddo_torch_prefix}")
      message(STATUS "ddo: torch's CMake prefix from ${ddo_python_for_torch}")
    else()
      message(WARNING "ddo: ${ddo_python_for_torch} cannot import torch; pass -DTorch_DIR=...")
    endif()
  endif()
endif()
