// The state behind an Offload handle (internal; enable_offload.cpp, attach_plan.cpp,
// offload_report.cpp, profile_run.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "ddo/core/calibration.h"
#include "ddo/core/planner.h"
#include "ddo/core/profile_store.h"
#include "ddo/core/settings.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"
#include "ddo/torch/module_tree.h"
#include "managed_weight.h"

namespace ddo::adapter::internal {

// What a replaced tensor looked like before, to restore it.
struct ReplacedTensor {
  at::Tensor handle;  // the model's own tensor (Parameter or buffer); set_data re-points it
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::Device original_device = c10::Device(c10::kCPU);
  bool requires_grad = false;
  // ddo set requires_grad=false on it (a streamed weight, Note [Training under offload]):
  // remove() gives the flag back only then, and only while it still reads false, so a flag the
  // host set while attached stays as the host set it.
  bool frozen_by_attach = false;
  // Requires grad in a model whose host froze other parameters: a weight the host may train, so
  // a streamed one refuses ops that run with autograd (Note [Training under offload]).
  bool trainable = false;
  core::TensorAction action = core::TensorAction::kKeep;
  int tied_to = -1;  // index of the first tensor sharing the same view (tied weights)
  std::string name;  // "module.tensor", for the pinned-weight cache
  int unit = -1;     // streamed: its stream unit (slab tensor) and byte offset there
  std::size_t unit_offset = 0;
  bool from_file = false;       // the loader reads it (loader.h); on a failed setup: a placeholder
  bool kept_on_device = false;  // found on the device, left there by remove(keep_residents)
  // The deferred loader's pinned tensor its unit streams from in place (Note [Loader pins] in
  // loader_pins.cpp): kept for remove(), which gives it back.
  at::Tensor loader_pin;
};

struct QuantizedDense;  // quantized_dense.h

// A dense Linear weight that `quantize=` serves from its quantized copy (Note [Quantized dense
// weights] in attach_quantize.cpp).
struct QuantizedLinear {
  std::size_t entry = 0;  // its module in tree.entries
  std::size_t slot = 0;   // the quantized weight's slot there; the scale's is the next one
  std::string name;       // its module: "blocks.0.attn.to_q"
  at::Tensor handle;      // the model's own weight: the placeholder while served
  at::Tensor host;        // its values in host memory, contiguous (the placeholder's bytes)
  c10::Device original_device = c10::Device(c10::kCPU);
  bool requires_grad = false;
  bool mapped = false;  // `host` points into the loader's checkpoint file (mapped copy-on-write)
  std::string checkpoint_name;       // mapped: the loader's tensor, read again by remove()
  std::uint32_t attach_version = 0;  // the weight's version when served: a write moves it on
  std::vector<std::int64_t> layout_code;
  std::shared_ptr<const QuantizedDense> served;  // set once the placeholder is installed
};

// Setup figures: the report's "setup" section (Offload::report).
struct SetupFigures {
  double resolve_seconds = 0.0;
  double plan_seconds = 0.0;
  double pin_seconds = 0.0;
  double moves_seconds = 0.0;
  double total_seconds = 0.0;
  std::int64_t resident_bytes = 0;
  std::int64_t move_once_bytes = 0;
  std::int64_t streamed_bytes = 0;
  std::int64_t kept_bytes = 0;
  std::int64_t pinned_bytes = 0;
  std::int64_t pageable_bytes = 0;
  std::int64_t pin_fallback_bytes = 0;
  int modules_patched = 0;  // modules with at least one streamed tensor
  int resident_modules = 0;
  int stream_units = 0;
  std::int64_t staging_bytes = 0;
  bool plan_cached = false;  // the plan came from the plan cache (cache_plan)
  // The pinned-weight cache at this attach: "off", "hit" or "miss" (Note [Pinned-weight cache]).
  std::string weight_cache = "off";
  std::int64_t weight_cache_reused_bytes = 0;    // served from cached slabs, no copy
  std::int64_t weight_cache_refilled_bytes = 0;  // copied into cached slabs
  std::int64_t weight_cache_changed_in_place = 0;
  std::int64_t on_device_bytes = 0;  // already on the execution device at attach: not moved
  std::int64_t load_bytes = 0;       // read from the checkpoint by the loader (loader.h)
  double load_seconds = 0.0;         // from the first read to the last
  std::string load_path;             // the checkpoint; "" when the model brought its weights
  std::int64_t disk_bytes = 0;       // streamed bytes left in the files (the disk tier)
  std::int64_t disk_ring_bytes = 0;  // the scheduler's pinned ring for them
  // Disk-tier tensors converted into a temporary file for their parameters' storage (Note
  // [Disk-tier storage] in attach_disk_tier.cpp).
  std::int64_t disk_spill_bytes = 0;
  // Residents and move-once tensors the loader read through pinned bounce buffers
  // (Note [Host uploads] in engine/src/host_upload.cpp).
  std::int64_t bounced_bytes = 0;
  // Streamed bytes served from the loader's pinned slabs where they lie (Note [Loader pins]).
  std::int64_t adopted_bytes = 0;
  int adopted_units = 0;
};

struct OffloadState {
  ModuleTree tree;
  std::string model_class;
  RecordEvent record_event;
  core::DynamicOffloadSettings settings;
  core::ModelInventory inventory;
  core::Plan plan;
  std::string device_name;                // "sim:0", "cuda:0", "cpu"
  const Backend* backend = &kSimBackend;  // the record of device_name's kind ("cpu": the sim's)
  c10::Device torch_device = c10::Device(c10::kCPU);  // where staged/resident tensors live
  bool executing = false;                             // false: plan mode or disabled

  std::shared_ptr<engine::Device> device;
  std::shared_ptr<StreamRuntime> runtime;  // null when nothing is streamed
  std::unique_ptr<MemoryProbe> probe;
  std::unique_ptr<ScopedCountingCpuAllocator> counting;  // sim only

  std::shared_ptr<WeightSource> weights;  // the loader's checkpoint, or null

  std::unique_ptr<core::ProfileStore> store;
  core::PreparedProfile prepared;
  nlohmann::json profile_report = nlohmann::json::object();
  bool region_open = false;

  std::vector<ReplacedTensor> replaced;
  // quantize=: "fp8", "int8", or "" for none; the Linears served quantized, and those kept
  // dense with why (name -> reason).
  std::string quantize;
  std::vector<QuantizedLinear> quantized;
  std::map<std::string, std::string> kept_dense;
  SetupFigures setup;
  bool active = true;

  std::string weight_cache_key;  // its pinned-weight cache entry (Note [Pinned-weight cache])
  std::map<int, std::uint64_t> cached_fingerprints;  // replaced id -> fingerprint, during setup
  std::vector<std::size_t> unit_bytes;  // bytes of each stream unit, as laid out in the slabs

  // `keep_weight_cache` false: copy the weights out and drop this model's cache entry, as
  // remove(clear_weight_cache) asks. `setup_failed`: the loader's tensors become placeholders
  // again and no cache entry is made (the slabs may be partly filled). `keep_residents`: resident
  // and move-once tensors stay on the CUDA device (RemoveOptions::keep_residents_on_device).
  void restore(bool keep_weight_cache = true, bool setup_failed = false,
               bool keep_residents = false);
  std::int64_t kept_on_device_bytes = 0;  // left on the device by restore(keep_residents)
  // Offload::counters() as they stood when restore() ended the run (it drops the scheduler and
  // the files that count them), so a reader after remove() gets the totals, not zeros.
  std::optional<Offload::Counters> totals_at_remove;
};

// The running totals Offload::counters() gives (offload_report.cpp).
Offload::Counters run_totals(const OffloadState& s);

// One open profile_run() region: over one offload, or over a pipeline's profiled components
// (Note [One region over several offloads] in profile_run.cpp).
struct RegionState {
  std::vector<OffloadState*> offloads;  // the measured offloads, at least one
  std::vector<std::string> components;  // their component names; empty for a single offload
  std::optional<core::CalibrationRegionLock> lock;
  std::size_t measurer = 0;  // the offload whose probe measures the device
  bool measuring = false;
  bool done = false;
  nlohmann::json report = nlohmann::json::object();
};

// Opens a region on `offloads` (profile_run.cpp); `components` names them (empty for one offload).
std::unique_ptr<RegionState> open_region(std::vector<OffloadState*> offloads,
                                         std::vector<std::string> components = {});
// Ends it; `normally` false aborts (nothing saved); `out_of_memory`: the device ran out of
// memory inside it (ProfileRun::abort_out_of_memory). Returns the report.
nlohmann::json close_region(RegionState& region, bool normally, bool out_of_memory = false);
// Runs `region` inside `run` and ends it: finish() when it returns, abort (the out-of-memory
// form for a c10::OutOfMemoryError) and rethrow when it throws. Offload's and PipelineOffload's
// profile_run(callable).
nlohmann::json run_region(ProfileRun run, const std::function<void()>& region);

// The settings an attach with `options` runs under: preset, environment, config and overrides
// resolved (DynamicOffloadSettings::from_env), then the options' own fields; validated.
core::DynamicOffloadSettings resolve_settings(const OffloadOptions& options,
                                              const core::EnvMap& env);

// The canonical name (core::DeviceName::str: "sim" -> "sim:0", "cuda:03" -> "cuda:3", "cpu");
// throws kInvalidArgument for anything else (core::parse_device_name's message).
std::string normalize_device_name(const std::string& device);

double gib(std::int64_t bytes);

// Which path each ddo op kind with a CUDA kernel takes on `device_name` ("cuda:N", "sim:N"),
// and why (kernel_report.cpp; Note [Kernel images] in sdnq/src/kernel_status.cpp):
//   {"sdnq_dequantize": {"path": "kernel", "reason": "sm_90 code in libddo_sdnq"}}
nlohmann::json kernels_report(const std::string& device_name);

// The card the planner sees: `total_bytes` (0 = unknown) bounded by config.vram_cap_gb.

// Calibration's compute measurement (Note [Balanced order] in core/src/planner_residency.cpp): a
// mark on the compute stream where the region starts, and, after the region's final
// synchronization, the GPU ms each residency candidate took in the last step (from the scheduler's
// timeline: the compute stream's time from one unit's acquire to the next, all candidates
// streamed).
/// Records the timeline's reference point and times every copy from now on (Timing::kFull).
void mark_compute_stream(const OffloadState& s);
/// true: every copy and wait is timed; false: the steady state's sample (Note [Copy timing]).
void time_all_copies(const OffloadState& s, bool on);
std::map<std::string, double> measured_candidate_compute(const OffloadState& s);

}  // namespace ddo::adapter::internal
