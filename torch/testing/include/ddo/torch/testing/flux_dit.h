/// \file
/// FluxDiT: the W1 workload, a FLUX.1-style MMDiT written with stock LibTorch layers.
///
/// The benchmark model of docs/design/0009-benchmarks.md (W1 `flux-dit`): double-stream blocks
/// (image and text streams with their own weights, joint attention over both) followed by
/// single-stream blocks over the concatenated sequence, adaLN-Zero modulation from a timestep
/// embedding. Every weight-bearing layer is a stock `torch::nn::Linear`, so ddo intercepts it
/// without changes to the model. Module names follow diffusers' FluxTransformer2DModel
/// (`x_embedder`, `context_embedder`, `time_embed`, `transformer_blocks.N`,
/// `single_transformer_blocks.N`, `norm_out`, `proj_out`; inside blocks `norm1.linear`,
/// `attn.to_q`, `attn.to_out.0`, `ff.net.0.proj`, `ff.net.2`, `proj_mlp`, `proj_out`, ...) so that
/// the auto block pattern and the default always-resident pattern see what they see on the real
/// model.
///
/// Weights are random from a fixed seed, scaled so that activations stay finite at full depth in
/// bf16. Presets: "tiny" (tests, 0.44 M parameters, fp32), "small" (CI and demos, 71 M, fp32),
/// "full" (FLUX.1 dimensions, 11.88 B parameters, 23.8 GB in bf16).
///
/// ```
/// using namespace ddo::adapter::testing;
/// FluxDiTOptions opts = FluxDiTOptions::preset("tiny");
/// FluxDiT model(opts);                                    // on the CPU, opts.dtype
/// FluxDiTInputs in = make_inputs(opts, torch::kCPU, /*batch=*/1);
/// torch::Tensor out = model->forward(in.img, in.txt, in.timestep);
/// // out.sizes() == {1, opts.img_tokens, opts.in_channels}
/// FluxDiTImpl::parameter_count(FluxDiTOptions::preset("full"));   // ~1.19e10, nothing allocated
/// ```
#pragma once

#include <cstdint>
#include <string_view>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace ddo::adapter::testing {

/// Dimensions of the FLUX-style test model; the defaults are FLUX.1's (23.8 GB in bf16).
struct FluxDiTOptions {
  int double_blocks = 19;  ///< double-stream (image and text) blocks
  int single_blocks = 38;  ///< single-stream blocks over the joined tokens
  int hidden = 3072;       ///< heads * head_dim
  int heads = 24;          ///< attention heads
  int mlp_ratio = 4;       ///< MLP width = hidden * mlp_ratio
  int in_channels = 64;    ///< packed latent channels (2x2 patches of 16); also the output width
  int text_dim = 4096;     ///< T5-XXL hidden size
  int img_tokens = 4096;   ///< 1024x1024 image: 64x64 patches
  int txt_tokens = 512;    ///< text tokens per sample
  int timestep_dim = 256;  ///< sinusoidal embedding width
  std::uint64_t seed = 0;  ///< every weight is drawn from it
  c10::ScalarType dtype = c10::ScalarType::BFloat16;  ///< of weights and activations

  /// "tiny", "small", "full"; throws ddo::Error(kInvalidArgument) naming the valid names.
  static FluxDiTOptions preset(std::string_view name);
  /// Width of one attention head.
  int head_dim() const { return hidden / heads; }
  /// Width of the MLP's hidden layer.
  int mlp_hidden() const { return hidden * mlp_ratio; }
};

/// The model. Construction draws every weight from `options.seed` on `init_device` (a CUDA device
/// draws a 23.8 GB model in seconds; the CPU needs minutes at full size) and places it on `device`,
/// one parameter at a time, so neither device holds more than the model plus one parameter.
/// The same seed and init device give the same weights.
class FluxDiTImpl : public torch::nn::Module {
 public:
  /// Builds the model; see the class comment for `device` and `init_device`.
  explicit FluxDiTImpl(const FluxDiTOptions& options, c10::Device device = c10::kCPU,
                       c10::Device init_device = c10::kCPU);

  /// img [B, img_tokens, in_channels], txt [B, txt_tokens, text_dim], timestep [B] in [0, 1]
  /// (any dtype; cast to the model's) -> [B, img_tokens, in_channels]. Token counts may differ
  /// from the options'.
  torch::Tensor forward(const torch::Tensor& img, const torch::Tensor& txt,
                        const torch::Tensor& timestep);

  /// The options the model was built with.
  const FluxDiTOptions& options() const { return options_; }

  /// Parameters of a model with these options, computed without building it.
  static std::int64_t parameter_count(const FluxDiTOptions& options);
  /// parameter_count * element size of options.dtype.
  static std::int64_t parameter_bytes(const FluxDiTOptions& options);

  torch::nn::Linear x_embedder{nullptr};        ///< latent channels -> hidden
  torch::nn::Linear context_embedder{nullptr};  ///< text_dim -> hidden
  /// Block internals are private types of flux_dit.cpp; their weights are stock Linears.
  std::shared_ptr<torch::nn::Module> time_embed;             ///< linear_1, linear_2
  torch::nn::ModuleList transformer_blocks{nullptr};         ///< double-stream blocks
  torch::nn::ModuleList single_transformer_blocks{nullptr};  ///< single-stream blocks
  std::shared_ptr<torch::nn::Module> norm_out;  ///< linear (adaLN, hidden -> 2 * hidden)
  torch::nn::Linear proj_out{nullptr};          ///< hidden -> in_channels

 private:
  FluxDiTOptions options_;
};
/// The module holder (shared_ptr) of FluxDiTImpl, as torch::nn names its modules.
TORCH_MODULE(FluxDiT);

/// One step's inputs for a FluxDiT, drawn by make_inputs.
struct FluxDiTInputs {
  torch::Tensor img;       ///< [B, img_tokens, in_channels], options.dtype
  torch::Tensor txt;       ///< [B, txt_tokens, text_dim], options.dtype
  torch::Tensor timestep;  ///< [B], float32 in (0, 1)
};

/// Random inputs of the model's shapes (standard normal latents and text features) from `seed`,
/// drawn on the CPU and moved to `device` so that they match across devices.
FluxDiTInputs make_inputs(const FluxDiTOptions& options, c10::Device device, std::int64_t batch = 1,
                          std::uint64_t seed = 1);

}  // namespace ddo::adapter::testing
