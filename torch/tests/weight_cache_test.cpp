// The pinned-weight and plan caches (Note [Pinned-weight cache] in
// torch/src/weight_cache.cpp): a second attach of the same model pins nothing and copies nothing,
// a weight changed in place or re-pointed is not served stale, a small RAM budget evicts, two
// models share the cache without mixing, and clearing works.
#include "ddo/torch/weight_cache.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ops/allclose.h>
#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/engine/sim_faults.h"
#include "ddo/torch/enable_offload.h"
#include "test_util.h"
#include "tiny_net.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

using Model = test::TinyLinearNet;

// Every attach gets its own sim device, as enable_offload opens one per attach, all counting
// their pin calls in `faults`.
OffloadOptions options(const TempDir& dir, const std::string& ns,
                       const std::shared_ptr<engine::SimFaults>& faults,
                       nlohmann::json extra = nlohmann::json::object()) {
  nlohmann::json ov = {{"cache_pinned_weights", true},
                       {"pinned_weight_cache_namespace", ns},
                       {"pin_cpu_memory", true},
                       {"allow_pin_memory_fallback", false}};
  for (auto it = extra.begin(); it != extra.end(); ++it) ov[it.key()] = it.value();
  OffloadOptions o = test::sim_options(dir, ov);
  engine::SimDeviceOptions so;
  so.capacity_bytes = std::int64_t{1} << 30;
  o.device = std::shared_ptr<engine::Device>(engine::make_sim_device(so, faults));
  return o;
}

const nlohmann::json& cache_of(const nlohmann::json& report) {
  return report["setup"]["weight_cache"];
}

TEST(WeightCache, SecondAttachReusesTheSlabsWithoutPinningOrCopying) {
  torch::manual_seed(1);
  Model model;
  TempDir dir;
  const at::Tensor expected = model.run();
  auto faults = std::make_shared<engine::SimFaults>();
  const PinnedWeightCacheStats before = pinned_weight_cache_stats();

  auto offload = enable_offload(*model.net, options(dir, "reuse", faults));
  EXPECT_EQ(cache_of(offload->report())["status"], "miss");
  EXPECT_TRUE(at::allclose(model.run(), expected));
  const std::int64_t pins_first = faults->calls(engine::SimFault::kPin);
  ASSERT_GT(pins_first, 0) << "the first attach must pin (pin_cpu_memory)";
  const std::int64_t streamed = offload->report()["setup"]["bytes"]["streamed"].get<std::int64_t>();
  ASSERT_GT(streamed, 0);
  offload->remove();
  // The model is usable on the host, its weights in the cached slabs.
  EXPECT_TRUE(at::allclose(model.run(), expected));
  EXPECT_EQ(pinned_weight_cache_stats().entries, before.entries + 1);
  const void* weight_ptr = model.net->parameters()[0].data_ptr();

  // Pinning would now fail: only a hit can attach.
  faults->fail_nth(engine::SimFault::kPin, 1, 1000);
  offload = enable_offload(*model.net, options(dir, "reuse", faults));
  const nlohmann::json report = offload->report();
  EXPECT_EQ(cache_of(report)["status"], "hit") << report.dump(2);
  EXPECT_EQ(cache_of(report)["reused_bytes"].get<std::int64_t>(), streamed);
  EXPECT_EQ(cache_of(report)["refilled_bytes"].get<std::int64_t>(), 0);
  EXPECT_EQ(faults->injected(engine::SimFault::kPin), 0) << "the second attach pinned";
  EXPECT_EQ(model.net->parameters()[0].data_ptr(), weight_ptr) << "the weight was copied";
  EXPECT_TRUE(report["setup"]["plan_cached"].get<bool>());
  EXPECT_TRUE(at::allclose(model.run(), expected));
  const PinnedWeightCacheStats after = pinned_weight_cache_stats();
  EXPECT_EQ(after.hits, before.hits + 1);
  EXPECT_EQ(after.reused_bytes, before.reused_bytes + streamed);
  offload->remove();
  EXPECT_TRUE(at::allclose(model.run(), expected));
  EXPECT_GT(clear_pinned_weight_cache("reuse"), 0);
}

TEST(WeightCache, AWeightChangedInPlaceOrReplacedIsNotServedStale) {
  torch::manual_seed(2);
  Model model;
  TempDir dir;
  auto faults = std::make_shared<engine::SimFaults>();
  auto offload = enable_offload(*model.net, options(dir, "stale", faults));
  offload->remove();
  {
    torch::NoGradGuard no_grad;
    model.net->parameters()[0].add_(0.5);  // a LoRA merged in place
    // ... and one merged by re-pointing the weight (weight.data = merged).
    at::Tensor p2 = model.net->parameters()[2];
    p2.set_data(p2.detach().clone() * 2.0);
  }
  const at::Tensor expected = model.run();
  offload = enable_offload(*model.net, options(dir, "stale", faults));
  const nlohmann::json report = offload->report();
  EXPECT_EQ(cache_of(report)["status"], "hit") << report.dump(2);
  EXPECT_GE(cache_of(report)["changed_in_place"].get<std::int64_t>(), 1);
  EXPECT_EQ(cache_of(report)["refilled_bytes"].get<std::int64_t>(), 64 * 64 * 4);
  EXPECT_TRUE(at::allclose(model.run(), expected));
  offload->remove();
  EXPECT_TRUE(at::allclose(model.run(), expected));
  clear_pinned_weight_cache("stale");
}

TEST(WeightCache, TwoModelsShareTheCacheWithoutMixing) {
  torch::manual_seed(3);
  Model a, b;
  TempDir dir;
  const at::Tensor ea = a.run(), eb = b.run();
  auto faults = std::make_shared<engine::SimFaults>();
  OffloadOptions oa = options(dir, "two", faults), ob = options(dir, "two", faults);
  oa.model_class = "test::Transformer";
  ob.model_class = "test::TextEncoder";
  for (int round = 0; round < 3; ++round) {
    auto fa = enable_offload(*a.net, oa);
    auto fb = enable_offload(*b.net, ob);
    const std::string want = round == 0 ? "miss" : "hit";
    EXPECT_EQ(cache_of(fa->report())["status"], want) << round;
    EXPECT_EQ(cache_of(fb->report())["status"], want) << round;
    EXPECT_TRUE(at::allclose(a.run(), ea)) << round;
    EXPECT_TRUE(at::allclose(b.run(), eb)) << round;
    fa->remove();
    fb->remove();
  }
  EXPECT_TRUE(at::allclose(a.run(), ea));
  EXPECT_TRUE(at::allclose(b.run(), eb));
  clear_pinned_weight_cache("two");
}

TEST(WeightCache, ASmallRamBudgetEvictsTheLeastRecentlyUsed) {
  torch::manual_seed(4);
  Model a, b;
  TempDir dir;
  const at::Tensor ea = a.run(), eb = b.run();
  auto faults = std::make_shared<engine::SimFaults>();
  // Room for one model's slabs (about 49 KiB), not two.
  const nlohmann::json small = {{"pin_weight_budget_gb", 80e3 / (1 << 30)}};
  OffloadOptions oa = options(dir, "small", faults, small);
  OffloadOptions ob = options(dir, "small", faults, small);
  oa.model_class = "test::A";
  ob.model_class = "test::B";
  clear_pinned_weight_cache();
  const PinnedWeightCacheStats before = pinned_weight_cache_stats();
  enable_offload(*a.net, oa)->remove();
  enable_offload(*b.net, ob)->remove();  // evicts a
  PinnedWeightCacheStats st = pinned_weight_cache_stats();
  EXPECT_EQ(st.evictions, before.evictions + 1);
  EXPECT_EQ(st.entries, 1);
  EXPECT_LE(st.bytes, 80000);
  auto fa = enable_offload(*a.net, oa);
  EXPECT_EQ(cache_of(fa->report())["status"], "miss");
  EXPECT_TRUE(at::allclose(a.run(), ea));
  fa->remove();  // evicts b
  auto fb = enable_offload(*b.net, ob);
  EXPECT_EQ(cache_of(fb->report())["status"], "miss");
  EXPECT_TRUE(at::allclose(b.run(), eb));
  fb.reset();
  EXPECT_TRUE(at::allclose(a.run(), ea));
  EXPECT_TRUE(at::allclose(b.run(), eb));
  clear_pinned_weight_cache();
}

TEST(WeightCache, ClearAndRemoveWithTheFlagDropTheEntry) {
  torch::manual_seed(5);
  Model model;
  TempDir dir;
  const at::Tensor expected = model.run();
  auto faults = std::make_shared<engine::SimFaults>();
  enable_offload(*model.net, options(dir, "clear", faults))->remove();
  EXPECT_GT(clear_pinned_weight_cache("clear"), 0);
  EXPECT_EQ(clear_pinned_weight_cache("clear"), 0);
  auto offload = enable_offload(*model.net, options(dir, "clear", faults));
  EXPECT_EQ(cache_of(offload->report())["status"], "miss");
  offload->remove({.clear_weight_cache = true});
  EXPECT_EQ(clear_pinned_weight_cache("clear"), 0) << "remove(clear_weight_cache) kept the entry";
  EXPECT_TRUE(at::allclose(model.run(), expected));
  offload = enable_offload(*model.net, options(dir, "clear", faults));
  EXPECT_EQ(cache_of(offload->report())["status"], "miss");
  offload.reset();
  clear_pinned_weight_cache("clear");
}

// Two threads attach and remove their own models over and over while a third reads the figures
// and clears another namespace: every attach after the first of each thread hits its own entry,
// and every output stays equal.
TEST(WeightCache, ThreadsAttachingTheirOwnModelsDoNotMix) {
  torch::manual_seed(7);
  constexpr int kThreads = 2;
  constexpr int kRounds = 8;
  std::vector<std::unique_ptr<Model>> models;
  std::vector<at::Tensor> expected;
  for (int t = 0; t < kThreads; ++t) {
    models.push_back(std::make_unique<Model>());
    expected.push_back(models.back()->run());
  }
  TempDir dir;
  auto faults = std::make_shared<engine::SimFaults>();
  std::vector<int> hits(kThreads, 0), wrong(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      OffloadOptions o = options(dir, "threads", faults);
      o.model_class = "test::Model" + std::to_string(t);
      for (int round = 0; round < kRounds; ++round) {
        auto offload = enable_offload(*models[t]->net, o);
        hits[t] += cache_of(offload->report())["status"] == "hit" ? 1 : 0;
        wrong[t] += at::allclose(models[t]->run(), expected[t]) ? 0 : 1;
        offload->remove();
      }
    });
  }
  std::thread reader([&] {
    for (int i = 0; i < 200; ++i) {
      (void)pinned_weight_cache_stats();
      (void)clear_pinned_weight_cache("another namespace");
    }
  });
  for (std::thread& t : threads) t.join();
  reader.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(hits[t], kRounds - 1) << "thread " << t;
    EXPECT_EQ(wrong[t], 0) << "thread " << t;
    EXPECT_TRUE(at::allclose(models[t]->run(), expected[t]));
  }
  clear_pinned_weight_cache("threads");
}

TEST(PlanCache, OffReplansOnEveryAttach) {
  torch::manual_seed(6);
  Model model;
  TempDir dir;
  auto faults = std::make_shared<engine::SimFaults>();
  const nlohmann::json off = {{"cache_plan", false}, {"cache_pinned_weights", false}};
  auto offload = enable_offload(*model.net, options(dir, "plan", faults, off));
  offload->remove();
  offload = enable_offload(*model.net, options(dir, "plan", faults, off));
  EXPECT_FALSE(offload->report()["setup"]["plan_cached"].get<bool>());
  EXPECT_EQ(cache_of(offload->report())["status"], "off");
}

}  // namespace
}  // namespace ddo::adapter
