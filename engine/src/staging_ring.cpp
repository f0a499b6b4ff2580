// The staging ring: the one device allocation that streamed units are copied into, handed out
// and reclaimed in trace order (Note [Staging ring]). Separate from the scheduler's copies and
// prefetch because the ring decides only where bytes go and when they may be overwritten.

#include <cstddef>
#include <cstdint>

#include "copy_scheduler_internal.h"

namespace ddo::engine {

using namespace scheduler_internal;

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

namespace scheduler_internal {

// Shared with the disk tier's host ring (copy_scheduler_internal.h).
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

}  // namespace scheduler_internal

void CopyScheduler::Impl::note_release_wait(int unit) {
  const std::uint64_t seq = units[unit].release_seq;
  if (seq > pending_wait_seq) {
    pending_wait_seq = seq;
    pending_wait_unit = unit;
  }
}

// Forgets region data: the unit no longer has it in staging.
void CopyScheduler::Impl::detach(Region& r, std::size_t slot) {
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

bool CopyScheduler::Impl::reclaimable(const Region& r, bool on_demand) const {
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

bool CopyScheduler::Impl::pop_front(bool on_demand) {
  if (ring_count == 0 || !reclaimable(front(), on_demand)) return false;
  detach(front(), ring_first);
  ring_first = (ring_first + 1) % ring.size();
  if (--ring_count == 0) head = 0;
  return true;
}

// Only for on-demand copies blocked by an acquired region at the old end.
bool CopyScheduler::Impl::pop_back() {
  if (ring_count == 0 || back().state == RegionState::kAcquired) return false;
  const std::size_t slot = (ring_first + ring_count - 1) % ring.size();
  detach(back(), slot);
  --ring_count;
  head = ring_count == 0 ? 0 : back().offset + back().bytes;
  return true;
}

bool CopyScheduler::Impl::fits(std::size_t n, std::size_t* offset) const {
  if (ring_count == ring.size()) return false;
  return ring_gap(staging_bytes, ring_count == 0, ring[ring_first].offset, head, n, offset);
}

bool CopyScheduler::Impl::allocate_region(std::size_t n, bool on_demand, std::size_t* offset) {
  for (;;) {
    if (fits(n, offset)) return true;
    if (pop_front(on_demand)) continue;
    if (on_demand && pop_back()) continue;
    return false;
  }
}

// Drops every prefetched unit that has not been acquired, except `keep`.
void CopyScheduler::Impl::drop_in_flight(int keep) {
  for (std::size_t k = 0; k < ring_count; ++k) {
    Region& r = ring_at(k);
    if (r.state == RegionState::kInFlight && r.unit != keep) {
      detach(r, (ring_first + k) % ring.size());
    }
  }
}

}  // namespace ddo::engine
