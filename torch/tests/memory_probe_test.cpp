// Tests of the memory probe: the counting CPU allocator, the simulation's probe and its sampler,
// the peak rule's agreement with core, and (on a GPU) the CUDA probe and the emulated cap.
#include "ddo/torch/memory_probe.h"

#include <chrono>
#include <thread>

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "ddo/core/calibration.h"
#include "ddo/engine/device.h"
#include "test_util.h"

#if DDO_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace ddo::adapter {
namespace {

constexpr std::int64_t kMiB = 1 << 20;

std::unique_ptr<engine::Device> sim_device(std::int64_t capacity_bytes) {
  return engine::make_sim_device({.capacity_bytes = capacity_bytes});
}

TEST(CountingCpuAllocator, CountsWhileInstalledAndRestoresThePrevious) {
  c10::Allocator* before = c10::GetCPUAllocator();
  const std::int64_t base = ScopedCountingCpuAllocator::stats().current_bytes;
  {
    ScopedCountingCpuAllocator counting;
    EXPECT_TRUE(ScopedCountingCpuAllocator::installed());
    EXPECT_NE(c10::GetCPUAllocator(), before);
    at::Tensor t = at::empty({4 * kMiB}, at::kByte);
    EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base + 4 * kMiB);
    {
      ScopedCountingCpuAllocator nested;  // refcounted: one installation
      at::Tensor u = at::empty({kMiB}, at::kByte);
      EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base + 5 * kMiB);
    }
    EXPECT_TRUE(ScopedCountingCpuAllocator::installed());
    EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base + 4 * kMiB);
  }
  EXPECT_FALSE(ScopedCountingCpuAllocator::installed());
  EXPECT_EQ(c10::GetCPUAllocator(), before);
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base);
  at::Tensor after = at::empty({kMiB}, at::kByte);  // not counted once uninstalled
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base);
}

TEST(CountingCpuAllocator, TensorsOutlivingTheScopeAreUncountedWhenFreed) {
  const std::int64_t base = ScopedCountingCpuAllocator::stats().current_bytes;
  at::Tensor survivor;
  {
    ScopedCountingCpuAllocator counting;
    survivor = at::empty({2 * kMiB}, at::kByte);
  }
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base + 2 * kMiB);
  survivor.fill_(7);  // still valid memory
  survivor.reset();
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base);
}

TEST(CountingCpuAllocator, PeakAndReset) {
  ScopedCountingCpuAllocator counting;
  ScopedCountingCpuAllocator::reset_peak();
  const std::int64_t base = ScopedCountingCpuAllocator::stats().current_bytes;
  { at::Tensor big = at::empty({8 * kMiB}, at::kByte); }
  EXPECT_GE(ScopedCountingCpuAllocator::stats().peak_bytes, base + 8 * kMiB);
  ScopedCountingCpuAllocator::reset_peak();
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().peak_bytes,
            ScopedCountingCpuAllocator::stats().current_bytes);
}

TEST(CountingCpuAllocator, RefusesAboveTheSimulatedCapacityLikeAFullCard) {
  auto device = sim_device(64 * kMiB);
  void* arena = nullptr;
  ASSERT_TRUE(device->allocate(40 * kMiB, &arena).ok());
  ScopedCountingCpuAllocator counting({.device = device.get()});
  const std::int64_t base = ScopedCountingCpuAllocator::stats().current_bytes;
  ASSERT_LT(base, 8 * kMiB) << "tensors from other tests still counted";
  at::Tensor fits = at::empty({8 * kMiB}, at::kByte);
  const std::int64_t refusals = ScopedCountingCpuAllocator::stats().refusals;
  try {
    at::Tensor too_big = at::empty({32 * kMiB}, at::kByte);
    FAIL() << "a 32 MiB tensor on a 64 MiB card with 40 MiB used must be refused";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("33554432"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().refusals, refusals + 1);
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base + 8 * kMiB);
  {
    ScopedUncountedCpuAllocations uncounted;  // ddo's own host copies are not device memory
    at::Tensor host_copy = at::empty({32 * kMiB}, at::kByte);
    EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base + 8 * kMiB);
  }
  device->deallocate(arena);
  at::Tensor now_fits = at::empty({32 * kMiB}, at::kByte);
  EXPECT_EQ(ScopedCountingCpuAllocator::stats().current_bytes, base + 40 * kMiB);
}

TEST(SimMemoryProbe, SnapshotAddsArenaAndCountedTensors) {
  auto device = sim_device(256 * kMiB);
  ScopedCountingCpuAllocator counting({.device = device.get()});
  auto probe = make_sim_memory_probe(*device);
  const MemorySnapshot before = probe->snapshot();
  EXPECT_EQ(before.total_bytes, 256 * kMiB);
  void* arena = nullptr;
  ASSERT_TRUE(device->allocate(16 * kMiB, &arena).ok());
  at::Tensor t = at::empty({4 * kMiB}, at::kByte);
  const MemorySnapshot after = probe->snapshot();
  EXPECT_EQ(after.driver_used_bytes - before.driver_used_bytes, 20 * kMiB);
  EXPECT_EQ(after.allocator_reserved_bytes - before.allocator_reserved_bytes, 4 * kMiB);
  device->deallocate(arena);
}

TEST(SimMemoryProbe, RegionSeesAllocatorPeakAndSampledTransient) {
  auto device = sim_device(512 * kMiB);
  ScopedCountingCpuAllocator counting({.device = device.get()});
  auto probe = make_sim_memory_probe(*device);
  void* resident = nullptr;
  ASSERT_TRUE(device->allocate(32 * kMiB, &resident).ok());
  ASSERT_TRUE(probe->start_sampling(std::chrono::milliseconds(1)).ok());
  EXPECT_FALSE(probe->start_sampling().ok()) << "a second region on one probe must be refused";
  // A transient tensor peak (seen by the allocator's peak counter) ...
  { at::Tensor activation = at::empty({24 * kMiB}, at::kByte); }
  // ... and a transient arena peak that only the sampling thread can see.
  void* staging = nullptr;
  ASSERT_TRUE(device->allocate(64 * kMiB, &staging).ok());
  // Until a whole reading falls after the allocation (a count, not a time: a loaded machine only
  // makes it take longer; the deadline catches a sampler that stopped).
  const int before = probe->samples_so_far();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (probe->samples_so_far() < before + 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GE(probe->samples_so_far(), before + 2) << "the sampling thread took no reading in 60 s";
  device->deallocate(staging);
  const MeasurementResult m = probe->stop_sampling();
  EXPECT_GT(m.samples, 0);
  EXPECT_EQ(m.total_bytes, 512 * kMiB);
  EXPECT_GE(m.initial_non_allocator_bytes, 32 * kMiB);  // the arena at the start
  EXPECT_GE(m.allocator_peak_reserved_bytes - m.start.allocator_reserved_bytes, 24 * kMiB);
  EXPECT_GE(m.peak_driver_used_bytes - m.start.driver_used_bytes, 64 * kMiB);
  EXPECT_EQ(m.peak_bytes, std::max(m.peak_driver_used_bytes, m.allocator_peak_reserved_bytes +
                                                                 m.initial_non_allocator_bytes));
  // Core's rule gives the same peak from the same readings.
  EXPECT_EQ(core::measure_peak(to_measurement_inputs(m)).peak_bytes, m.peak_bytes);
  device->deallocate(resident);
}

TEST(MeasurementRule, AllocatorTermCatchesPeaksBetweenSamples) {
  MemorySnapshot start{.total_bytes = 8 * kMiB * 1024,
                       .driver_used_bytes = 600 * kMiB,  // 500 MiB context + 100 MiB reserved
                       .allocator_allocated_bytes = 100 * kMiB,
                       .allocator_reserved_bytes = 100 * kMiB,
                       .allocator_peak_reserved_bytes = 100 * kMiB};
  MemorySnapshot end = start;
  end.allocator_peak_reserved_bytes = 3000 * kMiB;  // a peak no sample saw
  const MeasurementResult m = combine_measurement(start, end, 700 * kMiB, 5, 1.0);
  EXPECT_EQ(m.initial_non_allocator_bytes, 500 * kMiB);
  EXPECT_EQ(m.peak_bytes, 3500 * kMiB);
}

// The probe has no rule of its own: where the allocator's counter reports less than was reserved
// at the start (a counter reset to zero) and the driver was read below the reserved bytes, the
// probe's figures are core's, floor included (Note [Peak rule] in ddo/core/calibration.h).
TEST(MeasurementRule, ProbeFiguresAreCoresOnReadingsThatSeparateTheTerms) {
  MemorySnapshot start{.total_bytes = 8 * kMiB * 1024,
                       .driver_used_bytes = 1024 * kMiB,
                       .allocator_allocated_bytes = 1536 * kMiB,
                       .allocator_reserved_bytes = 2048 * kMiB,
                       .allocator_peak_reserved_bytes = 0};
  MemorySnapshot end = start;
  end.driver_used_bytes = 1280 * kMiB;
  end.allocator_peak_reserved_bytes = 512 * kMiB;
  const MeasurementResult m = combine_measurement(start, end, 1100 * kMiB, 3, 0.5);
  const core::Measurement c = core::measure_peak(to_measurement_inputs(m));
  EXPECT_EQ(m.peak_driver_used_bytes, 1280 * kMiB);
  EXPECT_EQ(m.initial_non_allocator_bytes, 0);
  EXPECT_EQ(m.allocator_peak_reserved_bytes, 2048 * kMiB);
  EXPECT_EQ(m.peak_bytes, 2048 * kMiB);
  EXPECT_EQ(c.peak_bytes, m.peak_bytes);
  EXPECT_EQ(c.driver_peak_bytes, m.peak_driver_used_bytes);
  EXPECT_EQ(c.allocator_peak_reserved_bytes, m.allocator_peak_reserved_bytes);
  EXPECT_EQ(c.initial_non_allocator_bytes, m.initial_non_allocator_bytes);
  EXPECT_EQ(m.samples, 3);
  EXPECT_EQ(m.total_bytes, start.total_bytes);
}

TEST(CudaMemoryProbe, SeesAllocatorAndDriver) {
  DDO_SKIP_WITHOUT_GPU();
  std::unique_ptr<MemoryProbe> probe;
  ASSERT_TRUE(make_cuda_memory_probe(0, &probe).ok());
  ASSERT_TRUE(probe->start_sampling(std::chrono::milliseconds(1)).ok());
  {
    at::Tensor t = at::empty({256 * kMiB}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
    t.fill_(1);
  }
  const MeasurementResult m = probe->stop_sampling();
  EXPECT_GE(m.allocator_peak_reserved_bytes, 256 * kMiB);
  EXPECT_GE(m.peak_bytes,
            m.start.driver_used_bytes + 256 * kMiB - m.start.allocator_reserved_bytes);
  EXPECT_GT(m.initial_non_allocator_bytes, 0);  // the CUDA context
}

TEST(CudaMemoryProbe, RejectsAMissingDevice) {
  DDO_SKIP_WITHOUT_GPU();
  std::unique_ptr<MemoryProbe> probe;
  EXPECT_EQ(make_cuda_memory_probe(999, &probe).code(), Code::kInvalidArgument);
}

TEST(VramCap, AllocatorRefusesAboveTheCapAndProbesReportIt) {
  DDO_SKIP_WITHOUT_GPU();
  constexpr std::int64_t kCap = std::int64_t{2} << 30;
  auto cuda = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  at::empty({kMiB}, cuda).fill_(0);  // the context exists before the cap is computed
  ASSERT_TRUE(apply_vram_cap(0, kCap).ok());
  std::unique_ptr<MemoryProbe> probe;
  ASSERT_TRUE(make_cuda_memory_probe(0, &probe).ok());
  EXPECT_EQ(probe->snapshot().total_bytes, kCap);
  EXPECT_THROW(at::empty({kCap}, cuda), c10::OutOfMemoryError);
  {
    at::Tensor fits = at::empty({kCap / 2}, cuda);
    fits.fill_(1);
    EXPECT_LE(probe->snapshot().driver_used_bytes, kCap);
  }
  ASSERT_TRUE(apply_vram_cap(0, 0).ok());
  EXPECT_GT(probe->snapshot().total_bytes, kCap);
  at::Tensor uncapped = at::empty({kCap}, cuda);
  EXPECT_EQ(apply_vram_cap(0, -1).code(), Code::kInvalidArgument);
}

#if !DDO_HAVE_CUDA
TEST(VramCap, UnavailableWithoutCuda) {
  EXPECT_EQ(apply_vram_cap(0, 1 << 30).code(), Code::kUnavailable);
}
#endif

}  // namespace
}  // namespace ddo::adapter
