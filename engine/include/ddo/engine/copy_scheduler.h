/// \file
/// CopyScheduler: streams weights from host slabs into a fixed device staging area just in time.
///
/// Each streamed weight is a unit (an id from add()). On the hot path the adapter calls
/// acquire(id) right before the op that reads the weight and release(id) right after issuing it:
///
/// ```
/// int id = scheduler.add(host_ptr, bytes, pinned);     // setup
/// scheduler.finalize();                                 // allocates staging once
/// void* w = scheduler.acquire(id, stream);              // device copy; `stream` waits for it
/// launch_op(w, stream);
/// scheduler.release(id, stream);                        // region reusable after the op
/// ```
///
/// The first pass records the order of acquires (the trace). Later passes prefetch ahead along
/// the trace by a byte window, on the copy stream, into a ring over the staging area; the copy
/// stream waits on the release event of a region before overwriting it, so neither side blocks
/// the host in the steady state. Resident modules never appear in the trace, so prefetch runs
/// past them. An acquire that does not match the trace is served correctly (an on-demand copy),
/// counted, and after repeated misses the trace is learned again. See Note [Staging ring].
///
/// Disk-tier units (add_from_reader) are not held in host RAM: each time one is needed, the
/// scheduler's reader threads read it into a pinned host ring, ahead along the trace, and the
/// device copy is issued from there like a host unit's:
///
/// ```
/// int id = scheduler.add_from_reader(bytes, [file, offset, bytes](void* dst) {
///   return read_exactly(file, offset, dst, bytes);   // on a reader thread
/// });
/// ```
///
/// A read that has not landed when the prefetch reaches its unit stops the prefetch there (trace
/// order is kept); the acquire then waits for it. See Note [Disk tier] in disk_tier_reader.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "ddo/core/status.h"
#include "ddo/engine/device.h"

namespace ddo::engine {

/// Reads a disk-tier unit's bytes into `dst` (pinned host memory of the unit's size, 256-byte
/// aligned). Called on the scheduler's reader threads, possibly concurrently for different units
/// (never twice at once for the same unit), or on the thread that acquires the unit; must be
/// thread-safe. A failure is returned, not thrown (an exception becomes a kInternal status).
using UnitReader = std::function<Status(void* dst)>;

/// What a CopyScheduler times with device events (Note [Copy timing] in copy_scheduler.cpp).
enum class Timing : std::uint8_t {
  kOff,      ///< nothing: no timing event is recorded; copy_ms and wait_ms stop growing
  kSampled,  ///< one copy in every kTimingSampleEvery, and one acquire wait in as many
  kFull,     ///< every copy and every acquire wait: timeline(), calibration
};

/// "off", "sampled" or "full", as reports write it.
constexpr const char* timing_name(Timing timing) {
  return timing == Timing::kFull ? "full" : timing == Timing::kSampled ? "sampled" : "off";
}

/// In Timing::kSampled, one copy (and one acquire wait) in this many is timed.
inline constexpr std::uint32_t kTimingSampleEvery = 16;

/// How a CopyScheduler sizes its staging area and issues its copies.
struct SchedulerOptions {
  /// Staging area size; 0 = window + 2 x the largest unit.
  std::size_t staging_bytes = 0;
  /// Bytes prefetched ahead of the op that runs; 0 = the working-set rule (core::size_staging:
  /// 512 MiB, at most the streamed bytes; capped by staging).
  std::size_t window_bytes = 0;
  /// false: copies are issued on the compute stream (no side stream, e.g. under WSL).
  bool use_side_stream = true;
  /// Creates the timing events, and starts in Timing::kFull; false: Timing::kOff for good.
  bool time_copies = true;
  /// Pinned host ring for disk-tier units, rounded up to 256 bytes; 0 = core::size_disk_ring
  /// without a room bound (window + 2 x the largest disk unit, at most the disk units' total).
  /// Must hold the largest disk unit; 2 x the largest keeps one read ahead of the copy.
  std::size_t disk_ring_bytes = 0;
  /// Threads reading disk-tier units; 0 = 2 (never more than there are disk units).
  int disk_read_workers = 0;
};

/// Counters of a CopyScheduler since it was built or reset_stats(); COUNT, SUM or peak as named.
struct SchedulerStats {
  std::int64_t acquires = 0;              ///< COUNT: acquire() calls
  std::int64_t bytes_copied = 0;          ///< SUM: bytes copied host to device
  std::int64_t prefetch_hits = 0;         ///< acquired units that were already in flight or landed
  std::int64_t on_demand = 0;             ///< acquired units copied only when asked
  std::int64_t order_misses = 0;          ///< acquires that did not match the trace
  std::int64_t relearns = 0;              ///< times the trace was learned again
  double copy_ms = 0.0;                   ///< SUM: device time of the timed copies
  double wait_ms = 0.0;                   ///< SUM: device time the compute stream waited (timed)
  std::int64_t timed_copies = 0;          ///< COUNT: copies in copy_ms
  std::int64_t timed_copy_bytes = 0;      ///< SUM: bytes of the copies in copy_ms
  std::int64_t waits = 0;                 ///< COUNT: acquires whose stream waited on a copy
  std::int64_t timed_waits = 0;           ///< COUNT: acquire waits in wait_ms
  std::int64_t staging_bytes = 0;         ///< size of the staging area
  std::int64_t peak_in_flight_bytes = 0;  ///< most bytes copied ahead and not yet released at once
  std::size_t trace_length = 0;           ///< units in the learned acquire order
  std::int64_t disk_bytes_read = 0;       ///< SUM: bytes read from disk-tier sources
  std::int64_t disk_waits = 0;            ///< COUNT: acquires whose read had not landed
  double disk_wait_ms = 0.0;              ///< host time acquires spent waiting for reads
  std::int64_t disk_ring_bytes = 0;       ///< size of the pinned host ring
};

/// One streamed unit's last copy and last compute-side wait, in milliseconds after the mark
/// (CopyScheduler::mark); negative where it came before the mark (a copy prefetched during the
/// previous step). NaN where the events have not completed or timing is off.
struct UnitTiming {
  int unit = -1;               ///< the unit's id (CopyScheduler::add)
  std::int64_t bytes = 0;      ///< the unit's size
  double copy_start_ms = 0.0;  ///< the copy began on the device
  double copy_end_ms = 0.0;    ///< the copy landed
  double wait_start_ms = 0.0;  ///< the compute stream reached the acquire
  double wait_end_ms = 0.0;    ///< ... and could run the op (the copy had landed)
};

/// Streams registered host units into a fixed device staging area just before the ops that read
/// them: it learns the order units are acquired in (the trace) and copies the next `window_bytes`
/// ahead on a side stream, ordered by events only.
class CopyScheduler {
 public:
  /// `device` must outlive the scheduler.
  CopyScheduler(Device& device, const SchedulerOptions& options);
  ~CopyScheduler();
  CopyScheduler(const CopyScheduler&) = delete;
  CopyScheduler& operator=(const CopyScheduler&) = delete;

  /// Setup. Registers a unit living at `host_ptr`; returns its id (0, 1, ...).
  int add(const void* host_ptr, std::size_t bytes, bool pinned);
  /// Setup. Registers a disk-tier unit of `bytes` whose data `read` supplies each time it is
  /// needed; returns its id (same id space as add()).
  int add_from_reader(std::size_t bytes, UnitReader read);
  /// Allocates the staging area (device memory) once, and with disk-tier units the pinned host
  /// ring, and starts the reader threads. Fails with kResourceExhausted when the device cannot
  /// hold the staging area or the ring cannot be pinned, naming the size.
  Status finalize();

  /// Hot path. Returns the device address holding unit `id`; work issued on `stream` after this
  /// call sees the data. Valid until release(id, stream).
  void* acquire(int id, Stream stream);
  /// The unit's bytes may be reused after the work on `stream` so far.
  void release(int id, Stream stream);

  /// Waits for all copies and running disk reads (queued ones are cancelled); drops prefetched
  /// and read-ahead data (used at region boundaries and teardown).
  void drain();

  /// Diagnostics (time_copies only): records a reference point on `stream`, e.g. where a step
  /// begins; timeline() then returns every unit of the trace in trace order, timed against it
  /// (complete in Timing::kFull; untimed copies and waits read NaN). Call timeline() after the
  /// stream is synchronized; it never blocks.
  void mark(Stream stream);
  std::vector<UnitTiming> timeline() const;  ///< see mark()

  /// What is timed from the next copy and acquire on; anything but kOff needs time_copies
  /// (kFailedPrecondition otherwise). Samples already recorded are still harvested.
  void set_timing(Timing timing);
  Timing timing() const;  ///< the mode set_timing() (or time_copies) chose

  SchedulerStats stats() const;       ///< the counters so far
  void reset_stats();                 ///< zeroes the counters (the trace is kept)
  std::size_t staging_bytes() const;  ///< the staging area's size once finalized
  std::size_t unit_count() const;     ///< units registered by add() and add_from_reader()
  /// Units added with add_from_reader.
  std::size_t disk_unit_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddo::engine
