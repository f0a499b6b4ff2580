// The W1 model: a FLUX.1-style MMDiT from stock LibTorch layers. See flux_dit.h.
#include "ddo/torch/testing/flux_dit.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>

#include "ddo/core/status.h"

namespace ddo::adapter::testing {

namespace {

using torch::Tensor;
using torch::nn::Linear;
using torch::nn::Module;
using torch::nn::ModuleList;

constexpr double kNormEps = 1e-6;
constexpr double kBiasStd = 0.02;
// adaLN outputs (shift, scale, gate) near 0.3 in magnitude: blocks change the residual stream
// by a fraction of its size, as a trained model's do.
constexpr double kModulationGain = 0.5;

// Note [Drawing weights]
// ~~~~~~~~~~~~~~~~~~~~~~
// A stock torch::nn::Linear allocates float32 weights on the CPU and runs kaiming-uniform init in
// its constructor. At full size that is 47.6 GB of float32 and a minute of CPU random numbers
// before the 23.8 GB bf16 model exists, more than the GPU machine's budget allows. So each
// Linear is constructed at 1x1 and then given its real options and weights (set_data, the
// mechanism Module::to uses): still a stock Linear in every respect the dispatcher sees. Weights
// are drawn from one generator in construction order on `init_device` (a CUDA device draws the
// full model in seconds) and moved to `device` one at a time, so no device holds more than the
// model plus one parameter.
class WeightSource {
 public:
  WeightSource(std::uint64_t seed, c10::Device device, c10::Device init_device,
               c10::ScalarType dtype)
      : device_(device), init_device_(init_device), dtype_(dtype) {
    if (init_device.is_cpu()) {
      generator_ = at::detail::createCPUGenerator(seed);
    } else {
      generator_ = at::globalContext()
                       .getAcceleratorHooksInterface(init_device.type())
                       .getNewGenerator(init_device.index() < 0 ? 0 : init_device.index());
      generator_.set_current_seed(seed);
    }
  }

  Tensor normal(std::vector<int64_t> shape, double std) {
    Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype_).device(init_device_));
    t.normal_(0.0, std, generator_);
    return t.to(device_);
  }

  Tensor ones(std::vector<int64_t> shape) {
    return at::ones(shape, at::TensorOptions().dtype(dtype_).device(device_));
  }

  // A stock Linear with the given shape and weights N(0, std^2); bias N(0, kBiasStd^2).
  Linear linear(int64_t in, int64_t out, double std, bool bias = true) {
    Linear layer(torch::nn::LinearOptions(1, 1).bias(bias));  // see Note [Drawing weights]
    layer->options.in_features(in);
    layer->options.out_features(out);
    torch::NoGradGuard no_grad;
    layer->weight.set_data(normal({out, in}, std));
    if (bias) layer->bias.set_data(normal({out}, kBiasStd));
    return layer;
  }

  // Variance-preserving for unit-variance inputs.
  Linear linear(int64_t in, int64_t out) { return linear(in, out, 1.0 / std::sqrt(double(in))); }

 private:
  c10::Device device_;
  c10::Device init_device_;
  c10::ScalarType dtype_;
  at::Generator generator_;
};

Tensor layer_norm(const Tensor& x) {
  return at::layer_norm(x, {x.size(-1)}, std::nullopt, std::nullopt, kNormEps);
}

// x * (1 + scale) + shift, with per-sample modulation [B, 1, h].
Tensor modulate(const Tensor& x, const Tensor& shift, const Tensor& scale) {
  return x * (1 + scale) + shift;
}

Tensor gelu_tanh(const Tensor& x) {
  return torch::nn::functional::gelu(x,
                                     torch::nn::functional::GELUFuncOptions().approximate("tanh"));
}

// RMS norm over the head dimension with a learned scale (diffusers' attn.norm_q / norm_k).
// Its 128-element weight stays under every small-tensor threshold: never streamed.
struct RMSNormImpl : Module {
  RMSNormImpl(WeightSource& w, int64_t dim) {
    weight = register_parameter("weight", w.ones({dim}), /*requires_grad=*/false);
  }
  Tensor forward(const Tensor& x) { return at::rms_norm(x, {x.size(-1)}, weight, kNormEps); }
  Tensor weight;
};
TORCH_MODULE(RMSNorm);

// A module holding one modulation Linear named `linear` (diffusers' AdaLayerNormZero,
// AdaLayerNormZeroSingle, AdaLayerNormContinuous).
struct AdaNormImpl : Module {
  AdaNormImpl(WeightSource& w, int64_t hidden, int64_t chunks) {
    linear = register_module(
        "linear", w.linear(hidden, chunks * hidden, kModulationGain / std::sqrt(double(hidden))));
  }
  Linear linear{nullptr};
};
TORCH_MODULE(AdaNorm);

struct TimestepEmbeddingImpl : Module {
  TimestepEmbeddingImpl(WeightSource& w, int64_t timestep_dim, int64_t hidden)
      : timestep_dim(timestep_dim) {
    linear_1 = register_module("linear_1", w.linear(timestep_dim, hidden));
    linear_2 = register_module("linear_2", w.linear(hidden, hidden));
  }
  // Sinusoidal embedding of t * 1000 (diffusers' Timesteps with flip_sin_to_cos), then an MLP.
  Tensor forward(const Tensor& timestep, c10::ScalarType dtype) {
    const int64_t half = timestep_dim / 2;
    auto f32 = at::TensorOptions().dtype(at::kFloat).device(timestep.device());
    Tensor freqs = at::exp(at::arange(half, f32) * (-std::log(10000.0) / double(half)));
    Tensor args = timestep.to(at::kFloat).unsqueeze(1) * 1000.0 * freqs.unsqueeze(0);
    Tensor emb = at::cat({at::cos(args), at::sin(args)}, -1).to(dtype);
    return linear_2(at::silu(linear_1(emb)));
  }
  int64_t timestep_dim;
  Linear linear_1{nullptr}, linear_2{nullptr};
};

// diffusers' GELU(approximate="tanh") activation module: a projection named `proj`.
struct GeluProjImpl : Module {
  GeluProjImpl(WeightSource& w, int64_t in, int64_t out) {
    proj = register_module("proj", w.linear(in, out));
  }
  Tensor forward(const Tensor& x) { return gelu_tanh(proj(x)); }
  Linear proj{nullptr};
};

// diffusers' FeedForward: net.0 = GELU projection, net.1 = dropout (here a parameter-free
// placeholder keeping the index), net.2 = output Linear.
struct FeedForwardImpl : Module {
  FeedForwardImpl(WeightSource& w, int64_t hidden, int64_t mlp_hidden, double out_gain) {
    auto gelu = std::make_shared<GeluProjImpl>(w, hidden, mlp_hidden);
    auto out = w.linear(mlp_hidden, hidden, out_gain / std::sqrt(double(mlp_hidden)));
    net = register_module("net", ModuleList(gelu, torch::nn::Identity(), out));
    gelu_ = gelu.get();
    out_ = out.get();
  }
  Tensor forward(const Tensor& x) { return out_->forward(gelu_->forward(x)); }
  ModuleList net{nullptr};

 private:
  GeluProjImpl* gelu_;
  torch::nn::LinearImpl* out_;
};

// [B, S, h] -> [B, heads, S, head_dim]
Tensor split_heads(const Tensor& x, int64_t heads) {
  return x.view({x.size(0), x.size(1), heads, -1}).transpose(1, 2);
}

// [B, heads, S, head_dim] -> [B, S, h]
Tensor merge_heads(const Tensor& x) {
  return x.transpose(1, 2).reshape({x.size(0), x.size(2), -1});
}

// Joint attention of a double block: image and text streams project separately, attend over
// the concatenated sequence [text, image], and project back separately.
struct JointAttentionImpl : Module {
  JointAttentionImpl(WeightSource& w, int64_t hidden, int64_t heads, double out_gain)
      : heads(heads) {
    const int64_t head_dim = hidden / heads;
    to_q = register_module("to_q", w.linear(hidden, hidden));
    to_k = register_module("to_k", w.linear(hidden, hidden));
    to_v = register_module("to_v", w.linear(hidden, hidden));
    norm_q = register_module("norm_q", RMSNorm(w, head_dim));
    norm_k = register_module("norm_k", RMSNorm(w, head_dim));
    add_q_proj = register_module("add_q_proj", w.linear(hidden, hidden));
    add_k_proj = register_module("add_k_proj", w.linear(hidden, hidden));
    add_v_proj = register_module("add_v_proj", w.linear(hidden, hidden));
    norm_added_q = register_module("norm_added_q", RMSNorm(w, head_dim));
    norm_added_k = register_module("norm_added_k", RMSNorm(w, head_dim));
    const double out_std = out_gain / std::sqrt(double(hidden));
    out_ = w.linear(hidden, hidden, out_std);
    to_out = register_module("to_out", ModuleList(out_));
    to_add_out = register_module("to_add_out", w.linear(hidden, hidden, out_std));
  }

  std::pair<Tensor, Tensor> forward(const Tensor& img, const Tensor& txt) {
    Tensor q = at::cat(
        {norm_added_q(split_heads(add_q_proj(txt), heads)), norm_q(split_heads(to_q(img), heads))},
        2);
    Tensor k = at::cat(
        {norm_added_k(split_heads(add_k_proj(txt), heads)), norm_k(split_heads(to_k(img), heads))},
        2);
    Tensor v = at::cat({split_heads(add_v_proj(txt), heads), split_heads(to_v(img), heads)}, 2);
    Tensor o = merge_heads(at::scaled_dot_product_attention(q, k, v));
    const int64_t m = txt.size(1);
    Tensor o_txt = o.narrow(1, 0, m);
    Tensor o_img = o.narrow(1, m, o.size(1) - m);
    return {out_(o_img), to_add_out(o_txt)};
  }

  int64_t heads;
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  RMSNorm norm_q{nullptr}, norm_k{nullptr};
  Linear add_q_proj{nullptr}, add_k_proj{nullptr}, add_v_proj{nullptr};
  RMSNorm norm_added_q{nullptr}, norm_added_k{nullptr};
  ModuleList to_out{nullptr};
  Linear to_add_out{nullptr};

 private:
  Linear out_{nullptr};  // to_out.0
};

// diffusers' FluxTransformerBlock.
struct DoubleBlockImpl : Module {
  DoubleBlockImpl(WeightSource& w, const FluxDiTOptions& o, double out_gain) {
    norm1 = register_module("norm1", AdaNorm(w, o.hidden, 6));
    norm1_context = register_module("norm1_context", AdaNorm(w, o.hidden, 6));
    attn = register_module("attn",
                           std::make_shared<JointAttentionImpl>(w, o.hidden, o.heads, out_gain));
    ff = register_module("ff",
                         std::make_shared<FeedForwardImpl>(w, o.hidden, o.mlp_hidden(), out_gain));
    ff_context = register_module(
        "ff_context", std::make_shared<FeedForwardImpl>(w, o.hidden, o.mlp_hidden(), out_gain));
  }

  // temb_act = silu(timestep embedding), [B, h].
  std::pair<Tensor, Tensor> forward(Tensor img, Tensor txt, const Tensor& temb_act) {
    auto mi = norm1->linear(temb_act).unsqueeze(1).chunk(6, -1);
    auto mt = norm1_context->linear(temb_act).unsqueeze(1).chunk(6, -1);
    auto [a_img, a_txt] = attn->forward(modulate(layer_norm(img), mi[0], mi[1]),
                                        modulate(layer_norm(txt), mt[0], mt[1]));
    img = img + mi[2] * a_img;
    txt = txt + mt[2] * a_txt;
    img = img + mi[5] * ff->forward(modulate(layer_norm(img), mi[3], mi[4]));
    txt = txt + mt[5] * ff_context->forward(modulate(layer_norm(txt), mt[3], mt[4]));
    return {img, txt};
  }

  AdaNorm norm1{nullptr}, norm1_context{nullptr};
  std::shared_ptr<JointAttentionImpl> attn;
  std::shared_ptr<FeedForwardImpl> ff, ff_context;
};

// Self-attention of a single block: q, k, v only (the output projection is the block's
// proj_out, shared with the MLP branch).
struct SingleAttentionImpl : Module {
  SingleAttentionImpl(WeightSource& w, int64_t hidden, int64_t heads) : heads(heads) {
    to_q = register_module("to_q", w.linear(hidden, hidden));
    to_k = register_module("to_k", w.linear(hidden, hidden));
    to_v = register_module("to_v", w.linear(hidden, hidden));
    norm_q = register_module("norm_q", RMSNorm(w, hidden / heads));
    norm_k = register_module("norm_k", RMSNorm(w, hidden / heads));
  }
  Tensor forward(const Tensor& x) {
    return merge_heads(at::scaled_dot_product_attention(norm_q(split_heads(to_q(x), heads)),
                                                        norm_k(split_heads(to_k(x), heads)),
                                                        split_heads(to_v(x), heads)));
  }
  int64_t heads;
  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  RMSNorm norm_q{nullptr}, norm_k{nullptr};
};

// diffusers' FluxSingleTransformerBlock. Its `proj_out` matches the default always-resident
// pattern exactly as it does on the real model.
struct SingleBlockImpl : Module {
  SingleBlockImpl(WeightSource& w, const FluxDiTOptions& o, double out_gain) {
    norm = register_module("norm", AdaNorm(w, o.hidden, 3));
    proj_mlp = register_module("proj_mlp", w.linear(o.hidden, o.mlp_hidden()));
    attn = register_module("attn", std::make_shared<SingleAttentionImpl>(w, o.hidden, o.heads));
    const int64_t cat = o.hidden + o.mlp_hidden();
    proj_out =
        register_module("proj_out", w.linear(cat, o.hidden, out_gain / std::sqrt(double(cat))));
  }

  Tensor forward(const Tensor& x, const Tensor& temb_act) {
    auto m = norm->linear(temb_act).unsqueeze(1).chunk(3, -1);
    Tensor nx = modulate(layer_norm(x), m[0], m[1]);
    Tensor mlp = gelu_tanh(proj_mlp(nx));
    return x + m[2] * proj_out(at::cat({attn->forward(nx), mlp}, -1));
  }

  AdaNorm norm{nullptr};
  Linear proj_mlp{nullptr};
  std::shared_ptr<SingleAttentionImpl> attn;
  Linear proj_out{nullptr};
};

int64_t linear_params(int64_t in, int64_t out) {
  return in * out + out;
}

}  // namespace

FluxDiTOptions FluxDiTOptions::preset(std::string_view name) {
  FluxDiTOptions o;
  if (name == "full") return o;
  if (name == "small") {
    o.double_blocks = 4;
    o.single_blocks = 8;
    o.hidden = 512;
    o.heads = 8;
    o.in_channels = 64;
    o.text_dim = 512;
    o.img_tokens = 256;
    o.txt_tokens = 64;
    o.dtype = c10::ScalarType::Float;
    return o;
  }
  if (name == "tiny") {
    o.double_blocks = 2;
    o.single_blocks = 2;
    o.hidden = 64;
    o.heads = 4;
    o.in_channels = 16;
    o.text_dim = 32;
    o.img_tokens = 32;
    o.txt_tokens = 8;
    o.timestep_dim = 32;
    o.dtype = c10::ScalarType::Float;
    return o;
  }
  throw Error(Code::kInvalidArgument, internal::str_cat("unknown FluxDiT preset \"", name,
                                                        "\"; valid presets: tiny, small, full"));
}

FluxDiTImpl::FluxDiTImpl(const FluxDiTOptions& options, c10::Device device, c10::Device init_device)
    : options_(options) {
  const FluxDiTOptions& o = options_;
  DDO_CHECK(o.hidden > 0 && o.heads > 0 && o.hidden % o.heads == 0, Code::kInvalidArgument,
            "FluxDiT hidden=", o.hidden, " must be a positive multiple of heads=", o.heads);
  DDO_CHECK(o.double_blocks >= 0 && o.single_blocks >= 0 && o.mlp_ratio > 0 && o.in_channels > 0 &&
                o.text_dim > 0 && o.timestep_dim > 0 && o.timestep_dim % 2 == 0,
            Code::kInvalidArgument,
            "FluxDiT sizes must be positive (blocks >= 0, timestep_dim even); got double_blocks=",
            o.double_blocks, " single_blocks=", o.single_blocks, " mlp_ratio=", o.mlp_ratio,
            " in_channels=", o.in_channels, " text_dim=", o.text_dim,
            " timestep_dim=", o.timestep_dim);
  WeightSource w(o.seed, device, init_device, o.dtype);
  // Residual branches scaled by 1/sqrt(2 x blocks): the stream's variance grows by a bounded
  // amount over the whole depth (finite in bf16 at 57 blocks).
  const double out_gain = 1.0 / std::sqrt(2.0 * std::max(1, o.double_blocks + o.single_blocks));

  x_embedder = register_module("x_embedder", w.linear(o.in_channels, o.hidden));
  context_embedder = register_module("context_embedder", w.linear(o.text_dim, o.hidden));
  time_embed = register_module(
      "time_embed", std::make_shared<TimestepEmbeddingImpl>(w, o.timestep_dim, o.hidden));
  transformer_blocks = register_module("transformer_blocks", ModuleList());
  for (int i = 0; i < o.double_blocks; ++i) {
    transformer_blocks->push_back(std::make_shared<DoubleBlockImpl>(w, o, out_gain));
  }
  single_transformer_blocks = register_module("single_transformer_blocks", ModuleList());
  for (int i = 0; i < o.single_blocks; ++i) {
    single_transformer_blocks->push_back(std::make_shared<SingleBlockImpl>(w, o, out_gain));
  }
  norm_out = register_module("norm_out", AdaNorm(w, o.hidden, 2).ptr());
  proj_out = register_module("proj_out", w.linear(o.hidden, o.in_channels));
  for (auto& p : parameters()) p.set_requires_grad(false);
}

Tensor FluxDiTImpl::forward(const Tensor& img, const Tensor& txt, const Tensor& timestep) {
  const FluxDiTOptions& o = options_;
  TORCH_CHECK(img.dim() == 3 && img.size(2) == o.in_channels, "FluxDiT img must be [B, N, ",
              o.in_channels, "]; got ", img.sizes());
  TORCH_CHECK(txt.dim() == 3 && txt.size(2) == o.text_dim && txt.size(0) == img.size(0),
              "FluxDiT txt must be [", img.size(0), ", M, ", o.text_dim, "]; got ", txt.sizes());
  TORCH_CHECK(timestep.dim() == 1 && timestep.size(0) == img.size(0), "FluxDiT timestep must be [",
              img.size(0), "]; got ", timestep.sizes());
  Tensor h = x_embedder(img.to(o.dtype));
  Tensor c = context_embedder(txt.to(o.dtype));
  Tensor temb = time_embed->as<TimestepEmbeddingImpl>()->forward(timestep, o.dtype);
  Tensor temb_act = at::silu(temb);
  for (const auto& block : *transformer_blocks) {
    std::tie(h, c) = block->as<DoubleBlockImpl>()->forward(h, c, temb_act);
  }
  const int64_t m = c.size(1);
  Tensor x = at::cat({c, h}, 1);
  for (const auto& block : *single_transformer_blocks) {
    x = block->as<SingleBlockImpl>()->forward(x, temb_act);
  }
  h = x.narrow(1, m, x.size(1) - m);
  auto mod = norm_out->as<AdaNormImpl>()->linear(temb_act).unsqueeze(1).chunk(2, -1);
  return proj_out(modulate(layer_norm(h), /*shift=*/mod[1], /*scale=*/mod[0]));
}

int64_t FluxDiTImpl::parameter_count(const FluxDiTOptions& o) {
  const int64_t h = o.hidden;
  const int64_t mh = int64_t{o.hidden} * o.mlp_ratio;
  const int64_t hd = h / o.heads;
  const int64_t stream = linear_params(h, 6 * h)    // norm1.linear
                         + 4 * linear_params(h, h)  // to_q, to_k, to_v, to_out.0
                         + 2 * hd                   // norm_q, norm_k
                         + linear_params(h, mh) + linear_params(mh, h);  // ff
  const int64_t single = linear_params(h, 3 * h) + 3 * linear_params(h, h) + 2 * hd +
                         linear_params(h, mh) + linear_params(h + mh, h);
  return linear_params(o.in_channels, h) + linear_params(o.text_dim, h) +
         linear_params(o.timestep_dim, h) + linear_params(h, h) +  // time_embed
         o.double_blocks * 2 * stream + o.single_blocks * single + linear_params(h, 2 * h) +
         linear_params(h, o.in_channels);  // norm_out, proj_out
}

int64_t FluxDiTImpl::parameter_bytes(const FluxDiTOptions& o) {
  return parameter_count(o) * static_cast<int64_t>(c10::elementSize(o.dtype));
}

FluxDiTInputs make_inputs(const FluxDiTOptions& o, c10::Device device, int64_t batch,
                          std::uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  FluxDiTInputs in;
  in.img =
      at::empty({batch, o.img_tokens, o.in_channels}, f32).normal_(0, 1, gen).to(device, o.dtype);
  in.txt = at::empty({batch, o.txt_tokens, o.text_dim}, f32).normal_(0, 1, gen).to(device, o.dtype);
  in.timestep = at::empty({batch}, f32).uniform_(0.05, 0.95, gen).to(device);
  return in;
}

}  // namespace ddo::adapter::testing
