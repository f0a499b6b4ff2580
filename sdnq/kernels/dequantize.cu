// ddo's SDNQ dequantize kernel: packed weight + scales (+ zero points) -> [rows, cols] in the
// result dtype, one pass, memory-bound (one read of the packed bytes and the scales, one write).
//
// Note [Bit-equal dequantize]
// ---------------------------
// The result must equal the `sdnq` package's dequantize on the same device bit for bit, so each
// element goes through exactly the roundings its ATen ops make: q (exact in f32) times the f32
// scale, one f32 rounding; for unsigned types `addcmul(zero_point, q, scale)`, whose CUDA kernel
// computes `zp + q * s` and is compiled with contraction on, i.e. one fused multiply-add
// (__fmaf_rn); then one round-to-nearest-even conversion to the result dtype. The GPU test
// (sdnq/tests/gpu) compares every layout against the ATen reference on the same device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dequantize_params.h"

namespace ddo::sdnq::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per thread in the vector path

template <int kType>
__device__ __forceinline__ float load_value(const std::uint8_t* w, std::int64_t idx) {
  if constexpr (kType == kDqInt8) {
    return static_cast<float>(reinterpret_cast<const std::int8_t*>(w)[idx]);
  } else if constexpr (kType == kDqUint8) {
    return static_cast<float>(w[idx]);
  } else if constexpr (kType == kDqInt4 || kType == kDqUint4) {
    const std::uint8_t byte = w[idx >> 1];
    const int n = (idx & 1) ? (byte >> 4) : (byte & 15);
    return static_cast<float>(kType == kDqInt4 ? n - 8 : n);
  } else if constexpr (kType == kDqFp8E4M3) {
    __nv_fp8_e4m3 v;
    v.__x = w[idx];
    return static_cast<float>(v);
  } else {
    __nv_fp8_e5m2 v;
    v.__x = w[idx];
    return static_cast<float>(v);
  }
}

template <int kType>
__device__ __forceinline__ float scale_value(float q, float s, float zp) {
  if constexpr (kType == kDqUint8 || kType == kDqUint4) {
    return __fmaf_rn(q, s, zp);  // addcmul(zp, q, s) as torch's CUDA kernel rounds it
  } else {
    return __fmul_rn(q, s);
  }
}

template <int kOut>
__device__ __forceinline__ void store(void* out, std::int64_t idx, float v) {
  if constexpr (kOut == kDqBf16) {
    static_cast<__nv_bfloat16*>(out)[idx] = __float2bfloat16_rn(v);
  } else if constexpr (kOut == kDqFp16) {
    static_cast<__half*>(out)[idx] = __float2half_rn(v);
  } else {
    static_cast<float*>(out)[idx] = v;
  }
}

// Any layout, one element per iteration.
template <int kType, int kOut>
__global__ void dequantize_scalar(DequantizeParams p) {
  const auto* w = static_cast<const std::uint8_t*>(p.weight);
  const std::int64_t total = p.rows * p.cols;
  const std::int64_t groups = p.group_size > 0 ? p.cols / p.group_size : 1;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t o = e / p.cols;
    const std::int64_t i = e - o * p.cols;
    const std::int64_t src = p.transposed ? i * p.rows + o : e;
    const std::int64_t si = p.group_size > 0 ? o * groups + i / p.group_size : o;
    const float zp = p.zero_point != nullptr ? p.zero_point[si] : 0.0f;
    store<kOut>(p.out, e, scale_value<kType>(load_value<kType>(w, src), p.scale[si], zp));
  }
}

// Row-major layouts with cols and group_size multiples of 8 and aligned pointers: 8 elements
// per iteration, one scale each (a group never splits an 8-element run), wide loads and stores.
template <int kType, int kOut>
__global__ void dequantize_vec8(DequantizeParams p) {
  const auto* w = static_cast<const std::uint8_t*>(p.weight);
  const std::int64_t runs = p.rows * p.cols / kVec;
  const std::int64_t groups = p.group_size > 0 ? p.cols / p.group_size : 1;
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < runs;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = r * kVec;
    const std::int64_t o = e / p.cols;
    const std::int64_t i = e - o * p.cols;
    const std::int64_t si = p.group_size > 0 ? o * groups + i / p.group_size : o;
    const float s = p.scale[si];
    const float zp = p.zero_point != nullptr ? p.zero_point[si] : 0.0f;
    float v[kVec];
    if constexpr (kType == kDqInt4 || kType == kDqUint4) {
      const std::uint32_t word = *reinterpret_cast<const std::uint32_t*>(w + e / 2);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const int n = (word >> (4 * k)) & 15;  // byte k/2, low nibble first
        v[k] = static_cast<float>(kType == kDqInt4 ? n - 8 : n);
      }
    } else {
      const uint2 raw = *reinterpret_cast<const uint2*>(w + e);
      const auto* bytes = reinterpret_cast<const std::uint8_t*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = load_value<kType>(bytes, k);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = scale_value<kType>(v[k], s, zp);
    if constexpr (kOut == kDqBf16) {
      __align__(16) __nv_bfloat16 h[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) h[k] = __float2bfloat16_rn(v[k]);
      *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + e) =
          *reinterpret_cast<const uint4*>(h);
    } else if constexpr (kOut == kDqFp16) {
      __align__(16) __half h[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) h[k] = __float2half_rn(v[k]);
      *reinterpret_cast<uint4*>(static_cast<__half*>(p.out) + e) =
          *reinterpret_cast<const uint4*>(h);
    } else {
      auto* o32 = static_cast<float*>(p.out) + e;
      *reinterpret_cast<float4*>(o32) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(o32 + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
}

bool aligned(const void* p, std::uintptr_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

int grid_for(std::int64_t items) {
  const std::int64_t blocks = (items + kThreads - 1) / kThreads;
  // Grid-stride loops: a few waves of blocks are enough to saturate memory bandwidth.
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

template <int kType, int kOut>
int launch_typed(const DequantizeParams& p, cudaStream_t stream) {
  const bool packed = kType == kDqInt4 || kType == kDqUint4;
  const bool vec = !p.transposed && p.cols % kVec == 0 &&
                   (p.group_size == 0 || p.group_size % kVec == 0) &&
                   aligned(p.weight, packed ? 4 : 8) && aligned(p.out, 16);
  if (vec) {
    const std::int64_t runs = p.rows * p.cols / kVec;
    dequantize_vec8<kType, kOut><<<grid_for(runs), kThreads, 0, stream>>>(p);
  } else {
    dequantize_scalar<kType, kOut><<<grid_for(p.rows * p.cols), kThreads, 0, stream>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

template <int kType>
int launch_out(const DequantizeParams& p, cudaStream_t stream) {
  switch (p.out_dtype) {
    case kDqBf16:
      return launch_typed<kType, kDqBf16>(p, stream);
    case kDqFp16:
      return launch_typed<kType, kDqFp16>(p, stream);
    case kDqFp32:
      return launch_typed<kType, kDqFp32>(p, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace

int launch_sdnq_dequantize(const DequantizeParams& p, void* stream_ptr) {
  if (p.rows <= 0 || p.cols <= 0) return static_cast<int>(cudaSuccess);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (p.type) {
    case kDqInt8:
      return launch_out<kDqInt8>(p, stream);
    case kDqUint8:
      return launch_out<kDqUint8>(p, stream);
    case kDqInt4:
      return launch_out<kDqInt4>(p, stream);
    case kDqUint4:
      return launch_out<kDqUint4>(p, stream);
    case kDqFp8E4M3:
      return launch_out<kDqFp8E4M3>(p, stream);
    case kDqFp8E5M2:
      return launch_out<kDqFp8E5M2>(p, stream);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

KernelImage query_sdnq_kernel_image(int device) {
  KernelImage image;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) {
    cudaDeviceGetAttribute(&image.device_major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&image.device_minor, cudaDevAttrComputeCapabilityMinor, device);
    cudaFuncAttributes attributes{};
    // Fails with cudaErrorNoKernelImageForDevice (or cudaErrorInvalidDeviceFunction) when the
    // fatbinary has neither a cubin this device runs nor PTX the driver can compile for it.
    err = cudaFuncGetAttributes(&attributes, dequantize_vec8<kDqInt8, kDqBf16>);
    if (err == cudaSuccess) {
      image.binary_version = attributes.binaryVersion;
      image.ptx_version = attributes.ptxVersion;
    }
  }
  image.error = static_cast<int>(err);
  image.error_text = cudaGetErrorString(err);
  cudaGetLastError();  // the query's error is reported here, not left for the next launch
  if (previous >= 0) cudaSetDevice(previous);
  return image;
}

}  // namespace ddo::sdnq::kernels
