// The placement phases of an attach (internal), one concept per file, in the order apply_plan
// (attach_plan.cpp, Note [Attach phases]) runs them:
//   attach_plan.cpp          the replaced tensors, tied views, training rules, the order itself
//   attach_residents.cpp     residents and move-once tensors on the device
//   attach_stream_units.cpp  streamed tensors laid out in units, their host slabs, the fill
//   attach_disk_tier.cpp     disk-tier units' tensors mapped from the checkpoint
//   attach_scheduler.cpp     the copy scheduler and the stream runtime that owns it all
//
//   const ReplacedOf replaced_of = collect_replaced(s, stays_from_file);
//   place_residents(s, replaced_of);
//   const std::vector<UnitLayout> units = layout_stream_units(s, replaced_of);
//   if (!units.empty()) s.runtime = build_stream_runtime(s, units, pin_workers);
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "managed_weight.h"
#include "offload_state.h"

namespace ddo::adapter::internal {

// For each module of the tree and each of its tensors, the index of its ReplacedTensor in
// OffloadState::replaced, or -1 for a tensor the plan leaves where it is.
using ReplacedOf = std::vector<std::vector<int>>;

// A plan unit's streamed tensors as they lie in its slab (or its disk-tier read).
struct UnitLayout {
  std::vector<int> ids;              // replaced ids, model order
  std::vector<std::size_t> offsets;  // byte offsets inside the unit
  std::size_t bytes = 0;
  bool pinned = false;
  // Read from the checkpoint every step (the planner's disk tier); only when every tensor of
  // the unit comes from the file.
  bool disk = false;
  // Streamed from the loader's pinned slab where its one tensor lies (Note [Loader pins] in
  // loader_pins.cpp): no slab of its own, no copy; `data` is that tensor's memory.
  bool adopted = false;
  char* data = nullptr;
  std::size_t module = 0;  // the module of its first tensor
};

// Where each tensor of each disk-tier unit points in host memory: `[unit][k]`, empty for the
// other units (attach_disk_tier.cpp).
using DiskTensorData = std::vector<std::vector<char*>>;

// The version counter's value (0 for an inference tensor, which has none).
inline std::uint32_t current_version(const at::Tensor& t) {
  return t.is_inference() ? 0 : t._version();
}

// attach_residents.cpp. Before anything moves: the plan's smallest working set fits what the
// device has free, else an error naming what to change.
void check_smallest_plan_fits(const OffloadState& s);
// Residents and move-once tensors, one device allocation per module.
void place_residents(OffloadState& s, const ReplacedOf& replaced_of);

// attach_stream_units.cpp. The units the plan streams, each with its tensors at aligned offsets.
std::vector<UnitLayout> layout_stream_units(OffloadState& s, const ReplacedOf& replaced_of);
// The host bytes of the units: the weight cache's slabs on a hit, else fresh slabs.
void make_host_slabs(OffloadState& s, const std::shared_ptr<StreamRuntime>& rt,
                     const std::vector<UnitLayout>& units, const std::vector<int>& streamed_ids);
// Fills the slabs and re-points every streamed tensor at its managed storage.
void fill_and_repoint(OffloadState& s, const std::shared_ptr<StreamRuntime>& rt,
                      const std::vector<UnitLayout>& units, const DiskTensorData& disk_data,
                      int pin_workers);

// attach_disk_tier.cpp. The disk-tier units' tensors over the checkpoint's mapping (Note
// [Disk-tier storage]); returns what keeps the mappings, `*data` where each tensor lies.
std::shared_ptr<void> map_disk_tensors(OffloadState& s, const std::vector<UnitLayout>& units,
                                       DiskTensorData* data);

// attach_scheduler.cpp. The stream runtime over `units`: slabs, scheduler, fill, registration,
// finalized; the caller stores it in the state.
std::shared_ptr<StreamRuntime> build_stream_runtime(OffloadState& s,
                                                    const std::vector<UnitLayout>& units,
                                                    int pin_workers);

}  // namespace ddo::adapter::internal
