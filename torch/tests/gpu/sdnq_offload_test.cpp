// GPU tests of SDNQ models under ddo (label "gpu"; each skips, saying so, without a GPU): packed
// units streamed through the dequantize kernel give the resident model's outputs bit for bit, and
// the SDNQ probe lifecycle (docs/design/0007-named-profiles.md, section 4) runs on the card: a
// zero-resident calibration saves a pending probe (sdnq_baseline_probe_pending), the next normal
// run applies and measures it and its result replaces the probe (sdnq_probe), and the run after
// that applies the result.
#include <gtest/gtest.h>

#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "../test_util.h"
#include "ddo/sdnq/linear.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
const c10::Device kCuda(c10::kCUDA, 0);

// A stack of blocks of two SDNQ Linears (a repeated block list: the residency candidates).
struct SdnqBlockImpl : torch::nn::Module {
  SdnqBlockImpl(std::int64_t h, const sdnq::QuantizeOptions& opt) {
    torch::nn::Linear a(h, 4 * h), b(4 * h, h);
    a->to(at::kBFloat16);
    b->to(at::kBFloat16);
    up = register_module("up", sdnq::SdnqLinear(*a, opt));
    down = register_module("down", sdnq::SdnqLinear(*b, opt));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(x))); }
  sdnq::SdnqLinear up{nullptr}, down{nullptr};
};
TORCH_MODULE(SdnqBlock);

struct SdnqStackImpl : torch::nn::Module {
  SdnqStackImpl(int n, std::int64_t h, const sdnq::QuantizeOptions& opt) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < n; ++i) blocks->push_back(SdnqBlock(h, opt));
  }
  at::Tensor forward(at::Tensor x) {
    for (const auto& b : *blocks) x = b->as<SdnqBlockImpl>()->forward(x);
    return x;
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(SdnqStack);

OffloadOptions sdnq_options(const TempDir& dir, nlohmann::json extra = nlohmann::json::object()) {
  OffloadOptions o;
  o.preset = "one_shot_fast";
  o.execution_device = "cuda:0";
  o.env = test::test_env(dir);
  nlohmann::json ov = {{"small_tensor_threshold_bytes", 0},
                       {"always_resident_modules_pattern", nlohmann::json::array()},
                       {"profile_vram_headroom_gb", 0.25}};
  for (auto it = extra.begin(); it != extra.end(); ++it) ov[it.key()] = it.value();
  o.overrides = ov;
  return o;
}

struct CapReset {
  ~CapReset() { (void)apply_vram_cap(0, 0); }
};

at::Tensor run(SdnqStack& model, const at::Tensor& x) {
  torch::NoGradGuard ng;
  return model->forward(x).to(c10::kCPU);
}

TEST(SdnqOffloadGpu, StreamedPackedUnitsEqualTheResidentModel) {
  DDO_SKIP_WITHOUT_GPU();
  for (sdnq::QuantType type : {sdnq::QuantType::kInt8, sdnq::QuantType::kUint4}) {
    sdnq::QuantizeOptions opt;
    opt.type = type;
    at::manual_seed(5);
    SdnqStack model(6, 512, opt);
    const at::Tensor x = at::randn({2, 64, 512}).to(at::kBFloat16).to(kCuda);
    model->to(kCuda);
    const at::Tensor ref = run(model, x);
    model->to(c10::kCPU);
    TempDir dir;
    auto offload = enable_offload(
        *model, sdnq_options(dir, {{"resident_module_patterns", nlohmann::json::array()}}));
    EXPECT_EQ(offload->report().value("execution_mode", ""), "sdnq_runtime");
    // One unit per SDNQ layer: 12 layers.
    EXPECT_EQ(offload->plan().stream_units.size(), 12u) << offload->summary();
    for (int step = 0; step < 3; ++step) {
      EXPECT_TRUE(at::equal(run(model, x), ref)) << sdnq::to_string(type) << " step " << step;
    }
    EXPECT_GT(offload->report()["run"].value("acquires", 0), 0);
    offload->remove();
  }
}

TEST(SdnqOffloadGpu, ProbeLifecyclePendingThenProbeThenApplied) {
  DDO_SKIP_WITHOUT_GPU();
  sdnq::QuantizeOptions opt;
  opt.type = sdnq::QuantType::kInt8;
  at::manual_seed(6);
  SdnqStack model(8, 1024, opt);
  const at::Tensor x = at::randn({1, 256, 1024}).to(at::kBFloat16).to(kCuda);
  model->to(kCuda);
  const at::Tensor ref = run(model, x);
  model->to(c10::kCPU);
  release_cached_device_memory();
  CapReset reset_cap;
  // A 5 GiB card: the zero-resident peak is far below, so the safe budget (about 4.5 GiB) is
  // >= 2 GiB and below the probe ceiling min(6, 5 - 0.25): the calibration saves a probe.
  const double cap_gb = 5.0;
  TempDir dir;
  nlohmann::json saved;
  {
    OffloadOptions o = sdnq_options(dir, {{"vram_cap_gb", cap_gb}});
    o.profile_name = "sdnq-probe";
    o.build_profile = true;
    auto offload = enable_offload(*model, o);
    saved = offload->profile_run([&] { EXPECT_TRUE(at::equal(run(model, x), ref)); });
    EXPECT_EQ(saved.value("status", ""), "saved") << saved.dump(2);
    EXPECT_EQ(saved.value("profile_measurement_kind", ""), "sdnq_baseline_probe_pending")
        << saved.dump(2);
  }
  nlohmann::json probed;
  {
    OffloadOptions o = sdnq_options(dir, {{"vram_cap_gb", cap_gb}});
    o.profile_name = "sdnq-probe";
    auto offload = enable_offload(*model, o);
    EXPECT_EQ(offload->profile_report().value("status", ""), "probing")
        << offload->profile_report().dump(2);
    EXPECT_FALSE(offload->plan().resident_module_names().empty()) << offload->summary();
    probed = offload->profile_run([&] { EXPECT_TRUE(at::equal(run(model, x), ref)); });
    EXPECT_EQ(probed.value("profile_measurement_kind", ""), "sdnq_probe") << probed.dump(2);
    EXPECT_LE(probed.value("peak_vram_gb", 1e9), cap_gb) << probed.dump(2);
  }
  {
    OffloadOptions o = sdnq_options(dir, {{"vram_cap_gb", cap_gb}});
    o.profile_name = "sdnq-probe";
    auto offload = enable_offload(*model, o);
    const nlohmann::json r = offload->profile_report();
    EXPECT_EQ(r.value("status", ""), "applied") << r.dump(2);
    EXPECT_EQ(r.value("profile_measurement_kind", ""), "sdnq_probe") << r.dump(2);
    EXPECT_TRUE(at::equal(run(model, x), ref));
  }
  EXPECT_EQ(vram_cap_bytes(0), 0);
}

}  // namespace
}  // namespace ddo::adapter
