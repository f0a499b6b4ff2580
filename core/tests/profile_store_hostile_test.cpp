// Hostile and damaged files in the profile directory: nesting deep enough to overflow
// the stack, oversized files, FIFOs and directories where files belong, numbers out of range or
// too large for 32 bits, backups of unreadable files, temporary files of killed writers, and a
// profile directory that is a file or cannot be written. Each case ends in an error or a warning
// that names the file, never in a crash, a hang, a silent acceptance or a loss of data.
#include <sys/stat.h>  // mkfifo (POSIX)
#include <unistd.h>    // getpid, geteuid (MinGW-w64 has getpid only)

#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "child_process.h"
#include "ddo/core/host_context.h"
#include "ddo/core/profile_store.h"

namespace ddo::core {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const fs::path& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
}

std::string nested_arrays(int depth) {
  return std::string(static_cast<std::size_t>(depth), '[') +
         std::string(static_cast<std::size_t>(depth), ']');
}

class HostileFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("ddo-hostile-") + info->name() + "-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir_, ec);
  }

  ProfileStore store(fs::path dir = {}) {
    ProfileStoreOptions options;
    options.directory = dir.empty() ? dir_ : dir;
    options.warn = [this](const std::string& message) { warnings_.push_back(message); };
    return ProfileStore(std::move(options));
  }

  static ProfileObservation observation() {
    ProfileObservation o;
    o.profile_measurement_kind = "baseline";
    o.peak_vram_gb = 6.0;
    o.total_vram_gb = 8.0;
    o.headroom_gb = 1.0;
    return o;
  }
  static ProfileRecommendation recommendation(double budget_gb = 1.0) {
    ProfileRecommendation r;
    r.resident_budget_gb = budget_gb;
    r.profile_measurement_kind = "baseline";
    r.peak_vram_gb = 6.0;
    r.total_vram_gb = 8.0;
    r.headroom_gb = 1.0;
    return r;
  }

  // A valid saved profile, as JSON, to damage.
  json saved_profile() {
    ProfileStore s = store();
    EXPECT_TRUE(s.save(id_, observation(), recommendation()).ok());
    return json::parse(read_all(s.path_for(id_)));
  }

  // Writes `profile` with its first observation's measurement replaced by `raw` JSON text.
  void write_with_measurement(json profile, const std::string& raw) {
    profile["observations"][0]["measurement"] = "@RAW@";
    std::string text = profile.dump();
    text.replace(text.find("\"@RAW@\""), 7, raw);
    write_all(store().path_for(id_), text);
  }

  bool warned(const std::string& part) const {
    for (const std::string& w : warnings_) {
      if (w.find(part) != std::string::npos) return true;
    }
    return false;
  }

  fs::path dir_;
  std::vector<std::string> warnings_;
  ProfileIdentity id_{"video-5s", "demo::Transformer"};
};

// --- nesting and size ------------------------------------------------------------------------

TEST(JsonBoundsTest, DepthScanSkipsStringsAndIsExactForValidJson) {
  EXPECT_EQ(json_nesting_depth("1"), 0);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": []}]})"), 4);
  EXPECT_EQ(json_nesting_depth(R"({"a": "[[[[{{{{", "b": "\"[["})"), 1);
  EXPECT_EQ(json_nesting_depth(nested_arrays(200000)), 200000);
  json value;
  EXPECT_TRUE(parse_json_bounded(nested_arrays(kMaxJsonDepth), &value).ok());
  const Status deep = parse_json_bounded(nested_arrays(kMaxJsonDepth + 1), &value);
  EXPECT_EQ(deep.code(), Code::kDataLoss);
  EXPECT_NE(deep.message().find("nested 65 levels deep"), std::string::npos) << deep.message();
}

// A profile nested 200,000 deep is listed as invalid and never overflows the stack: the process,
// `ddo profiles list` included, survives and names the file so the user can find it.
TEST_F(HostileFilesTest, ProfileNested200000DeepIsListedAsInvalidAndNeverCrashes) {
  const json profile = saved_profile();
  write_with_measurement(profile, nested_arrays(200000));
  ProfileStore s = store();
  const std::vector<ProfileListing> rows = s.list();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_NE(rows[0].problem.find("levels deep, more than the 64 levels"), std::string::npos)
      << rows[0].problem;
  EXPECT_EQ(rows[0].path, s.path_for(id_));
  EXPECT_FALSE(s.load(id_).has_value());
  EXPECT_TRUE(warned("levels deep, more than the 64 levels"))
      << ::testing::PrintToString(warnings_);
  // Objects nest the same way.
  std::string objects;
  for (int i = 0; i < 100000; ++i) objects += R"({"a":)";
  objects += "1" + std::string(100000, '}');
  write_with_measurement(profile, objects);
  ASSERT_EQ(s.list().size(), 1u);
  EXPECT_FALSE(s.list()[0].problem.empty());
}

// A 21 KB profile nested 10,000 deep is set aside, not accepted and rewritten with two spaces of
// indentation per level (200 MB): the saved file stays under 64 KB.
TEST_F(HostileFilesTest, DeeplyNestedProfileIsNotRewrittenAsAHugeFile) {
  write_with_measurement(saved_profile(), nested_arrays(10000));
  const std::string original = read_all(store().path_for(id_));
  ASSERT_LT(original.size(), 25u * 1024);
  ProfileStore s = store();
  ASSERT_TRUE(s.save(id_, observation(), recommendation(2.0)).ok());
  EXPECT_LT(fs::file_size(s.path_for(id_)), 64u * 1024);
  ASSERT_TRUE(s.load(id_).has_value());
  EXPECT_EQ(s.load(id_)->observations.size(), 1u);  // a fresh record
  EXPECT_EQ(read_all(dir_ / (s.path_for(id_).filename().string() + ".invalid")), original);
}

TEST_F(HostileFilesTest, OversizedFileIsInvalidAndKeptAsideOnSave) {
  ProfileStore s = store();
  const fs::path path = s.path_for(id_);
  const std::string big(kMaxProfileFileBytes + 1, ' ');
  write_all(path, big);
  ASSERT_EQ(s.list().size(), 1u);
  EXPECT_NE(s.list()[0].problem.find("more than the"), std::string::npos) << s.list()[0].problem;
  EXPECT_FALSE(s.load(id_).has_value());
  ASSERT_TRUE(s.save(id_, observation(), recommendation()).ok());
  EXPECT_TRUE(s.load(id_).has_value());
  EXPECT_EQ(fs::file_size(path.string() + ".invalid"), big.size());
  EXPECT_TRUE(warned("is kept in")) << ::testing::PrintToString(warnings_);
}

// A FIFO under a profile's name is named as such; list, load and save never block on it.
// Windows has no FIFOs in the file system (scripts/windows-test.sh lists the exclusion).
#ifndef _WIN32
TEST_F(HostileFilesTest, FifoInPlaceOfAProfileIsNamedAndNeverBlocks) {
  ProfileStore s = store();
  const fs::path path = s.path_for(id_);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  ASSERT_EQ(s.list().size(), 1u);
  EXPECT_NE(s.list()[0].problem.find("is a FIFO"), std::string::npos) << s.list()[0].problem;
  EXPECT_FALSE(s.load(id_).has_value());
  const Status saved = s.save(id_, observation(), recommendation());
  EXPECT_EQ(saved.code(), Code::kFailedPrecondition) << saved.to_string();
  EXPECT_NE(saved.message().find("is a FIFO"), std::string::npos) << saved.message();
}
#endif

TEST_F(HostileFilesTest, DirectoryInPlaceOfAProfileIsNamed) {
  ProfileStore s = store();
  const fs::path path = s.path_for(id_);
  fs::create_directory(path);
  ASSERT_EQ(s.list().size(), 1u);
  EXPECT_NE(s.list()[0].problem.find("is a directory"), std::string::npos) << s.list()[0].problem;
  EXPECT_FALSE(s.load(id_).has_value());
  EXPECT_TRUE(warned("is a directory")) << ::testing::PrintToString(warnings_);
  const Status saved = s.save(id_, observation(), recommendation());
  EXPECT_EQ(saved.code(), Code::kFailedPrecondition) << saved.to_string();
  EXPECT_NE(saved.message().find("is a directory"), std::string::npos) << saved.message();
  const Status writable = s.check_writable(id_);
  EXPECT_EQ(writable.code(), Code::kFailedPrecondition) << writable.to_string();
  EXPECT_NE(writable.message().find("is a directory"), std::string::npos) << writable.message();
  EXPECT_TRUE(fs::is_directory(path));
}

// --- numbers ---------------------------------------------------------------------------------

// A schema_version too large for 32 bits is rejected, never truncated: 4294967297 read as a
// 32-bit int would be 1, the current version.
TEST_F(HostileFilesTest, VersionsTooLargeFor32BitsAreRejected) {
  json profile = saved_profile();
  ProfileStore s = store();
  for (const char* version : {"4294967297", "18446744073709551617", "-4294967295", "1.0"}) {
    json damaged = profile;
    damaged["schema_version"] = "@V@";
    std::string text = damaged.dump();
    text.replace(text.find("\"@V@\""), 5, version);
    write_all(s.path_for(id_), text);
    ASSERT_EQ(s.list().size(), 1u) << version;
    EXPECT_NE(s.list()[0].problem.find("schema_version"), std::string::npos)
        << version << ": " << s.list()[0].problem;
    EXPECT_FALSE(s.load(id_).has_value()) << version;
  }
  json damaged = profile;
  damaged["context"]["identity_version"] = 4294967297ULL;
  write_all(s.path_for(id_), damaged.dump());
  EXPECT_NE(s.list()[0].problem.find("context.identity_version is 4294967297"), std::string::npos)
      << s.list()[0].problem;
}

// Every number is range-checked when read, and the error names the field and its range:
// resident_budget_gb 1e308, negative peaks, strings in number fields and huge capacity limits.
TEST_F(HostileFilesTest, EveryNumberIsRangeCheckedAndTheErrorNamesFieldAndRange) {
  const json profile = saved_profile();
  ProfileStore s = store();
  struct Case {
    const char* pointer;
    json value;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"/recommendation/profile_resident_module_budget_gb", 1e308,
       "recommendation.profile_resident_module_budget_gb is 1e+308"},
      {"/recommendation/profile_resident_module_budget_gb", -1.0,
       "recommendation.profile_resident_module_budget_gb is -1.0"},
      {"/recommendation/peak_vram_gb", 2e6, "recommendation.peak_vram_gb"},
      {"/recommendation/total_vram_gb", "8", "recommendation.total_vram_gb is string"},
      {"/recommendation/headroom_gb", -0.5, "recommendation.headroom_gb"},
      {"/recommendation/safe_budget_gb", 1e300, "recommendation.safe_budget_gb"},
      {"/recommendation/probe_budget_gb", -3, "recommendation.probe_budget_gb"},
      {"/recommendation/candidate_compute_ms", json{{"block.0", 1e12}},
       "recommendation.candidate_compute_ms[\"block.0\"]"},
      {"/observations/0/peak_vram_gb", 1e308, "observations[0].peak_vram_gb"},
      {"/observations/0/resident_budget_gb", -2, "observations[0].resident_budget_gb"},
      {"/observations/0/recommended_budget_gb", true, "observations[0].recommended_budget_gb"},
      {"/capacity_limits/resident_budget_gb/max_success", 1e300,
       "capacity_limits.resident_budget_gb.max_success"},
  };
  for (const Case& c : cases) {
    json damaged = profile;
    damaged[json::json_pointer(c.pointer)] = c.value;
    write_all(s.path_for(id_), damaged.dump());
    const std::vector<ProfileListing> rows = s.list();
    ASSERT_EQ(rows.size(), 1u);
    EXPECT_NE(rows[0].problem.find(c.field), std::string::npos)
        << c.pointer << ": " << rows[0].problem;
    EXPECT_FALSE(rows[0].resident_budget_gb.has_value()) << c.pointer;
    if (c.value.is_number()) {
      EXPECT_NE(rows[0].problem.find("outside 0 to "), std::string::npos) << rows[0].problem;
    }
    warnings_.clear();
    EXPECT_FALSE(s.load(id_).has_value()) << c.pointer;
    ASSERT_EQ(warnings_.size(), 1u);
    EXPECT_NE(warnings_[0].find(s.path_for(id_).string()), std::string::npos) << warnings_[0];
    EXPECT_NE(warnings_[0].find(c.field), std::string::npos) << warnings_[0];
  }
}

// --- backups and temporary files -------------------------------------------------------------

// Every backup of an unreadable profile is kept under its own name (.invalid, .invalid-2, ...), as
// the warning says: a later backup never overwrites an earlier one.
TEST_F(HostileFilesTest, EveryBackupOfAnUnreadableProfileIsKept) {
  ProfileStore s = store();
  const fs::path path = s.path_for(id_);
  std::vector<std::string> damaged = {"{truncated", "not json at all", "[1, 2"};
  for (const std::string& content : damaged) {
    write_all(path, content);
    ASSERT_TRUE(s.save(id_, observation(), recommendation()).ok());
  }
  const std::vector<fs::path> backups = {path.string() + ".invalid", path.string() + ".invalid-2",
                                         path.string() + ".invalid-3"};
  for (std::size_t i = 0; i < damaged.size(); ++i) {
    EXPECT_EQ(read_all(backups[i]), damaged[i]) << backups[i];
    EXPECT_TRUE(warned("is kept in '" + backups[i].string() + "'"))
        << ::testing::PrintToString(warnings_);
  }
  EXPECT_TRUE(s.load(id_).has_value());
  EXPECT_EQ(s.list().size(), 1u);  // backups are not listed as profiles
}

// A save removes old temporary files of dead writers; those of live writers, recent ones and
// files not ddo's are left alone.
TEST_F(HostileFilesTest, StaleTemporaryFilesOfDeadWritersAreRemovedOnTheNextSave) {
  ProfileStore s = store();
  const std::string target = s.path_for(id_).filename().string();
  const auto old_time = fs::file_time_type::clock::now() - std::chrono::minutes(5);
  auto temp = [&](long pid, int n, bool old) {
    const fs::path p =
        dir_ / ("." + target + ".tmp-" + std::to_string(pid) + "-" + std::to_string(n));
    write_all(p, "partial");
    if (old) fs::last_write_time(p, old_time);
    return p;
  };
  const long dead = ddo::testing::exited_process_id();
  ASSERT_GT(dead, 0);
  const fs::path stale = temp(dead, 0, true);
  const fs::path stale_context =
      dir_ / (".ddo-context-" + std::string(32, 'a') + ".json.tmp-" + std::to_string(dead) + "-3");
  write_all(stale_context, "partial");
  fs::last_write_time(stale_context, old_time);
  const fs::path live = temp(::getpid(), 7, true);  // a live owner: never touched
  const fs::path fresh = temp(dead, 1, false);      // too recent to be sure
  const fs::path foreign = dir_ / (".notes.tmp-" + std::to_string(dead) + "-0");  // not ddo's
  write_all(foreign, "x");
  fs::last_write_time(foreign, old_time);

  ASSERT_TRUE(s.save(id_, observation(), recommendation()).ok());
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(stale_context));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(fresh));
  EXPECT_TRUE(fs::exists(foreign));
}

// --- directories -----------------------------------------------------------------------------

// A DDO_PROFILE_DIR that names a regular file is an error when listing, never "no profiles" and
// exit status 0.
TEST_F(HostileFilesTest, ProfileDirectoryThatIsAFileIsAnErrorWhenListing) {
  const fs::path file = dir_ / "not-a-dir";
  write_all(file, "x");
  try {
    (void)store(file).list();
    FAIL() << "listing a regular file as the profile directory";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("is not a directory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("DDO_PROFILE_DIR"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(store(dir_ / "missing").list().empty());  // nothing saved yet is not an error
}

TEST_F(HostileFilesTest, CheckWritableFailsBeforeARunWhenTheDirectoryCannotBeWritten) {
  EXPECT_TRUE(store().check_writable(id_).ok());
  EXPECT_TRUE(store(dir_ / "new" / "sub").check_writable(id_).ok());  // created on demand
  EXPECT_TRUE(fs::is_directory(dir_ / "new" / "sub"));
  EXPECT_TRUE(fs::is_empty(dir_ / "new" / "sub"));  // the probe file is gone
  const fs::path file = dir_ / "file";
  write_all(file, "x");
  const Status under_file = store(file / "profiles").check_writable(id_);
  EXPECT_EQ(under_file.code(), Code::kUnavailable) << under_file.to_string();
  EXPECT_NE(under_file.message().find("DDO_PROFILE_DIR"), std::string::npos);
  // Not on Windows, where a directory's read-only attribute does not stop creating files in it.
#ifndef _WIN32
  if (::geteuid() != 0) {
    fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec);
    const Status read_only = store().check_writable(id_);
    EXPECT_EQ(read_only.code(), Code::kUnavailable) << read_only.to_string();
    EXPECT_NE(read_only.message().find(dir_.string()), std::string::npos);
  }
#endif
}

// --- host contexts -----------------------------------------------------------------------------

class HostileContextTest : public HostileFilesTest {
 protected:
  HostContextStore contexts() {
    HostContextStoreOptions options;
    options.directory = dir_;
    options.warn = [this](const std::string& message) { warnings_.push_back(message); };
    return HostContextStore(std::move(options));
  }
  const json context_{{"model", "flux"}, {"gpu", "4090"}};
};

// A caller's context nested deeper than 64 levels is rejected, naming the bound, before it can
// overflow the stack while being normalized.
TEST_F(HostileContextTest, DeepOrHugeContextsAreRejectedNamingTheBound) {
  const json deep = {{"x", json::parse(nested_arrays(2000))}};
  try {
    (void)normalize_context(deep);
    FAIL() << "a context 2000 deep";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("nested more than 64 levels"), std::string::npos)
        << e.what();
  }
  // The context object is the first level.
  EXPECT_NO_THROW(
      (void)normalize_context(json{{"x", json::parse(nested_arrays(kMaxJsonDepth - 1))}}));
  const json huge{{"prompt", std::string(kMaxContextBytes, 'x')}};
  EXPECT_THROW((void)normalize_context(huge), Error);
  json o = {{"status", "success"}, {"details", json::parse(nested_arrays(2000))}};
  EXPECT_EQ(contexts().record_observation(context_, o).code(), Code::kInvalidArgument);
}

TEST_F(HostileContextTest, DamagedContextFilesAreIgnoredNamingTheFieldAndNeverCrash) {
  HostContextStore store = contexts();
  json o = {{"status", "success"},
            {"capacity", {{"metric", "resident_budget_gb"}, {"value", 4.0}}}};
  ASSERT_TRUE(store.record_observation(context_, o).ok());
  const fs::path path = store.path_for(context_);
  const json saved = json::parse(read_all(path));

  json damaged = saved;
  damaged["context"] = "@RAW@";
  std::string text = damaged.dump();
  text.replace(text.find("\"@RAW@\""), 7, nested_arrays(200000));
  write_all(path, text);
  EXPECT_FALSE(store.load(context_).has_value());
  EXPECT_TRUE(warned("levels deep, more than the 64 levels"))
      << ::testing::PrintToString(warnings_);

  damaged = saved;
  damaged["schema_version"] = 4294967297ULL;
  write_all(path, damaged.dump());
  warnings_.clear();
  EXPECT_FALSE(store.load(context_).has_value());
  EXPECT_TRUE(warned("schema_version is 4294967297")) << ::testing::PrintToString(warnings_);

  damaged = saved;
  damaged["capacity_limits"]["resident_budget_gb"]["max_success"] = 1e300;
  write_all(path, damaged.dump());
  warnings_.clear();
  EXPECT_FALSE(store.load(context_).has_value());
  EXPECT_TRUE(warned("capacity_limits.resident_budget_gb.max_success is 1e+300"))
      << ::testing::PrintToString(warnings_);

  // Recording over the damaged file keeps it, under a name of its own each time.
  ASSERT_TRUE(store.record_observation(context_, o).ok());
  write_all(path, "{broken");
  ASSERT_TRUE(store.record_observation(context_, o).ok());
  EXPECT_EQ(json::parse(read_all(path.string() + ".invalid")), damaged);
  EXPECT_EQ(read_all(path.string() + ".invalid-2"), "{broken");

  o["capacity"]["value"] = 1e300;  // its limit would not read back
  EXPECT_EQ(store.record_observation(context_, o).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace ddo::core
