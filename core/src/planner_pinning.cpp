// Planner phases that decide pinning: explicit bounds, RAM admission (pin all, tiered, skip), the
// 95 % snap, the packed layers' pin admission by role, and which streamed tensors get the budget.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "planner_internal.h"

namespace ddo::core::planner_internal {
namespace {

// Below this much usable RAM (or a quarter of the candidates, if smaller) pinning is skipped:
// the machine is already short and a sliver of pinned weights gains little.
constexpr std::int64_t kMinUsefulPinBytes = kGiBBytes;
constexpr double kPinSnapRatio = 0.95;

}  // namespace

std::optional<std::int64_t> Planner::known_ram(std::string* source) const {
  if (config_.available_system_ram_gb) {
    *source = "available_system_ram_gb";
    return field_bytes(*config_.available_system_ram_gb, "available_system_ram_gb");
  }
  if (ctx_.available_ram_bytes) {
    *source = "detected";
    return *ctx_.available_ram_bytes;
  }
  *source = "unknown";
  return std::nullopt;
}

void Planner::plan_pinning() {
  std::int64_t loader_tensors = 0;
  std::vector<TensorRef> fresh;
  for (TensorRef ref : streamed_) {
    // Disk-tier tensors never live in host RAM (Note [Disk tier plan] in planner_tiers.cpp).
    if (on_disk_[ref.module][ref.tensor]) continue;
    if (tensor(ref).already_pinned) {
      ++loader_tensors;
    } else {
      fresh.push_back(ref);
      plan_.pin_candidate_bytes += tensor(ref).bytes;
    }
  }
  if (loader_tensors > 0) {
    decide("loader_pins_preserved",
           {{"tensors", loader_tensors}, {"bytes", plan_.loader_pinned_bytes}},
           fmt::format("{} streamed tensors ({}) pinned by the loader stay pinned and do not "
                       "count against new pins",
                       loader_tensors, gib(plan_.loader_pinned_bytes)));
  }
  if (!config_.pin_cpu_memory || !ctx_.pin_allowed) {
    decide("pin_disabled",
           {{"pin_cpu_memory", config_.pin_cpu_memory}, {"pin_allowed", ctx_.pin_allowed}},
           config_.pin_cpu_memory ? "the platform does not allow pinning (e.g. WSL)"
                                  : "pin_cpu_memory is off");
    return;
  }
  if (plan_.packed) {
    admit_packed_pins(plan_.pin_candidate_bytes);
  } else {
    admit_linear_pins(plan_.pin_candidate_bytes);
  }
  pin_selected(fresh, plan_.pin_budget_bytes);
  const std::int64_t all_streamed = plan_.pin_candidate_bytes + plan_.loader_pinned_bytes;
  if (plan_.resident_budget_bytes == 0 && all_streamed > 0 && plan_.disk_bytes == 0 &&
      plan_.pinned_bytes == plan_.pin_candidate_bytes) {
    decide(
        "full_pin_zero_resident",
        {{"pinned_bytes", plan_.pinned_bytes},
         {"loader_pinned_bytes", plan_.loader_pinned_bytes},
         {"streamed_bytes", plan_.streamed_bytes}},
        fmt::format("resident budget 0 and every streamed weight pinned ({})", gib(all_streamed)));
  }
}

void Planner::admit_linear_pins(std::int64_t candidates) {
  if (candidates == 0) return;
  // Explicit bounds: any that are set bound the budget together.
  std::optional<std::int64_t> bound;
  auto bound_by = [&](std::int64_t b) { bound = bound ? std::min(*bound, b) : b; };
  const double ratio = std::clamp(config_.pin_weight_budget_ratio, 0.0, 1.0);
  const std::int64_t max_bytes =
      field_bytes(config_.max_pin_weight_budget_gb, "max_pin_weight_budget_gb");
  if (config_.pin_weight_budget_gb > 0)
    bound_by(field_bytes(config_.pin_weight_budget_gb, "pin_weight_budget_gb"));
  if (ratio > 0) bound_by(static_cast<std::int64_t>(std::floor(ratio * candidates)));
  if (max_bytes > 0) bound_by(max_bytes);
  if (bound) {
    decide("pin_budget_explicit",
           {{"pin_weight_budget_gb", config_.pin_weight_budget_gb},
            {"pin_weight_budget_ratio", config_.pin_weight_budget_ratio},
            {"ratio_clamped", ratio},
            {"max_pin_weight_budget_gb", config_.max_pin_weight_budget_gb},
            {"candidate_bytes", candidates},
            {"bound_bytes", *bound}},
           fmt::format("explicit pin settings bound new pins to {}", gib(*bound)));
  }

  std::string ram_source;
  std::optional<std::int64_t> available = known_ram(&ram_source);
  std::int64_t budget = candidates;
  if (!available) {
    decide("pin_ram_unknown", {{"candidate_bytes", candidates}},
           "available RAM unknown: pin admission is not bounded by RAM");
  } else {
    const std::int64_t headroom =
        field_bytes(config_.system_ram_headroom_gb, "system_ram_headroom_gb");
    const std::int64_t usable = *available - headroom;
    const std::int64_t resident = plan_.resident_budget_bytes;
    nlohmann::json inputs = {
        {"available_bytes", *available},         {"available_source", ram_source},
        {"system_ram_headroom_bytes", headroom}, {"usable_bytes", usable},
        {"candidate_bytes", candidates},         {"resident_budget_bytes", resident}};
    if (usable >= candidates + resident) {
      decide("pin_all", inputs,
             fmt::format("usable RAM {} >= candidates {} + resident budget {}", gib(usable),
                         gib(candidates), gib(resident)));
    } else {
      const double tier = candidates <= 8 * kGiBBytes    ? 1.0
                          : candidates <= 16 * kGiBBytes ? 0.85
                                                         : 0.75;
      const std::int64_t tiered =
          std::min(static_cast<std::int64_t>(std::floor(tier * candidates)), usable);
      const std::int64_t too_small = std::min(kMinUsefulPinBytes, candidates / 4);
      inputs["tier_ratio"] = tier;
      inputs["min_useful_bytes"] = too_small;
      if (usable <= 0 || usable < too_small) {
        plan_.pin_budget_bytes = 0;
        decide("skip_insufficient_ram", inputs,
               fmt::format("usable RAM {} (available {} - headroom {}) is too small to pin any "
                           "of {}; weights stay in pageable memory",
                           gib(usable), gib(*available), gib(headroom), gib(candidates)));
        return;
      }
      budget = tiered;
      inputs["budget_bytes"] = budget;
      decide("pin_tiered", inputs,
             fmt::format("{:.0f}% of {} bounded by usable RAM {}: {}", tier * 100, gib(candidates),
                         gib(usable), gib(budget)));
    }
  }
  if (bound) budget = std::min(budget, *bound);
  // A maximum is a maximum: the snap never pins past max_pin_weight_budget_gb.
  const bool max_binds = max_bytes > 0 && max_bytes < candidates;
  if (budget < candidates && !max_binds &&
      static_cast<double>(budget) >= kPinSnapRatio * static_cast<double>(candidates)) {
    decide("pin_snap_95",
           {{"budget_bytes", budget},
            {"candidate_bytes", candidates},
            {"ratio", static_cast<double>(budget) / static_cast<double>(candidates)}},
           fmt::format("budget {} is >= 95% of {}: pin everything", gib(budget), gib(candidates)));
    budget = candidates;
  }
  plan_.pin_budget_bytes = budget;
}

void Planner::admit_packed_pins(std::int64_t fresh) {
  // diffusers-dynamic-offloader's SDNQ admission, for every packed format: counts direct packed
  // tensors, scales and auxiliaries by role; the ceiling,
  // ratio, maximum and known RAM headroom bound new pins; loader pins are kept and any excess
  // reported.
  std::map<std::string, std::int64_t> by_role;  // ordered for a stable JSON
  for (TensorRef ref : streamed_) {
    if (!on_disk_[ref.module][ref.tensor])
      by_role[to_string(tensor(ref).packed_role)] += tensor(ref).bytes;
  }
  const std::int64_t existing = plan_.loader_pinned_bytes;
  const std::int64_t all = fresh + existing;
  const double ratio = std::clamp(config_.pin_weight_budget_ratio, 0.0, 1.0);
  const std::int64_t max_bytes =
      field_bytes(config_.max_pin_weight_budget_gb, "max_pin_weight_budget_gb");
  std::int64_t ceiling = all;
  if (config_.pin_weight_budget_gb > 0) {
    ceiling = std::min(ceiling, field_bytes(config_.pin_weight_budget_gb, "pin_weight_budget_gb"));
  }
  if (ratio > 0) ceiling = std::min(ceiling, static_cast<std::int64_t>(std::floor(ratio * all)));
  if (max_bytes > 0) ceiling = std::min(ceiling, max_bytes);
  std::string ram_source;
  std::optional<std::int64_t> available = known_ram(&ram_source);
  std::optional<std::int64_t> usable;
  if (available)
    usable = *available - field_bytes(config_.system_ram_headroom_gb, "system_ram_headroom_gb");
  std::int64_t budget = std::max<std::int64_t>(0, ceiling - existing);
  if (usable) budget = std::min(budget, std::max<std::int64_t>(0, *usable));
  budget = std::min(budget, fresh);
  plan_.pin_budget_bytes = budget;
  const nlohmann::json usable_json = usable ? nlohmann::json(*usable) : nlohmann::json(nullptr);
  decide("packed_pin_admission",
         {{"candidate_bytes", all},
          {"candidate_bytes_by_role", by_role},
          {"loader_pinned_bytes", existing},
          {"pin_weight_budget_gb", config_.pin_weight_budget_gb},
          {"ratio_clamped", ratio},
          {"max_pin_weight_budget_gb", config_.max_pin_weight_budget_gb},
          {"ceiling_bytes", ceiling},
          {"available_source", ram_source},
          {"usable_ram_bytes", usable_json},
          {"new_pin_budget_bytes", budget}},
         fmt::format("packed/scale/auxiliary candidates {}, ceiling {}, loader pins {}, new pins "
                     "up to {}",
                     gib(all), gib(ceiling), gib(existing), gib(budget)));
  if (usable && *usable <= 0 && fresh > 0 && ceiling > existing) {
    decide("skip_insufficient_ram",
           {{"available_bytes", *available},
            {"available_source", ram_source},
            {"usable_bytes", *usable},
            {"candidate_bytes", fresh}},
           fmt::format("usable RAM {} leaves no room for new pins", gib(*usable)));
  }
  if (existing > ceiling) {
    plan_.pin_excess_bytes = existing - ceiling;
    decide("packed_pin_excess",
           {{"loader_pinned_bytes", existing},
            {"ceiling_bytes", ceiling},
            {"excess_bytes", plan_.pin_excess_bytes}},
           fmt::format("the loader already pinned {} beyond the ceiling {}; kept, not unpinned",
                       gib(plan_.pin_excess_bytes), gib(ceiling)));
  }
}

void Planner::pin_selected(const std::vector<TensorRef>& candidates, std::int64_t budget) {
  std::vector<std::int64_t> bytes;
  std::int64_t total = 0;
  for (TensorRef ref : candidates) {
    bytes.push_back(tensor(ref).bytes);
    total += tensor(ref).bytes;
  }
  std::vector<std::size_t> chosen;
  if (budget >= total) {
    chosen.resize(candidates.size());
    std::iota(chosen.begin(), chosen.end(), std::size_t{0});
  } else if (budget > 0) {
    chosen =
        greedy_fill(selection_order(bytes, config_.pin_weight_selection, budget), bytes, budget);
  }
  for (std::size_t i : chosen) {
    plan_.modules[candidates[i].module].tensors[candidates[i].tensor].pin = true;
    plan_.pinned_bytes += bytes[i];
  }
}

}  // namespace ddo::core::planner_internal
