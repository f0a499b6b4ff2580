/// \file
/// Fault injection for the simulation device: chosen calls of the real backend fail the way a
/// driver's would, so tests can show that every failure surfaces as a clear ddo::Status (or
/// ddo::Error on the hot path), that nothing leaks, and that what failed stays usable and
/// destructible.
///
/// ```
/// auto faults = std::make_shared<ddo::engine::SimFaults>();
/// auto dev = ddo::engine::make_sim_device({.capacity_bytes = 1 << 30}, faults);
/// faults->fail_nth(ddo::engine::SimFault::kAllocate, 2);  // the second allocate() from now
/// void* a = nullptr;
/// void* b = nullptr;
/// dev->allocate(64, &a);  // ok
/// dev->allocate(64, &b);  // kResourceExhausted: "simulated device 0: allocate of 64 bytes
///                         // failed (injected fault: allocate call 2)"
/// ```
///
/// The hook is test-only in purpose but sits in the real code path: the backend asks it before
/// doing the work, and a device made without one (make_sim_device(options)) never fails this way.
/// A failed call has no effect: nothing is allocated, pinned or copied.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>

#include "ddo/core/status.h"
#include "ddo/engine/device.h"

namespace ddo::engine {

/// The calls a SimFaults can make fail.
enum class SimFault {
  kAllocate,  ///< Device::allocate (device memory: staging, resident weights)
  kPin,       ///< Device::allocate_host and Device::register_host (pinned host memory)
  kCopy,      ///< every copy: copy_to_device_async, copy_on_device_async, copy_to_host
};

/// Counts the calls of each SimFault kind a simulation device makes and fails the chosen ones.
/// Thread-safe: copies are submitted from any thread.
class SimFaults {
 public:
  /// Makes calls `nth` .. `nth + count - 1` of `kind`, counted from now (1 = the next call), fail.
  /// A later fail_nth of the same kind replaces the earlier choice.
  void fail_nth(SimFault kind, std::int64_t nth, std::int64_t count = 1);
  /// Stops failing calls of `kind`.
  void clear(SimFault kind);
  /// Calls of `kind` seen so far, failed ones included.
  std::int64_t calls(SimFault kind) const;
  /// Calls of `kind` failed so far.
  std::int64_t injected(SimFault kind) const;

  /// For the backend: counts one call of `kind` and returns the error to report when it is a
  /// chosen one (code `code`, the message naming `what`, the call and that it was injected).
  Status check(SimFault kind, Code code, std::string_view what);

  /// A link that does not move: copies queued on a stream (not the default stream, which copies
  /// on the caller) wait before they start until release_stream_copies(). Lets a test see the
  /// state "issued, not finished" for as long as it looks, whatever the machine's load.
  void hold_stream_copies();
  /// Lets held and later stream copies run.
  void release_stream_copies();
  /// For the backend's stream workers: returns once stream copies are not held.
  void wait_while_stream_copies_held();

 private:
  static constexpr std::size_t kKinds = 3;
  mutable std::mutex mu_;
  std::array<std::int64_t, kKinds> calls_{};     // guarded by mu_
  std::array<std::int64_t, kKinds> injected_{};  // guarded by mu_
  std::array<std::int64_t, kKinds> first_{};     // guarded by mu_: first failing call; 0 = none
  std::array<std::int64_t, kKinds> last_{};      // guarded by mu_: last failing call
  bool hold_copies_ = false;                     // guarded by mu_
  std::condition_variable released_;             // hold_copies_ became false
};

/// A simulation device whose calls consult `faults` (may be null: no injected failures).
std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options,
                                        std::shared_ptr<SimFaults> faults);

}  // namespace ddo::engine
