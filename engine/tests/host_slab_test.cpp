#include "ddo/engine/host_slab.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "ddo/core/units.h"

namespace ddo::engine {
namespace {

constexpr std::size_t kAlign = 256;

std::size_t align_up(std::size_t v) {
  return core::align_up(v, kAlign);
}

std::unique_ptr<Device> sim(std::int64_t pinnable = -1) {
  SimDeviceOptions options;
  options.pinnable_bytes = pinnable;
  return make_sim_device(options);
}

TEST(HostSlabs, ExactSizesWithoutPowerOfTwoRounding) {
  auto device = sim();
  // Odd sizes: a power-of-two allocator would round 1000001 up to 1048576.
  std::vector<SlabTensor> tensors = {
      {1000001, true}, {300, true}, {77777, true}, {5, false}, {123457, false}};
  std::unique_ptr<HostSlabs> slabs;
  Status status = HostSlabs::create(*device, tensors, {}, &slabs);
  ASSERT_TRUE(status.ok()) << status.to_string();
  const HostSlabStats& st = slabs->stats();
  EXPECT_EQ(st.pinned_slabs, 1);
  EXPECT_EQ(st.pageable_slabs, 1);
  EXPECT_EQ(st.pinned_bytes, 1000001 + 300 + 77777);
  EXPECT_EQ(st.pageable_bytes, 5 + 123457);
  // Each slab: every tensor but the last starts aligned; no trailing padding.
  const std::int64_t pinned_slab = align_up(align_up(1000001) + 300) + 77777;
  const std::int64_t pageable_slab = align_up(5) + 123457;
  EXPECT_EQ(st.slab_bytes, pinned_slab + pageable_slab);
  EXPECT_EQ(st.pin_fallback_bytes, 0);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slabs->tensor_ptr(i)) % kAlign, 0u) << i;
    EXPECT_EQ(slabs->tensor_pinned(i), tensors[i].want_pinned) << i;
  }
  EXPECT_EQ(static_cast<char*>(slabs->tensor_ptr(1)) - static_cast<char*>(slabs->tensor_ptr(0)),
            static_cast<std::ptrdiff_t>(align_up(1000001)));
  EXPECT_EQ(slabs->size(), tensors.size());
}

TEST(HostSlabs, SplitsAtMaxSlabBytesAndGivesOversizedTensorsTheirOwnSlab) {
  auto device = sim();
  HostSlabOptions options;
  options.max_slab_bytes = 10000;
  // 4000 + 4000 fit (4000 is 256-aligned? no: second starts at 4096, ends 8096); a third does not.
  std::vector<SlabTensor> tensors = {
      {4000, true}, {4000, true}, {4000, true}, {25000, true}, {100, true}};
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(HostSlabs::create(*device, tensors, options, &slabs).ok());
  const HostSlabStats& st = slabs->stats();
  // [4000, 4000] [4000] [25000] [100]
  EXPECT_EQ(st.pinned_slabs, 4);
  EXPECT_EQ(st.slab_bytes, (4096 + 4000) + 4000 + 25000 + 100);
  EXPECT_EQ(st.pinned_bytes, 4000 * 3 + 25000 + 100);
}

TEST(HostSlabs, PinFailureFallsBackToOrdinaryMemory) {
  auto device = sim(/*pinnable=*/15000);
  HostSlabOptions options;
  options.max_slab_bytes = 10000;
  std::vector<SlabTensor> tensors = {{9000, true}, {9000, true}, {3000, true}, {500, false}};
  std::unique_ptr<HostSlabs> slabs;
  Status status = HostSlabs::create(*device, tensors, options, &slabs);
  ASSERT_TRUE(status.ok()) << status.to_string();
  const HostSlabStats& st = slabs->stats();
  // Slabs [9000] [9000] [3000]: the first pins (9000 <= 15000), the second does not, the third
  // still fits under the limit (12000).
  EXPECT_TRUE(slabs->tensor_pinned(0));
  EXPECT_FALSE(slabs->tensor_pinned(1));
  EXPECT_TRUE(slabs->tensor_pinned(2));
  EXPECT_FALSE(slabs->tensor_pinned(3));
  EXPECT_EQ(st.pin_fallback_bytes, 9000);
  EXPECT_EQ(st.pinned_bytes, 12000);
  EXPECT_EQ(st.pageable_bytes, 9500);
  // Everything still usable.
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<const void*> sources;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    data.emplace_back(tensors[i].bytes, static_cast<std::uint8_t>(i + 1));
  }
  for (auto& d : data) sources.push_back(d.data());
  slabs->fill(sources, 2);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(std::memcmp(slabs->tensor_ptr(i), data[i].data(), data[i].size()), 0) << i;
  }
}

TEST(HostSlabs, PinFailureWithoutFallbackNamesSizesAndTheOption) {
  auto device = sim(/*pinnable=*/15000);
  HostSlabOptions options;
  options.max_slab_bytes = 10000;
  options.allow_pin_fallback = false;
  std::unique_ptr<HostSlabs> slabs;
  Status status = HostSlabs::create(*device, {{9000, true}, {9000, true}}, options, &slabs);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), Code::kResourceExhausted);
  EXPECT_EQ(slabs, nullptr);
  EXPECT_NE(status.message().find("9000"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("18000"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("DDO_ALLOW_PIN_MEMORY_FALLBACK"), std::string::npos);
  // The slab that did pin was given back.
  void* probe = nullptr;
  EXPECT_TRUE(device->allocate_host(15000, &probe).ok());
  device->deallocate_host(probe);
}

TEST(HostSlabs, PinByRegisterRegistersAfterTheFill) {
  auto device = sim(/*pinnable=*/20000);
  HostSlabOptions options;
  options.pin_by_register = true;
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(HostSlabs::create(*device, {{12345, true}, {99, false}}, options, &slabs).ok());
  // Not pinned until registered: nothing of the pin budget is used yet.
  EXPECT_FALSE(slabs->tensor_pinned(0));
  EXPECT_EQ(slabs->stats().pinned_bytes, 0);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slabs->tensor_ptr(0)) % 4096, 0u);
  std::vector<std::uint8_t> a(12345), b(99);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::uint8_t>(i * 7);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint8_t>(i + 1);
  slabs->fill({a.data(), b.data()}, 2);
  ASSERT_TRUE(slabs->pin_registered(2).ok());
  EXPECT_TRUE(slabs->tensor_pinned(0));
  EXPECT_FALSE(slabs->tensor_pinned(1));
  EXPECT_EQ(slabs->stats().pinned_bytes, 12345);
  EXPECT_EQ(std::memcmp(slabs->tensor_ptr(0), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(slabs->tensor_ptr(1), b.data(), b.size()), 0);
  // The pin budget is in use by the registration.
  EXPECT_EQ(device->register_host(&options, 10000).code(), Code::kResourceExhausted);
  // A second call has nothing left to do.
  EXPECT_TRUE(slabs->pin_registered(2).ok());
  slabs.reset();
  EXPECT_TRUE(device->register_host(&options, 10000).ok());
  device->unregister_host(&options);
}

TEST(HostSlabs, RegisterFailureFallsBackKeepingTheData) {
  auto device = sim(/*pinnable=*/15000);
  HostSlabOptions options;
  options.pin_by_register = true;
  options.max_slab_bytes = 10000;
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(
      HostSlabs::create(*device, {{9000, true}, {9000, true}, {9000, true}}, options, &slabs).ok());
  std::vector<std::vector<std::uint8_t>> data(3, std::vector<std::uint8_t>(9000));
  std::vector<const void*> sources;
  for (std::size_t t = 0; t < 3; ++t) {
    for (std::size_t i = 0; i < 9000; ++i) data[t][i] = static_cast<std::uint8_t>(i * (t + 3));
    sources.push_back(data[t].data());
  }
  slabs->fill(sources, 3);
  ASSERT_TRUE(slabs->pin_registered(3).ok());
  // Only one 9000-byte slab fits the 15000-byte budget; the others stay ordinary memory.
  int pinned = 0;
  for (std::size_t t = 0; t < 3; ++t) {
    pinned += slabs->tensor_pinned(t) ? 1 : 0;
    EXPECT_EQ(std::memcmp(slabs->tensor_ptr(t), data[t].data(), 9000), 0) << t;
  }
  EXPECT_EQ(pinned, 1);
  EXPECT_EQ(slabs->stats().pinned_bytes, 9000);
  EXPECT_EQ(slabs->stats().pin_fallback_bytes, 18000);
  EXPECT_EQ(slabs->stats().pageable_bytes, 18000);
}

TEST(HostSlabs, RegisterFailureWithoutFallbackNamesTheOption) {
  auto device = sim(/*pinnable=*/15000);
  HostSlabOptions options;
  options.pin_by_register = true;
  options.allow_pin_fallback = false;
  options.max_slab_bytes = 10000;
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(HostSlabs::create(*device, {{9000, true}, {9000, true}}, options, &slabs).ok());
  std::vector<std::uint8_t> a(9000, 1), b(9000, 2);
  slabs->fill({a.data(), b.data()}, 1);
  Status status = slabs->pin_registered(1);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), Code::kResourceExhausted);
  EXPECT_NE(status.message().find("DDO_ALLOW_PIN_MEMORY_FALLBACK"), std::string::npos)
      << status.message();
  // Nothing already copied is lost.
  EXPECT_EQ(std::memcmp(slabs->tensor_ptr(1), b.data(), b.size()), 0);
}

TEST(HostSlabs, FillWithSeveralWorkersCopiesEveryByte) {
  auto device = sim();
  std::mt19937_64 rng(42);
  std::vector<SlabTensor> tensors;
  // One large tensor (split across threads) and many small ones.
  tensors.push_back({std::size_t{24} << 20, true});
  for (int i = 0; i < 200; ++i) {
    tensors.push_back({static_cast<std::size_t>(rng() % 200000 + 1), (i % 3) != 0});
  }
  HostSlabOptions options;
  options.max_slab_bytes = std::size_t{8} << 20;
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(HostSlabs::create(*device, tensors, options, &slabs).ok());
  std::vector<std::vector<std::uint8_t>> data(tensors.size());
  std::vector<const void*> sources;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    data[i].resize(tensors[i].bytes);
    for (auto& b : data[i]) b = static_cast<std::uint8_t>(rng());
    sources.push_back(data[i].data());
  }
  for (int workers : {1, 3, 8}) {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      std::memset(slabs->tensor_ptr(i), 0, tensors[i].bytes);
    }
    slabs->fill(sources, workers);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      ASSERT_EQ(std::memcmp(slabs->tensor_ptr(i), data[i].data(), tensors[i].bytes), 0)
          << "tensor " << i << " with " << workers << " workers";
    }
  }
  EXPECT_GT(slabs->stats().fill_seconds, 0.0);
}

TEST(HostSlabs, FillRejectsAWrongSourceCount) {
  auto device = sim();
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(HostSlabs::create(*device, {{10, false}, {20, false}}, {}, &slabs).ok());
  std::vector<std::uint8_t> one(10);
  EXPECT_THROW(slabs->fill({one.data()}, 1), Error);
}

TEST(HostSlabs, ContainsFindsEveryByteOfEverySlabAndNothingElse) {
  auto device = sim();
  HostSlabOptions options;
  options.max_slab_bytes = 5000;
  std::vector<SlabTensor> tensors = {{3000, true}, {3000, true}, {3000, false}, {7000, false}};
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(HostSlabs::create(*device, tensors, options, &slabs).ok());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const char* p = static_cast<const char*>(slabs->tensor_ptr(i));
    EXPECT_TRUE(slabs->contains(p)) << i;
    EXPECT_TRUE(slabs->contains(p + tensors[i].bytes - 1)) << i;
  }
  std::vector<char> outside(100);
  EXPECT_FALSE(slabs->contains(outside.data()));
  EXPECT_FALSE(slabs->contains(nullptr));
  // One past the end of a slab holding exactly one tensor (no trailing padding) is outside,
  // unless another slab happens to start there.
  const char* end = static_cast<const char*>(slabs->tensor_ptr(3)) + 7000;
  bool another_starts_there = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    another_starts_there |= slabs->tensor_ptr(i) == end;
  }
  if (!another_starts_there) {
    EXPECT_FALSE(slabs->contains(end));
  }
}

}  // namespace
}  // namespace ddo::engine
