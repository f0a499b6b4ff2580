// Managed weights: ordinary CPU tensors whose storage is a ddo host slab (internal).
//
// A streamed weight stays an ordinary dense CPU tensor, so the model, autograd metadata, Python
// and state_dict code see nothing unusual. What marks it is its storage's DataPtr: the context
// points to a ManagedWeight record and the deleter is `managed_deleter`. Recognising a managed
// tensor on the hot path is therefore one pointer comparison on the storage, with no map and no
// lock (see Note [Recognising managed storage]).
//
// A StreamRuntime is the per-offload state the hot path reads: the scheduler, the execution
// device and, for the classic group routes, the unit currently held. Records keep the runtime
// alive (shared_ptr), so a view of a managed weight that outlives its offload still points to
// valid host memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "backend.h"
#include "ddo/engine/copy_scheduler.h"
#include "ddo/engine/device.h"
#include "ddo/engine/host_slab.h"

namespace ddo::adapter::internal {

class InterceptionHandle;
struct QuantizedDense;  // quantized_dense.h

// Note [Recognising managed storage]
// ----------------------------------
// The interception kernels run for every addmm/mm/bmm/convolution/embedding of the process
// while an offload is active, most of them on tensors ddo does not manage. The test must be
// O(1) and allocation-free: `storage.data_ptr().get_deleter() == &managed_deleter`. A map from
// pointers to records would need a lock (Python threads) and a hash per argument; a custom
// dispatch key would need ddo's own TensorImpl subclass (see docs/design/0001-interception.md).

// The per-offload state read on the hot path. One thread drives an offload at a time (the
// scheduler is not thread-safe); nothing here is locked.
struct StreamRuntime {
  // Hot fields.
  engine::CopyScheduler* scheduler = nullptr;
  const Backend* backend = &kSimBackend;  // the execution device's kind
  c10::Device execution_device = c10::Device(c10::kCPU);
  // Classic group routes: a unit stays acquired until another unit is needed (one group on the
  // device at a time, like the classic group offload); the dynamic route releases after each op.
  bool sticky_units = false;
  int held_unit = -1;
  engine::Stream held_stream = engine::kDefaultStream;
  void* held_base = nullptr;
  std::int64_t intercepted_ops = 0;  // COUNT: ops that staged at least one managed weight
  // True while an op of this runtime is between its first acquire and its release (Note [One
  // thread at a time] in register_ops.cpp).
  std::atomic<bool> in_op{false};
  // Cold: the residency candidate (block) each unit belongs to, "" for none; calibration
  // attributes measured compute to candidates through it (measured_candidate_compute).
  std::vector<std::string> unit_candidate;
  // Cold: one tensor name per unit, for errors ("blocks.3.attn.to_q.weight").
  std::vector<std::string> unit_names;
  // Weights that required grad and were frozen at attach (Note [Training under offload] in
  // attach_plan.cpp); the first op with autograd enabled warns once.
  std::int64_t frozen_weights = 0;
  bool warned_grad = false;
  // Cold: the streamed weights that required grad in a model whose host froze others, by name;
  // ops that stage one of them with autograd enabled throw (Note [Training under offload]).
  std::vector<std::string> trainable_names;
  std::int64_t changed_in_place = 0;  // COUNT: in-place changes served (Note [Weights changed
                                      // in place])

  // Owners, destroyed in reverse order: the scheduler's staging, then the slabs, then the device.
  std::shared_ptr<engine::Device> device;
  // Shared with the pinned-weight cache (Note [Pinned-weight cache] in weight_cache.cpp); the
  // pointer keeps the device that pinned the slabs alive.
  std::shared_ptr<engine::HostSlabs> slabs;
  // Disk-tier units (Note [Disk tier] in disk_tier_reader.cpp): true where a unit's bytes are read
  // from the checkpoint every step instead of living in a slab. Their managed storages point
  // into `disk_backing`: the checkpoint files mapped copy-on-write, and a temporary file for
  // converted tensors (Note [Disk-tier storage] in attach_disk_tier.cpp).
  std::vector<bool> unit_on_disk;
  std::shared_ptr<void> disk_backing;
  std::unique_ptr<engine::CopyScheduler> scheduler_owner;
  std::shared_ptr<InterceptionHandle> interception;

  ~StreamRuntime();
  // Releases a held group unit (sticky routes); call before drain and at region boundaries.
  void release_held();
};

struct ManagedWeight {
  StreamRuntime* runtime = nullptr;  // hot path: no refcount traffic
  int unit = -1;
  std::size_t offset_bytes = 0;  // byte offset of this storage inside its unit
  std::shared_ptr<StreamRuntime> owner;
  // The version counter of the parameter when it was last served (Note [Weights changed in
  // place] in intercept_common.h).
  std::uint32_t version = 0;
  // >= 0 for a weight the host may train (Note [Training under offload] in attach_plan.cpp): its
  // name is runtime->trainable_names[trainable_index], and an op that stages it while autograd
  // is enabled throws.
  int trainable_index = -1;
  // Set for a dense Linear weight served from its quantized copy (Note [Quantized dense
  // weights] in attach_quantize.cpp): the record owns no unit (`unit` is -1) and the ops that
  // read it compute from the quantized tensors this points to.
  std::shared_ptr<const QuantizedDense> quant{};
};

// The deleter of every managed storage: frees the record only (the slab belongs to the runtime).
void managed_deleter(void* context);

inline ManagedWeight* managed_of(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage()) return nullptr;
  const c10::DataPtr& ptr = impl->unsafe_storage().data_ptr();
  if (ptr.get_deleter() != &managed_deleter) return nullptr;
  return static_cast<ManagedWeight*>(ptr.get_context());
}

// A CPU tensor with the given sizes and strides over `bytes` of host memory at `data`, owned by
// a new ManagedWeight record. storage_offset is 0: the storage starts at the tensor's lowest
// element.
at::Tensor make_managed_tensor(void* data, std::size_t bytes, at::IntArrayRef sizes,
                               at::IntArrayRef strides, c10::ScalarType dtype,
                               std::shared_ptr<StreamRuntime> owner, int unit,
                               std::size_t offset_bytes);

// Test hook: called with every staged view handed to an original kernel (null: off). One relaxed
// atomic load per staged weight when off.
using StageObserver = void (*)(const at::Tensor& staged, int unit);
void set_stage_observer(StageObserver observer);
StageObserver stage_observer();

}  // namespace ddo::adapter::internal
