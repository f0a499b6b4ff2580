// The backend record (internal): what the adapter knows of one kind of execution device, and the
// registry of the records this build knows.
//
// Below the engine's seam (engine::Device, DeviceCaps) ddo is written once. Above it the adapter
// needs, per kind of device, the c10 dispatch key its interception kernels serve, where its
// tensors live, its compute stream, its memory probe, how its device names read and how to open
// one. A Backend holds those for one kind, so that torch/src asks the record instead of
// branching on engine::DeviceKind; the interception kernels are templates over a backend's
// kernels (kernels.h), and register_ops.cpp registers them once per record. What adding a kind
// takes: docs/design/0010-backend-record.md.
//
//   const Backend& b = backend_named("cuda:1");  // b.kind == engine::DeviceKind::kCuda
//   b.torch_device(1);                           // c10::Device("cuda:1")
//   backend_for(engine::DeviceKind::kSim).name;  // "sim"
//   find_backend(c10::DispatchKey::CPU)->name;   // "sim": the simulation computes on the CPU key
//   backend_named("mps");  // throws ddo::Error (kInvalidArgument): device "mps" is not a kind
//                          // this build of ddo executes on; use "sim:N" or "cuda:N"
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/DispatchKey.h>

#include "ddo/core/status.h"
#include "ddo/engine/device.h"

namespace torch {
class Library;
}

namespace ddo::core {
struct DynamicOffloadConfig;
}

namespace ddo::adapter {
class MemoryProbe;
}

namespace ddo::adapter::internal {

// One kind of execution device, as the adapter sees it. Records are constants (no static
// constructor runs for them); the hot path holds a pointer to one, never looks one up.
struct Backend {
  // --- what the kind is ------------------------------------------------------------------------
  engine::DeviceKind kind;  // its engine devices' DeviceCaps::kind
  // Its device names' kind: "cuda" of "cuda:0". core::parse_device_name checks the whole name.
  const char* name;
  const char* title;              // in messages: "a CUDA build of ddo"
  const char* inputs_on;          // where its kernels' inputs are, in errors: "a CUDA device"
  c10::DeviceType torch_type;     // where its staged and resident tensors live
  c10::DispatchKey dispatch_key;  // the key its interception kernels serve
  // Device memory is host memory (the simulation): a tensor of torch_type is the host's own and
  // never one "already on the execution device", and what ATen allocates while it runs is counted
  // by ddo's CPU allocator (ScopedCountingCpuAllocator).
  bool memory_is_host;
  // libddo_sdnq's device kernels may run on it; sdnq::dequantize_kernel_status says whether they
  // do on a given device.
  bool sdnq_kernels;

  // --- slots; null where the kind has none ---------------------------------------------------
  // A record whose runtime this build lacks (CUDA in a build without it) keeps only what plan
  // mode needs: every slot below is null.
  //
  // The compute stream of device `index`. Null: the calling thread computes (the simulation), and
  // copies wait on engine::kDefaultStream.
  engine::Stream (*current_stream)(c10::DeviceIndex index) = nullptr;
  // Opens device `index` under `config` (the VRAM cap, the simulation's knobs); throws
  // ddo::Error. Null: this build cannot execute on the kind.
  std::shared_ptr<engine::Device> (*open)(int index,
                                          const core::DynamicOffloadConfig& config) = nullptr;
  // The memory probe of an offload on `device`, whose index is `index`.
  Status (*make_probe)(engine::Device& device, int index,
                       std::unique_ptr<MemoryProbe>* out) = nullptr;
  // The card plan mode assumes, where nothing is opened. Null: unknown (0).
  std::int64_t (*plan_total_bytes)(const core::DynamicOffloadConfig& config) = nullptr;
  // Registers the interception kernels instantiated for this kind
  // (register_interception_kernels<K> in kernels.h) on libraries of dispatch_key: `aten` over
  // ATen's ops, `ddo` over libddo_sdnq's. Null: the kind has no kernels in this build.
  void (*register_kernels)(torch::Library& aten, torch::Library& ddo) = nullptr;

  // --- derived -----------------------------------------------------------------------------
  // Where the tensors of device `index` live: the host CPU where memory_is_host.
  c10::Device torch_device(int index) const {
    return memory_is_host ? c10::Device(c10::kCPU)
                          : c10::Device(torch_type, static_cast<c10::DeviceIndex>(index));
  }
  // The canonical name of device `index`: "cuda:1" (core::DeviceName::str's spelling).
  std::string device_name(int index) const;
  // The stream whose work copies of device `index` are ordered with.
  engine::Stream stream(c10::DeviceIndex index) const {
    return current_stream != nullptr ? current_stream(index) : engine::kDefaultStream;
  }
};

// The records (backend_sim.cpp, backend_cuda.cpp). The CUDA record exists in every build, so
// that plan mode can plan for a GPU; its slots are null without CUDA.
extern const Backend kSimBackend;
extern const Backend kCudaBackend;

// --- the registry
// --------------------------------------------------------------------------------- Lookups lock a
// mutex: attach, report and load paths call them, never an intercepted op.

// The records this build knows, in registration order (the simulation, CUDA, then any a test
// added).
std::vector<const Backend*> backends();

// The record of `kind`; throws ddo::Error (kInternal) for a kind no record has.
const Backend& backend_for(engine::DeviceKind kind);

// The record whose kernels serve `key`, or null.
const Backend* find_backend(c10::DispatchKey key);

// The record of the kind `device_name` names ("cuda", "cuda:1", "sim:0"); "cpu", plan mode's
// host, plans as the simulation does and gives its record. Only the kind is read: the index is
// core::parse_device_name's to check. Throws ddo::Error (kInvalidArgument) naming the text and
// the kinds this build knows.
const Backend& backend_named(std::string_view device_name);

// Adds `backend` to the registry until destroyed: a kind a test defines. Its kind, name and
// dispatch key must be new (else ddo::Error, kInvalidArgument). Interception that becomes active
// while it is registered serves its key as well; register it while no offload is active.
class BackendRegistration {
 public:
  explicit BackendRegistration(const Backend& backend);
  ~BackendRegistration();
  BackendRegistration(const BackendRegistration&) = delete;
  BackendRegistration& operator=(const BackendRegistration&) = delete;

 private:
  const Backend* backend_;
};

}  // namespace ddo::adapter::internal
