// The plan's report: names of placements and tensor actions, lookups, the JSON view and the
// one-screen summary. Enum spellings come from config.h's tables, so the JSON reads back.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "planner_internal.h"

namespace ddo::core {

using planner_internal::gib;

const char* to_string(Placement placement) {
  switch (placement) {
    case Placement::kResident:
      return "resident";
    case Placement::kStreamed:
      return "streamed";
    case Placement::kDeviceOnce:
      return "device_once";
    case Placement::kSkipped:
      return "skipped";
  }
  return "skipped";
}

const char* to_string(TensorAction action) {
  switch (action) {
    case TensorAction::kResident:
      return "resident";
    case TensorAction::kStream:
      return "stream";
    case TensorAction::kMoveOnce:
      return "move_once";
    case TensorAction::kKeep:
      return "keep";
  }
  return "keep";
}

const Decision* Plan::find_decision(std::string_view name) const {
  for (const Decision& d : decisions) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

std::vector<std::string> Plan::resident_module_names() const {
  std::vector<std::string> out;
  for (const ModulePlan& m : modules) {
    if (m.placement == Placement::kResident) out.push_back(m.name);
  }
  return out;
}

nlohmann::json Plan::to_json() const {
  nlohmann::json mods = nlohmann::json::array();
  for (const ModulePlan& m : modules) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const TensorPlan& t : m.tensors) {
      tensors.push_back(
          {{"action", to_string(t.action)}, {"pin", t.pin}, {"loader_pinned", t.loader_pinned}});
    }
    mods.push_back({{"name", m.name},
                    {"placement", to_string(m.placement)},
                    {"always_resident", m.always_resident},
                    {"resident_candidate", m.resident_candidate},
                    {"tensors", std::move(tensors)}});
  }
  nlohmann::json units = nlohmann::json::array();
  for (const StreamUnit& u : stream_units) {
    nlohmann::json refs = nlohmann::json::array();
    for (TensorRef r : u.tensors) refs.push_back({r.module, r.tensor});
    units.push_back({{"name", u.name},
                     {"bytes", u.bytes},
                     {"grain", u.grain},
                     {"tier", u.tier},
                     {"tensors", std::move(refs)}});
  }
  nlohmann::json decisions_json = nlohmann::json::array();
  for (const Decision& d : decisions) {
    decisions_json.push_back({{"name", d.name}, {"inputs", d.inputs}, {"detail", d.detail}});
  }
  return {{"mode", to_string(mode)},
          {"route", to_string(route)},
          {"execute", execute},
          {"packed", packed},
          {"block_pattern", block_pattern},
          {"block_patterns", block_patterns},
          {"resident_patterns", resident_patterns},
          {"resident_budget_bytes", resident_budget_bytes},
          {"resident_used_bytes", resident_used_bytes},
          {"resident_candidate_bytes", resident_candidate_bytes},
          {"always_resident_bytes", always_resident_bytes},
          {"move_once_bytes", move_once_bytes},
          {"streamed_bytes", streamed_bytes},
          {"skipped_bytes", skipped_bytes},
          {"staging_estimate_bytes", staging_estimate_bytes},
          {"pin_candidate_bytes", pin_candidate_bytes},
          {"pin_budget_bytes", pin_budget_bytes},
          {"pinned_bytes", pinned_bytes},
          {"loader_pinned_bytes", loader_pinned_bytes},
          {"pin_excess_bytes", pin_excess_bytes},
          {"host_ram_budget_bytes", host_ram_budget_bytes},
          {"disk_bytes", disk_bytes},
          {"disk_ring_bytes", disk_ring_bytes},
          {"modules", std::move(mods)},
          {"stream_units", std::move(units)},
          {"decisions", std::move(decisions_json)}};
}

std::string Plan::summary() const {
  std::size_t counts[4] = {0, 0, 0, 0};
  for (const ModulePlan& m : modules) ++counts[static_cast<int>(m.placement)];
  std::string out = fmt::format("ddo plan: {}, route {}{}{}\n", to_string(mode), to_string(route),
                                execute ? "" : " (report only)", packed ? ", packed layers" : "");
  out += fmt::format("  modules: {} resident, {} streamed, {} device-once, {} skipped\n", counts[0],
                     counts[1], counts[2], counts[3]);
  out += fmt::format("  resident: budget {}, used {} of {} candidates; always-resident {}\n",
                     gib(resident_budget_bytes), gib(resident_used_bytes),
                     gib(resident_candidate_bytes), gib(always_resident_bytes));
  if (!block_patterns.empty()) {
    out += fmt::format("  blocks: {}\n", fmt::join(block_patterns, ", "));
  }
  out += fmt::format("  streamed {} in {} units; move-once {}; skipped {}\n", gib(streamed_bytes),
                     stream_units.size(), gib(move_once_bytes), gib(skipped_bytes));
  out += fmt::format("  pinned {} of {} (budget {}); loader-pinned {}", gib(pinned_bytes),
                     gib(pin_candidate_bytes), gib(pin_budget_bytes), gib(loader_pinned_bytes));
  if (pin_excess_bytes > 0) out += fmt::format(", excess {}", gib(pin_excess_bytes));
  if (host_ram_budget_bytes > 0 || disk_bytes > 0) {
    const auto on_disk = std::count_if(stream_units.begin(), stream_units.end(),
                                       [](const StreamUnit& u) { return u.tier == "disk"; });
    out += fmt::format(
        "\n  host RAM budget {}: {} from host memory, {} from disk in {} units "
        "(ring {})",
        host_ram_budget_bytes > 0 ? gib(host_ram_budget_bytes) : "unbounded",
        gib(host_tier_bytes()), gib(disk_bytes), on_disk, gib(disk_ring_bytes));
  }
  out += "\n  decisions:\n";
  for (const Decision& d : decisions) out += fmt::format("    {}: {}\n", d.name, d.detail);
  return out;
}

}  // namespace ddo::core
