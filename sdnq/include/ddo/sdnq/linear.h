/// \file
/// SdnqLinear: ddo's SDNQ-quantized Linear for LibTorch models.
///
/// It holds the `sdnq` package's tensors under the package's names (weight, scale, zero_point,
/// svd_up, svd_down, bias) as parameters without gradients, and its forward calls the
/// ddo::sdnq_linear op, so enable_offload streams its packed tensors as one unit and serves the
/// op with the weights staged on the device (ddo/sdnq/ops.h).
///
/// ```
/// torch::nn::Linear dense(3072, 3072);
/// ddo::sdnq::QuantizeOptions opt;
/// opt.type = ddo::sdnq::QuantType::kUint4;
/// ddo::sdnq::SdnqLinear q(*dense, opt);                 // quantize a dense layer
/// at::Tensor y = q(x);                                   // linear(x, dequantized weight)
/// q->layout().type;                                      // QuantType::kUint4
/// ```
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "ddo/sdnq/layout.h"
#include "ddo/sdnq/quantize.h"

namespace ddo::sdnq {

/// A Linear layer whose weight is SDNQ-quantized: its forward is the ddo::sdnq_linear op
/// (dequantize, then the GEMM), which an active offload streams like any weight.
class SdnqLinearImpl : public torch::nn::Cloneable<SdnqLinearImpl> {
 public:
  /// From tensors already in the layout (e.g. a checkpoint written by the `sdnq` package).
  SdnqLinearImpl(const Layout& layout, const QuantizedWeight& weights, const at::Tensor& bias);
  /// Quantizes a dense Linear.
  SdnqLinearImpl(const torch::nn::LinearImpl& dense, const QuantizeOptions& options);

  /// Input [..., in] -> [..., out], through the dispatcher.
  at::Tensor forward(const at::Tensor& input);
  /// The dequantized [out, in] weight (through the dispatcher, so streamed weights work too).
  at::Tensor dequantized_weight();

  /// Re-registers the tensors (Cloneable's contract); the values are kept.
  void reset() override;

  /// The layout of the layer's tensors.
  const Layout& layout() const { return layout_; }
  QuantizedWeight weights() const;  ///< the layer's registered tensors (not copies)

 private:
  void register_all(const QuantizedWeight& w, const at::Tensor& bias);

  Layout layout_;
  std::vector<std::int64_t> code_;
  at::Tensor weight_, scale_, zero_point_, svd_up_, svd_down_, bias_;
};

/// The module holder (shared_ptr) of SdnqLinearImpl, as torch::nn names its modules.
TORCH_MODULE(SdnqLinear);

}  // namespace ddo::sdnq
