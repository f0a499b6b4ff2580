// Planner phases that decide what streams: which tensors are streamable (Note [Packed layer
// units]), every module's placement and tensor actions, the stream units of each route, and the
// routes that do not stream.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "planner_internal.h"

namespace ddo::core::planner_internal {

void Planner::classify_tensors() {
  const std::int64_t threshold = config_.small_tensor_threshold_bytes;
  streamable_.assign(n_, {});
  own_cost_.assign(n_, 0);
  std::int64_t small_count = 0, small_bytes = 0;
  std::int64_t fallback_count = 0, fallback_bytes = 0;
  for (std::size_t m = 0; m < n_; ++m) {
    const ModuleInfo& mod = inv_.modules[m];
    streamable_[m].assign(mod.tensors.size(), false);
    if (skipped_[m]) continue;
    // Note [Packed layer units]: a packed layer's packed weight and its scales, zero points and
    // low-rank factors (every tensor with a role, whatever the format) are read together by one
    // dequantize, so they stream together or not at all. The threshold applies to the layer's
    // role bytes, not to each tensor: SDNQ uint4 scales and zero points (an eighth of the packed
    // bytes each at group 64) would otherwise all be moved once and fill a small card with
    // tensors that are only read when their weight is.
    std::int64_t packed_layer_bytes = 0;
    if (plan_.packed && mod.kind == ModuleKind::kPacked) {
      for (const TensorInfo& info : mod.tensors) {
        if (info.packed_role != PackedRole::kNone) packed_layer_bytes += info.bytes;
      }
    }
    for (std::size_t t = 0; t < mod.tensors.size(); ++t) {
      const TensorInfo& info = mod.tensors[t];
      bool eligible = false;
      if (plan_.packed) {
        eligible = mod.kind == ModuleKind::kPacked && info.packed_role != PackedRole::kNone;
        if (mod.kind == ModuleKind::kLinear) {
          ++fallback_count;
          fallback_bytes += info.bytes;
        }
        if (eligible && packed_layer_bytes > threshold) {
          streamable_[m][t] = true;
          own_cost_[m] += info.bytes;
          continue;
        }
      } else {
        const bool is_weight = info.name == "weight";
        switch (mod.kind) {
          case ModuleKind::kLinear:
          case ModuleKind::kEmbedding:
            eligible = is_weight && info.ndim() == 2;
            break;
          case ModuleKind::kConv:
            eligible = is_weight && info.ndim() >= 3;
            break;
          default:
            break;
        }
      }
      if (!eligible) continue;
      if (info.bytes <= threshold) {
        ++small_count;
        small_bytes += info.bytes;
        continue;
      }
      streamable_[m][t] = true;
      own_cost_[m] += info.bytes;
    }
  }
  if (small_count > 0) {
    decide("small_tensor",
           {{"threshold_bytes", threshold}, {"tensors", small_count}, {"bytes", small_bytes}},
           fmt::format("{} streamable-kind tensors at or under {} bytes are moved once",
                       small_count, threshold));
  }
  if (fallback_count > 0) {
    decide("packed_dense_fallback_resident",
           {{"tensors", fallback_count}, {"bytes", fallback_bytes}},
           fmt::format("{} tensors of dense fallback Linears ({}) stay on the device and are not "
                       "packed pin candidates",
                       fallback_count, gib(fallback_bytes)));
  }
}

void Planner::assign_placements() {
  plan_.modules.resize(n_);
  for (std::size_t m = 0; m < n_; ++m) {
    const ModuleInfo& mod = inv_.modules[m];
    ModulePlan& mp = plan_.modules[m];
    mp.name = mod.name;
    mp.always_resident = always_resident_[m];
    mp.resident_candidate = candidate_[m];
    mp.tensors.resize(mod.tensors.size());
    const bool has_stream =
        std::find(streamable_[m].begin(), streamable_[m].end(), true) != streamable_[m].end();
    if (skipped_[m]) {
      mp.placement = Placement::kSkipped;
    } else if (always_resident_[m] || resident_[m]) {
      mp.placement = Placement::kResident;
    } else if (has_stream) {
      mp.placement = Placement::kStreamed;
    } else {
      mp.placement = Placement::kDeviceOnce;
    }
    for (std::size_t t = 0; t < mod.tensors.size(); ++t) {
      const TensorInfo& info = mod.tensors[t];
      TensorPlan& tp = mp.tensors[t];
      switch (mp.placement) {
        case Placement::kSkipped:
          tp.action = TensorAction::kKeep;
          plan_.skipped_bytes += info.bytes;
          break;
        case Placement::kResident:
          tp.action = TensorAction::kResident;
          break;
        case Placement::kStreamed:
        case Placement::kDeviceOnce:
          if (streamable_[m][t]) {
            tp.action = TensorAction::kStream;
            plan_.streamed_bytes += info.bytes;
            streamed_.push_back({m, t});
            if (info.already_pinned) {
              tp.loader_pinned = true;
              plan_.loader_pinned_bytes += info.bytes;
            }
          } else {
            tp.action = TensorAction::kMoveOnce;
          }
          break;
      }
    }
  }
  plan_.always_resident_bytes = always_resident_bytes_;
  plan_.move_once_bytes = move_once_bytes_;
}

void Planner::build_stream_units() {
  std::vector<StreamUnit>& units = plan_.stream_units;
  auto tensor_name = [&](TensorRef ref) {
    const std::string& module = name_of(ref.module);
    return module.empty() ? tensor(ref).name : module + "." + tensor(ref).name;
  };
  std::string grain_reason;
  if (config_.route == Route::kDynamic) {
    // One unit per tensor, except packed layers: one unit per layer (Note [Packed layer units]).
    for (TensorRef ref : streamed_) {
      const bool packed_layer = inv_.modules[ref.module].kind == ModuleKind::kPacked;
      if (packed_layer && !units.empty() && units.back().tensors.back().module == ref.module) {
        units.back().tensors.push_back(ref);
        units.back().bytes += tensor(ref).bytes;
        continue;
      }
      units.push_back({packed_layer ? name_of(ref.module) : tensor_name(ref),
                       {ref},
                       tensor(ref).bytes,
                       packed_layer ? "packed_layer" : "tensor"});
    }
    grain_reason = plan_.packed
                       ? "dynamic route: each weight just in time; a packed layer's packed "
                         "weight, scales and zero points are read by one dequantize"
                       : "dynamic route: each weight just in time";
  } else {
    // Lookup only; units keep first-appearance (model) order.
    std::map<std::string, std::size_t> unit_of;
    std::vector<bool> block_member(n_, false);
    for (const BlockGroup& g : block_groups_) {
      for (std::size_t m : g.members) block_member[m] = true;
    }
    bool leaf = config_.route == Route::kGroupLeaf;
    grain_reason = leaf ? "group_leaf route: one module's weights per unit"
                        : "group_block route: one block per unit";
    if (!leaf && split_blocks_) {
      leaf = true;
      grain_reason = split_reason_;
    }
    for (TensorRef ref : streamed_) {
      std::string key;
      const char* grain = "leaf";
      if (leaf) {
        key = name_of(ref.module);
      } else {
        std::optional<std::size_t> block;
        for (std::optional<std::size_t> cur = ref.module; cur; cur = parent_[*cur]) {
          if (block_member[*cur]) block = cur;
        }
        if (block) {
          key = name_of(*block);
          grain = "block";
        } else {
          const std::string& name = name_of(ref.module);
          key = name.substr(0, name.find('.'));
          grain = key == name ? "leaf" : "block";
        }
      }
      auto [it, inserted] = unit_of.emplace(key, units.size());
      if (inserted) units.push_back({key, {}, 0, grain});
      units[it->second].tensors.push_back(ref);
      units[it->second].bytes += tensor(ref).bytes;
    }
  }
  std::int64_t largest = 0;
  std::map<std::string, int> by_grain;
  for (const StreamUnit& u : units) {
    largest = std::max(largest, u.bytes);
    ++by_grain[u.grain];
  }
  decide("stream_units",
         {{"route", to_string(config_.route)},
          {"units", units.size()},
          {"streamed_bytes", plan_.streamed_bytes},
          {"largest_unit_bytes", largest}},
         fmt::format("{} units over {} (largest {})", units.size(), gib(plan_.streamed_bytes),
                     gib(largest)));
  if (!units.empty()) {
    nlohmann::json counts = nlohmann::json::object();
    for (const auto& [grain, n] : by_grain) counts[grain] = n;
    decide("stream_grain", {{"units_by_grain", counts}, {"reason", grain_reason}}, grain_reason);
  }
}

// Routes that do not stream: a whole-component move, or nothing at all.
void Planner::plan_whole_route() {
  plan_.modules.resize(n_);
  const bool move = config_.route == Route::kDeviceMove;
  for (std::size_t m = 0; m < n_; ++m) {
    const ModuleInfo& mod = inv_.modules[m];
    ModulePlan& mp = plan_.modules[m];
    mp.name = mod.name;
    const bool keep = !move || skipped_[m];
    mp.placement = keep ? Placement::kSkipped : Placement::kDeviceOnce;
    mp.tensors.resize(mod.tensors.size());
    for (TensorPlan& tp : mp.tensors)
      tp.action = keep ? TensorAction::kKeep : TensorAction::kMoveOnce;
    (keep ? plan_.skipped_bytes : plan_.move_once_bytes) += mod.bytes();
  }
  decide(move ? "route_device_move" : "route_none",
         {{"route", to_string(config_.route)}, {"bytes", inv_.total_bytes()}},
         move ? "the whole component moves to the device once"
              : "the component is left where the host put it");
}

}  // namespace ddo::core::planner_internal
