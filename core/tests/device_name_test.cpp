#include "ddo/core/device_name.h"

#include <string>

#include <gtest/gtest.h>

#include "ddo/core/calibration.h"

namespace ddo::core {
namespace {

TEST(DeviceNameTest, EverySpellingOfADeviceParsesToOneName) {
  struct Case {
    const char* text;
    DeviceName name;
    const char* canonical;
  };
  const Case cases[] = {
      {"cpu", {DeviceType::kCpu, 0}, "cpu"},
      {"cuda", {DeviceType::kCuda, 0}, "cuda:0"},
      {"cuda:0", {DeviceType::kCuda, 0}, "cuda:0"},
      {"cuda:00", {DeviceType::kCuda, 0}, "cuda:0"},
      {"cuda:07", {DeviceType::kCuda, 7}, "cuda:7"},
      {"sim", {DeviceType::kSim, 0}, "sim:0"},
      {"sim:1023", {DeviceType::kSim, kMaxDeviceIndex}, "sim:1023"},
  };
  for (const Case& c : cases) {
    DeviceName name{DeviceType::kSim, 5};
    ASSERT_TRUE(parse_device_name("execution_device", c.text, &name).ok()) << c.text;
    EXPECT_EQ(name, c.name) << c.text;
    EXPECT_EQ(name.str(), c.canonical) << c.text;
  }
}

TEST(DeviceNameTest, BadNamesSayWhatToWriteAndLeaveTheOutput) {
  const DeviceName before{DeviceType::kSim, 5};
  for (const char* text : {"sim:1024", "cuda:", "cuda:-1", "cuda:1x", "sim:99999999999"}) {
    DeviceName name = before;
    const Status s = parse_device_name("execution_device", text, &name);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << text;
    EXPECT_NE(s.message().find("is not a number from 0 to 1023"), std::string::npos) << s.message();
    EXPECT_EQ(name, before) << text;
  }
  for (const char* text : {"mps", "cudax:1", "CUDA:0", "", "cpu:0"}) {
    DeviceName name = before;
    const Status s = parse_device_name("--device", text, &name);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << text;
    EXPECT_NE(s.message().find("is not a device ddo executes on"), std::string::npos)
        << s.message();
    EXPECT_EQ(s.message().rfind("--device \"", 0), 0u) << s.message();
    EXPECT_EQ(name, before) << text;
  }
}

TEST(DeviceNameTest, TheIndexCheckJudgesOnlyIndexedNames) {
  for (const char* ok : {"cpu", "cuda", "sim", "mps", "cudax:99999", "cuda:1023"}) {
    EXPECT_TRUE(check_device_index("execution_device", ok).ok()) << ok;
  }
  EXPECT_FALSE(check_device_index("execution_device", "cuda:1024").ok());
}

TEST(DeviceNameTest, CalibrationRegionsKeyByTheCanonicalName) {
  EXPECT_EQ(normalize_calibration_device("cuda:00"), "cuda:0");
  EXPECT_EQ(normalize_calibration_device("sim"), "sim:0");
  EXPECT_EQ(normalize_calibration_device("cpu"), std::nullopt);
  EXPECT_EQ(normalize_calibration_device("mps"), std::nullopt);
}

}  // namespace
}  // namespace ddo::core
