// SDNQ as a packed format of core (packed_format.cpp): the roles of its tensor names and the
// values its packed elements hold, as registered.
#include "ddo/sdnq/packed_format.h"

#include <gtest/gtest.h>

namespace ddo::sdnq {
namespace {

using core::PackedRole;

TEST(SdnqPackedFormat, RolesFromTheFormatsNames) {
  register_packed_format();
  register_packed_format();  // idempotent
  const core::PackedFormat* f = core::find_packed_format(kFormatName);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(*f, packed_format());
  EXPECT_EQ(f->role_for("weight"), PackedRole::kPackedWeight);
  EXPECT_EQ(f->role_for("scale"), PackedRole::kScale);
  EXPECT_EQ(f->role_for("zero_point"), PackedRole::kZeroPoint);
  EXPECT_EQ(f->role_for("svd_up"), PackedRole::kLowRankUp);
  EXPECT_EQ(f->role_for("svd_down"), PackedRole::kLowRankDown);
  EXPECT_EQ(f->role_for("scale_2"), PackedRole::kAuxiliary);
  EXPECT_EQ(f->role_for("zero_point_2"), PackedRole::kAuxiliary);
  EXPECT_EQ(f->role_for("bias"), PackedRole::kNone);
}

// Note [Dequantized temporaries]: a one-byte packed weight holds two values (uint4), an fp8 one
// holds one.
TEST(SdnqPackedFormat, OneBytePackedElementsHoldTwoValues) {
  EXPECT_EQ(packed_format().values_in("uint8", 100), 200);
  EXPECT_EQ(packed_format().values_in("int8", 100), 200);
  EXPECT_EQ(packed_format().values_in("float8_e4m3fn", 100), 100);
}

}  // namespace
}  // namespace ddo::sdnq
