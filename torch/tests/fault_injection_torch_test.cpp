// Fault injection inside a calibration region, at the torch level: the simulation
// device (engine/sim_faults.h) fails a device allocation in setup, an allocation and a copy in
// the middle of a step, and a pin. Each time the failure reaches the host as a ddo::Error whose
// code says what ran out or broke and whose message names the call that failed; the model gives
// the reference output again on the CPU after remove() (and, where the offload survived the
// failure, while still offloaded); no profile appears in an empty profile directory, and a good
// saved profile stays byte-for-byte as it was. The engine's fault_injection_test covers the same
// faults below torch; this file checks what the user of enable_offload / profile_run() sees.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <string>

#include <ATen/ops/equal.h>
#include <torch/nn/module.h>

#include "ddo/engine/sim_faults.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "test_util.h"
#include "tiny_net.h"

namespace ddo::adapter {
namespace {

namespace fs = std::filesystem;
using engine::SimFault;
using test::TempDir;
using Model = test::TinyLinearNet;

constexpr std::int64_t kCapacityBytes = std::int64_t{1} << 28;  // 0.25 GiB, as the config says
constexpr std::int64_t kAlways = 1 << 20;                       // "every call from now on"

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Every regular file under `dir` with its bytes: what "nothing was saved" compares.
std::map<std::string, std::string> files_in(const fs::path& dir) {
  std::map<std::string, std::string> files;
  if (!fs::exists(dir)) return files;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    files[fs::relative(e.path(), dir).string()] =
        std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  return files;
}

// A profile directory, and the faults every simulation device of its attaches consults.
struct Rig {
  TempDir dir;
  std::shared_ptr<engine::SimFaults> faults = std::make_shared<engine::SimFaults>();

  // A calibration (or normal) run of profile "faults" on a fresh faulty simulation device, as
  // enable_offload opens one device per attach. Pinned host memory without a fallback, so a pin
  // that fails is an error and not a slower run.
  OffloadOptions options(bool calibrate, const std::string& profile = "faults") const {
    OffloadOptions o = test::sim_options(dir, {{"sim_device_capacity_gb", 0.25},
                                               {"profile_vram_headroom_gb", 0.01},
                                               {"pin_cpu_memory", true},
                                               {"allow_pin_memory_fallback", false}});
    o.profile_name = profile;
    o.build_profile = calibrate;
    engine::SimDeviceOptions so;
    so.capacity_bytes = kCapacityBytes;
    o.device = std::shared_ptr<engine::Device>(engine::make_sim_device(so, faults));
    return o;
  }

  // A clean calibration of `model`: the good profile the faulty runs must leave alone.
  std::string save_good_profile(Model& model) const {
    auto offload = enable_offload(*model.net, options(true));
    const nlohmann::json report = offload->profile_run([&] { (void)model.run(); });
    EXPECT_EQ(report["status"], "saved") << report.dump(2);
    return report.value("path", std::string());
  }
};

// The failure as the host catches it: a ddo::Error with `code`, naming the injected call.
void expect_injected(const Error& e, Code code, const std::string& call) {
  EXPECT_EQ(e.code(), code) << e.what();
  EXPECT_TRUE(contains(e.what(), "(injected fault: " + call + " call")) << e.what();
}

// The model is an ordinary CPU model again: no managed weight, no interception, the reference
// output.
void expect_restored(Model& model, const at::Tensor& reference) {
  for (const at::Tensor& p : model.net->parameters()) EXPECT_FALSE(is_managed(p));
  EXPECT_FALSE(interception_active());
  EXPECT_TRUE(at::equal(model.run(), reference));
}

// Runs `attempt` (a faulty calibration attempt that must throw ddo::Error) twice: in an empty
// profile directory, where no file may appear, and after a clean calibration saved a profile,
// whose bytes must not change. `check` judges each error.
template <typename Attempt, typename Check>
void expect_nothing_saved(Model& model, Attempt attempt, Check check) {
  for (const bool with_good_profile : {false, true}) {
    SCOPED_TRACE(with_good_profile ? "a good profile saved before" : "an empty profile directory");
    Rig rig;
    if (with_good_profile) {
      ASSERT_FALSE(rig.save_good_profile(model).empty());
    }
    const auto before = files_in(rig.dir.path());
    ASSERT_EQ(before.empty(), !with_good_profile);
    try {
      attempt(rig);
      ADD_FAILURE() << "the injected fault did not surface";
    } catch (const Error& e) {
      check(e);
    }
    EXPECT_EQ(files_in(rig.dir.path()), before) << "the faulty calibration changed the profiles";
  }
}

// Fails each call of `kind` that a calibration attach makes, one attach per call: enable_offload
// throws kResourceExhausted naming the call, and the model is left as it was.
void fail_each_setup_call(SimFault kind, const std::string& call) {
  Model model;
  const at::Tensor reference = model.run();
  std::int64_t calls = 0;
  {
    Rig rig;
    (void)enable_offload(*model.net, rig.options(true));
    calls = rig.faults->calls(kind);
  }
  ASSERT_GE(calls, 1) << "a calibration attach made no " << call << " call";
  ::testing::Test::RecordProperty(call + "_calls", static_cast<int>(calls));  // --gtest_output
  for (std::int64_t nth = 1; nth <= calls; ++nth) {
    SCOPED_TRACE(call + " call " + std::to_string(nth) + " of " + std::to_string(calls));
    expect_nothing_saved(
        model,
        [&](Rig& rig) {
          rig.faults->fail_nth(kind, nth);
          (void)enable_offload(*model.net, rig.options(true));
        },
        [&](const Error& e) {
          expect_injected(e, Code::kResourceExhausted, call);
          EXPECT_TRUE(contains(e.what(), "simulated device 0: ")) << e.what();
        });
    expect_restored(model, reference);
  }
}

// Every device allocation of a calibration attach (the resident chunk of each module, the staging
// ring), failed in turn.
TEST(FaultInjectionTorch, DeviceAllocationFailureInSetup) {
  torch::manual_seed(11);
  fail_each_setup_call(SimFault::kAllocate, "allocate");
}

// Every pin of a calibration attach, failed in turn, with the fallback to pageable memory off.
TEST(FaultInjectionTorch, PinFailureInSetup) {
  torch::manual_seed(15);
  fail_each_setup_call(SimFault::kPin, "pin");
}

// After setup an offload allocates nothing on the device (Note [Scheduler threading and host cost]
// in engine/src/copy_scheduler.cpp), so the allocation that fails in the middle of a step is
// another attach on the same device: a pipeline that brings its VAE onto the card after the
// denoiser ran. The same for a pin of that attach. The step fails with the attach's error, the
// region saves nothing, and both models work: the first still offloaded, then restored; the second
// untouched.
TEST(FaultInjectionTorch, AllocationOrPinFailureInTheMiddleOfAStep) {
  torch::manual_seed(12);
  Model model;
  Model second;
  const at::Tensor reference = model.run();
  const at::Tensor second_reference = second.run();
  for (const SimFault kind : {SimFault::kAllocate, SimFault::kPin}) {
    const std::string call = kind == SimFault::kAllocate ? "allocate" : "pin";
    SCOPED_TRACE(call);
    expect_nothing_saved(
        model,
        [&](Rig& rig) {
          auto offload = enable_offload(*model.net, rig.options(true));
          OffloadOptions vae = rig.options(false, "second");
          vae.device = offload->device();  // one card for both components
          try {
            offload->profile_run([&] {
              EXPECT_TRUE(at::equal(model.run(), reference));  // the step's first half
              rig.faults->fail_nth(kind, 1, kAlways);
              auto second_offload = enable_offload(*second.net, vae);
              ADD_FAILURE() << "the second attach succeeded";
            });
          } catch (const Error&) {
            EXPECT_EQ(offload->profile_report()["status"], "failed");
            EXPECT_GE(rig.faults->injected(kind), 1);
            rig.faults->clear(kind);
            // Still usable offloaded, then restored by remove().
            EXPECT_TRUE(offload->active());
            EXPECT_TRUE(at::equal(model.run(), reference));
            offload->remove();
            expect_restored(model, reference);
            throw;
          }
        },
        [&](const Error& e) { expect_injected(e, Code::kResourceExhausted, call); });
    for (const at::Tensor& p : second.net->parameters()) EXPECT_FALSE(is_managed(p));
    EXPECT_TRUE(at::equal(second.run(), second_reference));
  }
}

// One step of `model` whose copies fail from the `nth` on (1 = the step's first); `on_error`
// runs where the step's error is caught, before it is rethrown.
void step_with_failing_copies(Rig& rig, Model& model, std::int64_t nth,
                              const std::function<void()>& on_error) {
  rig.faults->fail_nth(SimFault::kCopy, nth, kAlways);
  try {
    (void)model.run();
  } catch (...) {
    on_error();
    throw;
  }
  ADD_FAILURE() << "a step whose copies fail from call " << nth << " on ran to its end";
}

// A copy of a streamed weight fails in the middle of the first step of a calibration region
// (its first unit was already copied; the first step copies every unit on demand, while later
// steps of this small model find them still staged): the op that needs the weight throws
// kUnavailable naming the unit and the copy; the offload stays usable once the device copies again,
// and remove() restores the model. Then the same failure handled by remove() inside the region.
TEST(FaultInjectionTorch, CopyFailureInTheMiddleOfAStep) {
  torch::manual_seed(13);
  Model model;
  const at::Tensor reference = model.run();
  expect_nothing_saved(
      model,
      [&](Rig& rig) {
        auto offload = enable_offload(*model.net, rig.options(true));
        ASSERT_GE(offload->plan().stream_units.size(), 3u) << "the test needs streamed units";
        try {
          offload->profile_run([&] {
            const std::int64_t copies_before = rig.faults->calls(SimFault::kCopy);
            step_with_failing_copies(rig, model, 2, [&] {  // after the step's first copy
              EXPECT_GE(rig.faults->calls(SimFault::kCopy) - copies_before, 2);
            });
          });
        } catch (const Error&) {
          EXPECT_EQ(offload->profile_report()["status"], "failed");
          rig.faults->clear(SimFault::kCopy);
          EXPECT_TRUE(at::equal(model.run(), reference));  // the scheduler recovered
          offload->remove();
          expect_restored(model, reference);
          throw;
        }
      },
      [&](const Error& e) {
        expect_injected(e, Code::kUnavailable, "copy");
        EXPECT_TRUE(contains(e.what(), "copy scheduler: copying unit")) << e.what();
        EXPECT_TRUE(contains(e.what(), "copy_to_device_async of")) << e.what();
      });

  // The host's own error handler removes the model inside the region before rethrowing (what an
  // application that cleans up on error does). The error that reaches the host is still the
  // failed copy, not the region's complaint about remove(): the region aborted and saved nothing
  // either way (Note [remove() inside a measured region] in torch/src/profile_run.cpp).
  expect_nothing_saved(
      model,
      [&](Rig& rig) {
        auto offload = enable_offload(*model.net, rig.options(true));
        offload->profile_run(
            [&] { step_with_failing_copies(rig, model, 1, [&] { offload->remove(); }); });
      },
      [&](const Error& e) { expect_injected(e, Code::kUnavailable, "copy"); });
  expect_restored(model, reference);
}

// A resident weight large enough that its copy registers its pages (Note [Host uploads] in
// engine/src/host_upload.cpp) and a streamed one after it.
struct RegisteredResidentNet {
  torch::nn::Sequential net{torch::nn::Linear(1024, 2048), torch::nn::Linear(2048, 64)};
  at::Tensor input = at::randn({2, 1024});
  at::Tensor run() {
    torch::NoGradGuard no_grad;
    return net->forward(input).clone();
  }
};

// Every copy of an attach whose resident copy registers host memory, failed in turn: the attach
// throws and the device holds no host registration afterwards, so the whole pinnable budget can
// be pinned again (HostRegistrations in torch/src/host_registrations.h owns them on the error
// path).
TEST(FaultInjectionTorch, CopyFailureInSetupReleasesHostRegistrations) {
  torch::manual_seed(16);
  RegisteredResidentNet model;
  const at::Tensor reference = model.run();
  constexpr std::int64_t kPinnable = std::int64_t{64} << 20;
  TempDir dir;
  auto faults = std::make_shared<engine::SimFaults>();
  auto options = [&] {
    OffloadOptions o =
        test::sim_options(dir, {{"sim_device_capacity_gb", 0.25},
                                {"always_resident_modules_pattern", nlohmann::json::array({"^0$"})},
                                {"pin_cpu_memory", false},
                                {"auto_vram_headroom_gb", 0.01}});
    engine::SimDeviceOptions so;
    so.capacity_bytes = kCapacityBytes;
    so.pinnable_bytes = kPinnable;
    o.device = std::shared_ptr<engine::Device>(engine::make_sim_device(so, faults));
    return o;
  };
  std::int64_t calls = 0;
  {
    OffloadOptions o = options();
    auto offload = enable_offload(*model.net, o);
    EXPECT_GE(offload->report()["resident_bytes"].get<std::int64_t>(), 8 << 20);
    calls = faults->calls(SimFault::kCopy);
    offload->remove();
  }
  ASSERT_GE(calls, 2) << "the attach made fewer copies than the test needs";
  for (std::int64_t nth = 1; nth <= calls; ++nth) {
    SCOPED_TRACE("copy call " + std::to_string(nth) + " of " + std::to_string(calls));
    OffloadOptions o = options();
    faults->fail_nth(SimFault::kCopy, nth);
    try {
      (void)enable_offload(*model.net, o);
      ADD_FAILURE() << "the injected fault did not surface";
    } catch (const Error& e) {
      expect_injected(e, Code::kUnavailable, "copy");
    }
    faults->clear(SimFault::kCopy);
    // Nothing stays registered: the whole pinnable budget can be pinned again.
    void* all = nullptr;
    const Status st = o.device->allocate_host(static_cast<std::size_t>(kPinnable), &all);
    EXPECT_TRUE(st.ok()) << st.message();
    if (st.ok()) o.device->deallocate_host(all);
    for (const at::Tensor& p : model.net->parameters()) EXPECT_FALSE(is_managed(p));
    EXPECT_TRUE(at::equal(model.run(), reference));
  }
}

}  // namespace
}  // namespace ddo::adapter
