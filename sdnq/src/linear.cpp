#include "ddo/sdnq/linear.h"

#include "ddo/sdnq/ops.h"

namespace ddo::sdnq {

SdnqLinearImpl::SdnqLinearImpl(const Layout& layout, const QuantizedWeight& weights,
                               const at::Tensor& bias)
    : layout_(layout), code_(layout.encode()) {
  layout_.check(weights);
  register_all(weights, bias);
}

SdnqLinearImpl::SdnqLinearImpl(const torch::nn::LinearImpl& dense, const QuantizeOptions& options) {
  at::NoGradGuard no_grad;
  auto [weights, layout] = quantize(dense.weight.detach(), options);
  layout_ = layout;
  code_ = layout_.encode();
  register_all(weights, dense.bias.defined() ? dense.bias.detach().clone() : at::Tensor());
}

void SdnqLinearImpl::register_all(const QuantizedWeight& w, const at::Tensor& bias) {
  // Names as the `sdnq` package spells them: the inventory gives each its role by name.
  weight_ = register_parameter("weight", w.weight, /*requires_grad=*/false);
  scale_ = register_parameter("scale", w.scale, false);
  if (w.zero_point.defined()) zero_point_ = register_parameter("zero_point", w.zero_point, false);
  if (w.svd_up.defined()) {
    svd_up_ = register_parameter("svd_up", w.svd_up, false);
    svd_down_ = register_parameter("svd_down", w.svd_down, false);
  }
  if (bias.defined()) bias_ = register_parameter("bias", bias, false);
}

void SdnqLinearImpl::reset() {
  const QuantizedWeight w = weights();
  const at::Tensor bias = bias_;
  register_all(w, bias);
}

QuantizedWeight SdnqLinearImpl::weights() const {
  return {weight_, scale_, zero_point_, svd_up_, svd_down_};
}

at::Tensor SdnqLinearImpl::forward(const at::Tensor& input) {
  return call_linear(input, weights(), bias_, code_);
}

at::Tensor SdnqLinearImpl::dequantized_weight() {
  return call_dequantize(weights(), code_);
}

}  // namespace ddo::sdnq
