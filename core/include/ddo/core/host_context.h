/// \file
/// The legacy host-context profile API (spec §6, last item), kept for existing integrations.
///
/// Before named profiles, a host described its workload as an arbitrary JSON "context" (model,
/// resolution, steps, GPU, ...) and recorded observations under it. A context is normalized
/// (object keys sorted, only JSON-safe values) and hashed to a file "ddo-context-<32 hex>.json"
/// beside the named profiles; the different prefix keeps the two key spaces apart, and named
/// profiles never map to contexts. The files use the same locked, atomic write as profile_store.h.
///
/// A session pairs an exact execution context (what ran) with a wider capacity context (what
/// the limits apply to, e.g. the same model and GPU at any prompt): each record appends to the
/// execution context's history and updates the capacity context's limits.
///
/// ```
/// ddo::core::HostContextStore store({.directory = ddo::core::resolve_profile_dir(env)});
/// ddo::core::DynamicOffloadProfileSession session(
///     store, {{"model", "flux"}, {"gpu", "4090"}, {"steps", 28}},   // execution context
///     {{"model", "flux"}, {"gpu", "4090"}});                          // capacity context
/// ddo::Status s = session.record({.metrics = {{"resident_budget_gb", 6.0}}, .success = true});
/// session.recommendation().values.at("resident_budget_gb");  // == 6.0
/// ```
#pragma once

#include <cstddef>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/profile_store.h"
#include "ddo/core/status.h"

namespace ddo::core {

inline constexpr int kContextSchemaVersion = 1;  ///< the "schema_version" of a context file
/// File names are the prefix, the key and ".json"; distinct from the named profiles' prefix.
inline constexpr std::string_view kContextFilePrefix = "ddo-context-";
/// Observations kept per context, oldest dropped first.
inline constexpr std::size_t kMaxContextObservations = 20;
/// A context, and an observation's details, as compact JSON: 20 observations and two contexts
/// stay far below kMaxProfileFileBytes, so every file written reads back.
inline constexpr std::size_t kMaxContextBytes = std::size_t{64} << 10;

/// A copy of `context` with keys sorted, holding only null, bool, number, string, arrays and
/// objects, nested at most kMaxJsonDepth deep and at most kMaxContextBytes as JSON. Throws
/// ddo::Error (kInvalidArgument) naming the offending path for NaN or infinite numbers, binary
/// values, discarded values, deeper nesting or a larger context.
nlohmann::json normalize_context(const nlohmann::json& context);

/// First 32 hex digits of SHA-256 of the normalized context's canonical JSON. Throws like
/// normalize_context.
std::string context_key(const nlohmann::json& context);
/// "ddo-context-<key>.json".
std::string context_file_name(std::string_view key);
/// The context's file in `directory`. Throws like normalize_context.
std::filesystem::path context_path(const std::filesystem::path& directory,
                                   const nlohmann::json& context);

/// One observation: named numeric metrics of a run and whether it succeeded.
struct ContextObservation {
  std::map<std::string, double> metrics;  ///< e.g. resident_budget_gb, peak_vram_gb; finite
  bool success = true;                    ///< the run fit
  nlohmann::json details = nlohmann::json::object();  ///< free-form; normalized before saving
  std::string recorded_at;                            ///< filled on save when empty

  nlohmann::json to_json() const;  ///< one element of the file's "observations"
  /// kDataLoss names a bad field.
  static Status from_json(const nlohmann::json& json, ContextObservation* out);
};

/// Per metric, the largest value known to succeed, when it is below every known failure.
struct ContextRecommendation {
  std::map<std::string, double> values;  ///< the recommended value per metric
  std::vector<std::string> conflicting;  ///< metrics whose max_success >= min_failure

  nlohmann::json to_json() const;  ///< {"values": {...}, "conflicting": [...]}
};
/// The recommendation the limits imply (see ContextRecommendation).
ContextRecommendation recommend_from_capacity(const CapacityLimits& capacity);

/// One context's file, as read and written.
struct ContextRecord {
  std::string context_key;  ///< context_key(context): the file name without ".json"
  nlohmann::json context;   ///< normalized
  std::string updated_at;   ///< UTC ISO-8601 of the last write
  std::vector<ContextObservation> observations;  ///< oldest first, at most kMaxContextObservations
  CapacityLimits capacity;                       ///< per metric, from the observations

  nlohmann::json to_json() const;  ///< the whole file
  /// kDataLoss says what is wrong.
  static Status from_json(const nlohmann::json& json, ContextRecord* out);
};

/// Where a HostContextStore keeps its files and where it reports skipped ones.
struct HostContextStoreOptions {
  std::filesystem::path directory;           ///< the profile directory (resolve_profile_dir())
  WarningSink warn = stderr_warning_sink();  ///< told about every file ignored or kept aside
  DurableWriteOptions write;                 ///< test hooks
};

/// Host contexts in one directory, beside the named profiles; see the file comment.
class HostContextStore {
 public:
  /// Creates nothing until the first write.
  explicit HostContextStore(HostContextStoreOptions options);

  /// The directory the files live in.
  const std::filesystem::path& directory() const { return options_.directory; }
  /// The context's file, existing or not.
  std::filesystem::path path_for(const nlohmann::json& context) const;

  /// nullopt when absent; invalid, foreign or mismatched files warn and count as absent.
  std::optional<ContextRecord> load(const nlohmann::json& context) const;

  /// Under the file lock: updates the per-metric limits and, with keep_history, appends the
  /// observation (last kMaxContextObservations kept). Throws ddo::Error for an invalid context;
  /// kInvalidArgument for a metric that is not finite or above 2^53 in magnitude (it would not
  /// read back); kUnavailable names an unwritable directory. A present but invalid file is kept
  /// beside under a name of its own (keep_invalid_file) before it is replaced.
  Status record_observation(const nlohmann::json& context, const ContextObservation& observation,
                            bool keep_history = true);

  /// The stored limits; empty when there is no file.
  CapacityLimits read_capacity(const nlohmann::json& context) const;
  /// recommend_from_capacity(read_capacity(context)).
  ContextRecommendation read_recommendation(const nlohmann::json& context) const;

 private:
  HostContextStoreOptions options_;
};

/// Pairs an exact execution context with a wider capacity context.
class DynamicOffloadProfileSession {
 public:
  /// Normalizes both contexts; throws ddo::Error (kInvalidArgument) when either is invalid.
  DynamicOffloadProfileSession(HostContextStore store, const nlohmann::json& execution_context,
                               const nlohmann::json& capacity_context);

  /// The normalized execution context.
  const nlohmann::json& execution_context() const { return execution_context_; }
  /// The normalized capacity context.
  const nlohmann::json& capacity_context() const { return capacity_context_; }
  std::string execution_key() const;             ///< its file's key
  std::string capacity_key() const;              ///< its file's key
  std::filesystem::path execution_path() const;  ///< its file
  std::filesystem::path capacity_path() const;   ///< its file

  /// History (and limits) under the execution context; limits only under the capacity context.
  Status record(const ContextObservation& observation);

  /// The execution context's file; nullopt when absent.
  std::optional<ContextRecord> execution_record() const;
  CapacityLimits capacity() const;  ///< the capacity context's limits
  /// recommend_from_capacity(capacity()).
  ContextRecommendation recommendation() const;

 private:
  HostContextStore store_;
  nlohmann::json execution_context_;
  nlohmann::json capacity_context_;
};

}  // namespace ddo::core
