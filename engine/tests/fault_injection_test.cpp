// Fault injection on the simulation device (sim_faults.h): a pin that fails, a device allocation
// that fails in setup and while another scheduler is mid-step, and copies that fail on demand and
// while prefetching. Each failure is a ddo::Status or ddo::Error that names what failed; what
// failed stays usable or is destroyed cleanly; nothing leaks (the ASan build runs these tests).
#include "ddo/engine/sim_faults.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ddo/engine/copy_scheduler.h"
#include "ddo/engine/host_slab.h"

namespace ddo::engine {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Units of random bytes streamed by one scheduler on a faulty simulation device.
struct FaultyRig {
  explicit FaultyRig(int units = 12, std::size_t bytes = 4096, std::int64_t capacity = 1 << 20,
                     double bytes_per_second = 0.0) {
    SimDeviceOptions sim;
    sim.capacity_bytes = capacity;
    sim.copy_bytes_per_second = bytes_per_second;
    device = make_sim_device(sim, faults);
    std::mt19937_64 rng(99);
    for (int i = 0; i < units; ++i) {
      host.emplace_back(bytes + 64 * static_cast<std::size_t>(i));
      for (auto& b : host.back()) b = static_cast<std::uint8_t>(rng());
    }
    scheduler = make_scheduler();
  }
  ~FaultyRig() { scheduler.reset(); }  // before the device

  std::unique_ptr<CopyScheduler> make_scheduler() {
    SchedulerOptions options;
    options.window_bytes = 3 * host.front().size();
    auto s = std::make_unique<CopyScheduler>(*device, options);
    for (auto& h : host) s->add(h.data(), h.size(), /*pinned=*/true);
    return s;
  }

  // Acquires, checks and releases `id`; true when the staged bytes equal the host bytes.
  bool step_unit(CopyScheduler& s, int id) {
    const void* p = s.acquire(id, kDefaultStream);
    const bool same = std::memcmp(p, host[id].data(), host[id].size()) == 0;
    s.release(id, kDefaultStream);
    return same;
  }

  // One pass over every unit in order; returns how many came back wrong.
  int pass(CopyScheduler& s) {
    int wrong = 0;
    for (int id = 0; id < static_cast<int>(host.size()); ++id) wrong += step_unit(s, id) ? 0 : 1;
    return wrong;
  }

  std::shared_ptr<SimFaults> faults = std::make_shared<SimFaults>();
  std::unique_ptr<Device> device;
  std::vector<std::vector<std::uint8_t>> host;
  std::unique_ptr<CopyScheduler> scheduler;
};

TEST(SimFaults, TheChosenCallFailsWithoutEffectAndSaysItWasInjected) {
  auto faults = std::make_shared<SimFaults>();
  auto device = make_sim_device({.capacity_bytes = 1 << 20}, faults);
  faults->fail_nth(SimFault::kAllocate, 2);
  void* a = nullptr;
  void* b = nullptr;
  void* c = nullptr;
  ASSERT_TRUE(device->allocate(100, &a).ok());
  const Status failed = device->allocate(200, &b);
  EXPECT_EQ(failed.code(), Code::kResourceExhausted);
  EXPECT_EQ(b, nullptr);
  EXPECT_TRUE(contains(failed.message(), "allocate of 200 bytes failed")) << failed.message();
  EXPECT_TRUE(contains(failed.message(), "injected fault: allocate call 2")) << failed.message();
  EXPECT_EQ(device->memory().used_bytes, 100);  // the failed call allocated nothing
  ASSERT_TRUE(device->allocate(300, &c).ok());  // only the chosen call fails
  EXPECT_EQ(faults->calls(SimFault::kAllocate), 3);
  EXPECT_EQ(faults->injected(SimFault::kAllocate), 1);
  device->deallocate(a);
  device->deallocate(c);

  faults->fail_nth(SimFault::kPin, 1);
  void* h = nullptr;
  EXPECT_EQ(device->allocate_host(64, &h).code(), Code::kResourceExhausted);
  EXPECT_EQ(h, nullptr);
  std::vector<char> buffer(64);
  ASSERT_TRUE(device->register_host(buffer.data(), buffer.size()).ok());
  device->unregister_host(buffer.data());

  faults->fail_nth(SimFault::kCopy, 1, /*count=*/2);
  char src[8] = "abcdefg", dst[8] = {};
  EXPECT_EQ(device->copy_to_host(dst, src, 8).code(), Code::kUnavailable);
  EXPECT_EQ(device->copy_to_device_async(dst, src, 8, kDefaultStream).code(), Code::kUnavailable);
  EXPECT_EQ(dst[0], 0);  // nothing was copied
  EXPECT_TRUE(device->copy_to_device_async(dst, src, 8, kDefaultStream).ok());
  EXPECT_EQ(std::memcmp(dst, src, 8), 0);
  faults->fail_nth(SimFault::kCopy, 1);
  faults->clear(SimFault::kCopy);
  EXPECT_TRUE(device->copy_to_host(dst, src, 8).ok());
}

TEST(FaultInjection, PinFailureFallsBackOrFailsNamingTheOptionWithoutLeaking) {
  auto faults = std::make_shared<SimFaults>();
  auto device = make_sim_device({}, faults);
  HostSlabOptions options;
  options.max_slab_bytes = 10000;
  const std::vector<SlabTensor> tensors = {{9000, true}, {9000, true}, {9000, true}};

  // The second slab's pin fails: with the fallback its tensors go to ordinary memory.
  faults->fail_nth(SimFault::kPin, 2);
  std::unique_ptr<HostSlabs> slabs;
  ASSERT_TRUE(HostSlabs::create(*device, tensors, options, &slabs).ok());
  EXPECT_TRUE(slabs->tensor_pinned(0));
  EXPECT_FALSE(slabs->tensor_pinned(1));
  EXPECT_TRUE(slabs->tensor_pinned(2));
  EXPECT_EQ(slabs->stats().pin_fallback_bytes, 9000);
  std::vector<std::vector<std::uint8_t>> data(3, std::vector<std::uint8_t>(9000));
  std::vector<const void*> sources;
  for (std::size_t t = 0; t < 3; ++t) {
    std::iota(data[t].begin(), data[t].end(), static_cast<std::uint8_t>(t));
    sources.push_back(data[t].data());
  }
  slabs->fill(sources, 2);
  for (std::size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(std::memcmp(slabs->tensor_ptr(t), data[t].data(), 9000), 0) << t;
  }
  slabs.reset();

  // Without the fallback: an error naming the option; the slab that had pinned is given back
  // (ASan reports it otherwise) and nothing is returned.
  options.allow_pin_fallback = false;
  faults->fail_nth(SimFault::kPin, 3);
  const Status failed = HostSlabs::create(*device, tensors, options, &slabs);
  EXPECT_EQ(failed.code(), Code::kResourceExhausted);
  EXPECT_EQ(slabs, nullptr);
  EXPECT_TRUE(contains(failed.message(), "injected fault: pin call")) << failed.message();
  EXPECT_TRUE(contains(failed.message(), "DDO_ALLOW_PIN_MEMORY_FALLBACK")) << failed.message();

  // Registration (pin after the fill) that fails keeps the data in ordinary memory.
  options.allow_pin_fallback = true;
  options.pin_by_register = true;
  ASSERT_TRUE(HostSlabs::create(*device, tensors, options, &slabs).ok());
  slabs->fill(sources, 1);
  faults->fail_nth(SimFault::kPin, 1);
  ASSERT_TRUE(slabs->pin_registered(1).ok());
  EXPECT_FALSE(slabs->tensor_pinned(0));
  EXPECT_TRUE(slabs->tensor_pinned(1));
  for (std::size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(std::memcmp(slabs->tensor_ptr(t), data[t].data(), 9000), 0) << t;
  }
}

TEST(FaultInjection, StagingAllocationFailureInSetupIsAStatusAndFinalizeCanBeRetried) {
  FaultyRig rig;
  rig.faults->fail_nth(SimFault::kAllocate, 1);
  const Status failed = rig.scheduler->finalize();
  EXPECT_EQ(failed.code(), Code::kResourceExhausted);
  EXPECT_TRUE(contains(failed.message(), "injected fault: allocate call 1")) << failed.message();
  EXPECT_EQ(rig.device->memory().used_bytes, 0);
  // A scheduler whose setup failed is destroyed cleanly...
  rig.scheduler.reset();
  // ... and one that retries setup after the failure streams correctly.
  rig.scheduler = rig.make_scheduler();
  rig.faults->fail_nth(SimFault::kAllocate, 1);
  ASSERT_FALSE(rig.scheduler->finalize().ok());
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  EXPECT_EQ(rig.pass(*rig.scheduler), 0);
  EXPECT_EQ(rig.pass(*rig.scheduler), 0);
}

TEST(FaultInjection, AllocationFailureWhileAnotherSchedulerIsMidStepLeavesItStreaming) {
  FaultyRig rig(/*units=*/12, /*bytes=*/4096, /*capacity=*/1 << 20, /*bytes_per_second=*/50e6);
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  ASSERT_EQ(rig.pass(*rig.scheduler), 0);  // learns the order; later passes prefetch
  // Mid-step: half the units done, copies of the next ones in flight.
  for (int id = 0; id < 6; ++id) ASSERT_TRUE(rig.step_unit(*rig.scheduler, id));
  auto second = rig.make_scheduler();
  rig.faults->fail_nth(SimFault::kAllocate, 1);
  EXPECT_EQ(second->finalize().code(), Code::kResourceExhausted);
  second.reset();
  for (int id = 6; id < 12; ++id) EXPECT_TRUE(rig.step_unit(*rig.scheduler, id)) << id;
  EXPECT_EQ(rig.pass(*rig.scheduler), 0);
}

TEST(FaultInjection, OnDemandCopyFailureIsAnErrorNamingTheUnitAndTheSchedulerStaysUsable) {
  FaultyRig rig;
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  // The first pass learns the order: every copy is on demand; the third one fails.
  rig.faults->fail_nth(SimFault::kCopy, 3);
  EXPECT_TRUE(rig.step_unit(*rig.scheduler, 0));
  EXPECT_TRUE(rig.step_unit(*rig.scheduler, 1));
  try {
    (void)rig.scheduler->acquire(2, kDefaultStream);
    FAIL() << "the injected copy failure was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.status().code(), Code::kUnavailable);
    EXPECT_TRUE(contains(e.what(), "copying unit 2 (4224 bytes) to the device failed")) << e.what();
    EXPECT_TRUE(contains(e.what(), "injected fault: copy call 3")) << e.what();
  }
  // The unit was not left half-acquired: acquiring it again copies it and returns its bytes.
  EXPECT_TRUE(rig.step_unit(*rig.scheduler, 2));
  for (int id = 3; id < 12; ++id) EXPECT_TRUE(rig.step_unit(*rig.scheduler, id)) << id;
  for (int pass = 0; pass < 3; ++pass) EXPECT_EQ(rig.pass(*rig.scheduler), 0) << pass;
}

TEST(FaultInjection, PrefetchCopyFailureMidStepIsServedOnDemandWithTheRightBytes) {
  FaultyRig rig(/*units=*/12, /*bytes=*/4096, /*capacity=*/1 << 20, /*bytes_per_second=*/50e6);
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  ASSERT_EQ(rig.pass(*rig.scheduler), 0);
  ASSERT_EQ(rig.pass(*rig.scheduler), 0);
  rig.scheduler->reset_stats();
  // Mid-step in the steady state, unit 4 was prefetched while unit 3 was acquired, so the next
  // copy is the prefetch of unit 7 issued by acquire(4): it fails, which only stops prefetching
  // until the next acquire prefetches again.
  for (int id = 0; id < 4; ++id) ASSERT_TRUE(rig.step_unit(*rig.scheduler, id));
  rig.faults->fail_nth(SimFault::kCopy, 1);
  for (int id = 4; id < 12; ++id) EXPECT_TRUE(rig.step_unit(*rig.scheduler, id)) << id;
  EXPECT_EQ(rig.faults->injected(SimFault::kCopy), 1);
  EXPECT_EQ(rig.scheduler->stats().order_misses, 0);
  EXPECT_EQ(rig.pass(*rig.scheduler), 0);
}

TEST(FaultInjection, PersistentCopyFailureMidStepFailsAcquiresAndTheSchedulerTearsDownCleanly) {
  FaultyRig rig(/*units=*/12, /*bytes=*/4096, /*capacity=*/1 << 20, /*bytes_per_second=*/50e6);
  ASSERT_TRUE(rig.scheduler->finalize().ok());
  ASSERT_EQ(rig.pass(*rig.scheduler), 0);
  for (int id = 0; id < 3; ++id) ASSERT_TRUE(rig.step_unit(*rig.scheduler, id));
  // A broken device: every copy from now on fails (CUDA's errors are sticky).
  rig.faults->fail_nth(SimFault::kCopy, 1, /*count=*/1000000);
  int failed = 0;
  for (int id = 3; id < 12; ++id) {
    try {
      if (!rig.step_unit(*rig.scheduler, id)) ADD_FAILURE() << "wrong bytes for unit " << id;
    } catch (const Error& e) {
      ++failed;
      EXPECT_TRUE(contains(e.what(), "injected fault: copy call")) << e.what();
    }
  }
  // Units already prefetched before the failure were served; every other acquire failed.
  EXPECT_GT(failed, 0);
  rig.scheduler->drain();
  rig.scheduler.reset();  // no unit was left acquired, and teardown does not throw
  EXPECT_EQ(rig.device->memory().used_bytes, 0);
}

}  // namespace
}  // namespace ddo::engine
