// The same contract cases on every backend: the simulation always, CUDA when a GPU is present
// (the CUDA cases skip, and say so, on machines without one; see backends.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "backends.h"
#include "ddo/engine/device.h"
#include "ddo/engine/sim_faults.h"

namespace ddo::engine {
namespace {

constexpr std::int64_t kSimCapacity = std::int64_t{256} << 20;
constexpr std::int64_t kSimPinnable = std::int64_t{64} << 20;

class DeviceContract : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    SimDeviceOptions options;
    options.capacity_bytes = kSimCapacity;
    options.pinnable_bytes = kSimPinnable;
    options.copy_bytes_per_second = 4e9;  // slow enough that ordering bugs show
    device_ = sim() ? make_sim_device(options, faults_) : open_device(options);
    ASSERT_NE(device_, nullptr);
  }

  std::vector<std::uint8_t> pattern(std::size_t bytes, std::uint8_t seed) {
    std::vector<std::uint8_t> v(bytes);
    for (std::size_t i = 0; i < bytes; ++i)
      v[i] = static_cast<std::uint8_t>(seed + i * 131 + (i >> 9));
    return v;
  }

  // The simulation's: holding its stream copies shows "issued, not finished" on any machine.
  std::shared_ptr<SimFaults> faults_ = std::make_shared<SimFaults>();
  std::unique_ptr<Device> device_;
};

TEST_P(DeviceContract, CapsNameTheBackend) {
  const DeviceCaps caps = device_->caps();
  EXPECT_EQ(caps.kind, sim() ? DeviceKind::kSim : DeviceKind::kCuda);
  EXPECT_FALSE(caps.name.empty());
  EXPECT_TRUE(caps.timing_events);
}

TEST_P(DeviceContract, AllocateDeallocateAndMemoryFigures) {
  const DeviceMemory before = device_->memory();
  EXPECT_GT(before.total_bytes, 0);
  EXPECT_GE(before.used_bytes, 0);
  EXPECT_LE(before.used_bytes, before.total_bytes);

  void* ptr = nullptr;
  constexpr std::size_t kBytes = std::size_t{8} << 20;
  ASSERT_TRUE(device_->allocate(kBytes, &ptr).ok());
  ASSERT_NE(ptr, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ptr) % 64, 0u);
  const DeviceMemory during = device_->memory();
  if (sim()) {
    EXPECT_EQ(during.total_bytes, kSimCapacity);
    EXPECT_EQ(during.used_bytes, before.used_bytes + static_cast<std::int64_t>(kBytes));
  } else {
    EXPECT_GE(during.used_bytes, before.used_bytes);  // the driver may round up
  }
  device_->deallocate(ptr);
  if (sim()) {
    EXPECT_EQ(device_->memory().used_bytes, before.used_bytes);
  }
}

TEST_P(DeviceContract, AllocationBeyondCapacityFailsNamingSizes) {
  void* ptr = nullptr;
  const std::size_t huge = sim() ? static_cast<std::size_t>(kSimCapacity) + 1
                                 : std::size_t{1} << 50;  // 1 PiB: no card has it
  Status status = device_->allocate(huge, &ptr);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), Code::kResourceExhausted);
  EXPECT_EQ(ptr, nullptr);
  EXPECT_NE(status.message().find(std::to_string(huge)), std::string::npos) << status.message();
  if (sim()) {
    // Live allocations count: two halves fit, a third byte more does not.
    void* a = nullptr;
    void* b = nullptr;
    ASSERT_TRUE(device_->allocate(kSimCapacity / 2, &a).ok());
    ASSERT_TRUE(device_->allocate(kSimCapacity / 2, &b).ok());
    void* c = nullptr;
    Status full = device_->allocate(1, &c);
    EXPECT_EQ(full.code(), Code::kResourceExhausted);
    EXPECT_NE(full.message().find(std::to_string(kSimCapacity)), std::string::npos);
    device_->deallocate(a);
    ASSERT_TRUE(device_->allocate(1, &c).ok());
    device_->deallocate(b);
    device_->deallocate(c);
  }
}

TEST_P(DeviceContract, HostAllocationAndPinLimit) {
  void* host = nullptr;
  ASSERT_TRUE(device_->allocate_host(std::size_t{1} << 20, &host).ok());
  ASSERT_NE(host, nullptr);
  std::memset(host, 7, std::size_t{1} << 20);  // the memory is usable from the host
  device_->deallocate_host(host);
  if (!sim()) return;
  // The simulated pin limit: allocation past it fails so callers can test their fallback.
  void* a = nullptr;
  ASSERT_TRUE(device_->allocate_host(static_cast<std::size_t>(kSimPinnable) - 100, &a).ok());
  void* b = nullptr;
  Status status = device_->allocate_host(200, &b);
  EXPECT_EQ(status.code(), Code::kResourceExhausted);
  EXPECT_EQ(b, nullptr);
  // register_host shares the same limit.
  std::vector<char> owned(200);
  EXPECT_EQ(device_->register_host(owned.data(), owned.size()).code(), Code::kResourceExhausted);
  device_->deallocate_host(a);
  EXPECT_TRUE(device_->register_host(owned.data(), owned.size()).ok());
  device_->unregister_host(owned.data());
}

TEST_P(DeviceContract, RegisteredHostMemoryCopies) {
  ASSERT_TRUE(device_->caps().host_register);
  std::vector<std::uint8_t> src = pattern(std::size_t{2} << 20, 3);
  ASSERT_TRUE(device_->register_host(src.data(), src.size()).ok());
  void* d = nullptr;
  ASSERT_TRUE(device_->allocate(src.size(), &d).ok());
  Stream s = device_->create_stream();
  ASSERT_TRUE(device_->copy_to_device_async(d, src.data(), src.size(), s).ok());
  device_->synchronize_stream(s);
  std::vector<std::uint8_t> back(src.size());
  ASSERT_TRUE(device_->copy_to_host(back.data(), d, back.size()).ok());
  EXPECT_EQ(back, src);
  device_->destroy_stream(s);
  device_->deallocate(d);
  device_->unregister_host(src.data());
}

// A copy on stream A, an event, and a device-to-device copy on stream B that waits on it: B must
// see the data, which a missing wait would not give with a slow copy on A.
TEST_P(DeviceContract, AsyncCopyEventWaitOrdering) {
  constexpr std::size_t kBytes = std::size_t{32} << 20;
  void* host = nullptr;
  ASSERT_TRUE(device_->allocate_host(kBytes, &host).ok());
  std::vector<std::uint8_t> expected = pattern(kBytes, 11);
  std::memcpy(host, expected.data(), kBytes);
  void* d1 = nullptr;
  void* d2 = nullptr;
  ASSERT_TRUE(device_->allocate(kBytes, &d1).ok());
  ASSERT_TRUE(device_->allocate(kBytes, &d2).ok());
  Stream a = device_->create_stream();
  Stream b = device_->create_stream();
  Event copied = device_->create_event();
  Event moved = device_->create_event();

  ASSERT_TRUE(device_->copy_to_device_async(d1, host, kBytes, a).ok());
  device_->record_event(copied, a);
  device_->stream_wait_event(b, copied);
  ASSERT_TRUE(device_->copy_on_device_async(d2, d1, kBytes, b).ok());
  device_->record_event(moved, b);
  device_->synchronize_event(moved);
  EXPECT_TRUE(device_->event_done(moved));
  EXPECT_TRUE(device_->event_done(copied));

  std::vector<std::uint8_t> back(kBytes);
  ASSERT_TRUE(device_->copy_to_host(back.data(), d2, kBytes).ok());
  EXPECT_TRUE(back == expected);

  device_->destroy_event(copied);
  device_->destroy_event(moved);
  device_->destroy_stream(a);
  device_->destroy_stream(b);
  device_->deallocate(d1);
  device_->deallocate(d2);
  device_->deallocate_host(host);
}

// The caller's stream waits on a side-stream event; afterwards the side stream's work is visible.
TEST_P(DeviceContract, DefaultStreamWaitsOnSideStream) {
  constexpr std::size_t kBytes = std::size_t{16} << 20;
  std::vector<std::uint8_t> expected = pattern(kBytes, 5);
  void* host = nullptr;
  ASSERT_TRUE(device_->allocate_host(kBytes, &host).ok());
  std::memcpy(host, expected.data(), kBytes);
  void* d = nullptr;
  ASSERT_TRUE(device_->allocate(kBytes, &d).ok());
  Stream copy = device_->create_stream();
  Event done = device_->create_event();
  ASSERT_TRUE(device_->copy_to_device_async(d, host, kBytes, copy).ok());
  device_->record_event(done, copy);
  device_->stream_wait_event(kDefaultStream, done);
  if (sim()) {  // the caller is the default stream
    EXPECT_TRUE(device_->event_done(done));
  }
  device_->synchronize_stream(kDefaultStream);
  std::vector<std::uint8_t> back(kBytes);
  ASSERT_TRUE(device_->copy_to_host(back.data(), d, kBytes).ok());
  EXPECT_TRUE(back == expected);
  device_->destroy_event(done);
  device_->destroy_stream(copy);
  device_->deallocate(d);
  device_->deallocate_host(host);
}

TEST_P(DeviceContract, ElapsedTimeOfACopyIsPositive) {
  constexpr std::size_t kBytes = std::size_t{32} << 20;
  void* host = nullptr;
  ASSERT_TRUE(device_->allocate_host(kBytes, &host).ok());
  std::memset(host, 1, kBytes);
  void* d = nullptr;
  ASSERT_TRUE(device_->allocate(kBytes, &d).ok());
  Stream s = device_->create_stream();
  Event start = device_->create_event(/*timing=*/true);
  Event end = device_->create_event(/*timing=*/true);
  device_->record_event(start, s);
  ASSERT_TRUE(device_->copy_to_device_async(d, host, kBytes, s).ok());
  device_->record_event(end, s);
  device_->synchronize_event(end);
  const float ms = device_->elapsed_ms(start, end);
  EXPECT_GT(ms, 0.0f);
  if (sim()) {  // 32 MiB at 4 GB/s is about 8.4 ms
    EXPECT_GE(ms, 7.0f);
  }
  device_->destroy_event(start);
  device_->destroy_event(end);
  device_->destroy_stream(s);
  device_->deallocate(d);
  device_->deallocate_host(host);
}

// Recording again resets an event; a stream wait waits for the record current at the call.
TEST_P(DeviceContract, EventRecordedAgainResets) {
  Event e = device_->create_event();
  EXPECT_TRUE(device_->event_done(e));  // never recorded: done, as in CUDA
  device_->record_event(e, kDefaultStream);
  device_->synchronize_event(e);
  EXPECT_TRUE(device_->event_done(e));
  if (sim()) {
    constexpr std::size_t kBytes = std::size_t{1} << 20;
    std::vector<std::uint8_t> src(kBytes, 1);
    void* d = nullptr;
    ASSERT_TRUE(device_->allocate(kBytes, &d).ok());
    Stream s = device_->create_stream();
    faults_->hold_stream_copies();  // the copy is issued and cannot finish until released
    ASSERT_TRUE(device_->copy_to_device_async(d, src.data(), kBytes, s).ok());
    device_->record_event(e, s);
    EXPECT_FALSE(device_->event_done(e));
    faults_->release_stream_copies();
    device_->stream_wait_event(kDefaultStream, e);
    EXPECT_TRUE(device_->event_done(e));
    device_->destroy_stream(s);
    device_->deallocate(d);
  }
  device_->destroy_event(e);
}

TEST_P(DeviceContract, DestroyingAStreamDrainsIt) {
  constexpr std::size_t kBytes = std::size_t{8} << 20;
  std::vector<std::uint8_t> expected = pattern(kBytes, 9);
  void* d = nullptr;
  ASSERT_TRUE(device_->allocate(kBytes, &d).ok());
  Stream s = device_->create_stream();
  ASSERT_TRUE(device_->copy_to_device_async(d, expected.data(), kBytes, s).ok());
  // CUDA completes a destroyed stream's work but its copy_to_host does not order after it; the
  // simulation's destroy_stream itself must drain.
  if (!sim()) device_->synchronize_stream(s);
  device_->destroy_stream(s);
  std::vector<std::uint8_t> back(kBytes);
  ASSERT_TRUE(device_->copy_to_host(back.data(), d, kBytes).ok());
  EXPECT_TRUE(back == expected);
  device_->deallocate(d);
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceContract, kBackends, backend_name);

TEST(CudaBackend, UnavailableWithoutAGpuSaysSo) {
  if (cuda_available()) GTEST_SKIP() << "a CUDA GPU is present; nothing to check here";
  std::unique_ptr<Device> device;
  Status status = make_cuda_device({}, &device);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(device, nullptr);
  EXPECT_FALSE(status.message().empty());
}

}  // namespace
}  // namespace ddo::engine
