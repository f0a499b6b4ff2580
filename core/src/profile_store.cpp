#include "ddo/core/profile_store.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <utility>

#include <fmt/format.h>

#include "observation_history.h"
#include "os_file.h"
#include "profile_store_internal.h"

namespace ddo::core {
namespace fs = std::filesystem;
using nlohmann::json;

using internal::data_loss;
using internal::unavailable_dir;

WarningSink stderr_warning_sink() {
  return [](const std::string& message) { fmt::print(stderr, "ddo: warning: {}\n", message); };
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
  DDO_CHECK(is_valid_profile_key(key), Code::kInvalidArgument, "profile key '", key, "' is not '",
            kProfileFilePrefix, "' followed by ", kProfileKeyHexDigits,
            " lower-case hex digits; copy it from `ddo profiles list`");
  return options_.directory / profile_file_name(key);
}

namespace {

// Parses a profile file; a non-ok status says why it must be ignored.
Status parse_record(const std::string& content, ProfileRecord* record) {
  json value;
  DDO_RETURN_IF_ERROR(parse_json_bounded(content, &value));
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
        // Keep what was there: a foreign or damaged file may still matter to someone, and so
        // may every earlier backup (each gets a name of its own).
        fs::path kept;
        DDO_RETURN_IF_ERROR(keep_invalid_file(path, &kept));
        warn(fmt::format("replacing unreadable profile '{}' ({}); its content is kept in '{}'",
                         path.string(), parsed.message(), kept.string()));
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
    // The library's generic rule over the observation as written: {"status", "capacity":
    // {"metric": "resident_budget_gb", ...}}.
    const json written = stored.to_json();
    internal::append_observation(written, std::move(stored), &record.capacity,
                                 &record.observations);
    ProfileRecommendation rec = recommendation;
    if (rec.measured_at.empty()) rec.measured_at = record.updated_at;
    record.recommendation = std::move(rec);
    *next = record.to_json().dump(2) + "\n";
    return Status::ok_status();
  };
  return update_file_locked(path, update, options_.write, warn);
}

Status ProfileStore::check_writable(const ProfileIdentity& identity) const {
  DDO_RETURN_IF_ERROR(ensure_profile_directory(options_.directory));
  const fs::path path = path_for(identity);
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    return Status(Code::kFailedPrecondition,
                  fmt::format("cannot save profile '{}' for class '{}': its file '{}' is {}, not "
                              "a file; move it away or set DDO_PROFILE_DIR to another directory",
                              identity.name, identity.model_class, path.string(),
                              fs::is_directory(status) ? "a directory" : "not a regular file"));
  }
  // Create and delete a file the way a save does. Its name is a temporary file's, so a process
  // killed in between leaves one that the next save removes (Note [Stale temporary files]).
  static std::atomic<unsigned> counter{0};
  const fs::path probe =
      options_.directory / fmt::format(".{}writable-check.tmp-{}-{}", kProfileFilePrefix,
                                       os::current_process_id(), counter.fetch_add(1));
  const os::Result created = os::write_new_file(probe, {});
  if (!created.ok()) return unavailable_dir(options_.directory, created.text);
  fs::remove(probe, ec);
  return Status::ok_status();
}

std::vector<ProfileListing> ProfileStore::list(
    std::vector<std::filesystem::path>* host_contexts) const {
  std::vector<ProfileListing> rows;
  std::error_code ec;
  const fs::file_status dir_status = fs::status(options_.directory, ec);
  DDO_CHECK(!ec || dir_status.type() == fs::file_type::not_found, Code::kUnavailable,
            "cannot read the profile directory '", options_.directory.string(), "': ", ec.message(),
            "; check its permissions or set DDO_PROFILE_DIR");
  if (!fs::exists(dir_status)) return rows;  // nothing saved yet
  DDO_CHECK(fs::is_directory(dir_status), Code::kFailedPrecondition, "the profile directory '",
            options_.directory.string(),
            "' is not a directory; set DDO_PROFILE_DIR to a directory (or unset it to use "
            "~/.ddo/profiles)");
  fs::directory_iterator entries(options_.directory, ec);
  DDO_CHECK(!ec, Code::kUnavailable, "cannot list the profile directory '",
            options_.directory.string(), "': ", ec.message(),
            "; check its permissions or set DDO_PROFILE_DIR");
  for (; entries != fs::directory_iterator(); entries.increment(ec)) {
    const fs::directory_entry& entry = *entries;
    const std::string file = entry.path().filename().string();
    if (!file.ends_with(".json")) continue;
    const std::string key = file.substr(0, file.size() - 5);
    if (!is_valid_profile_key(key)) continue;
    ProfileListing row;
    row.profile_key = key;
    row.path = entry.path();
    std::string content;
    ProfileRecord record;
    json value;
    Status status = read_text_file(entry.path(), &content);
    if (status.ok()) status = parse_json_bounded(content, &value);
    if (status.ok() && value.is_object()) {
      // A host context's file shares the folder and the key space (host_context.h): not a row.
      auto context = value.find("context");
      if (context != value.end() && context->is_object() && !is_named_profile_context(*context)) {
        if (host_contexts != nullptr) host_contexts->push_back(entry.path());
        continue;
      }
    }
    if (status.ok()) status = ProfileRecord::from_json(value, &record);
    if (status.ok() && record.profile_key != key) {
      status = data_loss("its profile_key does not match its file name");
    }
    if (!status.ok()) {
      row.problem = status.message();
    } else {
      row.name = record.identity.name;
      row.model_class = record.identity.model_class;
      row.execution_mode = record.identity.execution_mode;
      row.updated_at = record.updated_at;
      if (record.recommendation) {
        row.resident_budget_gb = record.recommendation->resident_budget_gb;
        row.profile_measurement_kind = record.recommendation->profile_measurement_kind;
      }
    }
    rows.push_back(std::move(row));
  }
  if (host_contexts != nullptr) std::sort(host_contexts->begin(), host_contexts->end());
  std::sort(rows.begin(), rows.end(), [](const ProfileListing& a, const ProfileListing& b) {
    return std::tie(a.name, a.model_class, a.execution_mode, a.profile_key) <
           std::tie(b.name, b.model_class, b.execution_mode, b.profile_key);
  });
  return rows;
}

Status ProfileStore::remove_path(const fs::path& path, std::string_view what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return Status(Code::kNotFound,
                  fmt::format("no profile {} in '{}'", what, options_.directory.string()));
  }
  // Only a profile file is deleted: a directory or device under a profile's name is not ours.
  if (const fs::file_status st = fs::symlink_status(path, ec); !fs::is_regular_file(st)) {
    return Status(Code::kFailedPrecondition,
                  fmt::format("'{}' is not a profile file (it is not a regular file); nothing was "
                              "deleted: remove it yourself if it should go",
                              path.string()));
  }
  FileLock lock;
  DDO_RETURN_IF_ERROR(FileLock::acquire(lock_path_for(path), &lock));
  if (!fs::remove(path, ec) && ec) {
    return unavailable_dir(options_.directory, fmt::format("cannot delete '{}': {}",
                                                           path.filename().string(), ec.message()));
  }
  // POSIX: unlinked while held; a writer that opened the old lock file re-checks and retries.
  // Windows: a lock file open anywhere cannot be deleted, so it is released first and the delete
  // succeeds only when no other process has it open (Note [File semantics per platform]).
  if (!os::kLockFileDeletableWhileHeld) lock.release();
  fs::remove(lock_path_for(path), ec);
  return Status::ok_status();
}

Status ProfileStore::remove(const ProfileIdentity& identity) {
  return remove_path(path_for(identity),
                     fmt::format("named '{}' for class '{}' in {}", identity.name,
                                 identity.model_class, identity.execution_mode));
}

Status ProfileStore::remove_by_key(std::string_view key) {
  return remove_path(path_for_key(key), fmt::format("with key {}", key));
}

}  // namespace ddo::core
