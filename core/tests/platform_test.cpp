#include "ddo/core/platform.h"

#include <gtest/gtest.h>

namespace ddo::core {
namespace {

TEST(Platform, WslFromEnvironment) {
  EXPECT_TRUE(detect_wsl({{"WSL_DISTRO_NAME", "Ubuntu-22.04"}}, "Linux version 6.1.0"));
  EXPECT_TRUE(detect_wsl({{"WSL_INTEROP", "/run/WSL/1_interop"}}, ""));
  EXPECT_FALSE(detect_wsl({{"HOME", "/home/u"}}, "Linux version 6.1.0-13-amd64 (debian)"));
}

TEST(Platform, WslFromProcVersion) {
  EXPECT_TRUE(detect_wsl({}, "Linux version 5.15.90.1-microsoft-standard-WSL2 (gcc)"));
  EXPECT_TRUE(detect_wsl({}, "Linux version 4.4.0-19041-Microsoft (Microsoft@Microsoft.com)"));
  EXPECT_FALSE(detect_wsl({}, ""));
}

TEST(Platform, WslWrapperReadsTheFile) {
  // The build machine is not assumed to be WSL; the env path must still win.
  EXPECT_TRUE(detect_wsl({{"WSL_DISTRO_NAME", "x"}}));
}

constexpr std::int64_t kKiB = 1024;

TEST(Platform, MeminfoUsesMemAvailable) {
  const MemInfo info = parse_meminfo(
      "MemTotal:       32768000 kB\n"
      "MemFree:          100000 kB\n"
      "MemAvailable:   20000000 kB\n"
      "Buffers:           50000 kB\n"
      "Cached:          9000000 kB\n"
      "SReclaimable:     400000 kB\n"
      "HugePages_Total:       0\n");
  EXPECT_EQ(info.total_bytes, 32768000 * kKiB);
  EXPECT_EQ(info.available_bytes, 20000000 * kKiB);
}

TEST(Platform, MeminfoFallsBackToReclaimableSum) {
  const MemInfo info = parse_meminfo(
      "MemTotal:       32768000 kB\n"
      "MemFree:          100000 kB\n"
      "Buffers:           50000 kB\n"
      "Cached:          9000000 kB\n"
      "SwapCached:            0 kB\n"
      "SReclaimable:     400000 kB\n");
  EXPECT_EQ(info.available_bytes, (100000 + 50000 + 9000000 + 400000) * kKiB);
}

TEST(Platform, MeminfoFallbackToleratesMissingTermsButNeedsMemFree) {
  EXPECT_EQ(parse_meminfo("MemFree: 10 kB\nCached: 5 kB\n").available_bytes, 15 * kKiB);
  const MemInfo none = parse_meminfo("MemTotal: 10 kB\nCached: 5 kB\n");
  EXPECT_FALSE(none.available_bytes.has_value());
  EXPECT_EQ(none.total_bytes, 10 * kKiB);
}

TEST(Platform, MeminfoIgnoresGarbage) {
  const MemInfo info = parse_meminfo("junk\nMemTotal: lots kB\n: 5\nMemAvailable: 7 kB");
  EXPECT_FALSE(info.total_bytes.has_value());
  EXPECT_EQ(info.available_bytes, 7 * kKiB);
  EXPECT_FALSE(parse_meminfo("").available_bytes.has_value());
}

TEST(Platform, ReadsThisMachine) {
  const MemInfo info = read_meminfo();
  if (!info.total_bytes) GTEST_SKIP() << "no /proc/meminfo on this platform";
  EXPECT_GT(*info.total_bytes, 0);
  ASSERT_TRUE(info.available_bytes.has_value());
  EXPECT_LE(*info.available_bytes, *info.total_bytes);
  EXPECT_TRUE(detect_available_ram_bytes().has_value());
  EXPECT_TRUE(detect_total_ram_bytes().has_value());
}

}  // namespace
}  // namespace ddo::core
