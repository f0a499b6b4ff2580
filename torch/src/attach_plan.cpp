// Carrying a plan out (Note [Attach phases]); the way back is attach_restore.cpp, quantize= is
// attach_quantize.cpp.
//
// See Note [Setup order] for why tensors are re-pointed unit by unit.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#ifdef DDO_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "ddo/core/config.h"
#include "ddo/core/mapped_file.h"
#include "ddo/core/os_memory.h"
#include "ddo/core/units.h"
#include "ddo/core/working_set.h"
#include "ddo/engine/copy_scheduler.h"
#include "ddo/engine/device.h"
#include "ddo/engine/host_slab.h"
#include "ddo/engine/host_upload.h"
#include "ddo/torch/weight_cache.h"
#include "intercept_common.h"
#include "loader_pins.h"
#include "offload_state.h"
#include "weight_source.h"
#include "registration.h"
#include "weight_cache_internal.h"

#include "attach_common.h"
#include "attach_quantize.h"
#include "ddo/sdnq/kernel_status.h"

namespace ddo::adapter {
namespace internal {

// Note [Setup order]
// ------------------
// Streamed weights are copied into host slabs and re-pointed (set_data) unit by unit, in chunks
// of about 1 GiB, so each original storage can be freed as soon as its copy exists: for pageable
// slabs the process holds about one copy of the model at any time. Pinned slabs are committed
// when allocated, so pinning from an ordinary CPU model briefly holds both; the loader (loader.h)
// avoids that by loading straight into the slabs.

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

// The version counter's value (0 for an inference tensor, which has none).
std::uint32_t current_version(const at::Tensor& t) {
  return t.is_inference() ? 0 : t._version();
}

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

// The loader's residents and move-once tensors, file -> pinned bounce buffer -> device (Note
// [Host uploads], second case): tensors are packed into the held buffer and read in one parallel
// batch when it is full, then copied out of it while the next batch is read into the other one.
// A tensor larger than a buffer, or every tensor when the buffers cannot be pinned, is read into
// ordinary memory and copied registered (the first case).
class FileUploads {
 public:
  static constexpr std::size_t kMinBufferBytes = std::size_t{64} << 20;
  static constexpr std::size_t kMaxBufferBytes = std::size_t{256} << 20;
  static constexpr int kBuffers = 2;

  FileUploads(OffloadState& s, engine::Stream stream, std::size_t largest_bytes)
      : s_(s), stream_(stream) {
    const std::size_t bytes =
        std::clamp(align_up(largest_bytes, kTensorAlignment), kMinBufferBytes, kMaxBufferBytes);
    if (!engine::BounceBuffers::create(*s.device, bytes, kBuffers, stream, &bounce_).ok()) {
      bounce_.reset();  // not pinnable now: the registered path, slower and just as correct
    }
  }

  // Queues `r` (from the file) to land at device address `dst`.
  void add(const ReplacedTensor& r, char* dst) {
    const std::size_t n = span_bytes(r.handle);
    if (n == 0) return;
    if (!bounce_ || n > bounce_->buffer_bytes()) {
      copy_directly(r, dst, n);
      return;
    }
    if (buf_ != nullptr && align_up(used_, kTensorAlignment) + n > bounce_->buffer_bytes()) {
      flush();
    }
    if (buf_ == nullptr) throw_if_error(bounce_->acquire(&buf_));
    used_ = align_up(used_, kTensorAlignment);
    reads_.push_back({r.name, buf_ + used_, r.handle.scalar_type(), r.handle.numel()});
    copies_.emplace_back(dst, used_, n);
    used_ += n;
  }

  // Every queued tensor read and copied; the copies have landed.
  void finish() {
    flush();
    if (bounce_) throw_if_error(bounce_->drain());
  }

  std::size_t bounced_bytes() const { return bounce_ ? bounce_->bytes_copied() : 0; }

 private:
  void flush() {
    if (buf_ == nullptr) return;
    s_.weights->read(reads_, s_.record_event);
    for (const auto& [dst, offset, n] : copies_) throw_if_error(bounce_->copy_out(dst, offset, n));
    throw_if_error(bounce_->release());
    reads_.clear();
    copies_.clear();
    buf_ = nullptr;
    used_ = 0;
  }

  void copy_directly(const ReplacedTensor& r, char* dst, std::size_t n) {
    at::Tensor t = at::empty(r.sizes, at::TensorOptions().dtype(r.handle.scalar_type()));
    s_.weights->read({{r.name, t.data_ptr(), t.scalar_type(), t.numel()}}, s_.record_event);
    std::vector<void*> registered;
    throw_if_error(engine::copy_to_device_registered(
        *s_.device, dst, static_cast<const char*>(t.data_ptr()), n, stream_, &registered));
    s_.device->synchronize_stream(stream_);  // `t` is freed when this returns
    for (void* p : registered) s_.device->unregister_host(p);
  }

  OffloadState& s_;
  engine::Stream stream_;
  std::unique_ptr<engine::BounceBuffers> bounce_;
  char* buf_ = nullptr;  // the held buffer, or null
  std::size_t used_ = 0;
  std::vector<WeightSource::Read> reads_;
  std::vector<std::tuple<char*, std::size_t, std::size_t>> copies_;  // (dst, offset, bytes)
};

// Moves the resident / move-once tensors of one module into one device allocation. Those the
// loader reads from the file go through `uploads` (they land by uploads.finish()); the others are
// copied from host memory, registered, before this returns.
void move_module_to_device(OffloadState& s, const std::vector<std::size_t>& replaced_ids,
                           engine::Stream stream, FileUploads* uploads) {
  std::size_t total = 0;
  std::vector<std::size_t> offsets;
  for (std::size_t id : replaced_ids) {
    offsets.push_back(total);
    total += align_up(span_bytes(s.replaced[id].handle), kTensorAlignment);
  }
  if (total == 0) return;
  void* chunk = nullptr;
  Status st = s.device->allocate(total, &chunk);
  if (!st.ok()) {
    // Name the resident budget that chose these modules and what to change.
    std::string budget =
        ddo::internal::str_cat("; the plan keeps ", gib(s.plan.resident_used_bytes),
                               " GiB resident (budget ", gib(s.plan.resident_budget_bytes), " GiB");
    if (const core::Decision* d = s.plan.find_decision("resident_budget_fit")) {
      budget += ", already cut to the card: " + d->detail + ")";
    } else if (s.plan.find_decision("resident_budget_manual") != nullptr) {
      budget += ddo::internal::str_cat(
          " from resident_module_budget_gb=", s.settings.config.resident_module_budget_gb,
          "); lower it or set it to 0 for the balanced policy");
    } else if (s.plan.find_decision("resident_budget_profile") != nullptr) {
      budget += " from the saved profile); recalibrate on this card (build_profile=true)";
    } else {
      budget += "); lower vram_headroom or resident_module_budget_gb";
    }
    throw Error(st.code(), ddo::internal::str_cat("moving ", total, " bytes of resident and small ",
                                                  "tensors to ", s.device_name,
                                                  " failed: ", st.message(), budget));
  }
  std::shared_ptr<engine::Device> dev = s.device;
  std::shared_ptr<void> holder(chunk, [dev](void* p) { dev->deallocate(p); });
  std::vector<at::Tensor> sources;  // kept alive until their copies have landed
  std::vector<void*> registered;
  for (std::size_t k = 0; k < replaced_ids.size(); ++k) {
    const ReplacedTensor& r = s.replaced[replaced_ids[k]];
    char* dst = static_cast<char*>(chunk) + offsets[k];
    if (r.from_file) {
      uploads->add(r, dst);
      continue;
    }
    at::Tensor src = host_source(r.handle);
    const std::size_t n = span_bytes(src);
    if (n > 0 && is_pinned_loader_tensor(src)) {
      // Already pinned by the loader (Note [Loader pins]): a plain copy, nothing to register.
      throw_if_error(s.device->copy_to_device_async(dst, src.data_ptr(), n, stream));
    } else if (n > 0) {
      throw_if_error(engine::copy_to_device_registered(
          *s.device, dst, static_cast<const char*>(src.data_ptr()), n, stream, &registered));
    }
    sources.push_back(std::move(src));
  }
  if (!sources.empty()) s.device->synchronize_stream(stream);
  for (void* p : registered) s.device->unregister_host(p);
  for (std::size_t k = 0; k < replaced_ids.size(); ++k) {
    ReplacedTensor& r = s.replaced[replaced_ids[k]];
    at::Tensor dev_tensor =
        at::for_blob(static_cast<char*>(chunk) + offsets[k], r.sizes)
            .strides(r.strides)
            .deleter([holder](void*) {})
            .options(at::TensorOptions().dtype(r.handle.dtype()).device(s.torch_device))
            .target_device(s.torch_device)
            .make_tensor();
    set_weight(r.handle, dev_tensor);
  }
}

// Before anything moves: the smallest working set this plan can run with (its always-resident
// and move-once tensors, and a staging ring of one unit ahead, Note [Working set]) must fit in
// what the device has free, else the error says how much it needs and what to change. Residents
// chosen by a budget are not part of the minimum: the planner cuts a fixed budget to the card
// (decision resident_budget_fit), and an allocation that still fails names the budget.
void check_smallest_plan_fits(const OffloadState& s) {
  const core::Plan& plan = s.plan;
  if (!plan.execute || plan.stream_units.empty()) return;
  std::int64_t largest = 0;
  for (const core::StreamUnit& u : plan.stream_units) largest = std::max(largest, u.bytes);
  const std::int64_t staging = core::min_staging_bytes(largest);
  const std::int64_t temporary =
      s.inventory.largest_sdnq_temporary_bytes(sdnq_temporary_bytes_per_value(s));
  const std::int64_t smallest =
      plan.always_resident_bytes + plan.move_once_bytes + staging + temporary;
  const engine::DeviceMemory mem = s.device->memory();
  const std::int64_t free_bytes = std::max<std::int64_t>(0, mem.total_bytes - mem.used_bytes);
  if (smallest <= free_bytes) return;
  const auto g = [](std::int64_t b) { return fmt::format("{:.2f} GiB", core::bytes_to_gib(b)); };
  throw Error(
      Code::kResourceExhausted,
      fmt::format(
          "{} is too small for this model: its smallest plan needs {} on the device "
          "(always-resident {}, move-once {}, staging for three of the largest stream unit {} "
          "= {}{}), and {} of {} is free{}. Free device memory or raise vram_cap_gb; stream the "
          "always-resident modules too with always_resident_modules_pattern=[]; or keep modules "
          "on the host with skip_modules_pattern. Nothing was moved.",
          s.device_name, g(smallest), g(plan.always_resident_bytes), g(plan.move_once_bytes),
          g(largest), g(staging),
          temporary > 0
              ? fmt::format(", the largest SDNQ layer's dequantized weight {}", g(temporary))
              : std::string(),
          g(free_bytes), g(mem.total_bytes),
          s.settings.config.vram_cap_gb > 0
              ? fmt::format(" (vram_cap_gb={:g})", s.settings.config.vram_cap_gb)
              : std::string()));
}

// Note [Attach phases]
// ~~~~~~~~~~~~~~~~~~~~
// apply_plan carries a plan out in a fixed order, each phase one function below:
//   1. collect_replaced      every tensor the plan moves, with its original look (tied views
//                            follow the first); then check_smallest_plan_fits, before anything
//                            moves
//   2. read_kept_from_file   tensors that stay where they are but come from the loader's file
//   3. place_residents       residents and move-once tensors, one device allocation per module
//   4. layout_stream_units   the streamed tensors of each plan unit at their offsets
//   5. build_stream_runtime  host slabs (or the weight cache's), the scheduler and its staging,
//                            the fill and re-pointing in chunks, the units registered
//   6. finish_attach         the report's moves, the loader's totals, tied views
// A phase that throws leaves what the earlier ones did to enable_offload, which restores the model
// from the state's replaced tensors (OffloadState::restore with setup_failed) and rethrows.

// Phase 1: the tensors the plan touches; `stays_from_file` gets the modules whose kept tensors
// the loader fills.
std::vector<std::vector<int>> collect_replaced(OffloadState& s,
                                               std::vector<std::size_t>& stays_from_file) {
  const core::Plan& plan = s.plan;
  std::vector<std::vector<int>> replaced_of(s.tree.entries.size());
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

// Phase 3: residents and move-once tensors, one device allocation per module.
void place_residents(OffloadState& s, const std::vector<std::vector<int>>& replaced_of) {
  const core::Plan& plan = s.plan;
  auto t0 = Clock::now();
  std::vector<std::vector<std::size_t>> ids_of(s.tree.entries.size());
  std::size_t largest_from_file = 0;
  for (std::size_t m = 0; m < s.tree.entries.size(); ++m) {
    for (std::size_t t = 0; t < replaced_of[m].size(); ++t) {
      const int id = replaced_of[m][t];
      if (id < 0 || s.replaced[id].tied_to >= 0 || s.replaced[id].kept_on_device) continue;
      const core::TensorAction a = s.replaced[id].action;
      if (a != core::TensorAction::kResident && a != core::TensorAction::kMoveOnce) continue;
      const std::int64_t bytes =
          s.replaced[id].handle.numel() * s.replaced[id].handle.element_size();
      (a == core::TensorAction::kResident ? s.setup.resident_bytes : s.setup.move_once_bytes) +=
          bytes;
      if (s.replaced[id].from_file) {
        largest_from_file = std::max(largest_from_file, static_cast<std::size_t>(bytes));
      }
      ids_of[m].push_back(static_cast<std::size_t>(id));
    }
    if (plan.modules[m].placement == core::Placement::kResident) ++s.setup.resident_modules;
  }
  engine::Stream stream = s.device->create_stream();
  try {
    std::optional<FileUploads> uploads;
    if (largest_from_file > 0) uploads.emplace(s, stream, largest_from_file);
    for (std::size_t m = 0; m < ids_of.size(); ++m) {
      move_module_to_device(s, ids_of[m], stream, uploads ? &*uploads : nullptr);
    }
    if (uploads) {
      uploads->finish();
      s.setup.bounced_bytes = static_cast<std::int64_t>(uploads->bounced_bytes());
    }
  } catch (...) {
    s.device->synchronize_stream(stream);
    s.device->destroy_stream(stream);
    throw;
  }
  s.device->destroy_stream(stream);
  s.setup.moves_seconds = seconds_since(t0);
}

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

// Note [Disk-tier storage]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A disk-tier unit's bytes stay in the checkpoint: the copy scheduler reads them every step into
// its pinned ring. Its parameters still need host storage that reads as the weight, for what ddo
// does not intercept (an op on `weight * 1.0`, state_dict, torch.save, printing). They point into
// the checkpoint file itself, mapped copy-on-write (core::MappedFile): its pages come from the
// page cache when something reads them and cost nothing until then, a write gets a private page
// and never reaches the file (Note [Weights changed in place] refuses to serve it). A tensor whose
// file bytes are not what its parameter holds (another dtype, LoadOptions::dtype) or that is not
// aligned to its element size is converted once at attach into a temporary file in the system's
// temporary directory, mapped the same way, its pages dropped once written (setup.load
// "disk_spill_bytes").
struct DiskBacking {
  std::map<int, core::MappedFile> files;  // checkpoint file index -> its mapping
  core::MappedFile spill;
};

// Where each tensor of each disk-tier unit points: `(*data)[unit][k]`; empty for other units.
std::shared_ptr<DiskBacking> map_disk_tensors(OffloadState& s, const std::vector<UnitLayout>& units,
                                              std::vector<std::vector<char*>>* data) {
  auto backing = std::make_shared<DiskBacking>();
  data->assign(units.size(), {});
  std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> spilled;  // unit, k, offset
  std::vector<WeightSource::Read> spill_reads;
  std::size_t spill_bytes = 0;
  for (std::size_t ui = 0; ui < units.size(); ++ui) {
    const UnitLayout& u = units[ui];
    if (!u.disk) continue;
    (*data)[ui].assign(u.ids.size(), nullptr);
    for (std::size_t k = 0; k < u.ids.size(); ++k) {
      const ReplacedTensor& r = s.replaced[u.ids[k]];
      const core::CheckpointTensor& t = s.weights->find(r.name);
      const auto element = static_cast<std::uint64_t>(r.handle.element_size());
      if (to_scalar_type(t.dtype) == r.handle.scalar_type() && t.offset % element == 0) {
        auto [it, fresh] = backing->files.try_emplace(t.file);
        if (fresh) {
          throw_if_error(
              core::MappedFile::map_private(s.weights->checkpoint().files[t.file], &it->second));
        }
        (*data)[ui][k] = it->second.data() + t.offset;
        continue;
      }
      spill_bytes = (spill_bytes + 255) / 256 * 256;
      spilled.emplace_back(ui, k, spill_bytes);
      spill_reads.push_back(
          {r.name, reinterpret_cast<void*>(spill_bytes), r.handle.scalar_type(), r.handle.numel()});
      spill_bytes += span_bytes(r.handle);
    }
  }
  if (spill_bytes > 0) {
    std::filesystem::path tmp;
    throw_if_error(core::MappedFile::temporary_directory(&tmp));
    throw_if_error(core::MappedFile::create_temporary(tmp, spill_bytes, &backing->spill));
    throw_if_error(s.weights->read_unit(spill_reads, backing->spill.data()));
    backing->spill.drop_pages(0, spill_bytes);
    for (const auto& [ui, k, offset] : spilled) (*data)[ui][k] = backing->spill.data() + offset;
    s.setup.disk_spill_bytes = static_cast<std::int64_t>(spill_bytes);
  }
  return backing;
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
             s.inventory.largest_sdnq_temporary_bytes(sdnq_temporary_bytes_per_value(s)));
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

// Phase 5c: fills the slabs and re-points every streamed tensor at its managed storage.
void fill_and_repoint(OffloadState& s, const std::shared_ptr<StreamRuntime>& rt,
                      const std::vector<UnitLayout>& units,
                      const std::vector<std::vector<char*>>& disk_data, int pin_workers) {
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

// Phase 5: the stream runtime (5a-5d), finalized; the offload owns it from here.
void build_stream_runtime(OffloadState& s, const std::vector<UnitLayout>& units, int pin_workers) {
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
  std::vector<std::vector<char*>> disk_data;
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
  s.runtime = std::move(rt);
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
  const std::vector<std::vector<int>> replaced_of = collect_replaced(s, stays_from_file);
  mark_trainable(s);
  check_smallest_plan_fits(s);
  if (!stays_from_file.empty()) read_kept_from_file(s, replaced_of, std::move(stays_from_file));
  place_residents(s, replaced_of);
  const std::vector<UnitLayout> units = layout_stream_units(s, replaced_of);
  if (!units.empty()) build_stream_runtime(s, units, pin_workers);
  install_quantized_weights(s);
  finish_attach(s);
}

std::int64_t sdnq_temporary_bytes_per_value(const OffloadState& s) {
  constexpr std::int64_t kKernel = 2;      // bf16 / fp16 written once
  constexpr std::int64_t kReference = 10;  // float32 values and products, then the result
  if (!s.backend->sdnq_kernels || !s.inventory.has_sdnq_layers()) return kReference;
  return sdnq::use_dequantize_kernel(s.torch_device.index()) ? kKernel : kReference;
}

}  // namespace internal
}  // namespace ddo::adapter
