// str_cat builds messages without iostreams (Note [No iostreams] in ddo/core/status.h) and reads
// as an ostream insertion would.
#include "ddo/core/status.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace ddo {
namespace {

enum class Small : std::uint8_t { kA = 7 };

TEST(StrCat, FormatsLikeAStream) {
  EXPECT_EQ(internal::str_cat("a", std::string("b"), std::string_view("c"), 'd'), "abcd");
  EXPECT_EQ(internal::str_cat(-12, " ", 34u, " ", std::int64_t{-5000000000}, " ",
                              std::size_t{18446744073709551615u}),
            "-12 34 -5000000000 18446744073709551615");
  // Floating point as printf's %g: six significant digits.
  EXPECT_EQ(internal::str_cat(0.1), "0.1");
  EXPECT_EQ(internal::str_cat(1.0), "1");
  EXPECT_EQ(internal::str_cat(5.76837158203125), "5.76837");
  EXPECT_EQ(internal::str_cat(123456789.0), "1.23457e+08");
  EXPECT_EQ(internal::str_cat(1e-5), "1e-05");
  EXPECT_EQ(internal::str_cat(2.5f), "2.5");
  EXPECT_EQ(internal::str_cat(true, false), "10");
  EXPECT_EQ(internal::str_cat(static_cast<unsigned char>('x')), "x");
  EXPECT_EQ(internal::str_cat(Small::kA), std::string(1, '\x07'));  // uint8_t prints as a char
  EXPECT_EQ(internal::str_cat(static_cast<const char*>(nullptr)), "(null)");
  EXPECT_EQ(internal::str_cat(reinterpret_cast<const void*>(std::uintptr_t{0x1f})), "0x1f");
  EXPECT_EQ(internal::str_cat(), "");
}

TEST(StrCat, ChecksBuildTheirMessage) {
  try {
    const double headroom = -1.5;
    DDO_CHECK(headroom >= 0, Code::kInvalidArgument, "profile_vram_headroom_gb=", headroom,
              " is negative; use a value >= 0");
    FAIL() << "DDO_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_STREQ(e.what(), "profile_vram_headroom_gb=-1.5 is negative; use a value >= 0");
  }
}

}  // namespace
}  // namespace ddo
