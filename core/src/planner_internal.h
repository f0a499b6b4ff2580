// The Planner behind make_plan (internal to ddo_core): one object per make_plan call that holds
// the inventory, the config and the context, and fills a Plan phase by phase. Its member functions
// are defined by phase, one file each:
//
//   planner.cpp            checks, the module tree, the order of the phases (run), make_plan
//   planner_patterns.cpp   skip and always-resident patterns, the auto block pattern
//   planner_residency.cpp  resident candidates, costs, the budget, selection orders
//   planner_pinning.cpp    pin admission against RAM and explicit bounds, packed-layer admission
//   planner_tiers.cpp      the host RAM budget and the disk tier (Note [Disk tier plan])
//   planner_units.cpp      which tensors stream, placements, stream units, whole-component routes
//   planner_report.cpp     Plan::to_json, Plan::summary
//
//   Plan plan = planner_internal::Planner(inventory, config, context).run();
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ddo/core/planner.h"
#include "ddo/core/status.h"
#include "ddo/core/units.h"

namespace ddo::core::planner_internal {

// A GiB field of the config in bytes. validate_config bounds every such field so that this fits;
// the check stays, naming the field, for a config that skipped it.
inline std::int64_t field_bytes(double gib, const char* field) {
  return to_bytes_or_throw(gib, ByteUnit::kGiB, field);
}
inline std::string gib(std::int64_t bytes) {
  return format_bytes_as_gib(bytes);
}

struct CompiledPatterns {
  std::vector<std::string> sources;
  std::vector<std::regex> regexes;

  bool search(const std::string& name) const {
    return std::any_of(regexes.begin(), regexes.end(),
                       [&](const std::regex& r) { return std::regex_search(name, r); });
  }
};

// Compiles `patterns` for searching module names; throws ddo::Error naming `field` and the
// pattern when one is over the pattern limits or not a regex.
CompiledPatterns compile(const std::vector<std::string>& patterns, std::string_view field);

std::string regex_escape(std::string_view text);

// At most `limit` names, then "... N more", for a decision's inputs.
nlohmann::json names_json(const std::vector<std::string>& names, std::size_t limit = 16);

// The centres of k equal strides through n items, ascending (Note [Spread order] in
// planner_residency.cpp): floor((2i + 1) * n / (2k)) for i = 0..k-1. k is at most n.
std::vector<std::size_t> spread_indices(std::size_t n, std::size_t k);

struct BlockGroup {
  std::string prefix;
  std::vector<std::size_t> members;  // modules with streamable weights, model order
  std::int64_t bytes = 0;
  std::size_t first = 0;  // model index of the first member (tie-break)

  std::string pattern() const {
    return prefix.empty() ? std::string("^[0-9]+$") : "^" + regex_escape(prefix) + R"(\.[0-9]+$)";
  }
};

class Planner {
 public:
  Planner(const ModelInventory& inventory, const DynamicOffloadConfig& config,
          const PlanContext& context)
      : inv_(inventory), config_(config), ctx_(context), n_(inventory.modules.size()) {}

  Plan run();

 private:
  void decide(std::string name, nlohmann::json inputs, std::string detail) {
    plan_.decisions.push_back({std::move(name), std::move(inputs), std::move(detail)});
  }
  const std::string& name_of(std::size_t m) const { return inv_.modules[m].name; }
  const TensorInfo& tensor(TensorRef ref) const {
    return inv_.modules[ref.module].tensors[ref.tensor];
  }

  void check_inputs() const;
  void index_parents();
  // Flags the modules `matches` takes (by index) and their descendants; appends the names of
  // those it takes to `matched`.
  void mark_with_descendants(const std::function<bool(std::size_t)>& matches,
                             std::vector<bool>* flags, std::vector<std::string>* matched) const;
  bool flagged_or_ancestor(std::size_t m, const std::vector<bool>& flags) const;
  void classify_tensors();
  void apply_skip();
  void apply_always_resident();
  void fit_always_resident();
  void compute_costs();
  std::vector<BlockGroup> find_block_groups() const;
  std::vector<BlockGroup> choose_block_groups(bool all_lists);
  void resolve_resident_candidates();
  // VRAM the plan may use: the context's total, capped by vram_cap_gb; 0 = unknown.
  std::int64_t usable_vram() const;
  // The balanced policy's headroom for usable_vram(): auto_vram_headroom_gb, else the table.
  std::int64_t vram_headroom() const;
  // Note [Working set] over the units this route will stream; `with_always_resident` also counts
  // the streamable tensors of always-resident modules (before fit_always_resident decides).
  std::int64_t staging_estimate(bool with_always_resident = false);
  // What the card leaves for budget-chosen residents after `headroom`, the always-resident
  // modules, the move-once tensors and the staging estimate (may be negative); one formula for the
  // balanced policy and fit_budget_to_card.
  struct ResidentRoom {
    std::int64_t total = 0;  // usable_vram()
    std::int64_t headroom = 0;
    std::int64_t staging = 0;
    std::int64_t room = 0;
  };
  ResidentRoom resident_room(std::int64_t headroom) const;
  // Where a fixed resident budget came from (fit_budget_to_card).
  enum class FixedBudget { kConfig, kProfile };
  // Note [Resident budget fits the card]: clamps plan_.resident_budget_bytes, set from `source`.
  void fit_budget_to_card(FixedBudget source);
  void resolve_resident_budget();
  void select_residents();
  void assign_placements();
  // Available host RAM: available_system_ram_gb, else the context's detected figure; `source`
  // says which ("available_system_ram_gb", "detected", "unknown").
  std::optional<std::int64_t> known_ram(std::string* source) const;
  // Tiers (planner_tiers.cpp): the host RAM budget of the streamed units, then which of them
  // are read from the checkpoint every step.
  struct HostRamBudget {
    std::int64_t bytes = 0;
    std::string origin;   // "host_ram_cap_gb" or the admission rule and its RAM source
    bool capped = false;  // from host_ram_cap_gb: a plan over it is an error
    nlohmann::json inputs = nlohmann::json::object();
  };
  std::optional<HostRamBudget> host_ram_budget() const;
  std::vector<std::size_t> disk_eligible_units(std::int64_t* kept_host) const;
  void plan_tiers();
  void plan_pinning();
  void admit_linear_pins(std::int64_t candidates);
  void admit_packed_pins(std::int64_t candidates);
  void pin_selected(const std::vector<TensorRef>& candidates, std::int64_t budget);
  void build_stream_units();
  void plan_whole_route();

  const ModelInventory& inv_;
  const DynamicOffloadConfig& config_;
  const PlanContext& ctx_;
  const std::size_t n_;
  Plan plan_;

  std::vector<std::optional<std::size_t>> parent_;  // nearest ancestor present in the inventory
  std::vector<bool> skipped_;
  std::vector<bool> always_resident_;
  std::vector<std::vector<bool>> streamable_;  // [module][tensor]
  std::vector<std::int64_t> own_cost_;         // streamable bytes of a module's own tensors
  std::vector<std::int64_t> subtree_cost_;     // own_cost_ over the module and its descendants
  std::vector<bool> candidate_;                // outermost resident candidates
  std::vector<bool> resident_;                 // chosen resident (with descendants)
  std::vector<std::size_t> candidates_;        // candidate module indices, model order
  std::vector<BlockGroup> block_groups_;       // the groups behind block_patterns
  std::int64_t always_resident_bytes_ = 0;
  std::int64_t adapter_bytes_ = 0;  // Note [Adapter modules]: the part of always_resident_bytes_

  std::int64_t move_once_bytes_ = 0;
  std::vector<TensorRef> streamed_;         // model order
  std::vector<std::vector<bool>> on_disk_;  // [module][tensor]: a disk-tier unit's (plan_tiers)
  bool split_blocks_ = false;  // group_block route streaming by module (staging_estimate)
  std::string split_reason_;
};

}  // namespace ddo::core::planner_internal
