// The backends every engine test suite runs on: the simulation always, CUDA when a GPU is present.
// A suite derives its fixture from BackendTest and instantiates it over kBackends; the CUDA
// instances skip, and say so, on machines without a GPU. The device contract and the copy
// scheduler use it, so one logic is checked on each device the machine has (the style guide's
// "one test runs the same ops on every backend").
//
// ```
// class MyTest : public BackendTest {};
// TEST_P(MyTest, Works) {
//   std::unique_ptr<Device> device = open_device({.capacity_bytes = 64 << 20});
//   ...                                          // sim() says which backend runs
// }
// INSTANTIATE_TEST_SUITE_P(Backends, MyTest, kBackends, backend_name);
// ```
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "ddo/engine/device.h"

namespace ddo::engine {

/// The backends' names, as test names show them ("Backends/MyTest.Works/cuda").
inline const auto kBackends = ::testing::Values(std::string("sim"), std::string("cuda"));

/// The parameter as the instance's name.
inline std::string backend_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}

/// A fixture parametrized by backend name. SetUp skips CUDA instances without a GPU; a derived
/// SetUp calls it first and returns when IsSkipped().
class BackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!sim() && !cuda_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  }

  bool sim() const { return GetParam() == "sim"; }

  /// The backend's device: the simulation with `options`, or CUDA device 0 (which ignores them:
  /// its capacity and copy speed are the card's). Fails the test, returning null, when CUDA
  /// cannot be opened although a GPU is present.
  std::unique_ptr<Device> open_device(const SimDeviceOptions& options = {}) const {
    if (sim()) return make_sim_device(options);
    std::unique_ptr<Device> device;
    const Status status = make_cuda_device({}, &device);
    EXPECT_TRUE(status.ok()) << status.to_string();
    return device;
  }
};

}  // namespace ddo::engine
