// Helpers shared by the adapter tests: a temporary profile directory, sim options, and a
// RecordFunction guard that flags any op other than the intercepted ones reading a managed weight.
#pragma once

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include "ddo/core/platform.h"
#include "test_files.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/memory_probe.h"

// Skips a test that needs a GPU, saying so ("no CUDA GPU": scripts/gpu.sh counts these).
#if DDO_HAVE_CUDA
#define DDO_SKIP_WITHOUT_GPU()                          \
  do {                                                  \
    if (!::ddo::adapter::cuda_memory_probe_available()) \
      GTEST_SKIP() << "no CUDA GPU: GPU test skipped";  \
  } while (0)
#else
#define DDO_SKIP_WITHOUT_GPU() GTEST_SKIP() << "no CUDA GPU (built without CUDA): GPU test skipped"
#endif

namespace ddo::adapter::test {

// A fresh directory under the system temp dir, removed at destruction.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("ddo-torch-test-" + std::to_string(ddo::testing::process_id()) + "-" +
             std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { ddo::testing::remove_tree(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// An environment with only the profile directory set (never the real home).
inline core::EnvMap test_env(const TempDir& dir) {
  return {{"DDO_PROFILE_DIR", dir.path().string()}, {"HOME", dir.path().string()}};
}

// Offload options for the sim: the dynamic route, no pinning surprises from the host.
inline OffloadOptions sim_options(const TempDir& dir, nlohmann::json overrides = {}) {
  OffloadOptions o;
  o.preset = "one_shot_fast";
  o.execution_device = "sim";
  o.env = test_env(dir);
  nlohmann::json ov = {{"small_tensor_threshold_bytes", 0},
                       {"auto_budget_policy", "off"},
                       {"always_resident_modules_pattern", nlohmann::json::array()},
                       {"available_system_ram_gb", 16.0},
                       {"system_ram_headroom_gb", 0.0}};
  if (overrides.is_object()) {
    for (auto it = overrides.begin(); it != overrides.end(); ++it) ov[it.key()] = it.value();
  }
  o.overrides = ov;
  return o;
}

// A device that forwards to another and remembers its allocations, so tests can check that a
// pointer lies in device memory.
class RecordingDevice : public engine::Device {
 public:
  explicit RecordingDevice(std::shared_ptr<engine::Device> inner) : inner_(std::move(inner)) {}
  bool contains(const void* p) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ranges_.upper_bound(p);
    if (it == ranges_.begin()) return false;
    --it;
    return static_cast<const char*>(p) < static_cast<const char*>(it->first) + it->second;
  }
  engine::DeviceCaps caps() const override { return inner_->caps(); }
  Status allocate(std::size_t bytes, void** out) override {
    Status s = inner_->allocate(bytes, out);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mutex_);
      ranges_[*out] = bytes;
    }
    return s;
  }
  void deallocate(void* ptr) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ranges_.erase(ptr);
    }
    inner_->deallocate(ptr);
  }
  Status allocate_host(std::size_t bytes, void** out) override {
    return inner_->allocate_host(bytes, out);
  }
  void deallocate_host(void* ptr) override { inner_->deallocate_host(ptr); }
  Status register_host(void* ptr, std::size_t bytes) override {
    return inner_->register_host(ptr, bytes);
  }
  void unregister_host(void* ptr) override { inner_->unregister_host(ptr); }
  engine::Stream create_stream() override { return inner_->create_stream(); }
  void destroy_stream(engine::Stream s) override { inner_->destroy_stream(s); }
  engine::Event create_event(bool timing) override { return inner_->create_event(timing); }
  void destroy_event(engine::Event e) override { inner_->destroy_event(e); }
  Status copy_to_device_async(void* dst, const void* src, std::size_t bytes,
                              engine::Stream s) override {
    return inner_->copy_to_device_async(dst, src, bytes, s);
  }
  Status copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    return inner_->copy_to_host(dst, src, bytes);
  }
  Status copy_on_device_async(void* dst, const void* src, std::size_t bytes,
                              engine::Stream s) override {
    return inner_->copy_on_device_async(dst, src, bytes, s);
  }
  void record_event(engine::Event e, engine::Stream s) override { inner_->record_event(e, s); }
  void stream_wait_event(engine::Stream s, engine::Event e) override {
    inner_->stream_wait_event(s, e);
  }
  void synchronize_event(engine::Event e) override { inner_->synchronize_event(e); }
  bool event_done(engine::Event e) override { return inner_->event_done(e); }
  float elapsed_ms(engine::Event a, engine::Event b) override { return inner_->elapsed_ms(a, b); }
  void synchronize_stream(engine::Stream s) override { inner_->synchronize_stream(s); }
  engine::DeviceMemory memory() override { return inner_->memory(); }

 private:
  std::shared_ptr<engine::Device> inner_;
  mutable std::mutex mutex_;
  std::map<const void*, std::size_t> ranges_;
};

// Records every op that receives a managed tensor but is not one that ddo intercepts (or a
// metadata-only view op that reads no data).
class ManagedReadGuard {
 public:
  ManagedReadGuard() {
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&ManagedReadGuard::on_enter)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION}));
  }
  ~ManagedReadGuard() { at::removeCallback(handle_); }

  static std::set<std::string> violations() {
    std::lock_guard<std::mutex> lock(mutex());
    return bad();
  }
  static void clear() {
    std::lock_guard<std::mutex> lock(mutex());
    bad().clear();
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
    static const std::set<std::string> allowed = {
        // intercepted
        "aten::addmm", "aten::mm", "aten::bmm", "aten::convolution", "aten::_convolution",
        "aten::embedding",
        // composites that forward to them
        "aten::linear", "aten::matmul", "aten::conv1d", "aten::conv2d", "aten::conv3d",
        "aten::_convolution_mode",
        // metadata only: views of the weight
        "aten::t", "aten::transpose", "aten::permute", "aten::view", "aten::reshape",
        "aten::_reshape_alias", "aten::expand", "aten::as_strided", "aten::alias", "aten::detach",
        "aten::numpy_T", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice",
        "aten::_unsafe_view", "aten::lift_fresh", "aten::size", "aten::stride", "aten::is_pinned",
        "aten::set_data", "aten::requires_grad_", "aten::_has_compatible_shallow_copy_type",
        "aten::detach_"};
    const std::string name = fn.name();
    if (allowed.count(name) != 0) return nullptr;
    for (const c10::IValue& v : fn.inputs()) {
      if (v.isTensor() && is_managed(v.toTensor())) {
        std::lock_guard<std::mutex> lock(mutex());
        bad().insert(name);
      }
    }
    return nullptr;
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::set<std::string>& bad() {
    static std::set<std::string> s;
    return s;
  }
  at::CallbackHandle handle_;
};

// enable_offload with pinning refused and fallback off fails with kResourceExhausted and leaves
// the model as it was: no interception, no managed weight.
inline void expect_pin_refusal_leaves_model_alone(torch::nn::Module& model,
                                                  const OffloadOptions& options) {
  try {
    enable_offload(model, options);
    ADD_FAILURE() << "pinning failure with fallback off must be an error";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kResourceExhausted) << e.what();
  }
  EXPECT_FALSE(interception_active());
  for (const auto& p : model.parameters()) EXPECT_FALSE(is_managed(p));
}

// Writes `tensors` (name -> fp32 CPU tensor) as one safetensors file.
inline void write_safetensors(const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.contiguous();
    const std::size_t begin = data.size();
    data.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
    header[name] = {
        {"dtype", "F32"}, {"shape", c.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  // Padded with spaces to a multiple of 8 bytes, as the safetensors library writes it, so the
  // tensors' data stays aligned in the file.
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::uint64_t n = text.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

inline std::vector<std::pair<std::string, at::Tensor>> state_of(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : m.named_parameters())
    out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

}  // namespace ddo::adapter::test
