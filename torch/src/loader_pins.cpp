// The deferred flow's loader pins: load_weights_for_offload (loader.h) and how enable_offload
// recognises the pins (loader_pins.h).
#include "loader_pins.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>
#include <vector>

#include <c10/core/GradMode.h>
#include <c10/util/strides.h>

#include "ddo/core/planner.h"
#include "ddo/core/units.h"
#include "ddo/torch/loader.h"
#include "host_tensor.h"
#include "offload_state.h"
#include "weight_source.h"

namespace ddo::adapter {
namespace internal {

// Note [Loader pins]
// ~~~~~~~~~~~~~~~~~~
// diffusers-dynamic-offloader's deferred flow loads a component early (apply_dynamic=False) and
// attaches offload later, at the execution stage. Loaded into ordinary CPU tensors, the weights
// were copied a second time at the attach, into fresh pinned slabs: setup paid a full memcpy and a
// pin of the streamed bytes again, and host RAM briefly held both copies of each chunk. Instead the
// loader reads the weights the attach will stream and pin (below) straight into pinned host slabs
// for the execution device the offload settings name (HostSlabs: exact-size slabs, registered after
// the read), and each becomes a CPU tensor over its slab entry whose storage deleter marks it, as
// managed weights are marked. enable_offload then streams a unit of one loader-pinned tensor from
// where it lies: no slab, no copy, no pin (setup.loader_pins.adopted_bytes). What it may not adopt
// is copied as before: a unit of several tensors (an SDNQ layer, the classic group routes), a
// view that does not start at its entry, a slab that fell back to ordinary memory.
//
// What is pinned is what the attach would pin: the loader plans the model as enable_offload does
// without a profile (same settings, the same card, the RAM admission of the planner's pinning
// phase) and pins the streamed tensors that plan pins. The others (residents, move-once tensors,
// weights beyond the RAM admission) are read into ordinary CPU tensors, as before, so the attach
// frees a resident's host copy once it is on the device. A profile applied at the attach may plan
// otherwise: a tensor it streams that the load did not pin is copied into a new slab, and one the
// load pinned that it keeps resident goes to the device with a plain copy.
//
// Costs and limits. Entries are padded to 256 bytes so a unit's aligned copy stays inside its
// entry. The slabs are freed with the last tensor that points into them; remove() gives the
// adopted weights back as the same loader tensors, so the pins outlive the offload and a second
// enable_offload adopts them again. Pinning follows the settings: pin_cpu_memory off, plan
// mode, a disabled offload or execution_device "cpu" load into ordinary memory instead, and the
// report says why.

bool LoaderPin::streamable(const at::Tensor& t, std::size_t unit_bytes) const {
  if (!slabs->tensor_pinned(index) || !t.is_contiguous() || t.storage_offset() != 0) return false;
  return t.data_ptr() == slabs->tensor_ptr(index) && unit_bytes <= room;
}

void loader_pin_deleter(void* context) {
  delete static_cast<LoaderPin*>(context);
}

const LoaderPin* loader_pin_of(const at::Tensor& t) {
  if (!has_deleter(t, &loader_pin_deleter)) return nullptr;
  return static_cast<const LoaderPin*>(
      t.unsafeGetTensorImpl()->unsafe_storage().data_ptr().get_context());
}

bool is_pinned_loader_tensor(const at::Tensor& t) {
  const LoaderPin* pin = loader_pin_of(t);
  return pin != nullptr && pin->slabs->tensor_pinned(pin->index);
}

}  // namespace internal

namespace {

constexpr std::size_t kPinAlignment = 256;  // as the offload's unit layout (kTensorAlignment)

// The placeholders the files hold that the plan pins, one per storage, and the tree of every
// other slot, for materialize().
struct PinSlots {
  std::vector<at::Tensor> fresh_like;                  // one per storage: the placeholder
  std::vector<std::string> names;                      // its name in the module
  std::vector<std::pair<at::Tensor, std::size_t>> of;  // (handle, index into fresh_like)
  ModuleTree rest;
};

PinSlots split_slots(const ModuleTree& tree, const WeightSource& source, const core::Plan& plan) {
  // A storage is pinned when the plan streams and pins one of its names (tied names share it).
  // The inventory follows the tree (to_inventory), so the plan's indices are the tree's.
  std::map<const void*, bool> pinned;
  for (std::size_t m = 0; m < tree.entries.size(); ++m) {
    const ModuleEntry& entry = tree.entries[m];
    for (std::size_t t = 0; t < entry.tensors.size(); ++t) {
      const at::Tensor& h = entry.tensors[t].tensor;
      if (!is_placeholder(h) || !source.has(slot_name(entry, entry.tensors[t]))) continue;
      const core::TensorPlan& tp = plan.modules[m].tensors[t];
      bool& pin = pinned[h.storage().unsafeGetStorageImpl()];
      pin = pin || (tp.action == core::TensorAction::kStream && tp.pin);
    }
  }
  PinSlots out;
  out.rest.model_class = tree.model_class;
  std::map<const void*, std::size_t> index_of;
  for (const ModuleEntry& entry : tree.entries) {
    ModuleEntry kept = entry;
    kept.tensors.clear();
    for (const TensorSlot& slot : entry.tensors) {
      const void* key = slot.tensor.storage().unsafeGetStorageImpl();
      auto pin = pinned.find(key);
      if (pin == pinned.end() || !pin->second) {
        kept.tensors.push_back(slot);  // not from the files, or not pinned: materialize()
        continue;
      }
      auto [it, inserted] = index_of.emplace(key, out.fresh_like.size());
      if (inserted) {
        out.fresh_like.push_back(slot.tensor);
        out.names.push_back(slot_name(entry, slot));
      }
      out.of.emplace_back(slot.tensor, it->second);
    }
    out.rest.entries.push_back(std::move(kept));
  }
  return out;
}

// Why a load pins nothing, or "" when it may pin.
std::string unpinned_reason(const core::DynamicOffloadSettings& settings,
                            const std::string& device_name) {
  const core::DynamicOffloadConfig& config = settings.config;
  if (config.execution_mode == core::ExecutionMode::kPlan || !settings.enabled) {
    return "the offload will not execute (plan mode or disabled)";
  }
  if (device_name == "cpu") return "execution_device is \"cpu\"";
  if (!settings.pin_effective) {
    return "pinning is off in the settings (pin_cpu_memory, or the platform)";
  }
  return {};
}

// Reads the slots the plan pins from the files into new host slabs of `device` and returns a CPU
// tensor over each (a LoaderPin record keeps its slab alive); the module is not touched yet.
std::vector<at::Tensor> read_into_slabs(const std::shared_ptr<engine::Device>& device,
                                        const PinSlots& slots, WeightSource& source,
                                        const core::DynamicOffloadConfig& config,
                                        const RecordEvent& events,
                                        std::shared_ptr<engine::HostSlabs>* slabs_out) {
  std::vector<engine::SlabTensor> entries;
  entries.reserve(slots.fresh_like.size());
  for (const at::Tensor& t : slots.fresh_like) {
    const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
    entries.push_back({core::align_up(bytes, kPinAlignment), true});
  }
  engine::HostSlabOptions slab_options;
  slab_options.allow_pin_fallback = config.allow_pin_memory_fallback;
  slab_options.pin_by_register = device->caps().host_register;
  std::unique_ptr<engine::HostSlabs> made;
  throw_if_error(engine::HostSlabs::create(*device, entries, slab_options, &made));
  engine::HostSlabs* raw = made.release();
  std::shared_ptr<engine::HostSlabs> slabs(raw, [device](engine::HostSlabs* s) { delete s; });

  std::vector<WeightSource::Read> reads;
  reads.reserve(slots.fresh_like.size());
  for (std::size_t i = 0; i < slots.fresh_like.size(); ++i) {
    const at::Tensor& t = slots.fresh_like[i];
    reads.push_back({slots.names[i], slabs->tensor_ptr(i), t.scalar_type(), t.numel()});
  }
  source.read(reads, events);
  throw_if_error(slabs->pin_registered(config.pin_cpu_workers));

  std::vector<at::Tensor> fresh;
  fresh.reserve(slots.fresh_like.size());
  for (std::size_t i = 0; i < slots.fresh_like.size(); ++i) {
    const at::Tensor& like = slots.fresh_like[i];
    auto* record = new internal::LoaderPin{slabs, i, entries[i].bytes};
    const c10::DimVector strides = c10::contiguous_strides(like.sizes());
    fresh.push_back(internal::cpu_tensor_over(
        slabs->tensor_ptr(i), static_cast<std::size_t>(like.numel()) * like.element_size(),
        like.sizes(), strides, like.scalar_type(), record, &internal::loader_pin_deleter));
  }
  *slabs_out = std::move(slabs);
  return fresh;
}

}  // namespace

nlohmann::json load_weights_for_offload(const ModuleTree& tree_in, const LoadOptions& load,
                                        const OffloadOptions& options, const RecordEvent& events) {
  // The deferred flow measures nothing here: a profile belongs to the later attach, at the stage
  // that runs the model (as from_pretrained_with_dynamic_offload(apply_dynamic=False) says too).
  DDO_CHECK(options.profile_name.empty() && !options.build_profile, Code::kInvalidArgument,
            "load_weights_for_offload got profile options (profile_name '", options.profile_name,
            "', build_profile ", options.build_profile ? "true" : "false",
            "); pass them to the later enable_offload call, at the stage that runs the model");
  ModuleTree tree = tree_in;
  retype_placeholders(tree, load.dtype);
  std::shared_ptr<WeightSource> source = open_weight_source(tree, load);
  const core::EnvMap env = options.env ? *options.env : core::process_env();
  const core::DynamicOffloadSettings settings = internal::resolve_settings(options, env);
  const core::DynamicOffloadConfig& config = settings.config;
  const std::string device_name = internal::normalize_device_name(config.execution_device);
  nlohmann::json report = {{"device", device_name},
                           {"pinned_bytes", 0},
                           {"pageable_bytes", 0},
                           {"pin_fallback_bytes", 0}};
  std::string unpinned = unpinned_reason(settings, device_name);
  // The device that pins: the caller's, else one opened for the name without the VRAM cap (the
  // slabs keep it alive, and a cap would outlive the load with them). One that cannot be opened
  // here (no GPU, a build without CUDA) loads into ordinary memory: the load is still good, and
  // the later enable_offload says what to change about the device.
  std::shared_ptr<engine::Device> device = options.device;
  if (unpinned.empty() && !device) {
    core::DynamicOffloadConfig uncapped = config;
    uncapped.vram_cap_gb = 0;
    try {
      device = open_execution_device(device_name, uncapped);
    } catch (const Error& e) {
      if (e.code() != Code::kUnavailable) throw;
      unpinned = e.what();
    }
  }
  if (!unpinned.empty()) {
    materialize(tree, *source, events);
    source->finish(events);
    report["pinned"] = false;
    report["reason"] = unpinned;
    return report;
  }

  const auto start = std::chrono::steady_clock::now();
  // The plan the attach would make without a profile (Note [Loader pins]): its pins.
  const c10::Device torch_device =
      internal::backend_for(device->caps().kind).torch_device(device->caps().index);
  core::PlanContext ctx;
  ctx.total_vram_bytes = core::effective_card_bytes(device->memory().total_bytes, config);
  ctx.available_ram_bytes = settings.available_ram_bytes();
  ctx.pin_allowed = settings.pin_effective;
  const core::Plan plan = core::make_plan(to_inventory(tree, torch_device), config, ctx);
  PinSlots slots = split_slots(tree, *source, plan);
  std::shared_ptr<engine::HostSlabs> slabs;
  const std::vector<at::Tensor> fresh =
      read_into_slabs(device, slots, *source, config, events, &slabs);
  // Everything else the files hold is read into ordinary CPU tensors; only then are the pinned
  // ones swapped in, so a failed read leaves the module's placeholders as they were.
  materialize(slots.rest, *source, events);
  source->finish(events);
  {
    at::AutoGradMode no_grad(false);
    for (auto& [handle, index] : slots.of) {
      at::Tensor h = handle;
      h.set_data(fresh[index]);
    }
  }

  const engine::HostSlabStats& stats = slabs->stats();
  report["pinned"] = stats.pinned_bytes > 0;
  if (stats.pinned_bytes == 0) {
    report["reason"] =
        "the plan the attach would make pins none of these weights (its RAM "
        "admission or pin settings; see enable_offload's pin decisions)";
  }
  report["plan"] = {{"streamed_bytes", plan.streamed_bytes},
                    {"pin_budget_bytes", plan.pin_budget_bytes},
                    {"pinned_bytes", plan.pinned_bytes}};
  report["pinned_bytes"] = stats.pinned_bytes;
  report["pageable_bytes"] = stats.pageable_bytes;
  report["pin_fallback_bytes"] = stats.pin_fallback_bytes;
  report["tensors"] = slots.fresh_like.size();
  report["register_seconds"] = stats.register_seconds;
  report["seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (events) events("load_pins", report["seconds"].get<double>(), report);
  return report;
}

}  // namespace ddo::adapter
