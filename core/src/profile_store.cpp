#include "ddo/core/profile_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <system_error>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <openssl/evp.h>

namespace ddo::core {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string errno_text(int err) {
  return std::error_code(err, std::generic_category()).message();
}

Status unavailable_dir(const fs::path& directory, const std::string& what) {
  return Status(Code::kUnavailable,
                fmt::format("cannot write profiles in '{}': {}; set DDO_PROFILE_DIR to a writable "
                            "directory",
                            directory.string(), what));
}

// Parses a number field; json numbers may be stored as integers when they are whole.
bool get_number(const json& object, const char* key, double* out) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return false;
  *out = it->get<double>();
  return std::isfinite(*out);
}

bool get_string(const json& object, const char* key, std::string* out) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return false;
  *out = it->get<std::string>();
  return true;
}

Status data_loss(std::string message) {
  return Status(Code::kDataLoss, std::move(message));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Durable-file helpers.
// ---------------------------------------------------------------------------------------------

std::string sha256_hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  const int ok = EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr);
  DDO_ASSERT(ok == 1 && length == 32, "EVP_Digest(sha256) failed");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xf]);
  }
  return out;
}

std::string canonical_json(const json& value) {
  return value.dump();
}

std::string utc_now_iso8601() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%dT%H:%M:%S", &utc);
  return fmt::format("{}.{:03d}Z", buffer, static_cast<int>(millis));
}

fs::path resolve_profile_dir(const std::map<std::string, std::string>& env) {
  auto lookup = [&env](const char* name) -> std::string {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  if (std::string dir = lookup("DDO_PROFILE_DIR"); !dir.empty()) return fs::path(dir);
#ifdef _WIN32
  std::string home = lookup("USERPROFILE");
  if (home.empty()) home = lookup("HOME");
#else
  std::string home = lookup("HOME");
  if (home.empty()) home = lookup("USERPROFILE");
#endif
  DDO_CHECK(!home.empty(), Code::kFailedPrecondition,
            "cannot find the profile directory: neither HOME nor USERPROFILE is set; set "
            "DDO_PROFILE_DIR to a writable directory");
  return fs::path(home) / ".ddo" / "profiles";
}

Status ensure_profile_directory(const fs::path& directory) {
  if (directory.empty()) {
    return Status(Code::kFailedPrecondition,
                  "the profile directory is empty; set DDO_PROFILE_DIR to a writable directory");
  }
  std::error_code ec;
  fs::create_directories(directory, ec);
  if (ec) return unavailable_dir(directory, ec.message());
  if (!fs::is_directory(directory, ec)) return unavailable_dir(directory, "not a directory");
  return Status::ok_status();
}

Status write_file_atomic(const fs::path& target, std::string_view content,
                         const DurableWriteOptions& options) {
  const fs::path directory = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  // A unique temporary name per process and call, hidden (leading dot) and never matching the
  // "ddo-profile-*.json" pattern, so a leftover from a killed writer is never listed or loaded.
  static std::atomic<unsigned> counter{0};
  const fs::path temp =
      directory / fmt::format(".{}.tmp-{}-{}", target.filename().string(),
                              static_cast<long>(::getpid()), counter.fetch_add(1));
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return unavailable_dir(directory, "cannot create a file: " + errno_text(errno));

  auto fail = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    return unavailable_dir(directory, what + ": " + errno_text(err));
  };
  std::size_t written = 0;
  while (written < content.size()) {
    const ssize_t n = ::write(fd, content.data() + written, content.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail("cannot write '" + temp.filename().string() + "'");
    }
    written += static_cast<std::size_t>(n);
  }
  // The data must be on disk before the rename makes it visible, or a power loss could leave an
  // empty file under the final name (the classic ext4 rename-without-fsync bug).
  if (::fsync(fd) != 0) return fail("cannot sync '" + temp.filename().string() + "'");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return unavailable_dir(directory, "cannot close a file: " + errno_text(err));
  }
  if (options.before_rename) options.before_rename(temp);
  if (::rename(temp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    return unavailable_dir(directory, fmt::format("cannot rename onto '{}': {}",
                                                  target.filename().string(), errno_text(err)));
  }
  // Persist the rename itself. Failure here leaves a correct file that may not survive a power
  // loss; not worth failing the save for, and some file systems refuse directory fsync.
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    (void)::fsync(dir_fd);
    ::close(dir_fd);
  }
  return Status::ok_status();
}

Status read_text_file(const fs::path& path, std::string* content) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) {
    const int err = errno;
    if (err == ENOENT)
      return Status(Code::kNotFound, fmt::format("'{}' does not exist", path.string()));
    return Status(Code::kUnavailable,
                  fmt::format("cannot read '{}': {}", path.string(), errno_text(err)));
  }
  content->clear();
  char buffer[1 << 14];
  std::size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file)) > 0) content->append(buffer, n);
  const bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return Status(Code::kUnavailable, fmt::format("cannot read '{}'", path.string()));
  return Status::ok_status();
}

FileLock::FileLock(FileLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

FileLock::~FileLock() {
  release();
}

void FileLock::release() {
  if (fd_ >= 0) {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
    fd_ = -1;
  }
}

Status FileLock::acquire(const fs::path& lock_path, FileLock* out) {
  const fs::path directory = lock_path.parent_path();
  for (;;) {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return unavailable_dir(
          directory, fmt::format("cannot open lock file '{}': {}", lock_path.filename().string(),
                                 errno_text(errno)));
    }
    int rc = 0;
    while ((rc = ::flock(fd, LOCK_EX)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
      const int err = errno;
      ::close(fd);
      return unavailable_dir(
          directory,
          fmt::format("cannot lock '{}': {}", lock_path.filename().string(), errno_text(err)));
    }
    // If a remover unlinked the lock file between our open and flock, we hold a lock nobody
    // else can see; retry on the current file.
    struct stat held {};
    struct stat current {};
    if (::fstat(fd, &held) == 0 && ::stat(lock_path.c_str(), &current) == 0 &&
        held.st_ino == current.st_ino && held.st_dev == current.st_dev) {
      out->release();
      out->fd_ = fd;
      return Status::ok_status();
    }
    ::close(fd);
  }
}

fs::path lock_path_for(const fs::path& target) {
  fs::path lock = target;
  lock += ".lock";
  return lock;
}

Status update_file_locked(const fs::path& target, const FileUpdate& update,
                          const DurableWriteOptions& options) {
  DDO_RETURN_IF_ERROR(ensure_profile_directory(target.parent_path()));
  FileLock lock;
  DDO_RETURN_IF_ERROR(FileLock::acquire(lock_path_for(target), &lock));
  std::optional<std::string> current;
  std::string content;
  Status read = read_text_file(target, &content);
  if (read.ok()) {
    current = std::move(content);
  } else if (read.code() != Code::kNotFound) {
    return read;
  }
  std::string next;
  DDO_RETURN_IF_ERROR(update(current, &next));
  return write_file_atomic(target, next, options);
}

void update_limits(CapacityLimits& limits, const std::string& metric, double value, bool success) {
  MetricLimits& entry = limits[metric];
  if (success) {
    if (!entry.max_success || value > *entry.max_success) entry.max_success = value;
  } else {
    if (!entry.min_failure || value < *entry.min_failure) entry.min_failure = value;
  }
}

json limits_to_json(const CapacityLimits& limits) {
  json out = json::object();
  for (const auto& [metric, entry] : limits) {
    json item = json::object();
    item["max_success"] = entry.max_success ? json(*entry.max_success) : json(nullptr);
    item["min_failure"] = entry.min_failure ? json(*entry.min_failure) : json(nullptr);
    out[metric] = std::move(item);
  }
  return out;
}

Status limits_from_json(const json& value, CapacityLimits* out) {
  if (!value.is_object()) return data_loss("capacity is not an object");
  CapacityLimits limits;
  for (const auto& [metric, item] : value.items()) {
    if (!item.is_object()) return data_loss(fmt::format("capacity '{}' is not an object", metric));
    MetricLimits entry;
    for (const char* key : {"max_success", "min_failure"}) {
      auto it = item.find(key);
      if (it == item.end() || it->is_null()) continue;
      if (!it->is_number() || !std::isfinite(it->get<double>())) {
        return data_loss(fmt::format("capacity '{}'.{} is not a finite number", metric, key));
      }
      (std::string_view(key) == "max_success" ? entry.max_success : entry.min_failure) =
          it->get<double>();
    }
    limits[metric] = entry;
  }
  *out = std::move(limits);
  return Status::ok_status();
}

WarningSink stderr_warning_sink() {
  return [](const std::string& message) { fmt::print(stderr, "ddo: warning: {}\n", message); };
}

// ---------------------------------------------------------------------------------------------
// Records.
// ---------------------------------------------------------------------------------------------

json ProfileIdentity::to_json() const {
  return json{{"name", name}, {"model_class", model_class}, {"identity_version", identity_version}};
}

std::string profile_key(const ProfileIdentity& identity) {
  return sha256_hex(canonical_json(identity.to_json())).substr(0, kProfileKeyHexDigits);
}

std::string profile_file_name(std::string_view key) {
  return fmt::format("{}{}.json", kProfileFilePrefix, key);
}

bool is_valid_profile_key(std::string_view key) {
  return key.size() == kProfileKeyHexDigits && std::all_of(key.begin(), key.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

json ProfileRecommendation::to_json() const {
  json out{{"resident_budget_gb", resident_budget_gb},
           {"profile_measurement_kind", profile_measurement_kind},
           {"peak_vram_gb", peak_vram_gb},
           {"total_vram_gb", total_vram_gb},
           {"headroom_gb", headroom_gb},
           {"probe_pending", probe_pending},
           {"measured_at", measured_at}};
  out["safe_budget_gb"] = safe_budget_gb ? json(*safe_budget_gb) : json(nullptr);
  out["probe_budget_gb"] = probe_budget_gb ? json(*probe_budget_gb) : json(nullptr);
  if (!candidate_compute_ms.empty()) out["candidate_compute_ms"] = candidate_compute_ms;
  return out;
}

Status ProfileRecommendation::from_json(const json& value, ProfileRecommendation* out) {
  if (!value.is_object()) return data_loss("recommendation is not an object");
  ProfileRecommendation r;
  if (!get_number(value, "resident_budget_gb", &r.resident_budget_gb) || r.resident_budget_gb < 0) {
    return data_loss("recommendation.resident_budget_gb is missing or not a number >= 0");
  }
  if (!get_string(value, "profile_measurement_kind", &r.profile_measurement_kind)) {
    return data_loss("recommendation.profile_measurement_kind is missing");
  }
  const std::string& kind = r.profile_measurement_kind;
  if (kind != kKindBaseline && kind != kKindSdnqBaselineSafe && kind != kKindSdnqProbePending &&
      kind != kKindSdnqProbe) {
    return data_loss(fmt::format("unknown profile_measurement_kind '{}'", kind));
  }
  get_number(value, "peak_vram_gb", &r.peak_vram_gb);
  get_number(value, "total_vram_gb", &r.total_vram_gb);
  get_number(value, "headroom_gb", &r.headroom_gb);
  get_string(value, "measured_at", &r.measured_at);
  double number = 0;
  if (get_number(value, "safe_budget_gb", &number)) r.safe_budget_gb = number;
  if (get_number(value, "probe_budget_gb", &number)) r.probe_budget_gb = number;
  if (auto it = value.find("probe_pending"); it != value.end() && it->is_boolean()) {
    r.probe_pending = it->get<bool>();
  }
  if (r.probe_pending != (kind == kKindSdnqProbePending)) {
    return data_loss("recommendation.probe_pending disagrees with its measurement kind");
  }
  if (auto it = value.find("candidate_compute_ms"); it != value.end() && !it->is_null()) {
    if (!it->is_object()) return data_loss("recommendation.candidate_compute_ms is not an object");
    for (const auto& [name, ms] : it->items()) {
      if (!ms.is_number() || !(ms.get<double>() >= 0.0)) {
        return data_loss(
            fmt::format("recommendation.candidate_compute_ms[\"{}\"] is not a number >= 0", name));
      }
      r.candidate_compute_ms[name] = ms.get<double>();
    }
  }
  *out = std::move(r);
  return Status::ok_status();
}

json ProfileObservation::to_json() const {
  return json{
      {"recorded_at", recorded_at},   {"profile_measurement_kind", profile_measurement_kind},
      {"success", success},           {"resident_budget_gb", resident_budget_gb},
      {"peak_vram_gb", peak_vram_gb}, {"total_vram_gb", total_vram_gb},
      {"headroom_gb", headroom_gb},   {"recommended_budget_gb", recommended_budget_gb},
      {"measurement", measurement}};
}

Status ProfileObservation::from_json(const json& value, ProfileObservation* out) {
  if (!value.is_object()) return data_loss("an observation is not an object");
  ProfileObservation o;
  get_string(value, "recorded_at", &o.recorded_at);
  get_string(value, "profile_measurement_kind", &o.profile_measurement_kind);
  if (auto it = value.find("success"); it != value.end() && it->is_boolean()) {
    o.success = it->get<bool>();
  }
  if (!get_number(value, "peak_vram_gb", &o.peak_vram_gb)) {
    return data_loss("an observation has no numeric peak_vram_gb");
  }
  get_number(value, "resident_budget_gb", &o.resident_budget_gb);
  get_number(value, "total_vram_gb", &o.total_vram_gb);
  get_number(value, "headroom_gb", &o.headroom_gb);
  get_number(value, "recommended_budget_gb", &o.recommended_budget_gb);
  if (auto it = value.find("measurement"); it != value.end() && it->is_object()) {
    o.measurement = *it;
  }
  *out = std::move(o);
  return Status::ok_status();
}

json ProfileRecord::to_json() const {
  json history = json::array();
  for (const ProfileObservation& o : observations) history.push_back(o.to_json());
  return json{{"schema_version", kProfileSchemaVersion},
              {"profile_key", profile_key},
              {"updated_at", updated_at},
              {"identity", identity.to_json()},
              {"observations", std::move(history)},
              {"capacity", limits_to_json(capacity)},
              {"recommendation", recommendation ? recommendation->to_json() : json(nullptr)}};
}

Status ProfileRecord::from_json(const json& value, ProfileRecord* out) {
  if (!value.is_object()) return data_loss("the file is not a JSON object");
  auto schema = value.find("schema_version");
  if (schema == value.end() || !schema->is_number_integer()) {
    return data_loss("no schema_version; not a ddo profile");
  }
  if (schema->get<int>() != kProfileSchemaVersion) {
    return data_loss(fmt::format("schema_version {} is not the supported version {}; recalibrate",
                                 schema->get<int>(), kProfileSchemaVersion));
  }
  ProfileRecord r;
  auto identity = value.find("identity");
  if (identity == value.end() || !identity->is_object() ||
      !get_string(*identity, "name", &r.identity.name) ||
      !get_string(*identity, "model_class", &r.identity.model_class)) {
    return data_loss("identity is missing its name or model_class");
  }
  auto version = identity->find("identity_version");
  if (version == identity->end() || !version->is_number_integer() ||
      version->get<int>() != kProfileIdentityVersion) {
    return data_loss(
        fmt::format("identity_version is not the supported version {}", kProfileIdentityVersion));
  }
  r.identity.identity_version = kProfileIdentityVersion;
  if (!get_string(value, "profile_key", &r.profile_key) ||
      r.profile_key != core::profile_key(r.identity)) {
    return data_loss("profile_key does not match the stored identity");
  }
  get_string(value, "updated_at", &r.updated_at);
  if (auto it = value.find("observations"); it != value.end()) {
    if (!it->is_array()) return data_loss("observations is not an array");
    for (const json& item : *it) {
      ProfileObservation o;
      DDO_RETURN_IF_ERROR(ProfileObservation::from_json(item, &o));
      r.observations.push_back(std::move(o));
    }
  }
  if (auto it = value.find("capacity"); it != value.end()) {
    DDO_RETURN_IF_ERROR(limits_from_json(*it, &r.capacity));
  }
  if (auto it = value.find("recommendation"); it != value.end() && !it->is_null()) {
    ProfileRecommendation rec;
    DDO_RETURN_IF_ERROR(ProfileRecommendation::from_json(*it, &rec));
    r.recommendation = std::move(rec);
  }
  *out = std::move(r);
  return Status::ok_status();
}

json ProfileListing::to_json() const {
  json out{{"profile_key", profile_key}, {"name", name},
           {"model_class", model_class}, {"profile_measurement_kind", profile_measurement_kind},
           {"updated_at", updated_at},   {"path", path.string()}};
  out["resident_budget_gb"] = resident_budget_gb ? json(*resident_budget_gb) : json(nullptr);
  if (!problem.empty()) out["problem"] = problem;
  return out;
}

// ---------------------------------------------------------------------------------------------
// ProfileStore.
// ---------------------------------------------------------------------------------------------

ProfileStore::ProfileStore(ProfileStoreOptions options) : options_(std::move(options)) {
  if (!options_.warn) options_.warn = stderr_warning_sink();
}

fs::path ProfileStore::path_for(const ProfileIdentity& identity) const {
  return options_.directory / profile_file_name(profile_key(identity));
}

fs::path ProfileStore::path_for_key(std::string_view key) const {
  DDO_CHECK(is_valid_profile_key(key), Code::kInvalidArgument, "profile key '", key,
            "' is not 32 lower-case hex digits; copy it from `ddo profiles list`");
  return options_.directory / profile_file_name(key);
}

namespace {

// Parses a profile file; a non-ok status says why it must be ignored.
Status parse_record(const std::string& content, ProfileRecord* record) {
  json value = json::parse(content, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return data_loss("not valid JSON (truncated or corrupt)");
  return ProfileRecord::from_json(value, record);
}

}  // namespace

std::optional<ProfileRecord> ProfileStore::load_path(const fs::path& path,
                                                     const std::optional<ProfileIdentity>& expected,
                                                     std::string_view expected_key) const {
  std::string content;
  Status read = read_text_file(path, &content);
  if (read.code() == Code::kNotFound) return std::nullopt;
  if (!read.ok()) {
    options_.warn(fmt::format("ignoring profile '{}': {}", path.string(), read.message()));
    return std::nullopt;
  }
  ProfileRecord record;
  Status parsed = parse_record(content, &record);
  if (parsed.ok() && record.profile_key != expected_key) {
    parsed =
        data_loss(fmt::format("it holds profile key {}, not {}", record.profile_key, expected_key));
  }
  if (parsed.ok() && expected && record.identity != *expected) {
    parsed = data_loss(fmt::format("it holds name '{}' class '{}', not name '{}' class '{}'",
                                   record.identity.name, record.identity.model_class,
                                   expected->name, expected->model_class));
  }
  if (!parsed.ok()) {
    options_.warn(fmt::format("ignoring profile '{}': {}", path.string(), parsed.message()));
    return std::nullopt;
  }
  return record;
}

std::optional<ProfileRecord> ProfileStore::load(const ProfileIdentity& identity) const {
  return load_path(path_for(identity), identity, profile_key(identity));
}

std::optional<ProfileRecord> ProfileStore::load_by_key(std::string_view key) const {
  return load_path(path_for_key(key), std::nullopt, key);
}

Status ProfileStore::save(const ProfileIdentity& identity, const ProfileObservation& observation,
                          const ProfileRecommendation& recommendation) {
  if (identity.name.empty() || identity.model_class.empty()) {
    return Status(Code::kInvalidArgument,
                  fmt::format("a profile needs a non-empty name and model class (got name '{}', "
                              "class '{}')",
                              identity.name, identity.model_class));
  }
  const std::string key = profile_key(identity);
  const fs::path path = path_for(identity);
  const WarningSink& warn = options_.warn;
  auto update = [&](const std::optional<std::string>& current, std::string* next) -> Status {
    ProfileRecord record;
    bool reused = false;
    if (current) {
      Status parsed = parse_record(*current, &record);
      if (parsed.ok() && (record.profile_key != key || record.identity != identity)) {
        parsed = data_loss("it holds another identity");
      }
      if (parsed.ok()) {
        reused = true;
      } else {
        // Keep what was there: a foreign or damaged file may still matter to someone.
        fs::path kept = path;
        kept += ".invalid";
        warn(fmt::format("replacing unreadable profile '{}' ({}); the old content is kept in '{}'",
                         path.string(), parsed.message(), kept.string()));
        DDO_RETURN_IF_ERROR(write_file_atomic(kept, *current, {}));
      }
    }
    if (!reused) {
      record = ProfileRecord{};
      record.identity = identity;
      record.profile_key = key;
    }
    record.updated_at = utc_now_iso8601();
    ProfileObservation stored = observation;
    if (stored.recorded_at.empty()) stored.recorded_at = record.updated_at;
    record.observations.push_back(std::move(stored));
    if (record.observations.size() > kMaxProfileObservations) {
      record.observations.erase(
          record.observations.begin(),
          record.observations.end() - static_cast<std::ptrdiff_t>(kMaxProfileObservations));
    }
    update_limits(record.capacity, "resident_budget_gb", observation.resident_budget_gb,
                  observation.success);
    ProfileRecommendation rec = recommendation;
    if (rec.measured_at.empty()) rec.measured_at = record.updated_at;
    record.recommendation = std::move(rec);
    *next = record.to_json().dump(2) + "\n";
    return Status::ok_status();
  };
  return update_file_locked(path, update, options_.write);
}

std::vector<ProfileListing> ProfileStore::list() const {
  std::vector<ProfileListing> rows;
  std::error_code ec;
  if (!fs::is_directory(options_.directory, ec)) return rows;
  for (const fs::directory_entry& entry : fs::directory_iterator(options_.directory, ec)) {
    const std::string file = entry.path().filename().string();
    if (!file.starts_with(kProfileFilePrefix) || !file.ends_with(".json")) continue;
    const std::string key =
        file.substr(kProfileFilePrefix.size(), file.size() - kProfileFilePrefix.size() - 5);
    if (!is_valid_profile_key(key)) continue;
    ProfileListing row;
    row.profile_key = key;
    row.path = entry.path();
    std::string content;
    ProfileRecord record;
    Status status = read_text_file(entry.path(), &content);
    if (status.ok()) status = parse_record(content, &record);
    if (status.ok() && record.profile_key != key) {
      status = data_loss("its profile_key does not match its file name");
    }
    if (!status.ok()) {
      row.problem = status.message();
    } else {
      row.name = record.identity.name;
      row.model_class = record.identity.model_class;
      row.updated_at = record.updated_at;
      if (record.recommendation) {
        row.resident_budget_gb = record.recommendation->resident_budget_gb;
        row.profile_measurement_kind = record.recommendation->profile_measurement_kind;
      }
    }
    rows.push_back(std::move(row));
  }
  std::sort(rows.begin(), rows.end(), [](const ProfileListing& a, const ProfileListing& b) {
    return std::tie(a.name, a.model_class, a.profile_key) <
           std::tie(b.name, b.model_class, b.profile_key);
  });
  return rows;
}

Status ProfileStore::remove_path(const fs::path& path, std::string_view what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return Status(Code::kNotFound,
                  fmt::format("no profile {} in '{}'", what, options_.directory.string()));
  }
  FileLock lock;
  DDO_RETURN_IF_ERROR(FileLock::acquire(lock_path_for(path), &lock));
  if (!fs::remove(path, ec) && ec) {
    return unavailable_dir(options_.directory, fmt::format("cannot delete '{}': {}",
                                                           path.filename().string(), ec.message()));
  }
  // Unlinked while held: a writer that opened the old lock file re-checks and retries.
  fs::remove(lock_path_for(path), ec);
  return Status::ok_status();
}

Status ProfileStore::remove(const ProfileIdentity& identity) {
  return remove_path(path_for(identity),
                     fmt::format("named '{}' for class '{}'", identity.name, identity.model_class));
}

Status ProfileStore::remove_by_key(std::string_view key) {
  return remove_path(path_for_key(key), fmt::format("with key {}", key));
}

}  // namespace ddo::core
