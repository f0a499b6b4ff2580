// GPU tests (label "gpu"): the adapter on a real CUDA device. Each test skips, saying so, where
// no GPU is visible. The small DiT (W1 at its "small" size, about 70 M parameters) runs resident
// and under ddo on the same card and stream: fp32 outputs are bit-equal, bf16 within rounding.
// Calibration and the run that applies its profile stay inside an emulated VRAM cap (driver view,
// sampled); the allocator's reserved memory stays flat in steady steps; a changed execution order
// recovers; pinning failure falls back.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "../test_util.h"
#include "gpu_test_util.h"
#include "ddo/core/config.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/memory_probe.h"
#include "ddo/torch/testing/flux_dit.h"

namespace ddo::adapter {
namespace {

using test::TempDir;
using testing::FluxDiT;
using testing::FluxDiTOptions;

using test::CapReset;
using test::driver_used_now;
using test::kCuda;
using test::kGiB;
using test::kMiB;

// The small DiT with its resident output on the GPU as the reference. The model lives on the
// CPU between runs, as a host program hands it to ddo.
struct GpuDit {
  FluxDiTOptions opts;
  FluxDiT model{nullptr};
  testing::FluxDiTInputs in;
  at::Tensor ref;  // resident output, on the CPU

  explicit GpuDit(c10::ScalarType dtype) {
    opts = FluxDiTOptions::preset("small");
    opts.dtype = dtype;
    model = FluxDiT(opts, c10::kCPU, c10::kCPU);
    in = testing::make_inputs(opts, kCuda);
    model->to(kCuda);
    ref = run();
    model->to(c10::kCPU);
    release_cached_device_memory();
  }
  at::Tensor run() {
    torch::NoGradGuard ng;
    return model->forward(in.img, in.txt, in.timestep).to(c10::kCPU);
  }
  std::int64_t bytes() const { return testing::FluxDiTImpl::parameter_bytes(opts); }
};

OffloadOptions cuda_options(const TempDir& dir, nlohmann::json extra = nlohmann::json::object()) {
  OffloadOptions o;
  o.preset = "one_shot_fast";
  o.execution_device = "cuda:0";
  o.env = test::test_env(dir);
  nlohmann::json ov = {{"small_tensor_threshold_bytes", 0},
                       {"auto_budget_policy", "off"},
                       {"always_resident_modules_pattern", nlohmann::json::array()},
                       {"profile_vram_headroom_gb", 0.02}};
  for (auto it = extra.begin(); it != extra.end(); ++it) ov[it.key()] = it.value();
  o.overrides = ov;
  return o;
}

TEST(CudaOffload, Fp32OutputsBitEqualResidentOnEveryRoute) {
  DDO_SKIP_WITHOUT_GPU();
  GpuDit dit(c10::ScalarType::Float);
  for (const char* preset : {"one_shot_fast", "diffusers_offload_compat",
                             "diffusers_leaf_offload_compat", "low_ram_safe"}) {
    TempDir dir;
    OffloadOptions o = cuda_options(dir);
    o.preset = preset;
    auto offload = enable_offload(*dit.model, o);
    for (int step = 0; step < 3; ++step) {
      const at::Tensor out = dit.run();
      EXPECT_TRUE(at::equal(out, dit.ref)) << preset << " step " << step << ": max |diff| "
                                           << (out - dit.ref).abs().max().item<float>();
    }
    const nlohmann::json r = offload->report();
    EXPECT_GT(r["run"].value("acquires", 0), 0) << preset << "\n" << offload->summary();
    offload->remove();
    for (const auto& p : dit.model->parameters()) EXPECT_TRUE(p.device().is_cpu()) << preset;
  }
}

TEST(CudaOffload, Bf16OutputsEqualResidentWithinRounding) {
  DDO_SKIP_WITHOUT_GPU();
  GpuDit dit(c10::ScalarType::BFloat16);
  TempDir dir;
  auto offload = enable_offload(*dit.model, cuda_options(dir, {{"pin_cpu_memory", true}}));
  // Streamed from registered (pinned) slabs, the fast path.
  EXPECT_EQ(offload->report()["setup"].value("pinned_bytes", std::int64_t{0}),
            offload->report()["setup"]["bytes"].value("streamed", std::int64_t{-1}))
      << offload->summary();
  for (int step = 0; step < 3; ++step) {
    const at::Tensor out = dit.run().to(at::kFloat);
    const at::Tensor ref = dit.ref.to(at::kFloat);
    // Same kernels on the same values: equal in practice; bf16 rounding is the allowed slack.
    EXPECT_TRUE(at::allclose(out, ref, /*rtol=*/1.0 / 128, /*atol=*/1e-3))
        << "step " << step << ": max |diff| " << (out - ref).abs().max().item<float>();
  }
}

// diffusers-dynamic-offloader's lifecycle on the card: calibrate under a cap, save, apply; the
// driver-view peak (sampled every millisecond, plus the allocator's peak) never passes the cap.
TEST(CudaOffload, CalibrationAndReuseStayInsideTheCap) {
  DDO_SKIP_WITHOUT_GPU();
  GpuDit dit(c10::ScalarType::Float);
  CapReset reset_cap;
  // The context and cuBLAS handles exist before the cap is computed.
  const std::int64_t base = driver_used_now();
  const std::int64_t cap = base + dit.bytes() / 2 + 96 * kMiB;
  const double cap_gb = static_cast<double>(cap) / kGiB;
  TempDir dir;
  nlohmann::json calibration_report;
  {
    OffloadOptions o = cuda_options(dir, {{"vram_cap_gb", cap_gb}});
    o.profile_name = "gpu-test";
    o.build_profile = true;
    auto offload = enable_offload(*dit.model, o);
    std::unique_ptr<MemoryProbe> probe;
    ASSERT_TRUE(make_cuda_memory_probe(0, &probe).ok());
    ASSERT_TRUE(probe->start_sampling(std::chrono::milliseconds(1)).ok());
    calibration_report = offload->profile_run([&] {
      for (int step = 0; step < 3; ++step) EXPECT_TRUE(at::equal(dit.run(), dit.ref));
    });
    const MeasurementResult m = probe->stop_sampling();
    EXPECT_EQ(m.total_bytes, cap);
    EXPECT_LE(m.peak_bytes, cap) << "calibration peak above the cap";
    EXPECT_LE(m.peak_driver_used_bytes, cap);
    EXPECT_EQ(calibration_report.value("status", ""), "saved") << calibration_report.dump(2);
    EXPECT_LE(calibration_report.value("peak_vram_gb", 1e9), cap_gb) << calibration_report.dump(2);
  }
  const double recommended = calibration_report.value("resident_budget_gb", 0.0);
  EXPECT_GT(recommended, 0.0) << calibration_report.dump(2);
  EXPECT_LT(recommended, cap_gb);
  {
    OffloadOptions o = cuda_options(dir, {{"vram_cap_gb", cap_gb}});
    o.profile_name = "gpu-test";
    auto offload = enable_offload(*dit.model, o);
    EXPECT_EQ(offload->profile_report().value("status", ""), "applied")
        << offload->profile_report().dump(2);
    EXPECT_FALSE(offload->plan().resident_module_names().empty()) << offload->summary();
    const nlohmann::json r = offload->report();
    std::unique_ptr<MemoryProbe> probe;
    ASSERT_TRUE(make_cuda_memory_probe(0, &probe).ok());
    ASSERT_TRUE(probe->start_sampling(std::chrono::milliseconds(1)).ok());
    for (int step = 0; step < 4; ++step) EXPECT_TRUE(at::equal(dit.run(), dit.ref));
    const MeasurementResult m = probe->stop_sampling();
    EXPECT_LE(m.peak_bytes, cap) << "normal-run peak above the cap\n" << offload->summary();
    // Fewer bytes streamed than in calibration: the recommendation was applied.
    EXPECT_LT(r["setup"]["bytes"].value("streamed", std::int64_t{0}), dit.bytes());
  }
  // The emulated card went with the offload that asked for it.
  EXPECT_EQ(vram_cap_bytes(0), 0);
}

// Staging is taken once: steady steps make no cudaMalloc and leave reserved memory flat.
TEST(CudaOffload, SteadyStepsAllocateNothingNew) {
  DDO_SKIP_WITHOUT_GPU();
  GpuDit dit(c10::ScalarType::BFloat16);
  TempDir dir;
  auto offload = enable_offload(*dit.model, cuda_options(dir));
  dit.run();
  dit.run();
  std::unique_ptr<MemoryProbe> probe;
  ASSERT_TRUE(make_cuda_memory_probe(0, &probe).ok());
  probe->synchronize();
  const std::int64_t reserved = probe->snapshot().allocator_reserved_bytes;
  const AllocatorCounters before = allocator_counters(0);
  for (int step = 0; step < 5; ++step) dit.run();
  probe->synchronize();
  const AllocatorCounters after = allocator_counters(0);
  EXPECT_EQ(after.device_allocs, before.device_allocs);
  EXPECT_EQ(after.alloc_retries, before.alloc_retries);
  EXPECT_EQ(probe->snapshot().allocator_reserved_bytes, reserved);
  EXPECT_GT(offload->report()["run"].value("prefetch_hits", 0), 0) << offload->summary();
}

TEST(CudaOffload, ChangedExecutionOrderRecovers) {
  DDO_SKIP_WITHOUT_GPU();
  torch::manual_seed(7);
  torch::nn::ModuleList layers;
  for (int i = 0; i < 8; ++i) layers->push_back(torch::nn::Linear(1024, 1024));
  const at::Tensor x = at::randn({64, 1024}).to(kCuda);
  auto run = [&](bool reversed) {
    torch::NoGradGuard ng;
    at::Tensor h = x;
    for (int i = 0; i < 8; ++i) {
      const int k = reversed ? 7 - i : i;
      h = layers[k]->as<torch::nn::Linear>()->forward(h);
    }
    return h.to(c10::kCPU);
  };
  layers->to(kCuda);
  const at::Tensor fwd = run(false), rev = run(true);
  layers->to(c10::kCPU);
  TempDir dir;
  auto offload = enable_offload(*layers, cuda_options(dir));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(run(false), fwd)) << "forward " << i;
  for (int i = 0; i < 6; ++i) EXPECT_TRUE(at::equal(run(true), rev)) << "reversed " << i;
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(at::equal(run(i % 2 == 1), i % 2 ? rev : fwd)) << i;
  const nlohmann::json r = offload->report()["run"];
  EXPECT_GT(r.value("order_misses", 0), 0);
  EXPECT_GT(r.value("relearns", 0), 0);
}

TEST(CudaOffload, PinFailureFallsBackOrErrors) {
  DDO_SKIP_WITHOUT_GPU();
  GpuDit dit(c10::ScalarType::Float);
  // Less pinnable memory than the streamed weights: what cannot pin stays ordinary memory.
  const double pinnable_gb = static_cast<double>(dit.bytes()) / 3 / kGiB;
  {
    TempDir dir;
    auto offload = enable_offload(
        *dit.model,
        cuda_options(dir, {{"pin_cpu_memory", true}, {"sim_pinnable_gb", pinnable_gb}}));
    const nlohmann::json r = offload->report();
    // Slabs are up to 1 GiB, so the small model's one slab is refused whole.
    EXPECT_GT(r["setup"].value("pin_fallback_bytes", std::int64_t{0}), 0) << offload->summary();
    for (int step = 0; step < 3; ++step) EXPECT_TRUE(at::equal(dit.run(), dit.ref));
  }
  TempDir dir;
  test::expect_pin_refusal_leaves_model_alone(
      *dit.model, cuda_options(dir, {{"pin_cpu_memory", true},
                                     {"sim_pinnable_gb", pinnable_gb},
                                     {"allow_pin_memory_fallback", false}}));
  dit.model->to(kCuda);
  EXPECT_TRUE(at::equal(dit.run(), dit.ref));
  dit.model->to(c10::kCPU);
}

}  // namespace
}  // namespace ddo::adapter
