/// \file
/// The working set: how much device memory the copy scheduler holds beside the residents. One rule,
/// used by the planner (to leave room for it before it hands VRAM to residents) and by the adapter
/// and the engine (to size the staging ring on the device as it is). Also the one rule for the
/// pinned host ring that the disk tier reads into (size_disk_ring, Note [Disk ring]).
///
/// ```
/// ddo::core::StagingRequest r;
/// r.largest_unit_bytes = 94 << 20;         // FLUX: a single block's proj_out weight
/// r.streamed_bytes = std::int64_t{22} << 30;
/// ddo::core::StagingSize s = ddo::core::size_staging(r);
/// // s.window_bytes == 512 MiB (the default), s.staging_bytes == 512 MiB + 2 x 94 MiB
/// r.room_bytes = std::int64_t{600} << 20;  // a small card: what is left after the residents
/// s = ddo::core::size_staging(r);          // the window shrinks to (600 - 188) / 2 MiB
/// ```
///
/// Note [Working set]
/// The scheduler prefetches a window of bytes ahead of the op that runs into a ring over a fixed
/// staging area, and the ring needs two of the largest unit beside the window (the unit in use and
/// the one landing; staging_ring.cpp, Note [Staging ring]). So staging = window + 2 x largest
/// unit, and the smallest working set that streams at all is window = one unit: 3 x largest unit.
/// The window defaults to 512 MiB (enough to hide a block's copy behind the block before it on PCIe
/// 4 and 5 cards), never more than what is streamed, and, when the device memory left after
/// residents and move-once tensors is known, never more than half of what that room leaves after
/// the two units: the other half is for the step's activations, which nothing here can see. The
/// classic group routes prefetch exactly one unit ahead (window = largest unit).
///
/// Note [Disk ring]
/// Units of the disk tier (Note [Disk tier plan] in planner_tiers.cpp) never live in host RAM:
/// every step the engine reads them from the checkpoint, in traced order, into a pinned host ring
/// ahead of the copy stream, which copies each from the ring to the device staging. The ring needs
/// two of the largest disk unit: one the copy stream is reading while the next is read from the
/// file (read-ahead of one). That is its floor, and a plan whose budget cannot hold it cannot
/// stream from disk at all. By default the ring also holds a window like the device staging's
/// (prefetch_window_mb, else 512 MiB): disk reads then keep running through the stretches of host
/// units and absorb a slow read. Under a host RAM budget the window shrinks to the room the host
/// units leave, never below the floor. The ring is never larger than the disk bytes: a ring that
/// holds every disk unit would be those units kept in RAM.
///
/// ```
/// ddo::core::DiskRingRequest d;
/// d.largest_unit_bytes = 94 << 20;           // FLUX: proj_out of a single block
/// d.disk_bytes = std::int64_t{8} << 30;
/// ddo::core::size_disk_ring(d);              // 512 MiB + 2 x 94 MiB
/// d.room_bytes = std::int64_t{300} << 20;    // what the budget leaves after the host units
/// ddo::core::size_disk_ring(d);              // 300 MiB
/// d.room_bytes = std::int64_t{100} << 20;    // below the floor: the plan cannot stream from disk
/// ddo::core::size_disk_ring(d);              // 188 MiB = min_disk_ring_bytes(94 MiB, 8 GiB)
/// ```
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

namespace ddo::core {

/// The prefetch window when neither the config (prefetch_window_mb) nor the room bounds it.
inline constexpr std::int64_t kDefaultPrefetchWindowBytes = std::int64_t{512} << 20;

/// What size_staging() sizes the ring for.
struct StagingRequest {
  std::int64_t largest_unit_bytes = 0;  ///< the largest stream unit
  std::int64_t streamed_bytes = 0;      ///< all streamed bytes (an upper bound is fine)
  std::int64_t window_bytes = 0;        ///< requested window (prefetch_window_mb); 0 = by the rule
  std::int64_t staging_bytes = 0;  ///< requested staging (staging_mb); 0 = window + 2 x largest
  bool one_unit_ahead = false;     ///< the classic group routes: window = largest unit
  /// Device bytes left for staging and activations after residents and move-once tensors, when
  /// known (the adapter reads the device; the planner does not know the CUDA context).
  std::optional<std::int64_t> room_bytes;
};

/// The ring size_staging() chose.
struct StagingSize {
  std::int64_t window_bytes = 0;   ///< bytes prefetched ahead of the running op
  std::int64_t staging_bytes = 0;  ///< the device staging area: window + 2 x largest unit
};

/// Note [Working set]. A requested size wins over the rule (the engine still fits the window into
/// the staging area next to one unit).
StagingSize size_staging(const StagingRequest& request);

/// The smallest staging area that streams units of `largest_unit_bytes`: a window of one unit plus
/// the two the ring needs beside it.
inline std::int64_t min_staging_bytes(std::int64_t largest_unit_bytes) {
  return 3 * largest_unit_bytes;
}

/// What size_disk_ring() sizes the pinned host ring of the disk tier for.
struct DiskRingRequest {
  std::int64_t largest_unit_bytes = 0;  ///< the largest disk-tier unit
  std::int64_t disk_bytes = 0;          ///< all disk-tier bytes (read every step)
  /// Requested read-ahead window (prefetch_window_mb); 0 = kDefaultPrefetchWindowBytes.
  std::int64_t window_bytes = 0;
  /// Host RAM the budget leaves for the ring after the host-tier units, when a budget applies.
  std::optional<std::int64_t> room_bytes;
};

/// The smallest ring that streams disk units of `largest_unit_bytes` (Note [Disk ring]): two of
/// them, or all `disk_bytes` when that is less.
inline std::int64_t min_disk_ring_bytes(std::int64_t largest_unit_bytes, std::int64_t disk_bytes) {
  return std::max<std::int64_t>(0, std::min(disk_bytes, 2 * largest_unit_bytes));
}

/// Note [Disk ring]: min(disk bytes, max(2 x largest, min(window + 2 x largest, room))); 0 when
/// nothing is on disk. The result may exceed `room_bytes` (only by the floor): the caller checks.
std::int64_t size_disk_ring(const DiskRingRequest& request);

}  // namespace ddo::core
