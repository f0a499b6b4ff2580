// Note [One thread at a time]: an op of an offloaded model that runs while another thread is
// inside an op of the same model is a clear error for that thread, never an abort, and the first
// thread's forward still gives the unmanaged model's output. The overlap is made certain, not
// hoped for: the second thread runs from inside the first thread's op (the stage observer is
// called between the op's acquire and its release).
#include <atomic>
#include <string>
#include <thread>

#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

torch::nn::Sequential* g_net = nullptr;
at::Tensor* g_input = nullptr;
std::atomic<bool> g_fired{false};
std::string g_second_error;
bool g_second_threw = false;

void run_second_thread_inside_the_op(const at::Tensor& /*staged*/, int /*unit*/) {
  if (g_fired.exchange(true)) return;  // once, from the first thread's first op
  std::thread second([] {
    try {
      torch::NoGradGuard no_grad;
      (void)(*g_net)->forward(*g_input);
    } catch (const c10::Error& e) {
      g_second_threw = true;
      g_second_error = e.what_without_backtrace();
    }
  });
  second.join();
}

TEST(ThreadGuardTest, ASecondThreadInsideAnOpGetsAClearErrorAndTheFirstFinishes) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < 3; ++i) {
    net->push_back(torch::nn::Linear(64, 64));
    net->push_back(torch::nn::GELU());
  }
  at::Tensor x = at::randn({4, 64});
  at::Tensor expected;
  {
    torch::NoGradGuard no_grad;
    expected = net->forward(x);
  }
  test::TempDir dir;
  auto offload = enable_offload(*net, test::sim_options(dir));
  g_net = &net;
  g_input = &x;
  testing::set_stage_observer(&run_second_thread_inside_the_op);
  at::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = net->forward(x);
  }
  testing::set_stage_observer(nullptr);
  ASSERT_TRUE(g_fired.load());
  EXPECT_TRUE(g_second_threw);
  EXPECT_NE(g_second_error.find("one thread at a time"), std::string::npos) << g_second_error;
  EXPECT_TRUE(at::equal(out, expected));
  // The model serves its one thread as before, and once the first op is done so would another.
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(net->forward(x), expected));
  }
  std::thread later([&] {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(net->forward(x), expected));
  });
  later.join();
  offload->remove();
}

}  // namespace
}  // namespace ddo::adapter
