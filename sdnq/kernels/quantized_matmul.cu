// ddo's quantized-matmul kernels: the per-token activation quantizer and the int8 epilogue.
//
// Note [Bit-equal quantized matmul steps]
// ---------------------------------------
// Both kernels reproduce their ATen references (sdnq/src/quantized_matmul.cpp) bit for bit, so
// the GPU test can compare them exactly and the reference can stand in on a device without a
// kernel image. Each element goes through the references' roundings and no others:
//  - quantize_rows: the row's absmax in float32 (a max is exact in any order); scale = absmax /
//    qmax, one correctly rounded division; v = x / (scale, or 1 where it is 0), another, per
//    element (as the sdnq package divides its activations, so the two quantize a row alike);
//    int8: round half to even (rintf), clamp to [-127, 127]; fp8 e4m3: clamp to ±448, then the
//    round-to-nearest-even conversion. No multiplication by a reciprocal, no contraction.
//  - int8 epilogue: float(acc) (round to nearest even), times the row scale, times the column
//    scale, plus float(bias), each an IEEE float32 operation in that order (__fmul_rn and
//    __fadd_rn keep nvcc from fusing them), then one conversion to the result dtype.
//
// Note [Quantizing a row in one read]
// -----------------------------------
// The quantizer is bound by memory: it reads a row of 2 or 4 bytes per value and writes 1. One
// block per row reads the row once, 16 bytes per thread per load, into registers (up to
// kMaxVecs vectors a thread: rows of up to 16384 bf16 values, FLUX's and Wan's widest inputs
// included), reduces the absmax, and writes the quantized values from the registers, 8 (or 4)
// bytes per thread per store. Rows that are wider, unaligned or of a width that is not a
// multiple of the vector take the scalar kernel, which reads the row twice.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// Value j of a 16-byte vector of kIn values, from its bits (no trip through memory, so the
// vector stays in registers).
template <int kIn>
__device__ __forceinline__ float unpack(const uint4& v, int j) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
  if constexpr (kIn == kDqFp32) {
    return __uint_as_float(words[j]);
  } else {
    const unsigned bits = (words[j / 2] >> (16 * (j % 2))) & 0xffffu;
    if constexpr (kIn == kDqBf16) {
      return __uint_as_float(bits << 16);  // a bfloat16 is the top half of a float32
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }
}

// One quantized value's byte: int8 rounds half to even and clamps to ±127; fp8 e4m3 clamps to
// ±448, then converts (round to nearest even).
template <int kType>
__device__ __forceinline__ std::uint8_t quantize_value(float v) {
  if constexpr (kType == kDqInt8) {
    return static_cast<std::uint8_t>(
        static_cast<std::int8_t>(fminf(fmaxf(rintf(v), -127.f), 127.f)));
  } else {
    return __nv_fp8_e4m3(fminf(fmaxf(v, -448.f), 448.f)).__x;
  }
}

// The row's scale from each thread's partial absmax `m`: a block-wide max, scale = absmax / qmax
// written to `scale`, and the divisor (the scale, or 1 for a row of zeros) returned to every
// thread. `warp_max` and `divisor` are the block's shared slots; the caller syncs before it
// reuses them for the next row.
template <int kType>
__device__ __forceinline__ float row_divisor_of(float m, float* warp_max, float* divisor,
                                                float* scale) {
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float absmax = warp_max[0];
    for (int w = 1; w < kThreads / 32; ++w) absmax = fmaxf(absmax, warp_max[w]);
    const float s = __fdiv_rn(absmax, kType == kDqInt8 ? 127.f : 448.f);
    *scale = s;
    *divisor = s == 0.f ? 1.f : s;
  }
  __syncthreads();
  return *divisor;
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
    const float divisor = row_divisor_of<kType>(m, warp_max, &row_divisor, &p.scale[row]);
    const std::int64_t out_base = row * p.cols;
    for (std::int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
      static_cast<std::uint8_t*>(p.out)[out_base + c] =
          quantize_value<kType>(__fdiv_rn(load<kIn>(p.input, base + c), divisor));
    }
    __syncthreads();  // row_divisor and warp_max are rewritten for the next row
  }
}

// Note [Quantizing a row in one read]. kVecs vectors of 16 bytes per thread; the launcher checks
// the row's width (a multiple of the vector, at most kThreads * kVecs vectors) and alignment.
template <int kIn, int kType, int kVecs>
__global__ void __launch_bounds__(kThreads) quantize_rows_vec_kernel(QuantizeRowsParams p) {
  constexpr int kPer = kIn == kDqFp32 ? 4 : 8;  // values in 16 bytes
  using Out = std::conditional_t<kPer == 8, uint2, std::uint32_t>;
  __shared__ float warp_max[kThreads / 32];
  __shared__ float row_divisor;
  const std::int64_t vecs = p.cols / kPer;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(
        static_cast<const char*>(p.input) + row * p.row_stride * (kIn == kDqFp32 ? 4 : 2));
    uint4 regs[kVecs];
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const std::int64_t v = threadIdx.x + std::int64_t{i} * kThreads;
      if (v < vecs) {
        regs[i] = src[v];
#pragma unroll
        for (int j = 0; j < kPer; ++j) m = fmaxf(m, fabsf(unpack<kIn>(regs[i], j)));
      }
    }
    const float divisor = row_divisor_of<kType>(m, warp_max, &row_divisor, &p.scale[row]);
    Out* dst = reinterpret_cast<Out*>(static_cast<std::uint8_t*>(p.out) + row * p.cols);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const std::int64_t v = threadIdx.x + std::int64_t{i} * kThreads;
      if (v < vecs) {
        unsigned words[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const unsigned byte = quantize_value<kType>(__fdiv_rn(unpack<kIn>(regs[i], j), divisor));
          words[j / 4] |= byte << (8 * (j % 4));
        }
        if constexpr (kPer == 8) {
          dst[v] = make_uint2(words[0], words[1]);
        } else {
          dst[v] = words[0];
        }
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

constexpr int kMaxVecs = 8;

template <int kIn, int kType>
void launch_vec(const QuantizeRowsParams& p, std::int64_t vecs_per_thread, cudaStream_t stream) {
  const int grid = grid_for(p.rows);
  if (vecs_per_thread <= 1) {
    quantize_rows_vec_kernel<kIn, kType, 1><<<grid, kThreads, 0, stream>>>(p);
  } else if (vecs_per_thread <= 2) {
    quantize_rows_vec_kernel<kIn, kType, 2><<<grid, kThreads, 0, stream>>>(p);
  } else if (vecs_per_thread <= 4) {
    quantize_rows_vec_kernel<kIn, kType, 4><<<grid, kThreads, 0, stream>>>(p);
  } else {
    quantize_rows_vec_kernel<kIn, kType, kMaxVecs><<<grid, kThreads, 0, stream>>>(p);
  }
}

template <int kIn, int kType>
void launch_typed(const QuantizeRowsParams& p, cudaStream_t stream) {
  const int per = kIn == kDqFp32 ? 4 : 8;
  const std::int64_t vecs_per_thread = (p.cols / per + kThreads - 1) / kThreads;
  const bool aligned = reinterpret_cast<std::uintptr_t>(p.input) % 16 == 0 &&
                       p.row_stride % per == 0 && p.cols % per == 0;
  if (aligned && vecs_per_thread <= kMaxVecs) {
    launch_vec<kIn, kType>(p, vecs_per_thread, stream);
  } else {
    quantize_rows_kernel<kIn, kType><<<grid_for(p.rows), kThreads, 0, stream>>>(p);
  }
}

template <int kIn>
int launch_quantize_typed(const QuantizeRowsParams& p, cudaStream_t stream) {
  if (p.type == kDqInt8) {
    launch_typed<kIn, kDqInt8>(p, stream);
  } else if (p.type == kDqFp8E4M3) {
    launch_typed<kIn, kDqFp8E4M3>(p, stream);
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
