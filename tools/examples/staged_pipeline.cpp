// The staged flow (docs/design/0007-named-profiles.md, section 1) in C++: encode and release the
// encoder, attach offload to the denoiser, wrap only the denoising loop in profile_run(), release
// the denoiser, decode. A GenerationMeter reports the generation: seconds per stage, bytes
// streamed, peak VRAM and RSS.
//
//   staged_pipeline --calibrate      # first run: measures and saves profile "staged-demo"
//   staged_pipeline                  # later runs: the saved recommendation is applied at setup
//
// Runs on cuda:0 when a GPU is present, else on the host simulation. Profiles go to
// DDO_PROFILE_DIR (default ~/.ddo/profiles).
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/generation.h"
#include "ddo/torch/testing/flux_dit.h"

int main(int argc, char** argv) {
  bool calibrate = false;
  for (int i = 1; i < argc; ++i) calibrate = calibrate || std::strcmp(argv[i], "--calibrate") == 0;
  const bool cuda = ddo::engine::cuda_available();
  const std::string device = cuda ? "cuda:0" : "sim";
  const c10::Device tensors_on = cuda ? c10::Device("cuda:0") : c10::Device(c10::kCPU);
  torch::NoGradGuard no_grad;
  try {
    using ddo::adapter::testing::FluxDiT;
    using ddo::adapter::testing::FluxDiTOptions;
    FluxDiTOptions opts = FluxDiTOptions::preset("tiny");
    ddo::adapter::GenerationMeter meter({});  // the generation starts here

    // 1. Encode the prompt, then release the encoder before the denoiser is attached.
    at::Tensor text;
    {
      auto stage = meter.stage("encode");
      torch::nn::Sequential encoder(torch::nn::Linear(opts.text_dim, opts.text_dim),
                                    torch::nn::GELU(),
                                    torch::nn::Linear(opts.text_dim, opts.text_dim));
      encoder->to(tensors_on);
      at::Tensor tokens = at::randn({1, opts.txt_tokens, opts.text_dim}).to(tensors_on);
      text = encoder->forward(tokens);
    }  // encoder released

    // 2. Attach offload to the denoiser, at the actual execution stage, with the profile name.
    auto denoiser = std::make_shared<ddo::adapter::testing::FluxDiTImpl>(opts);
    ddo::adapter::OffloadOptions o;
    o.execution_device = device;
    o.profile_name = "staged-demo";
    o.build_profile = calibrate;
    // The tiny model's weights, all below the small-tensor threshold, stream like a large
    // model's (the calibration run streams them); on the simulation, a 256 MiB card.
    o.overrides = {{"small_tensor_threshold_bytes", 0}};
    if (!cuda) {
      o.overrides["sim_device_capacity_gb"] = 0.25;
      o.overrides["profile_vram_headroom_gb"] = 0.01;
    }
    std::unique_ptr<ddo::adapter::Offload> offload = ddo::adapter::enable_offload(denoiser, o);
    meter.add_offload("transformer", offload.get());

    // 3. Only the denoising loop is measured; the host chooses the steps.
    at::Tensor latents = at::randn({1, opts.img_tokens, opts.in_channels}).to(tensors_on);
    nlohmann::json profile_report;
    {
      auto stage = meter.stage("denoise");
      ddo::adapter::ProfileRun run = offload->profile_run();
      const int steps = 4;
      for (int i = 0; i < steps; ++i) {
        at::Tensor t = at::full({1}, 1.0 - static_cast<double>(i) / steps).to(tensors_on);
        latents = latents - denoiser->forward(latents, text, t) / steps;
      }
      profile_report = run.finish();  // without finish() (e.g. an exception) nothing is saved
    }
    std::printf("profile: %s\n", profile_report.dump().c_str());

    // 4. Release the denoiser (restores it, frees its device memory), then decode.
    meter.drop_offload("transformer");  // keeps what it streamed
    offload.reset();
    denoiser.reset();
    at::Tensor image;
    {
      auto stage = meter.stage("decode");
      torch::nn::Linear decoder(opts.in_channels, 3);
      decoder->to(tensors_on);
      image = decoder->forward(latents);
    }
    std::printf("decoded %lld x %lld values, mean %.4f\n", static_cast<long long>(image.size(1)),
                static_cast<long long>(image.size(2)), image.mean().item<double>());
    std::printf("generation: %s\n", meter.finish().dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "staged_pipeline: %s\n", e.what());
    return 1;
  }
}
