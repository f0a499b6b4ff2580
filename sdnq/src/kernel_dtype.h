// The kernels' code for a float dtype (kernels/dequantize_params.h's DqOutDtype), for the
// sources that launch them; CUDA builds only.
#pragma once

#include <c10/core/ScalarType.h>

#include "../kernels/dequantize_params.h"

namespace ddo::sdnq::internal {

/// kDqBf16, kDqFp16 or kDqFp32 for bfloat16, float16 and (anything else) float32.
inline int kernel_float_code(c10::ScalarType t) {
  return t == c10::kBFloat16 ? kernels::kDqBf16
         : t == c10::kHalf   ? kernels::kDqFp16
                             : kernels::kDqFp32;
}

}  // namespace ddo::sdnq::internal
