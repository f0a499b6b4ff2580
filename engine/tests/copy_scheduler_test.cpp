// CopyScheduler on every backend (backends.h): the simulation always, CUDA when a GPU is present.
// The compute stream is kDefaultStream; after acquire() returns, work on it sees the staged bytes,
// which the test reads back (Rig::staged_matches) and compares with the unit's host bytes. On the
// simulation copies are throttled in most tests so that prefetch actually runs ahead; the
// scheduler's decisions (trace, window, ring) are made on the host, so the counts the tests assert
// hold on both backends, while figures that depend on copy speed or the simulated arena are
// checked on the simulation only.
#include "ddo/engine/copy_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "backends.h"

namespace ddo::engine {
namespace {

struct Rig {
  // `device` is the backend's; each unit's bytes are random, kept in `host` for comparison and in
  // pinned host memory (allocate_host) for the scheduler to copy from.
  Rig(std::unique_ptr<Device> dev, int units, std::size_t min_bytes, std::size_t max_bytes,
      const SchedulerOptions& options)
      : device(std::move(dev)), sim(device->caps().kind == DeviceKind::kSim) {
    std::mt19937_64 rng(1234 + units);
    for (int i = 0; i < units; ++i) {
      const std::size_t bytes = min_bytes + rng() % (max_bytes - min_bytes + 1);
      host.emplace_back(bytes);
      for (auto& b : host.back()) b = static_cast<std::uint8_t>(rng());
      largest = std::max(largest, bytes);
      void* p = nullptr;
      throw_if_error(device->allocate_host(bytes, &p));
      std::memcpy(p, host.back().data(), bytes);
      pinned.push_back(p);
    }
    scheduler = std::make_unique<CopyScheduler>(*device, options);
    for (std::size_t i = 0; i < host.size(); ++i) {
      scheduler->add(pinned[i], host[i].size(), /*pinned=*/true);
    }
  }

  ~Rig() {
    scheduler.reset();  // before the memory it copies from and the device
    for (void* p : pinned) device->deallocate_host(p);
  }

  // Whether device memory at `p` holds `expected`, as work issued on kDefaultStream so far left
  // it. The simulation's device memory is host memory, read in place (a read-back copy would be
  // throttled like the scheduler's and change the tests' timing); CUDA's is copied back with
  // cudaMemcpy, which the legacy default stream orders after the compute stream's waits.
  bool device_matches(const void* p, const std::vector<std::uint8_t>& expected) const {
    if (sim) return std::memcmp(p, expected.data(), expected.size()) == 0;
    std::vector<std::uint8_t> back(expected.size());
    const Status status = device->copy_to_host(back.data(), p, back.size());
    EXPECT_TRUE(status.ok()) << status.to_string();
    return status.ok() && back == expected;
  }

  // Whether `p`, returned by acquire(id, kDefaultStream), holds unit `id`'s bytes.
  bool staged_matches(int id, const void* p) const { return device_matches(p, host[id]); }

  // Acquires, checks and releases each unit of `order`; returns how many came back wrong.
  // `during` runs while the unit is held.
  int run(const std::vector<int>& order, const std::function<void(int, const char*)>& during = {}) {
    int wrong = 0;
    for (int id : order) {
      const char* p = static_cast<const char*>(scheduler->acquire(id, kDefaultStream));
      lo = std::min(lo, p);
      hi = std::max(hi, p + host[id].size());
      if (!staged_matches(id, p)) ++wrong;
      if (during) during(id, p);
      scheduler->release(id, kDefaultStream);
    }
    return wrong;
  }

  std::vector<int> identity() const {
    std::vector<int> order(host.size());
    std::iota(order.begin(), order.end(), 0);
    return order;
  }

  std::unique_ptr<Device> device;
  bool sim = true;  ///< the simulation backend (device memory is host memory)
  std::vector<std::vector<std::uint8_t>> host;
  std::vector<void*> pinned;  ///< host[i]'s bytes in pinned memory; what the scheduler copies
  std::size_t largest = 0;
  std::unique_ptr<CopyScheduler> scheduler;
  const char* lo = reinterpret_cast<const char*>(std::numeric_limits<std::uintptr_t>::max());
  const char* hi = nullptr;
};

SchedulerOptions window(std::size_t window_bytes) {
  SchedulerOptions options;
  options.window_bytes = window_bytes;
  return options;
}

class CopySchedulerTest : public BackendTest {
 protected:
  // A rig on this test's backend. On the simulation, copies run at `bytes_per_second` (0: as
  // fast as memcpy) into a card of `capacity` bytes; CUDA runs at the card's speed and size.
  std::unique_ptr<Rig> make_rig(int units, std::size_t min_bytes, std::size_t max_bytes,
                                const SchedulerOptions& options, double bytes_per_second = 400e6,
                                std::int64_t capacity = std::int64_t{64} << 20) {
    SimDeviceOptions sim_options;
    sim_options.capacity_bytes = capacity;
    sim_options.copy_bytes_per_second = bytes_per_second;
    std::unique_ptr<Device> device = open_device(sim_options);
    if (device == nullptr) throw Error(Code::kUnavailable, "the backend's device did not open");
    return std::make_unique<Rig>(std::move(device), units, min_bytes, max_bytes, options);
  }
};

TEST_P(CopySchedulerTest, EveryAcquireIsCorrectAndPrefetchHitsAfterTheFirstPass) {
  auto rig = make_rig(24, 64 << 10, 256 << 10, window(768 << 10));
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  EXPECT_EQ(rig->scheduler->unit_count(), 24u);
  const auto order = rig->identity();
  EXPECT_EQ(rig->run(order), 0);  // learning pass: everything on demand
  SchedulerStats first = rig->scheduler->stats();
  EXPECT_EQ(first.on_demand, 24);
  EXPECT_EQ(first.prefetch_hits, 0);
  // The caller waited for on-demand copies: measurable at the simulation's 400 MB/s; a card's
  // copy of a few hundred KiB may land before the wait is recorded.
  if (sim()) {
    EXPECT_GT(first.wait_ms, 0.0);
  }

  rig->scheduler->reset_stats();
  for (int pass = 0; pass < 5; ++pass) EXPECT_EQ(rig->run(order), 0) << "pass " << pass;
  const SchedulerStats st = rig->scheduler->stats();
  EXPECT_EQ(st.acquires, 5 * 24);
  EXPECT_EQ(st.trace_length, 24u);
  EXPECT_LE(st.on_demand, 1);  // the acquire that closes the trace
  EXPECT_GE(st.prefetch_hits, st.acquires - 1);
  EXPECT_EQ(st.order_misses, 0);
  EXPECT_EQ(st.relearns, 0);
  EXPECT_GT(st.copy_ms, 0.0);
  EXPECT_GT(st.bytes_copied, 0);
}

TEST_P(CopySchedulerTest, TimelineListsTheTraceTimedAgainstTheMark) {
  auto rig = make_rig(12, 64 << 10, 128 << 10, window(512 << 10));
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  EXPECT_TRUE(rig->scheduler->timeline().empty());  // no trace yet
  const auto order = rig->identity();
  ASSERT_EQ(rig->run(order), 0);
  ASSERT_EQ(rig->run(order), 0);
  rig->scheduler->mark(kDefaultStream);
  ASSERT_EQ(rig->run(order), 0);
  rig->scheduler->drain();
  rig->device->synchronize_stream(kDefaultStream);  // the waits' events too (see mark())
  const std::vector<UnitTiming> t = rig->scheduler->timeline();
  ASSERT_EQ(t.size(), order.size());
  for (std::size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].unit, order[i]);
    EXPECT_EQ(t[i].bytes, static_cast<std::int64_t>(rig->host[order[i]].size()));
    EXPECT_GE(t[i].copy_end_ms, t[i].copy_start_ms) << i;
    EXPECT_GE(t[i].wait_end_ms, t[i].wait_start_ms) << i;
    // Every acquire of this pass came after the mark.
    EXPECT_GE(t[i].wait_start_ms, 0.0) << i;
  }
  // Acquires follow the trace.
  for (std::size_t i = 1; i < t.size(); ++i) EXPECT_GE(t[i].wait_start_ms, t[i - 1].wait_end_ms);
}

TEST_P(CopySchedulerTest, StagingAndDeviceStayWithinTheirSizes) {
  auto rig = make_rig(30, 32 << 10, 300 << 10, window(600 << 10));
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  const std::size_t staging = rig->scheduler->staging_bytes();
  EXPECT_GE(staging, (600u << 10) + 2 * rig->largest);
  // The simulated arena holds the staging area alone; a card's driver figure holds far more.
  if (sim()) {
    EXPECT_EQ(rig->device->memory().used_bytes, static_cast<std::int64_t>(staging));
  }
  const auto order = rig->identity();
  for (int pass = 0; pass < 6; ++pass) ASSERT_EQ(rig->run(order), 0);
  EXPECT_LE(static_cast<std::size_t>(rig->hi - rig->lo), staging);
  if (sim()) {
    EXPECT_EQ(rig->device->memory().used_bytes, static_cast<std::int64_t>(staging));
  }
  EXPECT_LE(rig->device->memory().used_bytes, rig->device->memory().total_bytes);
  EXPECT_EQ(rig->scheduler->stats().staging_bytes, static_cast<std::int64_t>(staging));
}

TEST_P(CopySchedulerTest, StagingThatDoesNotFitTheDeviceFailsNamingTheSize) {
  // 8 MiB on a simulated 4 MiB card; 1 PiB on a real one (no card has it).
  SchedulerOptions options;
  options.staging_bytes = sim() ? std::size_t{8} << 20 : std::size_t{1} << 50;
  auto rig = make_rig(4, 1 << 10, 4 << 10, options, 0.0, /*capacity=*/std::int64_t{4} << 20);
  Status status = rig->scheduler->finalize();
  EXPECT_EQ(status.code(), Code::kResourceExhausted);
  EXPECT_NE(status.message().find(std::to_string(options.staging_bytes)), std::string::npos)
      << status.message();
}

TEST_P(CopySchedulerTest, StagingSmallerThanTheLargestUnitIsRejected) {
  SchedulerOptions options;
  options.staging_bytes = 4096;
  auto rig = make_rig(3, 10000, 20000, options, 0.0);
  EXPECT_EQ(rig->scheduler->finalize().code(), Code::kInvalidArgument);
}

TEST_P(CopySchedulerTest, WindowBoundsBytesInFlight) {
  const std::size_t unit = 128 << 10;
  auto rig = make_rig(20, unit / 2, unit, window(3 * unit));
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  const auto order = rig->identity();
  for (int pass = 0; pass < 5; ++pass) ASSERT_EQ(rig->run(order), 0);
  const SchedulerStats st = rig->scheduler->stats();
  EXPECT_LE(st.peak_in_flight_bytes, static_cast<std::int64_t>(3 * unit + rig->largest));
  EXPECT_GT(st.peak_in_flight_bytes, static_cast<std::int64_t>(unit));  // it did prefetch
  EXPECT_GT(st.prefetch_hits, 3 * 20);
}

TEST_P(CopySchedulerTest, AcquiredRegionIsNeverOverwritten) {
  auto rig = make_rig(16, 64 << 10, 192 << 10, window(400 << 10));
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  const auto order = rig->identity();
  for (int pass = 0; pass < 3; ++pass) ASSERT_EQ(rig->run(order), 0);

  // Hold unit 0 while the rest of the trace cycles through the ring several times.
  const char* held = static_cast<const char*>(rig->scheduler->acquire(0, kDefaultStream));
  const std::size_t held_bytes = rig->host[0].size();
  ASSERT_TRUE(rig->staged_matches(0, held));
  std::vector<int> others(order.begin() + 1, order.end());
  int overlaps = 0;
  for (int round = 0; round < 4; ++round) {
    EXPECT_EQ(rig->run(others,
                       [&](int id, const char* p) {
                         const char* end = p + rig->host[id].size();
                         if (p < held + held_bytes && held < end) ++overlaps;
                       }),
              0);
    rig->device->synchronize_stream(kDefaultStream);
    ASSERT_TRUE(rig->staged_matches(0, held)) << "round " << round;
  }
  EXPECT_EQ(overlaps, 0);
  // Let in-flight prefetches land, then check once more before releasing.
  rig->scheduler->drain();
  EXPECT_TRUE(rig->staged_matches(0, held));
  rig->scheduler->release(0, kDefaultStream);
  for (int pass = 0; pass < 2; ++pass) EXPECT_EQ(rig->run(order), 0);
}

// Runs `order` until the scheduler has settled on it, then checks a clean steady state.
void expect_settles(Rig* rig, const std::vector<int>& order) {
  for (int pass = 0; pass < 8; ++pass) ASSERT_EQ(rig->run(order), 0) << "pass " << pass;
  rig->scheduler->reset_stats();
  for (int pass = 0; pass < 3; ++pass) ASSERT_EQ(rig->run(order), 0);
  const SchedulerStats st = rig->scheduler->stats();
  EXPECT_EQ(st.order_misses, 0);
  EXPECT_EQ(st.on_demand, 0);
  EXPECT_EQ(st.prefetch_hits, st.acquires);
}

class ChangedOrder : public CopySchedulerTest {
 protected:
  void SetUp() override {
    CopySchedulerTest::SetUp();
    if (IsSkipped()) return;
    rig_ = make_rig(20, 48 << 10, 160 << 10, window(500 << 10));
    ASSERT_TRUE(rig_->scheduler->finalize().ok());
    base_ = rig_->identity();
    for (int pass = 0; pass < 3; ++pass) ASSERT_EQ(rig_->run(base_), 0);
    ASSERT_EQ(rig_->scheduler->stats().relearns, 0);
  }
  std::unique_ptr<Rig> rig_;
  std::vector<int> base_;
};

TEST_P(ChangedOrder, SwappedUnitsStayCorrectAndRelearn) {
  std::vector<int> order = base_;
  std::swap(order[6], order[7]);
  rig_->scheduler->reset_stats();
  for (int pass = 0; pass < 2; ++pass) ASSERT_EQ(rig_->run(order), 0);
  const SchedulerStats st = rig_->scheduler->stats();
  EXPECT_GT(st.order_misses, 0);
  EXPECT_GE(st.relearns, 1);
  expect_settles(rig_.get(), order);
}

TEST_P(ChangedOrder, SkippedUnitStaysCorrectAndRelearns) {
  std::vector<int> order = base_;
  order.erase(order.begin() + 9);
  rig_->scheduler->reset_stats();
  for (int pass = 0; pass < 5; ++pass) ASSERT_EQ(rig_->run(order), 0);
  const SchedulerStats st = rig_->scheduler->stats();
  EXPECT_GT(st.order_misses, 0);
  EXPECT_GE(st.relearns, 1);
  expect_settles(rig_.get(), order);
}

TEST_P(ChangedOrder, NewOrderStaysCorrectAndRelearns) {
  std::vector<int> order = base_;
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  rig_->scheduler->reset_stats();
  for (int pass = 0; pass < 3; ++pass) ASSERT_EQ(rig_->run(order), 0);
  const SchedulerStats st = rig_->scheduler->stats();
  EXPECT_GT(st.order_misses, 0);
  EXPECT_GE(st.relearns, 1);
  expect_settles(rig_.get(), order);
  EXPECT_EQ(rig_->scheduler->stats().trace_length, order.size());
}

TEST_P(ChangedOrder, RepeatedUnitWithinAStepIsServedCorrectly) {
  // Unit 3 runs twice per step (a shared layer); correctness first, then no misses once learned.
  std::vector<int> order = base_;
  order.insert(order.begin() + 12, 3);
  for (int pass = 0; pass < 10; ++pass) ASSERT_EQ(rig_->run(order), 0);
  rig_->scheduler->reset_stats();
  for (int pass = 0; pass < 3; ++pass) ASSERT_EQ(rig_->run(order), 0);
  EXPECT_EQ(rig_->scheduler->stats().order_misses, 0);
}

TEST_P(ChangedOrder, ExtraUnitOutsideTheTraceIsServedOnDemand) {
  std::vector<int> order = base_;
  order.erase(order.begin() + 15);  // 15 now appears only once every few steps
  rig_->scheduler->reset_stats();
  ASSERT_EQ(rig_->run(order), 0);
  ASSERT_EQ(rig_->run({15}), 0);
  ASSERT_EQ(rig_->run(base_), 0);
}

// Random perturbations of a base order, with drains in between: every acquire must be correct.
TEST_P(CopySchedulerTest, RandomPerturbationsStayCorrect) {
  for (std::size_t window_bytes : {std::size_t{100} << 10, std::size_t{1} << 20}) {
    auto rig = make_rig(18, 8 << 10, 120 << 10, window(window_bytes), 2e9);
    ASSERT_TRUE(rig->scheduler->finalize().ok());
    std::mt19937 rng(static_cast<unsigned>(window_bytes));
    std::vector<int> base = rig->identity();
    int wrong = 0;
    for (int step = 0; step < 120; ++step) {
      std::vector<int> order = base;
      switch (rng() % 8) {
        case 0:
          std::swap(order[rng() % order.size()], order[rng() % order.size()]);
          break;
        case 1:
          order.erase(order.begin() + rng() % order.size());
          break;
        case 2:
          order.insert(order.begin() + rng() % order.size(), rng() % 18);
          break;
        case 3:
          std::shuffle(order.begin(), order.end(), rng);
          break;
        case 4:
          base = order;
          std::shuffle(base.begin(), base.end(), rng);
          break;
        default:
          break;
      }
      // Units may repeat within a step; acquire/release them one at a time.
      wrong += rig->run(order);
      if (rng() % 16 == 0) rig->scheduler->drain();
    }
    EXPECT_EQ(wrong, 0);
    EXPECT_LE(static_cast<std::size_t>(rig->hi - rig->lo), rig->scheduler->staging_bytes());
  }
}

TEST_P(CopySchedulerTest, DrainForgetsPrefetchedData) {
  auto rig = make_rig(12, 64 << 10, 128 << 10, window(512 << 10));
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  const auto order = rig->identity();
  for (int pass = 0; pass < 3; ++pass) ASSERT_EQ(rig->run(order), 0);
  ASSERT_EQ(rig->run({0, 1, 2}), 0);  // prefetch of 3, 4, ... is now in flight
  rig->scheduler->drain();
  const SchedulerStats before = rig->scheduler->stats();
  ASSERT_EQ(rig->run({3}), 0);
  EXPECT_EQ(rig->scheduler->stats().on_demand, before.on_demand + 1);
  std::vector<int> rest(order.begin() + 4, order.end());
  ASSERT_EQ(rig->run(rest), 0);
  for (int pass = 0; pass < 2; ++pass) ASSERT_EQ(rig->run(order), 0);
}

TEST_P(CopySchedulerTest, WithoutASideStreamCopiesOnTheComputeStream) {
  SchedulerOptions options = window(256 << 10);
  options.use_side_stream = false;
  auto rig = make_rig(10, 32 << 10, 96 << 10, options);
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  const auto order = rig->identity();
  for (int pass = 0; pass < 4; ++pass) ASSERT_EQ(rig->run(order), 0);
  const SchedulerStats st = rig->scheduler->stats();
  EXPECT_EQ(st.acquires, 40);
  EXPECT_GT(st.on_demand, 0);
  EXPECT_EQ(st.on_demand + st.prefetch_hits, st.acquires);
}

TEST_P(CopySchedulerTest, MisuseIsReported) {
  auto rig = make_rig(3, 1000, 2000, window(64 << 10), 0.0);
  std::vector<std::uint8_t> extra(10);
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  EXPECT_THROW(rig->scheduler->add(extra.data(), extra.size(), false), Error);
  EXPECT_THROW(rig->scheduler->acquire(7, kDefaultStream), Error);
  EXPECT_THROW(rig->scheduler->release(1, kDefaultStream), Error);
  rig->scheduler->acquire(1, kDefaultStream);
  EXPECT_THROW(rig->scheduler->acquire(1, kDefaultStream), Error);
  rig->scheduler->release(1, kDefaultStream);
}

TEST_P(CopySchedulerTest, UntimedCopiesStillStream) {
  SchedulerOptions options = window(300 << 10);
  options.time_copies = false;
  auto rig = make_rig(15, 16 << 10, 100 << 10, options);
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  const auto order = rig->identity();
  for (int pass = 0; pass < 4; ++pass) ASSERT_EQ(rig->run(order), 0);
  const SchedulerStats st = rig->scheduler->stats();
  EXPECT_EQ(st.copy_ms, 0.0);
  EXPECT_EQ(st.wait_ms, 0.0);
  EXPECT_GE(st.prefetch_hits, 2 * 15);
}

// Compute on its own stream (on the simulation three times slower than the copies; on a card the
// device-to-device copies are fast, but the order is the same), so the copy stream runs ahead
// into regions the host released long before the compute stream reads them: each region must be
// overwritten only after its reads (the release events of Note [Staging ring]).
TEST_P(CopySchedulerTest, ReclaimWaitsForAnAsynchronousComputeStream) {
  auto rig = make_rig(24, 16 << 10, 64 << 10, window(256 << 10), 200e6);
  ASSERT_TRUE(rig->scheduler->finalize().ok());
  const Stream compute = rig->device->create_stream();
  std::vector<void*> out(rig->host.size(), nullptr);
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(rig->device->allocate(rig->host[i].size(), &out[i]).ok());
  }
  int wrong = 0;
  for (int pass = 0; pass < 4; ++pass) {
    for (const int id : rig->identity()) {
      const void* p = rig->scheduler->acquire(id, compute);
      for (int r = 0; r < 3; ++r) {
        ASSERT_TRUE(
            rig->device->copy_on_device_async(out[id], p, rig->host[id].size(), compute).ok());
      }
      rig->scheduler->release(id, compute);
    }
    rig->device->synchronize_stream(compute);
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (!rig->device_matches(out[i], rig->host[i])) ++wrong;
    }
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_GE(rig->scheduler->stats().prefetch_hits, 2 * 24);
  rig->scheduler.reset();  // waits for the last release on `compute`: before the stream goes
  for (void* o : out) rig->device->deallocate(o);
  rig->device->destroy_stream(compute);
}

INSTANTIATE_TEST_SUITE_P(Backends, CopySchedulerTest, kBackends, backend_name);
INSTANTIATE_TEST_SUITE_P(Backends, ChangedOrder, kBackends, backend_name);

}  // namespace
}  // namespace ddo::engine
