/// \file
/// One-time uploads at setup: host memory the driver reads slowly (pageable memory, a file's
/// bytes) to the device or into host slabs, at the speed of pinned copies.
///
/// Three tools, each for one kind of source (Note [Host uploads] in host_upload.cpp):
///   parallel_memcpy          host to host on several threads (filling slabs from a CPU model)
///   copy_to_device_registered  pageable memory already paged in: registered for its copy
///   BounceBuffers            bytes that do not exist yet (read from a file): read into a pinned
///                            buffer, copied out of it, the buffer reused once the copy landed
///
/// ```
/// std::unique_ptr<BounceBuffers> bounce;
/// DDO_RETURN_IF_ERROR(BounceBuffers::create(device, 64 << 20, /*buffers=*/2, stream, &bounce));
/// char* buf = nullptr;
/// DDO_RETURN_IF_ERROR(bounce->acquire(&buf));        // waits for the copies out of it last time
/// read_into(buf, n);                                  // the host fills up to buffer_bytes()
/// DDO_RETURN_IF_ERROR(bounce->copy_out(dst, 0, n));   // async on `stream`
/// DDO_RETURN_IF_ERROR(bounce->release());             // records when the buffer is free again
/// DDO_RETURN_IF_ERROR(bounce->drain());               // every copy has landed
/// ```
#pragma once

#include <cstddef>
#include <memory>
#include <tuple>
#include <vector>

#include "ddo/core/status.h"
#include "ddo/engine/device.h"

namespace ddo::engine {

/// `jobs` (dst, src, bytes) copied with up to `workers` threads (1: on the calling thread).
void parallel_memcpy(const std::vector<std::tuple<void*, const void*, std::size_t>>& jobs,
                     int workers);

/// Copies `n` bytes of ordinary host memory at `src` to device memory at `dst` on `stream`,
/// registering the whole pages inside the source for the copy when that is worth it (4 MiB and
/// more, a backend with host_register). Registered pointers are appended to `registered`: the
/// caller unregisters them after synchronizing `stream`. A source the driver refuses to register
/// is copied pageable (slower, never wrong).
Status copy_to_device_registered(Device& device, char* dst, const char* src, std::size_t n,
                                 Stream stream, std::vector<void*>* registered);

/// A few pinned host buffers that carry bytes to the device in turn: the host fills one while the
/// copies out of the previous ones run. Not thread-safe: one host thread drives it.
class BounceBuffers {
 public:
  /// `count` (>= 1) buffers of `buffer_bytes` (> 0) each, pinned through `device`; copies go on
  /// `stream`, which the caller keeps alive until drain() or destruction. kResourceExhausted when
  /// the host memory cannot be pinned.
  static Status create(Device& device, std::size_t buffer_bytes, int count, Stream stream,
                       std::unique_ptr<BounceBuffers>* out);
  /// Waits for every copy, then frees the buffers.
  ~BounceBuffers();
  BounceBuffers(const BounceBuffers&) = delete;
  BounceBuffers& operator=(const BounceBuffers&) = delete;

  /// The capacity of each buffer: the most one acquire() lets the host fill.
  std::size_t buffer_bytes() const { return buffer_bytes_; }

  /// The next buffer in turn, once the copies issued out of it last time have landed.
  /// kFailedPrecondition while a buffer is already held (release() it first).
  Status acquire(char** data);
  /// Copies `bytes` at `offset` of the held buffer to device memory at `dst`, asynchronously.
  /// kInvalidArgument past the buffer's end, kFailedPrecondition without a held buffer.
  Status copy_out(void* dst, std::size_t offset, std::size_t bytes);
  /// Gives the held buffer back: it is reused after the copies issued out of it so far.
  Status release();
  /// Waits for every copy issued (a held buffer is released first).
  Status drain();

  /// Bytes copied out so far.
  std::size_t bytes_copied() const { return bytes_copied_; }

 private:
  struct Buffer {
    char* data = nullptr;
    Event copied = nullptr;  // recorded after the last copy out of it; null before any
  };
  BounceBuffers(Device& device, std::size_t buffer_bytes, Stream stream);

  Device& device_;
  std::size_t buffer_bytes_;
  Stream stream_;
  std::vector<Buffer> buffers_;
  std::size_t next_ = 0;  // the buffer acquire() gives next
  int held_ = -1;         // the buffer acquired and not yet released, or -1
  std::size_t bytes_copied_ = 0;
};

}  // namespace ddo::engine
