#include "ddo/core/profile_store.h"

#include <unistd.h>  // getpid, geteuid (MinGW-w64 has getpid only)

#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "child_process.h"

namespace ddo::core {
namespace {
namespace fs = std::filesystem;
using ddo::testing::ChildProcess;
using ddo::testing::start_child;
using nlohmann::json;

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const fs::path& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
}

ProfileRecommendation recommendation(double budget_gb, std::string kind = "baseline") {
  ProfileRecommendation r;
  r.resident_budget_gb = budget_gb;
  r.profile_measurement_kind = std::move(kind);
  r.peak_vram_gb = 6.0;
  r.total_vram_gb = 8.0;
  r.headroom_gb = 1.0;
  return r;
}

ProfileObservation observation(double peak_gb, double budget_gb = 0.0, bool success = true) {
  ProfileObservation o;
  o.profile_measurement_kind = "baseline";
  o.peak_vram_gb = peak_gb;
  o.resident_budget_gb = budget_gb;
  o.total_vram_gb = 8.0;
  o.headroom_gb = 1.0;
  o.success = success;
  return o;
}

class ProfileStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("ddo-profile-store-") + info->name() + "-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir_, ec);
  }

  ProfileStore make_store(fs::path dir = {}) {
    ProfileStoreOptions options;
    options.directory = dir.empty() ? dir_ : dir;
    options.warn = [this](const std::string& message) { warnings_.push_back(message); };
    return ProfileStore(std::move(options));
  }

  fs::path dir_;
  std::vector<std::string> warnings_;
  ProfileIdentity id_{"video-5s", "demo::Transformer"};
};

TEST(ProfileKeyTest, KeyIsTheSeedLibrarysCapacityKey) {
  ProfileIdentity id{"video-5s", "demo::Transformer"};
  EXPECT_EQ(id.execution_mode, "linear_runtime");
  const std::string key = profile_key(id);
  EXPECT_TRUE(is_valid_profile_key(key)) << key;
  EXPECT_EQ(key, profile_key(id));
  // The key is "ddo-capacity-v1-" and the first 24 hex digits of the identity's canonical JSON,
  // keys sorted (diffusers-dynamic-offloader's identity version 2).
  EXPECT_EQ(canonical_json(id.to_json()),
            R"({"execution_mode":"linear_runtime","identity_version":2,)"
            R"("model_class":"demo::Transformer","name":"video-5s"})");
  EXPECT_EQ(key, "ddo-capacity-v1-" + sha256_hex(canonical_json(id.to_json())).substr(0, 24));
  EXPECT_EQ(profile_file_name(key), key + ".json");
  EXPECT_NE(key, profile_key({"video-8s", "demo::Transformer"}));
  EXPECT_NE(key, profile_key({"video-5s", "demo::UNet"}));
  EXPECT_NE(key, profile_key({"video-5s", "demo::Transformer", "sdnq_runtime"}));
  // diffusers-dynamic-offloader's key for {name "w", class "Tiny", linear_runtime}, from running
  // it.
  EXPECT_EQ(profile_key({"w", "Tiny", "linear_runtime"}),
            "ddo-capacity-v1-2ed0ac89568814f093f629b0");
}

// The FIPS 180-2 vectors: one block, none, two blocks, and many (OpenSSL on Linux, CNG on
// Windows: file names must be the same on both; Note [SHA-256 per platform]).
TEST(ProfileKeyTest, Sha256MatchesKnownVectors) {
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(ProfileKeyTest, RejectsKeysThatAreNotHex) {
  const std::string prefix(kProfileFilePrefix);
  EXPECT_FALSE(is_valid_profile_key("../../etc/passwd"));
  EXPECT_FALSE(is_valid_profile_key(prefix + "../../etc/passwd"));
  EXPECT_FALSE(is_valid_profile_key(prefix + std::string(23, 'a')));
  EXPECT_FALSE(is_valid_profile_key(prefix + std::string(24, 'A')));
  EXPECT_FALSE(is_valid_profile_key(std::string(24, 'a')));
  EXPECT_TRUE(is_valid_profile_key(prefix + std::string(24, 'a')));
}

TEST(ProfileDirTest, ResolvesFromEnvMap) {
  EXPECT_EQ(resolve_profile_dir({{"DDO_PROFILE_DIR", "/x/p"}, {"HOME", "/h"}}), fs::path("/x/p"));
  EXPECT_EQ(resolve_profile_dir({{"DDO_PROFILE_DIR", ""}, {"HOME", "/h"}}),
            fs::path("/h") / ".ddo" / "profiles");
  EXPECT_EQ(resolve_profile_dir({{"USERPROFILE", "/u"}}), fs::path("/u") / ".ddo" / "profiles");
  // "~" is the home folder, as diffusers-dynamic-offloader's expanduser reads DDO_PROFILE_DIR.
  EXPECT_EQ(resolve_profile_dir({{"DDO_PROFILE_DIR", "~/p"}, {"HOME", "/h"}}), fs::path("/h/p"));
  EXPECT_EQ(resolve_profile_dir({{"DDO_PROFILE_DIR", "~"}, {"HOME", "/h"}}), fs::path("/h"));
  EXPECT_EQ(resolve_profile_dir({{"DDO_PROFILE_DIR", "/a/~b"}, {"HOME", "/h"}}), fs::path("/a/~b"));
#ifdef _WIN32
  // Windows: USERPROFILE first, and without either variable the system's profile folder.
  EXPECT_EQ(resolve_profile_dir({{"HOME", "/h"}, {"USERPROFILE", "/u"}}),
            fs::path("/u") / ".ddo" / "profiles");
  const fs::path known = resolve_profile_dir({});
  EXPECT_TRUE(known.is_absolute()) << known.string();
  EXPECT_EQ(known.filename(), "profiles");
#else
  EXPECT_EQ(resolve_profile_dir({{"HOME", "/h"}, {"USERPROFILE", "/u"}}),
            fs::path("/h") / ".ddo" / "profiles");
  try {
    (void)resolve_profile_dir({});
    FAIL() << "expected an error without HOME";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("DDO_PROFILE_DIR"), std::string::npos);
  }
#endif
}

TEST(ProfileTimeTest, UpdatedAtIsUtcIso8601) {
  EXPECT_TRUE(
      std::regex_match(utc_now_iso8601(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)")));
}

TEST_F(ProfileStoreTest, MissingProfileLoadsAsNothingWithoutWarning) {
  ProfileStore store = make_store();
  EXPECT_FALSE(store.load(id_).has_value());
  EXPECT_TRUE(store.list().empty());
  EXPECT_TRUE(warnings_.empty());
}

TEST_F(ProfileStoreTest, DeleteByKeyLeavesADirectoryUnderAProfileNameAlone) {
  ProfileStore store = make_store();
  const std::string key = std::string(kProfileFilePrefix) + "0123456789abcdef01234567";
  const fs::path path = store.path_for_key(key);
  fs::create_directories(path);  // empty, so a plain remove would take it
  const Status s = store.remove_by_key(key);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.to_string();
  EXPECT_NE(s.message().find("not a profile file"), std::string::npos) << s.message();
  EXPECT_TRUE(fs::is_directory(path));
}

TEST_F(ProfileStoreTest, SaveThenLoadRoundTrips) {
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save(id_, observation(6.0), recommendation(1.0)).ok());
  const fs::path path = store.path_for(id_);
  EXPECT_EQ(path.parent_path(), dir_);
  EXPECT_EQ(path.filename().string(), profile_key(id_) + ".json");

  // diffusers-dynamic-offloader's layout (Note [diffusers-dynamic-offloader's files]) with ddo's
  // fields beside.
  json file = json::parse(read_all(path));
  EXPECT_EQ(file["schema_version"], kProfileSchemaVersion);
  EXPECT_EQ(file["profile_key"], profile_key(id_));
  EXPECT_EQ(file["context"], id_.to_json());
  EXPECT_EQ(file["context"]["name"], "video-5s");
  EXPECT_EQ(file["context"]["model_class"], "demo::Transformer");
  EXPECT_EQ(file["recommendation"]["profile_resident_module_budget_gb"], 1.0);
  EXPECT_FALSE(file["recommendation"].contains("sdnq_probe_resident_budget_gb"));
  EXPECT_EQ(file["recommendation"]["profile_measurement_kind"], "baseline");
  EXPECT_TRUE(file["updated_at"].get<std::string>().ends_with("Z"));
  EXPECT_EQ(file["observations"].size(), 1u);
  EXPECT_EQ(file["observations"][0]["status"], "success");
  EXPECT_EQ(file["capacity_limits"]["resident_budget_gb"]["max_success"], 0.0);
  EXPECT_FALSE(file["capacity_limits"]["resident_budget_gb"].contains("min_failure"));

  std::optional<ProfileRecord> record = store.load(id_);
  ASSERT_TRUE(record.has_value());
  EXPECT_EQ(record->identity, id_);
  ASSERT_TRUE(record->recommendation.has_value());
  EXPECT_DOUBLE_EQ(record->recommendation->resident_budget_gb, 1.0);
  EXPECT_FALSE(record->recommendation->measured_at.empty());
  EXPECT_TRUE(warnings_.empty());
  // No temporary files are left behind.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    if (entry.path().extension() == ".json") ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST_F(ProfileStoreTest, ReusingNameReplacesRecommendationAndKeepsLast20Observations) {
  ProfileStore store = make_store();
  for (int i = 0; i < 25; ++i) {
    ASSERT_TRUE(store.save(id_, observation(i), recommendation(i)).ok());
  }
  std::optional<ProfileRecord> record = store.load(id_);
  ASSERT_TRUE(record.has_value());
  EXPECT_DOUBLE_EQ(record->recommendation->resident_budget_gb, 24.0);
  ASSERT_EQ(record->observations.size(), kMaxProfileObservations);
  EXPECT_DOUBLE_EQ(record->observations.front().peak_vram_gb, 5.0);
  EXPECT_DOUBLE_EQ(record->observations.back().peak_vram_gb, 24.0);
}

TEST_F(ProfileStoreTest, CapacityKeepsMaxSuccessAndMinFailure) {
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save(id_, observation(5, 2.0, true), recommendation(1)).ok());
  ASSERT_TRUE(store.save(id_, observation(5, 4.0, true), recommendation(1)).ok());
  ASSERT_TRUE(store.save(id_, observation(9, 6.0, false), recommendation(1)).ok());
  ASSERT_TRUE(store.save(id_, observation(9, 5.0, false), recommendation(1)).ok());
  std::optional<ProfileRecord> record = store.load(id_);
  ASSERT_TRUE(record.has_value());
  const MetricLimits& limits = record->capacity.at("resident_budget_gb");
  EXPECT_EQ(limits.max_success, 4.0);
  EXPECT_EQ(limits.min_failure, 5.0);
}

TEST_F(ProfileStoreTest, BadFilesAreIgnoredWithAWarning) {
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save(id_, observation(6.0), recommendation(1.0)).ok());
  const fs::path path = store.path_for(id_);
  const std::string good = read_all(path);

  json old_schema = json::parse(good);
  old_schema["schema_version"] = 0;
  json other_identity = json::parse(good);
  other_identity["context"]["name"] = "someone-else";
  other_identity["profile_key"] = profile_key({"someone-else", "demo::Transformer"});
  json bad_kind = json::parse(good);
  bad_kind["recommendation"]["profile_measurement_kind"] = "guess";

  const std::vector<std::pair<std::string, std::string>> cases = {
      {"invalid", "{not json"},
      {"truncated", good.substr(0, good.size() / 2)},
      {"empty", ""},
      {"foreign", R"({"name": "a package.json", "version": "1.0.0"})"},
      {"array", "[1, 2, 3]"},
      {"old schema", old_schema.dump()},
      {"mismatched identity", other_identity.dump()},
      {"unknown kind", bad_kind.dump()},
  };
  for (const auto& [what, content] : cases) {
    SCOPED_TRACE(what);
    warnings_.clear();
    write_all(path, content);
    std::optional<ProfileRecord> record;
    EXPECT_NO_THROW(record = store.load(id_));
    EXPECT_FALSE(record.has_value());
    ASSERT_EQ(warnings_.size(), 1u);
    EXPECT_NE(warnings_[0].find(path.string()), std::string::npos) << warnings_[0];
  }
}

TEST_F(ProfileStoreTest, SavingOverACorruptFileKeepsItsContentBeside) {
  ProfileStore store = make_store();
  fs::create_directories(dir_);
  const fs::path path = store.path_for(id_);
  write_all(path, "{corrupt");
  ASSERT_TRUE(store.save(id_, observation(6.0), recommendation(1.0)).ok());
  EXPECT_EQ(read_all(fs::path(path.string() + ".invalid")), "{corrupt");
  ASSERT_TRUE(store.load(id_).has_value());
  EXPECT_EQ(warnings_.size(), 1u);
}

TEST_F(ProfileStoreTest, DirectoryThatIsAFileIsAClearError) {
  // Works as root too: no permission bits are involved.
  fs::create_directories(dir_);
  const fs::path not_a_dir = dir_ / "profiles";
  write_all(not_a_dir, "I am a file");
  ProfileStore store = make_store(not_a_dir);
  Status status = store.save(id_, observation(6.0), recommendation(1.0));
  EXPECT_EQ(status.code(), Code::kUnavailable);
  EXPECT_NE(status.message().find(not_a_dir.string()), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("DDO_PROFILE_DIR"), std::string::npos) << status.message();
  EXPECT_EQ(read_all(not_a_dir), "I am a file");
}

// Not on Windows, where a directory's read-only attribute does not stop creating files in it
// (scripts/windows-test.sh lists the exclusion).
#ifndef _WIN32
TEST_F(ProfileStoreTest, ReadOnlyDirectoryFailsAndKeepsTheSavedProfile) {
  if (::geteuid() == 0) {
    GTEST_SKIP() << "running as root, which ignores directory permissions; "
                    "DirectoryThatIsAFileIsAClearError covers the unwritable case";
  }
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save(id_, observation(6.0), recommendation(1.0)).ok());
  const std::string before = read_all(store.path_for(id_));
  fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec);
  Status status = store.save(id_, observation(7.0), recommendation(0.0));
  fs::permissions(dir_, fs::perms::owner_all);
  EXPECT_TRUE(status.code() == Code::kUnavailable || status.code() == Code::kFailedPrecondition)
      << status.to_string();
  EXPECT_NE(status.message().find(dir_.string()), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("DDO_PROFILE_DIR"), std::string::npos);
  EXPECT_EQ(read_all(store.path_for(id_)), before);
}
#endif  // !_WIN32

// A reader holding the file open (diffusers-dynamic-offloader's Python, a virus scanner) does not
// make a save fail: POSIX renames over it; Windows refuses the replace while a handle without
// FILE_SHARE_DELETE is open (the C runtime's, which std::ifstream and Python use), and the save
// waits for it (Note [File semantics per platform] in os_file.h).
TEST_F(ProfileStoreTest, SaveSucceedsWhileAReaderHoldsTheFileOpen) {
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save(id_, observation(6.0), recommendation(1.0)).ok());
  const fs::path path = store.path_for(id_);
  std::atomic<bool> opened{false};
  std::thread reader([&] {
    std::ifstream held(path, std::ios::binary);
    opened = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  while (!opened) std::this_thread::yield();
  const Status saved = store.save(id_, observation(7.0), recommendation(2.0));
  reader.join();
  ASSERT_TRUE(saved.ok()) << saved.to_string();
  EXPECT_DOUBLE_EQ(store.load(id_)->recommendation->resident_budget_gb, 2.0);
}

// Child processes of the tests below (child_process.h): args are the directory, the identity's
// name and class, and the observation's peak.
ProfileStore child_store(const std::vector<std::string>& args, DurableWriteOptions write = {}) {
  ProfileStoreOptions options;
  options.directory = args.at(0);
  options.warn = [](const std::string&) {};
  options.write = std::move(write);
  return ProfileStore(std::move(options));
}

DDO_TEST_CHILD(save_killed_before_rename) {
  DurableWriteOptions write;
  write.before_rename = [](const fs::path&) { std::_Exit(0); };
  ProfileStore dying = child_store(args, std::move(write));
  (void)dying.save({args.at(1), args.at(2)}, observation(std::stod(args.at(3))),
                   recommendation(0.0));
  return 3;  // the hook must have ended the process before this
}

DDO_TEST_CHILD(save_once) {
  ProfileStore store = child_store(args);
  const double peak = std::stod(args.at(3));
  return store.save({args.at(1), args.at(2)}, observation(peak), recommendation(peak - 100.0)).ok()
             ? 0
             : 1;
}

TEST_F(ProfileStoreTest, WriterKilledBeforeRenameLeavesThePreviousFile) {
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save(id_, observation(6.0), recommendation(1.0)).ok());
  const std::string before = read_all(store.path_for(id_));

  ChildProcess child =
      start_child("save_killed_before_rename", {dir_.string(), id_.name, id_.model_class, "7.5"});
  ASSERT_GT(child.pid(), 0);
  EXPECT_EQ(child.wait(), 0) << "the child did not reach the rename hook";

  EXPECT_EQ(read_all(store.path_for(id_)), before);
  std::optional<ProfileRecord> record = store.load(id_);
  ASSERT_TRUE(record.has_value());
  EXPECT_DOUBLE_EQ(record->recommendation->resident_budget_gb, 1.0);
  // The orphaned temporary file is not mistaken for a profile, and the lock was released.
  EXPECT_EQ(store.list().size(), 1u);
  ASSERT_TRUE(store.save(id_, observation(6.5), recommendation(0.5)).ok());
  EXPECT_EQ(store.load(id_)->observations.size(), 2u);
}

TEST_F(ProfileStoreTest, ConcurrentWritersFromSeveralProcessesKeepEveryObservation) {
  constexpr int kChildren = 12;
  std::vector<ChildProcess> children;
  for (int i = 0; i < kChildren; ++i) {
    children.push_back(start_child(
        "save_once", {dir_.string(), id_.name, id_.model_class, std::to_string(100 + i)}));
    ASSERT_GT(children.back().pid(), 0);
  }
  for (ChildProcess& child : children) EXPECT_EQ(child.wait(), 0);
  ProfileStore store = make_store();
  std::optional<ProfileRecord> record = store.load(id_);
  ASSERT_TRUE(record.has_value());
  std::set<double> peaks;
  for (const ProfileObservation& o : record->observations) peaks.insert(o.peak_vram_gb);
  EXPECT_EQ(record->observations.size(), static_cast<std::size_t>(kChildren));
  for (int i = 0; i < kChildren; ++i) EXPECT_EQ(peaks.count(100.0 + i), 1u) << "child " << i;
  EXPECT_TRUE(warnings_.empty());
}

TEST_F(ProfileStoreTest, ListShowsReadableRowsAndFlagsBadFiles) {
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save({"b-workload", "demo::UNet"}, observation(5), recommendation(2)).ok());
  ASSERT_TRUE(store.save(id_, observation(6), recommendation(1)).ok());
  const std::string bad_key = std::string(kProfileFilePrefix) + std::string(24, 'f');
  write_all(store.path_for_key(bad_key), "{oops");
  write_all(dir_ / "unrelated.json", "{}");
  // A host context shares the folder and the key space; it is not a named profile row.
  const json context = {{"model", "flux"}};
  write_all(
      dir_ / profile_file_name(capacity_key(context)),
      json{{"schema_version", 1}, {"profile_key", capacity_key(context)}, {"context", context}}
          .dump());

  std::vector<ProfileListing> rows = store.list();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].profile_key, bad_key);  // no name: sorts first
  EXPECT_FALSE(rows[0].problem.empty());
  EXPECT_EQ(rows[1].name, "b-workload");
  EXPECT_EQ(rows[1].model_class, "demo::UNet");
  EXPECT_EQ(rows[1].resident_budget_gb, 2.0);
  EXPECT_EQ(rows[1].profile_measurement_kind, "baseline");
  EXPECT_EQ(rows[2].name, "video-5s");
  EXPECT_EQ(rows[2].path, store.path_for(id_));
  EXPECT_FALSE(rows[2].updated_at.empty());
  EXPECT_EQ(rows[2].to_json()["resident_budget_gb"], 1.0);
}

TEST_F(ProfileStoreTest, RemoveDeletesByIdentityOrKey) {
  ProfileStore store = make_store();
  ASSERT_TRUE(store.save(id_, observation(6), recommendation(1)).ok());
  ASSERT_TRUE(store.load_by_key(profile_key(id_)).has_value());
  EXPECT_TRUE(store.remove(id_).ok());
  EXPECT_FALSE(fs::exists(store.path_for(id_)));
  EXPECT_FALSE(fs::exists(lock_path_for(store.path_for(id_))));
  EXPECT_EQ(store.remove(id_).code(), Code::kNotFound);

  ASSERT_TRUE(store.save(id_, observation(6), recommendation(1)).ok());
  EXPECT_TRUE(store.remove_by_key(profile_key(id_)).ok());
  EXPECT_EQ(store.remove_by_key(profile_key(id_)).code(), Code::kNotFound);
  EXPECT_THROW((void)store.path_for_key("../x"), Error);
  // The message gives the key's real shape: 24 hex digits.
  try {
    (void)store.path_for_key("../x");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'ddo-capacity-v1-' followed by 24 lower-case hex digits"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(ProfileStoreTest, SaveRejectsAnEmptyIdentity) {
  ProfileStore store = make_store();
  EXPECT_EQ(store.save({"", "demo::X"}, observation(1), recommendation(1)).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(store.save({"x", ""}, observation(1), recommendation(1)).code(),
            Code::kInvalidArgument);
}

}  // namespace
}  // namespace ddo::core

namespace ddo::core {
namespace {

TEST(ProfileRecommendationTest, CandidateComputeRoundTripsAndIsChecked) {
  ProfileRecommendation r;
  r.resident_budget_gb = 2.5;
  r.profile_measurement_kind = "baseline";
  r.candidate_compute_ms = {{"transformer_blocks.0", 3.25}, {"single_transformer_blocks.1", 2.0}};
  const nlohmann::json j = r.to_json();
  ProfileRecommendation back;
  ASSERT_TRUE(ProfileRecommendation::from_json(j, &back).ok());
  EXPECT_EQ(back.candidate_compute_ms, r.candidate_compute_ms);
  // Older profiles have no such field.
  nlohmann::json old = j;
  old.erase("candidate_compute_ms");
  ASSERT_TRUE(ProfileRecommendation::from_json(old, &back).ok());
  EXPECT_TRUE(back.candidate_compute_ms.empty());
  nlohmann::json bad = j;
  bad["candidate_compute_ms"]["transformer_blocks.0"] = -1.0;
  const Status status = ProfileRecommendation::from_json(bad, &back);
  EXPECT_EQ(status.code(), Code::kDataLoss);
  EXPECT_NE(status.message().find("transformer_blocks.0"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace ddo::core

namespace ddo::core {
namespace {

// A named profile exactly as diffusers-dynamic-offloader writes it (its calibration run with a
// faked CUDA memory reading; python/tests/test_compat.py makes the same file through the library
// itself).
constexpr const char* kLibraryFile = R"({
  "capacity_limits": {},
  "context": {"execution_mode": "linear_runtime", "identity_version": 2, "model_class": "Tiny",
              "name": "w"},
  "observations": [{"headroom_gb": 1.0, "measurement": "cuda_driver_peak_sampled_plus_allocator",
                    "peak_vram_gb": 20.0, "profile_measurement_kind": "baseline",
                    "status": "success", "total_vram_gb": 24.0}],
  "profile_key": "ddo-capacity-v1-2ed0ac89568814f093f629b0",
  "recommendation": {"profile_resident_module_budget_gb": 3.0},
  "schema_version": 1,
  "updated_at": "2026-12-03T12:18:01.384093+00:00"
})";

TEST(ProfileRecordTest, ReadsTheSeedLibrarysFile) {
  ProfileRecord record;
  ASSERT_TRUE(ProfileRecord::from_json(json::parse(kLibraryFile), &record).ok());
  EXPECT_EQ(record.identity, (ProfileIdentity{"w", "Tiny", "linear_runtime"}));
  ASSERT_TRUE(record.recommendation.has_value());
  EXPECT_EQ(record.recommendation->resident_budget_gb, 3.0);
  EXPECT_EQ(record.recommendation->profile_measurement_kind, "baseline");
  EXPECT_EQ(record.recommendation->peak_vram_gb, 20.0);  // from its observation
  EXPECT_EQ(record.recommendation->total_vram_gb, 24.0);
  EXPECT_FALSE(record.recommendation->probe_pending);
  ASSERT_EQ(record.observations.size(), 1u);
  EXPECT_EQ(record.observations[0].measurement, "cuda_driver_peak_sampled_plus_allocator");
  // Written back, the library's fields are all there.
  const json back = record.to_json();
  EXPECT_EQ(back["recommendation"]["profile_resident_module_budget_gb"], 3.0);
  EXPECT_EQ(back["context"], json::parse(kLibraryFile)["context"]);
  EXPECT_EQ(back["profile_key"], "ddo-capacity-v1-2ed0ac89568814f093f629b0");
}

TEST(ProfileRecordTest, ALibraryPendingProbeIsAPendingProbe) {
  json file = json::parse(kLibraryFile);
  file["context"]["execution_mode"] = "sdnq_runtime";
  file["profile_key"] = capacity_key(file["context"]);
  file["observations"][0]["profile_measurement_kind"] = "sdnq_baseline_probe_pending";
  file["recommendation"] = {{"profile_resident_module_budget_gb", 6.0},
                            {"sdnq_probe_resident_budget_gb", 6.0}};
  ProfileRecord record;
  ASSERT_TRUE(ProfileRecord::from_json(file, &record).ok());
  ASSERT_TRUE(record.recommendation.has_value());
  EXPECT_TRUE(record.recommendation->probe_pending);
  EXPECT_EQ(record.recommendation->probe_budget_gb, 6.0);
  EXPECT_EQ(record.recommendation->profile_measurement_kind, "sdnq_baseline_probe_pending");
  // And ddo's pending probe is one for the library: the same two keys.
  const json rec = record.recommendation->to_json();
  EXPECT_EQ(rec["sdnq_probe_resident_budget_gb"], 6.0);
  EXPECT_EQ(rec["profile_resident_module_budget_gb"], 6.0);
}

TEST(ProfileRecordTest, UnknownFieldsOfOtherWritersSurviveARewrite) {
  json file = json::parse(kLibraryFile);
  file["future_field"] = {{"a", 1}};
  file["recommendation"]["library_note"] = "x";
  file["observations"][0]["library_detail"] = 7;
  ProfileRecord record;
  ASSERT_TRUE(ProfileRecord::from_json(file, &record).ok());
  const json back = record.to_json();
  EXPECT_EQ(back["future_field"], file["future_field"]);
  EXPECT_EQ(back["recommendation"]["library_note"], "x");
  EXPECT_EQ(back["observations"][0]["library_detail"], 7);
}

TEST(ProfileRecordTest, AHostContextFileIsNotANamedProfile) {
  const json context = {{"model", "flux"}};
  ProfileRecord record;
  const Status status = ProfileRecord::from_json(
      json{{"schema_version", 1}, {"profile_key", capacity_key(context)}, {"context", context}},
      &record);
  EXPECT_EQ(status.code(), Code::kDataLoss);
  EXPECT_NE(status.message().find("not a named profile"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace ddo::core

namespace ddo::core {
namespace {

TEST(PrintableText, ControlCharactersAndBrokenUtf8AreEscapedOnOneLine) {
  EXPECT_EQ(printable_text("video-5s"), "video-5s");
  EXPECT_EQ(printable_text("vidéo ✓ 视频"), "vidéo ✓ 视频");  // UTF-8 stays as it is
  EXPECT_EQ(printable_text("a\nb\tc\\d"), "a\\nb\\tc\\\\d");
  EXPECT_EQ(printable_text("\x1b[2J\x7f"), "\\x1b[2J\\x7f");  // ESC, DEL
  EXPECT_EQ(printable_text("x\xc2\x9b"
                           "1m"),
            "x\\xc2\\x9b1m");                                          // C1 CSI (U+009B)
  EXPECT_EQ(printable_text("\xff\xc0\x80 ok"), "\\xff\\xc0\\x80 ok");  // not UTF-8
  EXPECT_EQ(printable_text(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(printable_text("\xe2\x9c"), "\\xe2\\x9c");  // a sequence cut short
}

}  // namespace
}  // namespace ddo::core
