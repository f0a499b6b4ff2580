// The phases of an attach, in the order enable_offload_tree runs them (internal). Each takes the
// OffloadState the earlier ones filled; a phase that throws leaves nothing placed (placement
// restores the model itself).
#pragma once

#include <cstdint>
#include <string>

#include "ddo/core/config.h"
#include "ddo/core/settings.h"
#include "ddo/torch/enable_offload.h"
#include "offload_state.h"

namespace ddo::adapter::internal {

// The settings (resolve_settings) and the device they name: device_name, kind, torch_device,
// executing. Warns (TORCH_WARN) for what resolving accepted with a change.
void resolve_attach_settings(OffloadState& s, const OffloadOptions& options,
                             const core::EnvMap& env);

// The inventory of s.tree and the runtime it takes (SDNQ layers: sdnq_runtime); returns the
// execution mode the settings asked for, which the planner resolves again to record why.
core::ExecutionMode take_inventory(OffloadState& s);

// Opens the execution device (or takes options.device) with its memory probe when executing;
// returns the capacity the plan is made for (the card, the simulated one, under vram_cap_gb).
std::int64_t open_attach_device(OffloadState& s, const OffloadOptions& options);

// Who set a fixed resident budget ("" when none): the planner's resident_budget_fit decision and
// the profile's warning name it.
std::string resident_budget_origin(const OffloadState& s, const OffloadOptions& options,
                                   const core::EnvMap& env);

// The named profile's decision for this run (core::prepare_profile): s.store, s.prepared,
// s.profile_report.
void prepare_attach_profile(OffloadState& s, const core::EnvMap& env, std::int64_t total_vram,
                            const std::string& budget_origin);

// The plan (core::make_plan, or the cached one under cache_plan): s.plan, its event and the
// verbose decisions.
void plan_attach(OffloadState& s, std::int64_t total_vram, const std::string& budget_origin,
                 core::ExecutionMode requested_mode);

// Places the plan (apply_plan; on failure the model is restored and the error rethrown), or in
// plan mode materializes loaded weights as an ordinary CPU model.
void place_attach(OffloadState& s);

}  // namespace ddo::adapter::internal
