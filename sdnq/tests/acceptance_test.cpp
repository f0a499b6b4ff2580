// accept_layer and stored_layout: the one rule for the SDNQ layers ddo runs.
#include "ddo/sdnq/acceptance.h"

#include <gtest/gtest.h>

#include "ddo/sdnq/layout.h"

namespace ddo::sdnq {
namespace {

LayerFacts int8_layer() {
  LayerFacts f;
  f.weights_dtype = "int8";
  f.result_dtype = c10::kBFloat16;
  f.out_features = 64;
  f.in_features = 128;
  return f;
}

TEST(AcceptLayer, APlainLayerGetsItsLayoutCode) {
  const Acceptance a = accept_layer(int8_layer());
  ASSERT_TRUE(a.ok()) << a.why;
  const Layout l = Layout::decode(a.layout);
  EXPECT_EQ(l.type, QuantType::kInt8);
  EXPECT_EQ(l.out, 64);
  EXPECT_EQ(l.in, 128);
  EXPECT_FALSE(l.transposed);
  EXPECT_FALSE(l.quantized_matmul);
}

TEST(AcceptLayer, EachUnsupportedFactIsNamed) {
  LayerFacts f = int8_layer();
  f.is_linear = false;
  f.module_type = "Conv2d";
  EXPECT_EQ(accept_layer(f).why, "sdnq_Conv2d: only quantized Linear layers are streamed");
  for (const char* feature : {"use_hadamard", "use_codebook", "scale_2", "zero_point_2"}) {
    f = int8_layer();
    f.features = {"something_else", feature};
    const Acceptance a = accept_layer(f);
    EXPECT_FALSE(a.ok());
    EXPECT_EQ(a.why.rfind(std::string("sdnq_") + feature + ":", 0), 0u) << a.why;
  }
  f = int8_layer();
  f.features = {"something_else"};
  EXPECT_TRUE(accept_layer(f).ok());
  f = int8_layer();
  f.result_dtype.reset();
  EXPECT_NE(accept_layer(f).why.find("unreadable"), std::string::npos);
  f = int8_layer();
  f.out_features = -1;
  EXPECT_NE(accept_layer(f).why.find("2-D"), std::string::npos);
  f = int8_layer();
  f.transposed = true;
  f.has_svd = true;
  EXPECT_NE(accept_layer(f).why.find("SVD factors of the matmul layout"), std::string::npos);
  f = int8_layer();
  f.weights_dtype = "int13";
  EXPECT_EQ(accept_layer(f).why.rfind("sdnq_layout: ", 0), 0u) << accept_layer(f).why;
}

TEST(AcceptLayer, TheMatmulLayoutComputesWithTheGemm) {
  LayerFacts f = int8_layer();
  f.transposed = true;
  const Acceptance a = accept_layer(f);
  ASSERT_TRUE(a.ok()) << a.why;
  EXPECT_TRUE(Layout::decode(a.layout).transposed);
  EXPECT_TRUE(Layout::decode(a.layout).quantized_matmul);
  f.group_size = -1;  // the package's "no groups"
  f.transposed = false;
  EXPECT_EQ(Layout::decode(accept_layer(f).layout).group_size, 0);
}

TEST(StoredLayout, ShapesDecideTheLayoutAndTheGroups) {
  // The matmul layout: [in, out] weight, [1, out] scale, and the config asking for it.
  StoredLayout s = stored_layout(true, 64, 128, {128, 64}, {1, 64});
  EXPECT_TRUE(s.transposed);
  EXPECT_EQ(s.group_size, 0);
  // The same shapes without the config, or a plain layer under it: not transposed.
  EXPECT_FALSE(stored_layout(false, 64, 128, {128, 64}, {1, 64}).transposed);
  EXPECT_FALSE(stored_layout(true, 64, 128, {64, 128}, {64, 1}).transposed);
  // One output: [1, in] reads both ways; the package keeps it plain.
  EXPECT_FALSE(stored_layout(true, 1, 128, {128, 1}, {1, 1}).transposed);
  // Groups: scale [out, groups, 1].
  s = stored_layout(false, 64, 128, {64, 4, 32}, {64, 4, 1});
  EXPECT_EQ(s.group_size, 32);
}

}  // namespace
}  // namespace ddo::sdnq
