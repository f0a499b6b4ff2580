// WeightSource: the loader's validated checkpoint, read into memory the caller owns (internal;
// loader.cpp; used by attach_plan.cpp's placement). See ddo/torch/loader.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddo/core/checkpoint.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/loader.h"

namespace ddo::adapter {

class WeightSource {
 public:
  WeightSource(core::Checkpoint checkpoint, LoadOptions options);
  ~WeightSource();

  // One tensor to read: `numel` elements of `dtype`, contiguous, at `dst`.
  struct Read {
    std::string name;  // the module's name for it (ties resolved by the source)
    void* dst = nullptr;
    at::ScalarType dtype = at::kFloat;
    std::int64_t numel = 0;
  };

  // Checks the module against the checkpoint (see loader.h) and records the bytes to read, the
  // names tied tensors are stored under, and the non-meta tensors the file also holds. Throws
  // ddo::Error listing every problem.
  void check(const ModuleTree& tree);

  // Reads `reads` on the configured workers; reports progress through `events` ("load").
  void read(const std::vector<Read>& reads, const RecordEvent& events);
  // One disk-tier unit's tensors (Note [Disk tier] in disk_tier_reader.cpp): read `reads` (their
  // `dst` are offsets from `base`) into `base`, converting dtypes where the file differs. Called on
  // the copy scheduler's reader threads every step: thread-safe, no progress events, no counters.
  Status read_unit(const std::vector<Read>& reads, char* base) const;
  // A fresh contiguous CPU tensor holding `name` as `like` looks (sizes, dtype).
  at::Tensor read_cpu(const std::string& name, const at::Tensor& like, const RecordEvent& events);
  // Emits the final "load" event (bytes, seconds, GB/s).
  void finish(const RecordEvent& events);

  // The file's tensor for `name` (directly or under a tied tensor's name); throws when the files
  // do not hold it.
  const core::CheckpointTensor& find(const std::string& name) const;
  // True when the files hold `name` (directly or under a tied tensor's name).
  bool has(const std::string& name) const;
  std::uint64_t bytes_read() const { return done_bytes_; }
  // Bytes of the tensors read_cpu gave out so far: memory of their own that the host keeps.
  std::uint64_t cpu_tensor_bytes() const { return cpu_tensor_bytes_; }
  // Seconds from the first read to the last (0 before any).
  double seconds() const { return seconds_; }
  const core::Checkpoint& checkpoint() const { return checkpoint_; }
  // Every read of the files so far, the load's and the disk tier's (Note [Read meter]).
  core::ReadStats read_stats() const { return reader_->stats(); }
  const LoadOptions& options() const { return options_; }

 private:
  void report(const RecordEvent& events, bool final_event);

  core::Checkpoint checkpoint_;
  LoadOptions options_;
  std::unique_ptr<core::CheckpointReader> reader_;
  int workers_ = 1;                               // LoadOptions::read_workers, resolved
  std::map<std::string, std::string> stored_as_;  // tied module name -> name in the file
  std::uint64_t total_bytes_ = 0;                 // file bytes of the tensors to read
  std::uint64_t done_bytes_ = 0;
  std::uint64_t cpu_tensor_bytes_ = 0;
  bool started_ = false;
  double seconds_ = 0.0;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_report_;
};

// The at:: type of a file dtype.
at::ScalarType to_scalar_type(core::TensorDtype dtype);
// With `dtype`: floating placeholders of the tree take it (LoadOptions::dtype).
void retype_placeholders(ModuleTree& tree, std::optional<at::ScalarType> dtype);
// Reads every tensor of `tree` that `source` holds into CPU memory: placeholders get fresh
// tensors, other tensors are overwritten in place.
void materialize(const ModuleTree& tree, WeightSource& source, const RecordEvent& events);

// The module's full name of a tensor slot ("blocks.0.attn.to_q.weight").
std::string slot_name(const ModuleEntry& entry, const TensorSlot& slot);

}  // namespace ddo::adapter
