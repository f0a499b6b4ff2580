// The backend records and their registry (torch/src/backend.h): lookups by engine kind, dispatch
// key and device name; and a stub kind, defined here alone, whose interception kernels the
// registration loop registers on its own dispatch key with no edit elsewhere.
#include "backend.h"

#include <gtest/gtest.h>

#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "cpu_math.h"
#include "kernels.h"
#include "test_util.h"
#include "tiny_net.h"

namespace ddo::adapter::internal {
namespace {

// A kind no build has: its kernels serve PrivateUse1 and compute with the CPU's.
struct StubKernels : CpuMath {
  static const Backend& backend();
};

const Backend kStubBackend{
    .kind = static_cast<engine::DeviceKind>(99),
    .name = "stub",
    .title = "stub",
    .inputs_on = "the stub device",
    .torch_type = c10::DeviceType::PrivateUse1,
    .dispatch_key = c10::DispatchKey::PrivateUse1,
    .memory_is_host = false,
    .sdnq_kernels = false,
    .register_kernels = &register_interception_kernels<StubKernels>,
};

const Backend& StubKernels::backend() {
  return kStubBackend;
}

bool has_kernel(const char* op, c10::DispatchKey key) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  return handle.has_value() && handle->hasKernelForDispatchKey(key);
}

TEST(BackendRegistry, FindsTheSimulationByKindKeyAndName) {
  const Backend& sim = backend_for(engine::DeviceKind::kSim);
  EXPECT_EQ(&sim, &kSimBackend);
  EXPECT_STREQ(sim.name, "sim");
  EXPECT_EQ(find_backend(c10::DispatchKey::CPU), &sim);
  EXPECT_EQ(&backend_named("sim"), &sim);
  EXPECT_EQ(&backend_named("sim:3"), &sim);
  EXPECT_EQ(sim.torch_device(3), c10::Device(c10::kCPU));  // its memory is the host's
  EXPECT_EQ(sim.device_name(3), "sim:3");
  EXPECT_EQ(sim.stream(0), engine::kDefaultStream);  // the calling thread computes
  EXPECT_NE(sim.register_kernels, nullptr);
}

TEST(BackendRegistry, FindsCudaByKindKeyAndNameInEveryBuild) {
  const Backend& cuda = backend_named("cuda:1");
  EXPECT_EQ(&cuda, &kCudaBackend);
  EXPECT_EQ(&backend_named("cuda"), &cuda);
  EXPECT_EQ(&backend_for(engine::DeviceKind::kCuda), &cuda);
  EXPECT_EQ(find_backend(c10::DispatchKey::CUDA), &cuda);
  EXPECT_EQ(cuda.torch_device(1), c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(cuda.device_name(1), "cuda:1");
#if DDO_HAVE_CUDA
  EXPECT_NE(cuda.open, nullptr);
  EXPECT_NE(cuda.register_kernels, nullptr);
#else
  EXPECT_EQ(cuda.open, nullptr);  // plans for a GPU, opens none
  EXPECT_EQ(cuda.register_kernels, nullptr);
#endif
}

TEST(BackendRegistry, CpuPlansAsTheSimulation) {
  EXPECT_EQ(&backend_named("cpu"), &kSimBackend);
}

TEST(BackendRegistry, AnUnknownNameIsAnErrorNamingTheKnownKinds) {
  try {
    (void)backend_named("mps:0");
    FAIL() << "mps:0 was found";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              "device \"mps:0\" is not a kind this build of ddo executes on; use \"sim:N\" or "
              "\"cuda:N\"");
  }
  EXPECT_EQ(find_backend(c10::DispatchKey::PrivateUse1), nullptr);
  EXPECT_THROW((void)backend_for(static_cast<engine::DeviceKind>(99)), ddo::Error);
}

TEST(BackendRegistry, ARecordSharingAKindNameOrKeyIsRefused) {
  Backend twin = kStubBackend;
  twin.name = "sim";
  EXPECT_THROW(BackendRegistration{twin}, ddo::Error);
  twin = kStubBackend;
  twin.dispatch_key = c10::DispatchKey::CUDA;
  EXPECT_THROW(BackendRegistration{twin}, ddo::Error);
  twin = kStubBackend;
  twin.name = "cpu";
  EXPECT_THROW(BackendRegistration{twin}, ddo::Error);
  EXPECT_EQ(backends().size(), 2u);
}

TEST(BackendRegistry, AStubKindIsFoundAndServesItsKeyWithNoEditElsewhere) {
  ASSERT_FALSE(interception_active());
  {
    BackendRegistration stub(kStubBackend);
    EXPECT_EQ(&backend_named("stub:0"), &kStubBackend);
    EXPECT_EQ(&backend_for(kStubBackend.kind), &kStubBackend);
    EXPECT_EQ(find_backend(c10::DispatchKey::PrivateUse1), &kStubBackend);
    EXPECT_EQ(backends().back(), &kStubBackend);
    EXPECT_FALSE(has_kernel("aten::mm", c10::DispatchKey::PrivateUse1));

    // An offload on the simulation activates interception: every record's kernels register.
    torch::manual_seed(1);
    test::TinyLinearNet model;
    test::TempDir dir;
    const at::Tensor expected = model.run();
    auto offload = enable_offload(*model.net, test::sim_options(dir));
    for (const char* op :
         {"aten::addmm", "aten::mm", "aten::bmm", "aten::convolution", "aten::_convolution",
          "aten::embedding", "ddo::sdnq_linear", "ddo::sdnq_dequantize"}) {
      EXPECT_TRUE(has_kernel(op, c10::DispatchKey::PrivateUse1)) << op;
    }

    // The stub's instantiation, called as its key would call it: unmanaged arguments go to its
    // original; a weight the simulation streams is refused, naming where the inputs are.
    const at::Tensor a = at::randn({2, 64});
    const at::Tensor b = at::randn({64, 3});
    EXPECT_TRUE(at::allclose(kernels::mm<StubKernels>(a, b), at::mm(a, b)));
    const at::Tensor weight = model.net->named_parameters()["0.weight"];
    ASSERT_TRUE(is_managed(weight));
    torch::NoGradGuard no_grad;
    try {
      (void)kernels::mm<StubKernels>(a, weight.t());
      FAIL() << "the stub's kernel staged a weight the simulation streams";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("but its other inputs are on the stub device"),
                std::string::npos)
          << e.what();
    }
    // The model still runs on the simulation after the refusal.
    EXPECT_TRUE(at::allclose(model.run(), expected));
  }
  EXPECT_FALSE(interception_active());
  EXPECT_FALSE(has_kernel("aten::mm", c10::DispatchKey::PrivateUse1));
  EXPECT_EQ(find_backend(c10::DispatchKey::PrivateUse1), nullptr);
}

}  // namespace
}  // namespace ddo::adapter::internal
