// remove() inside a profile_run() region: a calibration region that sees the model
// restored must save nothing and say why (Note [remove() inside a measured region] in
// torch/src/profile_run.cpp); a region that does not measure is unaffected.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>

#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/torch/enable_offload.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

struct Model {
  torch::nn::Sequential net{torch::nn::Linear(64, 64), torch::nn::Linear(64, 64)};
  at::Tensor input = at::randn({4, 64});
  void run() {
    torch::NoGradGuard no_grad;
    (void)net->forward(input);
  }
};

OffloadOptions options(const TempDir& dir, bool calibrate) {
  OffloadOptions o = test::sim_options(
      dir, {{"sim_device_capacity_gb", 0.25}, {"profile_vram_headroom_gb", 0.01}});
  o.profile_name = "remove-inside";
  o.build_profile = calibrate;
  return o;
}

// remove() inside a calibration region fails the region: the saved recommendation is never
// replaced by one measured on a half-removed model.
TEST(ProfileRunRemove, RemoveInsideACalibrationRegionSavesNothingAndSaysWhy) {
  torch::manual_seed(3);
  Model model;
  TempDir dir;
  std::string path;
  {
    auto offload = enable_offload(*model.net, options(dir, true));
    nlohmann::json report = offload->profile_run([&] { model.run(); });
    ASSERT_EQ(report["status"], "saved") << report.dump(2);
    path = report["path"].get<std::string>();
  }
  const std::string good = read_file(path);
  ASSERT_FALSE(good.empty());

  {  // RAII form: finish() after remove().
    auto offload = enable_offload(*model.net, options(dir, true));
    ProfileRun run = offload->profile_run();
    model.run();
    offload->remove();
    model.run();  // the restored model still runs
    try {
      run.finish();
      FAIL() << "a region that saw remove() ended normally";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kFailedPrecondition);
      EXPECT_NE(std::string(e.what()).find("removed (remove()) inside the profile_run()"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("nothing was saved"), std::string::npos) << e.what();
    }
    EXPECT_EQ(offload->profile_report()["status"], "failed");
    EXPECT_EQ(read_file(path), good);
  }
  {  // Callable form.
    auto offload = enable_offload(*model.net, options(dir, true));
    EXPECT_THROW(offload->profile_run([&] {
      model.run();
      offload->remove();
    }),
                 Error);
    EXPECT_EQ(read_file(path), good);
  }
  {  // A normal run's region measures nothing: remove() inside it is harmless.
    auto offload = enable_offload(*model.net, options(dir, false));
    ASSERT_EQ(offload->profile_report()["status"], "applied");
    nlohmann::json report = offload->profile_run([&] {
      model.run();
      offload->remove();
    });
    EXPECT_EQ(report["status"], "applied");
    EXPECT_EQ(read_file(path), good);
  }
}

}  // namespace
}  // namespace ddo::adapter
