// Parameters of ddo's quantized-matmul kernels: the activation quantizer (one pass per row:
// absmax, scale, cast) and the int8 GEMM's epilogue (int32 sums times the row and column
// scales, plus the bias, in the result dtype). Plain structs, no torch or CUDA headers, like
// dequantize_params.h.
//
//   QuantizeRowsParams p;
//   p.input = x.data_ptr(); p.in_dtype = kDqBf16; p.rows = m; p.cols = k;
//   p.out = xq.data_ptr(); p.scale = xs.data_ptr<float>(); p.type = kDqInt8;
//   launch_quantize_rows(p, stream);            // returns a cudaError_t as int
#pragma once

#include <cstdint>

#include "dequantize_params.h"

namespace ddo::sdnq::kernels {

struct QuantizeRowsParams {
  const void* input = nullptr;  // [rows, cols], rows `row_stride` elements apart, in_dtype
  void* out = nullptr;          // [rows, cols] contiguous: int8 or float8_e4m3fn bytes
  float* scale = nullptr;       // [rows]: absmax / qmax (0 for a row of zeros)
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;  // elements between rows of the input
  int in_dtype = kDqBf16;       // a DqOutDtype: bf16, fp16 or fp32
  int type = kDqInt8;           // kDqInt8 or kDqFp8E4M3
};

// Enqueues the quantizer on `stream` (a cudaStream_t). Returns cudaSuccess (0) or the error.
int launch_quantize_rows(const QuantizeRowsParams& params, void* stream);

struct ScaleEpilogueParams {
  const std::int32_t* acc = nullptr;  // [rows, cols] contiguous: the int8 GEMM's sums
  const float* row_scale = nullptr;   // [rows]: the activations' scales
  const float* col_scale = nullptr;   // [cols]: the weight's per-output scales
  const void* bias = nullptr;         // [cols] in out_dtype, or null
  void* out = nullptr;                // [rows, cols] contiguous, out_dtype
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  int out_dtype = kDqBf16;  // a DqOutDtype
};

// Enqueues the epilogue on `stream`. Returns cudaSuccess (0) or the error.
int launch_int8_scale_epilogue(const ScaleEpilogueParams& params, void* stream);

}  // namespace ddo::sdnq::kernels
