#include "ddo/sdnq/quantized_matmul.h"

#include <algorithm>
#include <array>
#include <atomic>

#include <ATen/ATen.h>
#ifdef DDO_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/quantized_matmul_params.h"
#include "kernel_dtype.h"
#endif

#include <c10/core/Storage.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/intrusive_ptr.h>

#include "ddo/core/status.h"
#include "ddo/sdnq/kernel_status.h"

// Note [Quantized matmul accuracy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Against the dequantize path on the same quantized weight, a GEMM path adds one error: the
// activations' rounding (the weight's is shared; the sums are exact for int8 and float32 for
// fp8). Per token, int8 rounds each x to a step of absmax/127, an error uniform in half a step:
// for activations whose absmax is about 4 standard deviations (Gaussian rows of a few thousand
// values) that is 4 / 127 / sqrt(12) ~ 0.009 of the row's norm, and the output's relative error
// is the same, since independent errors add in quadrature over the K products. fp8 e4m3 keeps
// 3 mantissa bits: a relative rounding error of at most 2^-4, at most 2^-4 / sqrt(3) ~ 0.036 in
// RMS. Measured on Gaussian [192 x 1024] inputs and 0.02-scaled weights (sdnq/tests): 0.0050
// (int8, with or without SVD) and 0.0150 (fp8); the tests bound them at 0.01 and 0.03, twice
// the measurement and under the analysis' values. The benchmark reports the whole
// model's relative L2 and cosine against the bf16 model.

// Note [Fast fp8 accumulation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Hopper's fp8 tensor cores sum in a narrower accumulator than float32; cuBLASLt's exact mode
// promotes the partial sums to float32 every few k-steps, which costs a fifth to a quarter of
// the GEMM's time on FLUX's and Wan's shapes (H100, bench/python/w4_profile.py's GEMM table:
// 0.58 -> 0.45 ms for 4608 x 3072 x 21504). ddo takes the fast sums by default: their error is
// small beside the activations' own rounding to fp8 (2^-4 relative per value, Note [Quantized
// matmul accuracy]), which the benchmark's per-layer and whole-model figures show side by side.
// DDO_QUANTIZED_MATMUL=exact runs the exact mode, to rule the fast sums out.

// Note [One activation quantization per input]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Linears that read one input quantize it once: attention's q, k and v projections (and FLUX's
// single blocks' MLP input beside them) read the same normalized activations, and each call
// would otherwise run the row quantizer over the same rows again. A thread keeps the last input
// it quantized, identified by what makes two reads of it equal: its storage (held weakly, so a
// freed input is never matched and its memory is never kept), data pointer, shape, strides,
// dtype, the target type, the stream, and the version counter that every write through torch
// moves. A match returns the same quantized rows and scales. Not cached: inference tensors
// (they have no version counter) and calls inside a CUDA graph capture (a replay rewrites
// memory without moving versions, and an eager entry must not be read into a graph). What the
// version counter cannot see, it cannot see here either: bytes written behind torch's back
// (a raw pointer handed to another library) between two Linears that read them.

// Note [Quantized matmul operands]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cuBLASLt's int8 and fp8 GEMMs read A row-major [M, K] and B column-major [K, N], i.e. the
// weight as stored [N, K] row-major: ddo's own quantized_matmul layout (plain storage) is read
// in place. The package's matmul layout stores the weight [K, N] row-major; at::_int_mm takes
// it as it is, while at::_scaled_mm wants it column-major, so a streamed fp8 layer of that
// layout pays one transposed copy of its (fp8) weight per call.

namespace ddo::sdnq {
namespace {

bool is_float_input(c10::ScalarType t) {
  return t == c10::kBFloat16 || t == c10::kHalf || t == c10::kFloat;
}

std::optional<at::Tensor> or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace

const char* to_string(LinearPath path) {
  switch (path) {
    case LinearPath::kInt8Gemm:
      return "int8_gemm";
    case LinearPath::kFp8Gemm:
      return "fp8_gemm";
    case LinearPath::kDequantize:
      break;
  }
  return "dequantize";
}

GemmTarget gemm_target(c10::Device device) {
  GemmTarget target;
  target.type = device.type();
#ifdef DDO_HAVE_CUDA
  if (device.is_cuda()) {
    // torch caches each device's properties: one lookup after the first.
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(
        device.has_index() ? device.index() : c10::cuda::current_device());
    target.capability = props->major * 10 + props->minor;
  }
#endif
  return target;
}

namespace {

// Note [A GEMM that fails is tried once]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The capability rules of choose_linear_path say which card has the GEMM; a torch build or a
// cuBLASLt can still lack it for a shape or a dtype, and torch raises before anything runs. The
// layer then dequantizes (the same result within the tests' bounds) and the path is marked for
// that kind of card, one flag per (path, capability), so the next layers do not raise and catch
// again: a relaxed load per call on the hot path.
constexpr int kCapabilities = 256;  // capability major * 10 + minor, clamped
std::array<std::atomic<bool>, kCapabilities> g_int8_disabled{};
std::array<std::atomic<bool>, kCapabilities> g_fp8_disabled{};
std::atomic<int> g_int8_failures_for_testing{0};
std::atomic<int> g_fp8_failures_for_testing{0};

std::atomic<bool>& disabled_flag(LinearPath path, const GemmTarget& target) {
  const int index = target.type == c10::DeviceType::CUDA
                        ? std::clamp(target.capability, 1, kCapabilities - 1)
                        : 0;  // the CPU and the simulation
  return path == LinearPath::kInt8Gemm ? g_int8_disabled[index] : g_fp8_disabled[index];
}

// Raises as an unsupported GEMM would, while a test asked for it.
void maybe_fail_for_testing(LinearPath path) {
  std::atomic<int>& left =
      path == LinearPath::kInt8Gemm ? g_int8_failures_for_testing : g_fp8_failures_for_testing;
  int n = left.load(std::memory_order_relaxed);
  while (n > 0 && !left.compare_exchange_weak(n, n - 1)) {
  }
  TORCH_CHECK(n <= 0, "injected GEMM failure (fail_gemm_calls_for_testing)");
}

}  // namespace

void disable_gemm_path(LinearPath path, const GemmTarget& target) {
  if (path == LinearPath::kDequantize) return;
  disabled_flag(path, target).store(true, std::memory_order_relaxed);
}

bool gemm_path_disabled(LinearPath path, const GemmTarget& target) {
  if (path == LinearPath::kDequantize) return false;
  return disabled_flag(path, target).load(std::memory_order_relaxed);
}

void fail_gemm_calls_for_testing(LinearPath path, int count) {
  (path == LinearPath::kInt8Gemm ? g_int8_failures_for_testing : g_fp8_failures_for_testing)
      .store(count);
}

void reset_gemm_paths_for_testing() {
  for (auto* flags : {&g_int8_disabled, &g_fp8_disabled}) {
    for (std::atomic<bool>& flag : *flags) flag.store(false);
  }
}

namespace {

LinearPathChoice choose_capable_path(const Layout& layout, c10::ScalarType scale_dtype,
                                     c10::ScalarType input_dtype, std::int64_t rows,
                                     const GemmTarget& target) {
  using P = LinearPath;
  if (!layout.quantized_matmul || !is_matmul_type(layout.type) || layout.group_size != 0) {
    return {P::kDequantize, "the layout dequantizes (not a per-row quantized_matmul layer)"};
  }
  if (quantized_matmul_mode() == core::QuantizedMatmulMode::kOff) {
    return {P::kDequantize, "DDO_QUANTIZED_MATMUL=off"};
  }
  if (scale_dtype != c10::kFloat) {
    return {P::kDequantize, "the scales are not float32"};
  }
  if (!is_float_input(input_dtype)) {
    return {P::kDequantize, "the input is not bfloat16, float16 or float32"};
  }
  if (layout.in % 16 != 0 || layout.out % 16 != 0) {
    return {P::kDequantize, "a dimension is not a multiple of 16 (the GEMMs' alignment)"};
  }
  if (rows < kMinGemmRows) {
    return {P::kDequantize, "fewer than 32 rows: dequantizing costs less"};
  }
  const bool int8 = layout.type == QuantType::kInt8;
  if (target.type == c10::DeviceType::CUDA) {
    if (int8) {
      if (target.capability < 80) return {P::kDequantize, "int8 GEMM needs sm_80 or newer"};
      return {P::kInt8Gemm, "int8 GEMM (sm_80+)"};
    }
    if (target.capability < 89) return {P::kDequantize, "fp8 GEMM needs sm_89 or newer"};
    if (layout.result_dtype != c10::kBFloat16) {
      return {P::kDequantize, "the row-wise fp8 GEMM writes bfloat16 only"};
    }
    return {P::kFp8Gemm, "fp8 e4m3 GEMM (sm_89+)"};
  }
  if (target.type == c10::DeviceType::CPU) {
    if (int8) return {P::kInt8Gemm, "int8 GEMM (CPU: at::_int_mm)"};
    return {P::kFp8Gemm, "fp8 GEMM (CPU: its float32 reference)"};
  }
  return {P::kDequantize, "no quantized GEMM on this device type"};
}

}  // namespace

LinearPathChoice choose_linear_path(const Layout& layout, c10::ScalarType scale_dtype,
                                    c10::ScalarType input_dtype, std::int64_t rows,
                                    const GemmTarget& target) {
  const LinearPathChoice choice =
      choose_capable_path(layout, scale_dtype, input_dtype, rows, target);
  if (gemm_path_disabled(choice.path, target)) {
    return {LinearPath::kDequantize,
            choice.path == LinearPath::kInt8Gemm
                ? "the int8 GEMM failed on this device once (see the warning); dequantizing"
                : "the fp8 GEMM failed on this device once (see the warning); dequantizing"};
  }
  return choice;
}

LinearPathChoice choose_linear_path(const Layout& layout, const QuantizedWeight& w,
                                    const at::Tensor& input) {
  const std::int64_t rows =
      input.dim() == 0 ? 1 : input.numel() / std::max<std::int64_t>(input.size(-1), 1);
  return choose_linear_path(layout, w.scale.scalar_type(), input.scalar_type(), rows,
                            gemm_target(w.weight.device()));
}

std::pair<at::Tensor, at::Tensor> quantize_rows_reference(const at::Tensor& x, QuantType type) {
  DDO_CHECK(x.dim() == 2 && is_matmul_type(type), Code::kInvalidArgument,
            "quantize_rows: a 2-D input and type int8 or float8_e4m3fn, got ", x.dim(), "-D and ",
            to_string(type));
  const double qmax = type == QuantType::kInt8 ? 127.0 : 448.0;
  const at::Tensor xf = x.to(at::kFloat);
  // qmax as a tensor on x's device, not a scalar: ATen's CUDA division by a host scalar
  // multiplies by its rounded reciprocal, which differs from one correctly rounded division
  // in the last bit for some values (Note [Bit-equal quantized matmul steps]).
  const at::Tensor scale =
      at::div(at::amax(at::abs(xf), {1}), at::scalar_tensor(qmax, xf.options()));
  const at::Tensor divisor = at::where(scale == 0, at::ones_like(scale), scale);
  const at::Tensor v = at::div(xf, divisor.unsqueeze(1));
  at::Tensor q = type == QuantType::kInt8 ? at::round(v).clamp(-qmax, qmax).to(at::kChar)
                                          : v.clamp(-qmax, qmax).to(c10::ScalarType::Float8_e4m3fn);
  return {q, scale};
}

std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, QuantType type) {
#ifdef DDO_HAVE_CUDA
  if (x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 && is_float_input(x.scalar_type()) &&
      is_matmul_type(type) && use_dequantize_kernel(x.device().index())) {
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor q = at::empty(x.sizes(), x.options().dtype(storage_dtype(type)));
    at::Tensor scale = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
    kernels::QuantizeRowsParams p;
    p.input = x.data_ptr();
    p.out = q.data_ptr();
    p.scale = scale.data_ptr<float>();
    p.rows = x.size(0);
    p.cols = x.size(1);
    p.row_stride = x.stride(0);
    p.in_dtype = internal::kernel_float_code(x.scalar_type());
    p.type = static_cast<int>(type);
    const int err =
        kernels::launch_quantize_rows(p, c10::cuda::getCurrentCUDAStream(x.device().index()));
    DDO_CHECK(err == 0, Code::kInternal, "ddo quantize_rows kernel failed to launch (CUDA error ",
              err, ")");
    return {q, scale};
  }
#endif
  return quantize_rows_reference(x, type);
}

namespace {

struct ActivationEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  const void* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  QuantType type = QuantType::kInt8;
  c10::Stream stream = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
  std::uint32_t version = 0;
  at::Tensor q;
  at::Tensor scale;
};

thread_local ActivationEntry t_last_activation;
std::atomic<std::int64_t> g_activation_reuses{0};

bool cacheable_activation(const at::Tensor& x) {
  if (x.is_inference() || !x.has_storage()) return false;
#ifdef DDO_HAVE_CUDA
  if (x.is_cuda() &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return false;
  }
#endif
  return true;
}

c10::Stream current_stream_of(const at::Tensor& x) {
  return c10::impl::getDeviceGuardImpl(x.device().type())->getStream(x.device());
}

}  // namespace

std::pair<at::Tensor, at::Tensor> quantize_activation_rows(const at::Tensor& x, QuantType type) {
  if (x.dim() != 2 || !cacheable_activation(x)) return quantize_rows(x, type);
  ActivationEntry& e = t_last_activation;
  const c10::Stream stream = current_stream_of(x);
  const std::uint32_t version = x.unsafeGetTensorImpl()->version_counter().current_version();
  const c10::intrusive_ptr<c10::StorageImpl> held = e.storage.lock();
  if (held.get() == x.storage().unsafeGetStorageImpl() && e.data == x.data_ptr() &&
      e.rows == x.size(0) && e.cols == x.size(1) && e.row_stride == x.stride(0) &&
      x.stride(1) == 1 && e.dtype == x.scalar_type() && e.type == type && e.stream == stream &&
      e.version == version) {
    g_activation_reuses.fetch_add(1, std::memory_order_relaxed);
    return {e.q, e.scale};
  }
  auto [q, scale] = quantize_rows(x, type);
  if (x.stride(1) == 1) {
    e.storage = x.storage().getWeakStorageImpl();
    e.data = x.data_ptr();
    e.rows = x.size(0);
    e.cols = x.size(1);
    e.row_stride = x.stride(0);
    e.dtype = x.scalar_type();
    e.type = type;
    e.stream = stream;
    e.version = version;
    e.q = q;
    e.scale = scale;
  }
  return {q, scale};
}

std::int64_t activation_quantization_reuses() {
  return g_activation_reuses.load(std::memory_order_relaxed);
}

void forget_activation_quantization() {
  t_last_activation = ActivationEntry();
}

at::Tensor int8_scale_epilogue_reference(const at::Tensor& acc, const at::Tensor& row_scale,
                                         const at::Tensor& col_scale, const at::Tensor& bias,
                                         c10::ScalarType out_dtype) {
  at::Tensor v = acc.to(at::kFloat).mul(row_scale.reshape({-1, 1})).mul(col_scale.reshape({1, -1}));
  if (bias.defined()) v = v.add(bias.to(at::kFloat).reshape({1, -1}));
  return v.to(out_dtype);
}

at::Tensor int8_scale_epilogue(const at::Tensor& acc, const at::Tensor& row_scale,
                               const at::Tensor& col_scale, const at::Tensor& bias,
                               c10::ScalarType out_dtype) {
#ifdef DDO_HAVE_CUDA
  if (acc.is_cuda() && acc.is_contiguous() && row_scale.is_contiguous() &&
      col_scale.is_contiguous() && row_scale.scalar_type() == at::kFloat &&
      col_scale.scalar_type() == at::kFloat &&
      (!bias.defined() || (bias.is_contiguous() && bias.scalar_type() == out_dtype)) &&
      is_float_input(out_dtype) && use_dequantize_kernel(acc.device().index())) {
    c10::cuda::CUDAGuard guard(acc.device());
    at::Tensor out = at::empty(acc.sizes(), acc.options().dtype(out_dtype));
    kernels::ScaleEpilogueParams p;
    p.acc = acc.data_ptr<std::int32_t>();
    p.row_scale = row_scale.data_ptr<float>();
    p.col_scale = col_scale.data_ptr<float>();
    p.bias = bias.defined() ? bias.data_ptr() : nullptr;
    p.out = out.data_ptr();
    p.rows = acc.size(0);
    p.cols = acc.size(1);
    p.out_dtype = internal::kernel_float_code(out_dtype);
    const int err = kernels::launch_int8_scale_epilogue(
        p, c10::cuda::getCurrentCUDAStream(acc.device().index()));
    DDO_CHECK(err == 0, Code::kInternal, "ddo int8 epilogue kernel failed to launch (CUDA error ",
              err, ")");
    return out;
  }
#endif
  return int8_scale_epilogue_reference(acc, row_scale, col_scale, bias, out_dtype);
}

at::Tensor quantized_linear(const at::Tensor& input, const QuantizedWeight& w,
                            const at::Tensor& bias, const Layout& layout, LinearPath path) {
  DDO_CHECK(path == LinearPath::kInt8Gemm || path == LinearPath::kFp8Gemm, Code::kInvalidArgument,
            "quantized_linear runs a GEMM path, got ", to_string(path));
  layout.check(w);
  const c10::ScalarType out_dtype = layout.result_dtype;
  const at::Tensor x = input.reshape({-1, layout.in});
  auto [xq, xs] =
      quantize_activation_rows(x, layout.type);  // Note [One activation quantization per input]
  // The weight as [K, N]: a column-major view of the plain [N, K] storage, or the matmul
  // layout's [K, N] rows (Note [Quantized matmul operands]).
  const at::Tensor wt = layout.transposed ? w.weight : w.weight.t();
  const at::Tensor ws = w.scale.reshape({-1});
  const at::Tensor b = bias.defined() ? bias.to(out_dtype) : at::Tensor();
  at::Tensor out;
  maybe_fail_for_testing(path);
  if (path == LinearPath::kInt8Gemm) {
    out = int8_scale_epilogue(at::_int_mm(xq, wt), xs, ws, b, out_dtype);
  } else if (x.is_cuda()) {
    const at::Tensor b_col_major = layout.transposed ? wt.t().contiguous().t() : wt;
    // Note [Fast fp8 accumulation].
    const bool fast = quantized_matmul_mode() != core::QuantizedMatmulMode::kExact;
    out = at::_scaled_mm(xq, b_col_major, xs.reshape({-1, 1}), ws.reshape({1, -1}), or_none(b),
                         std::nullopt, out_dtype, /*use_fast_accum=*/fast);
  } else {
    // The fp8 GEMM's reference: fp8 values are exact in float32, so are their products; the
    // sums are float32, as the tensor cores accumulate them.
    const at::Tensor acc = at::mm(xq.to(at::kFloat), wt.to(at::kFloat));
    at::Tensor v = acc.mul(xs.reshape({-1, 1})).mul(ws.reshape({1, -1}));
    if (b.defined()) v = v.add(b.to(at::kFloat).reshape({1, -1}));
    out = v.to(out_dtype);
  }
  if (w.svd_up.defined()) {
    out.add_(at::mm(at::mm(x.to(out_dtype), w.svd_down.t()), w.svd_up.t()));
  }
  c10::DimVector shape(input.sizes());
  shape.back() = layout.out;
  return out.view(shape);
}

}  // namespace ddo::sdnq
