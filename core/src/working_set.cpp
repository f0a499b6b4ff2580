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

}  // namespace ddo::core
