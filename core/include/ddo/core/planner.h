/// \file
/// The planner: from a ModelInventory, a DynamicOffloadConfig and platform facts to a Plan that
/// says, for every module and tensor, where it lives: residents (Note [Auto block pattern],
/// Note [Spread order], Note [Balanced order]), pinning (packed pin admission:
/// docs/design/0007-named-profiles.md, section 4) and the disk tier (Note [Disk tier plan]).
///
/// make_plan is a pure function: no torch, no CUDA, no environment, no clock. The same inputs
/// give the same plan (nothing depends on hash-map order or pointer values), so plans can be cached
/// and compared, and every rule that fires leaves a Decision naming itself with its inputs, so a
/// user can see why a module is resident or a weight is not pinned.
///
/// ```
/// ddo::core::DynamicOffloadConfig config;
/// config.execution_mode = ExecutionMode::kLinearRuntime;
/// config.resident_module_patterns = {"auto"};
/// config.auto_budget_policy = AutoBudgetPolicy::kBalanced;
/// ddo::core::PlanContext ctx;
/// ctx.total_vram_bytes = 12 * (1LL << 30);
/// ddo::core::Plan plan = ddo::core::make_plan(inventory, config, ctx);
/// plan.block_pattern;                        // "^transformer_blocks\\.[0-9]+$"
/// plan.find_decision("balanced_policy");     // its inputs: total, headroom, candidates, ...
/// std::cout << plan.summary();
/// ```
///
/// See Note [Resident cost] and Note [Spread order] in planner_residency.cpp for what a
/// resident costs and how `spread` picks its candidates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/config.h"
#include "ddo/core/inventory.h"

namespace ddo::core {

/// Platform facts and caller-resolved inputs that are not configuration.
struct PlanContext {
  /// VRAM of the execution device (the caller applies vram_cap_gb or not; the planner also caps
  /// by config.vram_cap_gb when positive). 0 = unknown: the balanced policy then gives 0, and a
  /// fixed budget is used as given.
  std::int64_t total_vram_bytes = 0;
  /// Detected available host RAM. config.available_system_ram_gb, when set, wins (it simulates a
  /// smaller machine). Unknown: pin admission is not bounded by RAM.
  std::optional<std::int64_t> available_ram_bytes;
  /// A saved named-profile recommendation, already capped by the caller. Clamped to what the card
  /// can hold, like a manual budget (Note [Resident budget fits the card] in
  /// planner_residency.cpp).
  std::optional<std::int64_t> profile_budget_bytes;
  /// Who set config.resident_module_budget_gb, for the decision resident_budget_fit, which names
  /// it when the budget does not fit the card: e.g. "preset warm_process",
  /// "DDO_RESIDENT_MODULE_BUDGET_GB", "enable_offload override". Empty: named as the config field.
  std::string resident_budget_origin;
  /// Residency calibration run: forces the resident budget to 0 (seed).
  bool calibrating = false;
  /// Platform allows pinning (false e.g. under WSL with DDO_DISABLE_PIN_ON_WSL).
  bool pin_allowed = true;
  /// Staging bytes the engine will hold on the device; unset = config.staging_mb, else estimated.
  std::optional<std::int64_t> staging_bytes;
  /// Make every repeated block list a residency candidate, as the "auto_all" pattern token does.
  /// Stands in for a config field until one exists.
  bool all_block_lists = false;
  /// Measured GPU ms per step of residency candidates, by module name (a profile's
  /// candidate_compute_ms). With `spread` selection and a figure for every candidate, residents
  /// are placed by Note [Balanced order] on these figures; otherwise on an estimate, the same
  /// work for every candidate (Note [Estimated compute] in planner_residency.cpp).
  std::map<std::string, double> candidate_compute_ms;
  /// The streamed weights can be read again from a checkpoint every step (the adapter sets it when
  /// the loader supplies the weights). Only then may units stream from disk, and only then does
  /// the RAM admission bound host RAM without host_ram_cap_gb (Note [Disk tier plan] in
  /// planner_tiers.cpp).
  bool weights_in_file = false;
};

/// Where a module's weights live during the run.
enum class Placement {
  kResident,    ///< the whole module lives on the execution device
  kStreamed,    ///< its large weights are streamed; its small tensors moved once
  kDeviceOnce,  ///< nothing to stream: every tensor is moved to the device once
  kSkipped,     ///< skip_modules_pattern (or the route): left where the host put it
};

/// What happens to one tensor at setup.
enum class TensorAction {
  kResident,  ///< moved to the device with its resident module
  kStream,    ///< stays in host memory, streamed just in time
  kMoveOnce,  ///< small or not streamable: moved to the device once
  kKeep,      ///< its module is skipped: left where it is
};

/// "resident", "streamed", ...: the plan JSON's spelling.
const char* to_string(Placement placement);
const char* to_string(TensorAction action);  ///< the plan JSON's spelling

/// The plan for one tensor.
struct TensorPlan {
  TensorAction action = TensorAction::kMoveOnce;  ///< what setup does with it
  bool pin = false;                               ///< ddo pins this streamed tensor
  bool loader_pinned = false;  ///< streamed and already pinned by the loader; kept as it is
};

/// The plan for one module of the inventory.
struct ModulePlan {
  std::string name;                              ///< the module's dotted name
  Placement placement = Placement::kDeviceOnce;  ///< where its weights live
  bool always_resident = false;     ///< resident through always_resident_modules_pattern
  bool resident_candidate = false;  ///< matched resident_module_patterns (outermost match)
  std::vector<TensorPlan> tensors;  ///< parallel to ModuleInfo::tensors
};

/// (module index, tensor index) into the inventory.
struct TensorRef {
  std::size_t module = 0;                             ///< index into ModelInventory::modules
  std::size_t tensor = 0;                             ///< index into that module's tensors
  bool operator==(const TensorRef&) const = default;  ///< field by field
};

/// What the engine copies as one piece: one tensor (dynamic route), a block or a leaf module
/// (classic group routes).
struct StreamUnit {
  std::string name;                ///< for reports and timelines
  std::vector<TensorRef> tensors;  ///< model order
  std::int64_t bytes = 0;          ///< the sum of its tensors' bytes
  /// What the unit is: "tensor", "packed_layer" (a packed layer's role tensors), "leaf" (one
  /// module's weights) or "block"; the decision stream_grain says why.
  std::string grain;
  /// Where the engine reads it from every step: "host" (its host copy, pinned or pageable) or
  /// "disk" (the checkpoint, through the pinned disk ring; the decision disk_tier says why).
  std::string tier = "host";
};

/// One rule that fired, with the numbers it saw.
struct Decision {
  std::string name;       ///< the rule, e.g. "resident_budget_manual"
  nlohmann::json inputs;  ///< the figures the rule saw
  std::string detail;     ///< one line for humans: what it decided and why
};

/// The planner's answer for one model: a placement per module, an action per tensor, the units the
/// engine streams, the budgets, and every rule that fired.
struct Plan {
  ExecutionMode mode = ExecutionMode::kPlan;  ///< the runtime (resolve_execution_mode)
  Route route = Route::kDynamic;              ///< the route planned for
  bool execute = false;  ///< false in plan mode: placements are reported, nothing is moved
  bool packed = false;   ///< classified with the packed runtime's rules (kPackedRuntime)

  std::vector<ModulePlan> modules;  ///< parallel to ModelInventory::modules

  /// Residency.
  std::string block_pattern;                   ///< "" when no auto pattern was inferred
  std::vector<std::string> block_patterns;     ///< every inferred pattern (auto_all), best first
  std::vector<std::string> resident_patterns;  ///< resolved patterns used for candidates
  std::int64_t resident_budget_bytes = 0;      ///< device bytes residents may take
  std::int64_t resident_used_bytes = 0;  ///< resident-candidate bytes chosen (Note [Resident cost])
  std::int64_t resident_candidate_bytes = 0;  ///< bytes of every resident candidate
  std::int64_t always_resident_bytes = 0;     ///< on top of the budget
  std::int64_t move_once_bytes = 0;           ///< moved to the device once at setup
  std::int64_t streamed_bytes = 0;            ///< streamed every step
  std::int64_t skipped_bytes = 0;             ///< left where the host put them
  std::int64_t staging_estimate_bytes = 0;  ///< device bytes the copy scheduler will hold (staging)

  /// Pinning.
  std::int64_t pin_candidate_bytes = 0;  ///< streamed bytes not already pinned
  std::int64_t pin_budget_bytes = 0;     ///< budget for new pins
  std::int64_t pinned_bytes = 0;         ///< new pins
  std::int64_t loader_pinned_bytes = 0;  ///< streamed bytes the loader already pinned (kept)
  std::int64_t pin_excess_bytes = 0;     ///< packed: loader pins beyond the ceiling

  /// Host tiers (Note [Disk tier plan] in planner_tiers.cpp).
  /// Host RAM the streamed weights may take: host_ram_cap_gb, else with weights in a file what the
  /// RAM admission leaves (at least 1 byte); 0 = unbounded.
  std::int64_t host_ram_budget_bytes = 0;
  std::int64_t disk_bytes = 0;  ///< streamed bytes read from the checkpoint every step
  /// The pinned host ring the engine reads disk units into (Note [Disk ring] in working_set.h);
  /// 0 when nothing streams from disk.
  std::int64_t disk_ring_bytes = 0;

  std::vector<StreamUnit> stream_units;  ///< what the engine copies, model order
  std::vector<Decision> decisions;       ///< in the order the rules fired

  /// The first decision of that name; null when none fired.
  const Decision* find_decision(std::string_view name) const;
  /// True when a decision of that name fired.
  bool has_decision(std::string_view name) const { return find_decision(name) != nullptr; }
  /// Names of resident modules (placement kResident), model order.
  std::vector<std::string> resident_module_names() const;
  /// Streamed bytes read from host memory every step: streamed_bytes - disk_bytes.
  std::int64_t host_tier_bytes() const { return streamed_bytes - disk_bytes; }

  nlohmann::json to_json() const;  ///< the whole plan, for reports and tests
  /// One screen: totals, budgets and one line per decision.
  std::string summary() const;
};

/// The runtime a model runs under (one rule for the planner, the adapter and calibration):
/// linear_runtime on a model with packed layers (SDNQ's or another format's) becomes
/// kPackedRuntime, spelled sdnq_runtime (diffusers-dynamic-offloader picks the runtime from the
/// model); kPackedRuntime on a model without any throws kInvalidArgument; other modes are returned
/// as they are.
ExecutionMode resolve_execution_mode(ExecutionMode requested, const ModelInventory& inventory);

/// Builds the plan. Throws ddo::Error(kInvalidArgument) for a malformed pattern, a negative budget
/// or an invalid inventory, naming the value.
Plan make_plan(const ModelInventory& inventory, const DynamicOffloadConfig& config,
               const PlanContext& context);

/// The order in which `selection` takes items of the given sizes for `budget_bytes`
/// (Note [Spread order]); exposed for tests and the engine's own re-planning.
std::vector<std::size_t> selection_order(const std::vector<std::int64_t>& bytes,
                                         Selection selection, std::int64_t budget_bytes);

/// Note [Balanced order]: residents first, chosen so that the streamed bytes follow
/// `compute_ms` (one figure per item, model order); then the streamed items.
std::vector<std::size_t> balanced_order(const std::vector<std::int64_t>& bytes,
                                        const std::vector<double>& compute_ms,
                                        std::int64_t budget_bytes);

/// Greedy fill over `order`: takes each item that still fits and keeps going past those that do
/// not. Returns the chosen indices in `order` order.
std::vector<std::size_t> greedy_fill(const std::vector<std::size_t>& order,
                                     const std::vector<std::int64_t>& bytes,
                                     std::int64_t budget_bytes);

/// The module names that make a module a LoRA/PEFT adapter module (Note [Adapter modules] in
/// planner_patterns.cpp): PEFT's LoraLayer.adapter_layer_names (`lora_A`, `lora_B`,
/// `lora_embedding_A`, `lora_embedding_B`, `lora_magnitude_vector`) and diffusers' own
/// `lora_layer`.
const std::vector<std::string>& adapter_module_names();

/// The component of `module_name` (its dot-separated parts) that makes it an adapter module: the
/// first one equal to an adapter_module_names() entry, as a view into `module_name`; empty when
/// none is. A module inside an adapter module is one too.
///
/// ```
/// adapter_component("blocks.0.attn.to_q.lora_A.style");  // "lora_A"
/// adapter_component("blocks.0.attn.to_q.base_layer");    // ""
/// adapter_component("lora_up");                          // "" (a checkpoint key, not a module)
/// ```
std::string_view adapter_component(std::string_view module_name);

/// The one rule for adapter modules (Note [Adapter modules]): the planner keeps them resident
/// on top of the budget (decision `adapters_resident`), quantize= keeps them dense, and Python
/// places adapter tensors added after an attach (`ddo._C.is_adapter_module`).
inline bool is_adapter_module(std::string_view module_name) {
  return !adapter_component(module_name).empty();
}

/// The balanced policy's built-in VRAM headroom for a card of `total_vram_bytes`.
std::int64_t balanced_headroom_bytes(std::int64_t total_vram_bytes);

}  // namespace ddo::core
