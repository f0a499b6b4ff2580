// Planner phase that decides where each stream unit is read from every step: its host copy, or,
// when a host RAM budget cannot hold every host copy and the weights can be read again from a
// checkpoint, the file itself (the disk tier).
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddo/core/working_set.h"
#include "planner_internal.h"

// Note [Disk tier plan]
// ~~~~~~~~~~~~~~~~~~~~~
// The host RAM budget is what the streamed weights may take in host memory: their host copies
// (pinned or pageable) and the pinned ring the disk tier reads into. It is host_ram_cap_gb when set
// (an emulated smaller host, as vram_cap_gb emulates a smaller card); otherwise, only when the
// weights are in a file (PlanContext::weights_in_file), what the RAM admission says the host can
// hold: available RAM (available_system_ram_gb, else detected) minus system_ram_headroom_gb, at
// least 1 byte; unknown RAM is unbounded. Weights already in memory have no budget of their own:
// only the pin admission bounds their pins. Residents and move-once tensors live on the device and
// are not in the budget (the loader reads them straight into device memory).
//
// When the streamed bytes fit, every unit is "host" and nothing else changes. When they do not and
// the weights are in a file, some units become "disk": the engine reads them every step, in traced
// order, from the checkpoint into the pinned ring ahead of the copy stream (Note [Disk ring] in
// working_set.h), and they never live in host RAM, so they are neither pinned nor pin candidates.
// Which units: the fewest, k, at the centres of k equal strides through the units in model order
// (spread_indices, Note [Spread order]), so that disk reads interleave with host copies and each
// read has the copies of the host units before it to hide behind; unit sizes differ, so k starts
// at the fewest units that could cover the excess (the largest ones) and grows until the host
// units plus the ring fit. The ring takes what the budget leaves after the host units, up to
// window + 2 x the largest disk unit (size_disk_ring). A unit holding a tensor that a loader
// already pinned stays "host": it is in RAM already, and pins a loader made are kept
// (docs/design/0007-named-profiles.md, section 4). So does a unit holding a buffer (Note [Only
// parameters stay in the file]).
//
// When even every unit on disk leaves the host units and the smallest ring (2 x the largest unit)
// over the budget, there is no plan. Under host_ram_cap_gb that is an error (kResourceExhausted)
// naming the cap, what the smallest plan needs, what stays on the host and why, and what to
// change: the user asked for that host.
// Under the RAM admission every unit goes to disk with the smallest ring and the decision says by
// how much that exceeds the estimate: the estimate is free RAM less a reserve, not a limit, and
// failing a load on a busy machine would be worse than taking a ring out of the reserve.
//
// A cap below streamed weights that are already in host memory (enable_offload on a loaded model)
// cannot be met: nothing can stay in a file. The decision host_ram_cap_unmet says so and how to
// load from a checkpoint instead; every unit stays "host". Plan mode reports the same tiers as
// a run.

// Note [Only parameters stay in the file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint holds a model's parameters. A buffer may be one the module computes itself (a
// non-persistent buffer), or one the attach makes: quantize='s copies are buffers of their
// Linear's entry (Note [Quantized dense weights] in torch/src/attach_quantize.cpp), quantized
// from the dense weight at attach and never in any file. Neither can be read again every step,
// so a unit holding a buffer is not eligible for the disk tier: it stays "host", and its bytes
// count against the host RAM budget like every host unit's. A persistent buffer that a file does
// hold stays on the host too; buffers are small beside the weights, and a plan that keeps one in
// RAM only spends budget, while one that sends a unit the file cannot serve to disk would hold it
// in RAM beyond the budget without saying so.

namespace ddo::core::planner_internal {
namespace {

constexpr const char* kHostTier = "host";
constexpr const char* kDiskTier = "disk";

// A figure for a message: GiB with two decimals, and the bytes when that rounds (test models).
std::string figure(std::int64_t bytes) {
  return bytes < kGiBBytes / 100 ? fmt::format("{} ({} bytes)", gib(bytes), bytes) : gib(bytes);
}

// The smallest cap in GiB (3 decimals, or 3 significant digits below that) that holds `bytes`.
// Never below the field's smallest value (1e-6 GiB).
double cap_gib_for(std::int64_t bytes) {
  const double exact = bytes_to_gib(bytes);
  double scale = 1000.0;
  while (exact * scale < 100.0 && scale < 1e9) scale *= 10.0;
  return std::max(1e-6, std::ceil(exact * scale) / scale);
}

struct TierChoice {
  std::vector<std::size_t> disk;  // indices into the eligible units
  std::int64_t disk_bytes = 0;
  std::int64_t largest = 0;
  std::int64_t ring = 0;
};

}  // namespace

// The bytes the streamed units may hold in host memory: host_ram_cap_gb when set, else, for
// weights read from a checkpoint, the RAM admission estimate; none (unbounded) otherwise.
std::optional<Planner::HostRamBudget> Planner::host_ram_budget() const {
  HostRamBudget b;
  if (config_.host_ram_cap_gb > 0) {
    b.capped = true;
    b.bytes = field_bytes(config_.host_ram_cap_gb, "host_ram_cap_gb");
    b.origin = "host_ram_cap_gb";
    b.inputs["host_ram_cap_gb"] = config_.host_ram_cap_gb;
  } else {
    if (!ctx_.weights_in_file) return std::nullopt;
    std::string source;
    const std::optional<std::int64_t> available = known_ram(&source);
    if (!available) return std::nullopt;  // unknown RAM: unbounded
    const std::int64_t headroom =
        field_bytes(config_.system_ram_headroom_gb, "system_ram_headroom_gb");
    const std::int64_t usable = *available - headroom;
    b.bytes = std::max<std::int64_t>(1, usable);
    b.origin = fmt::format("ram_admission ({} RAM - system_ram_headroom_gb)", source);
    b.inputs["available_bytes"] = *available;
    b.inputs["available_source"] = source;
    b.inputs["system_ram_headroom_bytes"] = headroom;
    b.inputs["usable_bytes"] = usable;
  }
  b.inputs["budget_bytes"] = b.bytes;
  b.inputs["budget_origin"] = b.origin;
  b.inputs["streamed_bytes"] = plan_.streamed_bytes;
  b.inputs["weights_in_file"] = ctx_.weights_in_file;
  return b;
}

namespace {

// Which of the eligible units go to disk: the fewest (spread over the model) whose host bytes
// plus the disk ring fit the budget; when none fits, all of them, and `fits` is false.
TierChoice choose_disk_units(const std::vector<StreamUnit>& units,
                             const std::vector<std::size_t>& eligible, std::int64_t streamed,
                             std::int64_t budget, std::int64_t window, bool* fits) {
  auto choice_of = [&](std::vector<std::size_t> disk) {
    TierChoice c;
    c.disk = std::move(disk);
    for (std::size_t i : c.disk) {
      c.disk_bytes += units[eligible[i]].bytes;
      c.largest = std::max(c.largest, units[eligible[i]].bytes);
    }
    DiskRingRequest ring;
    ring.largest_unit_bytes = c.largest;
    ring.disk_bytes = c.disk_bytes;
    ring.window_bytes = window;
    ring.room_bytes = budget - (streamed - c.disk_bytes);
    c.ring = size_disk_ring(ring);
    return c;
  };
  // The fewest units that could cover the excess: the largest ones.
  std::vector<std::int64_t> sizes;
  sizes.reserve(eligible.size());
  for (std::size_t u : eligible) sizes.push_back(units[u].bytes);
  std::sort(sizes.begin(), sizes.end(), std::greater<>());
  std::size_t k = 0;
  for (std::int64_t covered = 0; k < sizes.size() && covered < streamed - budget; ++k) {
    covered += sizes[k];
  }
  for (k = std::max<std::size_t>(k, 1); k <= eligible.size(); ++k) {
    TierChoice c = choice_of(spread_indices(eligible.size(), k));
    if (streamed - c.disk_bytes + c.ring <= budget) {
      *fits = true;
      return c;
    }
  }
  *fits = false;
  std::vector<std::size_t> all(eligible.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  return choice_of(std::move(all));
}

// What stays in host memory whatever the tiers: units a loader pinned, and units holding a
// buffer (Note [Only parameters stay in the file]).
struct KeptHost {
  std::int64_t pinned = 0;
  std::int64_t buffers = 0;
};

// host_ram_cap_gb is below the smallest plan (every eligible unit on disk, `smallest`).
[[noreturn]] void throw_cap_unmet(double cap_gb, std::int64_t budget, std::int64_t streamed,
                                  std::int64_t need, const TierChoice& smallest, bool none_eligible,
                                  const KeptHost& kept) {
  std::vector<std::string> parts;
  if (!none_eligible) {
    parts.push_back(fmt::format(
        "every unit the checkpoint holds read from it through the smallest pinned disk ring, {} "
        "(2 x the largest unit, {})",
        figure(smallest.ring), figure(smallest.largest)));
  }
  if (kept.pinned > 0) {
    parts.push_back(fmt::format("{} of units a loader already pinned, which stay in host memory",
                                figure(kept.pinned)));
  }
  if (kept.buffers > 0) {
    parts.push_back(fmt::format(
        "{} of units holding buffers (quantize='s copies, made at attach, or tensors a module "
        "computes), which no checkpoint serves every step and so stay in host memory",
        figure(kept.buffers)));
  }
  // What to change: the cap; or, when quantize='s copies are among what cannot leave host memory,
  // quantize= itself: without it those Linears' weights are parameters the disk tier reads.
  const std::string instead =
      kept.buffers > 0
          ? std::string(
                "; or, with quantize=, load without it, so that those Linears' dense "
                "weights stay in the checkpoint and stream from it through the disk tier")
          : std::string();
  throw Error(
      Code::kResourceExhausted,
      fmt::format("host_ram_cap_gb={:g} gives a host RAM budget of {} for the "
                  "streamed weights ({}), but the smallest plan needs {}: {}. Raise "
                  "host_ram_cap_gb / DDO_HOST_RAM_CAP_GB to at least {:g} (GiB), or "
                  "set it to 0 to turn the cap off{}",
                  cap_gb, figure(budget), gib(streamed), figure(need),
                  fmt::format("{}", fmt::join(parts, ", plus ")), cap_gib_for(need), instead));
}

}  // namespace

// The stream units that may go to disk: those no loader pinned and holding parameters only (a
// unit that is not stays on the host; its bytes are added to *kept_host).
std::vector<std::size_t> Planner::disk_eligible_units(std::int64_t* kept_host) const {
  const std::vector<StreamUnit>& units = plan_.stream_units;
  std::vector<std::size_t> eligible;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const bool stays =
        std::any_of(units[u].tensors.begin(), units[u].tensors.end(), [&](TensorRef ref) {
          const TensorInfo& t = tensor(ref);
          return t.already_pinned || !t.is_parameter;
        });
    if (stays) {
      *kept_host += units[u].bytes;
    } else {
      eligible.push_back(u);
    }
  }
  return eligible;
}

void Planner::plan_tiers() {
  on_disk_.assign(n_, {});
  for (std::size_t m = 0; m < n_; ++m) on_disk_[m].assign(inv_.modules[m].tensors.size(), false);
  std::vector<StreamUnit>& units = plan_.stream_units;
  if (units.empty()) return;
  const std::int64_t streamed = plan_.streamed_bytes;

  std::optional<HostRamBudget> host_budget = host_ram_budget();
  if (!host_budget) return;
  const std::int64_t budget = host_budget->bytes;
  const std::string& origin = host_budget->origin;
  nlohmann::json inputs = std::move(host_budget->inputs);
  plan_.host_ram_budget_bytes = budget;

  if (streamed <= budget) {
    decide("host_ram_budget_fits", inputs,
           fmt::format("streamed {} fit the host RAM budget {} ({}): every unit streams from host "
                       "memory",
                       gib(streamed), gib(budget), origin));
    return;
  }
  if (!ctx_.weights_in_file) {
    // Only a cap gets here: without a file there is no admission budget.
    decide("host_ram_cap_unmet", inputs,
           fmt::format("host_ram_cap_gb={:g} ({}) is below the streamed {}, but the weights are "
                       "already in host memory, not read from a checkpoint: the cap is not "
                       "enforced and every unit streams from host memory; load the model from its "
                       "checkpoint directory (from_pretrained_with_dynamic_offload) to stream the "
                       "excess from disk",
                       config_.host_ram_cap_gb, gib(budget), gib(streamed)));
    return;
  }

  std::int64_t kept_host = 0;
  const std::vector<std::size_t> eligible = disk_eligible_units(&kept_host);
  // The same split by reason, for the inputs and the error (a unit both pinned and holding a
  // buffer counts as pinned).
  KeptHost kept;
  for (const StreamUnit& unit : units) {
    bool pinned = false, buffer = false;
    for (TensorRef ref : unit.tensors) {
      const TensorInfo& t = tensor(ref);
      pinned = pinned || t.already_pinned;
      buffer = buffer || !t.is_parameter;
    }
    if (pinned) {
      kept.pinned += unit.bytes;
    } else if (buffer) {
      kept.buffers += unit.bytes;
    }
  }
  const std::int64_t window =
      to_bytes_or_throw(config_.prefetch_window_mb, ByteUnit::kMiB, "prefetch_window_mb");
  bool fits = false;
  TierChoice chosen = choose_disk_units(units, eligible, streamed, budget, window, &fits);
  std::int64_t over = 0;
  if (!fits) {
    const std::int64_t need = streamed - chosen.disk_bytes + chosen.ring;
    if (host_budget->capped) {
      throw_cap_unmet(config_.host_ram_cap_gb, budget, streamed, need, chosen, eligible.empty(),
                      kept);
    }
    over = need - budget;
  }

  std::vector<std::string> names;
  for (std::size_t i : chosen.disk) {
    StreamUnit& unit = units[eligible[i]];
    unit.tier = kDiskTier;
    names.push_back(unit.name);
    for (TensorRef ref : unit.tensors) on_disk_[ref.module][ref.tensor] = true;
  }
  for (StreamUnit& unit : units) {
    if (unit.tier != kDiskTier) unit.tier = kHostTier;
  }
  plan_.disk_bytes = chosen.disk_bytes;
  plan_.disk_ring_bytes = chosen.ring;
  const std::int64_t host = streamed - chosen.disk_bytes;
  inputs["host_bytes"] = host;
  inputs["disk_bytes"] = chosen.disk_bytes;
  inputs["ring_bytes"] = chosen.ring;
  inputs["largest_disk_unit_bytes"] = chosen.largest;
  inputs["window_bytes"] = window > 0 ? window : kDefaultPrefetchWindowBytes;
  inputs["units_on_disk"] = chosen.disk.size();
  inputs["units"] = units.size();
  inputs["disk_units"] = names_json(names);
  inputs["loader_pinned_host_bytes"] = kept.pinned;
  inputs["buffer_host_bytes"] = kept.buffers;
  inputs["over_budget_bytes"] = over;
  std::string detail = fmt::format(
      "streamed {} exceed the host RAM budget {} ({}): {} of {} units ({}) are read from the "
      "checkpoint every step through a pinned ring of {}, {} from host memory",
      gib(streamed), gib(budget), origin, chosen.disk.size(), units.size(), gib(chosen.disk_bytes),
      gib(chosen.ring), gib(host));
  if (over > 0) {
    detail += fmt::format(
        "; even so {} over the estimate (free RAM less the reserve, not a limit); set "
        "host_ram_cap_gb to make it one",
        gib(over));
  }
  decide("disk_tier", std::move(inputs), std::move(detail));
}

}  // namespace ddo::core::planner_internal
