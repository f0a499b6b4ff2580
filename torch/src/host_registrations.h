// HostRegistrations: the owner of the host memory an attach step registers with the device for
// its copies (engine::copy_to_device_registered), internal.
//
//   std::vector<at::Tensor> sources;  // declared first: destroyed after the owner
//   HostRegistrations registered(*device, stream);
//   throw_if_error(engine::copy_to_device_registered(*device, dst, src, n, stream,
//                                                    registered.copy_queued()));
//   registered.release();  // the copies landed, the ranges unregistered
#pragma once

#include <vector>

#include "ddo/engine/device.h"

namespace ddo::adapter::internal {

// Note [Host registrations of the attach]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A registered range belongs to the driver until it is unregistered, and the copies queued on
// `stream` read it until they land. The owner therefore releases in one order, on success
// (release()) and on every error path (the destructor) alike: wait for the stream, then unregister
// each range. Memory the copies touch (their source tensors, the device chunk they write) is
// declared before the owner, so it outlives the wait even when an exception unwinds the step.
class HostRegistrations {
 public:
  HostRegistrations(engine::Device& device, engine::Stream stream)
      : device_(device), stream_(stream) {}
  // On an error path: a device that fails the wait has its error raised by the step already, and
  // a destructor that threw while another exception unwinds would end the process.
  ~HostRegistrations() {
    try {
      release();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the step's own error is the one to report
    }
  }
  HostRegistrations(const HostRegistrations&) = delete;
  HostRegistrations& operator=(const HostRegistrations&) = delete;

  // A copy is about to be queued on the stream: the list copy_to_device_registered appends what
  // it registers to.
  std::vector<void*>* copy_queued() {
    queued_ = true;
    return &registered_;
  }

  // Every copy queued through copy_queued() has landed and nothing stays registered. A step with
  // no copy of its own does not wait (the stream may carry other work, e.g. bounce-buffer
  // uploads that overlap the next read). Safe to repeat.
  void release() {
    if (queued_) device_.synchronize_stream(stream_);
    queued_ = false;
    for (void* p : registered_) device_.unregister_host(p);
    registered_.clear();
  }

 private:
  engine::Device& device_;
  engine::Stream stream_;
  std::vector<void*> registered_;
  bool queued_ = false;
};

}  // namespace ddo::adapter::internal
