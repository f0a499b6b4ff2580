#include "ddo/engine/host_upload.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <tuple>
#include <vector>

#include "backends.h"

namespace ddo::engine {
namespace {

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131 + seed) % 251);
  return v;
}

class HostUploadTest : public BackendTest {};

// Many pieces through two small buffers, each buffer refilled while the copies out of the other
// may still run: every byte lands where it was sent (a buffer reused too early would overwrite a
// copy's source and show up as wrong bytes).
TEST_P(HostUploadTest, BounceBuffersCarryEveryByte) {
  // The simulated copies are throttled so that they are still running when the host refills.
  std::unique_ptr<Device> device =
      open_device({.capacity_bytes = 64 << 20, .copy_bytes_per_second = 2e9});
  ASSERT_TRUE(device);
  constexpr std::size_t kBuffer = 1 << 20;
  constexpr std::size_t kTotal = 24 << 20;  // 24 fills of each buffer in turn
  void* dst = nullptr;
  ASSERT_TRUE(device->allocate(kTotal, &dst).ok());
  Stream stream = device->create_stream();
  const std::vector<unsigned char> want = pattern(kTotal, 7);
  {
    std::unique_ptr<BounceBuffers> bounce;
    ASSERT_TRUE(BounceBuffers::create(*device, kBuffer, 2, stream, &bounce).ok());
    EXPECT_EQ(bounce->buffer_bytes(), kBuffer);
    for (std::size_t at = 0; at < kTotal; at += kBuffer) {
      char* buf = nullptr;
      ASSERT_TRUE(bounce->acquire(&buf).ok());
      std::memcpy(buf, want.data() + at, kBuffer);
      // Two copies out of one buffer: halves, at their offsets.
      ASSERT_TRUE(bounce->copy_out(static_cast<char*>(dst) + at, 0, kBuffer / 2).ok());
      ASSERT_TRUE(
          bounce->copy_out(static_cast<char*>(dst) + at + kBuffer / 2, kBuffer / 2, kBuffer / 2)
              .ok());
      ASSERT_TRUE(bounce->release().ok());
    }
    ASSERT_TRUE(bounce->drain().ok());
    EXPECT_EQ(bounce->bytes_copied(), kTotal);
  }
  std::vector<unsigned char> got(kTotal);
  ASSERT_TRUE(device->copy_to_host(got.data(), dst, kTotal).ok());
  EXPECT_EQ(got, want);
  device->destroy_stream(stream);
  device->deallocate(dst);
}

TEST_P(HostUploadTest, BounceBuffersRejectMisuseWithTheCallToMake) {
  std::unique_ptr<Device> device = open_device({.capacity_bytes = 16 << 20});
  ASSERT_TRUE(device);
  Stream stream = device->create_stream();
  std::unique_ptr<BounceBuffers> bounce;
  Status st = BounceBuffers::create(*device, 0, 2, stream, &bounce);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("size > 0"), std::string::npos) << st.message();
  EXPECT_EQ(BounceBuffers::create(*device, 4096, 0, stream, &bounce).code(),
            Code::kInvalidArgument);
  ASSERT_TRUE(BounceBuffers::create(*device, 4096, 1, stream, &bounce).ok());
  void* dst = nullptr;
  ASSERT_TRUE(device->allocate(8192, &dst).ok());
  st = bounce->copy_out(dst, 0, 16);
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("acquire() one first"), std::string::npos) << st.message();
  EXPECT_EQ(bounce->release().code(), Code::kFailedPrecondition);
  char* buf = nullptr;
  ASSERT_TRUE(bounce->acquire(&buf).ok());
  EXPECT_EQ(bounce->acquire(&buf).code(), Code::kFailedPrecondition);
  st = bounce->copy_out(dst, 4000, 100);  // past the 4096-byte buffer
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("runs past the 4096-byte buffer"), std::string::npos) << st.message();
  EXPECT_EQ(bounce->bytes_copied(), 0u);
  ASSERT_TRUE(bounce->drain().ok());  // releases the held buffer
  ASSERT_TRUE(bounce->acquire(&buf).ok());
  bounce.reset();  // destroyed while held: waits, frees, no leak (ASan)
  device->deallocate(dst);
  device->destroy_stream(stream);
}

// Sources large enough to register (4 MiB and more), at an offset that is not page-aligned, so
// the head and the tail go the pageable way and the interior registered: all bytes arrive.
TEST_P(HostUploadTest, RegisteredCopyOfAnUnalignedSource) {
  std::unique_ptr<Device> device = open_device({.capacity_bytes = 64 << 20});
  ASSERT_TRUE(device);
  constexpr std::size_t kBytes = (6 << 20) + 123;
  const std::vector<unsigned char> storage = pattern(kBytes + 4096, 3);
  const char* src = reinterpret_cast<const char*>(storage.data()) + 77;
  void* dst = nullptr;
  ASSERT_TRUE(device->allocate(kBytes, &dst).ok());
  Stream stream = device->create_stream();
  std::vector<void*> registered;
  ASSERT_TRUE(
      copy_to_device_registered(*device, static_cast<char*>(dst), src, kBytes, stream, &registered)
          .ok());
  device->synchronize_stream(stream);
  if (device->caps().host_register) {
    EXPECT_EQ(registered.size(), 1u);
  }
  for (void* p : registered) device->unregister_host(p);
  std::vector<char> got(kBytes);
  ASSERT_TRUE(device->copy_to_host(got.data(), dst, kBytes).ok());
  EXPECT_EQ(std::memcmp(got.data(), src, kBytes), 0);
  device->destroy_stream(stream);
  device->deallocate(dst);
}

INSTANTIATE_TEST_SUITE_P(Backends, HostUploadTest, kBackends, backend_name);

TEST(ParallelMemcpy, EveryJobOnAnyNumberOfWorkers) {
  for (int workers : {1, 3, 16}) {
    std::vector<std::vector<unsigned char>> src, dst;
    std::vector<std::tuple<void*, const void*, std::size_t>> jobs;
    for (unsigned j = 0; j < 9; ++j) {
      src.push_back(pattern(1000 + 997 * j, j));
      dst.emplace_back(src.back().size(), 0);
    }
    for (std::size_t j = 0; j < src.size(); ++j) {
      jobs.emplace_back(dst[j].data(), src[j].data(), src[j].size());
    }
    parallel_memcpy(jobs, workers);
    EXPECT_EQ(dst, src) << workers << " workers";
  }
}

}  // namespace
}  // namespace ddo::engine
