/// \file
/// DynamicOffloadConfig: every knob of ddo, with its user-facing name and default
/// (docs/design/0006-configuration.md; the defaults and ranges: Note [Config field table] in
/// config.cpp).
///
/// A plain struct: code fills it, `DynamicOffloadSettings::from_env` (settings.h) resolves presets
/// and `DDO_*` environment variables into it. Units are in the names (GiB = 1024^3 bytes). This
/// header also defines the enum spellings users write (`to_string` / `parse_*`), the JSON view of a
/// config, and the per-field override mechanism behind `enable_offload(..., overrides)` and Python
/// keyword arguments: fields are set by their spec name with typed checks.
///
/// ```
/// ddo::core::DynamicOffloadConfig config;          // built-in defaults
/// config.execution_mode = ddo::core::ExecutionMode::kLinearRuntime;
/// config.resident_module_budget_gb = 4.0;          // manual budget: wins over profiles
/// ```
///
/// ```
/// ddo::Status s = ddo::core::apply_overrides(
///     &config, {{"pin_cpu_memory", true}, {"resident_module_selection", "largest"}});
/// // s.ok(); config.pin_cpu_memory == true
/// s = ddo::core::apply_overrides(&config, {{"pin_memory", true}});
/// // s.code() == kInvalidArgument: "unknown config field "pin_memory" (did you mean
/// // "pin_cpu_memory"?); valid fields: execution_device, ..."; config is unchanged
/// ```
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "ddo/core/device_name.h"  // check_device_index: execution_device
#include "ddo/core/status.h"
#include "ddo/core/units.h"  // kGiB, to_bytes: the unit of every *_gb / *_mb field

namespace ddo::core {

/// How weights reach the execution device (docs/design/0006-configuration.md, section 1).
enum class ExecutionMode {
  kPlan,           ///< build and report the plan; move nothing
  kLinearRuntime,  ///< "dynamic CUDA linear": stream dense Linear / Embedding / Conv weights
  /// Stream the packed tensors of packed layers (SDNQ's or another format's); dense fallback
  /// Linears stay resident. Spelled "sdnq_runtime" (the spelling diffusers-dynamic-offloader,
  /// config files and profile keys use); "packed_runtime" reads as the same mode.
  kPackedRuntime,
};

/// The classic routes, kept as baselines (presets diffusers_*_compat), and the dynamic route.
enum class Route {
  kDynamic,     ///< ddo's dynamic offload (the default)
  kGroupBlock,  ///< classic block-group streaming: one block per group, one-group prefetch
  kGroupLeaf,   ///< classic leaf streaming: one leaf module per group, one-group prefetch
  kDeviceMove,  ///< move the whole component to the execution device once
  kNone,        ///< leave the component where the host put it
};

/// How the resident budget is chosen when neither a manual budget nor a profile sets it: off
/// (budget 0: everything streamable streams) or balanced (what the card holds after a headroom,
/// the always-resident and move-once tensors and the staging area).
enum class AutoBudgetPolicy { kOff, kBalanced };

/// Order in which candidates are taken for a budget (resident modules, pinned weights).
enum class Selection { kFirst, kSpread, kLargest };

/// Every setting of an offload, by its spec name; settings.h resolves one from defaults, a preset,
/// DDO_* variables and overrides. Ranges: validate_config().
struct DynamicOffloadConfig {
  /// Devices. "cuda:N" for a GPU; "sim" / "sim:N" for the host-simulation device; "cpu" is valid
  /// only for plan mode (calibration on cpu is an error: docs/design/0007-named-profiles.md,
  /// section 3).
  std::string execution_device = "cuda:0";
  /// (spec) Accepted and reported; ddo keeps weights that are not on the device in host memory.
  std::string offload_device = "cpu";

  /// Module selection. Regexes, searched (not fully matched) in dotted module names.
  std::vector<std::string> skip_modules_pattern;
  /// Modules kept on the execution device whatever the budget: small ones every step reads.
  std::vector<std::string> always_resident_modules_pattern = {
      R"((^|\.)(proj_in|time_embed|prompt_adaln|norm_out|proj_out)(\.|$))"};
  /// Tensors up to this size are moved once instead of streamed.
  std::int64_t small_tensor_threshold_bytes = std::int64_t{16} * 1024;

  ExecutionMode execution_mode = ExecutionMode::kPlan;  ///< plan only, or which runtime streams
  Route route = Route::kDynamic;                        ///< dynamic offload or a classic route

  /// Pinned host memory.
  bool pin_cpu_memory = false;
  bool allow_pin_memory_fallback = true;  ///< false: a pinning failure is an error
  int pin_cpu_workers = 1;                ///< >= 1
  /// DDO_CACHE_PLAN: reuse the plan of the same inventory, settings and card in this process
  /// (the adapter's plan cache, ddo/torch/weight_cache.h).
  bool cache_plan = true;
  /// DDO_CACHE_PINNED_WEIGHTS: remove() keeps the pinned host copy of the streamed weights for
  /// the next attach of the same model in this process (ddo/torch/weight_cache.h).
  bool cache_pinned_weights = false;
  std::string pinned_weight_cache_namespace;  ///< separates cache entries of unrelated callers

  /// Budgets.
  AutoBudgetPolicy auto_budget_policy = AutoBudgetPolicy::kOff;
  double max_resident_module_budget_gb = 6.0;     ///< 0 = uncapped
  double auto_vram_headroom_gb = 0.0;             ///< 0 = built-in table
  double profile_vram_headroom_gb = 1.0;          ///< finite, >= 0
  double max_pin_weight_budget_gb = 0.0;          ///< 0 = none
  std::optional<double> available_system_ram_gb;  ///< unset = detected
  double system_ram_headroom_gb = 6.0;            ///< host RAM left free when pinning
  /// Bounds new pins, with pin_weight_budget_ratio and max_pin_weight_budget_gb (the smallest
  /// bound that is set wins); 0 = no bound from this field.
  double pin_weight_budget_gb = 0.0;
  double pin_weight_budget_ratio = 0.0;  ///< clamped to [0, 1]
  /// Which weights are pinned first when not all can be.
  Selection pin_weight_selection = Selection::kSpread;
  /// Which candidates become resident first.
  Selection resident_module_selection = Selection::kSpread;
  double resident_module_budget_gb = 0.0;  ///< manual budget; positive wins over profiles and auto
  std::vector<std::string> resident_module_patterns;  ///< "auto" infers the repeated block list

  /// Named workload profiles (code only).
  std::string profile_name;
  bool build_profile = false;  ///< this run calibrates (saves a recommendation under profile_name)

  /// Loading.
  std::string load_safetensors_backend;  ///< "", "mmap", "pread"

  /// Reporting.
  bool verbose = false;      ///< DDO_VERBOSE: setup phases and planner decisions on stderr
  bool show_profile = true;  ///< DDO_SHOW_PROFILE: the one-line profile report after profile_run()

  /// Platform facts acting below the preset.
  bool disable_pin_on_wsl = true;  ///< DDO_DISABLE_PIN_ON_WSL
  bool use_side_streams = true;    ///< false: copies on the compute stream (wsl_compat)

  /// Engine knobs (new in ddo; DDO_ variables in the same style).
  double staging_mb = 0.0;          ///< DDO_STAGING_MB: fixed staging area; 0 = from the plan
  double prefetch_window_mb = 0.0;  ///< DDO_PREFETCH_WINDOW_MB: bytes in flight ahead; 0 = auto
  double vram_cap_gb = 0.0;         ///< DDO_VRAM_CAP_GB: emulate a smaller card; 0 = off
  /// DDO_HOST_RAM_CAP_GB: emulate a host where ddo may hold at most this much RAM for the streamed
  /// weights (their pinned and pageable host copies and the disk ring); 0 = off. Weights that the
  /// loader reads from a checkpoint and that do not fit stay in the file and are read every step
  /// (the planner's disk tier, Note [Disk tier plan] in planner_tiers.cpp); their pages are dropped
  /// from the page cache as they are read, so they are read from the drive every step, as on the
  /// host the cap stands for. Residents and move-once tensors live on the device and do not count.
  double host_ram_cap_gb = 0.0;
  double sim_device_capacity_gb = 0.0;  ///< DDO_SIM_DEVICE_GB: capacity of the "sim" device; 0 = 8
  double sim_copy_gbps = 0.0;  ///< DDO_SIM_COPY_GBPS: simulated link speed; 0 = unthrottled
  /// DDO_SIM_PINNABLE_GB: pinning fails above this many GiB (on "sim", and on CUDA too, to test
  /// the pin fallback on a real card); < 0 = no limit.
  double sim_pinnable_gb = -1.0;
};

/// The spellings of the spec: plan, linear_runtime, sdnq_runtime (kPackedRuntime; parse_* also
/// reads packed_runtime); dynamic, group_block,
/// group_leaf, device, none; off, balanced; first, spread, largest.
///
/// One table per enum (config.cpp) is the only place a spelling is written: `to_string`, the
/// `parse_*` functions, the config JSON, the plan's JSON and report, and the settings reader all go
/// through it, so whatever ddo writes reads back (`parse_route(to_string(r))` gives r for every r).
template <typename E>
struct Spelling {
  const char* name;  ///< the spelling
  E value;           ///< the value it stands for
};
/// Every value of each enum with its spelling, in the order error messages list them.
std::span<const Spelling<ExecutionMode>> execution_mode_spellings();
std::span<const Spelling<Route>> route_spellings();  ///< see execution_mode_spellings
/// See execution_mode_spellings.
std::span<const Spelling<AutoBudgetPolicy>> auto_budget_policy_spellings();
std::span<const Spelling<Selection>> selection_spellings();  ///< see execution_mode_spellings

/// The spelling of a value, from the tables above.
const char* to_string(ExecutionMode mode);
const char* to_string(Route route);              ///< see to_string(ExecutionMode)
const char* to_string(AutoBudgetPolicy policy);  ///< see to_string(ExecutionMode)
const char* to_string(Selection selection);      ///< see to_string(ExecutionMode)

/// Parse the spellings above (case-insensitive, surrounding blanks ignored). On failure `out` is
/// unchanged and the kInvalidArgument message lists the valid spellings.
Status parse_execution_mode(std::string_view text, ExecutionMode* out);
/// See parse_execution_mode; also accepts dynamic_offload and linear_convolution (kDynamic) and
/// diffusers_group_offload (kGroupLeaf), the diffusers offloading vocabulary, wherever a route is
/// read.
Status parse_route(std::string_view text, Route* out);
/// See parse_execution_mode.
Status parse_auto_budget_policy(std::string_view text, AutoBudgetPolicy* out);
Status parse_selection(std::string_view text, Selection* out);  ///< see parse_execution_mode

/// The route arguments of the diffusers-style entry points (Python's enable_offload: route=,
/// group_offload=, dynamic_offload=, offload_type=); every member is optional.
struct RouteArguments {
  std::optional<std::string> route{};         ///< a route (parse_route) or "auto"
  std::optional<bool> group_offload{};        ///< true: the group route offload_type names
  std::optional<bool> dynamic_offload{};      ///< true: dynamic
  std::optional<std::string> offload_type{};  ///< "block_level" or "leaf_level" (the default)
};

/// The one route those arguments ask for, or nullopt (the settings decide): `route` wins unless
/// it is "auto", and diffusers_group_offload follows offload_type; else group_offload=true gives
/// the group route, dynamic_offload=true kDynamic, both false kNone. kInvalidArgument names the
/// bad argument and the valid values; `out` is unchanged then.
///
/// ```
/// std::optional<Route> r;
/// resolve_route_arguments({.group_offload = true, .offload_type = "block_level"}, &r);
/// // r == Route::kGroupBlock
/// ```
Status resolve_route_arguments(const RouteArguments& args, std::optional<Route>* out);

/// The valid values of `load_safetensors_backend`: "" (ddo chooses), "mmap", "pread".
bool is_valid_safetensors_backend(std::string_view backend);

/// Every field's spec name, in declaration order; the keys of `config_to_json` and
/// `apply_overrides`.
std::vector<std::string> config_field_names();

/// Every field by its spec name. Enums are their spellings; an unset
/// `available_system_ram_gb` is null.
nlohmann::json config_to_json(const DynamicOffloadConfig& config);

/// Sets the fields named by the keys of `object` (a JSON object), with typed checks: booleans take
/// true/false, numbers any JSON number (integer fields reject fractions), strings a string, lists
/// an array of strings or one string, enums their spellings, `available_system_ram_gb` also null
/// (= detect). Each number must lie in its field's range (validate_config); an error names the
/// override key, the value and the range. `pin_weight_budget_ratio` is clamped to [0, 1], and a
/// clamp appends a warning naming the key to `warnings` (when given). Unknown names fail with
/// kInvalidArgument listing all of them, with suggestions and the valid names. All or nothing: on
/// any error `config` and `warnings` are unchanged.
Status apply_overrides(DynamicOffloadConfig* config, const nlohmann::json& object,
                       std::vector<std::string>* warnings = nullptr);

/// Checks every field against its rule in the field table (Note [Config field table] in
/// config.cpp): each number finite and in its range (memory figures up to 64 TiB, so every
/// conversion to bytes fits; pin_cpu_workers in [1, 1024]; sim_copy_gbps 0 or in [0.1, 10000];
/// host_ram_cap_gb 0 or in [1e-06, 65536];
/// pin_weight_budget_ratio any number but NaN, as it is clamped where used), a known safetensors
/// backend, module patterns within the pattern limits that compile as ECMAScript regexes, and an
/// execution_device index in range (check_device_index). Messages start with
/// "config field <name>" and say what to write.
Status validate_config(const DynamicOffloadConfig& config);

/// The check every module pattern (skip, always-resident, resident, the inferred block patterns)
/// passes before std::regex compiles it: at most 1,000 characters and 32 levels of nested groups
/// (deeper input overflowed the stack inside std::regex and killed the process), and valid
/// ECMAScript. The message names `source`[`index`] and the limit.
///
/// ```
/// check_module_pattern("skip_modules_pattern", 0, std::string(20000, '(')).message();
/// // "skip_modules_pattern[0] is 20000 characters long; a module pattern may have at most 1000
/// ..."
/// ```
Status check_module_pattern(std::string_view source, std::size_t index, const std::string& pattern);

/// The card ddo plans for and measures against, in bytes: the device's `total_bytes` capped by
/// `config.vram_cap_gb` when that is set (> 0), the cap alone when the total is unknown (<= 0).
/// The one rule every backend, the planner's inputs and the loader's pins use.
///
/// ```
/// config.vram_cap_gb = 8;
/// effective_card_bytes(std::int64_t{80} << 30, config);  // 8 GiB
/// effective_card_bytes(0, config);                       // 8 GiB: no total known
/// ```
std::int64_t effective_card_bytes(std::int64_t total_bytes, const DynamicOffloadConfig& config);

}  // namespace ddo::core
