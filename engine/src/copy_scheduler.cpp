#include "ddo/engine/copy_scheduler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <limits>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "ddo/core/units.h"
#include "ddo/core/working_set.h"

namespace ddo::engine {

// Note [Staging ring]
// ~~~~~~~~~~~~~~~~~~~
// The staging area is one device allocation used as a byte ring. Regions are handed out in
// allocation order at `head_` and reclaimed from the oldest end, which matches how a cyclic
// trace consumes them: units are copied in trace order, acquired in trace order and released
// right after their op. Each live region keeps its own state:
//
//   kInFlight  copied (or copying) for a unit that has not been acquired yet
//   kAcquired  handed out; a compute op may read it           -> never reclaimed
//   kReleased  its unit was released; the data stays usable until the space is needed
//   kFree      dropped (mispredicted prefetch, drain); only waits for the ring to reach it
//
// Reclaiming a kReleased region makes the copy stream wait on the unit's release event (recorded
// on the compute stream in release()), so the overwrite starts only after the last op that read
// it. Releases happen in order on one compute stream, so waiting on the newest release event
// covers every older one: an allocation issues at most one stream wait, and none when the copy
// stream already waited on a newer release. A prefetch never reclaims kInFlight data that the
// trace still expects; an on-demand copy (the op needs it now) may. Data that was never acquired
// is reclaimed without a wait: no op read it, and the next copy into it is ordered behind the
// first on the same copy stream.
//
// With staging = window + 2 x largest unit, one acquired unit plus a full window always leaves a
// contiguous gap for the next unit (the two free ends of the ring add up to at least window +
// largest >= 2 x largest). If an op holds so much that no gap exists, acquire() throws
// kResourceExhausted naming the sizes instead of handing out overlapping memory.
//
// Note [Trace]
// ~~~~~~~~~~~~
// The first pass records acquire order. The trace closes when its first unit is acquired again
// (one step is one cycle); a unit used twice in a step appears twice. Positions are kept as a
// global sequence number (cycle * length + index), so "how far ahead" and "already passed" are
// plain comparisons. An acquire that does not match the expected unit is served correctly (from
// staging when it is there, else on demand), counted in order_misses, and the position jumps to
// the nearest occurrence of that unit in the trace, forwards or backwards. Units skipped by a
// forward jump (beyond a grace of kStaleGrace positions, which keeps a swapped neighbour) are
// dropped so their bytes stop counting against the window. The trace is learned again when one
// cycle misses more than min(8, 10% of the trace) times, or when three cycles in a row miss at
// all (a small but permanent change such as a skipped unit). Learning again drops all prefetched
// data and copies on demand until the new trace closes.
//
// Note [Scheduler threading and host cost]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// acquire() and release() are called from one compute thread, with one compute stream; nothing
// is locked. Nothing allocates after finalize(): unit events, the ring slots and the trace
// buffer are preallocated. In the steady state an acquire that hits costs one stream wait plus,
// for each unit prefetched, one copy and one event record (and at most one copy-stream wait on a
// release); a release costs one event record. A timed copy or wait adds two records and a
// non-blocking query of the previous sample (Note [Copy timing]). Disk-tier units add reader
// threads, a job queue and a lock per disk read (Note [Disk tier]); a scheduler without them starts
// no thread and takes no lock, and host units pay one branch per acquire and per prefetched unit.
//
// Note [Copy timing]
// ~~~~~~~~~~~~~~~~~~
// Device-side timing of copies (copy_ms, the link's achieved GB/s) and of the compute stream's
// waits (wait_ms, timeline()) takes CUDA events with timing enabled: a (start, done) record
// around each copy and a (start, end) record around each acquire wait, plus a query of the last
// sample before its events are recorded again. Measured per op that is most of the scheduler's
// host cost beyond the one copy, the one wait and the one release record that streaming needs,
// and timing events are also slower to wait on than plain ones. So timing is a mode, switchable
// at any time from the compute thread:
//   kFull     every copy and wait; what calibration and timeline() need (the adapter sets it for
//             calibration and for mark_step()), and the start state with time_copies.
//   kSampled  one copy in kTimingSampleEvery and one wait in as many: copy_ms / timed_copy_bytes
//             still measures the link, wait_ms x waits / timed_waits estimates the stall, at a
//             sixteenth of the cost. The adapter's steady state.
//   kOff      nothing recorded.
// An untimed copy records the unit's fast_done event (no timing) instead of the pair's done
// event; acquires wait on whichever was recorded last (Unit::last_done), so switching modes never
// leaves an acquire waiting on a stale event. A pending sample survives untimed copies (its
// events are not recorded again) and is harvested later.

// Note [Disk tier]
// ~~~~~~~~~~~~~~~~
// A disk-tier unit (add_from_reader) has no host copy: each time it is needed its UnitReader
// reads it from the checkpoint into a region of a pinned host ring (one Device::allocate_host at
// finalize), and the device copy is issued from that region exactly like a host unit's. Two
// cursors walk the learned trace (Note [Trace]):
//
//   read_seq      the read-ahead cursor. For each disk unit it reaches it takes a region of the
//                 host ring (a FIFO byte ring like the staging ring) and queues a read job. It
//                 runs ahead of prefetch_seq, bounded by the ring: when the oldest region cannot
//                 be reclaimed yet it stops (backpressure: the reads wait for the GPU to consume).
//   prefetch_seq  the device prefetch cursor (Note [Staging ring]). At a disk unit whose read has
//                 landed it copies from the region; at one whose read has not, it stops, keeping
//                 trace order, and tries again on the next acquire or release. It never blocks.
//
// Who owns what. The compute thread owns all bookkeeping: the ring, each region's unit and trace
// position, both cursors; it allocates and reclaims regions only inside acquire(), release(),
// prefetch and drain(). A reader thread only pops a job (slot, unit, destination) from the queue,
// calls the unit's reader into the region it was given and publishes the result: the job's state
// (an atomic the compute thread polls without blocking; kDone is stored with release order after
// the bytes and the status are written) and, on failure, its Status. Readers never call the
// Device. The queue and the state transitions run under one mutex and a condition variable for
// "a job finished"; each job is a multi-millisecond disk read, so a lock per job costs nothing
// measurable. A region is linked to at most one unit and a unit to at most one region, and a
// region is reclaimed only when its read is over, so the same unit is never read twice at once.
//
// Reusing a region. Its bytes may be overwritten only when (1) no read is queued (cancelled under
// the mutex) or running into it, and (2) the device copy out of it has landed: the unit's
// copy-done event recorded right after that copy, polled with Device::event_done, or waited for
// with synchronize_event by an acquire that needs the room. All copies are on the copy stream (or
// all on the one compute stream without a side stream), so a later record of the same event
// completes no earlier than the copy it replaced: a region waits at worst a little longer. And
// (3) the trace no longer expects it: a region serves the trace position it was read for until
// the consuming cursor (the prefetch cursor, or the acquire cursor without prefetch) passes it.
//
// Bytes are bytes. A unit's data does not depend on the position it was read for, so a landed
// region serves every later copy of that unit (a prefetch, an on-demand acquire, the read-ahead's
// next visit, which just re-targets it) until the region is reclaimed. When the ring holds every
// disk unit, each is read once; when it does not, FIFO reclaim drops them in trace order and each
// is read once per step. A relearn marks every region unexpected without dropping its data (the
// next acquires may still use it); drain() cancels queued reads, waits for running ones and drops
// all host data.
//
// acquire() of a disk unit not staged on the device: a read still queued is taken back and run
// on the calling thread (instead of waiting behind the reads queued before it); a running one is
// waited for; one that failed in read-ahead is run again on the calling thread; a unit with no
// region takes one, reclaiming from the oldest end and blocking on a copy event or a running read
// when it must, dropping reads the trace still expects (the read-ahead cursor rewinds to read
// them again), and reads synchronously. Each of these counts one disk wait (disk_waits,
// disk_wait_ms). A read that fails in read-ahead is only remembered: the prefetch stops there and
// the acquire reads again, where a failure throws ddo::Error with the reader's code and message,
// naming the unit and its size; the unit stays unacquired and its next acquire reads again.
//
// What a stall costs. A read that has not landed when the prefetch cursor reaches it stops the
// device prefetch; the window drains as compute runs, and the acquire of that unit blocks the
// compute thread for the rest of the read plus an on-demand copy. The device then idles for as
// long as the reads fell behind: disk tier throughput is min(disk, link) once reads are ahead,
// and a step whose compute is shorter than its disk reads is disk-bound whatever the ring size.

namespace {

enum class UnitState : std::uint8_t { kIdle, kInFlight, kAcquired, kCached };
enum class RegionState : std::uint8_t { kInFlight, kAcquired, kReleased, kFree };
// A host-ring region's read (Note [Disk tier]): kIdle no read (a free slot), kQueued waiting for a
// reader, kRunning being read, kDone the bytes have landed, kFailed the reader returned an error.
enum class JobState : std::uint8_t { kIdle, kQueued, kRunning, kDone, kFailed };
using Clock = std::chrono::steady_clock;

constexpr std::size_t kRingAlignment = 256;
// Positions a forward jump may pass before a still-in-flight unit counts as mispredicted.
constexpr std::int64_t kStaleGrace = 2;
// Cycles in a row with at least one miss before the trace is learned again.
constexpr int kMissCyclesBeforeRelearn = 3;
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
              std::size_t* offset) {
  if (empty) {
    *offset = 0;
    return n <= capacity;
  }
  if (head > tail) {  // live span [tail, head): free at the end, then at the start
    if (n <= capacity - head) {
      *offset = head;
      return true;
    }
    if (n <= tail) {
      *offset = 0;
      return true;
    }
    return false;
  }
  if (n <= tail - head) {  // wrapped: free between head and tail
    *offset = head;
    return true;
  }
  return false;
}

// Runs `read` into `dst`, turning an exception into a status: a reader thread must not die.
Status run_reader(const UnitReader& read, int unit, void* dst) {
  try {
    return read(dst);
  } catch (const Error& e) {
    return e.status();
  } catch (const std::exception& e) {
    return Status(Code::kInternal,
                  internal::str_cat("the reader of disk-tier unit ", unit, " threw: ", e.what()));
  } catch (...) {
    return Status(Code::kInternal, internal::str_cat("the reader of disk-tier unit ", unit,
                                                     " threw something that is not an exception"));
  }
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace

struct CopyScheduler::Impl {
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

  // --- ring -----------------------------------------------------------------------------------
  Region& ring_at(std::size_t k) { return ring[(ring_first + k) % ring.size()]; }
  Region& front() { return ring[ring_first]; }
  Region& back() { return ring_at(ring_count - 1); }

  bool stale(const Region& r) const { return r.seq + kStaleGrace < cursor_seq; }

  void note_release_wait(int unit) {
    const std::uint64_t seq = units[unit].release_seq;
    if (seq > pending_wait_seq) {
      pending_wait_seq = seq;
      pending_wait_unit = unit;
    }
  }

  // Forgets region data: the unit no longer has it in staging.
  void detach(Region& r, std::size_t slot) {
    if (r.unit < 0) return;
    Unit& u = units[r.unit];
    if (r.state == RegionState::kReleased) note_release_wait(r.unit);
    if (u.state != UnitState::kIdle && u.slot == slot) {
      if (u.state == UnitState::kInFlight) in_flight_bytes -= static_cast<std::int64_t>(u.bytes);
      u.state = UnitState::kIdle;
    }
    r.unit = -1;
    r.state = RegionState::kFree;
  }

  bool reclaimable(const Region& r, bool on_demand) const {
    switch (r.state) {
      case RegionState::kAcquired:
        return false;
      case RegionState::kInFlight:
        return on_demand || stale(r);
      case RegionState::kReleased:
      case RegionState::kFree:
        return true;
    }
    return false;
  }

  bool pop_front(bool on_demand) {
    if (ring_count == 0 || !reclaimable(front(), on_demand)) return false;
    detach(front(), ring_first);
    ring_first = (ring_first + 1) % ring.size();
    if (--ring_count == 0) head = 0;
    return true;
  }

  // Only for on-demand copies blocked by an acquired region at the old end.
  bool pop_back() {
    if (ring_count == 0 || back().state == RegionState::kAcquired) return false;
    const std::size_t slot = (ring_first + ring_count - 1) % ring.size();
    detach(back(), slot);
    --ring_count;
    head = ring_count == 0 ? 0 : back().offset + back().bytes;
    return true;
  }

  bool fits(std::size_t n, std::size_t* offset) const {
    if (ring_count == ring.size()) return false;
    return ring_gap(staging_bytes, ring_count == 0, ring[ring_first].offset, head, n, offset);
  }

  bool allocate_region(std::size_t n, bool on_demand, std::size_t* offset) {
    for (;;) {
      if (fits(n, offset)) return true;
      if (pop_front(on_demand)) continue;
      if (on_demand && pop_back()) continue;
      return false;
    }
  }

  // --- copies ---------------------------------------------------------------------------------
  // Whether the next copy (or acquire wait) is timed; `count` is that kind's sample counter.
  bool sample(std::uint32_t& count) const {
    switch (timing) {
      case Timing::kOff:
        return false;
      case Timing::kFull:
        return true;
      case Timing::kSampled:
        return ++count % kTimingSampleEvery == 0;
    }
    return false;
  }

  void harvest_copy_timing(Unit& u) {
    if (!u.copy_timing_pending || !device.event_done(u.copy_dones[u.pair])) return;
    const float ms = device.elapsed_ms(u.copy_starts[u.pair], u.copy_dones[u.pair]);
    if (ms >= 0.0f) {
      stats.copy_ms += ms;
      ++stats.timed_copies;
      stats.timed_copy_bytes += static_cast<std::int64_t>(u.bytes);
    }
    u.copy_timing_pending = false;
  }

  void harvest_wait_timing(Unit& u) {
    if (!u.wait_timing_pending || !device.event_done(u.wait_end)) return;
    const float ms = device.elapsed_ms(u.wait_start, u.wait_end);
    if (ms >= 0.0f) {
      stats.wait_ms += ms;
      ++stats.timed_waits;
    }
    u.wait_timing_pending = false;
  }

  void update_peak() {
    stats.peak_in_flight_bytes =
        std::max(stats.peak_in_flight_bytes, in_flight_bytes + acquired_bytes);
  }

  // Note [A copy that fails]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~
  // The device may refuse a copy (a driver error; the simulation's SimFaults). The copy is
  // submitted before the ring and the unit record it, so a refused copy changes nothing: the
  // unit stays where it was and its region stays free. Before this order, a refused copy left the
  // unit marked in flight with no copy behind it, and its next acquire returned stale bytes.
  // An on-demand copy throws ddo::Error naming the unit, with the device's code and message: the
  // op that needs the weight cannot run. A prefetch that fails only stops prefetching for now: the
  // unit is copied on demand when it is acquired, where a failure that persists (CUDA errors are
  // sticky) is raised to the caller that needs it; prefetching never fails an acquire of another
  // unit, which would leave that unit acquired behind the caller's back.

  // Copies unit `id` into a new ring region on `stream`. A prefetch returns false when there is
  // no room without dropping data the trace still expects, or when the device refuses the copy;
  // an on-demand copy throws instead.
  bool issue_copy(int id, Stream stream, bool on_demand, std::int64_t seq) {
    Unit& u = units[id];
    std::size_t offset = 0;
    if (!allocate_region(u.ring_bytes, on_demand, &offset)) {
      if (!on_demand) return false;
      throw Error(Code::kResourceExhausted,
                  internal::str_cat(
                      "copy scheduler: no room in the ", staging_bytes, "-byte staging area for a ",
                      u.bytes, "-byte unit while ", acquired_bytes,
                      " bytes are acquired and not released; "
                      "release units sooner or raise staging_bytes to at least ",
                      acquired_bytes + 2 * static_cast<std::int64_t>(largest_ring_bytes)));
    }
    // See Note [Staging ring]: one wait on the newest release covers every reclaimed region.
    if (options.use_side_stream && pending_wait_seq > copy_waited_release_seq) {
      device.stream_wait_event(stream, units[pending_wait_unit].release);
      copy_waited_release_seq = pending_wait_seq;
    }
    const bool timed = sample(copy_samples);
    if (timed) {
      harvest_copy_timing(u);
      u.copy_timing_pending = false;  // a sample still running is dropped, never waited for
      u.pair ^= 1;
      device.record_event(u.copy_starts[u.pair], stream);
    }
    // Before the ring and the unit change: see Note [A copy that fails].
    const Status copied = device.copy_to_device_async(staging + offset, u.host, u.bytes, stream);
    if (!copied.ok()) {
      if (!on_demand) return false;
      throw Error(copied.code(),
                  internal::str_cat("copy scheduler: copying unit ", id, " (", u.bytes,
                                    " bytes) to the device failed: ", copied.message()));
    }
    const std::size_t slot = (ring_first + ring_count) % ring.size();
    ring[slot] = Region{offset, u.ring_bytes, id, RegionState::kInFlight, seq};
    ++ring_count;
    head = offset + u.ring_bytes;
    u.state = UnitState::kInFlight;
    u.slot = slot;
    u.offset = offset;
    in_flight_bytes += static_cast<std::int64_t>(u.bytes);
    // An untimed copy leaves a pending sample of the pair alone: its events are not recorded.
    u.last_done = timed ? u.copy_dones[u.pair] : u.fast_done;
    device.record_event(u.last_done, stream);
    if (timed) u.copy_timing_pending = true;
    stats.bytes_copied += static_cast<std::int64_t>(u.bytes);
    update_peak();
    return true;
  }

  void prefetch() {
    if (has_disk) {
      read_ahead();
      prefetch_waits_on_read = false;
    }
    if (learning || !options.use_side_stream || window_bytes == 0 || trace.empty()) return;
    const auto length = static_cast<std::int64_t>(trace.size());
    if (prefetch_seq < cursor_seq) prefetch_seq = cursor_seq;
    // Stop one short of a full cycle: that position is the unit being acquired now.
    while (prefetch_seq < cursor_seq + length - 1) {
      const int id = trace[static_cast<std::size_t>(prefetch_seq % length)];
      Unit& u = units[id];
      if (u.state == UnitState::kInFlight || u.state == UnitState::kAcquired) {
        ++prefetch_seq;
        continue;
      }
      if (in_flight_bytes + static_cast<std::int64_t>(u.bytes) >
          static_cast<std::int64_t>(window_bytes)) {
        break;
      }
      if (u.state == UnitState::kCached) {
        // Still in staging from its last use: protect it again instead of copying.
        Region& r = ring[u.slot];
        r.state = RegionState::kInFlight;
        r.seq = prefetch_seq;
        u.state = UnitState::kInFlight;
        in_flight_bytes += static_cast<std::int64_t>(u.bytes);
        ++prefetch_seq;
        continue;
      }
      if (u.disk && !disk_bytes_landed(id)) {
        prefetch_waits_on_read = true;  // keep trace order; see Note [Disk tier]
        break;
      }
      if (!issue_copy(id, copy_stream, /*on_demand=*/false, prefetch_seq)) break;
      if (u.disk) hring[static_cast<std::size_t>(u.host_slot)].copy_event = u.copy_done();
      ++prefetch_seq;
    }
  }

  // Drops every prefetched unit that has not been acquired, except `keep`.
  void drop_in_flight(int keep) {
    for (std::size_t k = 0; k < ring_count; ++k) {
      Region& r = ring_at(k);
      if (r.state == RegionState::kInFlight && r.unit != keep) {
        detach(r, (ring_first + k) % ring.size());
      }
    }
  }

  // --- disk tier (Note [Disk tier]) -------------------------------------------------------------
  std::size_t hslot(std::size_t k) const { return (hring_first + k) % hring.size(); }
  // Where the trace has been consumed up to: regions for earlier positions are no longer expected.
  std::int64_t consumed_seq() const { return std::max(prefetch_seq, cursor_seq); }
  bool expected(const HostRegion& r) const { return r.unit >= 0 && r.seq >= consumed_seq(); }
  JobState job_state(std::size_t slot) const {
    return jobs[slot].state.load(std::memory_order_acquire);
  }

  void link(std::size_t slot, int id, std::int64_t seq) {
    hring[slot].unit = id;
    hring[slot].seq = seq;
    units[id].host_slot = static_cast<int>(slot);
  }

  // The region no longer holds a unit's data; it stays in the ring until reclaimed.
  void forget(std::size_t slot) {
    HostRegion& r = hring[slot];
    if (r.unit >= 0) units[r.unit].host_slot = -1;
    r.unit = -1;
    r.seq = kStaleSeq;
  }

  // Takes a job still in the queue back, leaving it in `to`; false when a reader got to it first.
  bool take_queued(std::size_t slot, JobState to) {
    std::lock_guard<std::mutex> lock(jobs_mu);
    ReadJob& j = jobs[slot];
    if (j.state.load(std::memory_order_relaxed) != JobState::kQueued) return false;
    for (std::size_t k = 0; k < queue_count; ++k) {
      if (queue[(queue_first + k) % queue.size()] != static_cast<int>(slot)) continue;
      for (std::size_t m = k; m + 1 < queue_count; ++m) {
        queue[(queue_first + m) % queue.size()] = queue[(queue_first + m + 1) % queue.size()];
      }
      --queue_count;
      break;
    }
    j.state.store(to, std::memory_order_relaxed);
    return true;
  }

  void queue_read(std::size_t slot) {
    const HostRegion& r = hring[slot];
    {
      std::lock_guard<std::mutex> lock(jobs_mu);
      ReadJob& j = jobs[slot];
      j.unit = r.unit;
      j.dst = host_ring + r.offset;
      j.bytes = units[r.unit].bytes;
      j.status = Status();
      j.state.store(JobState::kQueued, std::memory_order_relaxed);
      queue[(queue_first + queue_count) % queue.size()] = static_cast<int>(slot);
      ++queue_count;
    }
    queue_cv.notify_one();
  }

  // Any thread: runs the read of job `slot` (state kRunning, owned by the caller) and publishes it.
  void run_job(std::size_t slot, int unit, char* dst, std::size_t bytes) {
    Status status = run_reader(readers[static_cast<std::size_t>(unit)], unit, dst);
    if (status.ok()) disk_bytes_read.fetch_add(static_cast<std::int64_t>(bytes));
    {
      std::lock_guard<std::mutex> lock(jobs_mu);
      ReadJob& j = jobs[slot];
      const bool ok = status.ok();
      j.status = std::move(status);
      j.state.store(ok ? JobState::kDone : JobState::kFailed, std::memory_order_release);
    }
    done_cv.notify_all();
  }

  void wait_job(std::size_t slot) {
    std::unique_lock<std::mutex> lock(jobs_mu);
    done_cv.wait(lock, [&] {
      const JobState st = jobs[slot].state.load(std::memory_order_relaxed);
      return st != JobState::kQueued && st != JobState::kRunning;
    });
  }

  void reader_loop() {
    for (;;) {
      std::size_t slot = 0;
      int unit = -1;
      char* dst = nullptr;
      std::size_t bytes = 0;
      {
        std::unique_lock<std::mutex> lock(jobs_mu);
        queue_cv.wait(lock, [&] { return stop_readers || queue_count > 0; });
        if (stop_readers) return;  // queued jobs are abandoned: the ring is going away
        slot = static_cast<std::size_t>(queue[queue_first]);
        queue_first = (queue_first + 1) % queue.size();
        --queue_count;
        ReadJob& j = jobs[slot];
        j.state.store(JobState::kRunning, std::memory_order_relaxed);
        unit = j.unit;
        dst = j.dst;
        bytes = j.bytes;
      }
      run_job(slot, unit, dst, bytes);
    }
  }

  // finalize(), disk tier: the pinned host ring's size (Note [Disk tier]; the rule is Note
  // [Disk ring] in ddo/core/working_set.h, over ring bytes like the staging area) and the number
  // of reader threads.
  Status size_disk_tier(std::size_t* ring_bytes, int* workers) const {
    if (options.disk_ring_bytes > 0) {
      *ring_bytes = align_up(options.disk_ring_bytes, kRingAlignment);
    } else {
      core::DiskRingRequest ring;
      ring.largest_unit_bytes = static_cast<std::int64_t>(largest_disk_ring_bytes);
      ring.disk_bytes = static_cast<std::int64_t>(disk_ring_total);
      ring.window_bytes = static_cast<std::int64_t>(window_bytes);
      *ring_bytes = static_cast<std::size_t>(core::size_disk_ring(ring));
    }
    if (*ring_bytes < largest_disk_ring_bytes) {
      return Status(
          Code::kInvalidArgument,
          internal::str_cat("disk_ring_bytes=", options.disk_ring_bytes,
                            " cannot hold the largest disk-tier unit (", largest_disk_ring_bytes,
                            " bytes); use at least ", 2 * largest_disk_ring_bytes,
                            " (2 x the largest disk unit) or 0 for the default"));
    }
    if (options.disk_read_workers < 0) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat("disk_read_workers=", options.disk_read_workers,
                                      " is negative; use 0 for the default (2) or a count"));
    }
    const int wanted = options.disk_read_workers > 0 ? options.disk_read_workers : 2;
    // One read per unit at a time (Note [Disk tier]): more threads than units would idle.
    *workers =
        static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(wanted), disk_units));
    return {};
  }

  // finalize(), disk tier: pins the host ring and starts the reader threads. On failure nothing
  // of the disk tier is left.
  Status open_disk_tier(std::size_t ring_bytes, int workers) {
    void* ptr = nullptr;
    Status status = device.allocate_host(ring_bytes, &ptr);
    if (!status.ok()) {
      return Status(Code::kResourceExhausted,
                    internal::str_cat("pinning the ", ring_bytes, "-byte host ring for ",
                                      disk_units, " disk-tier units (largest ",
                                      largest_disk_ring_bytes, " bytes) failed: ", status.message(),
                                      "; lower disk_ring_bytes (at least 2 x the largest disk "
                                      "unit) or free pinned memory"));
    }
    host_ring = static_cast<char*>(ptr);
    host_ring_bytes = ring_bytes;
    hring.assign(2 * disk_units + 16, HostRegion{});
    jobs = std::make_unique<ReadJob[]>(hring.size());
    queue.assign(hring.size(), -1);
    try {
      for (int k = 0; k < workers; ++k) reader_threads.emplace_back([this] { reader_loop(); });
    } catch (const std::system_error& e) {
      join_readers();
      device.deallocate_host(host_ring);
      host_ring = nullptr;
      return Status(Code::kResourceExhausted,
                    internal::str_cat("starting ", workers, " disk reader threads failed: ",
                                      e.what(), "; lower disk_read_workers"));
    }
    stats.disk_ring_bytes = static_cast<std::int64_t>(ring_bytes);
    has_disk = true;
    return {};
  }

  // finalize(): each unit's events (release, copy done; the timed ones with time_copies), the
  // mark and the side stream.
  void create_events() {
    for (Unit& u : units) {
      u.release = device.create_event(/*timing=*/false);
      u.fast_done = device.create_event(/*timing=*/false);
      u.last_done = u.fast_done;
      if (options.time_copies) {
        for (int k = 0; k < 2; ++k) {
          u.copy_starts[k] = device.create_event(true);
          u.copy_dones[k] = device.create_event(true);
        }
        u.wait_start = device.create_event(true);
        u.wait_end = device.create_event(true);
      }
    }
    if (options.time_copies) mark = device.create_event(true);
    if (options.use_side_stream) copy_stream = device.create_stream();
  }

  void join_readers() {
    {
      std::lock_guard<std::mutex> lock(jobs_mu);
      stop_readers = true;
    }
    queue_cv.notify_all();
    for (std::thread& t : reader_threads) t.join();  // a running read finishes first
    reader_threads.clear();
  }

  // Reclaims the oldest region. Without `blocking` only when that costs no wait and the trace no
  // longer expects it; with it, waits for its read and its copy and drops expected data.
  bool pop_host_front(bool blocking) {
    if (hring_count == 0) return false;
    const std::size_t slot = hring_first;
    HostRegion& r = hring[slot];
    if (expected(r)) {
      if (!blocking) return false;
      read_seq = std::min(read_seq, r.seq);  // the read-ahead reads it again
    }
    // A read taken back from the queue never lands: the unit has no bytes there any more.
    if (job_state(slot) == JobState::kQueued && take_queued(slot, JobState::kIdle)) forget(slot);
    if (job_state(slot) == JobState::kRunning) {
      if (!blocking) return false;
      wait_job(slot);
    }
    if (r.copy_event != nullptr && !device.event_done(r.copy_event)) {
      if (!blocking) return false;
      device.synchronize_event(r.copy_event);
    }
    forget(slot);
    r.copy_event = nullptr;
    jobs[slot].state.store(JobState::kIdle, std::memory_order_relaxed);
    hring_first = (hring_first + 1) % hring.size();
    if (--hring_count == 0) hring_head = 0;
    return true;
  }

  bool allocate_host_region(std::size_t n, bool blocking, std::size_t* slot) {
    for (;;) {
      std::size_t offset = 0;
      if (hring_count < hring.size() &&
          ring_gap(host_ring_bytes, hring_count == 0, hring[hring_first].offset, hring_head, n,
                   &offset)) {
        *slot = hslot(hring_count);
        hring[*slot] = HostRegion{offset, -1, kStaleSeq, nullptr};
        ++hring_count;
        hring_head = offset + n;
        return true;
      }
      if (!pop_host_front(blocking)) return false;
    }
  }

  // The read-ahead cursor: queues reads for the disk units ahead, as far as the ring allows.
  void read_ahead() {
    if (learning || trace.empty()) return;
    const auto length = static_cast<std::int64_t>(trace.size());
    const std::int64_t consumed = consumed_seq();
    if (read_seq < consumed) read_seq = consumed;
    while (read_seq < cursor_seq + length - 1) {
      const int id = trace[static_cast<std::size_t>(read_seq % length)];
      Unit& u = units[id];
      if (!u.disk) {
        ++read_seq;
        continue;
      }
      if (u.host_slot >= 0) {
        const auto slot = static_cast<std::size_t>(u.host_slot);
        HostRegion& r = hring[slot];
        if (r.seq < read_seq) {
          // An earlier position still to be consumed (a unit used twice): that copy first.
          if (r.seq >= consumed) break;
          r.seq = read_seq;  // bytes are bytes: the region serves this position too
          if (job_state(slot) == JobState::kFailed) queue_read(slot);  // try once more
        }
        ++read_seq;
        continue;
      }
      std::size_t slot = 0;
      if (!allocate_host_region(u.ring_bytes, /*blocking=*/false, &slot)) break;  // backpressure
      link(slot, id, read_seq);
      queue_read(slot);
      ++read_seq;
    }
  }

  // For the prefetch: true when the unit's bytes have landed in the host ring (`host` points at
  // them). False while its read is queued or running, failed, or not issued yet.
  bool disk_bytes_landed(int id) {
    Unit& u = units[id];
    if (u.host_slot < 0) return false;
    const auto slot = static_cast<std::size_t>(u.host_slot);
    if (job_state(slot) != JobState::kDone) return false;
    u.host = host_ring + hring[slot].offset;
    return true;
  }

  // For an acquire that copies on demand: makes the unit's bytes land in the host ring, waiting
  // for or running its read on this thread (Note [Disk tier]); throws ddo::Error if it fails.
  void read_on_demand(int id) {
    Unit& u = units[id];
    const Clock::time_point start = Clock::now();
    bool waited = false;
    bool ran_here = false;
    std::size_t slot = 0;
    auto run_here = [&] {
      ReadJob& j = jobs[slot];
      j.state.store(JobState::kRunning, std::memory_order_relaxed);  // no reader holds it
      run_job(slot, id, host_ring + hring[slot].offset, u.bytes);
      waited = ran_here = true;
    };
    if (u.host_slot >= 0) {
      slot = static_cast<std::size_t>(u.host_slot);
      const JobState st = job_state(slot);
      if (st == JobState::kQueued && take_queued(slot, JobState::kRunning)) {
        run_job(slot, id, host_ring + hring[slot].offset, u.bytes);  // rather than queue behind
        waited = ran_here = true;
      } else if (st == JobState::kQueued || st == JobState::kRunning) {
        wait_job(slot);
        waited = true;
      }
      // A read-ahead that failed: once more here, where a failure reaches the caller.
      if (job_state(slot) == JobState::kFailed && !ran_here) run_here();
    } else {
      const bool found = allocate_host_region(u.ring_bytes, /*blocking=*/true, &slot);
      DDO_ASSERT(found, "copy scheduler: no room for disk-tier unit ", id, " (", u.ring_bytes,
                 " bytes) in an empty ", host_ring_bytes, "-byte host ring");
      link(slot, id, kStaleSeq);
      run_here();
    }
    if (waited) {
      ++stats.disk_waits;
      stats.disk_wait_ms += ms_since(start);
    }
    const JobState landed = job_state(slot);
    DDO_ASSERT(landed == JobState::kDone || landed == JobState::kFailed,
               "copy scheduler: disk-tier unit ", id, " has a host region without a read");
    if (landed == JobState::kFailed) {
      const Status& failure = jobs[slot].status;
      throw Error(failure.code(),
                  internal::str_cat("copy scheduler: reading disk-tier unit ", id, " (", u.bytes,
                                    " bytes) failed: ", failure.message(),
                                    "; the unit was not acquired and is read again when it is "
                                    "next acquired"));
    }
    u.host = host_ring + hring[slot].offset;
  }

  // Marks every region unexpected (a relearn): the data stays usable until reclaimed.
  void unexpect_host_regions() {
    for (std::size_t k = 0; k < hring_count; ++k) hring[hslot(k)].seq = kStaleSeq;
    prefetch_waits_on_read = false;
  }

  // drain(): no read runs into the ring afterwards, and no region holds a unit's data.
  void drain_reads() {
    for (std::size_t k = 0; k < hring_count; ++k) {
      const std::size_t slot = hslot(k);
      if (job_state(slot) == JobState::kQueued) take_queued(slot, JobState::kIdle);
    }
    for (std::size_t k = 0; k < hring_count; ++k) {
      const std::size_t slot = hslot(k);
      if (job_state(slot) == JobState::kRunning) wait_job(slot);
      forget(slot);
    }
    read_seq = cursor_seq;
    prefetch_waits_on_read = false;
  }

  // --- trace ----------------------------------------------------------------------------------
  void start_relearn(int id) {
    ++stats.relearns;
    learning = true;
    trace.clear();
    for (Unit& u : units) u.in_trace = false;
    drop_in_flight(id);
    if (has_disk) unexpect_host_regions();
    if (id >= 0) trace.push_back(id);
  }

  void learn(int id) {
    if (!trace.empty() && id == trace.front()) {
      const auto length = static_cast<std::int64_t>(trace.size());
      for (int t : trace) units[t].in_trace = true;
      learning = false;
      cycle = 1;
      cursor_seq = length + 1;  // trace[0] of cycle 1 is being acquired now
      prefetch_seq = cursor_seq;
      read_seq = cursor_seq;
      misses_in_cycle = 0;
      cycles_with_misses = 0;
      miss_limit = std::min<std::int64_t>(8, std::max<std::int64_t>(1, length / 10));
      return;
    }
    if (trace.size() >= max_trace) trace.clear();  // trace[0] never came back: start over here
    trace.push_back(id);
  }

  void end_cycle() {
    cycles_with_misses = misses_in_cycle > 0 ? cycles_with_misses + 1 : 0;
    misses_in_cycle = 0;
    if (cycles_with_misses >= kMissCyclesBeforeRelearn) start_relearn(-1);
  }

  void set_cursor(std::int64_t seq) {
    cursor_seq = seq;
    const auto length = static_cast<std::int64_t>(trace.size());
    if (cursor_seq / length > cycle) {
      cycle = cursor_seq / length;
      end_cycle();
    }
  }

  // Signed distance from trace position `pos` to the nearest occurrence of `id`; false if absent.
  bool nearest(int id, std::int64_t pos, std::int64_t* distance) const {
    if (!units[id].in_trace) return false;
    const auto length = static_cast<std::int64_t>(trace.size());
    for (std::int64_t d = 1; d <= length / 2 + 1; ++d) {
      if (trace[static_cast<std::size_t>((pos + d) % length)] == id) {
        *distance = d;
        return true;
      }
      if (trace[static_cast<std::size_t>(((pos - d) % length + length) % length)] == id) {
        *distance = -d;
        return true;
      }
    }
    return false;
  }

  void observe(int id) {
    if (learning) {
      learn(id);
      return;
    }
    const auto length = static_cast<std::int64_t>(trace.size());
    const std::int64_t pos = cursor_seq % length;
    if (trace[static_cast<std::size_t>(pos)] == id) {
      set_cursor(cursor_seq + 1);
      return;
    }
    ++stats.order_misses;
    if (++misses_in_cycle > miss_limit) {
      start_relearn(id);
      return;
    }
    std::int64_t distance = 0;
    if (!nearest(id, pos, &distance)) return;  // not in the trace: served on demand
    const std::int64_t target = cursor_seq + distance + 1;
    if (distance > 0) {
      // Units passed over beyond the grace were mispredicted: free their window share.
      for (std::int64_t s = cursor_seq; s < target - 1 - kStaleGrace; ++s) {
        const int skipped = trace[static_cast<std::size_t>(s % length)];
        Unit& u = units[skipped];
        if (u.state == UnitState::kInFlight && skipped != id && ring[u.slot].seq <= s) {
          detach(ring[u.slot], u.slot);
        }
      }
    }
    set_cursor(target);
    if (!learning && prefetch_seq < cursor_seq) prefetch_seq = cursor_seq;
  }

  void harvest_all() {
    for (Unit& u : units) {
      harvest_copy_timing(u);
      harvest_wait_timing(u);
    }
  }
};

CopyScheduler::CopyScheduler(Device& device, const SchedulerOptions& options)
    : impl_(std::make_unique<Impl>(device, options)) {}

CopyScheduler::~CopyScheduler() {
  Impl& s = *impl_;
  Device& d = s.device;
  // Destructors cannot report; a CUDA failure here (a broken context at teardown) is printed
  // rather than terminating the process.
  bool synced = false;
  try {
    if (s.finalized) {
      if (s.options.use_side_stream) d.synchronize_stream(s.copy_stream);
      // Ops issued before the newest release may still read staging.
      if (s.last_released_unit >= 0) d.synchronize_event(s.units[s.last_released_unit].release);
    }
    synced = true;
  } catch (const Error& e) {
    std::fprintf(stderr, "ddo: copy scheduler teardown failed: %s\n", e.what());
  }
  // Readers stop before the ring goes (a running read finishes into it); queued reads are dropped.
  s.join_readers();
  if (!synced) return;  // as before the disk tier: a broken device keeps its memory
  try {
    // Copies out of the host ring issued on the compute stream (no side stream) may still run.
    for (std::size_t k = 0; k < s.hring_count; ++k) {
      const Event e = s.hring[s.hslot(k)].copy_event;
      if (e != nullptr) d.synchronize_event(e);
    }
    if (s.host_ring != nullptr) d.deallocate_host(s.host_ring);
    if (s.staging != nullptr) d.deallocate(s.staging);
    for (Unit& u : s.units) {
      for (Event e : {u.release, u.wait_start, u.wait_end, u.copy_starts[0], u.copy_starts[1],
                      u.copy_dones[0], u.copy_dones[1], u.fast_done}) {
        if (e != nullptr) d.destroy_event(e);
      }
    }
    if (s.mark != nullptr) d.destroy_event(s.mark);
    if (s.copy_stream != kDefaultStream) d.destroy_stream(s.copy_stream);
  } catch (const Error& e) {
    std::fprintf(stderr, "ddo: copy scheduler teardown failed: %s\n", e.what());
  }
}

int CopyScheduler::add(const void* host_ptr, std::size_t bytes, bool pinned) {
  Impl& s = *impl_;
  DDO_CHECK(!s.finalized, Code::kFailedPrecondition,
            "CopyScheduler::add after finalize(); register every unit first");
  DDO_CHECK(host_ptr != nullptr || bytes == 0, Code::kInvalidArgument,
            "CopyScheduler::add: null host pointer for a ", bytes, "-byte unit");
  Unit u;
  u.host = static_cast<const char*>(host_ptr);
  u.bytes = bytes;
  u.ring_bytes = align_up(std::max<std::size_t>(bytes, 1), kRingAlignment);
  u.pinned = pinned;
  s.units.push_back(u);
  s.readers.emplace_back();
  s.largest_ring_bytes = std::max(s.largest_ring_bytes, u.ring_bytes);
  return static_cast<int>(s.units.size() - 1);
}

int CopyScheduler::add_from_reader(std::size_t bytes, UnitReader read) {
  Impl& s = *impl_;
  DDO_CHECK(!s.finalized, Code::kFailedPrecondition,
            "CopyScheduler::add_from_reader after finalize(); register every unit first");
  DDO_CHECK(static_cast<bool>(read), Code::kInvalidArgument,
            "CopyScheduler::add_from_reader: no reader for a ", bytes, "-byte disk-tier unit");
  Unit u;
  u.bytes = bytes;
  u.ring_bytes = align_up(std::max<std::size_t>(bytes, 1), kRingAlignment);
  u.pinned = true;  // copies read it from the pinned host ring
  u.disk = true;
  s.units.push_back(u);
  s.readers.push_back(std::move(read));
  s.largest_ring_bytes = std::max(s.largest_ring_bytes, u.ring_bytes);
  s.largest_disk_ring_bytes = std::max(s.largest_disk_ring_bytes, u.ring_bytes);
  s.disk_ring_total += u.ring_bytes;
  ++s.disk_units;
  return static_cast<int>(s.units.size() - 1);
}

Status CopyScheduler::finalize() {
  Impl& s = *impl_;
  if (s.finalized) {
    return Status(Code::kFailedPrecondition, "CopyScheduler::finalize called twice");
  }
  const std::size_t largest = s.largest_ring_bytes;
  // The one staging rule (Note [Working set] in ddo/core/working_set.h), over ring bytes.
  core::StagingRequest request;
  request.largest_unit_bytes = static_cast<std::int64_t>(largest);
  for (const Unit& u : s.units) request.streamed_bytes += static_cast<std::int64_t>(u.ring_bytes);
  request.window_bytes = static_cast<std::int64_t>(s.options.window_bytes);
  request.staging_bytes =
      static_cast<std::int64_t>(s.options.staging_bytes / kRingAlignment * kRingAlignment);
  const core::StagingSize size = core::size_staging(request);
  const auto window = static_cast<std::size_t>(size.window_bytes);
  const auto staging = static_cast<std::size_t>(size.staging_bytes);
  if (staging < largest) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("staging_bytes=", s.options.staging_bytes,
                                    " cannot hold the largest streamed unit (", largest,
                                    " bytes); use at least ", 2 * largest,
                                    " (2 x the largest unit) or 0 for the default"));
  }
  // The window never exceeds what the ring can hold next to one acquired unit.
  s.window_bytes = std::min(window, staging - largest);
  std::size_t ring_bytes = 0;
  int workers = 0;
  if (s.disk_units > 0) {
    if (Status sized = s.size_disk_tier(&ring_bytes, &workers); !sized.ok()) return sized;
  }
  if (staging > 0) {
    void* ptr = nullptr;
    Status status = s.device.allocate(staging, &ptr);
    if (!status.ok()) {
      return Status(status.code(),
                    internal::str_cat("allocating the ", staging, "-byte staging area (window ",
                                      s.window_bytes, " + 2 x largest unit ", largest,
                                      ") failed: ", status.message(),
                                      "; lower staging_bytes / window_bytes or the resident "
                                      "budget"));
    }
    s.staging = static_cast<char*>(ptr);
  }
  if (s.disk_units > 0) {
    if (Status opened = s.open_disk_tier(ring_bytes, workers); !opened.ok()) {
      s.device.deallocate(s.staging);
      s.staging = nullptr;
      return opened;
    }
  }
  s.staging_bytes = staging;
  s.stats.staging_bytes = static_cast<std::int64_t>(staging);
  s.create_events();
  s.ring.assign(2 * s.units.size() + 16, Region{});
  s.max_trace = 4 * s.units.size() + 16;
  s.trace.reserve(s.max_trace);
  s.finalized = true;
  return {};
}

void* CopyScheduler::acquire(int id, Stream stream) {
  Impl& s = *impl_;
  DDO_CHECK(s.finalized && id >= 0 && static_cast<std::size_t>(id) < s.units.size(),
            Code::kInvalidArgument, "CopyScheduler::acquire(", id,
            "): ", s.finalized ? "no such unit" : "call finalize() first");
  Unit& u = s.units[id];
  DDO_CHECK(u.state != UnitState::kAcquired, Code::kFailedPrecondition, "unit ", id,
            " acquired twice without release");
  ++s.stats.acquires;
  s.observe(id);
  const bool needs_wait = s.options.use_side_stream && u.state != UnitState::kCached;
  switch (u.state) {
    case UnitState::kInFlight:
      ++s.stats.prefetch_hits;
      s.in_flight_bytes -= static_cast<std::int64_t>(u.bytes);
      break;
    case UnitState::kCached:
      ++s.stats.prefetch_hits;  // its copy was already waited for by this compute stream
      break;
    case UnitState::kIdle:
    case UnitState::kAcquired:
      ++s.stats.on_demand;
      if (u.disk) s.read_on_demand(id);  // may throw; see Note [Disk tier]
      s.issue_copy(id, s.options.use_side_stream ? s.copy_stream : stream, /*on_demand=*/true,
                   s.cursor_seq);
      if (u.disk) s.hring[static_cast<std::size_t>(u.host_slot)].copy_event = u.copy_done();
      s.in_flight_bytes -= static_cast<std::int64_t>(u.bytes);
      break;
  }
  u.state = UnitState::kAcquired;
  u.consumed_pair = u.last_copy_timed() ? u.pair : -1;
  u.acquired_once = true;
  s.ring[u.slot].state = RegionState::kAcquired;
  s.acquired_bytes += static_cast<std::int64_t>(u.bytes);
  if (needs_wait) {
    ++s.stats.waits;
    u.wait_timed = s.sample(s.wait_samples);
    if (u.wait_timed) {
      s.harvest_wait_timing(u);
      s.device.record_event(u.wait_start, stream);
      s.device.stream_wait_event(stream, u.copy_done());
      s.device.record_event(u.wait_end, stream);
      u.wait_timing_pending = true;
    } else {
      s.device.stream_wait_event(stream, u.copy_done());
    }
  }
  s.prefetch();
  s.update_peak();
  return s.staging + u.offset;
}

void CopyScheduler::release(int id, Stream stream) {
  Impl& s = *impl_;
  DDO_CHECK(s.finalized && id >= 0 && static_cast<std::size_t>(id) < s.units.size() &&
                s.units[id].state == UnitState::kAcquired,
            Code::kFailedPrecondition, "CopyScheduler::release(", id,
            "): the unit is not acquired");
  Unit& u = s.units[id];
  s.device.record_event(u.release, stream);
  u.release_seq = ++s.release_counter;
  s.last_released_unit = id;
  u.state = UnitState::kCached;
  s.ring[u.slot].state = RegionState::kReleased;
  s.acquired_bytes -= static_cast<std::int64_t>(u.bytes);
  // Disk reads land between acquires: a stopped prefetch or read-ahead resumes here too.
  if (s.has_disk) {
    if (s.prefetch_waits_on_read) {
      s.prefetch();
    } else {
      s.read_ahead();
    }
  }
}

void CopyScheduler::drain() {
  Impl& s = *impl_;
  if (!s.finalized) return;
  if (s.options.use_side_stream) s.device.synchronize_stream(s.copy_stream);
  // Forget staged data; released regions keep their release waits (see Note [Staging ring]).
  for (std::size_t k = 0; k < s.ring_count; ++k) {
    Region& r = s.ring_at(k);
    if (r.state == RegionState::kInFlight || r.state == RegionState::kReleased) {
      s.detach(r, (s.ring_first + k) % s.ring.size());
    }
  }
  s.prefetch_seq = s.cursor_seq;
  if (s.has_disk) s.drain_reads();
  s.harvest_all();
}

void CopyScheduler::mark(Stream stream) {
  Impl& s = *impl_;
  if (s.mark != nullptr) s.device.record_event(s.mark, stream);
}

void CopyScheduler::set_timing(Timing timing) {
  Impl& s = *impl_;
  DDO_CHECK(timing == Timing::kOff || s.options.time_copies, Code::kFailedPrecondition,
            "CopyScheduler::set_timing: this scheduler was built with time_copies = false and "
            "has no timing events");
  s.timing = timing;
}

Timing CopyScheduler::timing() const {
  return impl_->timing;
}

std::vector<UnitTiming> CopyScheduler::timeline() const {
  Impl& s = *impl_;
  std::vector<UnitTiming> out;
  if (s.mark == nullptr || s.learning) return out;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto since_mark = [&](Event e) -> double {
    if (e == nullptr || !s.device.event_done(e) || !s.device.event_done(s.mark)) return nan;
    return static_cast<double>(s.device.elapsed_ms(s.mark, e));
  };
  for (int id : s.trace) {
    const Unit& u = s.units[static_cast<std::size_t>(id)];
    // The copy the latest acquire consumed, or before any acquire the latest copy; untimed ones
    // (Note [Copy timing]) read as NaN, as does a wait that was not timed.
    const int k = u.acquired_once ? u.consumed_pair : (u.last_copy_timed() ? u.pair : -1);
    const Event start = k < 0 ? nullptr : u.copy_starts[k];
    const Event done = k < 0 ? nullptr : u.copy_dones[k];
    out.push_back(UnitTiming{id, static_cast<std::int64_t>(u.bytes), since_mark(start),
                             since_mark(done), since_mark(u.wait_timed ? u.wait_start : nullptr),
                             since_mark(u.wait_timed ? u.wait_end : nullptr)});
  }
  return out;
}

SchedulerStats CopyScheduler::stats() const {
  impl_->harvest_all();
  SchedulerStats out = impl_->stats;
  out.trace_length = impl_->learning ? 0 : impl_->trace.size();
  out.disk_bytes_read = impl_->disk_bytes_read.load() - impl_->disk_bytes_read_base;
  return out;
}

void CopyScheduler::reset_stats() {
  Impl& s = *impl_;
  s.harvest_all();
  SchedulerStats fresh;
  fresh.staging_bytes = static_cast<std::int64_t>(s.staging_bytes);
  fresh.disk_ring_bytes = static_cast<std::int64_t>(s.host_ring_bytes);
  s.stats = fresh;
  s.disk_bytes_read_base = s.disk_bytes_read.load();
  s.update_peak();
}

std::size_t CopyScheduler::staging_bytes() const {
  return impl_->staging_bytes;
}

std::size_t CopyScheduler::unit_count() const {
  return impl_->units.size();
}

std::size_t CopyScheduler::disk_unit_count() const {
  return impl_->disk_units;
}

}  // namespace ddo::engine
