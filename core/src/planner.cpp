#include "ddo/core/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "planner_internal.h"

// The planner's entry points and the order of its phases; each phase lives in its own file
// (planner_internal.h lists them).

namespace ddo::core {
namespace planner_internal {

nlohmann::json names_json(const std::vector<std::string>& names, std::size_t limit) {
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t i = 0; i < names.size() && i < limit; ++i) out.push_back(names[i]);
  if (names.size() > limit) out.push_back(fmt::format("... {} more", names.size() - limit));
  return out;
}

void Planner::check_inputs() const {
  // The config's rules live in one place, validate_config; only the context is checked here.
  throw_if_error(validate_config(config_));
  DDO_CHECK(!ctx_.profile_budget_bytes || *ctx_.profile_budget_bytes >= 0, Code::kInvalidArgument,
            "profile budget of ", ctx_.profile_budget_bytes.value_or(0),
            " bytes is negative; the caller must clamp the recommendation at 0");
  DDO_CHECK(ctx_.total_vram_bytes >= 0, Code::kInvalidArgument,
            "total_vram_bytes=", ctx_.total_vram_bytes, " is negative");
}

void Planner::index_parents() {
  // An ordered map used for lookups only; nothing iterates it.
  std::map<std::string_view, std::size_t> index;
  for (std::size_t m = 0; m < n_; ++m) index.emplace(name_of(m), m);
  parent_.assign(n_, std::nullopt);
  for (std::size_t m = 0; m < n_; ++m) {
    std::string_view name = name_of(m);
    if (name.empty()) continue;
    while (true) {
      std::size_t dot = name.rfind('.');
      name = dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
      auto it = index.find(name);
      if (it != index.end()) {
        parent_[m] = it->second;
        break;
      }
      if (name.empty()) break;
    }
  }
}

Plan Planner::run() {
  throw_if_error(inv_.validate());
  check_inputs();
  plan_.mode = config_.execution_mode;
  plan_.route = config_.route;
  plan_.execute = config_.execution_mode != ExecutionMode::kPlan;
  const bool has_packed = inv_.has_packed_layers();
  const ExecutionMode effective = resolve_execution_mode(config_.execution_mode, inv_);
  plan_.packed = effective == ExecutionMode::kPackedRuntime ||
                 (config_.execution_mode == ExecutionMode::kPlan && has_packed);
  if (effective != config_.execution_mode) {
    plan_.mode = effective;
    // The decision's name follows the runtime's spelling (sdnq_runtime, config.h).
    decide("sdnq_runtime_auto", {{"requested", to_string(config_.execution_mode)}},
           fmt::format("the model has packed layers: their packed tensors stream with the {} rules",
                       to_string(ExecutionMode::kPackedRuntime)));
  }
  if (config_.execution_mode == ExecutionMode::kPlan) {
    decide("plan_mode",
           {{"classified_as", to_string(plan_.packed ? ExecutionMode::kPackedRuntime
                                                     : ExecutionMode::kLinearRuntime)}},
           "plan mode: placements are reported, nothing is moved");
  }
  index_parents();
  apply_skip();
  if (config_.route == Route::kDeviceMove || config_.route == Route::kNone) {
    plan_whole_route();
    return std::move(plan_);
  }
  classify_tensors();
  apply_always_resident();
  compute_costs();
  fit_always_resident();
  staging_estimate();
  resolve_resident_candidates();
  resolve_resident_budget();
  select_residents();
  assign_placements();
  // Units first: the tiers are chosen by unit, and disk-tier units are not pin candidates.
  build_stream_units();
  plan_tiers();
  plan_pinning();
  return std::move(plan_);
}

}  // namespace planner_internal

ExecutionMode resolve_execution_mode(ExecutionMode requested, const ModelInventory& inventory) {
  const bool has_packed = inventory.has_packed_layers();
  if (requested == ExecutionMode::kPackedRuntime) {
    DDO_CHECK(has_packed, Code::kInvalidArgument, "execution_mode ", to_string(requested),
              " needs SDNQ layers or another format's packed layers, but ",
              inventory.model_class.empty() ? "the model" : inventory.model_class,
              " has none; use linear_runtime (or preset auto, which picks the runtime from the "
              "model)");
    return requested;
  }
  if (requested == ExecutionMode::kLinearRuntime && has_packed) {
    return ExecutionMode::kPackedRuntime;
  }
  return requested;
}

Plan make_plan(const ModelInventory& inventory, const DynamicOffloadConfig& config,
               const PlanContext& context) {
  return planner_internal::Planner(inventory, config, context).run();
}

}  // namespace ddo::core
