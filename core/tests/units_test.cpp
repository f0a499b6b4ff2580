#include "ddo/core/units.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace ddo::core {
namespace {

TEST(Units, ConvertsAndRoundsToTheNearestByte) {
  EXPECT_EQ(gib_to_bytes(1.5), std::int64_t{3} << 29);
  EXPECT_EQ(mib_to_bytes(256), std::int64_t{256} << 20);
  EXPECT_EQ(kib_to_bytes(16), 16384);
  EXPECT_EQ(kib_to_bytes(0.0004), 0);  // 0.41 bytes
  EXPECT_EQ(kib_to_bytes(0.0006), 1);  // 0.61 bytes
  EXPECT_EQ(gib_to_bytes(-2), -(std::int64_t{2} << 30));
  EXPECT_EQ(bytes_to_gib(std::int64_t{3} << 29), 1.5);
  EXPECT_EQ(bytes_to_mib(std::int64_t{1} << 19), 0.5);
}

// Bytes typed as GiB: 1.6e10 GiB is 1.7e19 bytes, beyond int64, and converts to no value at all,
// never to -9223372036854775808 through an out-of-range cast (undefined behaviour).
TEST(Units, FiguresBeyondInt64AreNoValue) {
  EXPECT_FALSE(gib_to_bytes(16e9).has_value());
  EXPECT_FALSE(gib_to_bytes(8589934592.0).has_value());  // 2^33 GiB = 2^63 bytes
  EXPECT_TRUE(gib_to_bytes(8589934591.0).has_value());
  EXPECT_FALSE(gib_to_bytes(-16e9).has_value());
  EXPECT_FALSE(gib_to_bytes(std::numeric_limits<double>::infinity()).has_value());
  EXPECT_FALSE(gib_to_bytes(std::nan("")).has_value());
  EXPECT_FALSE(to_bytes(1e300, ByteUnit::kBytes).has_value());
}

TEST(Units, CheckedConversionNamesTheSource) {
  std::int64_t bytes = 7;
  Status s = to_bytes(16e9, ByteUnit::kGiB, "DDO_VRAM_CAP_GB", &bytes);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("DDO_VRAM_CAP_GB=1.6e+10 GiB does not fit in 64-bit bytes"),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("not in bytes"), std::string::npos) << s.message();
  EXPECT_EQ(bytes, 7);  // unchanged
  ASSERT_TRUE(to_bytes(2, ByteUnit::kMiB, "staging_mb", &bytes).ok());
  EXPECT_EQ(bytes, 2 << 20);
  try {
    (void)to_bytes_or_throw(1e300, ByteUnit::kGiB, "vram_cap_gb");
    FAIL() << "expected ddo::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("vram_cap_gb"), std::string::npos) << e.what();
  }
}

TEST(Units, AlignUp) {
  EXPECT_EQ(align_up(0, 256), 0u);
  EXPECT_EQ(align_up(1, 256), 256u);
  EXPECT_EQ(align_up(256, 256), 256u);
  EXPECT_EQ(align_up(1000, 512), 1024u);
  EXPECT_EQ(align_up(5, 1), 5u);
}

}  // namespace
}  // namespace ddo::core
