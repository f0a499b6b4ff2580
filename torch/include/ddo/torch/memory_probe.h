/// \file
/// MemoryProbe: the named-profile peak-VRAM measurement, on a real GPU and on the host simulation.
///
/// Calibration measures how much device memory a workload really needs
/// (docs/design/0007-named-profiles.md, section 3): synchronize at the region boundaries, reset the
/// allocator's peak counters, and take the larger of (a) the driver's view of used memory, observed
/// at the start, the end and by a sampling thread in between, and (b) the allocator's peak reserved
/// bytes plus the memory that was in use outside the allocator when the region began. This header
/// provides the measuring instrument; the peak rule itself (Note [Peak rule] in
/// ddo/core/calibration.h) and the recommendation live in core, and the probe calls them. See
/// docs/design/0002-measurement.md.
/// ```
/// std::unique_ptr<ddo::adapter::MemoryProbe> probe;
/// ddo::throw_if_error(ddo::adapter::make_cuda_memory_probe(/*device=*/0, &probe));
/// // or: probe = ddo::adapter::make_sim_memory_probe(*sim_device);
/// ddo::throw_if_error(probe->start_sampling(std::chrono::milliseconds(2)));
/// run_denoising_loop();
/// ddo::adapter::MeasurementResult m = probe->stop_sampling();
/// // m.peak_bytes == core::measure_peak(to_measurement_inputs(m)).peak_bytes
/// //              == max(m.peak_driver_used_bytes,
/// //                     m.allocator_peak_reserved_bytes + m.initial_non_allocator_bytes)
/// ```
///
/// Two more pieces serve the benchmarks and the simulation:
/// ```
/// - `apply_vram_cap(device, cap_bytes)` makes a large GPU behave like a small card: LibTorch's
///   caching allocator refuses memory above the cap and probes report the cap as the total.
/// - `ScopedCountingCpuAllocator` counts the CPU tensors created while a simulated offload is
///   active (on the simulation, activations are CPU tensors standing in for device memory) and
///   refuses, like a full card, allocations that would push the simulated device over capacity.
/// ```
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ddo/core/status.h"

namespace ddo::core {
struct MeasurementInputs;
}  // namespace ddo::core

namespace ddo::engine {
class Device;
}  // namespace ddo::engine

namespace ddo::adapter {

/// One reading of a device's memory. Byte counts; -1 where a source cannot tell.
struct MemorySnapshot {
  std::int64_t total_bytes = 0;        ///< the card, or the emulated cap when one is applied
  std::int64_t driver_used_bytes = 0;  ///< everything in use on the device, by anyone
  std::int64_t allocator_allocated_bytes = 0;      ///< tensors alive in the caching allocator
  std::int64_t allocator_reserved_bytes = 0;       ///< allocated + cached by the allocator
  std::int64_t allocator_peak_reserved_bytes = 0;  ///< since the last reset_peak()
};

/// The figures of one measured region (start_sampling .. stop_sampling).
struct MeasurementResult {
  MemorySnapshot start;  ///< when the region began, after the peak counters were reset
  MemorySnapshot end;    ///< when the region ended, after a synchronize
  /// Max of driver_used_bytes over the start, the end and every sample in between.
  std::int64_t peak_driver_used_bytes = 0;
  /// start.driver_used_bytes - start.allocator_reserved_bytes (clamped at 0): the CUDA context,
  /// other libraries, other processes; assumed constant through the region (Note [Peak rule]).
  std::int64_t initial_non_allocator_bytes = 0;
  /// max(end.allocator_peak_reserved_bytes, start.allocator_reserved_bytes): the counters were
  /// reset when the region began, and its peak includes its first instant.
  std::int64_t allocator_peak_reserved_bytes = 0;
  /// max(peak_driver_used_bytes, allocator_peak_reserved_bytes + initial_non_allocator_bytes),
  /// as core::measure_peak computes it (Note [Peak rule] in ddo/core/calibration.h).
  std::int64_t peak_bytes = 0;
  std::int64_t total_bytes = 0;  ///< start.total_bytes
  int samples = 0;               ///< sampling-thread readings (start and end not included)
  double seconds = 0.0;          ///< wall time of the region
};

/// Reads a device's memory figures and measures regions. One region at a time per probe; one
/// region per device in the process is core's rule (core::CalibrationRegionLock, taken by the
/// caller before start_sampling: the peak counters are per device).
/// Thread-safety: snapshot() may be called from any thread; start/stop from one thread.
class MemoryProbe {
 public:
  virtual ~MemoryProbe();
  MemoryProbe(const MemoryProbe&) = delete;
  MemoryProbe& operator=(const MemoryProbe&) = delete;

  /// A reading now. Does not synchronize.
  virtual MemorySnapshot snapshot() = 0;
  /// Waits for all work queued on the device (region boundaries only; never on a hot path).
  virtual void synchronize() = 0;
  /// Resets the allocator's peak counters to the current values.
  virtual void reset_peak() = 0;
  /// "cuda:0", "sim:0": names the device in messages and in the one-region-per-device rule.
  virtual std::string device_name() const = 0;
  /// What the sampling thread reads: the driver view alone, cheaper than a snapshot where the
  /// allocator's figures need its lock.
  virtual std::int64_t driver_used_bytes();

  /// Begins a region: synchronize, reset the peak counters, take the start snapshot and start a
  /// thread that reads driver_used_bytes every `period`. Fails with kFailedPrecondition when a
  /// region is already open on this probe.
  Status start_sampling(std::chrono::milliseconds period = std::chrono::milliseconds(2));
  /// Ends the region: synchronize, take the end snapshot, stop the thread and combine the
  /// figures. Must follow a successful start_sampling (an invariant).
  MeasurementResult stop_sampling();
  /// True while a region is open (between start_sampling and stop_sampling).
  bool sampling() const { return sampler_.joinable(); }
  /// Readings the sampling thread has taken in the open region so far: a reading begun after
  /// some moment is in once this has grown by two since.
  int samples_so_far() const { return samples_.load(std::memory_order_relaxed); }

 protected:
  MemoryProbe() = default;
  /// Ends an open region without measuring. Implementations call it first in their destructor:
  /// the sampling thread calls their virtual functions.
  void abandon_sampling();

 private:
  void sample_loop(std::chrono::milliseconds period);

  std::thread sampler_;
  std::mutex mutex_;  ///< guards the sampling state below
  std::atomic<bool> stop_{false};
  std::atomic<std::int64_t> peak_driver_used_{0};
  std::atomic<int> samples_{0};
  MemorySnapshot start_;
  std::chrono::steady_clock::time_point started_at_;
};

/// The figures of a region from two snapshots and a sampled driver maximum: the peak and its
/// terms come from core::measure_peak (Note [Peak rule]), the one copy of the rule. Exposed for
/// tests.
MeasurementResult combine_measurement(const MemorySnapshot& start, const MemorySnapshot& end,
                                      std::int64_t sampled_peak_driver_used_bytes, int samples,
                                      double seconds);

/// The readings core's calibration takes (ddo/core/calibration.h; include it to use them).
/// The sampled maximum travels as the one inside sample: core::measure_peak(inputs).peak_bytes
/// == result.peak_bytes.
core::MeasurementInputs to_measurement_inputs(const MeasurementResult& result);

// --- CUDA ----------------------------------------------------------------------------------------

/// True when this build has CUDA and a GPU is visible to LibTorch.
bool cuda_memory_probe_available();

/// A probe for CUDA device `device`: driver view from cudaMemGetInfo (total − free; the total is
/// replaced by the emulated cap when one is applied), allocator figures from LibTorch's caching
/// allocator (getDeviceStats), peak reset with resetPeakStats, synchronize with
/// c10::cuda::device_synchronize. Fails with kUnavailable when no GPU is present (the message says
/// so), kInvalidArgument for a bad index.
Status make_cuda_memory_probe(int device, std::unique_ptr<MemoryProbe>* out);

/// Emulates a card of `cap_bytes` on CUDA device `device`: the caching allocator refuses memory
/// (c10::OutOfMemoryError) once the driver-view usage would pass the cap, and CUDA probes report
/// `cap_bytes` as total_bytes. 0 removes the cap. See Note [Emulated VRAM cap] in
/// memory_probe_cuda.cpp. Fails with kInvalidArgument when the cap is negative, larger than the
/// card, or smaller than what is already in use outside the allocator; kUnavailable without a GPU.
Status apply_vram_cap(int device, std::int64_t cap_bytes);
/// The cap applied to `device`, 0 when none.
std::int64_t vram_cap_bytes(int device);
/// Event counts of LibTorch's CUDA caching allocator since the process began. A benchmark reads
/// them around its timed steps: an allocation retry (the allocator hit its limit, freed its cache
/// and synchronized the device) or a cudaMalloc inside steady steps costs far more than a step's
/// copies, and explains a slow row.
struct AllocatorCounters {
  std::int64_t alloc_retries = 0;     ///< allocations that first failed and freed the cache
  std::int64_t ooms = 0;              ///< allocations refused for good
  std::int64_t device_allocs = 0;     ///< cudaMalloc calls
  std::int64_t device_frees = 0;      ///< cudaFree calls
  std::int64_t sync_all_streams = 0;  ///< device-wide synchronizations by the allocator
};
/// Zeros without CUDA or a GPU.
AllocatorCounters allocator_counters(int device);
/// Returns the caching allocator's unused cached blocks on every CUDA device to the driver
/// (emptyCache), so that benchmark rows start from the same state. No-op without CUDA.
void release_cached_device_memory();

// --- host simulation -----------------------------------------------------------------------------

/// A probe for a simulated device: driver view = device.memory().used_bytes (its arena) plus the
/// bytes held by the counting CPU allocator; allocator figures = the counting allocator's current
/// and peak bytes. The device must outlive the probe.
std::unique_ptr<MemoryProbe> make_sim_memory_probe(engine::Device& device);

/// Figures of the counting CPU allocator (process-wide; COUNT and SUM since the process began,
/// peak since the last reset).
struct CountingCpuAllocatorStats {
  std::int64_t current_bytes = 0;  ///< SUM: bytes of live CPU allocations made through it
  std::int64_t peak_bytes = 0;     ///< max of current_bytes since reset_peak
  std::int64_t allocations = 0;    ///< COUNT: allocations made through it
  std::int64_t refusals = 0;       ///< COUNT: allocations refused for lack of simulated memory
};

/// What a ScopedCountingCpuAllocator enforces.
struct CountingCpuAllocatorOptions {
  /// The simulated device whose capacity bounds counted bytes; null = count only, never refuse.
  engine::Device* device = nullptr;
  /// The capacity to enforce; 0 = device->memory().total_bytes at each check.
  std::int64_t capacity_bytes = 0;
};

/// Installs ddo's counting CPU allocator (c10::SetCPUAllocator) for the scope's lifetime.
/// Refcounted: nested or concurrent scopes share one installation, the last one restores the
/// previous allocator. While installed, every CPU allocation is counted, and one that would make
/// `device arena used + counted bytes` exceed a registered device's capacity throws
/// c10::OutOfMemoryError naming the sizes, as a full card would. Tensors made while it was
/// installed may outlive it: their memory is freed and uncounted correctly afterwards.
/// See Note [Counting CPU allocator] in memory_probe.cpp.
///
/// ```
/// {
///   ScopedCountingCpuAllocator counting({.device = sim_device.get()});
///   auto y = model->forward(x);   // activations count against the simulated card
/// }                               // previous CPU allocator restored
/// ```
class ScopedCountingCpuAllocator {
 public:
  /// Installs the allocator (or joins the installed one) and registers the options' limit.
  explicit ScopedCountingCpuAllocator(const CountingCpuAllocatorOptions& options = {});
  ~ScopedCountingCpuAllocator();
  ScopedCountingCpuAllocator(const ScopedCountingCpuAllocator&) = delete;
  ScopedCountingCpuAllocator& operator=(const ScopedCountingCpuAllocator&) = delete;

  static CountingCpuAllocatorStats stats();  ///< the process-wide figures
  static void reset_peak();                  ///< peak_bytes becomes current_bytes
  static bool installed();                   ///< true while any scope is alive

 private:
  std::uint64_t token_ = 0;  ///< this scope's registered limit
};

/// On this thread, while alive, CPU allocations bypass the counting allocator (neither counted
/// nor refused): host-side copies that ddo itself makes (restoring weights on remove, host slabs
/// backed by tensors) are not device memory on the simulated card.
class ScopedUncountedCpuAllocations {
 public:
  ScopedUncountedCpuAllocations();
  ~ScopedUncountedCpuAllocations();
  ScopedUncountedCpuAllocations(const ScopedUncountedCpuAllocations&) = delete;
  ScopedUncountedCpuAllocations& operator=(const ScopedUncountedCpuAllocations&) = delete;

 private:
  bool previous_;
};

}  // namespace ddo::adapter
