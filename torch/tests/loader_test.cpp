// The loader from C++ (ddo/torch/loader.h): a LibTorch module's weights written as a
// safetensors file, the module released to placeholders, then loaded straight into place on the
// sim device; a failed setup leaves placeholders, mismatches are one clear error.
#include "ddo/torch/loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "ddo/engine/sim_faults.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "test_util.h"
#include "tiny_net.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

using Model = test::TinyLinearNet;

using test::state_of;
using test::write_safetensors;

bool all_placeholders(torch::nn::Module& m) {
  for (const at::Tensor& p : m.parameters()) {
    if (!is_placeholder(p)) return false;
  }
  return true;
}

struct Seeded {
  explicit Seeded(std::uint64_t seed) { torch::manual_seed(seed); }
};

// A model written to dir/model.safetensors and then released to placeholders; `expected` is its
// output before.
struct SavedModel : Seeded {
  Model model;
  TempDir dir;
  at::Tensor expected = model.run();
  std::string file = (dir.path() / "model.safetensors").string();
  explicit SavedModel(std::uint64_t seed) : Seeded(seed) {
    write_safetensors(file, state_of(*model.net));
    release_weights(*model.net);
  }
};

OffloadOptions stream_all(const TempDir& dir) {
  return test::sim_options(dir, {{"resident_module_budget_gb", 0.0}});
}

TEST(Loader, LoadsStraightIntoPlaceAndRunsLikeTheOriginal) {
  torch::manual_seed(3);
  Model model;
  TempDir dir;
  const at::Tensor expected = model.run();
  const std::string file = (dir.path() / "model.safetensors").string();
  write_safetensors(file, state_of(*model.net));

  release_weights(*model.net);
  ASSERT_TRUE(all_placeholders(*model.net));
  LoadOptions load;
  load.path = file;
  load.read_workers = 3;
  std::vector<std::string> events;
  OffloadOptions opts = stream_all(dir);
  opts.record_event = [&](const std::string& name, double, const nlohmann::json&) {
    events.push_back(name);
  };
  auto offload = load_with_offload(*model.net, load, opts);
  const nlohmann::json report = offload->report();
  ASSERT_TRUE(report["executing"].get<bool>());
  EXPECT_GT(report["setup"]["bytes"]["streamed"].get<std::int64_t>(), 0);
  std::int64_t total = 0;
  for (const at::Tensor& p : model.net->parameters()) total += p.numel() * p.element_size();
  EXPECT_EQ(report["setup"]["load"]["bytes"].get<std::int64_t>(), total);
  EXPECT_EQ(std::count(events.begin(), events.end(), "load"), 1);
  EXPECT_TRUE(at::equal(model.run(), expected));
  offload->remove();
  EXPECT_FALSE(is_placeholder(model.net->parameters()[0]));
  EXPECT_TRUE(at::equal(model.run(), expected));
}

TEST(Loader, LoadWeightsWithoutOffloadFillsCpuTensors) {
  SavedModel saved(4);
  LoadOptions load;
  load.path = saved.dir.path().string();  // the directory with its one file
  load_weights(*saved.model.net, load);
  EXPECT_FALSE(all_placeholders(*saved.model.net));
  EXPECT_TRUE(at::equal(saved.model.run(), saved.expected));
}

TEST(Loader, DeferredLoadPinsAndTheAttachStreamsFromThePins) {
  // Note [Loader pins]: the deferred load reads into pinned slabs for the device the options
  // name; enable_offload streams every one-tensor unit where it lies, and remove() gives the
  // loader's tensors back.
  SavedModel saved(5);
  Model& model = saved.model;
  const TempDir& dir = saved.dir;
  const at::Tensor& expected = saved.expected;
  LoadOptions load;
  load.path = saved.file;
  const OffloadOptions opts =
      test::sim_options(dir, {{"resident_module_budget_gb", 0.0}, {"pin_cpu_memory", true}});
  std::vector<std::string> events;
  const nlohmann::json pins = load_weights_for_offload(
      module_tree_from(*model.net), load, opts,
      [&](const std::string& name, double, const nlohmann::json&) { events.push_back(name); });
  ASSERT_TRUE(pins["pinned"].get<bool>()) << pins.dump();
  EXPECT_EQ(pins["device"], "sim:0");
  EXPECT_EQ(std::count(events.begin(), events.end(), "load_pins"), 1);
  std::int64_t total = 0;
  std::vector<const void*> before;
  for (const at::Tensor& p : model.net->parameters()) {
    total += p.numel() * p.element_size();
    before.push_back(p.data_ptr());
  }
  EXPECT_GE(pins["pinned_bytes"].get<std::int64_t>(),
            pins["plan"]["streamed_bytes"].get<std::int64_t>());
  EXPECT_GT(pins["plan"]["streamed_bytes"].get<std::int64_t>(), 0);
  EXPECT_EQ(pins["pageable_bytes"].get<std::int64_t>(), 0);
  EXPECT_TRUE(at::equal(model.run(), expected));  // an ordinary CPU model until attached

  auto offload = enable_offload(*model.net, opts);
  const nlohmann::json setup = offload->report()["setup"];
  const std::int64_t streamed = setup["bytes"]["streamed"].get<std::int64_t>();
  EXPECT_GT(streamed, 0);
  EXPECT_EQ(setup["loader_pins"]["adopted_bytes"].get<std::int64_t>(), streamed);
  EXPECT_EQ(setup["pinned_bytes"].get<std::int64_t>(), 0);
  EXPECT_EQ(setup["pageable_bytes"].get<std::int64_t>(), 0);
  EXPECT_TRUE(at::equal(model.run(), expected));
  offload->remove();
  // Each adopted weight is the loader's tensor again (the same memory); the others are fresh.
  std::int64_t same = 0;
  const std::vector<at::Tensor> params = model.net->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) same += params[i].data_ptr() == before[i];
  EXPECT_EQ(same, setup["loader_pins"]["adopted_units"].get<std::int64_t>());
  EXPECT_TRUE(at::equal(model.run(), expected));

  // Pinning off: ordinary memory, and the report says why.
  release_weights(*model.net);
  const nlohmann::json plain = load_weights_for_offload(
      module_tree_from(*model.net), load, test::sim_options(dir, {{"pin_cpu_memory", false}}));
  EXPECT_FALSE(plain["pinned"].get<bool>());
  EXPECT_NE(plain["reason"].get<std::string>().find("pin_cpu_memory"), std::string::npos);
  EXPECT_TRUE(at::equal(model.run(), expected));
}

TEST(Loader, DeferredLoadRefusesProfileOptionsAndReadsNothing) {
  // The profile belongs to the later attach (the deferred flow measures nothing); a load given
  // one says so before any byte is read.
  SavedModel saved(6);
  Model& model = saved.model;
  LoadOptions load;
  load.path = saved.file;
  for (const bool calibrate : {false, true}) {
    OffloadOptions opts = test::sim_options(saved.dir);
    opts.profile_name = "staged";
    opts.build_profile = calibrate;
    try {
      (void)load_weights_for_offload(module_tree_from(*model.net), load, opts);
      ADD_FAILURE() << "profile options were accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("later enable_offload"), std::string::npos) << e.what();
    }
  }
  (void)load_weights_for_offload(module_tree_from(*model.net), load, test::sim_options(saved.dir));
  EXPECT_TRUE(at::equal(model.run(), saved.expected));
}

TEST(Loader, AFailedSetupLeavesPlaceholdersAndNothingAttached) {
  torch::manual_seed(5);
  Model model;
  TempDir dir;
  const std::string file = (dir.path() / "model.safetensors").string();
  write_safetensors(file, state_of(*model.net));
  release_weights(*model.net);
  auto faults = std::make_shared<engine::SimFaults>();
  engine::SimDeviceOptions so;
  so.capacity_bytes = std::int64_t{1} << 30;
  OffloadOptions opts = stream_all(dir);
  opts.device = std::shared_ptr<engine::Device>(engine::make_sim_device(so, faults));
  faults->fail_nth(engine::SimFault::kAllocate, 1, 1000);  // staging cannot be allocated
  LoadOptions load;
  load.path = file;
  EXPECT_THROW(load_with_offload(*model.net, load, opts), ddo::Error);
  EXPECT_TRUE(all_placeholders(*model.net));
  EXPECT_FALSE(interception_active());
}

TEST(Loader, MismatchesAreOneErrorNamingTheTensors) {
  torch::manual_seed(6);
  Model model;
  TempDir dir;
  auto state = state_of(*model.net);
  state[0].first = "0.wrong_name";                             // missing "0.weight", unexpected
  state[1].second = state[1].second.narrow(0, 0, 32).clone();  // "0.bias" [64] -> [32]
  const std::string file = (dir.path() / "bad.safetensors").string();
  write_safetensors(file, state);
  release_weights(*model.net);
  LoadOptions load;
  load.path = file;
  try {
    load_with_offload(*model.net, load, stream_all(dir));
    FAIL() << "loaded a file that does not match";
  } catch (const ddo::Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(what.find("'0.weight'"), std::string::npos) << what;
  }
  EXPECT_TRUE(all_placeholders(*model.net));
  state = state_of(*model.net);  // placeholders: right names and shapes, zero values
  state.emplace_back("extra.weight", at::randn({2}));
  write_safetensors(file, state);
  try {
    load_weights(*model.net, load);
    FAIL() << "loaded a file with a tensor the module lacks";
  } catch (const ddo::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'extra.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("allow_unexpected_keys"), std::string::npos);
  }
  load.allow_unexpected_keys = true;
  load_weights(*model.net, load);
  EXPECT_FALSE(all_placeholders(*model.net));
}

TEST(Loader, PlaceholdersTakeNoMemory) {
  // 16 GiB of placeholders: address space only.
  const at::Tensor big = make_placeholder({std::int64_t{1} << 32}, at::kFloat);
  EXPECT_TRUE(is_placeholder(big));
  EXPECT_EQ(big.numel(), std::int64_t{1} << 32);
  EXPECT_FALSE(is_placeholder(at::randn({2})));
}

}  // namespace
}  // namespace ddo::adapter
