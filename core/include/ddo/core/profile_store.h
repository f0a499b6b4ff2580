/// \file
/// ProfileStore: named workload profiles on disk (docs/design/0007-named-profiles.md, section 2).
///
/// A profile is identified by {user-supplied name, model class qualified name, identity version,
/// execution mode}. The files are diffusers-dynamic-offloader 0.1.0rc2's, so a
/// user who switches keeps their profiles and can switch back: every profile and every legacy
/// host context is a "capacity file" named "ddo-capacity-v1-" plus the first 24 hex digits of the
/// SHA-256 of the identity's (or context's) canonical JSON, where canonical JSON is byte for byte
/// what Python's json.dumps(value, sort_keys=True, separators=(",", ":")) writes. The readable
/// name and class are stored inside, under "context". See Note [diffusers-dynamic-offloader's
/// files]. The directory is DDO_PROFILE_DIR, else ~/.ddo/profiles.
///
/// Every write is a read-modify-write under an exclusive lock on a sibling "<file>.lock", and the
/// new content replaces the old by rename, so two processes saving the same profile keep each
/// other's observations and a writer killed midway leaves the previous file intact.
///
/// ```
/// ddo::core::ProfileStore store({.directory = ddo::core::resolve_profile_dir(env)});
/// ddo::core::ProfileIdentity id{"video-5s", "my::Transformer", "linear_runtime"};
/// ddo::Status s = store.save(id, observation, recommendation);   // atomic, locked
/// std::optional<ddo::core::ProfileRecord> r = store.load(id);      // nullopt: absent or invalid
/// // r->recommendation->resident_budget_gb == recommendation.resident_budget_gb
/// // store.path_for(id).filename() == "ddo-capacity-v1-<24 hex>.json"
/// ```
///
/// This header also holds the durable-file helpers (SHA-256, atomic write, file lock, bounded JSON
/// reading, capacity limits, the key rule) that the legacy host-context store (host_context.h)
/// reuses, so there is one implementation of the crash- and concurrency-safe write path, of the
/// input bounds and of file naming.
///
/// Every file ddo reads here is untrusted input: it is at most kMaxProfileFileBytes, nested at most
/// kMaxJsonDepth deep (checked before a document is built; see Note [Bounded JSON]) and every
/// number in it is range-checked; a file that fails is reported (named, with the reason) and never
/// crashes or stalls a reader.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/status.h"

namespace ddo::core {

/// The "schema_version" ddo writes and reads; a file of another version is refused, not guessed at.
inline constexpr int kProfileSchemaVersion = 1;
/// diffusers-dynamic-offloader's identity version 2: {name, model_class, identity_version,
/// execution_mode}.
inline constexpr int kProfileIdentityVersion = 2;
/// Observations kept per profile, oldest dropped first.
inline constexpr std::size_t kMaxProfileObservations = 20;
/// Named profiles and host contexts share one key space, as in diffusers-dynamic-offloader: the key
/// is the prefix plus kProfileKeyHexDigits hex digits, and the file is "<key>.json".
inline constexpr std::string_view kProfileFilePrefix = "ddo-capacity-v1-";
inline constexpr std::size_t kProfileKeyHexDigits = 24;  ///< hex digits of SHA-256 in a key

/// Input bounds. A profile ddo writes is a few KB and nested 4 levels deep; the bounds leave two
/// orders of magnitude of room and stop hostile or corrupt files long before they cost memory or
/// stack (Note [Bounded JSON] in profile_files.cpp).
inline constexpr int kMaxJsonDepth = 64;
inline constexpr std::size_t kMaxProfileFileBytes = std::size_t{4} << 20;  ///< 4 MiB
/// GiB figures in a profile (budgets, peaks, totals, headroom): 0 to 1 PiB. The upper bound is
/// far above any device and far below 64-bit byte counts (8 EiB), so a converted value never
/// overflows.
inline constexpr double kMaxProfileGb = 1024.0 * 1024.0;
/// Per-candidate compute in a profile, ms per step: 0 to one hour.
inline constexpr double kMaxProfileComputeMs = 3.6e6;

/// profile_measurement_kind values (docs/design/0007-named-profiles.md, section 4).
inline constexpr std::string_view kKindBaseline = "baseline";
/// Packed-layer calibration whose probe would not be worth a run. The packed kinds keep the
/// spellings of diffusers-dynamic-offloader's files, whatever the layers' format.
inline constexpr std::string_view kKindPackedBaselineSafe = "sdnq_baseline_safe";
/// Packed-layer calibration with a probe still to run.
inline constexpr std::string_view kKindPackedProbePending = "sdnq_baseline_probe_pending";
/// Measured at a packed-layer probe budget.
inline constexpr std::string_view kKindPackedProbe = "sdnq_probe";

// ---------------------------------------------------------------------------------------------
// Durable-file helpers (shared with host_context.h).
// ---------------------------------------------------------------------------------------------

/// Lower-case hex SHA-256 of `data` (OpenSSL on Linux, CNG on Windows: the same digest).
std::string sha256_hex(std::string_view data);

/// Compact JSON with object keys sorted, byte for byte as Python's
/// json.dumps(value, sort_keys=True, separators=(",", ":")) writes it (ASCII only, `\uXXXX`
/// escapes, floats as Python's repr: 1.0, 1e-05, 1e+16). The key rule hashes this text, so a key
/// computed here equals the one diffusers-dynamic-offloader computes for the same value. Throws
/// ddo::Error (kInvalidArgument) for a string that is not valid UTF-8.
std::string canonical_json(const nlohmann::json& value);

/// The key of a capacity file: kProfileFilePrefix plus the first kProfileKeyHexDigits hex digits
/// of SHA-256(canonical_json(normalized)). `normalized` is a named profile's identity JSON or a
/// normalized host context (host_context.h). The one rule for file names in ddo.
std::string capacity_key(const nlohmann::json& normalized);

/// Current time as UTC ISO-8601 with milliseconds and a trailing Z: "2025-01-31T09:08:07.123Z".
std::string utc_now_iso8601();

/// The profile directory: DDO_PROFILE_DIR when set and non-empty, else `<home>/.ddo/profiles` where
/// home is HOME, else USERPROFILE; on Windows USERPROFILE, else HOME, else the system's profile
/// folder (SHGetKnownFolderPath). Throws ddo::Error (kFailedPrecondition) when there is none.
/// `env` is the process environment as a map.
/// A leading "~" in DDO_PROFILE_DIR is the home folder (diffusers-dynamic-offloader expands it
/// too).
std::filesystem::path resolve_profile_dir(const std::map<std::string, std::string>& env);

/// Sink for "ignored a file" warnings; the default prints "ddo: warning: ..." to stderr.
using WarningSink = std::function<void(const std::string& message)>;
WarningSink stderr_warning_sink();  ///< the default sink

/// Options of one atomic write.
struct DurableWriteOptions {
  /// Test hook: runs after the temporary file is complete and synced, before the rename. A test
  /// forks a child whose hook calls _exit() to prove a killed writer never loses the old file.
  std::function<void(const std::filesystem::path& temp_path)> before_rename;
};

/// Creates `directory` (and parents) when missing. kUnavailable names the directory and says to
/// set DDO_PROFILE_DIR when it cannot be created or is not a directory.
Status ensure_profile_directory(const std::filesystem::path& directory);

/// Writes `content` to a temporary file in the target's directory, fsyncs it, renames it over
/// `target` and fsyncs the directory. On failure the previous `target` is untouched.
Status write_file_atomic(const std::filesystem::path& target, std::string_view content,
                         const DurableWriteOptions& options = {});

/// Reads a whole regular file of at most `max_bytes`. kNotFound when it does not exist; kDataLoss
/// when it is larger than `max_bytes` or is not a regular file (a directory, a FIFO, a device;
/// the message says which); kUnavailable for other read errors. Never blocks on a FIFO.
Status read_text_file(const std::filesystem::path& path, std::string* content,
                      std::size_t max_bytes = kMaxProfileFileBytes);

/// The deepest nesting of arrays and objects in `text`, by a linear scan that skips strings: no
/// recursion and no document built, so it is safe on any input. Exact for valid JSON.
int json_nesting_depth(std::string_view text);

/// Parses `text` as JSON when it is at most kMaxProfileFileBytes and nested at most kMaxJsonDepth
/// deep; kDataLoss says which bound failed or that the text is not valid JSON.
Status parse_json_bounded(std::string_view text, nlohmann::json* out);

/// Keeps the current content of an unusable file `path` under a name no earlier backup holds:
/// "<path>.invalid", then "<path>.invalid-2", "-3", ... (a hard link, so nothing is copied and
/// `path` stays in place until its replacement is renamed over it; a rename where the file
/// system has no hard links). Call it under the file's lock. `*kept` is the backup's path.
Status keep_invalid_file(const std::filesystem::path& path, std::filesystem::path* kept);

/// Deletes the temporary files (".<file>.tmp-PID-N") that writers of profile and context files in
/// `directory` left when they were killed before their rename: only those whose owner process is
/// gone and that are older than a minute (Note [Stale temporary files]). Returns how many it
/// deleted; errors are ignored (a leftover costs disk space, never correctness).
int remove_stale_temp_files(const std::filesystem::path& directory);

/// An exclusive lock on a lock file (flock on POSIX, LockFileEx on Windows), held until
/// destruction. Blocks until the lock is free. On POSIX it re-checks after locking that the lock
/// file was not deleted and recreated meanwhile, so a `remove` that unlinks the lock file cannot
/// split writers across two inodes; Windows cannot delete a lock file that is open.
class FileLock {
 public:
  FileLock() = default;
  FileLock(FileLock&& other) noexcept;             ///< `other` no longer holds the lock
  FileLock& operator=(FileLock&& other) noexcept;  ///< releases the held lock first
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();

  /// Locks `lock_path` (created when missing), waiting for other holders; errors name the path.
  static Status acquire(const std::filesystem::path& lock_path, FileLock* out);
  /// True between acquire() and release().
  bool held() const { return fd_ >= 0; }
  void release();  ///< unlocks; idempotent

 private:
  int fd_ = -1;
};

/// The lock file that guards `target`: "<target>.lock".
std::filesystem::path lock_path_for(const std::filesystem::path& target);

/// Read-modify-write of `target` under its lock: `update` sees the current content (nullopt when
/// the file is absent) and fills the next content; a non-ok status from `update` writes nothing.
/// A current file larger than kMaxProfileFileBytes is kept aside (keep_invalid_file, reported
/// through `warn`) and `update` sees nullopt; a target that is not a regular file (a directory)
/// is an error naming it. Next content above kMaxProfileFileBytes is refused (kInvalidArgument),
/// so every file written can be read back. Stale temporary files of killed writers in the
/// directory are removed first.
using FileUpdate =
    std::function<Status(const std::optional<std::string>& current, std::string* next)>;
/// The read-modify-write described at FileUpdate.
Status update_file_locked(const std::filesystem::path& target, const FileUpdate& update,
                          const DurableWriteOptions& options = {}, const WarningSink& warn = {});

/// Capacity limits of one metric: the largest value that succeeded, the smallest that failed.
struct MetricLimits {
  std::optional<double> max_success;  ///< the largest value that succeeded
  std::optional<double> min_failure;  ///< the smallest value that failed
};
/// Limits per metric name (e.g. "resident_budget_gb").
using CapacityLimits = std::map<std::string, MetricLimits>;

/// The range of a number read from a file, for its error message.
struct NumberRange {
  double min = 0.0;       ///< the smallest value accepted
  double max = 0.0;       ///< the largest value accepted
  const char* unit = "";  ///< "GiB", "ms"; "" for plain numbers
};
/// GiB figures of a profile and the free-form metrics of a host context (whose integers stay
/// exact in a double up to 2^53).
inline constexpr NumberRange kProfileGbRange{0.0, kMaxProfileGb, "GiB"};
/// Host-context metrics: any number whose integers are exact in a double.
inline constexpr NumberRange kMetricRange{-9007199254740992.0, 9007199254740992.0, ""};

/// A number read from a file at `where` (the field as the user sees it in the file,
/// "recommendation.resident_budget_gb"), checked against `range`; kDataLoss names the field, the
/// value and the range.
Status checked_number(const nlohmann::json& value, std::string_view where, const NumberRange& range,
                      double* out);
/// The integer field `prefix``key` of `object` must equal `expected` (a schema or identity
/// version), compared without truncation; kDataLoss names it and ends with `advice`.
Status version_field(const nlohmann::json& object, const char* key, std::string_view prefix,
                     int expected, std::string_view advice);

/// Records one result: a success raises max_success, a failure lowers min_failure.
void update_limits(CapacityLimits& limits, const std::string& metric, double value, bool success);
/// diffusers-dynamic-offloader's rule for an observation object: {"status": "success" | "failure",
/// "capacity": {"metric": M, "value": V}} with M a non-empty string and V a number raises
/// max_success or lowers min_failure of that metric; any other observation leaves the limits as
/// they are.
void update_limits_from_observation(CapacityLimits& limits, const nlohmann::json& observation);
/// {"metric": {"max_success": x, "min_failure": y}}, an absent limit omitted (the library's form).
nlohmann::json limits_to_json(const CapacityLimits& limits);
/// Parses {"metric": {"max_success": x, "min_failure": y}} (a null limit is absent); kDataLoss on
/// a malformed entry or a number outside `range`, naming the field.
Status limits_from_json(const nlohmann::json& json, CapacityLimits* out,
                        const NumberRange& range = kMetricRange);

// ---------------------------------------------------------------------------------------------
// Named profiles.
// ---------------------------------------------------------------------------------------------

/// What a named profile is for; its key (the file name) is a hash of this.
struct ProfileIdentity {
  std::string name;         ///< user-supplied, stored verbatim
  std::string model_class;  ///< fully qualified C++ class name, or Python class qualified name
  /// The execution mode's spelling ("linear_runtime", "sdnq_runtime", "plan"): a dense
  /// calibration says nothing about an SDNQ run of the same name, so diffusers-dynamic-offloader
  /// keys them apart.
  std::string execution_mode = "linear_runtime";
  int identity_version = kProfileIdentityVersion;  ///< see kProfileIdentityVersion

  /// {"execution_mode", "identity_version", "model_class", "name"}: the file's "context".
  nlohmann::json to_json() const;
  bool operator==(const ProfileIdentity&) const = default;  ///< field by field
};

/// capacity_key(identity.to_json()): "ddo-capacity-v1-" and 24 hex digits.
std::string profile_key(const ProfileIdentity& identity);
/// "<key>.json".
std::string profile_file_name(std::string_view key);
/// True for kProfileFilePrefix plus exactly kProfileKeyHexDigits lower-case hex digits (guards
/// `--key` against path tricks).
bool is_valid_profile_key(std::string_view key);
/// Whether a capacity file's "context" is a named profile's identity rather than a host context.
bool is_named_profile_context(const nlohmann::json& context);

/// The recommendation's key for the resident budget, in the library's files and in a host
/// context's recommendation (host_context.h).
inline constexpr std::string_view kRecommendedBudgetKey = "profile_resident_module_budget_gb";

/// The budget a profile recommends and how it was measured. In the file (the library's form):
/// {"profile_resident_module_budget_gb": budget, "sdnq_probe_resident_budget_gb": probe (only
/// while a probe is pending), ...ddo's fields below by name}. A file the library wrote holds only
/// the first two; the rest are derived from its last observation (from_json).
struct ProfileRecommendation {
  double resident_budget_gb = 0.0;       ///< the budget the next run of this identity should use
  std::string profile_measurement_kind;  ///< one of the kKind* values
  double peak_vram_gb = 0.0;             ///< the peak the recommendation was derived from
  double total_vram_gb = 0.0;            ///< the card (or cap) it was measured on
  double headroom_gb = 0.0;              ///< the headroom it kept
  /// SDNQ probe fields. safe_budget_gb: the zero-resident safe budget (applied if a pending probe
  /// cannot run); probe_budget_gb: the resident budget probed or to be probed.
  std::optional<double> safe_budget_gb;
  std::optional<double> probe_budget_gb;  ///< see safe_budget_gb
  bool probe_pending = false;             ///< the next run is an SDNQ probe at probe_budget_gb
  std::string measured_at;                ///< UTC ISO-8601
  /// GPU milliseconds per step spent in each residency candidate (a block), measured in the
  /// calibration run where every candidate streams. The next run's planner uses it to place
  /// residents so that streamed bytes follow compute along the step (Note [Balanced order] in
  /// planner.cpp). Empty when not measured (older profiles, devices without timing).
  std::map<std::string, double> candidate_compute_ms;
  /// The weights it was measured with (ModelInventory::weights_summary: "bfloat16",
  /// "sdnq float8_e4m3fn + bfloat16"); "" when not recorded (the library's files, older ones).
  std::string weights;
  /// Fields of the file ddo does not know (another writer's), written back unchanged.
  nlohmann::json extra = nlohmann::json::object();

  nlohmann::json to_json() const;  ///< the file's "recommendation" object
  /// `last_observation` (may be null) fills what a library-written recommendation lacks.
  static Status from_json(const nlohmann::json& json, ProfileRecommendation* out,
                          const nlohmann::json& last_observation = nullptr);
};

/// One measured region, kept in a bounded history. In the file: {"status": "success" |
/// "failure", "capacity": {"metric": "resident_budget_gb", "value": resident_budget_gb}, ...the
/// fields below by name}, so the library's generic limit rule (update_limits_from_observation)
/// yields ddo's capacity limits.
struct ProfileObservation {
  std::string recorded_at;               ///< UTC ISO-8601
  std::string profile_measurement_kind;  ///< one of the kKind* values
  bool success = true;                   ///< the peak stayed within total - headroom
  double resident_budget_gb = 0.0;       ///< the budget the measured run used
  double peak_vram_gb = 0.0;             ///< the measured peak
  double total_vram_gb = 0.0;            ///< the card (or cap)
  double headroom_gb = 0.0;              ///< profile_vram_headroom_gb
  double recommended_budget_gb = 0.0;    ///< what the run recommended
  nlohmann::json measurement = nlohmann::json::object();  ///< ddo: an object; the library: a string
  nlohmann::json extra = nlohmann::json::object();  ///< unknown fields, written back unchanged

  nlohmann::json to_json() const;  ///< one element of the file's "observations"
  /// kDataLoss names a bad field.
  static Status from_json(const nlohmann::json& json, ProfileObservation* out);
};

/// A named profile's file, as read and written.
struct ProfileRecord {
  ProfileIdentity identity;  ///< the file's "context"
  std::string profile_key;   ///< profile_key(identity): the file name without ".json"
  std::string updated_at;    ///< UTC ISO-8601 of the last save
  std::vector<ProfileObservation> observations;  ///< oldest first, at most kMaxProfileObservations
  CapacityLimits capacity;  ///< from the observations (update_limits_from_observation)
  std::optional<ProfileRecommendation> recommendation;  ///< absent in a file that has none yet
  nlohmann::json extra = nlohmann::json::object();      ///< unknown top-level fields, kept

  nlohmann::json to_json() const;  ///< the whole file
  /// Validates schema version, identity (a named profile's "context") and key; kDataLoss says
  /// what is wrong. A host context's file is kDataLoss "not a named profile".
  static Status from_json(const nlohmann::json& json, ProfileRecord* out);
};

/// `text` (a profile name or class, stored verbatim) as one line a terminal shows as it is:
/// control characters (newline, tab, ESC, DEL and the C1 range) become `\\n`, `\\t` or `\\xNN`,
/// and a backslash is doubled, so a name cannot add rows to a listing or move the cursor. Bytes
/// that are not UTF-8 become `\\xNN` too.
std::string printable_text(std::string_view text);

/// One row of `ddo profiles list`. Unreadable files are listed with `problem` set so that the
/// user can see and delete them.
struct ProfileListing {
  std::string profile_key;                   ///< the file name without ".json"
  std::string name;                          ///< the profile name
  std::string model_class;                   ///< the identity's class
  std::string execution_mode;                ///< the identity's execution mode
  std::optional<double> resident_budget_gb;  ///< the recommendation, when there is one
  std::string profile_measurement_kind;      ///< how it was measured
  std::string updated_at;                    ///< UTC ISO-8601 of the last save
  std::filesystem::path path;                ///< the file
  std::string problem;                       ///< empty when the file is a valid profile

  nlohmann::json to_json() const;  ///< for `ddo profiles list --json`
};

/// Where a ProfileStore keeps its files and where it reports skipped ones.
struct ProfileStoreOptions {
  std::filesystem::path directory;           ///< resolve_profile_dir() for the usual place
  WarningSink warn = stderr_warning_sink();  ///< told about every file ignored or kept aside
  DurableWriteOptions write;                 ///< test hooks
};

/// Named profiles in one directory; see the file comment for the format and the write path.
class ProfileStore {
 public:
  explicit ProfileStore(ProfileStoreOptions options);  ///< creates nothing until the first save

  /// The directory the profiles live in.
  const std::filesystem::path& directory() const { return options_.directory; }
  /// The identity's file, existing or not.
  std::filesystem::path path_for(const ProfileIdentity& identity) const;
  /// Throws ddo::Error (kInvalidArgument) when `key` is not a valid key (is_valid_profile_key).
  std::filesystem::path path_for_key(std::string_view key) const;

  /// The stored record, or nullopt when absent. Invalid, foreign, mismatched or old-schema files
  /// are reported through the warning sink and treated as absent; this never throws for file
  /// content.
  std::optional<ProfileRecord> load(const ProfileIdentity& identity) const;
  /// The same by key; throws for an invalid key.
  std::optional<ProfileRecord> load_by_key(std::string_view key) const;

  /// Appends `observation` (history capped at kMaxProfileObservations), updates capacity limits
  /// and replaces the recommendation, all under the file lock. A present but invalid file is kept
  /// beside under a name of its own ("<file>.invalid", "<file>.invalid-2", ...; every earlier
  /// backup stays) before it is replaced. Errors name the directory.
  Status save(const ProfileIdentity& identity, const ProfileObservation& observation,
              const ProfileRecommendation& recommendation);

  /// Whether save(identity, ...) can write: the directory exists or can be created, a file can be
  /// created in it, and the profile's path is not a directory or other non-regular file. For the
  /// start of a calibration, so that an unwritable directory fails before the measured run rather
  /// than after it. kUnavailable / kFailedPrecondition name the path and say what to change.
  Status check_writable(const ProfileIdentity& identity) const;

  /// Every named profile ("ddo-capacity-v1-*.json" whose context is an identity) in the
  /// directory, sorted by name, class, then key; host-context files are left out, and files that
  /// cannot be read as either are rows with `problem` set. A missing directory lists nothing.
  /// Throws ddo::Error (kFailedPrecondition) when the directory path exists but is not a directory,
  /// and (kUnavailable) when it cannot be read. `host_contexts`, when given, receives the paths
  /// of the host-context files left out (host_context.h), so a listing can say they are there.
  std::vector<ProfileListing> list(
      std::vector<std::filesystem::path>* host_contexts = nullptr) const;

  /// Deletes the profile file (and its lock file). kNotFound when there is none.
  Status remove(const ProfileIdentity& identity);
  /// The same by key; kInvalidArgument for an invalid key.
  Status remove_by_key(std::string_view key);

 private:
  std::optional<ProfileRecord> load_path(const std::filesystem::path& path,
                                         const std::optional<ProfileIdentity>& expected,
                                         std::string_view expected_key) const;
  Status remove_path(const std::filesystem::path& path, std::string_view what);

  ProfileStoreOptions options_;
};

}  // namespace ddo::core
