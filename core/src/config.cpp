#include "ddo/core/config.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <regex>
#include <type_traits>
#include <vector>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "config_fields.h"
#include "text.h"

namespace ddo::core {
namespace {

using nlohmann::json;

using text::normalize_token;

// The only spellings ddo writes or reads for its enums (config.h: Spelling).
constexpr std::array<Spelling<ExecutionMode>, 3> kModeSpellings = {{
    {"plan", ExecutionMode::kPlan},
    {"linear_runtime", ExecutionMode::kLinearRuntime},
    {"sdnq_runtime", ExecutionMode::kPackedRuntime},
}};
// A format-neutral name of the packed runtime, accepted wherever a mode is read and never
// written: "sdnq_runtime" stays the written spelling, as profile keys hash it.
constexpr std::array<Spelling<ExecutionMode>, 1> kModeAliases = {{
    {"packed_runtime", ExecutionMode::kPackedRuntime},
}};
constexpr std::array<Spelling<Route>, 5> kRouteSpellings = {{
    {"dynamic", Route::kDynamic},
    {"group_block", Route::kGroupBlock},
    {"group_leaf", Route::kGroupLeaf},
    {"device", Route::kDeviceMove},
    {"none", Route::kNone},
}};
// Route names of the diffusers offloading vocabulary, accepted wherever a route is read
// (parse_route: route=, DDO_<COMPONENT>_ROUTE, the config's route) and never written.
constexpr std::array<Spelling<Route>, 3> kRouteAliases = {{
    {"dynamic_offload", Route::kDynamic},
    {"linear_convolution", Route::kDynamic},         // the dynamic route streams Conv weights too
    {"diffusers_group_offload", Route::kGroupLeaf},  // offload_type's default, leaf_level
}};
constexpr std::array<Spelling<AutoBudgetPolicy>, 2> kPolicySpellings = {{
    {"off", AutoBudgetPolicy::kOff},
    {"balanced", AutoBudgetPolicy::kBalanced},
}};
constexpr std::array<Spelling<Selection>, 3> kSelectionSpellings = {{
    {"first", Selection::kFirst},
    {"spread", Selection::kSpread},
    {"largest", Selection::kLargest},
}};

template <typename E>
const char* spelling_of(std::span<const Spelling<E>> table, E value) {
  for (const auto& s : table) {
    if (s.value == value) return s.name;
  }
  return "unknown";
}

template <typename E>
Status parse_spelling(std::span<const Spelling<E>> table, const char* what, std::string_view text,
                      E* out) {
  const std::string token = normalize_token(text);
  for (const auto& s : table) {
    if (token == s.name) {
      *out = s.value;
      return Status::ok_status();
    }
  }
  std::string valid;
  for (const auto& s : table) {
    if (!valid.empty()) valid += ", ";
    valid += s.name;
  }
  return Status(Code::kInvalidArgument, internal::str_cat(what, " \"", text, "\" is not one of ",
                                                          valid, "; use one of those spellings"));
}

}  // namespace

// Note [Config field table]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// One table (config_fields.h) says, for every field of DynamicOffloadConfig, its spec name, its
// DDO_ variable (or none: code only), and for a number its unit and range. Everything that reads
// or checks a config is derived from it: `config_field_names`, `config_to_json`,
// `apply_overrides` (type from the member pointer, range from the table), `validate_config`, and
// the environment reader in settings.cpp. So a field added to the struct and to this table is
// named, serialised, overridable, read from its variable and range-checked the same way, and an
// out-of-range figure is an error that names where it came from (the DDO_ variable, the override
// key or the config field) and the range, whichever way it arrived.
//
// Ranges. Memory figures are bounded by kMaxMemoryGiB (64 TiB): more than any machine ddo plans
// for, and 2^46 bytes, so no figure and no sum of a few of them can leave int64 (a GiB figure of
// 1.6e10 would become -2^63 bytes through an undefined float-to-int cast). The simulated copy rate
// has a floor (a rate of 1e-9 GB/s would turn one copy into a hang) and 0 = unthrottled. The ratio
// is the one clamped field (docs/design/0006-configuration.md, section 2): out of [0, 1] it is
// clamped with a warning.
// The table is a function-local constexpr array (no static constructors).
namespace fields {
namespace {

constexpr double kMaxMemoryGiB = 65536.0;
constexpr double kMaxMemoryMiB = kMaxMemoryGiB * 1024.0;
constexpr double kMaxMemoryBytes = kMaxMemoryGiB * kGiB;
constexpr double kMinSimCopyGbps = 0.1;  // 1 GiB in about 11 s
constexpr double kMaxSimCopyGbps = 10000.0;
constexpr double kMaxPinWorkers = 1024;
constexpr double kMinHostRamCapGiB = 1e-6;

using C = DynamicOffloadConfig;

constexpr Field gib(const char* name, double C::*ref, const char* env) {
  return {.name = name, .ref = ref, .env = env, .unit = "GiB", .min = 0, .max = kMaxMemoryGiB};
}

constexpr auto kFields = std::to_array<Field>({
    {.name = "execution_device", .ref = &C::execution_device, .check = Check::kDeviceIndex},
    {.name = "offload_device", .ref = &C::offload_device},
    {.name = "skip_modules_pattern", .ref = &C::skip_modules_pattern, .check = Check::kPatterns},
    {.name = "always_resident_modules_pattern",
     .ref = &C::always_resident_modules_pattern,
     .env = "DDO_ALWAYS_RESIDENT_MODULE_PATTERNS",
     .check = Check::kPatterns},
    {.name = "small_tensor_threshold_bytes",
     .ref = &C::small_tensor_threshold_bytes,
     .env = "DDO_SMALL_TENSOR_THRESHOLD_KB",
     .unit = "bytes",
     .min = 0,
     .max = kMaxMemoryBytes,
     .env_scale = kKiB,
     .env_unit = "KiB"},
    {.name = "execution_mode", .ref = &C::execution_mode, .env = "DDO_EXECUTION_MODE"},
    {.name = "route", .ref = &C::route},
    {.name = "pin_cpu_memory", .ref = &C::pin_cpu_memory, .env = "DDO_PIN_CPU_MEMORY"},
    {.name = "allow_pin_memory_fallback",
     .ref = &C::allow_pin_memory_fallback,
     .env = "DDO_ALLOW_PIN_MEMORY_FALLBACK"},
    {.name = "pin_cpu_workers",
     .ref = &C::pin_cpu_workers,
     .env = "DDO_PIN_CPU_WORKERS",
     .unit = "a thread count",
     .min = 1,
     .max = kMaxPinWorkers},
    {.name = "cache_plan", .ref = &C::cache_plan, .env = "DDO_CACHE_PLAN"},
    {.name = "cache_pinned_weights",
     .ref = &C::cache_pinned_weights,
     .env = "DDO_CACHE_PINNED_WEIGHTS"},
    {.name = "pinned_weight_cache_namespace",
     .ref = &C::pinned_weight_cache_namespace,
     .env = "DDO_PINNED_WEIGHT_CACHE_NAMESPACE"},
    {.name = "auto_budget_policy", .ref = &C::auto_budget_policy, .env = "DDO_AUTO_BUDGET_POLICY"},
    gib("max_resident_module_budget_gb", &C::max_resident_module_budget_gb,
        "DDO_MAX_RESIDENT_MODULE_BUDGET_GB"),
    gib("auto_vram_headroom_gb", &C::auto_vram_headroom_gb, "DDO_AUTO_VRAM_HEADROOM_GB"),
    gib("profile_vram_headroom_gb", &C::profile_vram_headroom_gb, "DDO_PROFILE_VRAM_HEADROOM_GB"),
    gib("max_pin_weight_budget_gb", &C::max_pin_weight_budget_gb, "DDO_MAX_PIN_WEIGHT_BUDGET_GB"),
    {.name = "available_system_ram_gb",
     .ref = &C::available_system_ram_gb,
     .env = "DDO_AVAILABLE_SYSTEM_RAM_GB",
     .unit = "GiB",
     .min = 0,
     .max = kMaxMemoryGiB},
    gib("system_ram_headroom_gb", &C::system_ram_headroom_gb, "DDO_SYSTEM_RAM_HEADROOM_GB"),
    gib("pin_weight_budget_gb", &C::pin_weight_budget_gb, "DDO_PIN_WEIGHT_BUDGET_GB"),
    {.name = "pin_weight_budget_ratio",
     .ref = &C::pin_weight_budget_ratio,
     .env = "DDO_PIN_WEIGHT_BUDGET_RATIO",
     .unit = "a fraction",
     .min = 0,
     .max = 1,
     .clamp = true},
    {.name = "pin_weight_selection",
     .ref = &C::pin_weight_selection,
     .env = "DDO_PIN_WEIGHT_SELECTION"},
    {.name = "resident_module_selection",
     .ref = &C::resident_module_selection,
     .env = "DDO_RESIDENT_MODULE_SELECTION"},
    gib("resident_module_budget_gb", &C::resident_module_budget_gb,
        "DDO_RESIDENT_MODULE_BUDGET_GB"),
    {.name = "resident_module_patterns",
     .ref = &C::resident_module_patterns,
     .env = "DDO_RESIDENT_MODULE_PATTERNS",
     .check = Check::kPatternsOrAuto},
    {.name = "profile_name", .ref = &C::profile_name},
    {.name = "build_profile", .ref = &C::build_profile},
    {.name = "load_safetensors_backend",
     .ref = &C::load_safetensors_backend,
     .env = "DDO_LOAD_SAFETENSORS_BACKEND",
     .env_alias = "DDO_SAFETENSORS_BACKEND",
     .check = Check::kSafetensorsBackend},
    {.name = "verbose", .ref = &C::verbose, .env = "DDO_VERBOSE"},
    {.name = "show_profile", .ref = &C::show_profile, .env = "DDO_SHOW_PROFILE"},
    {.name = "disable_pin_on_wsl", .ref = &C::disable_pin_on_wsl, .env = "DDO_DISABLE_PIN_ON_WSL"},
    {.name = "use_side_streams", .ref = &C::use_side_streams},
    {.name = "staging_mb",
     .ref = &C::staging_mb,
     .env = "DDO_STAGING_MB",
     .unit = "MiB",
     .min = 0,
     .max = kMaxMemoryMiB},
    {.name = "prefetch_window_mb",
     .ref = &C::prefetch_window_mb,
     .env = "DDO_PREFETCH_WINDOW_MB",
     .unit = "MiB",
     .min = 0,
     .max = kMaxMemoryMiB},
    gib("vram_cap_gb", &C::vram_cap_gb, "DDO_VRAM_CAP_GB"),
    // A cap that rounds to 0 bytes would read as "no cap" (Plan::host_ram_budget_bytes 0), so
    // the smallest is 1e-6 GiB (about a KiB): below any real ring, above 0 bytes, and small
    // enough for tests that emulate a host for a model of a few KiB.
    {.name = "host_ram_cap_gb",
     .ref = &C::host_ram_cap_gb,
     .env = "DDO_HOST_RAM_CAP_GB",
     .unit = "GiB",
     .min = kMinHostRamCapGiB,
     .max = kMaxMemoryGiB,
     .zero_is_off = true},
    gib("sim_device_capacity_gb", &C::sim_device_capacity_gb, "DDO_SIM_DEVICE_GB"),
    {.name = "sim_copy_gbps",
     .ref = &C::sim_copy_gbps,
     .env = "DDO_SIM_COPY_GBPS",
     .unit = "GB/s",
     .min = kMinSimCopyGbps,
     .max = kMaxSimCopyGbps,
     .zero_is_off = true},
    // < 0 = no limit.
    {.name = "sim_pinnable_gb",
     .ref = &C::sim_pinnable_gb,
     .env = "DDO_SIM_PINNABLE_GB",
     .unit = "GiB",
     .min = -kMaxMemoryGiB,
     .max = kMaxMemoryGiB},
});

bool is_number_field(const Field& field) {
  return field.unit != nullptr;
}

// The number a field holds, when it holds one (an unset optional holds none).
std::optional<double> number_of(const DynamicOffloadConfig& config, const Field& field) {
  return std::visit(
      [&](auto member) -> std::optional<double> {
        using T = std::remove_cv_t<std::remove_reference_t<decltype(config.*member)>>;
        const T& slot = config.*member;
        if constexpr (std::is_same_v<T, int> || std::is_same_v<T, std::int64_t> ||
                      std::is_same_v<T, double>) {
          return static_cast<double>(slot);
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          return slot;
        } else {
          return std::nullopt;
        }
      },
      field.ref);
}

// A figure as users write it: 65536, 0.1, 6.8719476736e+10 (shortest round trip).
std::string figure(double value) {
  return fmt::format("{}", value);
}

// Note [Pattern limits]
// ~~~~~~~~~~~~~~~~~~~~~
// A pattern longer than kMaxPatternLength characters or nested deeper than kMaxPatternNesting
// groups is an error, never a stack overflow: patterns are checked against these limits before they
// are compiled anywhere (check_module_pattern is the one place). std::regex compiles by recursive
// descent: each nested group, and each term of a sequence, costs stack frames, so a pattern of
// about 20,000 nested parentheses overflows the stack and kills the process instead of raising an
// error. Measured with libstdc++ and an 8 MiB stack: 20,000 nested groups crash an ordinary build,
// 20,000 plain characters crash an ASan build (10,000 do not). Module patterns are a few dotted
// names or a short alternation; 1,000 characters and 32 levels of grouping leave room for any real
// one and a tenfold margin for smaller thread stacks.
constexpr std::size_t kMaxPatternLength = 1000;
constexpr std::size_t kMaxPatternNesting = 32;

// The deepest nesting of ( and [ in `pattern`, outside escapes and character classes.
std::size_t nesting_depth(std::string_view pattern) {
  std::size_t depth = 0, deepest = 0;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\') {
      ++i;  // the escaped character is a literal
      continue;
    }
    if (in_class) {
      if (c == ']') {
        in_class = false;
        --depth;
      }
      continue;
    }
    if (c == '[') {
      in_class = true;
      deepest = std::max(deepest, ++depth);
    } else if (c == '(') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ')' && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

// Note [Pattern repetition]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Before compiling, a pattern's states are counted with every repetition applied (x* and x+ as two
// copies): at most kMaxPatternStates, and each count or back-reference number has at most
// kMaxPatternCountDigits digits. A quantifier that repeats a quantifier (a**, a+{2}) is refused,
// and so is repeating a group that already repeats without bound ((a*)*, (a+){2}). The reasons:
// libstdc++'s std::regex compiles a counted repetition x{m,n} by copying x's states n times, so
// nested counts multiply: ((a{100}){100}){100} builds a million states; a count with more digits
// than a long holds overflows (signed overflow, undefined behaviour, in
// _Compiler::_M_cur_int_value, which also reads back-reference numbers; fuzz/patterns_fuzz.cpp
// reaches it with "\777777777000001048532141"); and std::regex_search backtracks exponentially on a
// repeated quantifier (a********* stalls the fuzzer for 10 s on one module name, and so does
// ((((a*)*)....*)*)). A module pattern repeats little; the limits leave room for any real one.
// Alternations that overlap inside one unbounded repeat, such as (a|aa)*, can still backtrack:
// std::regex has no linear-time engine, and module names are short.
constexpr std::size_t kMaxPatternStates = 10000;
constexpr std::size_t kMaxPatternCountDigits = 4;

// The states a pattern compiles to, counted term by term with one frame per open group (see
// Note [Pattern repetition]); counts are capped just above the limit so they cannot overflow.
class StateCounter {
 public:
  static constexpr std::size_t kOver = kMaxPatternStates + 1;

  void add_term(std::size_t states, bool unbounded = false) {
    Frame& f = stack_.back();
    f.total = capped(f.total + f.last);
    f.last = states;
    f.last_unbounded = unbounded;
    f.unbounded = f.unbounded || unbounded;
  }
  // Repeats the latest term `times` times, without bound when `unbounded`; false when that term
  // already repeats without bound.
  bool repeat_last(std::size_t times, bool unbounded) {
    Frame& f = stack_.back();
    if (f.last_unbounded && (unbounded || times > 1)) return false;
    f.last = capped(f.last * times);
    f.last_unbounded = f.last_unbounded || unbounded;
    f.unbounded = f.unbounded || unbounded;
    return true;
  }
  void open_group() { stack_.emplace_back(); }
  bool in_group() const { return stack_.size() > 1; }
  // A group closes into one term of its parent (its states plus one for the group itself).
  void close_group() {
    const Frame inner = stack_.back();
    stack_.pop_back();
    add_term(capped(inner.total + inner.last + 1), inner.unbounded);
  }
  std::size_t states() {
    while (in_group()) close_group();  // unbalanced: std::regex will say so; count what is there
    return capped(stack_.back().total + stack_.back().last);
  }

 private:
  struct Frame {
    std::size_t total = 0;        // states of the finished terms of this group
    std::size_t last = 0;         // states of the latest term, which a quantifier repeats
    bool unbounded = false;       // some term of this group repeats without bound (*, +, {m,})
    bool last_unbounded = false;  // ... the latest term does
  };
  static std::size_t capped(std::size_t v) { return std::min(v, kOver); }
  std::vector<Frame> stack_ = std::vector<Frame>(1);
};

// Reads the digits of `pattern` at `i`; false when there are more than kMaxPatternCountDigits.
bool read_count(std::string_view pattern, std::size_t& i, std::size_t* value) {
  std::size_t digits = 0;
  *value = 0;
  while (i < pattern.size() && pattern[i] >= '0' && pattern[i] <= '9') {
    if (++digits > kMaxPatternCountDigits) return false;
    *value = *value * 10 + static_cast<std::size_t>(pattern[i] - '0');
    ++i;
  }
  return true;
}

// Why `pattern` would compile to too many states or holds too large a number; "" when it is fine.
// Malformed syntax is left to std::regex, which reports it.
std::string repetition_problem(std::string_view pattern) {
  std::string nested =
      "repeats a group that already repeats without bound (such as (a*)* or (a+){2}), which "
      "backtracks exponentially";
  std::string too_long =
      internal::str_cat("holds a repetition count or back-reference with more than ",
                        kMaxPatternCountDigits, " digits");
  std::string stacked =
      "repeats a repetition directly (such as a** or a+{2}), which backtracks exponentially; "
      "JavaScript refuses it as well";
  StateCounter counter;
  bool after_quantifier = false;  // the previous token was *, +, {m,n} (or one of them and ?)
  for (std::size_t i = 0; i < pattern.size();) {
    const char c = pattern[i];
    const bool quantifier = c == '*' || c == '+' || c == '{';
    if (quantifier && after_quantifier) return stacked;
    after_quantifier = quantifier || (c == '?' && after_quantifier);
    if (c == '\\') {
      ++i;
      std::size_t number = 0;
      if (i < pattern.size() && pattern[i] >= '1' && pattern[i] <= '9') {
        if (!read_count(pattern, i, &number)) return too_long;
      } else {
        ++i;
      }
      counter.add_term(1);
    } else if (c == '[') {
      for (++i; i < pattern.size() && pattern[i] != ']'; ++i) {
        if (pattern[i] == '\\') ++i;
      }
      ++i;
      counter.add_term(1);
    } else if (c == '(') {
      counter.open_group();
      ++i;
    } else if (c == ')' && counter.in_group()) {
      counter.close_group();
      ++i;
    } else if (c == '{') {
      std::size_t low = 0, high = 0;
      ++i;
      if (!read_count(pattern, i, &low)) return too_long;
      high = low;
      bool open_ended = false;
      if (i < pattern.size() && pattern[i] == ',') {
        ++i;
        const std::size_t at = i;
        if (!read_count(pattern, i, &high)) return too_long;
        open_ended = i == at;
        if (open_ended) high = low + 1;  // x{m,}: m copies and a star
      }
      if (!counter.repeat_last(std::max<std::size_t>(high, 1), open_ended)) return nested;
      if (i < pattern.size() && pattern[i] == '}') ++i;
    } else if (c == '*' || c == '+') {
      if (!counter.repeat_last(2, true)) return nested;
      ++i;
    } else if (c == '|') {
      counter.add_term(0);
      ++i;
    } else {
      if (c != '?') counter.add_term(1);
      ++i;
    }
  }
  if (counter.states() > kMaxPatternStates) {
    return internal::str_cat("repeats to more than ", kMaxPatternStates,
                             " regex states (nested counts multiply)");
  }
  return {};
}

}  // namespace

std::span<const Field> config_fields() {
  return kFields;
}

const Field* find_field(std::string_view name) {
  for (const Field& field : kFields) {
    if (name == field.name) return &field;
  }
  return nullptr;
}

std::string range_problem(const Field& field, double value, bool in_env_unit) {
  DDO_ASSERT(is_number_field(field), field.name, " is not a number field");
  const bool scaled = in_env_unit && field.env_unit != nullptr;
  const double scale = scaled ? field.env_scale : 1.0;
  const char* unit = scaled ? field.env_unit : field.unit;
  const std::string range =
      fmt::format("{} in [{}, {}]{}", unit, figure(field.min / scale), figure(field.max / scale),
                  field.zero_is_off ? " or 0 (off)" : "");
  if (std::isnan(value)) return "is not a finite number; use " + range;
  if (field.clamp) return {};
  if (!std::isfinite(value)) return "is not a finite number; use " + range;
  const double v = value * scale;
  if (v >= field.min && v <= field.max) return {};
  if (field.zero_is_off && v == 0) return {};
  if (v < 0 && field.min >= 0) return "is negative; use " + range;
  return "is out of range; use " + range;
}

bool needs_clamp(const Field& field, double figure) {
  return field.clamp && !std::isnan(figure) && (figure < field.min || figure > field.max);
}

double clamped(const Field& field, double figure) {
  return std::clamp(figure, field.min, field.max);
}

Status check_module_pattern(std::string_view source, std::size_t index,
                            const std::string& pattern) {
  if (pattern.size() > kMaxPatternLength) {
    return Status(
        Code::kInvalidArgument,
        internal::str_cat(source, "[", index, "] is ", pattern.size(),
                          " characters long; a module pattern may have at most ", kMaxPatternLength,
                          " (Note [Pattern limits]): list several "
                          "shorter patterns instead of one long alternation"));
  }
  const std::size_t depth = nesting_depth(pattern);
  if (depth > kMaxPatternNesting) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat(source, "[", index, "] nests groups ", depth,
                                    " deep; a module pattern may nest at most ", kMaxPatternNesting,
                                    " deep; write it with fewer parentheses"));
  }
  if (const std::string problem = repetition_problem(pattern); !problem.empty()) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat(source, "[", index, "] ", problem,
                                    " (Note [Pattern repetition]); a module pattern may repeat at "
                                    "most ",
                                    kMaxPatternStates, " states; write it with smaller counts"));
  }
  try {
    std::regex compiled(pattern, std::regex::ECMAScript);
    (void)compiled;
  } catch (const std::regex_error& e) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat(source, "[", index, "]=\"", pattern,
                                    "\" is not a valid regular expression (ECMAScript syntax: ",
                                    e.what(), "); fix or escape it"));
  }
  return Status::ok_status();
}

Status check_field(const DynamicOffloadConfig& config, const Field& field,
                   std::string_view source) {
  if (is_number_field(field)) {
    if (const std::optional<double> value = number_of(config, field)) {
      const std::string problem = range_problem(field, *value);
      if (!problem.empty()) {
        return Status(Code::kInvalidArgument, internal::str_cat(source, "=", *value, " ", problem));
      }
    }
    return Status::ok_status();
  }
  switch (field.check) {
    case Check::kNone:
      return Status::ok_status();
    case Check::kSafetensorsBackend: {
      const std::string& backend = config.*std::get<std::string C::*>(field.ref);
      if (is_valid_safetensors_backend(backend)) return Status::ok_status();
      return Status(Code::kInvalidArgument,
                    internal::str_cat(source, "=\"", backend,
                                      "\" is not a safetensors backend; use mmap, pread, or \"\" "
                                      "(ddo's choice)"));
    }
    case Check::kDeviceIndex:
      return check_device_index(source, config.*std::get<std::string C::*>(field.ref));
    case Check::kPatterns:
    case Check::kPatternsOrAuto: {
      const auto& patterns = config.*std::get<std::vector<std::string> C::*>(field.ref);
      for (std::size_t i = 0; i < patterns.size(); ++i) {
        if (field.check == Check::kPatternsOrAuto &&
            (patterns[i] == "auto" || patterns[i] == "auto_all")) {
          continue;
        }
        DDO_RETURN_IF_ERROR(check_module_pattern(source, i, patterns[i]));
      }
      return Status::ok_status();
    }
  }
  return Status::ok_status();
}

std::optional<std::string> clamp_field(DynamicOffloadConfig* config, const Field& field,
                                       std::string_view source) {
  if (!field.clamp) return std::nullopt;
  double& slot = config->*std::get<double C::*>(field.ref);
  if (!needs_clamp(field, slot)) return std::nullopt;
  const double before = slot;
  slot = clamped(field, slot);
  return internal::str_cat(source, "=", before, " is outside [", figure(field.min), ", ",
                           figure(field.max), "]; clamped to ", figure(slot));
}

}  // namespace fields

namespace {

using fields::Field;
using fields::find_field;
using fields::kFields;
using C = DynamicOffloadConfig;

template <typename E>
json enum_json(E value) {
  return to_string(value);
}

Status parse_enum(std::string_view text, ExecutionMode* out) {
  return parse_execution_mode(text, out);
}
Status parse_enum(std::string_view text, Route* out) {
  return parse_route(text, out);
}
Status parse_enum(std::string_view text, AutoBudgetPolicy* out) {
  return parse_auto_budget_policy(text, out);
}
Status parse_enum(std::string_view text, Selection* out) {
  return parse_selection(text, out);
}

Status type_error(const char* field, const char* expected, const json& value) {
  return Status(Code::kInvalidArgument,
                internal::str_cat("config field ", field, " takes ", expected, ", got ",
                                  value.type_name(), " ", value.dump()));
}

// Sets one field from a JSON value, checking its type. The caller checks the range (check_field).
Status set_field(DynamicOffloadConfig* config, const Field& field, const json& value) {
  return std::visit(
      [&](auto member) -> Status {
        using T = std::remove_reference_t<decltype(config->*member)>;
        T& slot = config->*member;
        if constexpr (std::is_same_v<T, bool>) {
          if (!value.is_boolean()) return type_error(field.name, "true or false", value);
          slot = value.get<bool>();
        } else if constexpr (std::is_same_v<T, int> || std::is_same_v<T, std::int64_t>) {
          if (!value.is_number()) return type_error(field.name, "an integer", value);
          constexpr auto kMin = std::numeric_limits<T>::min();
          constexpr auto kMax = std::numeric_limits<T>::max();
          if (value.is_number_float()) {
            const double d = value.get<double>();
            // kMax + 1 is a power of two, exact in a double, so the bound is exact for int64.
            if (!std::isfinite(d) || d != std::trunc(d) || d < static_cast<double>(kMin) ||
                d >= static_cast<double>(kMax) + 1.0) {
              return type_error(field.name, "a whole number in range", value);
            }
            slot = static_cast<T>(d);
          } else if (value.is_number_unsigned()) {
            if (value.get<std::uint64_t>() > static_cast<std::uint64_t>(kMax)) {
              return type_error(field.name, "a whole number in range", value);
            }
            slot = static_cast<T>(value.get<std::uint64_t>());
          } else {
            const std::int64_t i = value.get<std::int64_t>();
            if (i < kMin || i > kMax) {
              return type_error(field.name, "a whole number in range", value);
            }
            slot = static_cast<T>(i);
          }
        } else if constexpr (std::is_same_v<T, double>) {
          if (!value.is_number()) return type_error(field.name, "a number", value);
          slot = value.get<double>();
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          if (value.is_null()) {
            slot.reset();
          } else if (value.is_number()) {
            slot = value.get<double>();
          } else {
            return type_error(field.name, "a number or null (detect)", value);
          }
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!value.is_string()) return type_error(field.name, "a string", value);
          slot = value.get<std::string>();
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (value.is_string()) {
            slot = {value.get<std::string>()};
          } else if (value.is_array() &&
                     std::all_of(value.begin(), value.end(),
                                 [](const json& item) { return item.is_string(); })) {
            slot = value.get<std::vector<std::string>>();
          } else {
            return type_error(field.name, "a list of strings", value);
          }
        } else {
          if (!value.is_string()) return type_error(field.name, "a string naming a value", value);
          T parsed{};
          Status s = parse_enum(value.get_ref<const std::string&>(), &parsed);
          if (!s.ok()) {
            return Status(Code::kInvalidArgument,
                          internal::str_cat("config field ", field.name, ": ", s.message()));
          }
          slot = parsed;
        }
        return Status::ok_status();
      },
      field.ref);
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::vector<std::string_view> split_words(std::string_view name) {
  std::vector<std::string_view> words;
  while (!name.empty()) {
    const std::size_t cut = name.find('_');
    if (cut != 0) words.push_back(name.substr(0, cut));
    if (cut == std::string_view::npos) break;
    name.remove_prefix(cut + 1);
  }
  return words;
}

// The field a user most likely meant: a close spelling ("verbos"), else the shortest field that
// has every word of the name ("pin_memory" -> pin_cpu_memory), else one containing it
// ("headroom").
std::optional<std::string> suggest_field(std::string_view unknown) {
  const std::string key = normalize_token(unknown);
  std::optional<std::string> best;
  std::size_t best_distance = std::max<std::size_t>(2, key.size() / 3) + 1;
  for (const Field& field : kFields) {
    const std::size_t d = edit_distance(key, field.name);
    if (d < best_distance) {
      best_distance = d;
      best = field.name;
    }
  }
  if (best) return best;
  const std::vector<std::string_view> words = split_words(key);
  for (const Field& field : kFields) {
    const std::vector<std::string_view> field_words = split_words(field.name);
    const bool has_all = !words.empty() && std::all_of(words.begin(), words.end(), [&](auto w) {
      return std::find(field_words.begin(), field_words.end(), w) != field_words.end();
    });
    if (has_all && (!best || best->size() > std::string_view(field.name).size())) {
      best = field.name;
    }
  }
  if (best || key.size() < 4) return best;
  for (const Field& field : kFields) {
    if (std::string_view(field.name).find(key) != std::string_view::npos) return field.name;
  }
  return std::nullopt;
}

}  // namespace

std::span<const Spelling<ExecutionMode>> execution_mode_spellings() {
  return kModeSpellings;
}
std::span<const Spelling<Route>> route_spellings() {
  return kRouteSpellings;
}
std::span<const Spelling<AutoBudgetPolicy>> auto_budget_policy_spellings() {
  return kPolicySpellings;
}
std::span<const Spelling<Selection>> selection_spellings() {
  return kSelectionSpellings;
}

const char* to_string(ExecutionMode mode) {
  return spelling_of(execution_mode_spellings(), mode);
}
const char* to_string(Route route) {
  return spelling_of(route_spellings(), route);
}
const char* to_string(AutoBudgetPolicy policy) {
  return spelling_of(auto_budget_policy_spellings(), policy);
}
const char* to_string(Selection selection) {
  return spelling_of(selection_spellings(), selection);
}

Status parse_execution_mode(std::string_view text, ExecutionMode* out) {
  const std::string token = normalize_token(text);
  for (const auto& alias : kModeAliases) {
    if (token == alias.name) {
      *out = alias.value;
      return Status::ok_status();
    }
  }
  return parse_spelling(execution_mode_spellings(), "execution mode", text, out);
}
Status parse_route(std::string_view text, Route* out) {
  const std::string token = normalize_token(text);
  for (const auto& alias : kRouteAliases) {
    if (token == alias.name) {
      *out = alias.value;
      return Status::ok_status();
    }
  }
  Status status = parse_spelling(route_spellings(), "route", text, out);
  if (status.ok()) return status;
  return Status(status.code(), internal::str_cat(status.message(),
                                                 " (or dynamic_offload, linear_convolution, "
                                                 "diffusers_group_offload)"));
}

Status resolve_route_arguments(const RouteArguments& args, std::optional<Route>* out) {
  DDO_ASSERT(out != nullptr);
  Route group = Route::kGroupLeaf;
  if (args.offload_type) {
    const std::string type = normalize_token(*args.offload_type);
    if (type == "block_level") {
      group = Route::kGroupBlock;
    } else if (type != "leaf_level") {
      return Status(Code::kInvalidArgument,
                    internal::str_cat("offload_type=\"", *args.offload_type,
                                      "\" is not valid; use \"block_level\" or \"leaf_level\""));
    }
  }
  std::optional<Route> route;
  const std::string token = args.route ? normalize_token(*args.route) : std::string("auto");
  if (token != "auto") {
    Route parsed = Route::kDynamic;
    if (Status s = parse_route(*args.route, &parsed); !s.ok()) {
      return Status(s.code(), internal::str_cat(s.message(), "; or auto (the settings decide)"));
    }
    // diffusers_group_offload follows offload_type; the others name one route.
    route = token == "diffusers_group_offload" ? group : parsed;
  }
  if (!route && args.group_offload.value_or(false)) route = group;
  if (!route && args.dynamic_offload.value_or(false)) route = Route::kDynamic;
  if (!route && args.dynamic_offload == false && args.group_offload == false) route = Route::kNone;
  *out = route;
  return Status::ok_status();
}
Status parse_auto_budget_policy(std::string_view text, AutoBudgetPolicy* out) {
  return parse_spelling(auto_budget_policy_spellings(), "auto budget policy", text, out);
}
Status parse_selection(std::string_view text, Selection* out) {
  return parse_spelling(selection_spellings(), "selection", text, out);
}

bool is_valid_safetensors_backend(std::string_view backend) {
  return backend.empty() || backend == "mmap" || backend == "pread";
}

std::vector<std::string> config_field_names() {
  std::vector<std::string> names;
  names.reserve(kFields.size());
  for (const Field& field : kFields) names.emplace_back(field.name);
  return names;
}

nlohmann::json config_to_json(const DynamicOffloadConfig& config) {
  json out = json::object();
  for (const Field& field : kFields) {
    out[field.name] = std::visit(
        [&](auto member) -> json {
          using T = std::remove_cv_t<std::remove_reference_t<decltype(config.*member)>>;
          const T& slot = config.*member;
          if constexpr (std::is_enum_v<T>) {
            return enum_json(slot);
          } else if constexpr (std::is_same_v<T, std::optional<double>>) {
            return slot ? json(*slot) : json(nullptr);
          } else {
            return json(slot);
          }
        },
        field.ref);
  }
  return out;
}

Status apply_overrides(DynamicOffloadConfig* config, const nlohmann::json& object,
                       std::vector<std::string>* warnings) {
  DDO_ASSERT(config != nullptr);
  if (object.is_null()) return Status::ok_status();
  if (!object.is_object()) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("config overrides must be an object of field names to values, "
                                    "got ",
                                    object.type_name(), " ", object.dump()));
  }
  // Collect every unknown name before failing, so one run shows all typos.
  std::vector<std::string> unknown;
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (find_field(it.key()) == nullptr) unknown.push_back(it.key());
  }
  if (!unknown.empty()) {
    std::string message = unknown.size() == 1 ? "unknown config field " : "unknown config fields ";
    for (std::size_t i = 0; i < unknown.size(); ++i) {
      if (i > 0) message += ", ";
      message += "\"" + unknown[i] + "\"";
      if (auto suggestion = suggest_field(unknown[i])) {
        message += " (did you mean \"" + *suggestion + "\"?)";
      }
    }
    message += "; valid fields: ";
    for (std::size_t i = 0; i < kFields.size(); ++i) {
      if (i > 0) message += ", ";
      message += kFields[i].name;
    }
    return Status(Code::kInvalidArgument, std::move(message));
  }

  DynamicOffloadConfig updated = *config;
  std::vector<std::string> clamp_warnings;
  for (auto it = object.begin(); it != object.end(); ++it) {
    const Field& field = *find_field(it.key());
    DDO_RETURN_IF_ERROR(set_field(&updated, field, it.value()));
    // The message names the override key, not only the field (Note [Config field table]).
    const std::string source = "override " + it.key();
    DDO_RETURN_IF_ERROR(fields::check_field(updated, field, source));
    if (auto warning = fields::clamp_field(&updated, field, source)) {
      clamp_warnings.push_back(std::move(*warning));
    }
  }
  DDO_RETURN_IF_ERROR(validate_config(updated));
  *config = std::move(updated);
  if (warnings != nullptr) {
    warnings->insert(warnings->end(), clamp_warnings.begin(), clamp_warnings.end());
  }
  return Status::ok_status();
}

Status validate_config(const DynamicOffloadConfig& config) {
  for (const Field& field : kFields) {
    DDO_RETURN_IF_ERROR(
        fields::check_field(config, field, internal::str_cat("config field ", field.name)));
  }
  return Status::ok_status();
}

Status check_module_pattern(std::string_view source, std::size_t index,
                            const std::string& pattern) {
  return fields::check_module_pattern(source, index, pattern);
}

std::int64_t effective_card_bytes(std::int64_t total_bytes, const DynamicOffloadConfig& config) {
  if (config.vram_cap_gb <= 0) return total_bytes;
  const std::int64_t cap = to_bytes_or_throw(config.vram_cap_gb, ByteUnit::kGiB, "vram_cap_gb");
  return total_bytes > 0 ? std::min(total_bytes, cap) : cap;
}

}  // namespace ddo::core
