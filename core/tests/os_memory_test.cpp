// core::os memory calls (ddo/core/os_memory.h) on this system; the Windows build runs them under
// Wine like the rest of core.
#include "ddo/core/os_memory.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <gtest/gtest.h>

namespace ddo::core::os {
namespace {

TEST(OsMemoryTest, ZeroPagesReadAsZeroAcrossTheWholeReservation) {
  const std::size_t bytes = std::size_t{64} << 20;  // many pages, never written
  std::string why;
  void* base = reserve_zero_pages(bytes, &why);
  ASSERT_NE(base, nullptr) << why;
  EXPECT_TRUE(why.empty());
  const auto* p = static_cast<const volatile std::uint8_t*>(base);
  std::uint64_t sum = 0;
  for (std::size_t off = 0; off < bytes; off += page_size()) sum += p[off];
  sum += p[bytes - 1];
  EXPECT_EQ(sum, 0u);
  release_zero_pages(base, bytes);
}

TEST(OsMemoryTest, ProcessMemoryCountsPagesThisProcessTouches) {
  const ProcessMemory before = process_memory();
  ASSERT_GT(before.resident_bytes, 0);
  ASSERT_GE(before.peak_resident_bytes, before.resident_bytes);
  // 64 MiB written page by page: resident until freed, so the reading grows by most of it.
  const std::size_t bytes = std::size_t{64} << 20;
  std::unique_ptr<char[]> block(new char[bytes]);
  std::memset(block.get(), 1, bytes);
  const ProcessMemory during = process_memory();
  EXPECT_GE(during.resident_bytes, before.resident_bytes + static_cast<std::int64_t>(bytes / 2));
  EXPECT_GE(during.peak_resident_bytes, during.resident_bytes);
  EXPECT_EQ(block[bytes - 1], 1);
}

TEST(OsMemoryTest, AnImpossibleReservationFailsWithAReason) {
  std::string why;
  // More address space than any 64-bit system maps for one process.
  void* base = reserve_zero_pages(std::size_t{1} << 62, &why);
  EXPECT_EQ(base, nullptr);
  EXPECT_NE(why.find("failed"), std::string::npos) << why;
}

TEST(OsMemoryTest, PageSizeIsAPowerOfTwoOfAtLeast4KiB) {
  const std::size_t n = page_size();
  EXPECT_GE(n, 4096u);
  EXPECT_EQ(n & (n - 1), 0u) << n;
}

TEST(OsMemoryTest, TrimHeapKeepsLiveAllocationsIntact) {
  auto* live = new std::uint8_t[1 << 16];
  for (int i = 0; i < (1 << 16); ++i) live[i] = static_cast<std::uint8_t>(i);
  for (int k = 0; k < 256; ++k) delete[] new std::uint8_t[4096];
  trim_heap();
  bool same = true;
  for (int i = 0; i < (1 << 16); ++i) same = same && live[i] == static_cast<std::uint8_t>(i);
  EXPECT_TRUE(same);
  delete[] live;
}

}  // namespace
}  // namespace ddo::core::os
