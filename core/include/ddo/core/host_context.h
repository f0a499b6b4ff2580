/// \file
/// The legacy host-context profile API, kept for existing integrations
/// (docs/design/0007-named-profiles.md, section 6).
///
/// A host that predates named profiles describes its workload as an arbitrary JSON "context"
/// (model, resolution, steps, GPU, ...) and records observations under it. The files are
/// diffusers-dynamic-offloader 0.1.0rc2's: a context is normalized (a non-empty object,
/// keys sorted, only JSON-safe values) and named by capacity_key (profile_store.h), the same rule
/// and folder as named profiles, whose identity is just another context. A file holds the
/// context, the last 20 observations as the host wrote them, the per-metric capacity limits and
/// the recommendation the host stored. The files use the locked, atomic write of
/// profile_store.h.
///
/// An observation is free-form JSON; {"status": "success" | "failure", "capacity": {"metric":
/// "tokens", "value": 4096}} also moves that metric's limits (update_limits_from_observation).
/// A session pairs an exact execution context (what ran) with a wider capacity context (what
/// the limits apply to, e.g. the same model and GPU at any prompt): record_success appends the
/// observation to both and stores the recommendation with the execution context.
///
/// ```
/// ddo::core::HostContextStore store({.directory = ddo::core::resolve_profile_dir(env)});
/// ddo::core::DynamicOffloadProfileSession session(
///     store, {{"model", "flux"}, {"gpu", "4090"}, {"steps", 28}},   // execution context
///     {{"model", "flux"}, {"gpu", "4090"}});                          // capacity context
/// ddo::Status s = session.record_success(
///     {{"status", "success"}, {"capacity", {{"metric", "tokens"}, {"value", 4096}}}},
///     nlohmann::json{{"profile_resident_module_budget_gb", 6.0}});
/// session.execution_record()->recommendation->at("profile_resident_module_budget_gb");  // 6.0
/// session.capacity_record()->capacity.at("tokens").max_success;                         // 4096
/// ```
#pragma once

#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/profile_store.h"
#include "ddo/core/settings.h"
#include "ddo/core/status.h"

namespace ddo::core {

/// The "schema_version" of a context file.
inline constexpr int kContextSchemaVersion = kProfileSchemaVersion;
/// One key space with named profiles (diffusers-dynamic-offloader's): "ddo-capacity-v1-<24 hex>".
inline constexpr std::string_view kContextFilePrefix = kProfileFilePrefix;
/// Observations kept per context, oldest dropped first.
inline constexpr std::size_t kMaxContextObservations = kMaxProfileObservations;
/// A context, an observation or a recommendation as compact JSON: 20 observations and a context
/// stay far below kMaxProfileFileBytes, so every file written reads back.
inline constexpr std::size_t kMaxContextBytes = std::size_t{64} << 10;

/// A copy of `context` with keys sorted, holding only null, bool, number, string, arrays and
/// objects, nested at most kMaxJsonDepth deep and at most kMaxContextBytes as JSON. Throws
/// ddo::Error (kInvalidArgument): for a context that is not a non-empty object
/// (diffusers-dynamic-offloader's rule), and naming the offending path for NaN or infinite numbers,
/// binary values, discarded values, deeper nesting or a larger context.
nlohmann::json normalize_context(const nlohmann::json& context);

/// capacity_key(normalize_context(context)): "ddo-capacity-v1-" and 24 hex digits, the key
/// diffusers-dynamic-offloader's dynamic_offload_profile_key gives. Throws like normalize_context.
std::string context_key(const nlohmann::json& context);
/// "<key>.json".
std::string context_file_name(std::string_view key);
/// The context's file in `directory`. Throws like normalize_context.
std::filesystem::path context_path(const std::filesystem::path& directory,
                                   const nlohmann::json& context);

/// One capacity file as diffusers-dynamic-offloader writes it. Observations and the recommendation
/// are the host's own JSON objects (normalized); fields ddo does not know are kept in `extra`.
struct ContextRecord {
  std::string context_key;  ///< context_key(context): the file name without ".json"
  nlohmann::json context;   ///< normalized
  std::string updated_at;   ///< UTC ISO-8601 of the last write
  std::vector<nlohmann::json> observations;      ///< oldest first, at most kMaxContextObservations
  CapacityLimits capacity;                       ///< per metric, from the observations
  std::optional<nlohmann::json> recommendation;  ///< an object, when one was stored
  /// Unknown top-level fields, written back unchanged.
  nlohmann::json extra = nlohmann::json::object();

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

  /// Under the file lock: appends `observation` (last kMaxContextObservations kept), moves the
  /// capacity limits by update_limits_from_observation and, when given, replaces the stored
  /// recommendation. Throws ddo::Error for an invalid context. kInvalidArgument when the
  /// observation or recommendation is not an object or not JSON-safe (NaN, deeper than
  /// kMaxJsonDepth, larger than kMaxContextBytes); kUnavailable names an unwritable directory.
  /// A present but invalid file is kept beside under a name of its own (keep_invalid_file)
  /// before it is replaced.
  Status record_observation(const nlohmann::json& context, const nlohmann::json& observation,
                            const std::optional<nlohmann::json>& recommendation = std::nullopt);

  /// The stored limits; empty when there is no file.
  CapacityLimits read_capacity(const nlohmann::json& context) const;

 private:
  HostContextStoreOptions options_;
};

/// Pairs an exact execution context with a wider capacity context (diffusers-dynamic-offloader's
/// DynamicOffloadProfileSession).
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

  /// Appends `observation` to both contexts' files (one file when they are equal) and stores
  /// `recommendation`, when given, with the execution context only.
  Status record_success(const nlohmann::json& observation,
                        const std::optional<nlohmann::json>& recommendation = std::nullopt);

  /// Settings with the stored resident budget applied, and the recommendation they came from.
  struct AppliedSettings {
    DynamicOffloadSettings settings;  ///< the settings, with the budget when one was applied
    std::optional<nlohmann::json> recommendation;  ///< the execution context's, when stored
  };
  /// Python's DynamicOffloadProfileSession.apply_settings: a positive manual
  /// resident_module_budget_gb wins (the settings unchanged, no recommendation). Otherwise the
  /// execution context's recommendation is returned and, with `allow_recommendation`, its
  /// `profile_resident_module_budget_gb` (a finite number >= 0; anything else is no budget) becomes
  /// the settings' resident_module_budget_gb, capped by cap_saved_budget_gb (calibration.h). Throws
  /// ddo::Error like DynamicOffloadSettings::with_overrides.
  AppliedSettings apply_settings(const DynamicOffloadSettings& settings,
                                 bool allow_recommendation = true) const;

  /// The execution context's file; nullopt when absent.
  std::optional<ContextRecord> execution_record() const;
  /// The capacity context's file; nullopt when absent.
  std::optional<ContextRecord> capacity_record() const;

 private:
  HostContextStore store_;
  nlohmann::json execution_context_;
  nlohmann::json capacity_context_;
};

}  // namespace ddo::core
