// remove(): the model's tensors back, in two phases (Note [Restore in two phases]), and the
// pinned-weight cache entry its slabs become (Note [Pinned-weight cache] in weight_cache.cpp).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include "ddo/core/units.h"
#include "ddo/torch/loader.h"
#include "ddo/torch/memory_probe.h"
#include "ddo/torch/weight_cache.h"
#include "attach_common.h"
#include "attach_quantize.h"
#include "offload_state.h"
#include "weight_cache_internal.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

namespace {

// The bound of Note [Pinned-weight cache]: the explicit pin bounds, else RAM less the headroom.
std::optional<std::int64_t> weight_cache_budget(const OffloadState& s) {
  const core::DynamicOffloadConfig& c = s.settings.config;
  std::optional<std::int64_t> bound;
  for (double gb : {c.pin_weight_budget_gb, c.max_pin_weight_budget_gb}) {
    if (gb <= 0) continue;
    const std::int64_t b = core::to_bytes_or_throw(gb, core::ByteUnit::kGiB, "pin weight budget");
    bound = bound ? std::min(*bound, b) : b;
  }
  if (bound) return bound;
  const std::optional<std::int64_t> available = s.settings.available_ram_bytes();
  if (!available) return std::nullopt;
  const std::int64_t headroom = core::to_bytes_or_throw(
      c.system_ram_headroom_gb, core::ByteUnit::kGiB, "system_ram_headroom_gb");
  // Detected free RAM does not count what the cache and this offload's slabs already hold.
  std::int64_t held = 0;
  if (!c.available_system_ram_gb) {
    held = pinned_weight_cache_stats().bytes;
    if (s.runtime) held += s.runtime->slabs->stats().slab_bytes;
  }
  return std::max<std::int64_t>(0, *available + held - headroom);
}

// An empty cache entry for this offload's slabs when remove() should keep them, else null: the
// cache is on and kept, something is streamed, every streamed weight came from the CPU, and the
// slabs fit the bound (a larger entry is counted as rejected).
std::shared_ptr<CachedWeights> make_cache_entry(const OffloadState& s, bool keep) {
  if (!keep || !s.settings.config.cache_pinned_weights || !s.runtime || !s.runtime->slabs) {
    return nullptr;
  }
  for (const bool on_disk : s.runtime->unit_on_disk) {
    if (on_disk) return nullptr;  // a disk-tier unit has no slab to keep
  }
  if (s.setup.adopted_units > 0) return nullptr;  // loader pins go back to the loader's tensors
  for (const ReplacedTensor& r : s.replaced) {
    if (r.unit >= 0 && r.tied_to < 0 && !r.original_device.is_cpu()) return nullptr;
  }
  auto entry = std::make_shared<CachedWeights>();
  entry->ns = s.settings.config.pinned_weight_cache_namespace;
  entry->key = s.weight_cache_key;
  entry->slabs = s.runtime->slabs;
  entry->unit_bytes = s.unit_bytes;
  entry->bytes = s.runtime->slabs->stats().slab_bytes;
  const std::optional<std::int64_t> budget = weight_cache_budget(s);
  if (budget && entry->bytes > *budget) {
    (void)put_cached_weights(std::move(entry), budget);  // counts the rejection
    return nullptr;
  }
  return entry;
}

// Note [Restore in two phases]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// remove() first builds every tensor the model gets back (reads from the checkpoint for the disk
// tier, copies out of the slabs, device copies), and only when all of them exist re-points the
// parameters, which cannot fail. A failure in the first phase (a shard truncated since the load,
// out of memory) therefore leaves the offload exactly as it was: still active, every weight
// still served, and the error says so; the host fixes the cause and calls remove() again. A copy
// keeps the tensor's own layout (sizes, strides, storage offset) over a storage of the same
// extent, so a weight whose strides overlap (an expanded view, stride 0) comes back as such.
at::Tensor copy_with_layout(const at::Tensor& t) {
  const std::size_t span = span_bytes(t);
  const int64_t extent = static_cast<int64_t>(span / t.element_size());
  at::Tensor base = at::empty({extent}, at::TensorOptions().dtype(t.dtype()));
  if (extent > 0) base.copy_(t.detach().as_strided({extent}, {1}, t.storage_offset()));
  return base.as_strided(t.sizes(), t.strides(), 0);
}

// A streamed weight that stays in its slab region for the pinned-weight cache: a CPU view of
// the region, owned by the cache entry and the view together.
at::Tensor cached_view(const ReplacedTensor& r, const StreamRuntime& runtime,
                       CachedWeights& entry) {
  char* data = static_cast<char*>(runtime.slabs->tensor_ptr(r.unit)) + r.unit_offset;
  const std::size_t span = span_bytes(r.handle);
  CachedTensor c;
  c.name = r.name;
  c.sizes = r.sizes;
  c.strides = r.strides;
  c.dtype = r.handle.scalar_type();
  c.unit = static_cast<std::size_t>(r.unit);
  c.offset = r.unit_offset;
  c.span = span;
  c.fingerprint = sample_fingerprint(data, span);
  at::Tensor view =
      make_cached_view(data, span, r.sizes, r.strides, c.dtype, runtime.slabs, &c.lease);
  entry.tensors.push_back(std::move(c));
  return view;
}

// What remove() was asked for besides restoring.
struct RestoreChoice {
  bool setup_failed = false;
  bool keep_residents = false;
};

// Phase 1 for one untied tensor: what its parameter gets back. `stays`: it is left on the
// device (RemoveOptions::keep_residents_on_device).
at::Tensor tensor_back(const OffloadState& s, const ReplacedTensor& r, RestoreChoice choice,
                       CachedWeights* entry, bool* stays) {
  if (choice.setup_failed && r.from_file) return make_placeholder(r.sizes, r.handle.scalar_type());
  if (choice.keep_residents && !s.backend->memory_is_host &&
      (r.action == core::TensorAction::kResident || r.action == core::TensorAction::kMoveOnce) &&
      r.handle.device() == s.torch_device) {
    // Stays in its device chunk for the next attach, which finds it on the execution device and
    // moves nothing.
    *stays = true;
    return r.handle.detach();
  }
  if (r.unit >= 0 && s.runtime && s.runtime->unit_on_disk[static_cast<std::size_t>(r.unit)] &&
      s.weights) {
    // Disk tier: the weight was never in host memory; the model the host gets back reads it
    // from the checkpoint once more, into an ordinary CPU tensor. A weight the host wrote in
    // place while attached (load_state_dict, a LoRA fuse) holds its new bytes in the private
    // mapping's written pages, and the forward that would have served it refuses: those bytes
    // are what the host gets back, copied out of the mapping.
    const ManagedWeight* m = managed_of(r.handle);
    if (m != nullptr && !r.handle.is_inference() &&
        static_cast<std::uint32_t>(r.handle._version()) != m->version) {
      at::Tensor written = copy_with_layout(r.handle);
      return r.original_device.is_cpu() ? written : written.to(r.original_device);
    }
    at::Tensor t = s.weights->read_cpu(r.name, r.handle, s.record_event);
    return r.original_device.is_cpu() ? t : t.to(r.original_device);
  }
  // Streamed where the loader pinned it: the loader's own tensor again (Note [Loader pins]), so
  // a later attach adopts it once more.
  if (r.loader_pin.defined()) return r.loader_pin;
  if (entry != nullptr && r.unit >= 0) return cached_view(r, *s.runtime, *entry);
  at::Tensor fresh = copy_with_layout(r.handle);
  return r.original_device.is_cpu() ? fresh : fresh.to(r.original_device);
}

}  // namespace

void OffloadState::restore(bool keep_weight_cache, bool setup_failed, bool keep_residents) {
  if (!active) return;
  ScopedUncountedCpuAllocations uncounted;
  if (runtime) {
    runtime->release_held();
    runtime->scheduler->drain();
  }
  if (device) device->synchronize_stream(engine::kDefaultStream);
  at::AutoGradMode no_grad(false);
  std::shared_ptr<CachedWeights> entry =
      setup_failed ? nullptr : make_cache_entry(*this, keep_weight_cache);
  // Phase 1 (Note [Restore in two phases]): what each parameter gets back; nothing re-pointed.
  std::vector<at::Tensor> restored(replaced.size());
  std::vector<const at::Tensor*> kept;  // left on the device: remembered once phase 1 succeeded
  std::int64_t kept_bytes = 0;
  std::vector<at::Tensor> dense_back;  // quantize='s Linears (attach_quantize.h)
  try {
    dense_back = quantized_weights_back(*this);
    const RestoreChoice choice{setup_failed, keep_residents};
    for (std::size_t i = 0; i < replaced.size(); ++i) {
      const ReplacedTensor& r = replaced[i];
      if (r.tied_to >= 0) {
        restored[i] = restored[r.tied_to];
        continue;
      }
      bool stays = false;
      restored[i] = tensor_back(*this, r, choice, entry.get(), &stays);
      if (stays) {
        kept_bytes += static_cast<std::int64_t>(span_bytes(r.handle));
        kept.push_back(&restored[i]);
      }
    }
  } catch (const std::exception& e) {
    throw Error(Code::kDataLoss,
                ddo::internal::str_cat(
                    "remove() could not restore the weights of ", model_class, ": ", e.what(),
                    "; nothing was changed: the offload is still active and the model runs as "
                    "before. Fix the cause (e.g. restore the checkpoint file) and call remove() "
                    "again"));
  }
  // Phase 2: cannot fail.
  active = false;
  if (!keep_weight_cache && settings.config.cache_pinned_weights) {
    (void)take_cached_weights(weight_cache_key);  // dropped
  }
  for (const at::Tensor* t : kept) remember_kept_on_device(*t);
  kept_on_device_bytes += kept_bytes;
  put_back_quantized_weights(*this, dense_back);
  for (std::size_t i = 0; i < replaced.size(); ++i) {
    ReplacedTensor& r = replaced[i];
    r.handle.set_data(restored[i]);
    if (r.frozen_by_attach && r.handle.is_leaf() && !r.handle.requires_grad()) {
      r.handle.set_requires_grad(true);
    }
  }
  if (entry) {
    std::sort(entry->tensors.begin(), entry->tensors.end(),
              [](const CachedTensor& a, const CachedTensor& b) {
                return std::make_pair(a.unit, a.offset) < std::make_pair(b.unit, b.offset);
              });
    // make_cache_entry checked the size against the budget, so the entry is kept.
    (void)put_cached_weights(std::move(entry), weight_cache_budget(*this));
  }
  replaced.clear();
  totals_at_remove = run_totals(*this);
  runtime.reset();
  counting.reset();
  weights.reset();  // the disk tier's files
}

}  // namespace ddo::adapter::internal
