/// \file
/// Device: the one seam between ddo's engine and a device backend.
///
/// The copy scheduler, the staging area and the host slabs are written once above this interface.
/// Two backends implement it: CUDA (`make_cuda_device`, backends/cuda_device.cpp; the only file
/// that includes the CUDA runtime) and the host simulation (`make_sim_device`,
/// backends/sim_device.cpp), a capacity-limited host arena standing in for device memory with an
/// asynchronous copy worker standing in for the copy engine, so CI runs the same logic without a
/// GPU.
///
/// ```
/// auto dev = ddo::engine::make_sim_device({.capacity_bytes = 1 << 30});
/// void* d = nullptr;
/// DDO_RETURN_IF_ERROR(dev->allocate(bytes, &d));
/// Stream copy = dev->create_stream();
/// Event done = dev->create_event();
/// DDO_RETURN_IF_ERROR(dev->copy_to_device_async(d, host, bytes, copy));
/// dev->record_event(done, copy);
/// dev->stream_wait_event(kDefaultStream, done);   // compute waits on the device, not the host
/// ```
///
/// Streams and events are opaque handles owned by the device. `kDefaultStream` (null) is the
/// compute stream of the caller: for CUDA the adapter passes the stream LibTorch is using; for the
/// simulation it is the calling thread itself (work on it is synchronous).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "ddo/core/status.h"

namespace ddo::engine {

using Stream = void*;  ///< cudaStream_t for CUDA; a worker queue for the simulation
using Event = void*;   ///< cudaEvent_t for CUDA; a completion flag for the simulation
/// The compute stream (for the simulation: the calling thread).
inline constexpr Stream kDefaultStream = nullptr;

/// The two backends: a CUDA GPU, or the host simulation (a capacity-limited arena of host memory).
enum class DeviceKind { kCuda, kSim };

/// What a backend can do; callers query it instead of checking the kind.
struct DeviceCaps {
  DeviceKind kind = DeviceKind::kSim;  ///< which backend
  int index = 0;                       ///< the device ordinal ("cuda:N", "sim:N")
  std::string name;                    ///< "NVIDIA H200", "ddo-sim"
  bool async_copy = true;              ///< copies on a side stream overlap compute
  bool pinned_host = true;     ///< allocate_host returns memory the copy engine reads at full speed
  bool host_register = false;  ///< register_host can pin memory the caller already owns
  bool timing_events = true;   ///< elapsed_ms works
};

/// The driver's view of device memory (what nvidia-smi would show), used by calibration.
struct DeviceMemory {
  std::int64_t total_bytes = 0;  ///< the card, or the emulated cap when one is set
  std::int64_t used_bytes = 0;   ///< everything in use on the device, by anyone
};

/// The device seam: everything ddo asks of an execution device. Two backends implement it (CUDA,
/// the host simulation); the scheduler and the adapter are written once above it.
class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceCaps caps() const = 0;  ///< what this backend can do

  // --- device memory -------------------------------------------------------------------------
  /// Fails with kResourceExhausted (naming the sizes) when the device or its cap is full.
  virtual Status allocate(std::size_t bytes, void** out) = 0;
  virtual void deallocate(void* ptr) = 0;  ///< frees what allocate() returned

  // --- host memory the copy engine reads directly (pinned) ------------------------------------
  /// May fail (kResourceExhausted): callers fall back to ordinary memory when allowed.
  virtual Status allocate_host(std::size_t bytes, void** out) = 0;
  virtual void deallocate_host(void* ptr) = 0;  ///< frees what allocate_host() returned
  /// Optional (caps().host_register): pin memory the caller already owns, e.g. a loader's buffer.
  virtual Status register_host(void* ptr, std::size_t bytes) = 0;
  virtual void unregister_host(void* ptr) = 0;  ///< undoes register_host()

  // --- streams and events --------------------------------------------------------------------
  virtual Stream create_stream() = 0;              ///< a side stream for copies
  virtual void destroy_stream(Stream stream) = 0;  ///< after its work has completed
  /// `timing` makes it usable with elapsed_ms().
  virtual Event create_event(bool timing = false) = 0;
  virtual void destroy_event(Event event) = 0;  ///< after it has completed

  /// Host-to-device copy, ordered on `stream`; returns once issued. The host memory must stay
  /// valid until an event recorded after it completes.
  virtual Status copy_to_device_async(void* dst, const void* src, std::size_t bytes,
                                      Stream stream) = 0;
  /// Device-to-host copy, synchronous (used only to restore a model, never on the hot path).
  virtual Status copy_to_host(void* dst, const void* src, std::size_t bytes) = 0;
  /// Device-to-device copy ordered on `stream` (moving residents between areas).
  virtual Status copy_on_device_async(void* dst, const void* src, std::size_t bytes,
                                      Stream stream) = 0;

  /// `event` completes when the work on `stream` so far has.
  virtual void record_event(Event event, Stream stream) = 0;
  /// Work submitted to `stream` after this call starts only once `event` completes. The host
  /// does not wait (for the simulation's default stream, the calling thread is the stream and
  /// waits).
  virtual void stream_wait_event(Stream stream, Event event) = 0;
  virtual void synchronize_event(Event event) = 0;  ///< the host waits
  virtual bool event_done(Event event) = 0;         ///< polls without waiting
  /// Milliseconds between two completed timing events (device time, not issue time). Returns a
  /// negative value, without blocking, when either event has not completed or was created
  /// without timing.
  virtual float elapsed_ms(Event start, Event end) = 0;
  virtual void synchronize_stream(Stream stream) = 0;  ///< the host waits for the work on `stream`

  // --- memory figures ------------------------------------------------------------------------
  virtual DeviceMemory memory() = 0;  ///< total and used, as the driver sees them
};

/// Options for the CUDA backend.
struct CudaDeviceOptions {
  int index = 0;  ///< the CUDA device ordinal
  /// Where device memory comes from. The torch adapter routes it through LibTorch's caching
  /// allocator so that allocator statistics and an emulated cap see ddo's own memory; the default
  /// (empty) uses cudaMalloc / cudaFree.
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*)> free;  ///< the matching release for `alloc`
  std::int64_t cap_bytes = 0;       ///< emulated VRAM cap reported as total; 0 = the card
  /// allocate_host / register_host fail once this many bytes are pinned, as on a host whose
  /// pinnable memory runs out (to test pin fallback on a real card); < 0 = no limit.
  std::int64_t pinnable_bytes = -1;
};

/// Options for the host-simulation backend.
struct SimDeviceOptions {
  int index = 0;  ///< the N of "sim:N"; each device made here has its own arena
  std::int64_t capacity_bytes = std::int64_t{8} << 30;  ///< the simulated card
  /// allocate_host fails once this many bytes are pinned (to test pin fallback); < 0 = no limit.
  std::int64_t pinnable_bytes = -1;
  /// Throttle copies to this many bytes per second (0 = as fast as memcpy).
  double copy_bytes_per_second = 0.0;
};

/// Returns nullptr with kUnavailable when ddo was built without CUDA or no GPU is present.
Status make_cuda_device(const CudaDeviceOptions& options, std::unique_ptr<Device>* out);
std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options);  ///< never fails

/// True when a CUDA device can be opened in this process (built with CUDA and a GPU is present).
bool cuda_available();

}  // namespace ddo::engine
