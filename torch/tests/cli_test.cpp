// The `ddo` program (tools/cli) as a user runs it: its errors name what was wrong and what to do,
// and `ddo demo` takes its preset like every entry point (--preset, else DDO_PRESET, else auto).
// Runs the program the build made (DDO_PROGRAM; the test target depends on it).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "child_process.h"
#include "ddo/core/host_context.h"
#include "ddo/core/profile_store.h"
#include "ddo/engine/device.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {
namespace fs = std::filesystem;

fs::path ddo_program() {
  return fs::path(DDO_PROGRAM);
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
    ASSERT_TRUE(fs::exists(ddo_program())) << "the ddo program is not built at " << ddo_program();
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

// A profile directory that is a file is an error (nonzero exit), never "no profiles in ..." and
// exit status 0.
TEST_F(CliTest, ProfileDirectoryThatIsAFileIsAnError) {
  const fs::path file = dir_.path() / "file";
  std::ofstream(file) << "x";
  const Result r = run_ddo("DDO_PROFILE_DIR='" + file.string() + "'", "profiles list");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("is not a directory"), std::string::npos) << r.output;
}

// Device text is validated, and the message quotes the --device value instead of a parser's
// name such as "stoi".
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

// Without a GPU, --device cuda:0 fails with a message that points to --device sim, not a torch
// backtrace.
TEST_F(CliTest, CudaWithoutAGpuSaysToUseSim) {
  if (engine::cuda_available()) GTEST_SKIP() << "a GPU is present";
  const Result r = run_ddo(profile_env(), "demo --profile t --size tiny --device cuda:0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--device sim"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
}

// The demo takes its preset from DDO_PRESET, and --preset overrides it.
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

TEST_F(CliTest, VersionNamesDdoAndTheTorchItWasBuiltAgainst) {
  const Result r = run_ddo(profile_env(), "--version");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("ddo 0.", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("(torch " TORCH_VERSION ")"), std::string::npos) << r.output;
}

TEST_F(CliTest, DemoStepsOfZeroNamesTheRange) {
  const Result r = run_ddo(profile_env(), "demo --profile t --size tiny --device sim --steps 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 to 100000"), std::string::npos) << r.output;
}

TEST_F(CliTest, DemoHelpShowsTheDefaults) {
  const Result r = run_ddo(profile_env(), "demo --help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(default: small)"), std::string::npos) << r.output;  // --size
  EXPECT_NE(r.output.find("(default: 4)"), std::string::npos) << r.output;      // --steps
}

// A profile is found by its name alone when one class has it, by its key in any of the three
// spellings `list` suggests, and deleting it deletes the demo's run summary beside it.
TEST_F(CliTest, ProfilesByNameAloneByBareKeyAndDeleteTakesTheDemoSummary) {
  Result r = run_ddo(profile_env(),
                     "demo --profile cli-demo --size tiny --device sim --steps 1 "
                     "--calibrate --json",
                     /*with_stderr=*/false);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_ddo(profile_env(), "profiles list");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("KEY"), std::string::npos) << r.output;
  const std::size_t at = r.output.find("ddo-capacity-v1-");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string key = r.output.substr(at, 40);
  const std::string digits = key.substr(16);
  ASSERT_EQ(digits.size(), 24u);

  r = run_ddo(profile_env(), "profiles show cli-demo");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("key:        " + key), std::string::npos) << r.output;
  for (const std::string& spelling : {key, key + ".json", digits}) {
    r = run_ddo(profile_env(), "profiles show --key " + spelling);
    EXPECT_EQ(r.exit_code, 0) << spelling << ": " << r.output;
    EXPECT_NE(r.output.find("name:       cli-demo"), std::string::npos) << r.output;
  }

  const fs::path summary = dir_.path() / (key + ".json.demo-run.json");
  ASSERT_TRUE(fs::exists(summary));
  r = run_ddo(profile_env(), "profiles delete cli-demo");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("run summary"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(summary));
  EXPECT_FALSE(fs::exists(dir_.path() / (key + ".json")));
  r = run_ddo(profile_env(), "profiles show cli-demo");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no profile named 'cli-demo'"), std::string::npos) << r.output;
}

TEST_F(CliTest, ProfilesListMentionsHostContextRecords) {
  core::HostContextStoreOptions options;
  options.directory = dir_.path();
  core::HostContextStore contexts(options);
  ASSERT_TRUE(
      contexts.record_observation({{"model", "flux"}, {"gpu", "4090"}}, {{"status", "success"}})
          .ok());
  const Result r = run_ddo(profile_env(), "profiles list");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("also 1 host-context record"), std::string::npos) << r.output;
  EXPECT_NE(
      r.output.find(contexts.path_for({{"model", "flux"}, {"gpu", "4090"}}).filename().string()),
      std::string::npos)
      << r.output;
}

TEST_F(CliTest, ProfileNamesWithControlCharactersAreListedOnOneEscapedLine) {
  core::ProfileStoreOptions options;
  options.directory = dir_.path();
  core::ProfileStore store(options);
  core::ProfileObservation observation;
  core::ProfileRecommendation rec;
  rec.resident_budget_gb = 1.0;
  rec.profile_measurement_kind = "baseline";
  const core::ProfileIdentity forged{"evil\nfake-row\x1b[2J", "demo::Net"};
  ASSERT_TRUE(store.save(forged, observation, rec).ok());
  const Result r = run_ddo(profile_env(), "profiles list");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find('\x1b'), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("evil\\nfake-row\\x1b[2J"), std::string::npos) << r.output;
  // The directory line, the header and one row: the name adds no row of its own.
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 3) << r.output;
}

}  // namespace
}  // namespace ddo::adapter
