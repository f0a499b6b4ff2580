// The streamed tensors of an attach (phases 4 and 5a, 5c of Note [Attach phases] in
// attach_plan.cpp): each plan unit's tensors at aligned offsets, the host slabs that hold them
// (or the pinned-weight cache's), and the fill that copies them in and re-points each tensor at
// its managed storage, chunk by chunk (Note [Setup order]).
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ddo/core/os_memory.h"
#include "ddo/engine/device.h"
#include "ddo/engine/host_slab.h"
#include "ddo/engine/host_upload.h"
#include "ddo/torch/weight_cache.h"
#include "attach_common.h"
#include "attach_placement.h"
#include "intercept_common.h"
#include "loader_pins.h"
#include "offload_state.h"
#include "weight_cache_internal.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

// Note [Setup order]
// ------------------
// Streamed weights are copied into host slabs and re-pointed (set_data) unit by unit, in chunks
// of about 1 GiB, so each original storage can be freed as soon as its copy exists: for pageable
// slabs the process holds about one copy of the model at any time. Pinned slabs are committed
// when allocated, so pinning from an ordinary CPU model briefly holds both; the loader (loader.h)
// avoids that by loading straight into the slabs.

namespace {

// The pinned-weight cache's entry for this model when it can serve this attach, else null (an
// unusable entry is dropped). See Note [Pinned-weight cache] in weight_cache.cpp. `ids`: the
// streamed, untied replaced tensors.
std::shared_ptr<CachedWeights> take_matching_cache_entry(OffloadState& s, std::vector<int> ids) {
  std::shared_ptr<CachedWeights> entry = take_cached_weights(s.weight_cache_key);
  if (!entry) return nullptr;
  std::sort(ids.begin(), ids.end(), [&](int a, int b) {
    return std::make_pair(s.replaced[a].unit, s.replaced[a].unit_offset) <
           std::make_pair(s.replaced[b].unit, s.replaced[b].unit_offset);
  });
  bool same = entry->unit_bytes == s.unit_bytes && entry->tensors.size() == ids.size();
  for (std::size_t k = 0; same && k < ids.size(); ++k) {
    const ReplacedTensor& r = s.replaced[ids[k]];
    const CachedTensor& c = entry->tensors[k];
    same = c.name == r.name && c.sizes == r.sizes && c.strides == r.strides &&
           c.dtype == r.handle.scalar_type() && static_cast<int>(c.unit) == r.unit &&
           c.offset == r.unit_offset;
  }
  if (!same) {
    count_weight_cache_stale();
    return nullptr;
  }
  std::map<int, std::uint64_t> fingerprints;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const ReplacedTensor& r = s.replaced[ids[k]];
    const CachedTensor& c = entry->tensors[k];
    const char* region = static_cast<const char*>(entry->slabs->tensor_ptr(c.unit)) + c.offset;
    const bool in_place = r.handle.device().is_cpu() && r.handle.data_ptr() == region;
    // A re-pointed weight is copied into its region: only while nothing else reads it.
    if (!in_place && !c.lease.expired()) return nullptr;
    fingerprints[ids[k]] = c.fingerprint;
  }
  s.cached_fingerprints = std::move(fingerprints);
  return entry;
}

std::uint64_t cached_fingerprint(const OffloadState& s, int id) {
  auto it = s.cached_fingerprints.find(id);
  return it == s.cached_fingerprints.end() ? 0 : it->second;
}

// Re-points a streamed tensor at a managed storage over `data`, its bytes in host memory (or in
// the mapped file for a disk-tier unit); a weight that required grad is frozen.
void repoint_managed(ReplacedTensor& r, const std::shared_ptr<StreamRuntime>& rt, int unit,
                     std::size_t offset, char* data) {
  at::Tensor managed = make_managed_tensor(data, span_bytes(r.handle), r.sizes, r.strides,
                                           r.handle.scalar_type(), rt, unit, offset);
  set_weight(r.handle, managed);
  ManagedWeight* record = managed_of(managed);
  if (r.handle.requires_grad()) {
    r.handle.set_requires_grad(false);
    r.frozen_by_attach = true;
    if (r.trainable) {
      record->trainable_index = static_cast<int>(rt->trainable_names.size());
      rt->trainable_names.push_back(r.name);
    } else {
      ++rt->frozen_weights;
    }
  }
  record->version = current_version(r.handle);
}

}  // namespace

// Phase 5c: fills the slabs and re-points every streamed tensor at its managed storage.
void fill_and_repoint(OffloadState& s, const std::shared_ptr<StreamRuntime>& rt,
                      const std::vector<UnitLayout>& units, const DiskTensorData& disk_data,
                      int pin_workers) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  // Where tensor k of unit ui lives in host memory.
  auto tensor_data = [&](std::size_t ui, std::size_t k) -> char* {
    if (units[ui].disk) return disk_data[ui][k];
    if (units[ui].adopted) return units[ui].data + units[ui].offsets[k];
    return static_cast<char*>(rt->slabs->tensor_ptr(ui)) + units[ui].offsets[k];
  };
  // Fill and re-point in chunks (Note [Setup order]).
  std::vector<std::tuple<void*, const void*, std::size_t>> jobs;
  std::vector<WeightSource::Read> reads;  // the loader's: file -> slab, no CPU copy
  std::vector<std::pair<std::size_t, std::size_t>> pending;  // (unit, index in unit)
  std::vector<at::Tensor> keep_sources;
  std::size_t chunk_bytes = 0;
  auto flush = [&] {
    engine::parallel_memcpy(jobs, pin_workers);
    if (!reads.empty()) s.weights->read(reads, s.record_event);
    reads.clear();
    for (const auto& [ui, k] : pending) {
      repoint_managed(s.replaced[units[ui].ids[k]], rt, static_cast<int>(ui), units[ui].offsets[k],
                      tensor_data(ui, k));
    }
    jobs.clear();
    pending.clear();
    keep_sources.clear();
    chunk_bytes = 0;
    // Originals below glibc's mmap threshold were freed into the heap; hand those pages back
    // so the process holds about one copy of the model (Note [Setup order]).
    core::os::trim_heap();
  };
  for (std::size_t ui = 0; ui < units.size(); ++ui) {
    const UnitLayout& u = units[ui];
    for (std::size_t k = 0; k < u.ids.size(); ++k) {
      const ReplacedTensor& r = s.replaced[u.ids[k]];
      const at::Tensor& h = r.handle;
      s.setup.streamed_bytes += h.numel() * h.element_size();
      if (u.disk) {
        // Stays in the file; the scheduler reads it every step (no bytes now).
        s.setup.disk_bytes += h.numel() * h.element_size();
        pending.emplace_back(ui, k);
        continue;
      }
      if (u.adopted) {
        // Stays in the loader's pinned slab (Note [Loader pins]): no copy.
        s.setup.adopted_bytes += h.numel() * h.element_size();
        ++s.setup.adopted_units;
        pending.emplace_back(ui, k);
        continue;
      }
      char* dst = static_cast<char*>(rt->slabs->tensor_ptr(ui)) + u.offsets[k];
      if (r.from_file) {
        reads.push_back({r.name, dst, h.scalar_type(), h.numel()});
        chunk_bytes += span_bytes(h);
        pending.emplace_back(ui, k);
        continue;
      }
      at::Tensor src = host_source(h);
      const std::size_t n = span_bytes(src);
      if (n > 0 && dst == src.data_ptr()) {
        // Already in its cached slab region (Note [Pinned-weight cache]): no copy.
        s.setup.weight_cache_reused_bytes += static_cast<std::int64_t>(n);
        if (sample_fingerprint(dst, n) != cached_fingerprint(s, u.ids[k])) {
          ++s.setup.weight_cache_changed_in_place;
        }
      } else if (n > 0) {
        jobs.emplace_back(dst, src.data_ptr(), n);
        chunk_bytes += n;  // only copies count: a cache hit flushes (and trims) once
        if (s.setup.weight_cache == "hit") {
          s.setup.weight_cache_refilled_bytes += static_cast<std::int64_t>(n);
        }
      }
      keep_sources.push_back(std::move(src));
      pending.emplace_back(ui, k);
    }
    if (chunk_bytes >= kFillChunkBytes) flush();
  }
  flush();
  throw_if_error(rt->slabs->pin_registered(pin_workers));
  s.cached_fingerprints.clear();
  if (config.cache_pinned_weights) {
    count_weight_cache_attach(s.setup.weight_cache == "hit", s.setup.weight_cache_reused_bytes,
                              s.setup.weight_cache_refilled_bytes,
                              s.setup.weight_cache_changed_in_place);
  }
}

// Phase 4: the units the plan streams, each with its tensors at aligned offsets.
std::vector<UnitLayout> layout_stream_units(OffloadState& s,
                                            const std::vector<std::vector<int>>& replaced_of) {
  const core::Plan& plan = s.plan;
  std::vector<UnitLayout> units;
  std::vector<bool> patched(s.tree.entries.size(), false);
  for (const core::StreamUnit& su : plan.stream_units) {
    UnitLayout u;
    if (!su.tensors.empty()) u.module = su.tensors.front().module;
    u.disk = su.tier == "disk" && s.weights != nullptr;
    for (const core::TensorRef& ref : su.tensors) {
      const int id = replaced_of[ref.module][ref.tensor];
      if (id < 0 || s.replaced[id].tied_to >= 0) continue;
      u.disk = u.disk && s.replaced[id].from_file;
      u.offsets.push_back(u.bytes);
      u.ids.push_back(id);
      u.bytes += align_up(span_bytes(s.replaced[id].handle), kTensorAlignment);
      u.pinned = u.pinned || plan.modules[ref.module].tensors[ref.tensor].pin;
      patched[ref.module] = true;
    }
    if (!u.disk && u.ids.size() == 1) {
      ReplacedTensor& r = s.replaced[u.ids.front()];
      const LoaderPin* pin = loader_pin_of(r.handle);
      if (pin != nullptr && pin->streamable(r.handle, u.bytes)) {
        u.adopted = true;
        u.data = static_cast<char*>(r.handle.data_ptr());
        r.loader_pin = r.handle.detach();  // keeps its slab; remove() gives it back
      }
    }
    if (u.bytes > 0) units.push_back(std::move(u));
  }
  s.setup.modules_patched = static_cast<int>(std::count(patched.begin(), patched.end(), true));
  s.setup.stream_units = static_cast<int>(units.size());
  return units;
}

// Phase 5a: the host bytes of the units: the weight cache's slabs on a hit, else fresh slabs
// (pinned where the plan says so); disk-tier units get no slab, their tensors point where
// map_disk_tensors says.
void make_host_slabs(OffloadState& s, const std::shared_ptr<StreamRuntime>& rt,
                     const std::vector<UnitLayout>& units, const std::vector<int>& streamed_ids) {
  const core::DynamicOffloadConfig& config = s.settings.config;
  bool any_disk = false;
  bool any_adopted = false;
  for (const UnitLayout& u : units) {
    rt->unit_on_disk.push_back(u.disk);
    any_disk = any_disk || u.disk;
    any_adopted = any_adopted || u.adopted;
  }
  // The pinned-weight cache keeps slabs; disk-tier units have none, so it stays out of the way.
  if (config.cache_pinned_weights && any_disk) s.setup.weight_cache = "off: disk tier";
  // Loader pins are the loader's: remove() gives them back, there is no slab to keep.
  if (config.cache_pinned_weights && any_adopted && !any_disk) {
    s.setup.weight_cache = "off: loader pins";
  }
  if (config.cache_pinned_weights && !any_disk && !any_adopted) {
    std::shared_ptr<CachedWeights> cached = take_matching_cache_entry(s, streamed_ids);
    s.setup.weight_cache = cached ? "hit" : "miss";
    if (cached) rt->slabs = cached->slabs;
  }
  if (!rt->slabs) {
    std::vector<engine::SlabTensor> slab_tensors;
    // A disk-tier or adopted unit takes no slab bytes (its entry is empty; HostSlabs skips it).
    slab_tensors.reserve(units.size());
    for (const UnitLayout& u : units) {
      slab_tensors.push_back(
          u.disk || u.adopted ? engine::SlabTensor{0, false}
                              : engine::SlabTensor{u.bytes, u.pinned && s.settings.pin_effective});
    }
    engine::HostSlabOptions slab_options;
    slab_options.allow_pin_fallback = config.allow_pin_memory_fallback;
    // Fill ordinary memory, then register it: several times faster than cudaHostAlloc, and the
    // pages are committed as the fill goes, so the originals freed per chunk keep host RAM near
    // one copy (Note [Setup order]; Note [Exact-size slabs] in host_slab.cpp).
    slab_options.pin_by_register = s.device->caps().host_register;
    std::unique_ptr<engine::HostSlabs> fresh;
    throw_if_error(engine::HostSlabs::create(*s.device, slab_tensors, slab_options, &fresh));
    // The slabs keep the device that pinned them: the weight cache may outlive this offload.
    std::shared_ptr<engine::Device> pinned_by = s.device;
    engine::HostSlabs* raw = fresh.release();
    rt->slabs = std::shared_ptr<engine::HostSlabs>(
        raw, [pinned_by](engine::HostSlabs* slabs) { delete slabs; });
  }
}

}  // namespace ddo::adapter::internal
