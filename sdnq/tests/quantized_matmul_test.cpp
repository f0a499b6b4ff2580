// Quantized compute on the CPU: the layout's quantized_matmul flag, the path rules, the
// activation quantizer's and the int8 epilogue's references, and each GEMM path against the
// dequantize path on the same weights (Note [Quantized matmul accuracy]). The CUDA kernels
// against these references: sdnq/tests/gpu/quantized_matmul_kernel_test.cpp.
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "ddo/core/status.h"
#include "ddo/sdnq/dequantize.h"
#include "ddo/sdnq/ops.h"
#include "ddo/sdnq/quantize.h"
#include "ddo/sdnq/quantize_model.h"
#include "ddo/sdnq/quantized_matmul.h"

namespace ddo::sdnq {
namespace {

double relative_l2(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor af = a.to(at::kFloat);
  const at::Tensor bf = b.to(at::kFloat);
  return ((af - bf).norm() / bf.norm()).item<double>();
}

Layout matmul_layout(QuantType type, std::int64_t out, std::int64_t in) {
  Layout l;
  l.type = type;
  l.result_dtype = at::kBFloat16;
  l.out = out;
  l.in = in;
  l.quantized_matmul = true;
  return l;
}

TEST(QuantizedMatmulLayout, VersionOneCodesReadTheFlagFromTransposed) {
  const Layout t{QuantType::kInt8, at::kBFloat16, 64, 32, 0, true, true};
  std::vector<std::int64_t> v1 = t.encode();
  ASSERT_EQ(v1.size(), 8u);
  v1.pop_back();
  v1[0] = 1;
  EXPECT_EQ(Layout::decode(v1), t);  // the package's matmul layout computes quantized
  v1[6] = 0;
  EXPECT_FALSE(Layout::decode(v1).quantized_matmul);
  const Layout plain = matmul_layout(QuantType::kFloat8E4M3, 64, 32);
  EXPECT_EQ(Layout::decode(plain.encode()), plain);
}

TEST(QuantizedMatmulLayout, OnlyPerRowInt8AndFp8E4m3) {
  Layout l = matmul_layout(QuantType::kUint8, 64, 32);
  EXPECT_THROW(Layout::decode(l.encode()), Error);
  l.quantized_matmul = false;
  l.transposed = true;  // a transposed uint8 weight is no layout of the package's
  EXPECT_THROW(Layout::decode(l.encode()), Error);
  l = matmul_layout(QuantType::kInt8, 64, 32);
  l.group_size = 16;
  EXPECT_THROW(Layout::decode(l.encode()), Error);
  l = matmul_layout(QuantType::kFloat8E4M3, 64, 32);
  l.transposed = true;  // the package's fp8 matmul layout
  EXPECT_NO_THROW(Layout::decode(l.encode()));
}

TEST(QuantizedMatmulQuantize, TheOptionGivesPerRowPlainStorage) {
  at::manual_seed(3);
  const at::Tensor dense = at::randn({64, 4096}).to(at::kBFloat16);
  for (const QuantType type : {QuantType::kInt8, QuantType::kFloat8E4M3}) {
    QuantizeOptions opt;
    opt.type = type;
    opt.quantized_matmul = true;
    auto [w, layout] = quantize(dense, opt);
    EXPECT_TRUE(layout.quantized_matmul);
    EXPECT_FALSE(layout.transposed);
    EXPECT_EQ(layout.group_size, 0);  // not the 1024 the plain 8-bit default would give
    EXPECT_EQ(w.weight.sizes(), (at::IntArrayRef{64, 4096}));
    EXPECT_EQ(w.scale.sizes(), (at::IntArrayRef{64, 1}));
  }
  QuantizeOptions bad;
  bad.type = QuantType::kUint4;
  bad.quantized_matmul = true;
  EXPECT_THROW(quantize(dense, bad), Error);
  bad.type = QuantType::kInt8;
  bad.group_size = 128;
  EXPECT_THROW(quantize(dense, bad), Error);
  // The package's fp8 matmul layout: stored [in, out], and it computes quantized.
  QuantizeOptions t;
  t.type = QuantType::kFloat8E4M3;
  t.transposed = true;
  auto [wt, lt] = quantize(dense, t);
  EXPECT_TRUE(lt.transposed);
  EXPECT_TRUE(lt.quantized_matmul);
  EXPECT_EQ(wt.weight.sizes(), (at::IntArrayRef{4096, 64}));
}

TEST(QuantizedMatmulPath, RulesInOrder) {
  const GemmTarget h100{c10::DeviceType::CUDA, 90};
  const GemmTarget rtx3090{c10::DeviceType::CUDA, 86};
  const GemmTarget rtx2080{c10::DeviceType::CUDA, 75};
  const GemmTarget cpu{c10::DeviceType::CPU, 0};
  const Layout int8 = matmul_layout(QuantType::kInt8, 3072, 3072);
  const Layout fp8 = matmul_layout(QuantType::kFloat8E4M3, 3072, 3072);
  const auto path = [](const Layout& l, const GemmTarget& t, std::int64_t rows = 4096,
                       c10::ScalarType scale = at::kFloat) {
    return choose_linear_path(l, scale, at::kBFloat16, rows, t).path;
  };
  EXPECT_EQ(path(int8, h100), LinearPath::kInt8Gemm);
  EXPECT_EQ(path(fp8, h100), LinearPath::kFp8Gemm);
  EXPECT_EQ(path(int8, rtx3090), LinearPath::kInt8Gemm);
  EXPECT_EQ(path(fp8, rtx3090), LinearPath::kDequantize);  // no fp8 tensor cores before sm_89
  EXPECT_EQ(path(int8, rtx2080), LinearPath::kDequantize);
  EXPECT_EQ(path(int8, cpu), LinearPath::kInt8Gemm);
  EXPECT_EQ(path(fp8, cpu), LinearPath::kFp8Gemm);
  EXPECT_EQ(path(int8, h100, kMinGemmRows - 1), LinearPath::kDequantize);
  EXPECT_EQ(path(int8, h100, kMinGemmRows), LinearPath::kInt8Gemm);
  EXPECT_EQ(path(int8, h100, 4096, at::kBFloat16), LinearPath::kDequantize);
  Layout odd = matmul_layout(QuantType::kInt8, 3072, 3080);  // 3080 is no multiple of 16
  EXPECT_EQ(path(odd, h100), LinearPath::kDequantize);
  Layout fp8_half = fp8;
  fp8_half.result_dtype = at::kHalf;
  EXPECT_EQ(path(fp8_half, h100), LinearPath::kDequantize);
  Layout plain = int8;
  plain.quantized_matmul = false;
  const LinearPathChoice c = choose_linear_path(plain, at::kFloat, at::kBFloat16, 4096, h100);
  EXPECT_EQ(c.path, LinearPath::kDequantize);
  EXPECT_NE(c.why.find("dequantizes"), std::string_view::npos) << c.why;
  EXPECT_EQ(std::string(to_string(LinearPath::kFp8Gemm)), "fp8_gemm");
}

TEST(QuantizedMatmulActivations, RowsQuantizeToTheirAbsmax) {
  at::manual_seed(4);
  at::Tensor x = at::randn({6, 200}).to(at::kBFloat16);
  x[2].zero_();
  x[3][17] = -50.0;  // the row's absmax, negative
  for (const QuantType type : {QuantType::kInt8, QuantType::kFloat8E4M3}) {
    const double qmax = type == QuantType::kInt8 ? 127.0 : 448.0;
    auto [q, s] = quantize_rows_reference(x, type);
    ASSERT_EQ(s.sizes(), (at::IntArrayRef{6}));
    EXPECT_EQ(q.scalar_type(), storage_dtype(type));
    EXPECT_EQ(s[2].item<float>(), 0.0f);
    EXPECT_EQ(q[2].to(at::kFloat).abs().max().item<float>(), 0.0f);
    EXPECT_EQ(q[3][17].to(at::kFloat).item<double>(), -qmax);
    EXPECT_FLOAT_EQ(s[3].item<float>(), static_cast<float>(50.0 / qmax));
    const at::Tensor back = q.to(at::kFloat) * s.unsqueeze(1);
    const at::Tensor err = (back - x.to(at::kFloat)).abs();
    if (type == QuantType::kInt8) {
      // Round to nearest: at most half a step (plus the division's last bit).
      EXPECT_TRUE(at::all(err <= s.unsqueeze(1) * 0.5001).item<bool>());
    } else {
      // e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 above the subnormals.
      EXPECT_TRUE(
          at::all(err <= x.to(at::kFloat).abs() * 0.0626 + s.unsqueeze(1) * 0.002).item<bool>());
    }
  }
  EXPECT_THROW(quantize_rows_reference(x, QuantType::kUint4), Error);
}

TEST(QuantizedMatmulEpilogue, ScalesInOrderThenBias) {
  const at::Tensor acc = at::tensor(std::vector<int>{100, -3, 7, 0}).reshape({2, 2});
  const at::Tensor rows = at::tensor(std::vector<float>{0.5f, 2.0f});
  const at::Tensor cols = at::tensor(std::vector<float>{0.25f, 4.0f});
  const at::Tensor bias = at::tensor(std::vector<float>{1.0f, -1.0f});
  const at::Tensor out = int8_scale_epilogue(acc, rows, cols, bias, at::kFloat);
  EXPECT_TRUE(
      at::equal(out, at::tensor(std::vector<float>{13.5f, -7.0f, 4.5f, -1.0f}).reshape({2, 2})));
  EXPECT_EQ(int8_scale_epilogue(acc, rows, cols, at::Tensor(), at::kBFloat16).scalar_type(),
            at::kBFloat16);
}

struct AccuracyCase {
  QuantType type;
  bool svd;
  bool transposed;
  double bound;  // relative L2 against the dequantize path (Note [Quantized matmul accuracy])
};

std::string accuracy_case_name(const ::testing::TestParamInfo<AccuracyCase>& param_info) {
  const AccuracyCase& c = param_info.param;
  return std::string(to_string(c.type)) + (c.svd ? "_svd" : "") +
         (c.transposed ? "_transposed" : "");
}

class QuantizedMatmulAccuracy : public ::testing::TestWithParam<AccuracyCase> {};

TEST_P(QuantizedMatmulAccuracy, GemmPathIsCloseToTheDequantizePath) {
  const AccuracyCase c = GetParam();
  at::manual_seed(7);
  const at::Tensor dense = (at::randn({256, 1024}) * 0.02).to(at::kBFloat16);
  QuantizeOptions opt;
  opt.type = c.type;
  opt.use_svd = c.svd;
  opt.svd_rank = 8;
  opt.transposed = c.transposed;
  opt.quantized_matmul = !c.transposed;
  opt.group_size = c.svd ? 0 : -1;
  auto [w, layout] = quantize(dense, opt);
  ASSERT_TRUE(layout.quantized_matmul);
  const at::Tensor bias = at::randn({256}).to(at::kBFloat16);
  const at::Tensor x = at::randn({2, 96, 1024}).to(at::kBFloat16);

  const LinearPathChoice choice = choose_linear_path(layout, w, x);
  ASSERT_NE(choice.path, LinearPath::kDequantize) << choice.why;
  const at::Tensor by_gemm = linear(x, w, bias, layout);  // the path the CPU takes
  ASSERT_EQ(by_gemm.sizes(), (at::IntArrayRef{2, 96, 256}));
  EXPECT_EQ(by_gemm.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(by_gemm, quantized_linear(x, w, bias, layout, choice.path)));
  const at::Tensor by_dequantize = at::linear(x, dequantize_reference(w, layout), bias);
  const double err = relative_l2(by_gemm, by_dequantize);
  EXPECT_LT(err, c.bound) << to_string(c.type);
  RecordProperty("relative_l2", std::to_string(err));
  EXPECT_GT(err, 0.0) << "the activations are quantized: the GEMM path is not the dequantize one";
  // The dispatcher op takes the same path.
  EXPECT_TRUE(at::equal(call_linear(x, w, bias, layout.encode()), by_gemm));

  // Fewer than kMinGemmRows rows: the dequantize path, bit for bit.
  const at::Tensor few = x.narrow(1, 0, 8);
  EXPECT_TRUE(at::equal(linear(few, w, bias, layout),
                        at::linear(few, dequantize_reference(w, layout), bias)));
}

// Note [One activation quantization per input]: Linears reading one unchanged input share its
// quantized rows; a write, another input or an inference tensor quantizes again, and a shared
// result equals a fresh one bit for bit.
TEST(QuantizedMatmulActivations, OneInputIsQuantizedOnceForTheLinearsThatReadIt) {
  at::manual_seed(11);
  for (QuantType type : {QuantType::kInt8, QuantType::kFloat8E4M3}) {
    SCOPED_TRACE(to_string(type));
    QuantizeOptions opt;
    opt.type = type;
    opt.quantized_matmul = true;
    opt.group_size = 0;
    std::vector<std::pair<QuantizedWeight, Layout>> layers;
    for (int i = 0; i < 3; ++i)
      layers.push_back(quantize((at::randn({128, 256}) * 0.02).to(at::kBFloat16), opt));
    const LinearPath path = type == QuantType::kInt8 ? LinearPath::kInt8Gemm : LinearPath::kFp8Gemm;
    at::Tensor x = at::randn({2, 48, 256}).to(at::kBFloat16);

    auto fresh = [&](const at::Tensor& input, int i) {
      forget_activation_quantization();
      const at::Tensor y =
          quantized_linear(input, layers[i].first, at::Tensor(), layers[i].second, path);
      forget_activation_quantization();
      return y;
    };
    std::vector<at::Tensor> expected;
    for (int i = 0; i < 3; ++i) expected.push_back(fresh(x, i));

    // q, k, v over one input: quantized once, the same outputs.
    std::int64_t before = activation_quantization_reuses();
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::equal(
          quantized_linear(x, layers[i].first, at::Tensor(), layers[i].second, path), expected[i]));
    }
    EXPECT_EQ(activation_quantization_reuses() - before, 2);

    // A write between two reads (through a view: views share the version counter).
    x.narrow(1, 0, 4).mul_(3);
    before = activation_quantization_reuses();
    const at::Tensor after_write =
        quantized_linear(x, layers[0].first, at::Tensor(), layers[0].second, path);
    EXPECT_EQ(activation_quantization_reuses() - before, 0);
    EXPECT_TRUE(at::equal(after_write, fresh(x, 0)));
    EXPECT_FALSE(at::equal(after_write, expected[0]));

    // Another tensor with equal values is another input.
    const at::Tensor copy = x.clone();
    quantized_linear(x, layers[0].first, at::Tensor(), layers[0].second, path);
    before = activation_quantization_reuses();
    quantized_linear(copy, layers[1].first, at::Tensor(), layers[1].second, path);
    EXPECT_EQ(activation_quantization_reuses() - before, 0);

    // Inference tensors carry no version counter: never shared.
    at::Tensor frozen;
    {
      c10::InferenceMode guard;
      frozen = at::randn({96, 256}).to(at::kBFloat16);
      before = activation_quantization_reuses();
      for (int i = 0; i < 3; ++i)
        quantized_linear(frozen, layers[i].first, at::Tensor(), layers[i].second, path);
      EXPECT_EQ(activation_quantization_reuses() - before, 0);
    }
    forget_activation_quantization();
  }
}

// Note [A GEMM that fails is tried once]: the layer that meets the failure dequantizes, and the
// path is not chosen again on that kind of device; ddo's own checks still raise.
TEST(QuantizedMatmulFallback, AGemmThatFailsIsTriedOnceThenLayersDequantize) {
  reset_gemm_paths_for_testing();
  at::manual_seed(3);
  const at::Tensor dense = (at::randn({128, 256}) * 0.02).to(at::kBFloat16);
  auto [w, layout] = quantize(dense, quantize_model_options(QuantType::kInt8));
  const at::Tensor bias = at::randn({128}).to(at::kBFloat16);
  const at::Tensor x = at::randn({64, 256}).to(at::kBFloat16);
  ASSERT_EQ(choose_linear_path(layout, w, x).path, LinearPath::kInt8Gemm);

  fail_gemm_calls_for_testing(LinearPath::kInt8Gemm, 1);
  const at::Tensor y = linear(x, w, bias, layout);
  EXPECT_TRUE(at::equal(y, at::linear(x, dequantize(w, layout), bias)));
  const GemmTarget cpu{};
  EXPECT_TRUE(gemm_path_disabled(LinearPath::kInt8Gemm, cpu));
  EXPECT_FALSE(gemm_path_disabled(LinearPath::kFp8Gemm, cpu));
  const LinearPathChoice after = choose_linear_path(layout, w, x);
  EXPECT_EQ(after.path, LinearPath::kDequantize);
  EXPECT_NE(after.why.find("int8 GEMM failed on this device once"), std::string_view::npos)
      << after.why;
  EXPECT_TRUE(at::equal(linear(x, w, bias, layout), y));  // no second attempt, no second failure

  // A CUDA card of another capability keeps the path.
  EXPECT_FALSE(gemm_path_disabled(LinearPath::kInt8Gemm, {c10::DeviceType::CUDA, 89}));
  reset_gemm_paths_for_testing();
  EXPECT_EQ(choose_linear_path(layout, w, x).path, LinearPath::kInt8Gemm);

  // ddo's own checks are not a GEMM failure: a wrong scale raises and disables nothing.
  QuantizedWeight bad = w;
  bad.scale = at::ones({7}, at::kFloat);
  EXPECT_THROW((void)linear(x, bad, bias, layout), Error);
  EXPECT_FALSE(gemm_path_disabled(LinearPath::kInt8Gemm, cpu));
}

INSTANTIATE_TEST_SUITE_P(All, QuantizedMatmulAccuracy,
                         ::testing::Values(AccuracyCase{QuantType::kInt8, false, false, 0.01},
                                           AccuracyCase{QuantType::kInt8, false, true, 0.01},
                                           AccuracyCase{QuantType::kInt8, true, false, 0.01},
                                           AccuracyCase{QuantType::kFloat8E4M3, false, false, 0.03},
                                           AccuracyCase{QuantType::kFloat8E4M3, false, true, 0.03}),
                         accuracy_case_name);

}  // namespace
}  // namespace ddo::sdnq

namespace ddo::sdnq {
namespace {

TEST(QuantizeModel, OptionAndSkipRules) {
  EXPECT_EQ(parse_quantize_option("fp8"), QuantType::kFloat8E4M3);
  EXPECT_EQ(parse_quantize_option("float8_e4m3fn"), QuantType::kFloat8E4M3);
  EXPECT_EQ(parse_quantize_option("int8"), QuantType::kInt8);
  EXPECT_EQ(parse_quantize_option("none"), std::nullopt);
  EXPECT_EQ(parse_quantize_option(""), std::nullopt);
  try {
    parse_quantize_option("uint4");
    FAIL() << "uint4 has no quantized GEMM";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"fp8\""), std::string::npos) << e.what();
  }
  EXPECT_EQ(quantize_skip_reason(3072, 3072, at::kBFloat16), nullptr);
  EXPECT_NE(quantize_skip_reason(3072, 3080, at::kBFloat16), nullptr);
  EXPECT_NE(quantize_skip_reason(16, 512, at::kBFloat16), nullptr);  // 8192 weights
  EXPECT_EQ(quantize_skip_reason(32, 512, at::kBFloat16), nullptr);
  EXPECT_NE(quantize_skip_reason(3072, 3072, at::kInt), nullptr);
  const QuantizeOptions o = quantize_model_options(QuantType::kFloat8E4M3);
  EXPECT_TRUE(o.quantized_matmul);
  EXPECT_EQ(o.group_size, 0);
}

}  // namespace
}  // namespace ddo::sdnq
