// SDNQ layouts, the reference dequantize, the quantizer's round trip and the ops (CPU).
// Bit-equality with the `sdnq` package itself is checked from Python (python/tests/test_sdnq.py).
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include "ddo/core/status.h"
#include "ddo/sdnq/dequantize.h"
#include "ddo/sdnq/linear.h"
#include "ddo/sdnq/ops.h"
#include "ddo/sdnq/quantize.h"

namespace ddo::sdnq {
namespace {

struct Case {
  QuantType type;
  std::int64_t group_size;
  bool svd;
  bool transposed;
  double tolerance;  // max |dequantized - dense| relative to max |dense|
};

std::string name_of(const Case& c) {
  const std::string group = c.group_size < 0 ? "default" : std::to_string(c.group_size);
  return std::string(to_string(c.type)) + "_g" + group + (c.svd ? "_svd" : "") +
         (c.transposed ? "_t" : "");
}

const Case kCases[] = {
    {QuantType::kInt8, 0, false, false, 0.01},
    {QuantType::kInt8, 32, false, false, 0.01},
    {QuantType::kInt8, 0, false, true, 0.01},
    {QuantType::kUint8, 0, false, false, 0.01},
    {QuantType::kInt4, -1, false, false, 0.16},
    {QuantType::kUint4, -1, false, false, 0.08},
    {QuantType::kUint4, 32, true, false, 0.08},
    {QuantType::kFloat8E4M3, 0, false, false, 0.07},
    {QuantType::kFloat8E5M2, 0, false, false, 0.13},
    {QuantType::kInt8, 0, true, false, 0.01},
};

class SdnqLayouts : public ::testing::TestWithParam<Case> {};

TEST_P(SdnqLayouts, QuantizeThenDequantizeIsCloseAndShapedAsTheFormatSays) {
  const Case c = GetParam();
  at::manual_seed(1);
  const at::Tensor dense = at::randn({48, 128}).to(at::kBFloat16);
  QuantizeOptions opt;
  opt.type = c.type;
  opt.group_size = c.group_size;
  opt.use_svd = c.svd;
  opt.svd_rank = 8;
  opt.transposed = c.transposed;
  auto [w, layout] = quantize(dense, opt);
  EXPECT_EQ(w.weight.sizes().vec(), layout.stored_shape());
  EXPECT_EQ(w.scale.sizes().vec(), layout.scale_shape());
  EXPECT_EQ(w.zero_point.defined(), is_unsigned(c.type));
  EXPECT_EQ(w.svd_up.defined(), c.svd);
  if (c.type == QuantType::kUint4 || c.type == QuantType::kInt4) {
    EXPECT_EQ(w.weight.dim(), 1);
    EXPECT_EQ(w.weight.numel(), 48 * 128 / 2);
    if (c.group_size < 0) {
      EXPECT_EQ(layout.group_size, 64);  // the package's default
    }
  }
  const at::Tensor back = dequantize_reference(w, layout);
  ASSERT_EQ(back.sizes(), dense.sizes());
  EXPECT_EQ(back.scalar_type(), at::kBFloat16);
  const double err = (back.to(at::kFloat) - dense.to(at::kFloat)).abs().max().item<double>();
  const double ref = dense.to(at::kFloat).abs().max().item<double>();
  EXPECT_LT(err / ref, c.tolerance) << name_of(c);
  // The dispatcher op gives the same bits as the reference on the CPU.
  const at::Tensor via_op = call_dequantize(w, layout.encode());
  EXPECT_TRUE(at::equal(via_op, back)) << name_of(c);
}

INSTANTIATE_TEST_SUITE_P(All, SdnqLayouts, ::testing::ValuesIn(kCases),
                         [](const auto& test) { return name_of(test.param); });

TEST(SdnqReference, Uint4NibblesLowFirstAndAddcmul) {
  // One row, one group of 4: bytes 0x21, 0x43 hold 1, 2, 3, 4.
  Layout layout{QuantType::kUint4, at::kFloat, 1, 4, 4, false};
  QuantizedWeight w;
  w.weight = at::tensor(std::vector<std::uint8_t>{0x21, 0x43});
  w.scale = at::full({1, 1, 1}, 0.5f);
  w.zero_point = at::full({1, 1, 1}, -1.0f);
  const at::Tensor r = dequantize_reference(w, layout);
  EXPECT_TRUE(
      at::equal(r, at::tensor(std::vector<float>{-0.5f, 0.0f, 0.5f, 1.0f}).reshape({1, 4})));
}

TEST(SdnqReference, Int4IsOffsetByEight) {
  Layout layout{QuantType::kInt4, at::kFloat, 1, 2, 0, false};
  QuantizedWeight w;
  w.weight = at::tensor(std::vector<std::uint8_t>{0xF0});  // 0 - 8, 15 - 8
  w.scale = at::full({1, 1}, 2.0f);
  EXPECT_TRUE(at::equal(dequantize_reference(w, layout),
                        at::tensor(std::vector<float>{-16.0f, 14.0f}).reshape({1, 2})));
}

TEST(SdnqLayout, EncodeDecodeRoundTripAndBadCodes) {
  const Layout l{QuantType::kUint4, at::kBFloat16, 3072, 12288, 64, false};
  EXPECT_EQ(Layout::decode(l.encode()), l);
  std::vector<std::int64_t> bad = l.encode();
  bad[5] = 100;  // does not divide 12288
  EXPECT_THROW(Layout::decode(bad), Error);
  bad = l.encode();
  bad[0] = 9;
  EXPECT_THROW(Layout::decode(bad), Error);
  EXPECT_THROW(parse_quant_type("int3"), Error);
  EXPECT_EQ(parse_quant_type("float8_e4m3fn"), QuantType::kFloat8E4M3);
}

TEST(SdnqLayout, ShapesWhoseSizesWouldWrapAreRefused) {
  // 2^62 x 4 elements: out * in wraps int64 in every size derived from it.
  const Layout wraps{QuantType::kUint4, at::kBFloat16, std::int64_t{1} << 62, 4, 0, false};
  try {
    (void)Layout::decode(wraps.encode());
    ADD_FAILURE() << "a shape of 2^64 elements was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 2^48 elements"), std::string::npos) << e.what();
  }
  const Layout large{
      QuantType::kInt8, at::kBFloat16, std::int64_t{1} << 24, std::int64_t{1} << 24, 0, false};
  EXPECT_EQ(Layout::decode(large.encode()), large);  // 2^48 exactly: accepted
  const Layout over{QuantType::kInt8,
                    at::kBFloat16,
                    (std::int64_t{1} << 24) + 1,
                    std::int64_t{1} << 24,
                    0,
                    false};
  EXPECT_THROW((void)Layout::decode(over.encode()), Error);
}

TEST(SdnqLayout, CheckNamesTheWrongTensor) {
  Layout layout{QuantType::kInt8, at::kBFloat16, 4, 8, 0, false};
  QuantizedWeight w;
  w.weight = at::zeros({4, 8}, at::kChar);
  w.scale = at::ones({4, 2});
  try {
    layout.check(w);
    FAIL() << "a scale of the wrong shape must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'scale' has shape [4, 2], expected [4, 1]"),
              std::string::npos)
        << e.what();
  }
  w.scale = at::ones({4, 1});
  w.zero_point = at::zeros({4, 1});
  EXPECT_THROW(layout.check(w), Error);  // signed types carry no zero point
}

TEST(SdnqLinear, ForwardEqualsLinearOverTheDequantizedWeight) {
  at::manual_seed(2);
  torch::nn::Linear dense(torch::nn::LinearOptions(64, 40));
  dense->to(at::kBFloat16);
  QuantizeOptions opt;
  opt.type = QuantType::kUint4;
  opt.group_size = 16;
  SdnqLinear q(*dense, opt);
  EXPECT_EQ(q->layout().out, 40);
  EXPECT_EQ(q->layout().group_size, 16);
  const at::Tensor x = at::randn({3, 5, 64}).to(at::kBFloat16);
  const at::Tensor y = q(x);
  const at::Tensor expected =
      at::linear(x, dequantize_reference(q->weights(), q->layout()), dense->bias);
  EXPECT_TRUE(at::equal(y, expected));
  // Parameters carry the package's names (the inventory's roles come from them).
  std::vector<std::string> names;
  for (const auto& p : q->named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "scale", "zero_point", "bias"}));
}

// The package's group sizes (Note [The package's group sizes] in sdnq/src/quantize.cpp), as
// sdnq 0.2.8 chose them for these shapes.
TEST(SdnqQuantize, GroupSizesFollowThePackage) {
  auto group = [](QuantType type, std::int64_t in, std::int64_t asked, bool svd = false,
                  bool transposed = false) {
    QuantizeOptions opt;
    opt.type = type;
    opt.group_size = asked;
    opt.use_svd = svd;
    opt.transposed = transposed;
    return resolve_group_size(opt, in);
  };
  EXPECT_EQ(group(QuantType::kUint4, 3072, -1), 64);
  EXPECT_EQ(group(QuantType::kInt4, 12288, -1), 64);
  EXPECT_EQ(group(QuantType::kUint4, 200, -1), 100);
  EXPECT_EQ(group(QuantType::kUint4, 2049, -1), 683);
  EXPECT_EQ(group(QuantType::kUint4, 96, -1), 0);  // one group of 96: per row
  EXPECT_EQ(group(QuantType::kInt8, 3072, -1), 1024);
  EXPECT_EQ(group(QuantType::kFloat8E4M3, 12288, -1), 1024);
  EXPECT_EQ(group(QuantType::kInt8, 1536, -1), 0);
  EXPECT_EQ(group(QuantType::kInt8, 2560, -1), 0);  // k = 2 is skipped, k = 1: per row
  EXPECT_EQ(group(QuantType::kUint8, 3584, -1), 1792);
  EXPECT_EQ(group(QuantType::kUint4, 3072, -1, /*svd=*/true), 128);
  EXPECT_EQ(group(QuantType::kInt8, 4096, -1, /*svd=*/true), 2048);
  EXPECT_EQ(group(QuantType::kInt8, 5120, -1, /*svd=*/true), 0);
  EXPECT_EQ(group(QuantType::kInt8, 3072, -1, false, /*transposed=*/true), 0);
  EXPECT_EQ(group(QuantType::kUint4, 3000, 512), 750);  // not 600
  EXPECT_EQ(group(QuantType::kInt8, 3072, 100), 128);
  EXPECT_EQ(group(QuantType::kInt8, 200, 32), 40);
  EXPECT_EQ(group(QuantType::kInt8, 3072, 0), 0);
  EXPECT_TRUE(transposed_layout_fits(32, 48));
  EXPECT_FALSE(transposed_layout_fits(16, 64));
  EXPECT_FALSE(transposed_layout_fits(40, 128));
}

TEST(SdnqQuantize, DefaultsAndShapesAtLargeInFeatures) {
  const at::Tensor dense = at::randn({32, 3072}).to(at::kBFloat16);
  QuantizeOptions opt;
  opt.type = QuantType::kUint4;
  auto [w4, l4] = quantize(dense, opt);
  EXPECT_EQ(l4.group_size, 64);
  EXPECT_EQ(w4.weight.sizes().vec(), (std::vector<std::int64_t>{32 * 3072 / 2}));
  EXPECT_EQ(w4.scale.sizes().vec(), (std::vector<std::int64_t>{32, 48, 1}));
  EXPECT_EQ(w4.scale.scalar_type(), at::kFloat);
  EXPECT_EQ(w4.zero_point.scalar_type(), at::kFloat);
  opt.type = QuantType::kInt8;
  auto [w8, l8] = quantize(dense, opt);
  EXPECT_EQ(l8.group_size, 1024);
  EXPECT_EQ(w8.weight.sizes().vec(), (std::vector<std::int64_t>{32, 3, 1024}));
  EXPECT_EQ(l8.result_dtype, at::kBFloat16);
  opt.transposed = true;
  auto [wt, lt] = quantize(dense, opt);
  EXPECT_TRUE(lt.transposed);
  EXPECT_EQ(lt.group_size, 0);
  EXPECT_EQ(wt.weight.sizes().vec(), (std::vector<std::int64_t>{3072, 32}));
  EXPECT_EQ(wt.scale.sizes().vec(), (std::vector<std::int64_t>{1, 32}));
  // 40 rows: no int8-matmul layout; the plain one with the default groups, as the package does.
  auto [wp, lp] = quantize(at::randn({40, 3072}), opt);
  EXPECT_FALSE(lp.transposed);
  EXPECT_EQ(lp.group_size, 1024);
}

TEST(SdnqQuantize, ExactValuesLowNibbleFirst) {
  QuantizeOptions opt;
  opt.type = QuantType::kUint4;
  opt.group_size = 0;
  // min 0, max 7.5: scale 0.5, q = 0, 3, 6, 15.
  auto [u, lu] =
      quantize(at::tensor(std::vector<float>{0.0f, 1.5f, 3.0f, 7.5f}).reshape({1, 4}), opt);
  EXPECT_TRUE(at::equal(u.weight, at::tensor({0x30, 0xF6}, at::kByte)));
  EXPECT_TRUE(at::equal(u.scale, at::full({1, 1}, 0.5f)));
  EXPECT_TRUE(at::equal(u.zero_point, at::zeros({1, 1})));
  // amax 3.5: scale 0.5, q = -7, -2, 1, 7 stored + 8.
  opt.type = QuantType::kInt4;
  auto [s, ls] =
      quantize(at::tensor(std::vector<float>{-3.5f, -1.0f, 0.5f, 3.5f}).reshape({1, 4}), opt);
  EXPECT_TRUE(at::equal(s.weight, at::tensor({0x61, 0xF9}, at::kByte)));
  EXPECT_FALSE(s.zero_point.defined());
  // Halves round to even: 1.25 / 0.5 = 2.5 -> 2 (uint4: (1.25 - 0) / 0.5).
  opt.type = QuantType::kUint4;
  auto [h, lh] =
      quantize(at::tensor(std::vector<float>{0.0f, 1.25f, 1.75f, 7.5f}).reshape({1, 4}), opt);
  EXPECT_TRUE(at::equal(h.weight, at::tensor({0x20, 0xF4}, at::kByte)));
}

TEST(SdnqQuantize, ZeroRowsKeepScaleZeroAndQuantizeToZero) {
  for (QuantType type : {QuantType::kInt8, QuantType::kUint8, QuantType::kInt4, QuantType::kUint4,
                         QuantType::kFloat8E4M3, QuantType::kFloat8E5M2}) {
    at::Tensor dense = at::randn({4, 64});
    dense[1].zero_();
    QuantizeOptions opt;
    opt.type = type;
    opt.group_size = 32;
    auto [w, layout] = quantize(dense, opt);
    EXPECT_TRUE(at::equal(w.scale[1], at::zeros({2, 1}))) << to_string(type);
    EXPECT_GT(w.scale[0].min().item<float>(), 0.0f) << to_string(type);
    if (w.zero_point.defined()) {
      EXPECT_TRUE(at::equal(w.zero_point[1], at::zeros({2, 1})));
    }
    const at::Tensor back = dequantize_reference(w, layout);
    EXPECT_FALSE(back.isnan().any().item<bool>()) << to_string(type);
    EXPECT_TRUE(at::equal(back[1], at::zeros({64}))) << to_string(type);
  }
}

TEST(SdnqQuantize, SvdIsSeededAndItsRankClamped) {
  const at::Tensor dense = at::randn({40, 64});
  QuantizeOptions opt;
  opt.type = QuantType::kInt4;
  opt.use_svd = true;
  opt.svd_rank = 48;  // above min(out, in) = 40: the factors have rank 40
  at::manual_seed(5);
  auto [a, la] = quantize(dense, opt);
  at::manual_seed(5);
  auto [b, lb] = quantize(dense, opt);
  EXPECT_EQ(a.svd_up.sizes().vec(), (std::vector<std::int64_t>{40, 40}));
  EXPECT_EQ(a.svd_down.sizes().vec(), (std::vector<std::int64_t>{40, 64}));
  EXPECT_TRUE(at::equal(a.svd_up, b.svd_up));
  EXPECT_TRUE(at::equal(a.weight, b.weight));
  EXPECT_EQ(la.group_size, 0);  // default with SVD: 128 > 64 inputs, per row
  opt.transposed = true;
  opt.type = QuantType::kInt8;
  EXPECT_THROW(quantize(at::randn({64, 128}), opt), Error);
}

}  // namespace
}  // namespace ddo::sdnq
