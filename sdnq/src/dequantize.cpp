#include "ddo/sdnq/dequantize.h"

#include <ATen/ATen.h>
#ifdef DDO_HAVE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../kernels/dequantize_params.h"
#include "kernel_dtype.h"
#endif

#include "ddo/core/status.h"
#include "ddo/sdnq/kernel_status.h"
#include "ddo/sdnq/quantized_matmul.h"

namespace ddo::sdnq {
namespace {

// The stored weight as integers (or fp8) in quantized_shape(); 4-bit bytes unpacked low nibble
// first, int4 still offset by 8 (subtracted in the compute dtype, where it is exact).
at::Tensor unpacked(const at::Tensor& weight, const Layout& layout) {
  if (!is_packed(layout.type)) return weight.reshape(layout.quantized_shape());
  const at::Tensor bytes = weight.reshape({-1});
  const at::Tensor lo = at::bitwise_and(bytes, 15);
  const at::Tensor hi = at::bitwise_right_shift(bytes, 4);
  return at::stack({lo, hi}, -1).reshape(layout.quantized_shape());
}

}  // namespace

at::Tensor dequantize_reference(const QuantizedWeight& w, const Layout& layout) {
  layout.check(w);
  const c10::ScalarType compute = w.scale.scalar_type();
  at::Tensor q = unpacked(w.weight, layout).to(compute);
  if (layout.type == QuantType::kInt4) q = q - 8;
  at::Tensor r = is_unsigned(layout.type) ? at::addcmul(w.zero_point, q, w.scale) : q * w.scale;
  if (layout.transposed) r = r.t();
  r = r.reshape({layout.out, layout.in}).to(layout.result_dtype);
  if (w.svd_up.defined()) r = at::addmm(r, w.svd_up, w.svd_down);
  return r.contiguous();
}

bool kernel_supports(const QuantizedWeight& w, const Layout& layout) {
#ifdef DDO_HAVE_CUDA
  if (!w.weight.is_cuda() || !w.weight.is_contiguous()) return false;
  if (w.scale.scalar_type() != c10::kFloat || !w.scale.is_contiguous()) return false;
  if (w.zero_point.defined() && !w.zero_point.is_contiguous()) return false;
  if (w.scale.device() != w.weight.device()) return false;
  // The library may hold no code for this device (Note [Kernel images]): the reference runs.
  return use_dequantize_kernel(w.weight.device().index());
#else
  (void)w;
  (void)layout;
  return false;
#endif
}

at::Tensor dequantize(const QuantizedWeight& w, const Layout& layout) {
#ifdef DDO_HAVE_CUDA
  if (kernel_supports(w, layout)) {
    layout.check(w);
    c10::cuda::CUDAGuard guard(w.weight.device());
    at::Tensor out =
        at::empty({layout.out, layout.in}, w.weight.options().dtype(layout.result_dtype));
    kernels::DequantizeParams p;
    p.weight = w.weight.data_ptr();
    p.scale = w.scale.data_ptr<float>();
    p.zero_point = w.zero_point.defined() ? w.zero_point.data_ptr<float>() : nullptr;
    p.out = out.data_ptr();
    p.rows = layout.out;
    p.cols = layout.in;
    p.group_size = layout.group_size;
    p.type = static_cast<int>(layout.type);
    p.out_dtype = internal::kernel_float_code(layout.result_dtype);
    p.transposed = layout.transposed;
    const int err = kernels::launch_sdnq_dequantize(
        p, c10::cuda::getCurrentCUDAStream(w.weight.device().index()).stream());
    DDO_CHECK(err == 0, Code::kInternal, "SDNQ dequantize kernel failed to launch (CUDA error ",
              err, ")");
    if (w.svd_up.defined()) out = at::addmm(out, w.svd_up, w.svd_down);
    return out;
  }
#endif
  return dequantize_reference(w, layout);
}

at::Tensor linear(const at::Tensor& input, const QuantizedWeight& w, const at::Tensor& bias,
                  const Layout& layout) {
  if (layout.quantized_matmul) {
    const LinearPathChoice choice = choose_linear_path(layout, w, input);
    if (choice.path != LinearPath::kDequantize) {
      layout.check(w);  // ddo's own checks raise as themselves, outside the fallback below
      try {
        return quantized_linear(input, w, bias, layout, choice.path);
      } catch (const c10::Error& e) {
        // Note [A GEMM that fails is tried once] in quantized_matmul.cpp.
        disable_gemm_path(choice.path, gemm_target(w.weight.device()));
        TORCH_WARN("ddo: the ", to_string(choice.path), " of a quantized layer failed on ",
                   w.weight.device().str(), " (", e.what_without_backtrace(),
                   "); quantized layers there dequantize from now on");
      }
    }
  }
  const at::Tensor weight = dequantize(w, layout);
  return at::linear(input, weight,
                    bias.defined() ? std::optional<at::Tensor>(bias) : std::optional<at::Tensor>());
}

}  // namespace ddo::sdnq
