#include "ddo/core/host_context.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <set>

#include <gtest/gtest.h>

namespace ddo::core {
namespace {
namespace fs = std::filesystem;
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

  // Only resident_budget_gb unless a peak is given: a constant peak recorded for both a success
  // and a failure would itself be a conflicting limit.
  static ContextObservation obs(double budget, bool success, std::optional<double> peak = {}) {
    ContextObservation o;
    o.metrics = {{"resident_budget_gb", budget}};
    if (peak) o.metrics["peak_vram_gb"] = *peak;
    o.success = success;
    return o;
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
  EXPECT_THROW((void)normalize_context(json::binary({1, 2, 3})), Error);
  json discarded = json::parse("{oops", nullptr, false);
  EXPECT_THROW((void)normalize_context(discarded), Error);
  EXPECT_NO_THROW((void)normalize_context(json(nullptr)));
  EXPECT_NO_THROW((void)normalize_context(json("scalar")));
}

TEST(ContextKeyTest, KeySpaceIsSeparateFromNamedProfiles) {
  const fs::path path = context_path("dir", json{{"name", "video-5s"}});
  EXPECT_TRUE(path.filename().string().starts_with("ddo-context-"));
  EXPECT_FALSE(path.filename().string().starts_with(std::string(kProfileFilePrefix)));
  EXPECT_EQ(path.filename().string().size(), std::string("ddo-context-.json").size() + 32);
}

TEST_F(HostContextTest, RecordKeepsLast20AndPerMetricLimits) {
  HostContextStore s = store();
  for (int i = 0; i < 25; ++i) {
    ASSERT_TRUE(s.record_observation(exec_, obs(i, i < 10)).ok());
  }
  std::optional<ContextRecord> record = s.load(exec_);
  ASSERT_TRUE(record.has_value());
  ASSERT_EQ(record->observations.size(), kMaxContextObservations);
  EXPECT_DOUBLE_EQ(record->observations.front().metrics.at("resident_budget_gb"), 5.0);
  EXPECT_DOUBLE_EQ(record->observations.back().metrics.at("resident_budget_gb"), 24.0);
  EXPECT_EQ(record->context, normalize_context(exec_));

  CapacityLimits limits = s.read_capacity(exec_);
  EXPECT_EQ(limits.at("resident_budget_gb").max_success, 9.0);
  EXPECT_EQ(limits.at("resident_budget_gb").min_failure, 10.0);
  ContextRecommendation rec = s.read_recommendation(exec_);
  EXPECT_EQ(rec.values.at("resident_budget_gb"), 9.0);
  EXPECT_TRUE(rec.conflicting.empty());
  EXPECT_TRUE(warnings_.empty());
}

TEST_F(HostContextTest, ConflictingLimitsAreNotRecommended) {
  HostContextStore s = store();
  ASSERT_TRUE(s.record_observation(exec_, obs(4, false)).ok());
  ASSERT_TRUE(s.record_observation(exec_, obs(5, true)).ok());
  ContextRecommendation rec = s.read_recommendation(exec_);
  EXPECT_EQ(rec.values.count("resident_budget_gb"), 0u);
  EXPECT_EQ(rec.conflicting, std::vector<std::string>{"resident_budget_gb"});
}

TEST_F(HostContextTest, NonFiniteMetricsAndBadContextsAreRejected) {
  HostContextStore s = store();
  ContextObservation o = obs(1, true, 5.0);
  o.metrics["peak_vram_gb"] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(s.record_observation(exec_, o).code(), Code::kInvalidArgument);
  json bad = {{"x", std::numeric_limits<double>::infinity()}};
  EXPECT_THROW((void)s.record_observation(bad, obs(1, true)), Error);
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_F(HostContextTest, CorruptOrForeignFilesAreIgnoredWithAWarning) {
  HostContextStore s = store();
  ASSERT_TRUE(s.record_observation(exec_, obs(3, true)).ok());
  const fs::path path = s.path_for(exec_);
  for (const char* content : {"{", "[]", R"({"schema_version": 99})",
                              R"({"schema_version": 1, "context": {"other": 1},
                                  "context_key": "0000"})"}) {
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

TEST_F(HostContextTest, SessionSplitsHistoryAndCapacity) {
  DynamicOffloadProfileSession session(store(), exec_, capacity_);
  EXPECT_NE(session.execution_key(), session.capacity_key());
  ASSERT_TRUE(session.record(obs(6, true)).ok());
  ASSERT_TRUE(session.record(obs(8, false)).ok());

  // A second execution context (other step count) shares the capacity context.
  json exec2 = exec_;
  exec2["steps"] = 50;
  DynamicOffloadProfileSession other(store(), exec2, capacity_);
  ASSERT_TRUE(other.record(obs(7, true)).ok());

  std::optional<ContextRecord> history = session.execution_record();
  ASSERT_TRUE(history.has_value());
  EXPECT_EQ(history->observations.size(), 2u);
  EXPECT_EQ(other.execution_record()->observations.size(), 1u);

  HostContextStore s = store();
  std::optional<ContextRecord> capacity_record = s.load(capacity_);
  ASSERT_TRUE(capacity_record.has_value());
  EXPECT_TRUE(capacity_record->observations.empty());
  EXPECT_EQ(session.capacity().at("resident_budget_gb").max_success, 7.0);
  EXPECT_EQ(session.capacity().at("resident_budget_gb").min_failure, 8.0);
  EXPECT_EQ(session.recommendation().values.at("resident_budget_gb"), 7.0);
  EXPECT_EQ(other.recommendation().values.at("resident_budget_gb"), 7.0);
  EXPECT_TRUE(fs::exists(session.execution_path()));
  EXPECT_TRUE(fs::exists(session.capacity_path()));
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

TEST_F(HostContextTest, ConcurrentSessionsFromSeveralProcessesKeepEveryRecord) {
  constexpr int kChildren = 8;
  std::vector<pid_t> children;
  for (int i = 0; i < kChildren; ++i) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      HostContextStoreOptions options;
      options.directory = dir_;
      options.warn = [](const std::string&) {};
      DynamicOffloadProfileSession session(HostContextStore(std::move(options)), exec_, capacity_);
      ::_exit(session.record(obs(i, true, 100.0 + i)).ok() ? 0 : 1);
    }
    children.push_back(child);
  }
  for (pid_t child : children) {
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  }
  HostContextStore s = store();
  std::optional<ContextRecord> record = s.load(exec_);
  ASSERT_TRUE(record.has_value());
  std::set<double> peaks;
  for (const ContextObservation& o : record->observations)
    peaks.insert(o.metrics.at("peak_vram_gb"));
  EXPECT_EQ(peaks.size(), static_cast<std::size_t>(kChildren));
  EXPECT_EQ(s.read_capacity(capacity_).at("resident_budget_gb").max_success, kChildren - 1.0);
}

}  // namespace
}  // namespace ddo::core
