// Parameters of ddo's SDNQ dequantize kernel (no torch, no CUDA headers: the kernel is built by
// nvcc alone and called through this plain struct, like FlashAttention's Flash_fwd_params).
//
//   DequantizeParams p;
//   p.weight = packed.data_ptr(); p.scale = scale.data_ptr<float>(); ...
//   p.type = kDqUint4; p.out_dtype = kDqBf16; p.rows = out; p.cols = in; p.group_size = 64;
//   launch_sdnq_dequantize(p, stream);       // returns a cudaError_t as int
#pragma once

#include <cstdint>

namespace ddo::sdnq::kernels {

// Mirrors QuantType (layout.h) without including it.
enum DqType : int {
  kDqInt8 = 0,
  kDqUint8 = 1,
  kDqInt4 = 2,
  kDqUint4 = 3,
  kDqFp8E4M3 = 4,
  kDqFp8E5M2 = 5,
};

enum DqOutDtype : int {
  kDqBf16 = 0,
  kDqFp16 = 1,
  kDqFp32 = 2,
};

struct DequantizeParams {
  const void* weight = nullptr;       // stored weight: bytes / int8 / fp8, contiguous
  const float* scale = nullptr;       // [rows, groups] or [rows] (transposed: [rows] too)
  const float* zero_point = nullptr;  // like scale; unsigned types only
  void* out = nullptr;                // [rows, cols] contiguous, out_dtype
  std::int64_t rows = 0;              // out features
  std::int64_t cols = 0;              // in features
  std::int64_t group_size = 0;        // 0: one scale per row
  int type = kDqInt8;
  int out_dtype = kDqBf16;
  bool transposed = false;  // weight stored [cols, rows]
};

// Enqueues the kernel on `stream` (a cudaStream_t). Returns cudaSuccess (0) or the launch error.
int launch_sdnq_dequantize(const DequantizeParams& params, void* stream);

// What the CUDA runtime finds in this library for one device (Note [Kernel images] in
// sdnq/src/kernel_status.cpp). Every kernel of this file lives in one module, and the other kernel
// files (quantized_matmul.cu) are built for the same architecture list, so one function's
// attributes speak for all of them.
struct KernelImage {
  int error = 0;  // cudaSuccess, or why no kernel can run (cudaErrorNoKernelImageForDevice)
  const char* error_text = "";  // cudaGetErrorString(error): a static string
  int binary_version = 0;  // the architecture of the code that runs (86: sm_86), when error == 0
  int ptx_version = 0;     // the PTX the image was compiled from, when error == 0
  int device_major = 0;    // the device's compute capability
  int device_minor = 0;
};

// Queries device `device` (its context is created if needed; the current device is restored).
KernelImage query_sdnq_kernel_image(int device);

}  // namespace ddo::sdnq::kernels
