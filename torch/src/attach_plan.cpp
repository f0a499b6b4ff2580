// Carrying a plan out (Note [Attach phases]): the order of the placement phases, the tensors the
// plan replaces, tied views and the training rules. The phases themselves are in the files
// attach_placement.h lists; the way back is attach_restore.cpp, quantize= is attach_quantize.cpp.
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddo/sdnq/kernel_status.h"
#include "attach_common.h"
#include "attach_placement.h"
#include "attach_quantize.h"
#include "intercept_common.h"
#include "offload_state.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

namespace {

// Key of a tensor view for tied-weight detection: same storage, offset, shape, strides, dtype.
using ViewKey = std::tuple<const void*, int64_t, std::vector<int64_t>, std::vector<int64_t>, int>;
ViewKey view_key(const at::Tensor& t) {
  return {t.storage().unsafeGetStorageImpl(), t.storage_offset(), t.sizes().vec(),
          t.strides().vec(), static_cast<int>(t.scalar_type())};
}

// Storages remove(keep_residents_on_device) left on the device, so the next attach of the model
// knows them from tensors the host put there itself. Weak: a freed storage drops out.
std::mutex g_kept_mu;
std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> g_kept_on_device;

}  // namespace

void remember_kept_on_device(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(g_kept_mu);
  std::erase_if(g_kept_on_device, [](const auto& w) { return w.expired(); });
  g_kept_on_device.emplace_back(t.storage().getWeakStorageImpl());
}

namespace {

bool kept_on_device_by_ddo(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(g_kept_mu);
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  for (const auto& w : g_kept_on_device) {
    if (w._unsafe_get_target() == impl && !w.expired()) return true;
  }
  return false;
}

// Note [Attach phases]
// ~~~~~~~~~~~~~~~~~~~~
// apply_plan carries a plan out in a fixed order, each phase one function:
//   1. collect_replaced      every tensor the plan moves, with its original look (tied views
//                            follow the first); then check_smallest_plan_fits, before anything
//                            moves (attach_residents.cpp)
//   2. read_kept_from_file   tensors that stay where they are but come from the loader's file
//   3. place_residents       residents and move-once tensors, one device allocation per module
//                            (attach_residents.cpp)
//   4. layout_stream_units   the streamed tensors of each plan unit at their offsets
//                            (attach_stream_units.cpp)
//   5. build_stream_runtime  host slabs (or the weight cache's), disk-tier mappings
//                            (attach_disk_tier.cpp), the scheduler and its staging, the fill and
//                            re-pointing in chunks, the units registered (attach_scheduler.cpp)
//   6. finish_attach         the report's moves, the loader's totals, tied views
// A phase that throws leaves what the earlier ones did to enable_offload, which restores the model
// from the state's replaced tensors (OffloadState::restore with setup_failed) and rethrows.

// Phase 1: the tensors the plan touches; `stays_from_file` gets the modules whose kept tensors
// the loader fills.
ReplacedOf collect_replaced(OffloadState& s, std::vector<std::size_t>& stays_from_file) {
  const core::Plan& plan = s.plan;
  ReplacedOf replaced_of(s.tree.entries.size());
  std::map<ViewKey, int> first_of_view;
  // quantize='s copies are made at attach, never read from the loader's files.
  std::set<std::pair<std::size_t, std::size_t>> made_here;
  for (const QuantizedLinear& q : s.quantized) {
    made_here.insert({q.entry, q.slot});
    made_here.insert({q.entry, q.slot + 1});
  }
  for (std::size_t m = 0; m < s.tree.entries.size(); ++m) {
    ModuleEntry& entry = s.tree.entries[m];
    replaced_of[m].assign(entry.tensors.size(), -1);
    for (std::size_t t = 0; t < entry.tensors.size(); ++t) {
      const core::TensorAction action = plan.modules[m].tensors[t].action;
      at::Tensor& handle = entry.tensors[t].tensor;
      const std::int64_t bytes = handle.numel() * handle.element_size();
      const bool from_file = s.weights && !made_here.contains({m, t}) &&
                             s.weights->has(slot_name(entry, entry.tensors[t]));
      if (action == core::TensorAction::kKeep) {
        s.setup.kept_bytes += bytes;
        if (from_file) stays_from_file.push_back(m);
        continue;
      }
      bool kept_on_device = false;
      if (action != core::TensorAction::kStream && handle.device() == s.torch_device &&
          !s.backend->memory_is_host) {
        s.setup.on_device_bytes += bytes;
        if (!kept_on_device_by_ddo(handle)) {
          if (from_file) stays_from_file.push_back(m);
          continue;  // the host put it on the execution device: it stays and stays there
        }
        // Left here by remove(keep_residents_on_device): nothing moves now, and a later plain
        // remove() returns it to the host like any resident.
        kept_on_device = true;
      }
      ReplacedTensor r;
      r.handle = handle;
      r.sizes = handle.sizes().vec();
      r.strides = handle.strides().vec();
      r.original_device = kept_on_device ? c10::Device(c10::kCPU) : handle.device();
      r.kept_on_device = kept_on_device;
      r.requires_grad = handle.requires_grad();
      r.action = action;
      r.name = slot_name(entry, entry.tensors[t]);
      r.from_file = from_file && !kept_on_device;
      auto [it, inserted] =
          first_of_view.emplace(view_key(handle), static_cast<int>(s.replaced.size()));
      if (!inserted) r.tied_to = it->second;
      replaced_of[m][t] = static_cast<int>(s.replaced.size());
      s.replaced.push_back(std::move(r));
    }
  }

  return replaced_of;
}

// Phase 2: tensors that stay where they are but come from the file, read in place (loader.h).
void read_kept_from_file(OffloadState& s, const std::vector<std::vector<int>>& replaced_of,
                         std::vector<std::size_t> stays_from_file) {
  ModuleTree kept;
  stays_from_file.erase(std::unique(stays_from_file.begin(), stays_from_file.end()),
                        stays_from_file.end());
  for (std::size_t m : stays_from_file) {
    ModuleEntry e = s.tree.entries[m];
    e.tensors.clear();
    for (std::size_t t = 0; t < s.tree.entries[m].tensors.size(); ++t) {
      if (replaced_of[m][t] < 0) e.tensors.push_back(s.tree.entries[m].tensors[t]);
    }
    kept.entries.push_back(std::move(e));
  }
  materialize(kept, *s.weights, s.record_event);
}

// Phase 6: the report's moves, the loader's totals, tied views.
void finish_attach(OffloadState& s) {
  emit(s, "moves", s.setup.moves_seconds,
       {{"resident_bytes", s.setup.resident_bytes},
        {"move_once_bytes", s.setup.move_once_bytes},
        {"staging_bytes", s.setup.staging_bytes},
        {"resident_modules", s.setup.resident_modules}});

  if (s.weights) {
    s.weights->finish(s.record_event);
    s.setup.load_bytes = static_cast<std::int64_t>(s.weights->bytes_read());
    s.setup.load_seconds = s.weights->seconds();
  }

  // Tied views follow their first tensor.
  for (ReplacedTensor& r : s.replaced) {
    if (r.tied_to < 0) continue;
    at::Tensor target = s.replaced[r.tied_to].handle;
    set_weight(r.handle, target.detach());
    // One counter for both parameters, as views share one: a write through either is seen
    // (Note [Weights changed in place] in intercept_common.h).
    if (managed_of(target) != nullptr && !r.handle.is_inference() && !target.is_inference()) {
      r.handle.unsafeGetTensorImpl()->set_version_counter(
          target.unsafeGetTensorImpl()->version_counter());
    }
    if (r.handle.requires_grad() && managed_of(target) != nullptr) {
      r.handle.set_requires_grad(false);
      r.frozen_by_attach = true;
    }
  }
}

// Note [Training under offload]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A streamed weight lives in host memory and reaches the device only as a staged view that the
// op reads; autograd would put its gradient on the execution device, which a CPU parameter cannot
// take, so streamed weights are inference-only and get requires_grad=false while attached
// (restored by remove()). Gradients still flow through them to the inputs: the backward mm reads
// the weight through the same interception, which is what training adapters (LoRA) on a frozen
// base needs.
//
// What must not happen is a training step that silently leaves a weight without its gradient.
// Neither a parameter's requires_grad nor a module's training flag says "this will be trained":
// every parameter requires grad by default and every module starts in training mode, and
// diffusers' load_lora_adapter leaves the injected LoRA modules in training mode with their
// weights requiring grad for a model that only runs inference. What decides is autograd at run
// time. A streamed weight that still requires grad in a model whose host froze some other
// parameter (the host sorted them: an adapter, a block being fine-tuned) is marked trainable:
// the attach succeeds, ops under torch.no_grad() or inference mode run, and the first op that
// stages it with autograd enabled throws, naming it (StageScope::stage), before anything is
// computed with a gradient missing. In an untouched model (every parameter requiring grad) the
// streamed weights are frozen, counted in the report, and the first op with autograd enabled
// warns once. The LoRA matrices themselves are planned resident (Note [Adapter modules] in
// core/src/planner_patterns.cpp), so adapters train on a streamed base. One attach-time refusal
// stays: a quantized Linear's dense weight that requires grad in a module in training mode
// (quantize=), which is served from its quantized copy and could never be trained.
bool host_froze_some_parameter(const OffloadState& s) {
  for (const ModuleEntry& entry : s.tree.entries) {
    for (const TensorSlot& slot : entry.tensors) {
      if (slot.is_parameter && !slot.tensor.requires_grad()) return true;
    }
  }
  for (const QuantizedLinear& q : s.quantized) {
    if (!q.handle.requires_grad()) return true;
  }
  return false;
}

void mark_trainable(OffloadState& s) {
  if (!host_froze_some_parameter(s)) return;
  for (ReplacedTensor& r : s.replaced) r.trainable = r.requires_grad;
}

void refuse_trainable_streamed(const OffloadState& s) {
  if (s.quantized.empty() || !host_froze_some_parameter(s)) return;
  std::vector<std::string> names;
  for (const QuantizedLinear& q : s.quantized) {
    if (!s.tree.entries[q.entry].training || !q.handle.requires_grad()) continue;
    if (s.plan.modules[q.entry].tensors[q.slot].action != core::TensorAction::kStream) continue;
    names.push_back(q.name.empty() ? "<root>" : q.name);
  }
  if (names.empty()) return;
  const std::size_t count = names.size();
  if (names.size() > 8) names.resize(8);
  throw Error(Code::kFailedPrecondition,
              fmt::format("enable_offload: {} quantized Linear weight(s) that require grad are in "
                          "modules in training mode ({}{}), while other parameters are frozen; "
                          "streamed quantized weights are inference-only and would get no "
                          "gradient. Keep the modules you train resident "
                          "(always_resident_modules_pattern), or freeze them with "
                          "requires_grad_(False); for inference, call eval() on the model",
                          count, fmt::join(names, ", "), names.size() < count ? ", ..." : ""));
}

}  // namespace

void apply_plan(OffloadState& s, int pin_workers) {
  // Note [Attach phases].
  refuse_trainable_streamed(s);
  std::vector<std::size_t> stays_from_file;
  const ReplacedOf replaced_of = collect_replaced(s, stays_from_file);
  mark_trainable(s);
  check_smallest_plan_fits(s);
  if (!stays_from_file.empty()) read_kept_from_file(s, replaced_of, std::move(stays_from_file));
  place_residents(s, replaced_of);
  const std::vector<UnitLayout> units = layout_stream_units(s, replaced_of);
  // quantize='s placeholders are served through the interception whether or not anything
  // streams: a plan that places every quantized copy on the device still needs the runtime that
  // holds the interception, or the host's ops would read the placeholders' dense bytes.
  if (!units.empty() || !s.quantized.empty()) {
    s.runtime = build_stream_runtime(s, units, pin_workers);
  }
  install_quantized_weights(s);
  finish_attach(s);
}

std::int64_t sdnq_temporary_bytes_per_value(const OffloadState& s) {
  constexpr std::int64_t kKernel = 2;      // bf16 / fp16 written once
  constexpr std::int64_t kReference = 10;  // float32 values and products, then the result
  if (!s.backend->sdnq_kernels || !s.inventory.has_packed_layers()) return kReference;
  return sdnq::use_dequantize_kernel(s.torch_device.index()) ? kKernel : kReference;
}

}  // namespace ddo::adapter::internal
