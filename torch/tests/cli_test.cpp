// The `ddo` program (tools/cli) as a user runs it: its errors name what was wrong and what to do,
// and `ddo demo` takes its preset like every entry point (--preset, else DDO_PRESET, else auto).
// Runs the program built beside this test (<build>/tools/ddo); skips, saying so, without it.
#include <unistd.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "child_process.h"
#include "ddo/engine/device.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {
namespace fs = std::filesystem;

// <build>/torch/ddo_torch_tests -> <build>/tools/ddo.
fs::path ddo_program() {
  std::array<char, 4096> self{};
  const ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (n <= 0) return {};
  return fs::path(std::string(self.data(), static_cast<std::size_t>(n)))
             .parent_path()
             .parent_path() /
         "tools" / "ddo";
}

using Result = ddo::testing::ProgramResult;

// Runs `ddo <args>` with `env` (NAME=value words) added; stdout, and stderr when `with_stderr`.
Result run_ddo(const std::string& env, const std::string& args, bool with_stderr = true) {
  return ddo::testing::run_program("env " + env + " '" + ddo_program().string() + "' " + args +
                                   (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(ddo_program())) {
      GTEST_SKIP() << "the ddo program is not built at " << ddo_program();
    }
  }
  std::string profile_env() const { return "DDO_PROFILE_DIR='" + dir_.path().string() + "'"; }
  test::TempDir dir_;
};

TEST_F(CliTest, UnknownCommandIsNamedWithTheChoices) {
  Result r = run_ddo(profile_env(), "profiles lst");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("unknown command 'lst'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("list, show, path, delete"), std::string::npos) << r.output;
  r = run_ddo(profile_env(), "frobnicate");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("'frobnicate'"), std::string::npos) << r.output;
}

// Before: "no profiles in ..." and exit status 0.
TEST_F(CliTest, ProfileDirectoryThatIsAFileIsAnError) {
  const fs::path file = dir_.path() / "file";
  std::ofstream(file) << "x";
  const Result r = run_ddo("DDO_PROFILE_DIR='" + file.string() + "'", "profiles list");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("is not a directory"), std::string::npos) << r.output;
}

// Before: `--device sim:99999999999` said "stoi".
TEST_F(CliTest, DeviceTextIsValidatedWithAClearMessage) {
  for (const char* device : {"sim:99999999999", "sim:-1", "sim:", "sim:1x", "gpu:0"}) {
    const Result r =
        run_ddo(profile_env(), std::string("demo --profile t --size tiny --device ") + device);
    EXPECT_NE(r.exit_code, 0) << device;
    EXPECT_NE(r.output.find(std::string("--device '") + device + "'"), std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("stoi"), std::string::npos) << r.output;
  }
}

// Before: a torch backtrace that did not mention the simulation.
TEST_F(CliTest, CudaWithoutAGpuSaysToUseSim) {
  if (engine::cuda_available()) GTEST_SKIP() << "a GPU is present";
  const Result r = run_ddo(profile_env(), "demo --profile t --size tiny --device cuda:0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--device sim"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
}

// Before: the demo always ran the auto preset.
TEST_F(CliTest, DemoTakesItsPresetFromDdoPresetUnlessOneIsPassed) {
  const std::string args = "demo --profile t --size tiny --device sim --steps 1 --json";
  Result r = run_ddo(profile_env() + " DDO_PRESET=low_ram_safe", args, /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json out = nlohmann::json::parse(r.output);
  EXPECT_EQ(out["report"]["preset"], "low_ram_safe") << out["report"].dump(2);
  r = run_ddo(profile_env() + " DDO_PRESET=low_ram_safe", args + " --preset warm_process",
              /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  out = nlohmann::json::parse(r.output);
  EXPECT_EQ(out["report"]["preset"], "warm_process") << out["report"].dump(2);
}

}  // namespace
}  // namespace ddo::adapter
