// CopyScheduler with disk-tier units (add_from_reader; Note [Disk tier] in disk_tier_reader.cpp).
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
  ASSERT_TRUE(r->scheduler->finalize().ok());
  const auto order = r->identity();
  ASSERT_EQ(r->run(order), 0);  // learning: every disk unit is read on demand
  SchedulerStats st = r->scheduler->stats();
  EXPECT_EQ(st.disk_waits, r->disk_count);
  ASSERT_EQ(r->run(order), 0);
  r->scheduler->reset_stats();
  // With the trace learned, each disk unit's read starts on a reader thread before the test
  // acquires it: the test waits for that event (a count, so a loaded machine only makes it take
  // longer; the deadline catches a scheduler that never reads ahead) and then counts that no
  // read ran on the test thread.
  auto read_off_thread = [&](int id) {
    return r->sources[id]->calls.load() - r->sources[id]->calls_here.load();
  };
  // seen[id]: the unit's off-thread reads when it was last acquired; the next read of it must
  // start after that and before the next acquire. Step 0 only takes the counts.
  std::vector<int> seen(order.size());
  int calls_here_before = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int step = 0; step < 5; ++step) {
    if (step == 1) {
      for (const auto& src : r->sources) calls_here_before += src->calls_here.load();
    }
    for (int id : order) {
      if (r->sources[id]->disk && step > 0) {
        while (read_off_thread(id) == seen[id] && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(microseconds(100));
        }
        ASSERT_GT(read_off_thread(id), seen[id])
            << "no read of disk unit " << id << " ran ahead in step " << step;
      }
      ASSERT_TRUE(r->step(id));
      seen[id] = read_off_thread(id);
    }
  }
  int calls_here = -calls_here_before;
  for (const auto& src : r->sources) calls_here += src->calls_here.load();
  EXPECT_EQ(calls_here, 0);  // every read ran on the reader threads
  st = r->scheduler->stats();
  EXPECT_EQ(st.acquires, 5 * o.units);
  EXPECT_EQ(st.prefetch_hits + st.on_demand, st.acquires);
  EXPECT_EQ(r->overlapping_reads_of_one_unit.load(), 0);
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
  // Queued reads were dropped: the running ones (40 ms each) were waited for, not all the queued
  // ones. The bound is a hang detector, far above what any load makes of two 40 ms reads.
  EXPECT_LT(took, std::chrono::seconds(60));
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
