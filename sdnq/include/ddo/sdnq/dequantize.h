/// \file
/// Dequantizing an SDNQ weight, and the quantized Linear's forward.
///
/// `dequantize` is the one entry point: on a CUDA tensor it runs ddo's dequantize kernel
/// (sdnq/kernels/, one pass from packed bytes to the result dtype) where the kernel covers the
/// layout and the library has code for the device (kernel_status.h), and the ATen reference
/// otherwise; on the CPU it runs the reference. Both give the
/// `sdnq` package's dequantize result bit for bit (Note [Bit-equal dequantize] in
/// sdnq/src/dequantize.cpp).
///
/// ```
/// at::Tensor w = ddo::sdnq::dequantize(weights, layout);          // [out, in], result dtype
/// at::Tensor y = ddo::sdnq::linear(x, weights, bias, layout);     // = F.linear(x, w, bias)
/// ```
#pragma once

#include <ATen/core/Tensor.h>

#include "ddo/sdnq/layout.h"

namespace ddo::sdnq {

/// The weight as the Linear would hold it: [out, in], contiguous, `layout.result_dtype`, on the
/// weight's device.
at::Tensor dequantize(const QuantizedWeight& w, const Layout& layout);

/// The same computed with ATen ops only (any device): the reference the kernel is tested against.
at::Tensor dequantize_reference(const QuantizedWeight& w, const Layout& layout);

/// True when the CUDA kernel covers this layout with these tensors (contiguous, f32 scales) and
/// runs on their device (use_dequantize_kernel in kernel_status.h).
bool kernel_supports(const QuantizedWeight& w, const Layout& layout);

/// The SDNQ layer's forward: a quantized GEMM where choose_linear_path picks one
/// (quantized_matmul.h), else linear(input, dequantize(w), bias).
at::Tensor linear(const at::Tensor& input, const QuantizedWeight& w, const at::Tensor& bias,
                  const Layout& layout);

}  // namespace ddo::sdnq
