// The trace learner: the acquire order recorded in the first step, the cursor that follows it,
// and the relearn when the order changes (Note [Trace]). Separate from the staging ring and the
// disk tier, which only read the positions it keeps.

#include <algorithm>
#include <cstdint>

#include "copy_scheduler_internal.h"

namespace ddo::engine {

using namespace scheduler_internal;

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

namespace {

// Cycles in a row with at least one miss before the trace is learned again.
constexpr int kMissCyclesBeforeRelearn = 3;

}  // namespace

void CopyScheduler::Impl::start_relearn(int id) {
  ++stats.relearns;
  learning = true;
  trace.clear();
  for (Unit& u : units) u.in_trace = false;
  drop_in_flight(id);
  if (has_disk) unexpect_host_regions();
  if (id >= 0) trace.push_back(id);
}

void CopyScheduler::Impl::learn(int id) {
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

void CopyScheduler::Impl::end_cycle() {
  cycles_with_misses = misses_in_cycle > 0 ? cycles_with_misses + 1 : 0;
  misses_in_cycle = 0;
  if (cycles_with_misses >= kMissCyclesBeforeRelearn) start_relearn(-1);
}

void CopyScheduler::Impl::set_cursor(std::int64_t seq) {
  cursor_seq = seq;
  const auto length = static_cast<std::int64_t>(trace.size());
  if (cursor_seq / length > cycle) {
    cycle = cursor_seq / length;
    end_cycle();
  }
}

// Signed distance from trace position `pos` to the nearest occurrence of `id`; false if absent.
bool CopyScheduler::Impl::nearest(int id, std::int64_t pos, std::int64_t* distance) const {
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

void CopyScheduler::Impl::observe(int id) {
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

}  // namespace ddo::engine
