// The phases of an attach before placement, in the order enable_offload_tree runs them
// (internal). Each returns what it decided as a value; enable_offload_tree moves the values into
// the OffloadState, so a phase reads only what the earlier ones returned and never fills the
// state itself. Placement (place_attach) is the one phase that works on the state: what it
// replaced is what OffloadState::restore puts back.
//
//   AttachSettings resolved = resolve_attach_settings(options, env);
//   AttachInventory inventory = take_inventory(*s);       // s->settings = resolved.settings, ...
//   DeviceContext device = open_attach_device(*s, options);
//   AttachProfile profile = prepare_attach_profile(*s, resolved.device, env, total_vram, origin);
//   PlannedAttach planned = plan_attach(*s, total_vram, origin, inventory.requested_mode);
//   place_attach(*s);
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include "ddo/core/config.h"
#include "ddo/core/device_name.h"
#include "ddo/core/planner.h"
#include "ddo/core/profile_store.h"
#include "ddo/core/settings.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"
#include "backend.h"
#include "offload_state.h"

namespace ddo::adapter::internal {

// The settings (resolve_settings) and the execution device they name, parsed once.
struct AttachSettings {
  core::DynamicOffloadSettings settings;  // config.execution_device in its canonical spelling
  core::DeviceName device;                // the execution device: its type, not its text
  const Backend* backend = &kSimBackend;  // the record of device's kind ("cpu": the sim's)
  c10::Device torch_device = c10::Device(c10::kCPU);
  bool executing = false;  // false: plan mode or the "off" preset
};

// Warns (TORCH_WARN) for what resolving accepted with a change; throws for "cpu" outside plan
// mode.
AttachSettings resolve_attach_settings(const OffloadOptions& options, const core::EnvMap& env);

// The inventory of the tree and the runtime it takes (SDNQ layers: sdnq_runtime).
struct AttachInventory {
  core::ModelInventory inventory;
  std::string weight_cache_key;  // the model's pinned-weight cache entry on this device
  // The mode the settings asked for, which the planner resolves again to record why, and the one
  // the model takes (core::resolve_execution_mode).
  core::ExecutionMode requested_mode = core::ExecutionMode::kPlan;
  core::ExecutionMode mode = core::ExecutionMode::kPlan;
};
AttachInventory take_inventory(const OffloadState& s);

// The execution device (or options.device) with its memory probe when executing, and the
// capacity the plan is made for (the card, the simulated one, under vram_cap_gb).
struct DeviceContext {
  std::shared_ptr<engine::Device> device;
  std::unique_ptr<MemoryProbe> probe;
  std::unique_ptr<ScopedCountingCpuAllocator> counting;  // a device whose memory is host memory
  std::int64_t total_vram = 0;
};
DeviceContext open_attach_device(const OffloadState& s, const OffloadOptions& options);

// Who set a fixed resident budget ("" when none): the planner's resident_budget_fit decision and
// the profile's warning name it.
std::string resident_budget_origin(const OffloadState& s, const OffloadOptions& options,
                                   const core::EnvMap& env);

// The named profile's decision for this run (core::prepare_profile) and its report.
struct AttachProfile {
  std::unique_ptr<core::ProfileStore> store;
  core::PreparedProfile prepared;
  nlohmann::json report = nlohmann::json::object();
};
AttachProfile prepare_attach_profile(const OffloadState& s, const core::DeviceName& device,
                                     const core::EnvMap& env, std::int64_t total_vram,
                                     const std::string& budget_origin);

// The plan (core::make_plan, or the cached one under cache_plan), its event emitted.
struct PlannedAttach {
  core::Plan plan;
  bool cached = false;  // from the plan cache
  double seconds = 0.0;
};
PlannedAttach plan_attach(const OffloadState& s, std::int64_t total_vram,
                          const std::string& budget_origin, core::ExecutionMode requested_mode);

// Places the plan (apply_plan; on failure the model is restored and the error rethrown), or in
// plan mode materializes loaded weights as an ordinary CPU model.
void place_attach(OffloadState& s);

}  // namespace ddo::adapter::internal
