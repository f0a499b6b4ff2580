// CopyScheduler timing modes (Note [Copy timing]) on every backend (backends.h): what each mode
// counts, that switching modes mid-run never serves stale bytes, and that a scheduler built
// without timing events refuses to time. A sample still running when its unit is copied again
// is dropped, so counts are bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backends.h"
#include "ddo/engine/copy_scheduler.h"

namespace ddo::engine {
namespace {

constexpr int kUnits = 12;
constexpr std::size_t kUnitBytes = 64 << 10;

struct TimingRig {
  TimingRig(std::unique_ptr<Device> d, bool time_copies) : device(std::move(d)) {
    std::mt19937_64 rng(7);
    for (int i = 0; i < kUnits; ++i) {
      host.emplace_back(kUnitBytes);
      for (auto& b : host.back()) b = static_cast<std::uint8_t>(rng());
    }
    SchedulerOptions options;
    options.window_bytes = 4 * kUnitBytes;
    options.time_copies = time_copies;
    scheduler = std::make_unique<CopyScheduler>(*device, options);
    for (auto& h : host) scheduler->add(h.data(), h.size(), /*pinned=*/true);
  }
  ~TimingRig() { scheduler.reset(); }  // before the device

  // Whether the staged bytes at `p` are unit `id`'s (read back through the device).
  bool correct(int id, const void* p) {
    std::vector<std::uint8_t> got(kUnitBytes);
    device->synchronize_stream(kDefaultStream);
    if (!device->copy_to_host(got.data(), p, kUnitBytes).ok()) return false;
    return std::memcmp(got.data(), host[id].data(), kUnitBytes) == 0;
  }

  // One step: every unit in order, each checked against its host bytes. Returns wrong units.
  int step() {
    int wrong = 0;
    for (int id = 0; id < kUnits; ++id) {
      const void* p = scheduler->acquire(id, kDefaultStream);
      if (!correct(id, p)) ++wrong;
      scheduler->release(id, kDefaultStream);
    }
    return wrong;
  }

  std::unique_ptr<Device> device;
  std::vector<std::vector<std::uint8_t>> host;
  std::unique_ptr<CopyScheduler> scheduler;
};

class CopySchedulerTiming : public BackendTest {
 protected:
  std::unique_ptr<TimingRig> rig(bool time_copies) {
    SimDeviceOptions sim;
    sim.capacity_bytes = std::int64_t{16} << 20;
    return std::make_unique<TimingRig>(open_device(sim), time_copies);
  }
};

TEST_P(CopySchedulerTiming, FullTimesEveryCopy) {
  auto r = rig(/*time_copies=*/true);
  TimingRig& rig = *r;
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  EXPECT_EQ(rig.scheduler->timing(), Timing::kFull);
  for (int s = 0; s < 4; ++s) ASSERT_EQ(rig.step(), 0);
  rig.scheduler->drain();
  const SchedulerStats st = rig.scheduler->stats();
  ASSERT_GT(st.bytes_copied, 0);
  EXPECT_EQ(st.timed_copy_bytes, st.timed_copies * static_cast<std::int64_t>(kUnitBytes));
  EXPECT_LE(st.timed_copy_bytes, st.bytes_copied);
  // A sample still running when its unit is copied again is dropped; nearly all land first.
  EXPECT_GE(st.timed_copy_bytes * 10, st.bytes_copied * 9);
  EXPECT_GT(st.timed_waits, 0);
  EXPECT_GT(st.copy_ms, 0.0);
}

TEST_P(CopySchedulerTiming, SampledTimesOneCopyInSixteen) {
  auto r = rig(/*time_copies=*/true);
  TimingRig& rig = *r;
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  rig.scheduler->set_timing(Timing::kSampled);
  for (int s = 0; s < 16; ++s) ASSERT_EQ(rig.step(), 0);
  rig.scheduler->drain();
  const SchedulerStats st = rig.scheduler->stats();
  const std::int64_t copies = st.bytes_copied / static_cast<std::int64_t>(kUnitBytes);
  ASSERT_GE(copies, 16 * kUnits);
  const std::int64_t sampled = copies / static_cast<std::int64_t>(kTimingSampleEvery);
  EXPECT_LE(st.timed_copies, sampled);
  EXPECT_GE(st.timed_copies, sampled - 2);
  EXPECT_EQ(st.timed_copy_bytes, st.timed_copies * static_cast<std::int64_t>(kUnitBytes));
  EXPECT_LE(st.timed_waits, st.acquires / static_cast<std::int64_t>(kTimingSampleEvery));
  EXPECT_GT(st.timed_waits, 0);
}

TEST_P(CopySchedulerTiming, OffTimesNothing) {
  auto r = rig(/*time_copies=*/true);
  TimingRig& rig = *r;
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  rig.scheduler->set_timing(Timing::kOff);
  for (int s = 0; s < 3; ++s) ASSERT_EQ(rig.step(), 0);
  rig.scheduler->drain();
  const SchedulerStats st = rig.scheduler->stats();
  EXPECT_GT(st.bytes_copied, 0);
  EXPECT_EQ(st.timed_copies, 0);
  EXPECT_EQ(st.timed_waits, 0);
  EXPECT_EQ(st.copy_ms, 0.0);
  EXPECT_EQ(st.wait_ms, 0.0);
}

TEST_P(CopySchedulerTiming, SwitchingModesMidStepServesTheRightBytes) {
  auto r = rig(/*time_copies=*/true);
  TimingRig& rig = *r;
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  const Timing modes[] = {Timing::kFull, Timing::kOff, Timing::kSampled, Timing::kFull,
                          Timing::kOff};
  int wrong = 0;
  for (int s = 0; s < 10; ++s) {
    for (int id = 0; id < kUnits; ++id) {
      // Switch between a prefetch and the acquire that consumes it.
      rig.scheduler->set_timing(modes[(s * kUnits + id) % 5]);
      const void* p = rig.scheduler->acquire(id, kDefaultStream);
      if (!rig.correct(id, p)) ++wrong;
      rig.scheduler->release(id, kDefaultStream);
    }
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(rig.scheduler->stats().order_misses, 0);
}

TEST_P(CopySchedulerTiming, TimelineReadsNanWhereNothingWasTimed) {
  auto r = rig(/*time_copies=*/true);
  TimingRig& rig = *r;
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  for (int s = 0; s < 2; ++s) ASSERT_EQ(rig.step(), 0);  // learns the trace
  rig.scheduler->set_timing(Timing::kOff);
  rig.scheduler->mark(kDefaultStream);
  for (int s = 0; s < 2; ++s) ASSERT_EQ(rig.step(), 0);
  rig.device->synchronize_stream(kDefaultStream);
  const std::vector<UnitTiming> off = rig.scheduler->timeline();
  ASSERT_EQ(off.size(), static_cast<std::size_t>(kUnits));
  for (const UnitTiming& t : off) {
    EXPECT_TRUE(std::isnan(t.copy_start_ms)) << "unit " << t.unit;
    EXPECT_TRUE(std::isnan(t.wait_end_ms)) << "unit " << t.unit;
  }
  rig.scheduler->set_timing(Timing::kFull);
  rig.scheduler->mark(kDefaultStream);
  for (int s = 0; s < 2; ++s) ASSERT_EQ(rig.step(), 0);
  rig.device->synchronize_stream(kDefaultStream);
  int timed = 0;
  for (const UnitTiming& t : rig.scheduler->timeline()) {
    timed += std::isfinite(t.copy_end_ms) && std::isfinite(t.wait_end_ms) ? 1 : 0;
  }
  EXPECT_EQ(timed, kUnits);
}

TEST_P(CopySchedulerTiming, WithoutTimingEventsOnlyOffIsAllowed) {
  auto r = rig(/*time_copies=*/false);
  TimingRig& rig = *r;
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  EXPECT_EQ(rig.scheduler->timing(), Timing::kOff);
  rig.scheduler->set_timing(Timing::kOff);
  try {
    rig.scheduler->set_timing(Timing::kSampled);
    FAIL() << "set_timing(kSampled) without timing events must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status().code(), Code::kFailedPrecondition);
  }
  ASSERT_EQ(rig.step(), 0);
  EXPECT_EQ(rig.scheduler->stats().timed_copies, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, CopySchedulerTiming, kBackends, backend_name);

}  // namespace
}  // namespace ddo::engine
