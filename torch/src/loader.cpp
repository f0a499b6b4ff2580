#include "ddo/torch/loader.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>

#include "ddo/core/os_memory.h"
#include "ddo/core/planner.h"
#include "ddo/core/status.h"
#include "ddo/core/units.h"
#include "host_tensor.h"
#include "weight_source.h"

namespace ddo::adapter {

// Note [Placeholders]
// -------------------
// A module built for loading has no weights yet, but ddo needs tensor handles it can re-point
// with set_data(), and set_data() refuses to turn a meta tensor into a CPU one. So every weight
// the file will provide is first a placeholder: a CPU tensor of the right shape and dtype over a
// read-only anonymous mapping that all placeholders share. It costs address space, not memory
// (core::os::reserve_zero_pages: never written, every page reads as zero; Note [Zero pages per
// platform] in ddo/core/os_memory.h), so a FLUX-sized module of placeholders has an RSS of a few
// MB. Reading a placeholder gives zeros; writing one faults,
// which is why nothing but the loader ever sees them: enable_offload re-points each to the
// memory the plan gives it, and a failed setup re-points them back to placeholders.

namespace {

struct PlaceholderRegion {
  void* base = nullptr;
  std::size_t bytes = 0;
  ~PlaceholderRegion() { core::os::release_zero_pages(base, bytes); }
};

std::mutex g_region_mu;
std::shared_ptr<PlaceholderRegion> g_region;  // the largest so far; older ones live in tensors

std::shared_ptr<PlaceholderRegion> region_for(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(g_region_mu);
  if (g_region && g_region->bytes >= bytes) return g_region;
  // Address space only; at least 4 GiB so a model's placeholders share one mapping.
  const std::size_t size = std::max<std::size_t>(bytes, std::size_t{4} << 30);
  std::string why;
  void* p = core::os::reserve_zero_pages(size, &why);
  DDO_CHECK(p != nullptr, Code::kResourceExhausted, "reserving ", size,
            " bytes of address space for the loader's placeholders failed (", why,
            "); the process may be limited by ulimit -v");
  auto region = std::make_shared<PlaceholderRegion>();
  region->base = p;
  region->bytes = size;
  g_region = region;
  return region;
}

void placeholder_deleter(void* context) {
  delete static_cast<std::shared_ptr<PlaceholderRegion>*>(context);
}

std::string join_names(const std::vector<std::string>& names, std::size_t max_listed = 8) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < max_listed; ++i) {
    if (i > 0) out += ", ";
    out += "'" + names[i] + "'";
  }
  if (names.size() > max_listed) out += fmt::format(" and {} more", names.size() - max_listed);
  return out;
}

std::string shape_text(at::IntArrayRef shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

bool is_floating(at::ScalarType t) {
  return at::isFloatingType(t);
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

at::ScalarType to_scalar_type(core::TensorDtype dtype) {
  switch (dtype) {
    case core::TensorDtype::kF64:
      return at::kDouble;
    case core::TensorDtype::kF32:
      return at::kFloat;
    case core::TensorDtype::kF16:
      return at::kHalf;
    case core::TensorDtype::kBF16:
      return at::kBFloat16;
    case core::TensorDtype::kI64:
      return at::kLong;
    case core::TensorDtype::kI32:
      return at::kInt;
    case core::TensorDtype::kI16:
      return at::kShort;
    case core::TensorDtype::kI8:
      return at::kChar;
    case core::TensorDtype::kU8:
      return at::kByte;
    case core::TensorDtype::kBool:
      return at::kBool;
    case core::TensorDtype::kF8E4M3:
      return at::kFloat8_e4m3fn;
    case core::TensorDtype::kF8E5M2:
      return at::kFloat8_e5m2;
  }
  return at::kFloat;
}

at::Tensor make_placeholder(at::IntArrayRef sizes, at::ScalarType dtype) {
  const at::Tensor like = at::empty(sizes, at::TensorOptions().dtype(dtype).device(at::kMeta));
  const std::size_t bytes = static_cast<std::size_t>(like.numel()) * like.element_size();
  std::shared_ptr<PlaceholderRegion> region = region_for(bytes);
  void* base = region->base;
  return internal::cpu_tensor_over(base, bytes, sizes, like.strides(), dtype,
                                   new std::shared_ptr<PlaceholderRegion>(std::move(region)),
                                   &placeholder_deleter);
}

bool is_placeholder(const at::Tensor& t) {
  return internal::has_deleter(t, &placeholder_deleter);
}

std::string slot_name(const ModuleEntry& entry, const TensorSlot& slot) {
  return entry.name.empty() ? slot.name : entry.name + "." + slot.name;
}

// --- WeightSource --------------------------------------------------------------------------------

WeightSource::WeightSource(core::Checkpoint checkpoint, LoadOptions options)
    : checkpoint_(std::move(checkpoint)), options_(std::move(options)) {
  workers_ = options_.read_workers > 0
                 ? options_.read_workers
                 : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 4, 16);
  // The disk tier's queue (Note [Disk unit reads]): half the load's workers, at least 2.
  throw_if_error(core::CheckpointReader::open(checkpoint_, &reader_, std::max(2, workers_ / 2)));
}

WeightSource::~WeightSource() = default;

const core::CheckpointTensor& WeightSource::find(const std::string& name) const {
  auto alias = stored_as_.find(name);
  const std::string& key = alias == stored_as_.end() ? name : alias->second;
  const core::CheckpointTensor* t = checkpoint_.find(key);
  DDO_CHECK(t != nullptr, Code::kNotFound, checkpoint_.root, " has no tensor '", key,
            "' (the loader checked the module against it first: this is a ddo bug)");
  return *t;
}

bool WeightSource::has(const std::string& name) const {
  return checkpoint_.find(name) != nullptr || stored_as_.count(name) > 0;
}

void WeightSource::check(const ModuleTree& tree) {
  std::vector<std::string> missing, mismatched;
  std::set<std::string> used;
  // Tied tensors share one storage; the file stores each storage once, under any of its names.
  std::map<const void*, std::vector<std::string>> names_of_storage;
  std::map<std::string, const at::Tensor*> tensor_of;
  for (const ModuleEntry& entry : tree.entries) {
    for (const TensorSlot& slot : entry.tensors) {
      const std::string name = slot_name(entry, slot);
      tensor_of[name] = &slot.tensor;
      names_of_storage[slot.tensor.storage().unsafeGetStorageImpl()].push_back(name);
    }
  }
  total_bytes_ = 0;
  std::set<const void*> counted;
  for (const auto& [name, tensor] : tensor_of) {
    const core::CheckpointTensor* t = checkpoint_.find(name);
    const void* storage = tensor->storage().unsafeGetStorageImpl();
    if (t == nullptr) {
      for (const std::string& other : names_of_storage[storage]) {
        if (const core::CheckpointTensor* o = checkpoint_.find(other); o != nullptr) {
          stored_as_[name] = other;
          t = o;
          break;
        }
      }
    }
    if (t == nullptr) {
      if (is_placeholder(*tensor)) missing.push_back(name);
      continue;  // a tensor the module makes itself (a non-persistent buffer) keeps its value
    }
    used.insert(t->name);
    const at::ScalarType file_dtype = to_scalar_type(t->dtype);
    if (!tensor->sizes().equals(t->shape)) {
      mismatched.push_back(fmt::format("'{}' is {} in {} but {} in the module", name,
                                       shape_text(t->shape), checkpoint_.files[t->file],
                                       shape_text(tensor->sizes())));
    } else if (file_dtype != tensor->scalar_type() &&
               !(is_floating(file_dtype) && is_floating(tensor->scalar_type()))) {
      mismatched.push_back(
          fmt::format("'{}' is {} in {} but {} in the module (only floating "
                      "point tensors are converted)",
                      name, core::tensor_dtype_name(t->dtype), checkpoint_.files[t->file],
                      c10::toString(tensor->scalar_type())));
    } else if (!tensor->is_contiguous()) {
      mismatched.push_back(fmt::format(
          "'{}' is not contiguous in the module; the loader reads whole tensors", name));
    }
    if (counted.insert(storage).second) total_bytes_ += t->bytes;
  }
  DDO_CHECK(missing.empty(), Code::kInvalidArgument, checkpoint_.root, " has no weights for ",
            missing.size(), " tensor(s) of the module: ", join_names(missing),
            ". The files were saved from a different model or config: check model_loader and "
            "the directory");
  DDO_CHECK(mismatched.empty(), Code::kInvalidArgument, "the files in ", checkpoint_.root,
            " do not match the module: ", fmt::format("{}", fmt::join(mismatched, "; ")),
            ". Build the module from the config.json saved with these weights");
  if (!options_.allow_unexpected_keys) {
    std::vector<std::string> unexpected;
    for (const core::CheckpointTensor& t : checkpoint_.tensors) {
      if (used.count(t.name) == 0) unexpected.push_back(t.name);
    }
    DDO_CHECK(unexpected.empty(), Code::kInvalidArgument, checkpoint_.root, " holds ",
              unexpected.size(), " tensor(s) the module does not have: ", join_names(unexpected),
              ". Check that model_loader builds the model these files were saved from, or load "
              "with allow_unexpected_keys=True to ignore them");
  }
}

void WeightSource::report(const RecordEvent& events, bool final_event) {
  const auto now = Clock::now();
  if (!final_event && now - last_report_ < std::chrono::milliseconds(200)) return;
  last_report_ = now;
  const double seconds = seconds_since(start_);
  seconds_ = seconds;
  if (options_.progress) options_.progress(done_bytes_, total_bytes_, seconds);
  if (events) {
    events(final_event ? "load" : "load_progress", seconds,
           {{"bytes", done_bytes_},
            {"total_bytes", total_bytes_},
            {"gbps", seconds > 0 ? static_cast<double>(done_bytes_) / seconds / 1e9 : 0.0},
            {"files", checkpoint_.files.size()},
            {"path", checkpoint_.root}});
  }
}

void WeightSource::read(const std::vector<Read>& reads, const RecordEvent& events) {
  if (!started_) {
    started_ = true;
    start_ = Clock::now();
    last_report_ = start_;
  }
  std::vector<core::ReadJob> direct;
  std::vector<const Read*> converted;
  std::uint64_t direct_bytes = 0;
  for (const Read& r : reads) {
    const core::CheckpointTensor& t = find(r.name);
    if (to_scalar_type(t.dtype) == r.dtype) {
      direct.push_back({checkpoint_.by_name.at(t.name), 0, t.bytes, r.dst});
      direct_bytes += t.bytes;
    } else {
      converted.push_back(&r);
    }
  }
  if (!direct.empty()) {
    // Read on worker threads; this thread reports progress, so a host callback (Python, with
    // its GIL) is only ever called from the thread that called ddo.
    std::atomic<std::uint64_t> done{0};
    auto task = std::async(std::launch::async, [&] {
      // 16 MiB pieces: even one large tensor keeps every worker busy.
      return reader_->read_all(
          direct, workers_, [&](std::uint64_t d, std::uint64_t) { done = d; },
          std::uint64_t{16} << 20);
    });
    const std::uint64_t base = done_bytes_;
    try {
      while (task.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
        done_bytes_ = base + done.load();
        report(events, false);
      }
    } catch (...) {
      task.wait();  // the destinations must outlive the reads
      throw;
    }
    throw_if_error(task.get());
    done_bytes_ = base + direct_bytes;
  }
  for (const Read* r : converted) {
    const core::CheckpointTensor& t = find(r->name);
    at::Tensor raw = at::empty(t.shape, at::TensorOptions().dtype(to_scalar_type(t.dtype)));
    throw_if_error(reader_->read(t, 0, raw.data_ptr(), t.bytes));
    at::from_blob(r->dst, {r->numel}, at::TensorOptions().dtype(r->dtype)).copy_(raw.reshape(-1));
    done_bytes_ += t.bytes;
  }
  report(events, false);
}

Status WeightSource::read_unit(const std::vector<Read>& reads, char* base) const {
  // Note [Disk unit reads]: one pread at a time reaches about 0.8 of an NVMe drive's sequential
  // bandwidth, with the scheduler's two reader threads each reading one unit; the drive needs
  // more requests in flight, and a steady number of them. So a unit's tensors go through the
  // reader's shared queue (Note [Read queue] in checkpoint_reader.cpp) in 16 MiB pieces, on half
  // the load's workers: the next unit's pieces follow the current one's tail, and the depth is the
  // same whether one unit or two are being read. Each piece is dropped from the page cache once
  // read: these bytes are read again every step precisely because host RAM is not to hold them,
  // and cached they would take the RAM the budget leaves to the rest of the host (and make a
  // capped run on a large host faster than the host it stands for).
  std::vector<core::ReadJob> direct;
  for (const Read& r : reads) {
    const core::CheckpointTensor& t = find(r.name);
    if (to_scalar_type(t.dtype) == r.dtype) {
      direct.push_back({checkpoint_.by_name.at(t.name), 0, t.bytes,
                        base + reinterpret_cast<std::uintptr_t>(r.dst)});
    }
  }
  if (!direct.empty()) {
    DDO_RETURN_IF_ERROR(reader_->read_queued(direct, core::CheckpointReader::kQueuePieceBytes,
                                             /*drop_behind=*/true));
  }
  for (const Read& r : reads) {
    const core::CheckpointTensor& t = find(r.name);
    char* dst = base + reinterpret_cast<std::uintptr_t>(r.dst);
    if (to_scalar_type(t.dtype) == r.dtype) continue;
    try {
      // Read as the file holds it (through the same queue, dropped behind), then converted
      // into place: a temporary of the file's size per converted tensor and step, on this
      // reader thread, not the compute thread.
      at::Tensor raw = at::empty(t.shape, at::TensorOptions().dtype(to_scalar_type(t.dtype)));
      DDO_RETURN_IF_ERROR(
          reader_->read_queued({{checkpoint_.by_name.at(t.name), 0, t.bytes, raw.data_ptr()}},
                               core::CheckpointReader::kQueuePieceBytes, /*drop_behind=*/true));
      at::from_blob(dst, {r.numel}, at::TensorOptions().dtype(r.dtype)).copy_(raw.reshape(-1));
    } catch (const std::exception& e) {
      return Status(Code::kInternal,
                    fmt::format("converting '{}' from the file's {} failed: {}", r.name,
                                core::tensor_dtype_name(t.dtype), e.what()));
    }
  }
  return {};
}

// Note [Reads that give the model back]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// read_cpu gives the host a weight it keeps: remove() reads the disk tier's weights and quantize='s
// dense weights back through it. Its bytes must be the load's, so it first checks the file as the
// disk tier's every step does (CheckpointReader::check_unchanged: size and last-write time against
// the reader's open). A shard written in place since the load, even at its size, is an error naming
// the file and the tensor rather than weights the model never had; remove() then changes nothing
// (Note [Restore in two phases]) and succeeds once the file is back as it was. A shard replaced by
// a new file is not an error: the reader's open descriptor still reads the old one.
at::Tensor WeightSource::read_cpu(const std::string& name, const at::Tensor& like,
                                  const RecordEvent& events) {
  const core::CheckpointTensor& t = find(name);
  if (const Status unchanged =
          reader_->check_unchanged({{checkpoint_.by_name.at(t.name), 0, t.bytes, nullptr}});
      !unchanged.ok()) {
    throw Error(Code::kDataLoss,
                fmt::format("'{}' is not the file the model was loaded from: its size or "
                            "last-write time changed since the load (written in place), so "
                            "reading '{}' from it would give weights the model never had. Put "
                            "the file back as it was, with its last-write time (cp -p or rsync "
                            "-t from a copy); write new checkpoints beside the old ones",
                            checkpoint_.files[t.file], name));
  }
  at::Tensor out = at::empty(like.sizes(), at::TensorOptions().dtype(like.scalar_type()));
  read({{name, out.data_ptr(), out.scalar_type(), out.numel()}}, events);
  cpu_tensor_bytes_ += out.nbytes();
  return out;
}

void WeightSource::finish(const RecordEvent& events) {
  if (started_) report(events, true);
}

// --- public --------------------------------------------------------------------------------------

std::shared_ptr<WeightSource> open_weight_source(const ModuleTree& tree,
                                                 const LoadOptions& options) {
  DDO_CHECK(!options.path.empty(), Code::kInvalidArgument,
            "the loader needs a path: a component directory (config.json and its .safetensors "
            "files) or one .safetensors file");
  DDO_CHECK(options.read_workers >= 0 && options.read_workers <= 256, Code::kInvalidArgument,
            "read_workers=", options.read_workers,
            " is out of range; use 1..256, or 0 for one per core");
  core::Checkpoint checkpoint;
  throw_if_error(core::open_checkpoint(options.path, &checkpoint));
  auto source = std::make_shared<WeightSource>(std::move(checkpoint), options);
  source->check(tree);
  return source;
}

void retype_placeholders(ModuleTree& tree, std::optional<at::ScalarType> dtype) {
  if (!dtype) return;
  for (ModuleEntry& entry : tree.entries) {
    for (TensorSlot& slot : entry.tensors) {
      at::Tensor& t = slot.tensor;
      if (is_placeholder(t) && is_floating(t.scalar_type()) && t.scalar_type() != *dtype) {
        at::AutoGradMode no_grad(false);
        t.set_data(make_placeholder(t.sizes(), *dtype));
      }
    }
  }
}

void release_weights(const ModuleTree& tree) {
  at::AutoGradMode no_grad(false);
  for (const ModuleEntry& entry : tree.entries) {
    for (const TensorSlot& slot : entry.tensors) {
      at::Tensor t = slot.tensor;
      if (is_placeholder(t)) continue;
      t.set_data(make_placeholder(t.sizes(), t.scalar_type()));
    }
  }
}

void release_weights(torch::nn::Module& model) {
  release_weights(module_tree_from(model));
}

void materialize(const ModuleTree& tree, WeightSource& source, const RecordEvent& events) {
  // One fresh tensor per storage (tied names share it), read in one parallel batch.
  std::map<const void*, at::Tensor> fresh_of;
  std::vector<std::pair<at::Tensor, at::Tensor>> assign;  // (handle, fresh)
  std::vector<WeightSource::Read> reads;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_into;  // (existing, read)
  for (const ModuleEntry& entry : tree.entries) {
    for (const TensorSlot& slot : entry.tensors) {
      const std::string name = slot_name(entry, slot);
      if (!source.has(name)) continue;
      const at::Tensor& t = slot.tensor;
      const void* key = t.storage().unsafeGetStorageImpl();
      if (is_placeholder(t)) {
        auto [it, inserted] = fresh_of.emplace(key, at::Tensor());
        if (inserted) {
          it->second = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
          reads.push_back({name, it->second.data_ptr(), t.scalar_type(), t.numel()});
        }
        assign.emplace_back(t, it->second);
      } else if (fresh_of.count(key) > 0) {
        continue;  // tied to a tensor read already
      } else if (t.device().is_cpu() && t.is_contiguous()) {
        fresh_of.emplace(key, t);  // read in place
        reads.push_back({name, t.data_ptr(), t.scalar_type(), t.numel()});
      } else {
        fresh_of.emplace(key, t);
        copy_into.emplace_back(t, source.read_cpu(name, t, events));
      }
    }
  }
  source.read(reads, events);
  at::AutoGradMode no_grad(false);
  for (auto& [handle, fresh] : assign) {
    at::Tensor h = handle;
    h.set_data(fresh);
  }
  for (auto& [existing, value] : copy_into) {
    at::Tensor e = existing;
    e.copy_(value);
  }
}

std::map<std::string, at::Tensor> checkpoint_meta_tensors(const std::string& path) {
  core::Checkpoint checkpoint;
  throw_if_error(core::open_checkpoint(path, &checkpoint));
  std::map<std::string, at::Tensor> out;
  for (const core::CheckpointTensor& t : checkpoint.tensors) {
    out.emplace(
        t.name,
        at::empty(
            t.shape,
            at::TensorOptions().dtype(to_scalar_type(t.dtype)).device(c10::DeviceType::Meta)));
  }
  return out;
}

void load_weights(const ModuleTree& tree_in, const LoadOptions& options,
                  const RecordEvent& events) {
  ModuleTree tree = tree_in;
  retype_placeholders(tree, options.dtype);
  std::shared_ptr<WeightSource> source = open_weight_source(tree, options);
  materialize(tree, *source, events);
  source->finish(events);
}

void load_weights(torch::nn::Module& model, const LoadOptions& options) {
  load_weights(module_tree_from(model), options);
}

namespace {

// Note [Dense weights under the host cap]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// host_ram_cap_gb bounds what the model's weights hold in host memory: the plan's host-tier units
// and the disk ring (Note [Disk tier plan] in core/src/planner_tiers.cpp), quantize='s copies among
// them (Note [Only parameters stay in the file]). quantize= also keeps each quantized Linear's
// dense weight: over the checkpoint's mapping it has no memory of its own, but where the file holds
// it in another dtype than the model's it is read into memory at attach (Note [Quantized dense
// weights] in attach_quantize.cpp), beside the plan. Those bytes are known once the attach has
// read them (WeightSource::cpu_tensor_bytes over the attach), so the loader adds them to the plan's
// host bytes then: over the cap, the offload is removed and the error names the bytes and what to
// change (the load's dtype= equal to the file's, which maps them; a larger cap; or no quantize=).
void check_dense_weights_fit(Offload& offload, std::uint64_t dense_bytes) {
  const double cap_gb = offload.settings().config.host_ram_cap_gb;
  if (cap_gb <= 0 || dense_bytes == 0 || !offload.active()) return;
  const core::Plan& plan = offload.plan();
  const std::int64_t planned = plan.host_tier_bytes() + plan.disk_ring_bytes;
  const auto dense = static_cast<std::int64_t>(dense_bytes);
  if (planned + dense <= plan.host_ram_budget_bytes) return;
  const std::string message = fmt::format(
      "host_ram_cap_gb={:g} gives a host RAM budget of {} bytes, but quantize= holds {} bytes "
      "of dense Linear weights in host memory beside the plan's {} bytes (host-tier units and the "
      "disk ring): the checkpoint holds them in another dtype than the model's, so they are read "
      "into memory instead of mapped from the file. Load with dtype= the checkpoint's dtype (the "
      "dense weights then stay in the file), raise host_ram_cap_gb / DDO_HOST_RAM_CAP_GB to at "
      "least {:g} (GiB), or load without quantize=",
      cap_gb, plan.host_ram_budget_bytes, dense, planned,
      std::ceil(core::bytes_to_gib(planned + dense) * 1e6) / 1e6);
  offload.remove();
  throw Error(Code::kResourceExhausted, message);
}

}  // namespace

std::unique_ptr<Offload> load_with_offload(ModuleTree tree, const LoadOptions& load,
                                           const OffloadOptions& options) {
  retype_placeholders(tree, load.dtype);
  OffloadOptions with_source = options;
  with_source.weights = open_weight_source(tree, load);
  const std::uint64_t before = with_source.weights->cpu_tensor_bytes();
  std::unique_ptr<Offload> offload = enable_offload_tree(std::move(tree), with_source);
  check_dense_weights_fit(*offload, with_source.weights->cpu_tensor_bytes() - before);
  return offload;
}

std::unique_ptr<Offload> load_with_offload(torch::nn::Module& model, const LoadOptions& load,
                                           const OffloadOptions& options) {
  ModuleTree tree = module_tree_from(model);
  if (options.model_class.empty()) {
    OffloadOptions named = options;
    named.model_class = tree.model_class;
    return load_with_offload(std::move(tree), load, named);
  }
  return load_with_offload(std::move(tree), load, options);
}

}  // namespace ddo::adapter
