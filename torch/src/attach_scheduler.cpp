// The stream runtime of an attach (phases 5, 5b and 5d of Note [Attach phases] in
// attach_plan.cpp): the copy scheduler with its staging ring sized against the device as the
// residents left it, each unit's candidate block, the units registered in order, and the runtime
// that owns slabs, scheduler and disk mappings for the offload's life.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ddo/core/units.h"
#include "ddo/core/working_set.h"
#include "ddo/engine/copy_scheduler.h"
#include "ddo/engine/device.h"
#include "ddo/engine/host_slab.h"
#include "attach_common.h"
#include "attach_placement.h"
#include "intercept_common.h"
#include "offload_state.h"
#include "registration.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

namespace {

// Phase 5b: the copy scheduler with its staging ring, and each unit's candidate block.
void make_scheduler(OffloadState& s, const std::shared_ptr<StreamRuntime>& rt,
                    const std::vector<UnitLayout>& units) {
  const core::Plan& plan = s.plan;
  const core::DynamicOffloadConfig& config = s.settings.config;
  // The staging ring, sized by the one rule (Note [Working set]) against the device as it is
  // now, after residents and move-once tensors: on a small card the window shrinks to half of
  // what the two largest units leave, the other half being the step's activations.
  core::StagingRequest request;
  for (const UnitLayout& u : units) {
    request.largest_unit_bytes =
        std::max(request.largest_unit_bytes, static_cast<std::int64_t>(u.bytes));
    request.streamed_bytes += static_cast<std::int64_t>(u.bytes);
  }
  request.window_bytes = core::to_bytes_or_throw(config.prefetch_window_mb, core::ByteUnit::kMiB,
                                                 "prefetch_window_mb");
  request.staging_bytes =
      core::to_bytes_or_throw(config.staging_mb, core::ByteUnit::kMiB, "staging_mb");
  request.one_unit_ahead = rt->sticky_units;  // the classic routes: exactly one group ahead
  const engine::DeviceMemory mem = s.device->memory();
  // An SDNQ layer's dequantized weight lives beside staging while it runs (Note [Dequantized
  // temporaries] in core/src/inventory.cpp): the room is what is left after it.
  request.room_bytes = std::max<std::int64_t>(
      0, mem.total_bytes - mem.used_bytes -
             s.inventory.largest_packed_temporary_bytes(sdnq_temporary_bytes_per_value(s)));
  const core::StagingSize staging = core::size_staging(request);
  engine::SchedulerOptions so;
  so.staging_bytes = static_cast<std::size_t>(staging.staging_bytes);
  so.window_bytes = static_cast<std::size_t>(staging.window_bytes);
  so.use_side_stream = s.settings.side_streams_effective;
  so.disk_ring_bytes = static_cast<std::size_t>(plan.disk_ring_bytes);
  rt->scheduler_owner = std::make_unique<engine::CopyScheduler>(*s.device, so);
  rt->scheduler = rt->scheduler_owner.get();
  // Note [Copy timing]: a sample of the copies keeps the link measured at a sixteenth of the
  // per-op cost; calibration and mark_step() time every copy.
  rt->scheduler->set_timing(engine::Timing::kSampled);
  {
    // The candidate (block) of each unit: the nearest ancestor-or-self the planner marked.
    std::set<std::string> candidates;
    for (const core::ModulePlan& mp : plan.modules) {
      if (mp.resident_candidate) candidates.insert(mp.name);
    }
    for (const UnitLayout& u : units) {
      std::string name = plan.modules[u.module].name;
      while (!name.empty() && candidates.count(name) == 0) {
        const std::size_t dot = name.rfind('.');
        name = dot == std::string::npos ? std::string() : name.substr(0, dot);
      }
      rt->unit_candidate.push_back(name);
      rt->unit_names.push_back(u.ids.empty() ? std::string() : s.replaced[u.ids.front()].name);
    }
  }
}

// Phase 5d: registers every unit with the scheduler, in unit order (ids follow add()).
void register_units(OffloadState& s, const std::shared_ptr<StreamRuntime>& rt,
                    const std::vector<UnitLayout>& units) {
  for (std::size_t i = 0; i < units.size(); ++i) {
    const UnitLayout& u = units[i];
    int id = -1;
    if (u.disk) {
      // The unit's tensors at their offsets, read by the scheduler's reader threads.
      std::vector<WeightSource::Read> unit_reads;
      for (std::size_t k = 0; k < u.ids.size(); ++k) {
        const ReplacedTensor& r = s.replaced[u.ids[k]];
        unit_reads.push_back({r.name, reinterpret_cast<void*>(u.offsets[k]), r.handle.scalar_type(),
                              r.handle.numel()});
      }
      id = rt->scheduler->add_from_reader(
          u.bytes, [source = s.weights, unit_reads = std::move(unit_reads)](void* dst) {
            return source->read_unit(unit_reads, static_cast<char*>(dst));
          });
    } else if (u.adopted) {
      id = rt->scheduler->add(u.data, u.bytes, /*pinned=*/true);
    } else {
      id = rt->scheduler->add(rt->slabs->tensor_ptr(i), u.bytes, rt->slabs->tensor_pinned(i));
    }
    DDO_ASSERT(id == static_cast<int>(i), "scheduler unit ids must follow add() order");
  }
}

}  // namespace

// Phase 5: the stream runtime (5a-5d), finalized; the offload owns it once apply_plan stores it.
std::shared_ptr<StreamRuntime> build_stream_runtime(OffloadState& s,
                                                    const std::vector<UnitLayout>& units,
                                                    int pin_workers) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  auto t0 = Clock::now();
  auto rt = std::make_shared<StreamRuntime>();
  rt->backend = s.backend;
  rt->execution_device = s.torch_device;
  rt->sticky_units =
      config.route == core::Route::kGroupBlock || config.route == core::Route::kGroupLeaf;
  rt->device = s.device;
  rt->interception = acquire_interception();

  std::vector<int> streamed_ids;
  for (std::size_t ui = 0; ui < units.size(); ++ui) {
    s.unit_bytes.push_back(units[ui].bytes);
    for (std::size_t k = 0; k < units[ui].ids.size(); ++k) {
      s.replaced[units[ui].ids[k]].unit = static_cast<int>(ui);
      s.replaced[units[ui].ids[k]].unit_offset = units[ui].offsets[k];
      streamed_ids.push_back(units[ui].ids[k]);
    }
  }
  make_host_slabs(s, rt, units, streamed_ids);
  DiskTensorData disk_data;
  if (std::any_of(units.begin(), units.end(), [](const UnitLayout& u) { return u.disk; })) {
    rt->disk_backing = map_disk_tensors(s, units, &disk_data);
  }
  make_scheduler(s, rt, units);
  fill_and_repoint(s, rt, units, disk_data, pin_workers);
  register_units(s, rt, units);
  const engine::HostSlabStats& hs = rt->slabs->stats();
  s.setup.pinned_bytes = hs.pinned_bytes;
  s.setup.pageable_bytes = hs.pageable_bytes;
  s.setup.pin_fallback_bytes = hs.pin_fallback_bytes;
  s.setup.pin_seconds = seconds_since(t0);
  emit(s, "pin", s.setup.pin_seconds,
       {{"pinned_bytes", hs.pinned_bytes},
        {"pageable_bytes", hs.pageable_bytes},
        {"pin_fallback_bytes", hs.pin_fallback_bytes},
        {"fill_seconds", hs.fill_seconds},
        {"register_seconds", hs.register_seconds},
        {"slabs", hs.pinned_slabs + hs.pageable_slabs},
        {"units", units.size()},
        {"weight_cache", s.setup.weight_cache},
        {"weight_cache_reused_bytes", s.setup.weight_cache_reused_bytes}});

  t0 = Clock::now();
  throw_if_error(rt->scheduler->finalize());
  s.setup.staging_bytes = static_cast<std::int64_t>(rt->scheduler->staging_bytes());
  s.setup.disk_ring_bytes = rt->scheduler->stats().disk_ring_bytes;
  s.setup.moves_seconds += seconds_since(t0);
  return rt;
}

}  // namespace ddo::adapter::internal
