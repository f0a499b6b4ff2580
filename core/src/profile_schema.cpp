// The record schema: profile and host-context records to and from JSON, field by field with
// the ranges a file may hold, the canonical JSON that names a file (capacity_key), and the
// capacity limits an observation moves (Note [diffusers-dynamic-offloader's files]). Separate
// from the durable files (profile_files.cpp), which only move the bytes.
#include "ddo/core/profile_store.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "profile_store_internal.h"

namespace ddo::core {
using nlohmann::json;

using internal::data_loss;

namespace {

std::string range_text(const NumberRange& range) {
  return fmt::format("{:g} to {:g}{}{}", range.min, range.max, *range.unit ? " " : "", range.unit);
}

}  // namespace

// json numbers may be stored as integers when they are whole; a 1e400 literal already fails to
// parse.
Status checked_number(const json& value, std::string_view where, const NumberRange& range,
                      double* out) {
  if (!value.is_number()) {
    return data_loss(fmt::format("{} is {}, not a number", where, value.type_name()));
  }
  const double number = value.get<double>();
  if (!(number >= range.min && number <= range.max)) {
    return data_loss(fmt::format("{} is {}, outside {}; recalibrate or delete the file", where,
                                 value.dump(), range_text(range)));
  }
  *out = number;
  return Status::ok_status();
}

namespace {

// An optional number field: absent or null leaves *out and *present unchanged.
Status optional_number(const json& object, const char* key, std::string_view prefix,
                       const NumberRange& range, double* out, bool* present = nullptr) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return Status::ok_status();
  DDO_RETURN_IF_ERROR(checked_number(*it, fmt::format("{}{}", prefix, key), range, out));
  if (present != nullptr) *present = true;
  return Status::ok_status();
}

Status required_number(const json& object, const char* key, std::string_view prefix,
                       const NumberRange& range, double* out) {
  if (!object.contains(key)) return data_loss(fmt::format("{}{} is missing", prefix, key));
  return optional_number(object, key, prefix, range, out);
}

}  // namespace

// Compared in 64 bits: 4294967297 is not 1 (it was, when read as a 32-bit int).
Status version_field(const json& object, const char* key, std::string_view prefix, int expected,
                     std::string_view advice) {
  auto it = object.find(key);
  if (it == object.end()) return data_loss(fmt::format("{}{} is missing; {}", prefix, key, advice));
  bool matches = false;
  if (it->is_number_unsigned()) {
    matches = it->get<std::uint64_t>() == static_cast<std::uint64_t>(expected);
  } else if (it->is_number_integer()) {
    matches = it->get<std::int64_t>() == expected;
  } else {
    return data_loss(
        fmt::format("{}{} is {}, not an integer; {}", prefix, key, it->dump(), advice));
  }
  if (!matches) {
    return data_loss(fmt::format("{}{} is {}, not the supported version {}; {}", prefix, key,
                                 it->dump(), expected, advice));
  }
  return Status::ok_status();
}

namespace {

bool get_string(const json& object, const char* key, std::string* out) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return false;
  *out = it->get<std::string>();
  return true;
}

}  // namespace

// sha256_hex: sha256.cpp (Note [SHA-256 per platform]).

// Note [diffusers-dynamic-offloader's files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// diffusers-dynamic-offloader 0.1.0rc2 keeps named profiles and host
// contexts in one folder and one format, learned by running it (python/tests/test_compat.py
// writes with one and reads with the other):
//   file  "ddo-capacity-v1-" + sha256(json.dumps(context, sort_keys=True,
//         separators=(",", ":"))).hexdigest()[:24] + ".json"
//   body  {"capacity_limits": {metric: {"max_success": x, "min_failure": y}},
//          "context": {...}, "observations": [... last 20 ...], "profile_key": <file stem>,
//          "recommendation": {...} (only once one was stored), "schema_version": 1,
//          "updated_at": ISO-8601}
// A named profile is the context {"execution_mode", "identity_version": 2, "model_class",
// "name"} whose recommendation holds "profile_resident_module_budget_gb" (and, while an SDNQ
// probe is pending, "sdnq_probe_resident_budget_gb"). The library ignores fields it does not
// know, so ddo writes its own (measured_at, candidate_compute_ms, ...) beside the library's and
// keeps the library's fields it does not know when it rewrites a file. Only the key needs the
// text to match byte for byte: canonical_json below writes what Python's json.dumps writes.

namespace {

// Python's float repr (the 'r' format): the shortest digits that round-trip, positional when
// the decimal exponent is in [-4, 16), scientific otherwise, always with a '.' or an 'e'.
void append_python_float(std::string& out, double value) {
  if (std::isnan(value)) {
    out += "NaN";
    return;
  }
  if (std::isinf(value)) {
    out += value > 0 ? "Infinity" : "-Infinity";
    return;
  }
  char buffer[64];
  auto [end, ec] =
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  DDO_ASSERT(ec == std::errc(), "to_chars failed on a double");
  std::string_view text(buffer, static_cast<std::size_t>(end - buffer));
  if (text.front() == '-') {
    out.push_back('-');
    text.remove_prefix(1);
  }
  const std::size_t e = text.find('e');
  std::string digits(text.substr(0, e));
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exponent = 0;
  std::from_chars(text.data() + e + (text[e + 1] == '+' ? 2 : 1), text.data() + text.size(),
                  exponent);
  const int decpt = exponent + 1;  // digits before the decimal point
  const int ndigits = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out += digits.substr(0, 1);
    if (ndigits > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  } else if (decpt <= 0) {
    out += "0." + std::string(static_cast<std::size_t>(-decpt), '0') + digits;
  } else if (decpt < ndigits) {
    out += digits.substr(0, static_cast<std::size_t>(decpt)) + "." +
           digits.substr(static_cast<std::size_t>(decpt));
  } else {
    out += digits + std::string(static_cast<std::size_t>(decpt - ndigits), '0') + ".0";
  }
}

// Python's ensure_ascii string: \" \\ \b \f \n \r \t, other bytes outside ' '..'~' as \uXXXX
// (lower-case hex; UTF-16 surrogate pairs above U+FFFF).
void append_python_string(std::string& out, std::string_view text) {
  out.push_back('"');
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    std::uint32_t cp = 0;
    int length = 1;
    if (c < 0x80) {
      cp = c;
    } else if ((c & 0xe0) == 0xc0) {
      cp = c & 0x1f, length = 2;
    } else if ((c & 0xf0) == 0xe0) {
      cp = c & 0x0f, length = 3;
    } else if ((c & 0xf8) == 0xf0) {
      cp = c & 0x07, length = 4;
    } else {
      length = 0;
    }
    for (int k = 1; length > 0 && k < length; ++k) {
      const std::size_t at = i + static_cast<std::size_t>(k);
      const auto next = at < text.size() ? static_cast<unsigned char>(text[at]) : 0;
      if ((next & 0xc0) != 0x80) {
        length = 0;
        break;
      }
      cp = (cp << 6) | (next & 0x3f);
    }
    DDO_CHECK(length > 0, Code::kInvalidArgument,
              "a string holds bytes that are not UTF-8 (at byte ", i,
              "); profile contexts and files hold text only");
    i += static_cast<std::size_t>(length);
    switch (cp) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      default:
        break;
    }
    if (cp >= 0x20 && cp <= 0x7e) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x10000) {
      out += fmt::format("\\u{:04x}", cp);
    } else {
      const std::uint32_t v = cp - 0x10000;
      out += fmt::format("\\u{:04x}\\u{:04x}", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
    }
  }
  out.push_back('"');
}

// Iterative (an explicit stack), so that no input depth costs native stack (Note [Bounded JSON]).
void append_canonical(std::string& out, const json& root) {
  struct Frame {
    const json* value;
    json::const_iterator next;
    bool first = true;
  };
  std::vector<Frame> stack;
  auto emit = [&](const json& value) {
    switch (value.type()) {
      case json::value_t::null:
        out += "null";
        return;
      case json::value_t::boolean:
        out += value.get<bool>() ? "true" : "false";
        return;
      case json::value_t::number_integer:
        out += std::to_string(value.get<std::int64_t>());
        return;
      case json::value_t::number_unsigned:
        out += std::to_string(value.get<std::uint64_t>());
        return;
      case json::value_t::number_float:
        append_python_float(out, value.get<double>());
        return;
      case json::value_t::string:
        append_python_string(out, value.get_ref<const std::string&>());
        return;
      case json::value_t::array:
        out.push_back('[');
        stack.push_back({&value, value.begin()});
        return;
      case json::value_t::object:
        out.push_back('{');
        stack.push_back({&value, value.begin()});
        return;
      case json::value_t::binary:
      case json::value_t::discarded:
        break;
    }
    throw Error(Code::kInvalidArgument, "binary or discarded JSON values have no JSON text");
  };
  emit(root);
  while (!stack.empty()) {
    Frame& frame = stack.back();
    if (frame.next == frame.value->end()) {
      out.push_back(frame.value->is_object() ? '}' : ']');
      stack.pop_back();
      continue;
    }
    if (!frame.first) out.push_back(',');
    frame.first = false;
    const json::const_iterator item = frame.next++;
    if (frame.value->is_object()) {
      // nlohmann::json objects are std::map-backed: keys come in UTF-8 byte order, which is code
      // point order, which is Python's sort order for str.
      append_python_string(out, item.key());
      out.push_back(':');
    }
    emit(*item);  // may push a frame; `frame` is not used after this
  }
}

}  // namespace

std::string canonical_json(const json& value) {
  std::string out;
  append_canonical(out, value);
  return out;
}

std::string capacity_key(const json& normalized) {
  return fmt::format("{}{}", kProfileFilePrefix,
                     sha256_hex(canonical_json(normalized)).substr(0, kProfileKeyHexDigits));
}

void update_limits(CapacityLimits& limits, const std::string& metric, double value, bool success) {
  MetricLimits& entry = limits[metric];
  if (success) {
    if (!entry.max_success || value > *entry.max_success) entry.max_success = value;
  } else {
    if (!entry.min_failure || value < *entry.min_failure) entry.min_failure = value;
  }
}

void update_limits_from_observation(CapacityLimits& limits, const json& observation) {
  if (!observation.is_object()) return;
  auto status = observation.find("status");
  auto capacity = observation.find("capacity");
  if (status == observation.end() || !status->is_string() || capacity == observation.end() ||
      !capacity->is_object()) {
    return;
  }
  const std::string& state = status->get_ref<const std::string&>();
  if (state != "success" && state != "failure") return;
  auto metric = capacity->find("metric");
  auto value = capacity->find("value");
  if (metric == capacity->end() || !metric->is_string() ||
      metric->get_ref<const std::string&>().empty() || value == capacity->end() ||
      !(value->is_number() || value->is_boolean())) {
    return;
  }
  // A bool counts as 0 or 1, as Python's bool is an int (the library's arithmetic).
  const double number =
      value->is_boolean() ? (value->get<bool>() ? 1.0 : 0.0) : value->get<double>();
  if (!std::isfinite(number)) return;
  update_limits(limits, metric->get<std::string>(), number, state == "success");
}

json limits_to_json(const CapacityLimits& limits) {
  json out = json::object();
  for (const auto& [metric, entry] : limits) {
    json item = json::object();
    if (entry.max_success) item["max_success"] = *entry.max_success;
    if (entry.min_failure) item["min_failure"] = *entry.min_failure;
    out[metric] = std::move(item);
  }
  return out;
}

Status limits_from_json(const json& value, CapacityLimits* out, const NumberRange& range) {
  if (!value.is_object()) return data_loss("capacity_limits is not an object");
  CapacityLimits limits;
  for (const auto& [metric, item] : value.items()) {
    if (!item.is_object()) {
      return data_loss(fmt::format("capacity_limits '{}' is not an object", metric));
    }
    MetricLimits entry;
    const std::string prefix = fmt::format("capacity_limits.{}.", metric);
    double number = 0.0;
    bool present = false;
    DDO_RETURN_IF_ERROR(optional_number(item, "max_success", prefix, range, &number, &present));
    if (present) entry.max_success = number;
    present = false;
    DDO_RETURN_IF_ERROR(optional_number(item, "min_failure", prefix, range, &number, &present));
    if (present) entry.min_failure = number;
    limits[metric] = entry;
  }
  *out = std::move(limits);
  return Status::ok_status();
}

// ---------------------------------------------------------------------------------------------
// Records (Note [diffusers-dynamic-offloader's files]).
// ---------------------------------------------------------------------------------------------

namespace {

constexpr std::string_view kLibraryProbeKey = "sdnq_probe_resident_budget_gb";

bool is_known_kind(std::string_view kind) {
  return kind == kKindBaseline || kind == kKindPackedBaselineSafe ||
         kind == kKindPackedProbePending || kind == kKindPackedProbe;
}

// The fields of `object` whose names are not in `known`.
json unknown_fields(const json& object, std::initializer_list<std::string_view> known) {
  json out = json::object();
  for (const auto& [key, item] : object.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) out[key] = item;
  }
  return out;
}

// `base` with every field of `extra` that `base` does not set.
json with_extra(json base, const json& extra) {
  for (const auto& [key, item] : extra.items()) {
    if (!base.contains(key)) base[key] = item;
  }
  return base;
}

}  // namespace

json ProfileIdentity::to_json() const {
  return json{{"execution_mode", execution_mode},
              {"identity_version", identity_version},
              {"model_class", model_class},
              {"name", name}};
}

std::string profile_key(const ProfileIdentity& identity) {
  return capacity_key(identity.to_json());
}

std::string profile_file_name(std::string_view key) {
  return fmt::format("{}.json", key);
}

bool is_valid_profile_key(std::string_view key) {
  if (!key.starts_with(kProfileFilePrefix)) return false;
  const std::string_view hex = key.substr(kProfileFilePrefix.size());
  return hex.size() == kProfileKeyHexDigits && std::all_of(hex.begin(), hex.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool is_named_profile_context(const json& context) {
  if (!context.is_object() || context.size() != 4) return false;
  for (const char* key : {"name", "model_class", "execution_mode"}) {
    auto it = context.find(key);
    if (it == context.end() || !it->is_string()) return false;
  }
  auto version = context.find("identity_version");
  return version != context.end() && version->is_number_integer();
}

json ProfileRecommendation::to_json() const {
  json out{{kRecommendedBudgetKey, resident_budget_gb},
           {"profile_measurement_kind", profile_measurement_kind},
           {"peak_vram_gb", peak_vram_gb},
           {"total_vram_gb", total_vram_gb},
           {"headroom_gb", headroom_gb},
           {"measured_at", measured_at}};
  // The library tells a pending probe by this key alone.
  if (probe_pending) out[kLibraryProbeKey] = probe_budget_gb.value_or(resident_budget_gb);
  if (!probe_pending && probe_budget_gb) out["probe_budget_gb"] = *probe_budget_gb;
  if (safe_budget_gb) out["safe_budget_gb"] = *safe_budget_gb;
  if (!candidate_compute_ms.empty()) out["candidate_compute_ms"] = candidate_compute_ms;
  if (!weights.empty()) out["weights"] = weights;
  return with_extra(std::move(out), extra);
}

Status ProfileRecommendation::from_json(const json& value, ProfileRecommendation* out,
                                        const json& last_observation) {
  if (!value.is_object()) return data_loss("recommendation is not an object");
  constexpr std::string_view kPrefix = "recommendation.";
  ProfileRecommendation r;
  if (!value.contains(kRecommendedBudgetKey)) {
    return data_loss(fmt::format("recommendation.{} is missing", kRecommendedBudgetKey));
  }
  DDO_RETURN_IF_ERROR(required_number(value, kRecommendedBudgetKey.data(), kPrefix, kProfileGbRange,
                                      &r.resident_budget_gb));
  double number = 0;
  bool present = false;
  DDO_RETURN_IF_ERROR(
      optional_number(value, kLibraryProbeKey.data(), kPrefix, kProfileGbRange, &number, &present));
  if (present) {
    r.probe_pending = true;
    r.probe_budget_gb = number;
  }
  // What the library does not write comes from its last observation of the same run.
  const json empty = json::object();
  const json& observed = last_observation.is_object() ? last_observation : empty;
  if (!get_string(value, "profile_measurement_kind", &r.profile_measurement_kind)) {
    std::string kind;
    if (r.probe_pending) {
      r.profile_measurement_kind = std::string(kKindPackedProbePending);
    } else if (get_string(observed, "profile_measurement_kind", &kind) && is_known_kind(kind) &&
               kind != kKindPackedProbePending) {
      r.profile_measurement_kind = kind;
    } else {
      r.profile_measurement_kind = std::string(kKindBaseline);
    }
  }
  const std::string& kind = r.profile_measurement_kind;
  if (!is_known_kind(kind)) {
    return data_loss(fmt::format("unknown profile_measurement_kind '{}'", kind));
  }
  if (r.probe_pending != (kind == kKindPackedProbePending)) {
    return data_loss(fmt::format("recommendation.{} disagrees with its measurement kind '{}'",
                                 kLibraryProbeKey, kind));
  }
  for (auto [key, field] :
       {std::pair{"peak_vram_gb", &r.peak_vram_gb}, std::pair{"total_vram_gb", &r.total_vram_gb},
        std::pair{"headroom_gb", &r.headroom_gb}}) {
    const bool in_recommendation = value.contains(key) && !value[key].is_null();
    DDO_RETURN_IF_ERROR(optional_number(in_recommendation ? value : observed, key,
                                        in_recommendation ? kPrefix : "observations[-1].",
                                        kProfileGbRange, field));
  }
  if (!get_string(value, "measured_at", &r.measured_at)) {
    get_string(observed, "recorded_at", &r.measured_at);
  }
  present = false;
  DDO_RETURN_IF_ERROR(
      optional_number(value, "safe_budget_gb", kPrefix, kProfileGbRange, &number, &present));
  if (present) r.safe_budget_gb = number;
  if (!r.probe_pending) {
    present = false;
    DDO_RETURN_IF_ERROR(
        optional_number(value, "probe_budget_gb", kPrefix, kProfileGbRange, &number, &present));
    if (present) r.probe_budget_gb = number;
  }
  if (auto it = value.find("candidate_compute_ms"); it != value.end() && !it->is_null()) {
    if (!it->is_object()) return data_loss("recommendation.candidate_compute_ms is not an object");
    constexpr NumberRange kMs{0.0, kMaxProfileComputeMs, "ms"};
    for (const auto& [name, ms] : it->items()) {
      DDO_RETURN_IF_ERROR(
          checked_number(ms, fmt::format("recommendation.candidate_compute_ms[\"{}\"]", name), kMs,
                         &r.candidate_compute_ms[name]));
    }
  }
  if (auto it = value.find("weights"); it != value.end() && !it->is_null()) {
    if (!it->is_string() || it->get_ref<const std::string&>().size() > 256) {
      return data_loss("recommendation.weights is not a string of at most 256 bytes");
    }
    r.weights = it->get<std::string>();
  }
  r.extra =
      unknown_fields(value, {kRecommendedBudgetKey, kLibraryProbeKey, "profile_measurement_kind",
                             "peak_vram_gb", "total_vram_gb", "headroom_gb", "measured_at",
                             "safe_budget_gb", "probe_budget_gb", "candidate_compute_ms", "weights",
                             // ddo 0.1.0's own spellings, dropped on rewrite
                             "resident_budget_gb", "probe_pending"});
  *out = std::move(r);
  return Status::ok_status();
}

json ProfileObservation::to_json() const {
  json out{{"status", success ? "success" : "failure"},
           {"capacity", {{"metric", "resident_budget_gb"}, {"value", resident_budget_gb}}},
           {"recorded_at", recorded_at},
           {"profile_measurement_kind", profile_measurement_kind},
           {"resident_budget_gb", resident_budget_gb},
           {"peak_vram_gb", peak_vram_gb},
           {"total_vram_gb", total_vram_gb},
           {"headroom_gb", headroom_gb},
           {"recommended_budget_gb", recommended_budget_gb},
           {"measurement", measurement}};
  return with_extra(std::move(out), extra);
}

namespace {

// `prefix` names the observation in errors: "observations[3]." inside a record. Fields a library
// observation lacks keep their defaults (a library run's "capacity" is absent: its budget was 0).
Status observation_from_json(const json& value, const std::string& prefix,
                             ProfileObservation* out) {
  if (!value.is_object()) {
    return data_loss(fmt::format("{} is not an object", prefix.substr(0, prefix.size() - 1)));
  }
  ProfileObservation o;
  get_string(value, "recorded_at", &o.recorded_at);
  get_string(value, "profile_measurement_kind", &o.profile_measurement_kind);
  if (std::string status; get_string(value, "status", &status)) o.success = status != "failure";
  for (auto [key, field] :
       {std::pair{"peak_vram_gb", &o.peak_vram_gb},
        std::pair{"resident_budget_gb", &o.resident_budget_gb},
        std::pair{"total_vram_gb", &o.total_vram_gb}, std::pair{"headroom_gb", &o.headroom_gb},
        std::pair{"recommended_budget_gb", &o.recommended_budget_gb}}) {
    DDO_RETURN_IF_ERROR(optional_number(value, key, prefix, kProfileGbRange, field));
  }
  // Informational: ddo writes an object, the library a string; the reader bounded its depth
  // (Note [Bounded JSON]).
  if (auto it = value.find("measurement"); it != value.end()) o.measurement = *it;
  o.extra = unknown_fields(value, {"status", "capacity", "recorded_at", "profile_measurement_kind",
                                   "resident_budget_gb", "peak_vram_gb", "total_vram_gb",
                                   "headroom_gb", "recommended_budget_gb", "measurement"});
  *out = std::move(o);
  return Status::ok_status();
}

}  // namespace

Status ProfileObservation::from_json(const json& value, ProfileObservation* out) {
  return observation_from_json(value, "observation.", out);
}

json ProfileRecord::to_json() const {
  json history = json::array();
  for (const ProfileObservation& o : observations) history.push_back(o.to_json());
  json out{{"schema_version", kProfileSchemaVersion},
           {"profile_key", profile_key},
           {"updated_at", updated_at},
           {"context", identity.to_json()},
           {"observations", std::move(history)},
           {"capacity_limits", limits_to_json(capacity)}};
  if (recommendation) out["recommendation"] = recommendation->to_json();
  return with_extra(std::move(out), extra);
}

Status ProfileRecord::from_json(const json& value, ProfileRecord* out) {
  if (!value.is_object()) return data_loss("the file is not a JSON object");
  if (!value.contains("schema_version")) return data_loss("no schema_version; not a ddo profile");
  DDO_RETURN_IF_ERROR(
      version_field(value, "schema_version", "", kProfileSchemaVersion, "recalibrate"));
  ProfileRecord r;
  auto context = value.find("context");
  if (context == value.end() || !context->is_object()) return data_loss("context is missing");
  if (!is_named_profile_context(*context)) {
    return data_loss(
        "not a named profile: its context is not {name, model_class, identity_version, "
        "execution_mode} (a host context's file)");
  }
  get_string(*context, "name", &r.identity.name);
  get_string(*context, "model_class", &r.identity.model_class);
  get_string(*context, "execution_mode", &r.identity.execution_mode);
  DDO_RETURN_IF_ERROR(version_field(*context, "identity_version", "context.",
                                    kProfileIdentityVersion, "recalibrate"));
  r.identity.identity_version = kProfileIdentityVersion;
  if (!get_string(value, "profile_key", &r.profile_key) ||
      r.profile_key != core::profile_key(r.identity)) {
    return data_loss("profile_key does not match the stored context");
  }
  get_string(value, "updated_at", &r.updated_at);
  json last_observation;
  if (auto it = value.find("observations"); it != value.end()) {
    if (!it->is_array()) return data_loss("observations is not an array");
    for (std::size_t i = 0; i < it->size(); ++i) {
      ProfileObservation o;
      DDO_RETURN_IF_ERROR(observation_from_json((*it)[i], fmt::format("observations[{}].", i), &o));
      r.observations.push_back(std::move(o));
    }
    if (!it->empty()) last_observation = it->back();
  }
  if (auto it = value.find("capacity_limits"); it != value.end()) {
    DDO_RETURN_IF_ERROR(limits_from_json(*it, &r.capacity, kProfileGbRange));
  }
  if (auto it = value.find("recommendation"); it != value.end() && !it->is_null()) {
    ProfileRecommendation rec;
    DDO_RETURN_IF_ERROR(ProfileRecommendation::from_json(*it, &rec, last_observation));
    r.recommendation = std::move(rec);
  }
  r.extra = unknown_fields(value, {"schema_version", "profile_key", "updated_at", "context",
                                   "observations", "capacity_limits", "recommendation"});
  *out = std::move(r);
  return Status::ok_status();
}

json ProfileListing::to_json() const {
  json out{{"profile_key", profile_key},
           {"name", name},
           {"model_class", model_class},
           {"execution_mode", execution_mode},
           {"profile_measurement_kind", profile_measurement_kind},
           {"updated_at", updated_at},
           {"path", path.string()}};
  out["resident_budget_gb"] = resident_budget_gb ? json(*resident_budget_gb) : json(nullptr);
  if (!problem.empty()) out["problem"] = problem;
  return out;
}
}  // namespace ddo::core
