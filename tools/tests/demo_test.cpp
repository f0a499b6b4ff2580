// `ddo demo` shows what calibration buys: on the host simulation the saved budget keeps
// some blocks resident, so the second run streams less and its copies take less time, and its
// output says so; its profiles stay apart from ~/.ddo/profiles. Runs the built program
// (DDO_PROGRAM, set by tools/CMakeLists.txt) as a user does.
#include <algorithm>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "child_process.h"

namespace {
namespace fs = std::filesystem;
using nlohmann::json;

using Result = ddo::testing::ProgramResult;

// Runs `env -u DDO_PROFILE_DIR <env> ddo <args>`: stdout only (the JSON), or with stderr.
Result run_ddo(const std::string& env, const std::string& args, bool with_stderr = false) {
  return ddo::testing::run_program("env -u DDO_PROFILE_DIR -u DDO_SIM_COPY_GBPS " + env + " '" +
                                   DDO_PROGRAM + "' " + args +
                                   (with_stderr ? " 2>&1" : " 2>/dev/null"));
}

class DemoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    home_ = fs::temp_directory_path() /
            ("ddo-demo-test-" +
             std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(home_);
    fs::create_directories(home_);
  }
  void TearDown() override { fs::remove_all(home_); }
  std::string env() const { return "HOME='" + home_.string() + "'"; }
  fs::path home_;
};

// The demo's second run keeps some blocks resident and streams less than the calibration run, which
// needs a simulated card large enough for the saved budget to hold a block (at 60% of the model it
// holds none: Note [Demo card]); the demo's profiles go to their own folder, not ~/.ddo/profiles.
TEST_F(DemoTest, SecondRunKeepsBlocksResidentStreamsLessAndSaysSo) {
  const std::string args = "demo --profile t --device sim --size small --steps 2";
  Result heading = run_ddo(env(), args + " --calibrate");
  ASSERT_EQ(heading.exit_code, 0) << heading.output;
  EXPECT_EQ(heading.output.rfind("== ddo demo 1/2: calibration", 0), 0u) << heading.output;
  EXPECT_NE(heading.output.find("profile: saved"), std::string::npos) << heading.output;
  Result first = run_ddo(env(), args + " --calibrate --json");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const json calibration = json::parse(first.output);
  ASSERT_EQ(calibration["profile_report"]["status"], "saved") << calibration["profile_report"];
  // Its own folder under the home folder, not ~/.ddo/profiles.
  const fs::path saved = calibration["profile_report"]["path"].get<std::string>();
  EXPECT_EQ(saved.parent_path(), home_ / ".ddo" / "demo-profiles");
  EXPECT_FALSE(fs::exists(home_ / ".ddo" / "profiles"));
  EXPECT_EQ(calibration["summary"]["resident_blocks"], 0);

  Result second = run_ddo(env(), args + " --json");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  const json reuse = json::parse(second.output);
  ASSERT_EQ(reuse["profile_report"]["status"], "applied") << reuse["profile_report"];
  const json& now = reuse["summary"];
  const json& before = reuse["calibration_run"];
  EXPECT_EQ(before, calibration["summary"]);
  EXPECT_GT(now["resident_blocks"].get<int>(), 0) << now;
  EXPECT_LT(now["resident_blocks"].get<int>(), now["blocks"].get<int>()) << now;  // some stream
  EXPECT_LT(now["streamed_gib_per_step"].get<double>(),
            before["streamed_gib_per_step"].get<double>());
  // The link's time follows the bytes (the step time also follows the host's load, so it is
  // reported, not asserted).
  EXPECT_LT(now["copy_seconds_per_step"].get<double>(),
            before["copy_seconds_per_step"].get<double>());

  // The same figures in the JSON the text prints.
  const json& bought = reuse["calibration_bought"];
  EXPECT_EQ(bought["resident_blocks"], now["resident_blocks"]);
  EXPECT_EQ(bought["streamed_gib_per_step"], now["streamed_gib_per_step"]);
  EXPECT_EQ(bought["calibration_streamed_gib_per_step"], before["streamed_gib_per_step"]);

  Result text = run_ddo(env(), args);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  // The story: the heading, then the benefit first; no internals without --verbose.
  EXPECT_EQ(text.output.rfind("== ddo demo 2/2: reuse", 0), 0u) << text.output;
  const std::size_t second_line = text.output.find('\n') + 1;
  EXPECT_EQ(text.output.compare(second_line, 20, "calibration bought: "), 0) << text.output;
  for (const char* internal : {"W1", "Note [", "FluxDiTImpl", "regex", "decision"}) {
    EXPECT_EQ(text.output.find(internal), std::string::npos) << internal << "\n" << text.output;
  }
  EXPECT_LT(std::count(text.output.begin(), text.output.end(), '\n'), 10) << text.output;
  Result verbose = run_ddo(env(), args + " --verbose");
  ASSERT_EQ(verbose.exit_code, 0) << verbose.output;
  EXPECT_NE(verbose.output.find("prefetch hits"), std::string::npos) << verbose.output;
  EXPECT_GT(verbose.output.size(), text.output.size());
  EXPECT_NE(text.output.find("calibration bought: "), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("blocks ("), std::string::npos) << text.output;
  EXPECT_NE(text.output.find("% less"), std::string::npos) << text.output;
  EXPECT_NE(text.output.find((home_ / ".ddo" / "demo-profiles").string()), std::string::npos)
      << text.output;
}

// --quantize: the demo's Linears compute from quantized copies (OffloadOptions::quantize), the
// report says how, and the text says it in one line.
TEST_F(DemoTest, QuantizeComputesTheLinearsFromQuantizedCopies) {
  const std::string args = "demo --profile q --device sim --size tiny --steps 1 --quantize int8";
  Result run = run_ddo(env(), args + " --calibrate --json");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json q = json::parse(run.output)["report"]["quantized_compute"];
  EXPECT_EQ(q["quantize"], "int8") << q;
  EXPECT_GT(q["layers"].size(), 0u) << q;
  EXPECT_EQ(json::parse(run.output)["report"]["execution_mode"], "sdnq_runtime");
  Result text = run_ddo(env(), args);
  ASSERT_EQ(text.exit_code, 0) << text.output;
  EXPECT_NE(text.output.find("compute: int8: "), std::string::npos) << text.output;
  Result bad = run_ddo(env(), "demo --profile q --device sim --quantize int4", true);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("int4"), std::string::npos) << bad.output;
}

// A profile name is printed escaped: a newline or an ESC in it never reaches the terminal.
TEST_F(DemoTest, TheBannerEscapesTheProfileName) {
  Result run = run_ddo(env(),
                       "demo --profile \"$(printf 'a\\nb\\033[31m')\" --device sim --size tiny "
                       "--steps 1 --calibrate");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("calibration of profile 'a\\nb\\x1b[31m'"), std::string::npos)
      << run.output;
  EXPECT_EQ(run.output.find('\x1b'), std::string::npos) << run.output;
}

}  // namespace
