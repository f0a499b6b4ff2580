#include "ddo/core/host_context.h"

#include <unistd.h>  // getpid

#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <set>

#include <gtest/gtest.h>

#include "child_process.h"

namespace ddo::core {
namespace {
namespace fs = std::filesystem;
using ddo::testing::ChildProcess;
using ddo::testing::start_child;
using nlohmann::json;

class HostContextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("ddo-host-context-") + info->name() + "-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  HostContextStore store() {
    HostContextStoreOptions options;
    options.directory = dir_;
    options.warn = [this](const std::string& m) { warnings_.push_back(m); };
    return HostContextStore(std::move(options));
  }

  // diffusers-dynamic-offloader's observation shape: a status and one capacity metric.
  static json obs(double value, bool success, const char* metric = "tokens") {
    return json{{"status", success ? "success" : "failure"},
                {"capacity", {{"metric", metric}, {"value", value}}}};
  }

  fs::path dir_;
  std::vector<std::string> warnings_;
  json exec_ = {{"model", "flux"}, {"gpu", "rtx4090"}, {"steps", 28}, {"size", {1024, 1024}}};
  json capacity_ = {{"model", "flux"}, {"gpu", "rtx4090"}};
};

TEST(NormalizeContextTest, SortsKeysRecursively) {
  json context = json::parse(R"({"b": 1, "a": {"d": [true, null, {"z": 1, "y": 2}], "c": "x"}})");
  EXPECT_EQ(normalize_context(context).dump(),
            R"({"a":{"c":"x","d":[true,null,{"y":2,"z":1}]},"b":1})");
  EXPECT_EQ(context_key(context),
            context_key(json::parse(R"({"a": {"c": "x", "d": [true, null, {"y": 2, "z": 1}]},
                                        "b": 1})")));
  EXPECT_NE(context_key(context), context_key(json::parse(R"({"b": 2})")));
}

TEST(NormalizeContextTest, RejectsNonFiniteNumbersAndBinaryNamingThePath) {
  for (double bad :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity()}) {
    json context = {{"a", {{"list", {1, bad}}}}};
    try {
      (void)normalize_context(context);
      FAIL() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("context.a.list[1]"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW((void)normalize_context(json{{"x", json::binary({1, 2, 3})}}), Error);
  json discarded = json::parse("{oops", nullptr, false);
  EXPECT_THROW((void)normalize_context(discarded), Error);
}

// diffusers-dynamic-offloader refuses anything but a non-empty mapping ("must be a non-empty
// mapping").
TEST(NormalizeContextTest, ContextIsANonEmptyObject) {
  for (const json& bad : {json(nullptr), json("scalar"), json::array({1}), json::object()}) {
    try {
      (void)normalize_context(bad);
      FAIL() << "accepted " << bad.dump();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("non-empty object"), std::string::npos) << e.what();
    }
  }
}

// Keys computed by diffusers-dynamic-offloader (diffusers-dynamic-offloader 0.1.0rc2,
// dynamic_offload_profile_key) for the same contexts: the rule is byte-exact, including Python's
// float spelling (1000000000000000.0 but 1e+16, 1e-05, -0.0) and its \uXXXX escapes.
TEST(ContextKeyTest, EqualsTheSeedLibrarysKeys) {
  struct Case {
    const char* context;
    const char* key;
  };
  const Case cases[] = {
      {R"({"model": "flux", "gpu": "4090", "steps": 28, "nested": {"b": 1, "a": [1.5, null, true]}})",
       "ddo-capacity-v1-25cbb08b13a17dc495247e56"},
      {R"({"name": "w", "model_class": "Tiny", "identity_version": 2,
           "execution_mode": "linear_runtime"})",
       "ddo-capacity-v1-2ed0ac89568814f093f629b0"},
      {R"({"x": "\u00e9\u2603", "y": 1e20, "z": -0.0, "w": 2.0})",
       "ddo-capacity-v1-b6aa302b4a2e2ad352aac5ff"},
      {R"({"x": 1e15})", "ddo-capacity-v1-956f5c22d16816977a4bc776"},
      {R"({"x": 1e16})", "ddo-capacity-v1-21d6bea42b17fd31195fc9fc"},
      {R"({"x": 1e-5})", "ddo-capacity-v1-a2357767c34244592859a4ac"},
      {R"({"x": 1e300})", "ddo-capacity-v1-6cca0514479af7fe3bc421e6"},
      {R"({"x": -0.0})", "ddo-capacity-v1-529436936b90ebdff10ece80"},
      {R"({"x": 1.0})", "ddo-capacity-v1-bf32f56236899e13ef54db87"},
      {R"({"\u00e9": "\u00fc\n\u007f"})", "ddo-capacity-v1-40940499d0af398834904422"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(context_key(json::parse(c.context)), c.key) << c.context;
  }
}

TEST(ContextKeyTest, CanonicalJsonIsPythonsJsonDumps) {
  EXPECT_EQ(canonical_json(json::parse(R"({"b": [1, 2.5, 0.0001, 1e-05, 123456789012345680.0],
                                           "a": "\"\\\t\u0001\ud83d\ude00"})")),
            R"({"a":"\"\\\t\u0001\ud83d\ude00","b":[1,2.5,0.0001,1e-05,1.2345678901234568e+17]})");
  EXPECT_EQ(canonical_json(json(100.0)), "100.0");
  EXPECT_EQ(canonical_json(json(-1.5e-7)), "-1.5e-07");
  EXPECT_EQ(canonical_json(json(std::uint64_t{18446744073709551615u})), "18446744073709551615");
  EXPECT_THROW((void)canonical_json(json(std::string("\xff"))), Error);
}

TEST(ContextKeyTest, SharesTheNamedProfilesKeySpace) {
  const fs::path path = context_path("dir", json{{"name", "video-5s"}});
  const std::string file = path.filename().string();
  EXPECT_TRUE(file.starts_with(std::string(kProfileFilePrefix))) << file;
  EXPECT_EQ(file.size(), kContextFilePrefix.size() + kProfileKeyHexDigits + 5);
  EXPECT_TRUE(is_valid_profile_key(file.substr(0, file.size() - 5)));
}

TEST_F(HostContextTest, RecordKeepsLast20AndPerMetricLimits) {
  HostContextStore s = store();
  for (int i = 0; i < 25; ++i) {
    ASSERT_TRUE(s.record_observation(exec_, obs(i, i < 10)).ok());
  }
  std::optional<ContextRecord> record = s.load(exec_);
  ASSERT_TRUE(record.has_value());
  ASSERT_EQ(record->observations.size(), kMaxContextObservations);
  EXPECT_EQ(record->observations.front()["capacity"]["value"], 5.0);
  EXPECT_EQ(record->observations.back()["capacity"]["value"], 24.0);
  EXPECT_EQ(record->context, normalize_context(exec_));
  EXPECT_FALSE(record->recommendation.has_value());

  CapacityLimits limits = s.read_capacity(exec_);
  EXPECT_EQ(limits.at("tokens").max_success, 9.0);
  EXPECT_EQ(limits.at("tokens").min_failure, 10.0);
  EXPECT_TRUE(warnings_.empty());
}

// The library's rule, as observed: only "success" and "failure" move limits, only with a
// non-empty metric name and a number (a bool counts as 0 or 1).
TEST_F(HostContextTest, OnlyWellFormedObservationsMoveLimits) {
  HostContextStore s = store();
  for (const json& o :
       {json{{"status", "failed"}, {"capacity", {{"metric", "t"}, {"value", 1}}}},
        json{{"status", "SUCCESS"}, {"capacity", {{"metric", "t"}, {"value", 1}}}},
        json{{"status", "success"}, {"capacity", {{"metric", ""}, {"value", 1}}}},
        json{{"status", "success"}, {"capacity", {{"metric", 5}, {"value", 1}}}},
        json{{"status", "success"}, {"capacity", {{"metric", "t"}, {"value", "7"}}}},
        json{{"status", "success"}, {"capacity", json::array({1})}},
        json{{"capacity", {{"metric", "t"}, {"value", 3}}}}, json::object()}) {
    ASSERT_TRUE(s.record_observation(exec_, o).ok()) << o.dump();
  }
  EXPECT_TRUE(s.read_capacity(exec_).empty());
  ASSERT_TRUE(s.record_observation(exec_, obs(true, true, "flag")).ok());
  EXPECT_EQ(s.read_capacity(exec_).at("flag").max_success, 1.0);
  EXPECT_EQ(s.load(exec_)->observations.size(), 9u);
}

TEST_F(HostContextTest, RecommendationIsReplacedOnlyWhenGiven) {
  HostContextStore s = store();
  ASSERT_TRUE(s.record_observation(exec_, obs(1, true), json{{"resident_budget_gb", 4.0}}).ok());
  ASSERT_TRUE(s.record_observation(exec_, obs(2, true)).ok());
  EXPECT_EQ(*s.load(exec_)->recommendation, (json{{"resident_budget_gb", 4.0}}));
  ASSERT_TRUE(s.record_observation(exec_, obs(3, true), json::object()).ok());
  EXPECT_EQ(*s.load(exec_)->recommendation, json::object());
}

TEST_F(HostContextTest, NonJsonObservationsAndBadContextsAreRejected) {
  HostContextStore s = store();
  json nan_observation = {{"peak", std::numeric_limits<double>::quiet_NaN()}};
  EXPECT_EQ(s.record_observation(exec_, nan_observation).code(), Code::kInvalidArgument);
  EXPECT_EQ(s.record_observation(exec_, json::array({1})).code(), Code::kInvalidArgument);
  EXPECT_EQ(s.record_observation(exec_, obs(1, true), json::array({1})).code(),
            Code::kInvalidArgument);
  json bad = {{"x", std::numeric_limits<double>::infinity()}};
  EXPECT_THROW((void)s.record_observation(bad, obs(1, true)), Error);
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_F(HostContextTest, FieldsOfOtherWritersAreKept) {
  HostContextStore s = store();
  ASSERT_TRUE(s.record_observation(exec_, obs(1, true)).ok());
  const fs::path path = s.path_for(exec_);
  json file = json::parse(std::ifstream(path));
  file["written_by"] = "someone else";
  std::ofstream(path, std::ios::trunc) << file.dump();
  ASSERT_TRUE(s.record_observation(exec_, obs(2, true)).ok());
  json again = json::parse(std::ifstream(path));
  EXPECT_EQ(again["written_by"], "someone else");
  EXPECT_EQ(again["observations"].size(), 2u);
  EXPECT_EQ(again["profile_key"], context_key(exec_));
  EXPECT_EQ(again["schema_version"], 1);
}

TEST_F(HostContextTest, CorruptOrForeignFilesAreIgnoredWithAWarning) {
  HostContextStore s = store();
  ASSERT_TRUE(s.record_observation(exec_, obs(3, true)).ok());
  const fs::path path = s.path_for(exec_);
  for (const char* content : {"{", "[]", R"({"schema_version": 99})",
                              R"({"schema_version": 1, "context": {"other": 1},
                                  "profile_key": "0000"})"}) {
    warnings_.clear();
    std::ofstream(path, std::ios::trunc) << content;
    EXPECT_FALSE(s.load(exec_).has_value()) << content;
    EXPECT_EQ(warnings_.size(), 1u) << content;
  }
  // Recording over a bad file starts a fresh record and keeps the old bytes beside it.
  ASSERT_TRUE(s.record_observation(exec_, obs(3, true)).ok());
  EXPECT_TRUE(fs::exists(path.string() + ".invalid"));
  EXPECT_EQ(s.load(exec_)->observations.size(), 1u);
}

TEST_F(HostContextTest, SessionRecordsBothContextsAndTheRecommendationOnce) {
  DynamicOffloadProfileSession session(store(), exec_, capacity_);
  EXPECT_NE(session.execution_key(), session.capacity_key());
  ASSERT_TRUE(session.record_success(obs(6, true), json{{"resident_budget_gb", 3.0}}).ok());
  ASSERT_TRUE(session.record_success(obs(8, false)).ok());

  // A second execution context (other step count) shares the capacity context.
  json exec2 = exec_;
  exec2["steps"] = 50;
  DynamicOffloadProfileSession other(store(), exec2, capacity_);
  ASSERT_TRUE(other.record_success(obs(7, true)).ok());

  std::optional<ContextRecord> history = session.execution_record();
  ASSERT_TRUE(history.has_value());
  EXPECT_EQ(history->observations.size(), 2u);
  EXPECT_EQ(*history->recommendation, (json{{"resident_budget_gb", 3.0}}));
  EXPECT_EQ(other.execution_record()->observations.size(), 1u);
  EXPECT_FALSE(other.execution_record()->recommendation.has_value());

  std::optional<ContextRecord> capacity = session.capacity_record();
  ASSERT_TRUE(capacity.has_value());
  EXPECT_EQ(capacity->observations.size(), 3u);
  EXPECT_FALSE(capacity->recommendation.has_value());
  EXPECT_EQ(capacity->capacity.at("tokens").max_success, 7.0);
  EXPECT_EQ(capacity->capacity.at("tokens").min_failure, 8.0);
  EXPECT_TRUE(fs::exists(session.execution_path()));
  EXPECT_TRUE(fs::exists(session.capacity_path()));
}

TEST_F(HostContextTest, SessionWithOneContextWritesOneFile) {
  DynamicOffloadProfileSession session(store(), exec_, exec_);
  ASSERT_TRUE(session.record_success(obs(6, true)).ok());
  EXPECT_EQ(session.execution_record()->observations.size(), 1u);
}

TEST_F(HostContextTest, SessionRejectsInvalidContexts) {
  json bad = {{"x", std::numeric_limits<double>::quiet_NaN()}};
  try {
    DynamicOffloadProfileSession session(store(), exec_, bad);
    FAIL() << "accepted a NaN capacity context";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("capacity_context.x"), std::string::npos) << e.what();
  }
}

// A child process of the test below (child_process.h): args are the directory, the execution
// and capacity contexts as JSON, and the child's index.
DDO_TEST_CHILD(record_one_success) {
  HostContextStoreOptions options;
  options.directory = args.at(0);
  options.warn = [](const std::string&) {};
  DynamicOffloadProfileSession session(HostContextStore(std::move(options)),
                                       json::parse(args.at(1)), json::parse(args.at(2)));
  const int i = std::stoi(args.at(3));
  json o = {{"status", "success"}, {"capacity", {{"metric", "tokens"}, {"value", i}}}};
  o["peak_vram_gb"] = 100.0 + i;
  return session.record_success(o).ok() ? 0 : 1;
}

TEST_F(HostContextTest, ConcurrentSessionsFromSeveralProcessesKeepEveryRecord) {
  constexpr int kChildren = 8;
  std::vector<ChildProcess> children;
  for (int i = 0; i < kChildren; ++i) {
    children.push_back(start_child(
        "record_one_success", {dir_.string(), exec_.dump(), capacity_.dump(), std::to_string(i)}));
    ASSERT_GT(children.back().pid(), 0);
  }
  for (ChildProcess& child : children) EXPECT_EQ(child.wait(), 0);
  HostContextStore s = store();
  std::optional<ContextRecord> record = s.load(exec_);
  ASSERT_TRUE(record.has_value());
  std::set<double> peaks;
  for (const json& o : record->observations) peaks.insert(o.at("peak_vram_gb").get<double>());
  EXPECT_EQ(peaks.size(), static_cast<std::size_t>(kChildren));
  EXPECT_EQ(s.read_capacity(capacity_).at("tokens").max_success, kChildren - 1.0);
}

TEST_F(HostContextTest, ApplySettingsUsesTheStoredBudgetUnlessAManualOneWins) {
  DynamicOffloadProfileSession session(store(), exec_, exec_);
  SettingsRequest r;
  r.config = DynamicOffloadConfig{};  // a "custom" preset: applying must not re-resolve it
  r.config->max_resident_module_budget_gb = 0.0;  // uncapped
  r.wsl = false;
  const DynamicOffloadSettings base = DynamicOffloadSettings::from_env(r, {});

  // Nothing stored: the settings unchanged, no recommendation.
  DynamicOffloadProfileSession::AppliedSettings none = session.apply_settings(base);
  EXPECT_FALSE(none.recommendation.has_value());
  EXPECT_EQ(none.settings.config.resident_module_budget_gb, 0.0);

  ASSERT_TRUE(session.record_success(obs(1, true), json{{kRecommendedBudgetKey, 6.5}}).ok());
  DynamicOffloadProfileSession::AppliedSettings applied = session.apply_settings(base);
  ASSERT_TRUE(applied.recommendation.has_value());
  EXPECT_EQ(applied.settings.config.resident_module_budget_gb, 6.5);
  EXPECT_EQ(applied.settings.requested_preset, "custom");
  EXPECT_EQ(session.apply_settings(base, false).settings.config.resident_module_budget_gb, 0.0);

  DynamicOffloadSettings capped;
  ASSERT_TRUE(base.with_overrides({{"max_resident_module_budget_gb", 4.0}}, &capped).ok());
  EXPECT_EQ(session.apply_settings(capped).settings.config.resident_module_budget_gb, 4.0);

  DynamicOffloadSettings manual;
  ASSERT_TRUE(base.with_overrides({{"resident_module_budget_gb", 2.0}}, &manual).ok());
  DynamicOffloadProfileSession::AppliedSettings won = session.apply_settings(manual);
  EXPECT_FALSE(won.recommendation.has_value());
  EXPECT_EQ(won.settings.config.resident_module_budget_gb, 2.0);

  // A budget that is not a finite number >= 0 is no budget (the recommendation is still returned).
  for (const json& value : {json(true), json("6"), json(-1.0)}) {
    ASSERT_TRUE(session.record_success(obs(1, true), json{{kRecommendedBudgetKey, value}}).ok());
    DynamicOffloadProfileSession::AppliedSettings odd = session.apply_settings(base);
    EXPECT_TRUE(odd.recommendation.has_value()) << value;
    EXPECT_EQ(odd.settings.config.resident_module_budget_gb, 0.0) << value;
  }
}

}  // namespace
}  // namespace ddo::core
