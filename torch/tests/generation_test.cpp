// GenerationMeter (ddo/torch/generation.h) over a pipeline on the sim device: its stages, the
// bytes it attributes to each component, the memory it saw, and its misuse errors.
#include "ddo/torch/generation.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>

#include "ddo/engine/device.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/testing/flux_dit.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;
using testing::FluxDiT;
using testing::FluxDiTOptions;

struct Pipeline {
  FluxDiTOptions opts = FluxDiTOptions::preset("tiny");
  FluxDiT dit{opts};
  testing::FluxDiTInputs in = testing::make_inputs(opts, c10::kCPU);
  std::shared_ptr<torch::nn::LinearImpl> encoder = std::make_shared<torch::nn::LinearImpl>(64, 64);
  std::shared_ptr<torch::nn::LinearImpl> vae = std::make_shared<torch::nn::LinearImpl>(32, 32);
  at::Tensor ids = at::randn({4, 64});
  at::Tensor latents = at::randn({4, 32});
};

std::unique_ptr<PipelineOffload> offload(Pipeline& p, const TempDir& dir) {
  OffloadOptions o = test::sim_options(dir, {{"sim_device_capacity_gb", 0.25}});
  core::EnvMap env = test::test_env(dir);
  env["DDO_VAE_ROUTE"] = "dynamic";
  env["DDO_TEXT_ENCODER_ROUTE"] = "dynamic";
  o.env = env;
  return enable_pipeline_offload(
      {{"text_encoder", p.encoder}, {"transformer", p.dit.ptr()}, {"vae", p.vae}}, o);
}

const nlohmann::json& stage_named(const nlohmann::json& report, const std::string& name) {
  for (const nlohmann::json& s : report["stages"]) {
    if (s["name"] == name) return s;
  }
  ADD_FAILURE() << "no stage " << name << " in " << report.dump();
  static const nlohmann::json none;
  return none;
}

TEST(GenerationMeter, StagesBytesAndMemoryOfOneGeneration) {
  torch::manual_seed(3);
  Pipeline p;
  TempDir dir;
  auto pipe = offload(p, dir);
  torch::NoGradGuard ng;
  p.encoder->forward(p.ids);  // a call before the meter: its copies are not the generation's
  const char* names[] = {"text_encoder", "transformer", "vae"};
  std::map<std::string, std::int64_t> before;
  for (const char* name : names) before[name] = pipe->component(name)->counters().bytes_streamed;

  constexpr int kSteps = 3;
  GenerationMeter meter(*pipe);
  {
    auto stage = meter.stage("text_encoder");
    p.encoder->forward(p.ids);
  }
  for (int step = 0; step < kSteps; ++step) {
    auto stage = meter.stage("transformer");
    auto again = meter.stage("transformer");  // re-entered: one call
    p.dit->forward(p.in.img, p.in.txt, p.in.timestep);
  }
  {
    auto stage = meter.stage("vae");
    p.vae->forward(p.latents);
  }
  const nlohmann::json r = meter.finish();

  ASSERT_EQ(r["stages"].size(), 3u) << r.dump();
  EXPECT_EQ(r["stages"][0]["name"], "text_encoder");  // in the order they began
  EXPECT_EQ(r["stages"][1]["name"], "transformer");
  EXPECT_EQ(stage_named(r, "text_encoder")["calls"], 1);
  EXPECT_EQ(stage_named(r, "transformer")["calls"], kSteps);
  EXPECT_EQ(stage_named(r, "vae")["calls"], 1);
  double staged = 0;
  for (const nlohmann::json& s : r["stages"]) staged += s["seconds"].get<double>();
  EXPECT_GE(r["seconds"].get<double>() + 1e-9, staged);

  // Bytes per component: what each offload's own counters gained during the generation (the
  // encoder's may be 0: its units can still be in the staging ring from the call before).
  std::int64_t sum = 0;
  for (const char* name : names) {
    const std::int64_t b = r["components"][name]["bytes_streamed"];
    EXPECT_EQ(b, pipe->component(name)->counters().bytes_streamed - before[name]) << name;
    sum += b;
  }
  EXPECT_GT(r["components"]["transformer"]["bytes_streamed"].get<std::int64_t>(), 0);
  EXPECT_GT(r["components"]["vae"]["bytes_streamed"].get<std::int64_t>(), 0);
  EXPECT_EQ(r["bytes_streamed"], sum);
  EXPECT_EQ(r["disk_bytes_read"], 0);  // weights in memory: no disk tier

  EXPECT_EQ(r["device"], "sim:0");
  // The sim device held at least the staging area while the steps ran.
  EXPECT_GT(r["peak_vram_bytes"].get<std::int64_t>(), 0);
  EXPECT_GE(r["peak_rss_bytes"].get<std::int64_t>(), 1);
  EXPECT_GE(r["process_peak_rss_gb"].get<double>(), r["peak_rss_gb"].get<double>() - 1e-9);

  EXPECT_EQ(meter.finish(), r);  // the same report again
  EXPECT_THROW(meter.begin_stage("vae"), ddo::Error);
}

// The staged flow: each stage's offload is attached when the stage begins and removed after it;
// the meter keeps what each streamed.
TEST(GenerationMeter, AStagedFlowKeepsWhatEachReleasedStageStreamed) {
  torch::manual_seed(4);
  Pipeline p;
  TempDir dir;
  torch::NoGradGuard ng;
  GenerationMeter meter({});
  std::int64_t encoder_streamed = 0;
  {
    auto encoder = enable_offload(*p.encoder, test::sim_options(dir));
    meter.add_offload("text_encoder", encoder.get());
    {
      auto stage = meter.stage("text_encoder");
      p.encoder->forward(p.ids);
    }
    encoder_streamed = encoder->counters().bytes_streamed;
    meter.drop_offload("text_encoder");
    encoder->remove();
    EXPECT_EQ(encoder->counters().bytes_streamed, encoder_streamed);  // its totals outlive remove()
  }
  auto dit = enable_offload(*p.dit, test::sim_options(dir));
  meter.add_offload("transformer", dit.get());
  {
    auto stage = meter.stage("transformer");
    p.dit->forward(p.in.img, p.in.txt, p.in.timestep);
  }
  try {
    meter.add_offload("transformer", dit.get());
    FAIL() << "a second offload of a component still read";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("drop_offload('transformer')"), std::string::npos);
  }
  EXPECT_THROW(meter.drop_offload("vae"), ddo::Error);
  const nlohmann::json r = meter.finish();
  EXPECT_GT(encoder_streamed, 0);
  EXPECT_EQ(r["components"]["text_encoder"]["bytes_streamed"], encoder_streamed);
  EXPECT_EQ(r["components"]["transformer"]["bytes_streamed"], dit->counters().bytes_streamed);
  EXPECT_EQ(r["bytes_streamed"].get<std::int64_t>(),
            encoder_streamed + dit->counters().bytes_streamed);
  EXPECT_EQ(r["device"], "sim:0");  // from the first offload added
  EXPECT_GT(r["peak_vram_bytes"].get<std::int64_t>(), 0);
}

TEST(GenerationMeter, MisuseIsAClearErrorAndOpenStagesEndAtFinish) {
  GenerationMeter meter({{"transformer", nullptr}});  // nothing placed: seconds and RSS only
  try {
    meter.end_stage("vae");
    FAIL() << "end_stage without begin_stage";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("begin_stage('vae')"), std::string::npos) << e.what();
  }
  try {
    GenerationMeter on_sim({}, "sim:0");
    FAIL() << "cuda_device names a simulated device";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("name a GPU"), std::string::npos) << e.what();
  }
  if (!engine::cuda_available()) {
    EXPECT_THROW(GenerationMeter({}, "cuda:0"), ddo::Error);  // no GPU: unavailable, said so
  }
  meter.begin_stage("decode");
  const nlohmann::json r = meter.finish();
  EXPECT_EQ(r["stages"][0]["calls"], 1);  // ended by finish()
  EXPECT_TRUE(r["device"].is_null());
  EXPECT_EQ(r["peak_vram_bytes"], -1);
  EXPECT_EQ(r["bytes_streamed"], 0);
  EXPECT_GT(r["peak_rss_bytes"].get<std::int64_t>(), 0);
}

}  // namespace
}  // namespace ddo::adapter
