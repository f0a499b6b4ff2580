// Registration of ddo's interception kernels, the managed-storage records and the staging step.
//
// Registrations live in torch::Library objects created by the first enable_offload and destroyed
// with the last (InterceptionHandle, refcounted), so a process without an active offload pays
// nothing and no static constructor runs at load time. See docs/design/0001-interception.md.
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "backend.h"
#include "host_tensor.h"
#include "intercept_common.h"
#include "quantized_dense.h"
#include "ddo/torch/interception.h"
#include "registration.h"

namespace ddo::adapter {
namespace internal {

// --- managed storage -----------------------------------------------------------------------------

void managed_deleter(void* context) {
  delete static_cast<ManagedWeight*>(context);
}

at::Tensor make_managed_tensor(void* data, std::size_t bytes, at::IntArrayRef sizes,
                               at::IntArrayRef strides, c10::ScalarType dtype,
                               std::shared_ptr<StreamRuntime> owner, int unit,
                               std::size_t offset_bytes) {
  auto* record = new ManagedWeight{owner.get(), unit, offset_bytes, std::move(owner)};
  return cpu_tensor_over(data, bytes, sizes, strides, dtype, record, &managed_deleter);
}

StreamRuntime::~StreamRuntime() = default;

void StreamRuntime::release_held() {
  if (held_unit < 0) return;
  scheduler->release(held_unit, held_stream);
  held_unit = -1;
}

namespace {
std::atomic<StageObserver> g_stage_observer{nullptr};
}  // namespace

void set_stage_observer(StageObserver observer) {
  g_stage_observer.store(observer);
}
StageObserver stage_observer() {
  return g_stage_observer.load(std::memory_order_relaxed);
}

// --- weights changed in place (Note [Weights changed in place] in intercept_common.h) ---------

void note_changed_in_place(ManagedWeight* m, std::uint32_t version) {
  if (m->quant != nullptr) {
    // A quantized Linear's dense weight: its quantized copy is made again from the new bytes
    // (whose own version change then drops any staged copy of them).
    requantize(*m->quant);
    m->version = version;
    return;
  }
  StreamRuntime* rt = m->runtime;
  const auto unit = static_cast<std::size_t>(m->unit);
  const std::string& name = unit < rt->unit_names.size() ? rt->unit_names[unit] : "?";
  TORCH_CHECK(unit >= rt->unit_on_disk.size() || !rt->unit_on_disk[unit],
              "ddo: a weight of "
              "stream unit ",
              m->unit, " (with ", name,
              ") was changed in place while the offload "
              "is active, but that unit is read from the checkpoint every step (the disk tier), "
              "so the change cannot be served; change weights before enable_offload, or call "
              "remove() first and attach again, or raise host_ram_cap_gb so the unit is held in "
              "host memory");
  TORCH_CHECK(!rt->in_op.load(std::memory_order_acquire), "ddo: a weight of stream unit ", m->unit,
              " (with ", name,
              ") was changed in place while another thread was "
              "running an op of the same offloaded model; ddo serves an offloaded model from one "
              "thread at a time");
  // Copies made before the write are dropped; the next acquire copies the host bytes again.
  rt->release_held();
  rt->scheduler->drain();
  m->version = version;
  ++rt->changed_in_place;
}

// --- the staging step ----------------------------------------------------------------------------

// Note [One thread at a time]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An offloaded model serves one thread at a time: its copy scheduler follows one traced order of
// acquires and releases. Two threads running ops of the same model at once (two Python threads
// calling forward: torch releases the GIL inside ops) would interleave acquires and releases of
// one unit, and the scheduler's release of a unit the other thread already released threw from
// a destructor, which ended the process. Each op therefore claims its runtime with one atomic
// exchange at its first acquire and gives it back after its release: a second thread whose op
// overlaps gets a clear error naming the rule, and the first thread's op is untouched. The cost is
// two uncontended atomic operations per intercepted op. Ops of two threads that merely alternate
// stay correct (each op acquires and releases whole), though they perturb the traced order.
void StageScope::claim(StreamRuntime* rt) {
  for (int i = 0; i < claimed_count_; ++i) {
    if (claimed_[i] == rt) return;
  }
  TORCH_INTERNAL_ASSERT(claimed_count_ < static_cast<int>(claimed_.size()),
                        "ddo: one op reads weights of more than two offloaded models");
  TORCH_CHECK(!rt->in_op.exchange(true, std::memory_order_acquire), "ddo: ", op_,
              " ran on a second thread while another thread was running an op of the same "
              "offloaded model; ddo serves an offloaded model from one thread at a time: run its "
              "forward calls one after another (a lock around them), or give each thread its own "
              "model");
  claimed_[claimed_count_++] = rt;
}

void* StageScope::acquire(ManagedWeight* m, engine::Stream stream) {
  StreamRuntime* rt = m->runtime;
  claim(rt);
  if (rt->sticky_units) {
    // Classic group routes: the group stays on the device until another group is needed.
    if (rt->held_unit == m->unit) return rt->held_base;
    rt->release_held();
    void* base = rt->scheduler->acquire(m->unit, stream);
    rt->held_unit = m->unit;
    rt->held_stream = stream;
    rt->held_base = base;
    return base;
  }
  for (int i = 0; i < held_count_; ++i) {
    if (held_[i].runtime == rt && held_[i].unit == m->unit) return held_[i].base;
  }
  TORCH_INTERNAL_ASSERT(held_count_ < static_cast<int>(held_.size()),
                        "ddo: too many managed arguments in one ", op_);
  void* base = rt->scheduler->acquire(m->unit, stream);
  held_[held_count_++] = {rt, m->unit, stream, base};
  return base;
}

void StageScope::check_backend(const Backend* offload_backend, const c10::Device& device) const {
  TORCH_CHECK(offload_backend == backend_, "ddo: ", op_, " reads a weight that ddo streams to ",
              device.str(), ", but its other inputs are on ", backend_->inputs_on,
              "; move the inputs to ", device.str(), " (the offload's execution device)");
}

// Note [Training under offload] in attach_plan.cpp: before anything is staged or computed.
void StageScope::refuse_grad(const ManagedWeight& m) const {
  const StreamRuntime& rt = *m.runtime;
  const std::string& name = rt.trainable_names[static_cast<std::size_t>(m.trainable_index)];
  TORCH_CHECK(false, "ddo: ", op_, " runs with autograd enabled and reads ", name,
              ", a streamed weight that requires grad while other parameters of the model are "
              "frozen (",
              rt.trainable_names.size(),
              " such weight(s)); streamed weights are inference-only and would get no gradient. "
              "For inference, run under torch.no_grad() or torch.inference_mode(); to train it, "
              "keep its module resident (always_resident_modules_pattern) and attach again; or "
              "freeze it with requires_grad_(False) before enable_offload");
}

at::Tensor StageScope::stage(const at::Tensor& t) {
  ManagedWeight* m = managed_of(t);
  if (m == nullptr) return t;
  if (C10_UNLIKELY(m->quant != nullptr)) return stage_dequantized(t, *m->quant);
  StreamRuntime* rt = m->runtime;
  check_backend(rt->backend, rt->execution_device);
  if (C10_UNLIKELY(m->trainable_index >= 0) && at::GradMode::is_enabled()) refuse_grad(*m);
  char* base = static_cast<char*>(acquire(m, backend_->stream(rt->execution_device.index())));
  if (!counted_) {
    ++rt->intercepted_ops;
    counted_ = true;
    if (C10_UNLIKELY(rt->frozen_weights > 0 && !rt->warned_grad) && at::GradMode::is_enabled()) {
      rt->warned_grad = true;  // Note [Training under offload] in attach_plan.cpp
      TORCH_WARN("ddo: an offloaded model runs with autograd enabled, but its ", rt->frozen_weights,
                 " streamed weights that required grad were frozen at "
                 "attach (streamed weights are inference-only) and get no gradient. Run "
                 "inference under torch.no_grad() or inference mode (it also saves memory); to "
                 "train adapters, freeze the base with requires_grad_(False) and keep the "
                 "adapters resident");
    }
  }
  char* data = base + m->offset_bytes + t.storage_offset() * static_cast<int64_t>(t.itemsize());
  at::Tensor staged =
      at::for_blob(data, t.sizes())
          .strides(t.strides())
          .options(at::TensorOptions().dtype(t.dtype()).device(rt->execution_device))
          .target_device(rt->execution_device)
          .make_tensor();
  if (StageObserver obs = stage_observer(); C10_UNLIKELY(obs != nullptr)) obs(staged, m->unit);
  return staged;
}

StageScope::~StageScope() {
  for (int i = 0; i < held_count_; ++i) {
    held_[i].runtime->scheduler->release(held_[i].unit, held_[i].stream);
  }
  for (int i = 0; i < claimed_count_; ++i) {
    claimed_[i]->in_op.store(false, std::memory_order_release);
  }
}

// --- registration --------------------------------------------------------------------------------

namespace {

// Drops the one warning that registering over a backend kernel always prints; forwards the rest.
class DropOverrideWarning : public c10::WarningHandler {
 public:
  explicit DropOverrideWarning(c10::WarningHandler* previous) : previous_(previous) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Overriding a previously registered kernel") != std::string::npos) {
      return;
    }
    previous_->process(warning);
  }

 private:
  c10::WarningHandler* previous_;
};

// The libraries of one backend record's dispatch key.
struct BackendLibraries {
  std::unique_ptr<torch::Library> aten;
  std::unique_ptr<torch::Library> ddo;  // over libddo_sdnq's own kernels
};
using Libraries = std::vector<BackendLibraries>;

std::mutex g_registration_mutex;  // guards g_libraries and g_refs
Libraries* g_libraries = nullptr;
int g_refs = 0;

// Every record with kernels in this build (the simulation's on the CPU key, CUDA's on the CUDA
// key, a test's stub on its own) gets its instantiation of the kernels (kernels.h).
Libraries* register_kernels() {
  auto* libs = new Libraries;
  DropOverrideWarning filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&filter);
  for (const Backend* backend : backends()) {
    if (backend->register_kernels == nullptr) continue;
    BackendLibraries& l = libs->emplace_back();
    l.aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", backend->dispatch_key,
                                              __FILE__, __LINE__);
    l.ddo = std::make_unique<torch::Library>(torch::Library::IMPL, "ddo", backend->dispatch_key,
                                             __FILE__, __LINE__);
    backend->register_kernels(*l.aten, *l.ddo);
  }
  return libs;
}

}  // namespace

InterceptionHandle::~InterceptionHandle() {
  std::lock_guard<std::mutex> lock(g_registration_mutex);
  if (--g_refs == 0) {
    delete g_libraries;  // the Library destructors deregister; the originals are active again
    g_libraries = nullptr;
  }
}

std::shared_ptr<InterceptionHandle> acquire_interception() {
  std::lock_guard<std::mutex> lock(g_registration_mutex);
  if (g_refs == 0) g_libraries = register_kernels();
  ++g_refs;
  return std::shared_ptr<InterceptionHandle>(new InterceptionHandle());
}

}  // namespace internal

bool is_managed(const at::Tensor& t) {
  return internal::managed_of(t) != nullptr;
}

bool interception_active() {
  std::lock_guard<std::mutex> lock(internal::g_registration_mutex);
  return internal::g_refs > 0;
}

namespace testing {
void set_stage_observer(StageObserver observer) {
  internal::set_stage_observer(observer);
}
}  // namespace testing

}  // namespace ddo::adapter
