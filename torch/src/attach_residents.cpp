// Residents and move-once tensors on the execution device (phase 3 of Note [Attach phases] in
// attach_plan.cpp): one device allocation per module, filled from host memory (registered for
// the copy, Note [Host registrations of the attach]) or from the loader's file through pinned
// bounce buffers; and the check, before anything moves, that the plan's smallest working set
// fits the device.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <fmt/format.h>

#include "ddo/core/units.h"
#include "ddo/core/working_set.h"
#include "ddo/engine/device.h"
#include "ddo/engine/host_upload.h"
#include "attach_common.h"
#include "attach_placement.h"
#include "host_registrations.h"
#include "loader_pins.h"
#include "offload_state.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

namespace {

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
    // `t` outlives the copy: the owner waits for it (Note [Host registrations of the attach]).
    HostRegistrations registered(*s_.device, stream_);
    throw_if_error(engine::copy_to_device_registered(*s_.device, dst,
                                                     static_cast<const char*>(t.data_ptr()), n,
                                                     stream_, registered.copy_queued()));
    registered.release();
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
  // Declared after what the copies touch (Note [Host registrations of the attach]).
  HostRegistrations registered(*s.device, stream);
  for (std::size_t k = 0; k < replaced_ids.size(); ++k) {
    const ReplacedTensor& r = s.replaced[replaced_ids[k]];
    char* dst = static_cast<char*>(chunk) + offsets[k];
    if (r.from_file) {
      uploads->add(r, dst);
      continue;
    }
    sources.push_back(host_source(r.handle));  // held before its copy is queued
    const at::Tensor& src = sources.back();
    const std::size_t n = span_bytes(src);
    if (n > 0 && is_pinned_loader_tensor(src)) {
      // Already pinned by the loader (Note [Loader pins]): a plain copy, nothing to register.
      (void)registered.copy_queued();
      throw_if_error(s.device->copy_to_device_async(dst, src.data_ptr(), n, stream));
    } else if (n > 0) {
      throw_if_error(engine::copy_to_device_registered(*s.device, dst,
                                                       static_cast<const char*>(src.data_ptr()), n,
                                                       stream, registered.copy_queued()));
    }
  }
  registered.release();
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

}  // namespace

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
      s.inventory.largest_packed_temporary_bytes(sdnq_temporary_bytes_per_value(s));
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

}  // namespace ddo::adapter::internal
