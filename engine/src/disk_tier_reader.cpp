// The disk-tier reader: units read from the checkpoint each time into a pinned host ring, a
// read-ahead cursor over the trace, and the reader threads with their job queue (Note [Disk
// tier]). Separate because it is the scheduler's only threaded part and its only host memory.

#include <algorithm>
#include <chrono>
#include <exception>
#include <system_error>
#include <utility>

#include "ddo/core/working_set.h"

#include "copy_scheduler_internal.h"

namespace ddo::engine {

using namespace scheduler_internal;

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

using Clock = std::chrono::steady_clock;

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

void CopyScheduler::Impl::link(std::size_t slot, int id, std::int64_t seq) {
  hring[slot].unit = id;
  hring[slot].seq = seq;
  units[id].host_slot = static_cast<int>(slot);
}

// The region no longer holds a unit's data; it stays in the ring until reclaimed.
void CopyScheduler::Impl::forget(std::size_t slot) {
  HostRegion& r = hring[slot];
  if (r.unit >= 0) units[r.unit].host_slot = -1;
  r.unit = -1;
  r.seq = kStaleSeq;
}

// Takes a job still in the queue back, leaving it in `to`; false when a reader got to it first.
bool CopyScheduler::Impl::take_queued(std::size_t slot, JobState to) {
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

void CopyScheduler::Impl::queue_read(std::size_t slot) {
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
void CopyScheduler::Impl::run_job(std::size_t slot, int unit, char* dst, std::size_t bytes) {
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

void CopyScheduler::Impl::wait_job(std::size_t slot) {
  std::unique_lock<std::mutex> lock(jobs_mu);
  done_cv.wait(lock, [&] {
    const JobState st = jobs[slot].state.load(std::memory_order_relaxed);
    return st != JobState::kQueued && st != JobState::kRunning;
  });
}

void CopyScheduler::Impl::reader_loop() {
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
Status CopyScheduler::Impl::size_disk_tier(std::size_t* ring_bytes, int* workers) const {
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
  *workers = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(wanted), disk_units));
  return {};
}

// finalize(), disk tier: pins the host ring and starts the reader threads. On failure nothing
// of the disk tier is left.
Status CopyScheduler::Impl::open_disk_tier(std::size_t ring_bytes, int workers) {
  void* ptr = nullptr;
  Status status = device.allocate_host(ring_bytes, &ptr);
  if (!status.ok()) {
    return Status(Code::kResourceExhausted,
                  internal::str_cat("pinning the ", ring_bytes, "-byte host ring for ", disk_units,
                                    " disk-tier units (largest ", largest_disk_ring_bytes,
                                    " bytes) failed: ", status.message(),
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
                  internal::str_cat("starting ", workers, " disk reader threads failed: ", e.what(),
                                    "; lower disk_read_workers"));
  }
  stats.disk_ring_bytes = static_cast<std::int64_t>(ring_bytes);
  has_disk = true;
  return {};
}

void CopyScheduler::Impl::join_readers() {
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
bool CopyScheduler::Impl::pop_host_front(bool blocking) {
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

bool CopyScheduler::Impl::allocate_host_region(std::size_t n, bool blocking, std::size_t* slot) {
  for (;;) {
    std::size_t offset = 0;
    if (hring_count < hring.size() && ring_gap(host_ring_bytes, hring_count == 0,
                                               hring[hring_first].offset, hring_head, n, &offset)) {
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
void CopyScheduler::Impl::read_ahead() {
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
bool CopyScheduler::Impl::disk_bytes_landed(int id) {
  Unit& u = units[id];
  if (u.host_slot < 0) return false;
  const auto slot = static_cast<std::size_t>(u.host_slot);
  if (job_state(slot) != JobState::kDone) return false;
  u.host = host_ring + hring[slot].offset;
  return true;
}

// For an acquire that copies on demand: makes the unit's bytes land in the host ring, waiting
// for or running its read on this thread (Note [Disk tier]); throws ddo::Error if it fails.
void CopyScheduler::Impl::read_on_demand(int id) {
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
void CopyScheduler::Impl::unexpect_host_regions() {
  for (std::size_t k = 0; k < hring_count; ++k) hring[hslot(k)].seq = kStaleSeq;
  prefetch_waits_on_read = false;
}

// drain(): no read runs into the ring afterwards, and no region holds a unit's data.
void CopyScheduler::Impl::drain_reads() {
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

}  // namespace ddo::engine
