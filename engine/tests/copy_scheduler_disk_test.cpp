// CopyScheduler with disk-tier units (add_from_reader; Note [Disk tier] in copy_scheduler.cpp).
// The readers here copy from an in-memory "file" after an optional delay and count what they do:
// how often each unit is read, on which thread, how many reads run at once, and the bytes read.
// Every acquire's staged bytes are read back with copy_to_host and compared with the unit's
// content. The cases run on the simulation device and on CUDA when a GPU is present; cases that
// need the simulation's knobs (a slow link, a pin limit, injected faults) run on it only.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ddo/core/units.h"
#include "ddo/engine/copy_scheduler.h"
#include "ddo/engine/sim_faults.h"

namespace ddo::engine {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// One unit: its content, and for a disk unit what its reader has done.
struct Source {
  std::vector<std::uint8_t> data;
  bool disk = false;
  std::atomic<int> calls{0};       // reads started
  std::atomic<int> calls_here{0};  // ... on the test thread (an acquire reading on demand)
  std::atomic<int> failures{0};    // reads that returned an error
  std::atomic<int> in_read{0};     // reads of this unit running now
  std::atomic<bool> always_fail{false};
  std::atomic<bool> fail_next_off_thread{false};  // the next read on a reader thread fails
};

struct DiskRigOptions {
  int units = 24;
  int disk_every = 2;  // units 0, k, 2k, ... are on disk
  std::size_t min_bytes = 16 << 10;
  std::size_t max_bytes = 64 << 10;
  SchedulerOptions scheduler;
  double bytes_per_second = 1e9;  // the simulated link
  std::int64_t pinnable_bytes = -1;
  std::shared_ptr<SimFaults> faults;
};

class DiskRig {
 public:
  // `backend` "sim" or "cuda" (the caller skips cuda without a GPU).
  DiskRig(const std::string& backend, const DiskRigOptions& o) {
    if (backend == "cuda") {
      const Status status = make_cuda_device({}, &device);
      EXPECT_TRUE(status.ok()) << status.to_string();
    } else {
      SimDeviceOptions sim;
      sim.capacity_bytes = std::int64_t{64} << 20;
      sim.copy_bytes_per_second = o.bytes_per_second;
      sim.pinnable_bytes = o.pinnable_bytes;
      device = o.faults ? make_sim_device(sim, o.faults) : make_sim_device(sim);
    }
    std::mt19937_64 rng(4321 + o.units);
    for (int i = 0; i < o.units; ++i) {
      auto src = std::make_unique<Source>();
      src->data.resize(o.min_bytes + rng() % (o.max_bytes - o.min_bytes + 1));
      for (auto& b : src->data) b = static_cast<std::uint8_t>(rng());
      src->disk = o.disk_every > 0 && i % o.disk_every == 0;
      if (src->disk) {
        largest_disk = std::max(largest_disk, src->data.size());
        disk_bytes += src->data.size();
        ++disk_count;
      }
      sources.push_back(std::move(src));
    }
    scheduler = make_scheduler(o.scheduler);
  }

  ~DiskRig() { scheduler.reset(); }  // before the device

  std::unique_ptr<CopyScheduler> make_scheduler(const SchedulerOptions& options) {
    auto s = std::make_unique<CopyScheduler>(*device, options);
    for (auto& src : sources) {
      Source* p = src.get();
      if (!p->disk) {
        s->add(p->data.data(), p->data.size(), /*pinned=*/true);
        continue;
      }
      s->add_from_reader(p->data.size(), [this, p](void* dst) { return read(*p, dst); });
    }
    return s;
  }

  // Reads back what acquire returned; true when it is the unit's content.
  bool staged_correctly(int id, const void* staged) {
    const std::vector<std::uint8_t>& want = sources[id]->data;
    std::vector<std::uint8_t> got(want.size());
    const Status status = device->copy_to_host(got.data(), staged, got.size());
    EXPECT_TRUE(status.ok()) << status.to_string();
    return got == want;
  }

  // Acquires, checks and releases each unit of `order`; returns how many came back wrong.
  // `compute` is slept while each unit is held (the op).
  int run(const std::vector<int>& order, microseconds compute = microseconds(0)) {
    int wrong = 0;
    for (int id : order) wrong += step(id, compute) ? 0 : 1;
    return wrong;
  }

  bool step(int id, microseconds compute = microseconds(0)) {
    const void* p = scheduler->acquire(id, kDefaultStream);
    const bool same = staged_correctly(id, p);
    if (compute.count() > 0) std::this_thread::sleep_for(compute);
    scheduler->release(id, kDefaultStream);
    return same;
  }

  std::vector<int> identity() const {
    std::vector<int> order(sources.size());
    std::iota(order.begin(), order.end(), 0);
    return order;
  }

  std::vector<int> disk_ids() const {
    std::vector<int> ids;
    for (std::size_t i = 0; i < sources.size(); ++i) {
      if (sources[i]->disk) ids.push_back(static_cast<int>(i));
    }
    return ids;
  }

  int total_calls() const {
    int n = 0;
    for (const auto& s : sources) n += s->calls.load();
    return n;
  }

  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Source>> sources;
  std::size_t largest_disk = 0;
  std::size_t disk_bytes = 0;
  int disk_count = 0;
  std::unique_ptr<CopyScheduler> scheduler;

  std::atomic<int> read_delay_us{0};
  std::atomic<int> reader_thread_delay_us{0};  // added for reads not on the test thread
  std::atomic<std::int64_t> bytes_read_ok{0};
  std::atomic<int> reads_running{0};
  std::atomic<int> overlapping_reads_of_one_unit{0};
  std::atomic<int> reads_into_memory_being_read{0};  // two running reads whose targets overlap
  const std::thread::id test_thread = std::this_thread::get_id();

 private:
  struct Span {
    const char* begin;
    const char* end;
  };

  // Registers [dst, dst + bytes) as being written; counts an overlap with another running read.
  void enter(const void* dst, std::size_t bytes) {
    const char* b = static_cast<const char*>(dst);
    std::lock_guard<std::mutex> lock(spans_mu_);
    for (const Span& s : spans_) {
      if (b < s.end && s.begin < b + bytes) ++reads_into_memory_being_read;
    }
    spans_.push_back({b, b + bytes});
  }
  void leave(const void* dst) {
    std::lock_guard<std::mutex> lock(spans_mu_);
    for (std::size_t i = 0; i < spans_.size(); ++i) {
      if (spans_[i].begin == dst) {
        spans_.erase(spans_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }
  }

  Status read(Source& src, void* dst) {
    if (src.in_read.fetch_add(1) != 0) ++overlapping_reads_of_one_unit;
    enter(dst, src.data.size());
    ++reads_running;
    ++src.calls;
    const bool here = std::this_thread::get_id() == test_thread;
    if (here) ++src.calls_here;
    int us = read_delay_us.load();
    if (!here) us += reader_thread_delay_us.load();
    if (us > 0) std::this_thread::sleep_for(microseconds(us));
    Status status;
    if (src.always_fail.load()) {
      status = Status(Code::kDataLoss, "checksum mismatch in shard 3 of the checkpoint");
    } else if (!here && src.fail_next_off_thread.exchange(false)) {
      status = Status(Code::kUnavailable, "read-ahead: EIO from the disk");
    } else {
      std::memcpy(dst, src.data.data(), src.data.size());
      bytes_read_ok += static_cast<std::int64_t>(src.data.size());
    }
    if (!status.ok()) ++src.failures;
    --reads_running;
    leave(dst);
    --src.in_read;
    return status;
  }

  std::mutex spans_mu_;
  std::vector<Span> spans_;  // guarded by spans_mu_: the targets of the running reads
};

SchedulerOptions window(std::size_t window_bytes) {
  SchedulerOptions options;
  options.window_bytes = window_bytes;
  return options;
}

// --- on every backend --------------------------------------------------------------------------

class DiskTier : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "cuda" && !cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  }
  std::unique_ptr<DiskRig> rig(const DiskRigOptions& o) {
    return std::make_unique<DiskRig>(GetParam(), o);
  }
};

TEST_P(DiskTier, MixedHostAndDiskUnitsAreExactOverManySteps) {
  DiskRigOptions o;
  o.units = 30;
  o.disk_every = 3;
  o.min_bytes = 8 << 10;
  o.max_bytes = 96 << 10;
  o.scheduler = window(256 << 10);
  auto r = rig(o);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  EXPECT_EQ(r->scheduler->unit_count(), 30u);
  EXPECT_EQ(r->scheduler->disk_unit_count(), 10u);
  const auto order = r->identity();
  for (int step = 0; step < 12; ++step) ASSERT_EQ(r->run(order), 0) << "step " << step;
  r->scheduler->drain();
  const SchedulerStats st = r->scheduler->stats();
  EXPECT_EQ(st.acquires, 12 * 30);
  EXPECT_EQ(st.disk_bytes_read, r->bytes_read_ok.load());
  // The ring (window + 2 x largest disk unit) cannot hold every disk unit: each is read per step.
  EXPECT_GE(st.disk_bytes_read, static_cast<std::int64_t>(12 * r->disk_bytes));
  EXPECT_EQ(r->overlapping_reads_of_one_unit.load(), 0);
  for (int id : r->disk_ids()) EXPECT_EQ(r->sources[id]->failures.load(), 0);
  for (int id = 0; id < o.units; ++id) {
    if (!r->sources[id]->disk) {
      EXPECT_EQ(r->sources[id]->calls.load(), 0);
    }
  }
}

TEST_P(DiskTier, ReadsRunAheadOnceTheTraceIsLearned) {
  DiskRigOptions o;
  o.units = 24;
  o.disk_every = 2;
  o.min_bytes = 32 << 10;
  o.max_bytes = 64 << 10;
  o.scheduler = window(256 << 10);
  auto r = rig(o);
  r->read_delay_us = 1000;  // a 1 ms read; two readers; each op takes 2 ms
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const auto order = r->identity();
  const microseconds op(2000);
  ASSERT_EQ(r->run(order, op), 0);  // learning: every disk unit is read on demand
  SchedulerStats st = r->scheduler->stats();
  EXPECT_EQ(st.disk_waits, r->disk_count);
  EXPECT_GT(st.disk_wait_ms, 0.0);
  ASSERT_EQ(r->run(order, op), 0);
  r->scheduler->reset_stats();
  const int calls_here_before = [&] {
    int n = 0;
    for (const auto& s : r->sources) n += s->calls_here.load();
    return n;
  }();
  for (int step = 0; step < 4; ++step) ASSERT_EQ(r->run(order, op), 0);
  st = r->scheduler->stats();
  // Reads land before their acquires: at most a stray one waits (a loaded machine, TSan).
  EXPECT_LE(st.disk_waits, 4 * r->disk_count / 10) << st.disk_waits << " of " << 4 * r->disk_count;
  EXPECT_LT(st.disk_wait_ms, 4 * r->disk_count * 1.0);
  int calls_here = -calls_here_before;
  for (const auto& s : r->sources) calls_here += s->calls_here.load();
  EXPECT_LE(calls_here, st.disk_waits);  // reads ran on the reader threads
  EXPECT_EQ(st.prefetch_hits + st.on_demand, st.acquires);
  EXPECT_GE(st.prefetch_hits, st.acquires * 8 / 10);
}

TEST_P(DiskTier, RingOfExactlyTwiceTheLargestDiskUnitStreams) {
  for (const std::size_t max_bytes : {std::size_t{48} << 10, (std::size_t{48} << 10) + 77}) {
    DiskRigOptions o;
    o.units = 16;
    o.disk_every = 2;
    o.min_bytes = 8 << 10;
    o.max_bytes = max_bytes;
    o.scheduler = window(128 << 10);
    // Slow copies: regions are still being copied out of when the read-ahead wants them back.
    o.bytes_per_second = 100e6;
    auto r = rig(o);
    SchedulerOptions options = o.scheduler;
    options.disk_ring_bytes = 2 * r->largest_disk;
    r->scheduler = r->make_scheduler(options);
    ASSERT_TRUE(r->scheduler->finalize().ok());
    EXPECT_EQ(r->scheduler->stats().disk_ring_bytes,
              static_cast<std::int64_t>(core::align_up(2 * r->largest_disk, 256)));
    const auto order = r->identity();
    for (int step = 0; step < 8; ++step) ASSERT_EQ(r->run(order), 0) << "step " << step;
    EXPECT_GE(r->scheduler->stats().disk_bytes_read, static_cast<std::int64_t>(8 * r->disk_bytes));
    EXPECT_GT(r->scheduler->stats().prefetch_hits, 0);
  }
}

TEST_P(DiskTier, RingHoldingEveryDiskUnitReadsEachOnlyOnce) {
  DiskRigOptions o;
  o.units = 12;
  o.disk_every = 2;
  o.scheduler = window(96 << 10);  // staging keeps no unit from one step to the next
  auto r = rig(o);
  std::size_t all_disk = 0;
  for (int id : r->disk_ids()) all_disk += core::align_up(r->sources[id]->data.size(), 256);
  SchedulerOptions options = o.scheduler;
  options.disk_ring_bytes = all_disk;
  r->scheduler = r->make_scheduler(options);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const auto order = r->identity();
  ASSERT_EQ(r->run(order), 0);
  EXPECT_EQ(r->total_calls(), r->disk_count);
  r->scheduler->reset_stats();
  for (int step = 0; step < 5; ++step) ASSERT_EQ(r->run(order), 0);
  // Bytes are bytes (Note [Disk tier]): a landed region serves every later copy of its unit.
  EXPECT_EQ(r->total_calls(), r->disk_count);
  const SchedulerStats st = r->scheduler->stats();
  EXPECT_EQ(st.disk_bytes_read, 0);
  EXPECT_EQ(st.disk_waits, 0);
  EXPECT_GE(st.bytes_copied, static_cast<std::int64_t>(4 * r->disk_bytes));  // copied each step
}

TEST_P(DiskTier, DefaultRingIsTheWindowPlusTwoLargestAtMostAllDiskUnits) {
  DiskRigOptions o;
  o.units = 12;
  o.disk_every = 2;
  o.scheduler = window(1 << 20);
  auto r = rig(o);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  std::size_t all_disk = 0;
  for (int id : r->disk_ids()) all_disk += core::align_up(r->sources[id]->data.size(), 256);
  EXPECT_EQ(r->scheduler->stats().disk_ring_bytes, static_cast<std::int64_t>(all_disk));
  o.scheduler = window(64 << 10);
  auto small = rig(o);
  ASSERT_TRUE(small->scheduler->finalize().ok());
  EXPECT_EQ(small->scheduler->stats().disk_ring_bytes,
            static_cast<std::int64_t>((64 << 10) + 2 * core::align_up(small->largest_disk, 256)));
  EXPECT_EQ(small->run(small->identity()), 0);
}

// An acquire that reads on demand into the oldest region while a read-ahead still writes it must
// wait for that read first (Note [Disk tier], reusing a region).
TEST_P(DiskTier, AnOnDemandReadNeverWritesWhereARunningReadWrites) {
  DiskRigOptions o;
  o.units = 8;
  o.disk_every = 1;  // all on disk
  o.min_bytes = 64 << 10;
  o.max_bytes = 64 << 10;
  o.scheduler = window(64 << 10);
  auto r = rig(o);
  SchedulerOptions options = o.scheduler;
  options.disk_ring_bytes = 2 * r->largest_disk;
  r->scheduler = r->make_scheduler(options);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const auto order = r->identity();
  for (int step = 0; step < 2; ++step) ASSERT_EQ(r->run(order), 0);
  r->reader_thread_delay_us = 50000;
  ASSERT_TRUE(r->step(0));  // the read-ahead of units 1 and 2 fills the ring; both run
  std::this_thread::sleep_for(milliseconds(5));
  ASSERT_TRUE(r->step(5));  // out of order: read here, into the ring the reads of 1 and 2 hold
  EXPECT_EQ(r->reads_into_memory_being_read.load(), 0);
  r->reader_thread_delay_us = 0;
  for (int step = 0; step < 2; ++step) ASSERT_EQ(r->run(order), 0);
  EXPECT_EQ(r->reads_into_memory_being_read.load(), 0);
  EXPECT_EQ(r->overlapping_reads_of_one_unit.load(), 0);
}

TEST_P(DiskTier, OrderMissesAndRelearnStayExact) {
  DiskRigOptions o;
  o.units = 20;
  o.disk_every = 2;
  o.min_bytes = 8 << 10;
  o.max_bytes = 48 << 10;
  o.scheduler = window(160 << 10);
  auto r = rig(o);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  std::vector<int> base = r->identity();
  for (int step = 0; step < 3; ++step) ASSERT_EQ(r->run(base), 0);
  ASSERT_EQ(r->scheduler->stats().relearns, 0);

  // A swap, then a new order: misses, a relearn, and a settled steady state on the new order.
  std::vector<int> swapped = base;
  std::swap(swapped[6], swapped[7]);
  for (int step = 0; step < 2; ++step) ASSERT_EQ(r->run(swapped), 0);
  std::vector<int> shuffled = base;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(11));
  r->scheduler->reset_stats();
  for (int step = 0; step < 8; ++step) ASSERT_EQ(r->run(shuffled), 0);
  SchedulerStats st = r->scheduler->stats();
  EXPECT_GT(st.order_misses, 0);
  EXPECT_GE(st.relearns, 1);
  r->scheduler->reset_stats();
  for (int step = 0; step < 3; ++step) ASSERT_EQ(r->run(shuffled), 0);
  st = r->scheduler->stats();
  EXPECT_EQ(st.order_misses, 0);
  EXPECT_EQ(st.relearns, 0);
  EXPECT_EQ(st.trace_length, shuffled.size());

  // Random perturbations with drains between steps: every acquire is exact.
  std::mt19937 rng(5);
  int wrong = 0;
  for (int step = 0; step < 60; ++step) {
    std::vector<int> order = base;
    switch (rng() % 6) {
      case 0:
        std::swap(order[rng() % order.size()], order[rng() % order.size()]);
        break;
      case 1:
        order.erase(order.begin() + rng() % order.size());
        break;
      case 2:
        order.insert(order.begin() + rng() % order.size(), rng() % o.units);
        break;
      case 3:
        std::shuffle(order.begin(), order.end(), rng);
        break;
      default:
        break;
    }
    wrong += r->run(order);
    if (rng() % 12 == 0) r->scheduler->drain();
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(r->overlapping_reads_of_one_unit.load(), 0);
}

TEST_P(DiskTier, AReadThatFailsInReadAheadIsReadAgainOnDemand) {
  DiskRigOptions o;
  o.units = 16;
  o.disk_every = 2;
  o.min_bytes = 32 << 10;
  o.max_bytes = 64 << 10;
  o.scheduler = window(128 << 10);  // staging cannot keep a unit from one step to the next
  auto r = rig(o);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const auto order = r->identity();
  ASSERT_EQ(r->run(order), 0);
  ASSERT_EQ(r->run(order), 0);
  const int victim = 8;
  ASSERT_TRUE(r->sources[victim]->disk);
  const int here_before = r->sources[victim]->calls_here.load();
  r->scheduler->reset_stats();
  // Its next read is a read-ahead on a reader thread (the step's first units are host units and
  // disk units that read ahead of it).
  r->sources[victim]->fail_next_off_thread = true;
  for (int step = 0; step < 3; ++step) ASSERT_EQ(r->run(order), 0) << "step " << step;
  EXPECT_EQ(r->sources[victim]->failures.load(), 1);
  EXPECT_FALSE(r->sources[victim]->fail_next_off_thread.load());
  // The acquire read it again on its own thread and counted the wait.
  EXPECT_GE(r->sources[victim]->calls_here.load(), here_before + 1);
  EXPECT_GE(r->scheduler->stats().disk_waits, 1);
}

TEST_P(DiskTier, AReaderThatAlwaysFailsThrowsAClearErrorAndTheOtherUnitsAreServed) {
  DiskRigOptions o;
  o.units = 12;
  o.disk_every = 3;
  o.min_bytes = 4096;
  o.max_bytes = 4096;
  o.scheduler = window(16 << 10);
  auto r = rig(o);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const int broken = 6;
  ASSERT_TRUE(r->sources[broken]->disk);
  r->sources[broken]->always_fail = true;
  int thrown = 0;
  int wrong = 0;
  for (int step = 0; step < 5; ++step) {
    for (int id : r->identity()) {
      if (id != broken) {
        wrong += r->step(id) ? 0 : 1;
        continue;
      }
      try {
        (void)r->scheduler->acquire(id, kDefaultStream);
        ADD_FAILURE() << "acquire of a unit whose reader fails returned";
        r->scheduler->release(id, kDefaultStream);
      } catch (const Error& e) {
        ++thrown;
        EXPECT_EQ(e.status().code(), Code::kDataLoss);
        EXPECT_TRUE(contains(e.what(), "disk-tier unit 6 (4096 bytes)")) << e.what();
        EXPECT_TRUE(contains(e.what(), "checksum mismatch in shard 3")) << e.what();
      }
    }
  }
  EXPECT_EQ(thrown, 5);
  EXPECT_EQ(wrong, 0);
  // The failed unit was never left acquired.
  EXPECT_THROW(r->scheduler->release(broken, kDefaultStream), Error);
  r->sources[broken]->always_fail = false;  // the disk is back: the unit streams again
  for (int step = 0; step < 2; ++step) EXPECT_EQ(r->run(r->identity()), 0);
}

TEST_P(DiskTier, DrainMidStepWaitsForReadsAndDropsTheirData) {
  DiskRigOptions o;
  o.units = 20;
  o.disk_every = 2;
  o.scheduler = window(192 << 10);
  auto r = rig(o);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const auto order = r->identity();
  for (int step = 0; step < 2; ++step) ASSERT_EQ(r->run(order), 0);
  r->read_delay_us = 3000;
  for (int id = 0; id < 7; ++id) ASSERT_TRUE(r->step(id));  // reads ahead are queued or running
  r->scheduler->drain();
  EXPECT_EQ(r->reads_running.load(), 0);  // no read runs into the ring after drain()
  const SchedulerStats before = r->scheduler->stats();
  EXPECT_EQ(before.disk_bytes_read, r->bytes_read_ok.load());
  // Unit 8 had been read ahead (it is in the window of the step so far); drain() dropped that
  // data, so it is read once more, and its acquire comes before that read could land.
  r->read_delay_us = 20000;
  const int calls = r->sources[8]->calls.load();
  ASSERT_TRUE(r->step(7));
  ASSERT_TRUE(r->step(8));
  EXPECT_EQ(r->sources[8]->calls.load(), calls + 1);
  EXPECT_EQ(r->scheduler->stats().disk_waits, before.disk_waits + 1);
  r->read_delay_us = 0;
  std::vector<int> rest(order.begin() + 9, order.end());
  ASSERT_EQ(r->run(rest), 0);
  for (int step = 0; step < 2; ++step) ASSERT_EQ(r->run(order), 0);
}

TEST_P(DiskTier, DestructionWithReadsInFlightDoesNotHang) {
  DiskRigOptions o;
  o.units = 16;
  o.disk_every = 2;
  o.scheduler = window(128 << 10);
  auto r = rig(o);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const auto order = r->identity();
  for (int step = 0; step < 2; ++step) ASSERT_EQ(r->run(order), 0);
  r->read_delay_us = 40000;
  ASSERT_TRUE(r->step(0));  // reads of the next disk units are queued; two are running
  const auto start = std::chrono::steady_clock::now();
  r->scheduler.reset();
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r->reads_running.load(), 0);  // running reads finished before the ring went
  // Queued reads were dropped: at most the running ones (40 ms each) were waited for.
  EXPECT_LT(took, milliseconds(2000));
}

TEST_P(DiskTier, StatsCountReadsAndWaits) {
  DiskRigOptions o;
  o.units = 10;
  o.disk_every = 2;
  o.scheduler = window(96 << 10);
  auto r = rig(o);
  SchedulerOptions options = o.scheduler;
  options.disk_ring_bytes = 3 * r->largest_disk;
  options.disk_read_workers = 3;
  r->scheduler = r->make_scheduler(options);
  ASSERT_TRUE(r->scheduler->finalize().ok());
  SchedulerStats st = r->scheduler->stats();
  const auto ring = static_cast<std::int64_t>(core::align_up(3 * r->largest_disk, 256));
  EXPECT_EQ(st.disk_ring_bytes, ring);
  EXPECT_EQ(st.disk_bytes_read, 0);
  EXPECT_EQ(st.disk_waits, 0);
  const auto order = r->identity();
  ASSERT_EQ(r->run(order), 0);
  st = r->scheduler->stats();
  EXPECT_EQ(st.disk_bytes_read, static_cast<std::int64_t>(r->disk_bytes));  // one read each
  EXPECT_EQ(st.disk_waits, r->disk_count);
  EXPECT_GT(st.disk_wait_ms, 0.0);
  for (int step = 0; step < 3; ++step) ASSERT_EQ(r->run(order), 0);
  r->scheduler->drain();  // no read lands after this: the counts are final
  EXPECT_EQ(r->scheduler->stats().disk_bytes_read, r->bytes_read_ok.load());
  r->scheduler->reset_stats();
  st = r->scheduler->stats();
  EXPECT_EQ(st.disk_bytes_read, 0);
  EXPECT_EQ(st.disk_waits, 0);
  EXPECT_EQ(st.disk_wait_ms, 0.0);
  EXPECT_EQ(st.disk_ring_bytes, ring);  // a size, not a counter
}

INSTANTIATE_TEST_SUITE_P(Backends, DiskTier, ::testing::Values("sim", "cuda"),
                         [](const auto& param_info) { return param_info.param; });

// --- simulation only ----------------------------------------------------------------------------

TEST(DiskTierSim, WithoutASideStreamReadsStillRunAhead) {
  DiskRigOptions o;
  o.units = 16;
  o.disk_every = 2;
  o.scheduler = window(128 << 10);
  o.scheduler.use_side_stream = false;
  DiskRig r("sim", o);
  r.read_delay_us = 500;
  ASSERT_TRUE(r.scheduler->finalize().ok());
  const auto order = r.identity();
  for (int step = 0; step < 2; ++step) ASSERT_EQ(r.run(order, microseconds(1500)), 0);
  r.scheduler->reset_stats();
  for (int step = 0; step < 3; ++step) ASSERT_EQ(r.run(order, microseconds(1500)), 0);
  const SchedulerStats st = r.scheduler->stats();
  EXPECT_EQ(st.on_demand, st.acquires);  // no device prefetch without a side stream
  EXPECT_LE(st.disk_waits, 3 * r.disk_count / 4);
}

TEST(DiskTierSim, SetupRejectsARingSmallerThanTheLargestDiskUnit) {
  DiskRigOptions o;
  o.units = 6;
  o.min_bytes = 10000;
  o.max_bytes = 20000;
  DiskRig r("sim", o);
  SchedulerOptions options;
  options.disk_ring_bytes = r.largest_disk - 300;
  r.scheduler = r.make_scheduler(options);
  const Status status = r.scheduler->finalize();
  EXPECT_EQ(status.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(status.message(), "cannot hold the largest disk-tier unit"))
      << status.message();
  options.disk_ring_bytes = 0;
  options.disk_read_workers = -1;
  r.scheduler = r.make_scheduler(options);
  EXPECT_EQ(r.scheduler->finalize().code(), Code::kInvalidArgument);
  EXPECT_EQ(r.device->memory().used_bytes, 0);
}

TEST(DiskTierSim, RingThatCannotBePinnedFailsNamingItsSizeWithoutLeaking) {
  DiskRigOptions o;
  o.units = 8;
  o.scheduler = window(64 << 10);
  o.pinnable_bytes = 1 << 10;  // far below any ring
  DiskRig r("sim", o);
  const Status status = r.scheduler->finalize();
  EXPECT_EQ(status.code(), Code::kResourceExhausted);
  EXPECT_TRUE(contains(status.message(), "-byte host ring")) << status.message();
  EXPECT_TRUE(contains(status.message(), "disk_ring_bytes")) << status.message();
  EXPECT_EQ(r.device->memory().used_bytes, 0);  // the staging area was given back

  // An injected pin fault: the same error; a second scheduler then streams.
  DiskRigOptions f = o;
  f.pinnable_bytes = -1;
  f.faults = std::make_shared<SimFaults>();
  DiskRig faulty("sim", f);
  f.faults->fail_nth(SimFault::kPin, 1);
  const Status injected = faulty.scheduler->finalize();
  EXPECT_EQ(injected.code(), Code::kResourceExhausted);
  EXPECT_TRUE(contains(injected.message(), "injected fault: pin call 1")) << injected.message();
  faulty.scheduler = faulty.make_scheduler(o.scheduler);
  ASSERT_TRUE(faulty.scheduler->finalize().ok());
  EXPECT_EQ(faulty.run(faulty.identity()), 0);
}

// Threads of this process on Linux; -1 elsewhere (under Wine /proc describes the Wine host).
int thread_count() {
#ifdef __linux__
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
#endif
  return -1;
}

TEST(DiskTierSim, HostUnitsOnlyStartNoReaderAndPinNoRing) {
  if (thread_count() < 0) GTEST_SKIP() << "threads are counted on Linux only";
  DiskRigOptions o;
  o.units = 8;
  o.disk_every = 0;  // host units only
  o.scheduler = window(64 << 10);
  o.pinnable_bytes = 0;  // any allocate_host would fail
  DiskRig r("sim", o);
  // ThreadSanitizer starts a background thread with the first thread the program creates.
  std::thread([] {}).join();
  const int before = thread_count();
  ASSERT_TRUE(r.scheduler->finalize().ok());
  EXPECT_EQ(thread_count(), before + 1);  // the simulated copy stream's worker only
  EXPECT_EQ(r.scheduler->disk_unit_count(), 0u);
  EXPECT_EQ(r.scheduler->stats().disk_ring_bytes, 0);
  EXPECT_EQ(r.run(r.identity()), 0);

  DiskRigOptions d = o;
  d.disk_every = 2;
  d.pinnable_bytes = -1;
  d.scheduler.disk_read_workers = 3;
  DiskRig disk("sim", d);
  const int before_disk = thread_count();
  ASSERT_TRUE(disk.scheduler->finalize().ok());
  EXPECT_EQ(thread_count(), before_disk + 1 + 3);
  disk.scheduler.reset();
  EXPECT_EQ(thread_count(), before_disk);  // joined
}

}  // namespace
}  // namespace ddo::engine
