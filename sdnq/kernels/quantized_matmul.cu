// ddo's quantized-matmul kernels: the per-token activation quantizer and the int8 epilogue.
//
// Note [Bit-equal quantized matmul steps]
// ---------------------------------------
// Both kernels reproduce their ATen references (sdnq/src/quantized_matmul.cpp) bit for bit, so
// the GPU test can compare them exactly and the reference can stand in on a device without a
// kernel image. Each element goes through the references' roundings and no others:
//  - quantize_rows: the row's absmax in float32 (a max is exact in any order); scale = absmax /
//    qmax, one correctly rounded division; v = x / (scale, or 1 where it is 0), another; int8:
//    round half to even (rintf), clamp to [-127, 127]; fp8 e4m3: clamp to ±448, then the
//    round-to-nearest-even conversion. No multiplication by a reciprocal, no contraction.
//  - int8 epilogue: float(acc) (round to nearest even), times the row scale, times the column
//    scale, plus float(bias), each an IEEE float32 operation in that order (__fmul_rn and
//    __fadd_rn keep nvcc from fusing them), then one conversion to the result dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "quantized_matmul_params.h"

namespace ddo::sdnq::kernels {
namespace {

constexpr int kThreads = 256;

template <int kIn>
__device__ __forceinline__ float load(const void* p, std::int64_t i) {
  if constexpr (kIn == kDqBf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  } else if constexpr (kIn == kDqFp16) {
    return __half2float(static_cast<const __half*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

template <int kOut>
__device__ __forceinline__ void store(void* out, std::int64_t i, float v) {
  if constexpr (kOut == kDqBf16) {
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  } else if constexpr (kOut == kDqFp16) {
    static_cast<__half*>(out)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

// One block per row: a block-wide absmax, then every element quantized with the row's scale.
template <int kIn, int kType>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(QuantizeRowsParams p) {
  __shared__ float warp_max[kThreads / 32];
  __shared__ float row_divisor;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const std::int64_t base = row * p.row_stride;
    float m = 0.f;
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
      m = fmaxf(m, fabsf(load<kIn>(p.input, base + c)));
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      float absmax = warp_max[0];
      for (int w = 1; w < kThreads / 32; ++w) absmax = fmaxf(absmax, warp_max[w]);
      const float qmax = kType == kDqInt8 ? 127.f : 448.f;
      const float scale = __fdiv_rn(absmax, qmax);
      p.scale[row] = scale;
      row_divisor = scale == 0.f ? 1.f : scale;
    }
    __syncthreads();
    const float divisor = row_divisor;
    const std::int64_t out_base = row * p.cols;
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
      const float v = __fdiv_rn(load<kIn>(p.input, base + c), divisor);
      if constexpr (kType == kDqInt8) {
        const float r = fminf(fmaxf(rintf(v), -127.f), 127.f);
        static_cast<std::int8_t*>(p.out)[out_base + c] = static_cast<std::int8_t>(r);
      } else {
        const __nv_fp8_e4m3 q(fminf(fmaxf(v, -448.f), 448.f));
        static_cast<std::uint8_t*>(p.out)[out_base + c] = q.__x;
      }
    }
    __syncthreads();  // row_divisor and warp_max are rewritten for the next row
  }
}

template <int kOut>
__global__ void __launch_bounds__(kThreads) int8_epilogue_kernel(ScaleEpilogueParams p) {
  const std::int64_t n = p.rows * p.cols;
  for (std::int64_t i = blockIdx.x * std::int64_t{kThreads} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * kThreads) {
    const std::int64_t r = i / p.cols;
    const std::int64_t c = i - r * p.cols;
    float v = __fmul_rn(__fmul_rn(__int2float_rn(p.acc[i]), p.row_scale[r]), p.col_scale[c]);
    if (p.bias != nullptr) v = __fadd_rn(v, load<kOut>(p.bias, c));
    store<kOut>(p.out, i, v);
  }
}

int grid_for(std::int64_t blocks) {
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

template <int kIn>
int launch_quantize_typed(const QuantizeRowsParams& p, cudaStream_t stream) {
  if (p.type == kDqInt8) {
    quantize_rows_kernel<kIn, kDqInt8><<<grid_for(p.rows), kThreads, 0, stream>>>(p);
  } else if (p.type == kDqFp8E4M3) {
    quantize_rows_kernel<kIn, kDqFp8E4M3><<<grid_for(p.rows), kThreads, 0, stream>>>(p);
  } else {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_quantize_rows(const QuantizeRowsParams& p, void* stream_ptr) {
  if (p.rows <= 0 || p.cols <= 0) return static_cast<int>(cudaSuccess);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (p.in_dtype) {
    case kDqBf16:
      return launch_quantize_typed<kDqBf16>(p, stream);
    case kDqFp16:
      return launch_quantize_typed<kDqFp16>(p, stream);
    case kDqFp32:
      return launch_quantize_typed<kDqFp32>(p, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int launch_int8_scale_epilogue(const ScaleEpilogueParams& p, void* stream_ptr) {
  const std::int64_t n = p.rows * p.cols;
  if (n <= 0) return static_cast<int>(cudaSuccess);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int grid = grid_for((n + kThreads - 1) / kThreads);
  switch (p.out_dtype) {
    case kDqBf16:
      int8_epilogue_kernel<kDqBf16><<<grid, kThreads, 0, stream>>>(p);
      break;
    case kDqFp16:
      int8_epilogue_kernel<kDqFp16><<<grid, kThreads, 0, stream>>>(p);
      break;
    case kDqFp32:
      int8_epilogue_kernel<kDqFp32><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace ddo::sdnq::kernels
