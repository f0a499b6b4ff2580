// The device-independent half of MemoryProbe (the region, the sampler, core's peak rule), the probe
// of the host simulation and the counting CPU allocator. The CUDA probe and the VRAM cap are in
// memory_probe_cuda.cpp.
#include "ddo/torch/memory_probe.h"

#include <algorithm>
#include <map>
#include <new>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "ddo/core/calibration.h"
#include "ddo/engine/device.h"

namespace ddo::adapter {

// --- the region ----------------------------------------------------------------------------------

MemoryProbe::~MemoryProbe() {
  DDO_ASSERT(!sampler_.joinable(), "a probe must call abandon_sampling() in its destructor");
}

void MemoryProbe::abandon_sampling() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sampler_.joinable()) return;
  stop_.store(true);
  sampler_.join();
}

std::int64_t MemoryProbe::driver_used_bytes() {
  return snapshot().driver_used_bytes;
}

Status MemoryProbe::start_sampling(std::chrono::milliseconds period) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (sampler_.joinable()) {
    return Status(Code::kFailedPrecondition,
                  internal::str_cat("a memory measurement is already running on ", device_name(),
                                    " through this probe; call stop_sampling() first"));
  }
  // diffusers-dynamic-offloader's order: queued work first, so that the peak counters and the start
  // reading see the state the region really starts from.
  synchronize();
  reset_peak();
  start_ = snapshot();
  peak_driver_used_.store(start_.driver_used_bytes);
  samples_.store(0);
  stop_.store(false);
  started_at_ = std::chrono::steady_clock::now();
  const auto sample_period = std::max(period, std::chrono::milliseconds(1));
  sampler_ = std::thread([this, sample_period] { sample_loop(sample_period); });
  return Status();
}

void MemoryProbe::sample_loop(std::chrono::milliseconds period) {
  while (!stop_.load(std::memory_order_relaxed)) {
    const std::int64_t used = driver_used_bytes();
    std::int64_t seen = peak_driver_used_.load(std::memory_order_relaxed);
    while (used > seen && !peak_driver_used_.compare_exchange_weak(seen, used)) {
    }
    samples_.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(period);
  }
}

MeasurementResult MemoryProbe::stop_sampling() {
  std::lock_guard<std::mutex> lock(mutex_);
  DDO_ASSERT(sampler_.joinable(), "stop_sampling() without a successful start_sampling()");
  synchronize();
  const MemorySnapshot end = snapshot();
  stop_.store(true);
  sampler_.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_at_).count();
  return combine_measurement(start_, end, peak_driver_used_.load(), samples_.load(), seconds);
}

namespace {

// The sampled maximum travels as the one inside sample; the allocator's figures as read.
core::MeasurementInputs inputs_of(const MemorySnapshot& start, const MemorySnapshot& end,
                                  std::int64_t sampled_peak_driver_used_bytes) {
  core::MeasurementInputs inputs;
  inputs.driver_used_start_bytes = start.driver_used_bytes;
  inputs.driver_used_end_bytes = end.driver_used_bytes;
  inputs.driver_used_samples_bytes = {sampled_peak_driver_used_bytes};
  inputs.allocator_reserved_start_bytes = start.allocator_reserved_bytes;
  // The counters were reset at the start, so the end's peak covers exactly the region.
  inputs.allocator_peak_reserved_bytes = end.allocator_peak_reserved_bytes;
  return inputs;
}

}  // namespace

MeasurementResult combine_measurement(const MemorySnapshot& start, const MemorySnapshot& end,
                                      std::int64_t sampled_peak_driver_used_bytes, int samples,
                                      double seconds) {
  // The rule is core's (Note [Peak rule] in ddo/core/calibration.h); this only copies its terms.
  const core::Measurement m =
      core::measure_peak(inputs_of(start, end, sampled_peak_driver_used_bytes));
  MeasurementResult r;
  r.start = start;
  r.end = end;
  r.peak_driver_used_bytes = m.driver_peak_bytes;
  r.initial_non_allocator_bytes = m.initial_non_allocator_bytes;
  r.allocator_peak_reserved_bytes = m.allocator_peak_reserved_bytes;
  r.peak_bytes = m.peak_bytes;
  r.total_bytes = start.total_bytes;
  r.samples = samples;
  r.seconds = seconds;
  return r;
}

core::MeasurementInputs to_measurement_inputs(const MeasurementResult& result) {
  return inputs_of(result.start, result.end, result.peak_driver_used_bytes);
}

// --- the counting CPU allocator ------------------------------------------------------------------

// Note [Counting CPU allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On the host simulation the "device" that runs the model is the CPU: activations, staged
// weights viewed as tensors and temporaries are CPU tensors, and only ddo's own arena
// (engine::Device) knows its bytes. To measure the region as on a card, and to fail as a card of
// that size would, CPU allocations made while a simulated offload is active go through this
// wrapper around the CPU allocator that was installed before it:
//   - each allocation carries a small header {inner deleter and context, bytes} just before its
//     data (the data pointer is its own context, as Allocator::raw_allocate requires: oneDNN
//     allocates scratch that way); the deleter
//     uncounts the bytes and frees the inner allocation, so tensors that outlive the
//     installation (a result returned from the region) are still freed correctly. The wrapper
//     object is therefore never destroyed (a leaked singleton, no static destructor).
//   - the bytes are added before the capacity check and taken back on refusal, so concurrent
//     allocations can only be refused too early, never let through over the capacity.
//   - installation is refcounted: two offloads on the simulation share one installation, and
//     a refusal checks every registered device (conservative: the counted bytes are not
//     attributed to one device).
//   - c10::SetCPUAllocator replaces an allocator only at an equal or higher priority; ddo uses 0,
//     the priority of LibTorch's default, and says so when another library holds a higher one.
// Only the simulation installs it; CUDA runs never pay for it.

namespace {

constexpr std::uint8_t kCountingAllocatorPriority = 0;

thread_local bool t_uncounted = false;

class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& instance() {
    static auto* allocator = new CountingCpuAllocator();  // see Note [Counting CPU allocator]
    return *allocator;
  }

  c10::DataPtr allocate(size_t n) override {
    c10::Allocator* inner = inner_.load();
    DDO_ASSERT(inner != nullptr, "the counting CPU allocator was used before installation");
    const bool counted = !t_uncounted && n > 0;
    const auto bytes = counted ? static_cast<std::int64_t>(n) : std::int64_t{0};
    const std::int64_t now = current_.fetch_add(bytes) + bytes;
    if (counted) check_capacity(bytes, now);
    c10::DataPtr inner_ptr;
    try {
      inner_ptr = inner->allocate(n + kHeaderBytes);
    } catch (...) {
      current_.fetch_sub(bytes);
      throw;
    }
    if (counted) {
      std::int64_t seen = peak_.load(std::memory_order_relaxed);
      while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
      }
      allocations_.fetch_add(1, std::memory_order_relaxed);
    }
    // Note [Counting allocator header]: the data pointer is its own context (what
    // Allocator::raw_allocate asserts; oneDNN allocates its scratch that way), so the record of
    // the inner allocation lives in a header just before the data.
    char* base = static_cast<char*>(inner_ptr.get());
    const c10::Device device = inner_ptr.device();
    const c10::DeleterFnPtr inner_deleter = inner_ptr.get_deleter();
    void* inner_context = inner_ptr.release_context();
    new (base) Header{inner_deleter, inner_context, bytes};
    void* data = base + kHeaderBytes;
    return c10::DataPtr(data, data, &CountingCpuAllocator::delete_counted, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::delete_counted; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void install(std::uint64_t token, const CountingCpuAllocatorOptions& options) {
    std::lock_guard<std::mutex> lock(install_mutex_);
    if (installs_ == 0) {
      c10::Allocator* previous = c10::GetCPUAllocator();
      if (previous != this) inner_.store(previous);
      c10::SetCPUAllocator(this, kCountingAllocatorPriority);
      if (c10::GetCPUAllocator() != this) {
        throw Error(Code::kUnavailable,
                    "cannot install ddo's counting CPU allocator for the simulated device: "
                    "another library registered a CPU allocator at a higher priority");
      }
    }
    ++installs_;
    std::lock_guard<std::mutex> limits_lock(limits_mutex_);
    limits_[token] = options;
  }

  void uninstall(std::uint64_t token) {
    std::lock_guard<std::mutex> lock(install_mutex_);
    {
      std::lock_guard<std::mutex> limits_lock(limits_mutex_);
      limits_.erase(token);
    }
    DDO_ASSERT(installs_ > 0);
    if (--installs_ == 0) c10::SetCPUAllocator(inner_.load(), kCountingAllocatorPriority);
  }

  bool installed() {
    std::lock_guard<std::mutex> lock(install_mutex_);
    return installs_ > 0;
  }

  CountingCpuAllocatorStats stats() const {
    CountingCpuAllocatorStats s;
    s.current_bytes = current_.load();
    s.peak_bytes = peak_.load();
    s.allocations = allocations_.load();
    s.refusals = refusals_.load();
    return s;
  }

  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Header {
    c10::DeleterFnPtr inner_deleter;
    void* inner_context;
    std::int64_t bytes;
  };
  // 64 keeps the data as aligned as the inner allocator's (c10's CPU allocator aligns to 64).
  static constexpr std::size_t kHeaderBytes = 64;
  static_assert(sizeof(Header) <= kHeaderBytes);

  static void delete_counted(void* data) {
    if (data == nullptr) return;
    auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeaderBytes);
    instance().current_.fetch_sub(header->bytes);
    const c10::DeleterFnPtr deleter = header->inner_deleter;
    void* context = header->inner_context;
    if (deleter != nullptr) deleter(context);  // frees the inner allocation (and the header)
  }

  // Throws c10::OutOfMemoryError (after taking `bytes` back) when counted bytes `now` plus a
  // registered device's arena exceed its capacity.
  void check_capacity(std::int64_t bytes, std::int64_t now) {
    std::lock_guard<std::mutex> lock(limits_mutex_);
    for (const auto& [token, limit] : limits_) {
      if (limit.device == nullptr) continue;
      const engine::DeviceMemory memory = limit.device->memory();
      const std::int64_t capacity =
          limit.capacity_bytes > 0 ? limit.capacity_bytes : memory.total_bytes;
      if (memory.used_bytes + now <= capacity) continue;
      current_.fetch_sub(bytes);
      refusals_.fetch_add(1);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "simulated device ", limit.device->caps().name,
                       " out of memory: tried to allocate ", bytes, " bytes with ",
                       memory.used_bytes, " bytes used by its arena and ", now - bytes,
                       " bytes by tensors, capacity ", capacity,
                       " bytes; raise the simulated capacity (DDO_SIM_DEVICE_GB) or lower the "
                       "resident budget");
    }
  }

  std::atomic<c10::Allocator*> inner_{nullptr};
  std::atomic<std::int64_t> current_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> allocations_{0};
  std::atomic<std::int64_t> refusals_{0};

  std::mutex install_mutex_;
  int installs_ = 0;  // guarded by install_mutex_
  std::mutex limits_mutex_;
  std::map<std::uint64_t, CountingCpuAllocatorOptions> limits_;  // guarded by limits_mutex_
};

std::atomic<std::uint64_t> g_next_token{1};

}  // namespace

ScopedCountingCpuAllocator::ScopedCountingCpuAllocator(const CountingCpuAllocatorOptions& options)
    : token_(g_next_token.fetch_add(1)) {
  CountingCpuAllocator::instance().install(token_, options);
}

ScopedCountingCpuAllocator::~ScopedCountingCpuAllocator() {
  CountingCpuAllocator::instance().uninstall(token_);
}

CountingCpuAllocatorStats ScopedCountingCpuAllocator::stats() {
  return CountingCpuAllocator::instance().stats();
}

void ScopedCountingCpuAllocator::reset_peak() {
  CountingCpuAllocator::instance().reset_peak();
}

bool ScopedCountingCpuAllocator::installed() {
  return CountingCpuAllocator::instance().installed();
}

ScopedUncountedCpuAllocations::ScopedUncountedCpuAllocations() : previous_(t_uncounted) {
  t_uncounted = true;
}

ScopedUncountedCpuAllocations::~ScopedUncountedCpuAllocations() {
  t_uncounted = previous_;
}

// --- the simulation's probe ----------------------------------------------------------------------

namespace {

class SimMemoryProbe final : public MemoryProbe {
 public:
  explicit SimMemoryProbe(engine::Device& device) : device_(device) {}
  ~SimMemoryProbe() override { abandon_sampling(); }

  MemorySnapshot snapshot() override {
    const engine::DeviceMemory memory = device_.memory();
    const CountingCpuAllocatorStats counted = ScopedCountingCpuAllocator::stats();
    MemorySnapshot s;
    s.total_bytes = memory.total_bytes;
    s.driver_used_bytes = memory.used_bytes + counted.current_bytes;
    // The CPU allocator caches nothing: what it holds is what tensors hold.
    s.allocator_allocated_bytes = counted.current_bytes;
    s.allocator_reserved_bytes = counted.current_bytes;
    s.allocator_peak_reserved_bytes = counted.peak_bytes;
    return s;
  }

  // The simulation's compute stream is the calling thread; the arena's figures change only on
  // synchronous allocate/deallocate calls, so in-flight copies do not move them.
  void synchronize() override { device_.synchronize_stream(engine::kDefaultStream); }

  void reset_peak() override { ScopedCountingCpuAllocator::reset_peak(); }

  std::string device_name() const override {
    return internal::str_cat("sim:", device_.caps().index);
  }

 private:
  engine::Device& device_;
};

}  // namespace

std::unique_ptr<MemoryProbe> make_sim_memory_probe(engine::Device& device) {
  return std::make_unique<SimMemoryProbe>(device);
}

}  // namespace ddo::adapter
