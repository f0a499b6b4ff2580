#include "ddo/engine/copy_scheduler.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <utility>

#include "ddo/core/units.h"
#include "ddo/core/working_set.h"

#include "copy_scheduler_internal.h"

namespace ddo::engine {

using namespace scheduler_internal;

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

// Whether the next copy (or acquire wait) is timed; `count` is that kind's sample counter.
bool CopyScheduler::Impl::sample(std::uint32_t& count) const {
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

void CopyScheduler::Impl::harvest_copy_timing(Unit& u) {
  if (!u.copy_timing_pending || !device.event_done(u.copy_dones[u.pair])) return;
  const float ms = device.elapsed_ms(u.copy_starts[u.pair], u.copy_dones[u.pair]);
  if (ms >= 0.0f) {
    stats.copy_ms += ms;
    ++stats.timed_copies;
    stats.timed_copy_bytes += static_cast<std::int64_t>(u.bytes);
  }
  u.copy_timing_pending = false;
}

void CopyScheduler::Impl::harvest_wait_timing(Unit& u) {
  if (!u.wait_timing_pending || !device.event_done(u.wait_end)) return;
  const float ms = device.elapsed_ms(u.wait_start, u.wait_end);
  if (ms >= 0.0f) {
    stats.wait_ms += ms;
    ++stats.timed_waits;
  }
  u.wait_timing_pending = false;
}

void CopyScheduler::Impl::update_peak() {
  stats.peak_in_flight_bytes =
      std::max(stats.peak_in_flight_bytes, in_flight_bytes + acquired_bytes);
}

// Note [A copy that fails]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The device may refuse a copy (a driver error; the simulation's SimFaults). The copy is
// submitted before the ring and the unit record it, so a refused copy changes nothing: the
// unit stays where it was and its region stays free. In the other order a refused copy would leave
// the unit marked in flight with no copy behind it, and its next acquire would return stale bytes.
// An on-demand copy throws ddo::Error naming the unit, with the device's code and message: the
// op that needs the weight cannot run. A prefetch that fails only stops prefetching for now: the
// unit is copied on demand when it is acquired, where a failure that persists (CUDA errors are
// sticky) is raised to the caller that needs it; prefetching never fails an acquire of another
// unit, which would leave that unit acquired behind the caller's back.

// Copies unit `id` into a new ring region on `stream`. A prefetch returns false when there is
// no room without dropping data the trace still expects, or when the device refuses the copy;
// an on-demand copy throws instead.
bool CopyScheduler::Impl::issue_copy(int id, Stream stream, bool on_demand, std::int64_t seq) {
  Unit& u = units[id];
  std::size_t offset = 0;
  if (!allocate_region(u.ring_bytes, on_demand, &offset)) {
    if (!on_demand) return false;
    throw Error(
        Code::kResourceExhausted,
        internal::str_cat("copy scheduler: no room in the ", staging_bytes,
                          "-byte staging area for a ", u.bytes, "-byte unit while ", acquired_bytes,
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

void CopyScheduler::Impl::prefetch() {
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

// finalize(): each unit's events (release, copy done; the timed ones with time_copies), the
// mark and the side stream.
void CopyScheduler::Impl::create_events() {
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

void CopyScheduler::Impl::harvest_all() {
  for (Unit& u : units) {
    harvest_copy_timing(u);
    harvest_wait_timing(u);
  }
}

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
  if (!synced) return;  // a broken device keeps its memory
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
