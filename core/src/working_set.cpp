#include "ddo/core/working_set.h"

#include <algorithm>

namespace ddo::core {

StagingSize size_staging(const StagingRequest& r) {
  const std::int64_t largest = std::max<std::int64_t>(0, r.largest_unit_bytes);
  StagingSize out;
  if (r.window_bytes > 0) {
    out.window_bytes = r.window_bytes;
  } else if (r.one_unit_ahead) {
    out.window_bytes = largest;
  } else {
    std::int64_t window =
        std::min(kDefaultPrefetchWindowBytes, std::max<std::int64_t>(0, r.streamed_bytes));
    if (r.room_bytes) {
      const std::int64_t left = *r.room_bytes - 2 * largest;
      window = std::min(window, left > 0 ? left / 2 : 0);
    }
    out.window_bytes = std::max(largest, window);
  }
  out.staging_bytes = r.staging_bytes > 0 ? r.staging_bytes : out.window_bytes + 2 * largest;
  return out;
}

std::int64_t size_disk_ring(const DiskRingRequest& r) {
  // Note [Disk ring].
  const std::int64_t disk = std::max<std::int64_t>(0, r.disk_bytes);
  const std::int64_t largest = std::max<std::int64_t>(0, r.largest_unit_bytes);
  if (disk == 0) return 0;
  const std::int64_t window = r.window_bytes > 0 ? r.window_bytes : kDefaultPrefetchWindowBytes;
  std::int64_t ring = window + 2 * largest;
  if (r.room_bytes) ring = std::min(ring, *r.room_bytes);
  ring = std::max(ring, 2 * largest);
  return std::min(ring, disk);
}

}  // namespace ddo::core
