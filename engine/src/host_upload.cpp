#include "ddo/engine/host_upload.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>

#include "ddo/core/status.h"

// Note [Host uploads]
// ~~~~~~~~~~~~~~~~~~~
// Setup copies every weight once, and how fast depends on where its bytes are:
//
// * Pageable memory already paged in (a CPU model's residents). The driver copies pageable
//   memory through its own bounce buffers at about 6 GB/s on the H200 machine, while registering
//   memory that is already paged in runs at 14.7 GB/s and a copy from it at 53 GB/s (measured
//   with bench/copy_engine.cpp). So each large source is registered for
//   the duration of its copy: only the pages lying wholly inside the tensor, so no page is ever
//   registered twice by two neighbouring tensors; the unaligned head and tail (under a page each)
//   go the pageable way. A source the driver refuses (already pinned, read-only mapping, pin
//   limit) is copied pageable: slower, never wrong. Registration of the next tensor overlaps the
//   previous tensor's copy.
//
// * Bytes that do not exist yet (the loader's residents, read from a file). Reading them into
//   fresh pageable memory and registering that costs a page fault per page, a registration and a
//   copy, one after the other. A reused pinned buffer costs none of the first two: the reader
//   writes into it, the copy reads from it at the pinned rate, and with two or more buffers the
//   next read overlaps the previous copy, so the upload runs at about max(read, copy) instead of
//   their sum, and host RAM never holds more than the buffers.
//
// * Host to host (filling slabs): plain memcpy on a few threads; one thread does not saturate the
//   memory bus.

namespace ddo::engine {

void parallel_memcpy(const std::vector<std::tuple<void*, const void*, std::size_t>>& jobs,
                     int workers) {
  workers = std::max(1, std::min<int>(workers, static_cast<int>(jobs.size())));
  if (workers == 1) {
    for (const auto& [dst, src, n] : jobs) std::memcpy(dst, src, n);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(workers));
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      for (std::size_t i = next++; i < jobs.size(); i = next++) {
        const auto& [dst, src, n] = jobs[i];
        std::memcpy(dst, src, n);
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

namespace {
constexpr std::size_t kRegisterMinBytes = std::size_t{4} << 20;
constexpr std::uintptr_t kPageBytes = 4096;
}  // namespace

Status copy_to_device_registered(Device& device, char* dst, const char* src, std::size_t n,
                                 Stream stream, std::vector<void*>* registered) {
  // Note [Host uploads], first case.
  if (n >= kRegisterMinBytes && device.caps().host_register) {
    const auto begin = reinterpret_cast<std::uintptr_t>(src);
    const std::uintptr_t lo = (begin + kPageBytes - 1) / kPageBytes * kPageBytes;
    const std::uintptr_t hi = (begin + n) / kPageBytes * kPageBytes;
    if (hi > lo && hi - lo >= kRegisterMinBytes) {
      void* interior = reinterpret_cast<void*>(lo);
      if (device.register_host(interior, hi - lo).ok()) {
        registered->push_back(interior);
        const std::size_t head = lo - begin;
        const std::size_t tail = begin + n - hi;
        if (head > 0) DDO_RETURN_IF_ERROR(device.copy_to_device_async(dst, src, head, stream));
        DDO_RETURN_IF_ERROR(device.copy_to_device_async(dst + head, interior, hi - lo, stream));
        if (tail > 0) {
          DDO_RETURN_IF_ERROR(device.copy_to_device_async(
              dst + head + (hi - lo), reinterpret_cast<const char*>(hi), tail, stream));
        }
        return Status::ok_status();
      }
    }
  }
  return device.copy_to_device_async(dst, src, n, stream);
}

// --- BounceBuffers -------------------------------------------------------------------------------

BounceBuffers::BounceBuffers(Device& device, std::size_t buffer_bytes, Stream stream)
    : device_(device), buffer_bytes_(buffer_bytes), stream_(stream) {}

Status BounceBuffers::create(Device& device, std::size_t buffer_bytes, int count, Stream stream,
                             std::unique_ptr<BounceBuffers>* out) {
  if (buffer_bytes == 0 || count < 1) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("bounce buffers need a size > 0 and a count >= 1 (got ",
                                    buffer_bytes, " bytes x ", count, ")"));
  }
  std::unique_ptr<BounceBuffers> b(new BounceBuffers(device, buffer_bytes, stream));
  for (int i = 0; i < count; ++i) {
    void* p = nullptr;
    const Status st = device.allocate_host(buffer_bytes, &p);
    if (!st.ok()) {
      return Status(Code::kResourceExhausted,
                    internal::str_cat("pinning a ", buffer_bytes, "-byte bounce buffer (", i + 1,
                                      " of ", count, ") failed: ", st.message()));
    }
    b->buffers_.push_back({static_cast<char*>(p), nullptr});
  }
  *out = std::move(b);
  return Status::ok_status();
}

BounceBuffers::~BounceBuffers() {
  // The copies read the buffers: they must land before the memory goes back.
  for (Buffer& b : buffers_) {
    if (b.copied != nullptr) {
      device_.synchronize_event(b.copied);
      device_.destroy_event(b.copied);
    }
  }
  if (held_ >= 0) device_.synchronize_stream(stream_);  // copies issued but not yet recorded
  for (Buffer& b : buffers_) device_.deallocate_host(b.data);
}

Status BounceBuffers::acquire(char** data) {
  if (held_ >= 0) {
    return Status(Code::kFailedPrecondition,
                  "BounceBuffers::acquire while a buffer is held: release() it first");
  }
  Buffer& b = buffers_[next_];
  if (b.copied != nullptr) device_.synchronize_event(b.copied);
  held_ = static_cast<int>(next_);
  next_ = (next_ + 1) % buffers_.size();
  *data = b.data;
  return Status::ok_status();
}

Status BounceBuffers::copy_out(void* dst, std::size_t offset, std::size_t bytes) {
  if (held_ < 0) {
    return Status(Code::kFailedPrecondition,
                  "BounceBuffers::copy_out without a held buffer: acquire() one first");
  }
  if (offset > buffer_bytes_ || bytes > buffer_bytes_ - offset) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("bounce copy of ", bytes, " bytes at offset ", offset,
                                    " runs past the ", buffer_bytes_, "-byte buffer"));
  }
  if (bytes == 0) return Status::ok_status();
  DDO_RETURN_IF_ERROR(device_.copy_to_device_async(
      dst, buffers_[static_cast<std::size_t>(held_)].data + offset, bytes, stream_));
  bytes_copied_ += bytes;
  return Status::ok_status();
}

Status BounceBuffers::release() {
  if (held_ < 0) {
    return Status(Code::kFailedPrecondition,
                  "BounceBuffers::release without a held buffer: acquire() one first");
  }
  Buffer& b = buffers_[static_cast<std::size_t>(held_)];
  if (b.copied == nullptr) b.copied = device_.create_event();
  if (b.copied == nullptr) {
    // No event to poll: wait for the copies now rather than risk overwriting their source.
    device_.synchronize_stream(stream_);
  } else {
    device_.record_event(b.copied, stream_);
  }
  held_ = -1;
  return Status::ok_status();
}

Status BounceBuffers::drain() {
  if (held_ >= 0) DDO_RETURN_IF_ERROR(release());
  device_.synchronize_stream(stream_);
  return Status::ok_status();
}

}  // namespace ddo::engine
