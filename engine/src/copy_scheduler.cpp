#include "ddo/engine/copy_scheduler.h"

#include <algorithm>
#include <cstdio>
#include <limits>
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
// release); a release costs one event record. time_copies adds two records per acquire and per
// copy plus a non-blocking query of the previous sample; turn it off where per-op host time is
// measured.

namespace {

enum class UnitState : std::uint8_t { kIdle, kInFlight, kAcquired, kCached };
enum class RegionState : std::uint8_t { kInFlight, kAcquired, kReleased, kFree };

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
  UnitState state = UnitState::kIdle;
  std::size_t slot = 0;    // ring slot while state != kIdle
  std::size_t offset = 0;  // staging offset while state != kIdle
  std::uint64_t release_seq = 0;
  Event release = nullptr;
  // copy_dones[pair] completes when the latest copy has landed (the event acquires wait on).
  // With time_copies, copies alternate between two (start, done) timing pairs, so that the copy
  // an acquire consumed keeps its times (for timeline()) while the next cycle's prefetch records
  // the other; without, pair stays 0 and copy_starts are null. Timing events are read lazily,
  // before they are recorded again.
  Event copy_starts[2] = {nullptr, nullptr};
  Event copy_dones[2] = {nullptr, nullptr};
  int pair = 0;            // the pair of the latest issued copy
  int consumed_pair = -1;  // the pair of the copy the latest acquire used
  Event copy_done() const { return copy_dones[pair]; }
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

}  // namespace

struct CopyScheduler::Impl {
  Impl(Device& d, const SchedulerOptions& o) : device(d), options(o) {}

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

  Event mark = nullptr;  // timeline reference (time_copies only)

  std::int64_t in_flight_bytes = 0;  // units copied for, not yet acquired
  std::int64_t acquired_bytes = 0;
  SchedulerStats stats;

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
    if (ring_count == 0) {
      *offset = 0;
      return n <= staging_bytes;
    }
    const std::size_t tail = ring[ring_first].offset;
    if (head > tail) {  // live span [tail, head): free at the end, then at the start
      if (n <= staging_bytes - head) {
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

  bool allocate_region(std::size_t n, bool on_demand, std::size_t* offset) {
    for (;;) {
      if (fits(n, offset)) return true;
      if (pop_front(on_demand)) continue;
      if (on_demand && pop_back()) continue;
      return false;
    }
  }

  // --- copies ---------------------------------------------------------------------------------
  void harvest_copy_timing(Unit& u) {
    if (!u.copy_timing_pending || !device.event_done(u.copy_done())) return;
    const float ms = device.elapsed_ms(u.copy_starts[u.pair], u.copy_done());
    if (ms >= 0.0f) stats.copy_ms += ms;
    u.copy_timing_pending = false;
  }

  void harvest_wait_timing(Unit& u) {
    if (!u.wait_timing_pending || !device.event_done(u.wait_end)) return;
    const float ms = device.elapsed_ms(u.wait_start, u.wait_end);
    if (ms >= 0.0f) stats.wait_ms += ms;
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
    if (options.time_copies) {
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
    device.record_event(u.copy_done(), stream);
    u.copy_timing_pending = options.time_copies;
    stats.bytes_copied += static_cast<std::int64_t>(u.bytes);
    update_peak();
    return true;
  }

  void prefetch() {
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
      if (!issue_copy(id, copy_stream, /*on_demand=*/false, prefetch_seq)) break;
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

  // --- trace ----------------------------------------------------------------------------------
  void start_relearn(int id) {
    ++stats.relearns;
    learning = true;
    trace.clear();
    for (Unit& u : units) u.in_trace = false;
    drop_in_flight(id);
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
  try {
    if (s.finalized) {
      if (s.options.use_side_stream) d.synchronize_stream(s.copy_stream);
      // Ops issued before the newest release may still read staging.
      if (s.last_released_unit >= 0) d.synchronize_event(s.units[s.last_released_unit].release);
      d.deallocate(s.staging);
    }
    for (Unit& u : s.units) {
      for (Event e : {u.release, u.wait_start, u.wait_end, u.copy_starts[0], u.copy_starts[1],
                      u.copy_dones[0], u.copy_dones[1]}) {
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
  s.largest_ring_bytes = std::max(s.largest_ring_bytes, u.ring_bytes);
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
  s.staging_bytes = staging;
  s.stats.staging_bytes = static_cast<std::int64_t>(staging);
  for (Unit& u : s.units) {
    u.release = s.device.create_event(/*timing=*/false);
    if (!s.options.time_copies) {
      u.copy_dones[0] = s.device.create_event(/*timing=*/false);
    } else {
      for (int k = 0; k < 2; ++k) {
        u.copy_starts[k] = s.device.create_event(true);
        u.copy_dones[k] = s.device.create_event(true);
      }
      u.wait_start = s.device.create_event(true);
      u.wait_end = s.device.create_event(true);
    }
  }
  if (s.options.time_copies) s.mark = s.device.create_event(true);
  if (s.options.use_side_stream) s.copy_stream = s.device.create_stream();
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
      s.issue_copy(id, s.options.use_side_stream ? s.copy_stream : stream, /*on_demand=*/true,
                   s.cursor_seq);
      s.in_flight_bytes -= static_cast<std::int64_t>(u.bytes);
      break;
  }
  u.state = UnitState::kAcquired;
  u.consumed_pair = u.pair;
  s.ring[u.slot].state = RegionState::kAcquired;
  s.acquired_bytes += static_cast<std::int64_t>(u.bytes);
  if (needs_wait) {
    if (s.options.time_copies) {
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
  s.harvest_all();
}

void CopyScheduler::mark(Stream stream) {
  Impl& s = *impl_;
  if (s.mark != nullptr) s.device.record_event(s.mark, stream);
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
    const int k = u.consumed_pair < 0 ? u.pair : u.consumed_pair;
    out.push_back(UnitTiming{id, static_cast<std::int64_t>(u.bytes), since_mark(u.copy_starts[k]),
                             since_mark(u.copy_dones[k]), since_mark(u.wait_start),
                             since_mark(u.wait_end)});
  }
  return out;
}

SchedulerStats CopyScheduler::stats() const {
  impl_->harvest_all();
  SchedulerStats out = impl_->stats;
  out.trace_length = impl_->learning ? 0 : impl_->trace.size();
  return out;
}

void CopyScheduler::reset_stats() {
  Impl& s = *impl_;
  s.harvest_all();
  SchedulerStats fresh;
  fresh.staging_bytes = static_cast<std::int64_t>(s.staging_bytes);
  s.stats = fresh;
  s.update_peak();
}

std::size_t CopyScheduler::staging_bytes() const {
  return impl_->staging_bytes;
}

std::size_t CopyScheduler::unit_count() const {
  return impl_->units.size();
}

}  // namespace ddo::engine
