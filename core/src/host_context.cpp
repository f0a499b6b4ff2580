#include "ddo/core/host_context.h"

#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "ddo/core/calibration.h"
#include "observation_history.h"

namespace ddo::core {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

Status data_loss(std::string message) {
  return Status(Code::kDataLoss, std::move(message));
}

// A caller's context is nested at most kMaxJsonDepth deep: copying, comparing and dumping a JSON
// value recurse once per level, and a context 100,000 levels deep overflowed the stack (Note
// [Bounded JSON] in profile_files.cpp). The check comes before the recursion into a level, so
// the walk itself stays within the bound.
json normalize_at(const json& value, const std::string& where, int depth = 0) {
  if ((value.is_array() || value.is_object()) && depth >= kMaxJsonDepth) {
    throw Error(Code::kInvalidArgument,
                fmt::format("{} is nested more than {} levels deep; a profile context holds at "
                            "most {} levels of arrays and objects (flatten it)",
                            where, kMaxJsonDepth, kMaxJsonDepth));
  }
  switch (value.type()) {
    case json::value_t::null:
    case json::value_t::boolean:
    case json::value_t::string:
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return value;
    case json::value_t::number_float: {
      const double number = value.get<double>();
      DDO_CHECK(std::isfinite(number), Code::kInvalidArgument, where, " is ", number,
                "; a profile context holds only finite numbers (write it as a string or drop it)");
      return value;
    }
    case json::value_t::array: {
      json out = json::array();
      for (std::size_t i = 0; i < value.size(); ++i) {
        out.push_back(normalize_at(value[i], fmt::format("{}[{}]", where, i), depth + 1));
      }
      return out;
    }
    case json::value_t::object: {
      // nlohmann::json objects are std::map-backed: inserting sorts the keys.
      json out = json::object();
      for (const auto& [key, item] : value.items()) {
        out[key] = normalize_at(item, fmt::format("{}.{}", where, key), depth + 1);
      }
      return out;
    }
    case json::value_t::binary:
      throw Error(Code::kInvalidArgument,
                  fmt::format("{} is binary data; a profile context holds only null, bool, number, "
                              "string, arrays and objects",
                              where));
    case json::value_t::discarded:
      break;
  }
  throw Error(Code::kInvalidArgument,
              fmt::format("{} is not a JSON value (a discarded parse result); pass a valid JSON "
                          "context",
                          where));
}

// A normalized context or details value of at most kMaxContextBytes as compact JSON, so that a
// file of 20 observations stays far below kMaxProfileFileBytes and can always be read back.
json normalize_bounded(const json& value, const std::string& where) {
  json out = normalize_at(value, where);
  const std::size_t bytes = canonical_json(out).size();
  DDO_CHECK(bytes <= kMaxContextBytes, Code::kInvalidArgument, where, " is ", bytes,
            " bytes as JSON, more than the ", kMaxContextBytes,
            " a profile context may hold; keep contexts to the facts that select a budget "
            "(model, GPU, resolution, steps)");
  return out;
}

Status parse_context_record(const std::string& content, ContextRecord* record) {
  json value;
  DDO_RETURN_IF_ERROR(parse_json_bounded(content, &value));
  return ContextRecord::from_json(value, record);
}

// A caller's observation or recommendation: a JSON object, normalized and bounded like a context.
json normalize_object(const json& value, const std::string& what) {
  DDO_CHECK(value.is_object(), Code::kInvalidArgument, "a profile ", what,
            " must be an object (a dict), not ", value.type_name());
  return normalize_bounded(value, what);
}

// `where` names the context in errors: "context", "execution_context", "capacity_context".
json normalize_context_as(const json& context, const std::string& where) {
  DDO_CHECK(context.is_object() && !context.empty(), Code::kInvalidArgument, "a profile ", where,
            " must be a non-empty object (a dict such as {\"model\": \"flux\", \"gpu\": "
            "\"4090\"}), not ",
            context.is_object() ? "an empty one" : context.type_name());
  return normalize_bounded(context, where);
}

}  // namespace

json normalize_context(const json& context) {
  return normalize_context_as(context, "context");
}

std::string context_key(const json& context) {
  return capacity_key(normalize_context(context));
}

std::string context_file_name(std::string_view key) {
  return profile_file_name(key);
}

fs::path context_path(const fs::path& directory, const json& context) {
  return directory / context_file_name(context_key(context));
}

json ContextRecord::to_json() const {
  json out{{"schema_version", kContextSchemaVersion},
           {"profile_key", context_key},
           {"updated_at", updated_at},
           {"context", context},
           {"observations", observations},
           {"capacity_limits", limits_to_json(capacity)}};
  if (recommendation) out["recommendation"] = *recommendation;
  for (const auto& [key, item] : extra.items()) {
    if (!out.contains(key)) out[key] = item;
  }
  return out;
}

Status ContextRecord::from_json(const json& value, ContextRecord* out) {
  if (!value.is_object()) return data_loss("the file is not a JSON object");
  if (!value.contains("schema_version")) {
    return data_loss("no schema_version; not a ddo context profile");
  }
  DDO_RETURN_IF_ERROR(version_field(value, "schema_version", "", kContextSchemaVersion,
                                    "record the context again"));
  ContextRecord r;
  auto context = value.find("context");
  auto key = value.find("profile_key");
  if (context == value.end() || key == value.end() || !key->is_string()) {
    return data_loss("context or profile_key is missing");
  }
  try {
    r.context = normalize_context(*context);
    r.context_key = core::context_key(r.context);
  } catch (const Error& e) {
    return data_loss(e.what());
  }
  if (r.context_key != key->get<std::string>()) {
    return data_loss("profile_key does not match the stored context");
  }
  if (auto it = value.find("updated_at"); it != value.end() && it->is_string()) {
    r.updated_at = it->get<std::string>();
  }
  if (auto it = value.find("observations"); it != value.end()) {
    if (!it->is_array()) return data_loss("observations is not an array");
    for (std::size_t i = 0; i < it->size(); ++i) {
      if (!(*it)[i].is_object()) {
        return data_loss(fmt::format("observations[{}] is not an object", i));
      }
      r.observations.push_back((*it)[i]);
    }
  }
  if (auto it = value.find("capacity_limits"); it != value.end()) {
    DDO_RETURN_IF_ERROR(limits_from_json(*it, &r.capacity));
  }
  if (auto it = value.find("recommendation"); it != value.end() && !it->is_null()) {
    // The library stores any object and its reader hands back only objects; keep whatever is
    // there so a rewrite loses nothing, and let readers check the type.
    r.recommendation = *it;
  }
  for (const auto& [k, item] : value.items()) {
    if (k != "schema_version" && k != "profile_key" && k != "updated_at" && k != "context" &&
        k != "observations" && k != "capacity_limits" && k != "recommendation") {
      r.extra[k] = item;
    }
  }
  *out = std::move(r);
  return Status::ok_status();
}

// ---------------------------------------------------------------------------------------------
// HostContextStore.
// ---------------------------------------------------------------------------------------------

HostContextStore::HostContextStore(HostContextStoreOptions options) : options_(std::move(options)) {
  if (!options_.warn) options_.warn = stderr_warning_sink();
}

fs::path HostContextStore::path_for(const json& context) const {
  return context_path(options_.directory, context);
}

std::optional<ContextRecord> HostContextStore::load(const json& context) const {
  const json normalized = normalize_context(context);
  const fs::path path = path_for(normalized);
  std::string content;
  Status status = read_text_file(path, &content);
  if (status.code() == Code::kNotFound) return std::nullopt;
  ContextRecord record;
  if (status.ok()) status = parse_context_record(content, &record);
  if (status.ok() && record.context != normalized) {
    status = data_loss("it holds another context");
  }
  if (!status.ok()) {
    options_.warn(
        fmt::format("ignoring context profile '{}': {}", path.string(), status.message()));
    return std::nullopt;
  }
  return record;
}

Status HostContextStore::record_observation(const json& context, const json& observation,
                                            const std::optional<json>& recommendation) {
  const json normalized = normalize_context(context);
  json stored;
  std::optional<json> stored_recommendation;
  try {
    stored = normalize_object(observation, "observation");
    if (recommendation) stored_recommendation = normalize_object(*recommendation, "recommendation");
  } catch (const Error& e) {
    return e.status();
  }
  // A limit this observation sets must read back (kMetricRange), or the file would be unreadable.
  CapacityLimits moved;
  update_limits_from_observation(moved, stored);
  for (const auto& [metric, limits] : moved) {
    const double value = limits.max_success.value_or(limits.min_failure.value_or(0.0));
    if (!(value >= kMetricRange.min && value <= kMetricRange.max)) {
      return Status(Code::kInvalidArgument,
                    fmt::format("observation capacity '{}' is {}; record capacity values of at "
                                "most 2^53 in magnitude",
                                metric, value));
    }
  }
  const std::string key = context_key(normalized);
  const fs::path path = path_for(normalized);
  const WarningSink& warn = options_.warn;
  auto update = [&](const std::optional<std::string>& current, std::string* next) -> Status {
    ContextRecord record;
    bool reused = false;
    if (current) {
      Status parsed = parse_context_record(*current, &record);
      if (parsed.ok() && record.context != normalized)
        parsed = data_loss("it holds another context");
      if (parsed.ok()) {
        reused = true;
      } else {
        fs::path kept;
        DDO_RETURN_IF_ERROR(keep_invalid_file(path, &kept));
        warn(
            fmt::format("replacing unreadable context profile '{}' ({}); its content is kept in "
                        "'{}'",
                        path.string(), parsed.message(), kept.string()));
      }
    }
    if (!reused) {
      record = ContextRecord{};
      record.context = normalized;
      record.context_key = key;
    }
    record.updated_at = utc_now_iso8601();
    internal::append_observation(stored, stored, &record.capacity, &record.observations);
    if (stored_recommendation) record.recommendation = *stored_recommendation;
    *next = record.to_json().dump(2) + "\n";
    return Status::ok_status();
  };
  return update_file_locked(path, update, options_.write, warn);
}

CapacityLimits HostContextStore::read_capacity(const json& context) const {
  std::optional<ContextRecord> record = load(context);
  return record ? record->capacity : CapacityLimits{};
}

// ---------------------------------------------------------------------------------------------
// DynamicOffloadProfileSession.
// ---------------------------------------------------------------------------------------------

DynamicOffloadProfileSession::DynamicOffloadProfileSession(HostContextStore store,
                                                           const json& execution_context,
                                                           const json& capacity_context)
    : store_(std::move(store)),
      execution_context_(normalize_context_as(execution_context, "execution_context")),
      capacity_context_(normalize_context_as(capacity_context, "capacity_context")) {}

std::string DynamicOffloadProfileSession::execution_key() const {
  return context_key(execution_context_);
}
std::string DynamicOffloadProfileSession::capacity_key() const {
  return context_key(capacity_context_);
}
fs::path DynamicOffloadProfileSession::execution_path() const {
  return store_.path_for(execution_context_);
}
fs::path DynamicOffloadProfileSession::capacity_path() const {
  return store_.path_for(capacity_context_);
}

Status DynamicOffloadProfileSession::record_success(const json& observation,
                                                    const std::optional<json>& recommendation) {
  DDO_RETURN_IF_ERROR(store_.record_observation(execution_context_, observation, recommendation));
  // When both contexts are the same, the one file already holds the observation.
  if (capacity_context_ == execution_context_) return Status::ok_status();
  return store_.record_observation(capacity_context_, observation);
}

DynamicOffloadProfileSession::AppliedSettings DynamicOffloadProfileSession::apply_settings(
    const DynamicOffloadSettings& settings, bool allow_recommendation) const {
  if (allow_recommendation && settings.config.resident_module_budget_gb > 0) {
    return {settings, std::nullopt};
  }
  AppliedSettings applied{settings, std::nullopt};
  if (std::optional<ContextRecord> record = execution_record()) {
    applied.recommendation = std::move(record->recommendation);
  }
  if (!allow_recommendation || !applied.recommendation) return applied;
  const auto it = applied.recommendation->find(kRecommendedBudgetKey);
  if (it == applied.recommendation->end() || !it->is_number()) return applied;
  const double value = it->get<double>();
  if (!std::isfinite(value) || value < 0) return applied;
  const double capped = cap_saved_budget_gb(value, settings.config.max_resident_module_budget_gb);
  throw_if_error(
      settings.with_overrides({{"resident_module_budget_gb", capped}}, &applied.settings));
  return applied;
}

std::optional<ContextRecord> DynamicOffloadProfileSession::execution_record() const {
  return store_.load(execution_context_);
}

std::optional<ContextRecord> DynamicOffloadProfileSession::capacity_record() const {
  return store_.load(capacity_context_);
}

}  // namespace ddo::core
