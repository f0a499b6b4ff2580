// CopyScheduler::Impl and the records it keeps (internal to ddo_engine). One object per
// scheduler; its member functions are defined by concept, one file each, so that each of the
// scheduler's three mechanisms reads on its own:
//
//   copy_scheduler.cpp    the public API, copies and prefetch, copy timing, teardown
//   staging_ring.cpp      the device staging area as a byte ring (Note [Staging ring])
//   trace_learner.cpp     the learned acquire order and the cursor over it (Note [Trace])
//   disk_tier_reader.cpp  the pinned host ring, its read-ahead and the reader threads
//                         (Note [Disk tier])
//
// The records below are shared by all of them; each file opens
// `using namespace scheduler_internal;`.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ddo/core/units.h"
#include "ddo/engine/copy_scheduler.h"

namespace ddo::engine {
namespace scheduler_internal {

enum class UnitState : std::uint8_t { kIdle, kInFlight, kAcquired, kCached };
enum class RegionState : std::uint8_t { kInFlight, kAcquired, kReleased, kFree };
// A host-ring region's read (Note [Disk tier]): kIdle no read (a free slot), kQueued waiting for a
// reader, kRunning being read, kDone the bytes have landed, kFailed the reader returned an error.
enum class JobState : std::uint8_t { kIdle, kQueued, kRunning, kDone, kFailed };

constexpr std::size_t kRingAlignment = 256;
// Positions a forward jump may pass before a still-in-flight unit counts as mispredicted.
constexpr std::int64_t kStaleGrace = 2;
constexpr std::int64_t kStaleSeq = std::numeric_limits<std::int64_t>::min() / 2;

using core::align_up;  // the one definition (ddo/core/units.h)

struct Unit {
  const char* host = nullptr;
  std::size_t bytes = 0;
  std::size_t ring_bytes = 0;
  bool pinned = false;
  bool in_trace = false;
  bool disk = false;   // added with add_from_reader: `host` points into the host ring when read
  int host_slot = -1;  // disk units: the host-ring region holding (or reading) its bytes, or -1
  UnitState state = UnitState::kIdle;
  std::size_t slot = 0;    // ring slot while state != kIdle
  std::size_t offset = 0;  // staging offset while state != kIdle
  std::uint64_t release_seq = 0;
  Event release = nullptr;
  // last_done completes when the latest copy has landed (the event acquires wait on): fast_done
  // (no timing) for an untimed copy, copy_dones[pair] for a timed one (Note [Copy timing]). Timed
  // copies alternate between two (start, done) pairs, so that the copy an acquire consumed keeps
  // its times (for timeline()) while the next cycle's prefetch records the other. Timing events
  // exist only with time_copies and are read lazily, before they are recorded again.
  Event copy_starts[2] = {nullptr, nullptr};
  Event copy_dones[2] = {nullptr, nullptr};
  Event fast_done = nullptr;
  Event last_done = nullptr;
  int pair = 0;                // the pair of the latest timed copy
  int consumed_pair = -1;      // the pair of the copy the latest acquire used; -1: untimed
  bool acquired_once = false;  // consumed_pair is meaningful
  bool wait_timed = false;     // the latest acquire's wait was timed (wait_start, wait_end)
  Event copy_done() const { return last_done; }
  bool last_copy_timed() const { return last_done != fast_done; }  // recorded copy_dones[pair]
  Event wait_start = nullptr;
  Event wait_end = nullptr;
  bool copy_timing_pending = false;
  bool wait_timing_pending = false;
};

struct Region {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  int unit = -1;
  RegionState state = RegionState::kFree;
  std::int64_t seq = kStaleSeq;  // trace position it was prefetched for
};

// A region of the pinned host ring (Note [Disk tier]); compute thread only.
struct HostRegion {
  std::size_t offset = 0;
  int unit = -1;                 // the unit whose bytes it holds or reads; -1 once dropped
  std::int64_t seq = kStaleSeq;  // trace position it serves; kStaleSeq: none (on demand, relearn)
  Event copy_event = nullptr;    // done once the latest device copy out of it has landed
};

// The read into a host-ring region, shared by the compute thread and the reader threads.
struct ReadJob {
  // Written under Impl::jobs_mu; the compute thread also reads it without the lock (acquire).
  std::atomic<JobState> state{JobState::kIdle};
  // Set by the compute thread before queueing (under jobs_mu), read by the reader that pops it.
  int unit = -1;
  char* dst = nullptr;
  std::size_t bytes = 0;
  Status status;  // written by whoever ran the read before `state` becomes kFailed
};

// Where `n` bytes fit in a byte ring of `capacity` whose live span runs from `tail` (oldest
// region) to `head` (end of the newest); `empty` when no region is live.
bool ring_gap(std::size_t capacity, bool empty, std::size_t tail, std::size_t head, std::size_t n,
              std::size_t* offset);

}  // namespace scheduler_internal

struct CopyScheduler::Impl {
  using Unit = scheduler_internal::Unit;
  using Region = scheduler_internal::Region;
  using HostRegion = scheduler_internal::HostRegion;
  using ReadJob = scheduler_internal::ReadJob;
  using JobState = scheduler_internal::JobState;

  Impl(Device& d, const SchedulerOptions& o)
      : device(d), options(o), timing(o.time_copies ? Timing::kFull : Timing::kOff) {}

  Device& device;
  const SchedulerOptions options;
  bool finalized = false;
  std::vector<Unit> units;
  std::size_t largest_ring_bytes = 0;

  char* staging = nullptr;
  std::size_t staging_bytes = 0;
  std::size_t window_bytes = 0;
  Stream copy_stream = kDefaultStream;

  // The ring: a circular array of regions, oldest at ring_first. See Note [Staging ring].
  std::vector<Region> ring;
  std::size_t ring_first = 0;
  std::size_t ring_count = 0;
  std::size_t head = 0;  // staging offset where the newest region ends

  // Release ordering (see Note [Staging ring]).
  std::uint64_t release_counter = 0;
  std::uint64_t copy_waited_release_seq = 0;
  std::uint64_t pending_wait_seq = 0;
  int pending_wait_unit = -1;
  int last_released_unit = -1;

  // Trace (see Note [Trace]).
  std::vector<int> trace;
  std::size_t max_trace = 0;
  bool learning = true;
  std::int64_t cursor_seq = 0;    // position of the next expected acquire
  std::int64_t prefetch_seq = 0;  // next position to prefetch
  std::int64_t cycle = 0;
  std::int64_t misses_in_cycle = 0;
  std::int64_t miss_limit = 1;
  int cycles_with_misses = 0;

  Event mark = nullptr;          // timeline reference (time_copies only)
  Timing timing = Timing::kOff;  // Note [Copy timing]
  std::uint32_t copy_samples = 0;
  std::uint32_t wait_samples = 0;

  std::int64_t in_flight_bytes = 0;  // units copied for, not yet acquired
  std::int64_t acquired_bytes = 0;
  SchedulerStats stats;

  // Disk tier (Note [Disk tier]). Compute thread only, unless a comment says otherwise.
  std::vector<UnitReader> readers;  // by unit id, empty for host units; fixed after finalize()
  std::size_t disk_units = 0;
  std::size_t largest_disk_ring_bytes = 0;
  std::size_t disk_ring_total = 0;  // ring bytes of all disk units
  bool has_disk = false;            // finalized with disk units: the hooks below run
  char* host_ring = nullptr;        // pinned
  std::size_t host_ring_bytes = 0;
  std::vector<HostRegion> hring;  // circular, oldest at hring_first
  std::size_t hring_first = 0;
  std::size_t hring_count = 0;
  std::size_t hring_head = 0;           // host-ring offset where the newest region ends
  std::unique_ptr<ReadJob[]> jobs;      // one per hring slot
  std::int64_t read_seq = 0;            // the read-ahead cursor
  bool prefetch_waits_on_read = false;  // the prefetch stopped at a disk unit: retry on release
  std::mutex jobs_mu;                   // the queue, stop_readers, job state transitions
  std::condition_variable queue_cv;     // a job was queued, or stop
  std::condition_variable done_cv;      // a job finished
  std::vector<int> queue;               // guarded by jobs_mu: circular, slots of queued jobs
  std::size_t queue_first = 0;          // guarded by jobs_mu
  std::size_t queue_count = 0;          // guarded by jobs_mu
  bool stop_readers = false;            // guarded by jobs_mu
  std::vector<std::thread> reader_threads;
  std::atomic<std::int64_t> disk_bytes_read{0};  // SUM, added to by whichever thread read
  std::int64_t disk_bytes_read_base = 0;         // disk_bytes_read at the last reset_stats()

  // --- the scheduler itself: copies, prefetch, timing (copy_scheduler.cpp) -------------------
  bool sample(std::uint32_t& count) const;
  void harvest_copy_timing(Unit& u);
  void harvest_wait_timing(Unit& u);
  void update_peak();
  bool issue_copy(int id, Stream stream, bool on_demand, std::int64_t seq);
  void prefetch();
  void create_events();
  void harvest_all();

  // --- staging ring (staging_ring.cpp, Note [Staging ring]) ----------------------------------
  Region& ring_at(std::size_t k) { return ring[(ring_first + k) % ring.size()]; }
  Region& front() { return ring[ring_first]; }
  Region& back() { return ring_at(ring_count - 1); }
  bool stale(const Region& r) const { return r.seq + scheduler_internal::kStaleGrace < cursor_seq; }
  void note_release_wait(int unit);
  void detach(Region& r, std::size_t slot);
  bool reclaimable(const Region& r, bool on_demand) const;
  bool pop_front(bool on_demand);
  bool pop_back();
  bool fits(std::size_t n, std::size_t* offset) const;
  bool allocate_region(std::size_t n, bool on_demand, std::size_t* offset);
  void drop_in_flight(int keep);

  // --- trace (trace_learner.cpp, Note [Trace]) ------------------------------------------------
  void start_relearn(int id);
  void learn(int id);
  void end_cycle();
  void set_cursor(std::int64_t seq);
  bool nearest(int id, std::int64_t pos, std::int64_t* distance) const;
  void observe(int id);

  // --- disk tier (disk_tier_reader.cpp, Note [Disk tier]) ------------------------------------
  std::size_t hslot(std::size_t k) const { return (hring_first + k) % hring.size(); }
  // Where the trace has been consumed up to: regions for earlier positions are no longer expected.
  std::int64_t consumed_seq() const { return std::max(prefetch_seq, cursor_seq); }
  bool expected(const HostRegion& r) const { return r.unit >= 0 && r.seq >= consumed_seq(); }
  JobState job_state(std::size_t slot) const {
    return jobs[slot].state.load(std::memory_order_acquire);
  }
  void link(std::size_t slot, int id, std::int64_t seq);
  void forget(std::size_t slot);
  bool take_queued(std::size_t slot, JobState to);
  void queue_read(std::size_t slot);
  void run_job(std::size_t slot, int unit, char* dst, std::size_t bytes);
  void wait_job(std::size_t slot);
  void reader_loop();
  Status size_disk_tier(std::size_t* ring_bytes, int* workers) const;
  Status open_disk_tier(std::size_t ring_bytes, int workers);
  void join_readers();
  bool pop_host_front(bool blocking);
  bool allocate_host_region(std::size_t n, bool blocking, std::size_t* slot);
  void read_ahead();
  bool disk_bytes_landed(int id);
  void read_on_demand(int id);
  void unexpect_host_regions();
  void drain_reads();
};

}  // namespace ddo::engine
