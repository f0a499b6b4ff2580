#include "ddo/sdnq/quantize.h"

#include <ATen/ATen.h>

#include "ddo/core/status.h"

// Note [Bit-equal quantize]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// ddo's quantizer is written from the format's facts and from the `sdnq` package's outputs
// (it is an oracle in the tests, its code is not ours to copy). Every step below was matched
// against the package by comparing tensors with torch.equal, on bfloat16 and float32 weights,
// odd shapes, rows of zeros and half-zero rows, for every type:
//  - Everything runs in float32: the weight is cast first (a float32 weight is used as is).
//  - Signed types: scale = amax(|w|) / qmax, a true division by 127, 7, 448 or 57344 (a
//    multiplication by the reciprocal differs in the last bit of some scales); q =
//    round(w / scale) (half to even), clamped to [-qmax - 1, qmax]. fp8 is w / scale clamped to
//    ±qmax, then cast (round to nearest even).
//  - Unsigned types: zero_point = min(w), scale = (max(w) - min(w)) / qmax, q = round((w -
//    zero_point) / scale), clamped to [0, qmax].
//  - A group of zeros keeps scale 0 (and zero point 0) and quantizes to 0, as the package
//    stores it. Dividing by 1 where the scale is 0 gives those bits with no 0 / 0, whose NaN
//    would cast to an integer differently on different devices.
//  - int4 stores q + 8; 4-bit values are packed two per byte, low nibble first, in row-major
//    order of the [out, groups, group_size] tensor.
//  - SVD: U, S, V from torch.svd_lowrank(w, q=svd_rank, niter=svd_steps) on the float32 weight
//    (so the first random numbers after a seed are R, [min-side, rank]); svd_up = (U * S) and
//    svd_down = V^T, both cast to the result dtype; the quantized part is w - float(svd_up @
//    svd_down), the product taken in the result dtype. `svd_lowrank` below is torch's
//    algorithm (torch/_lowrank.py, BSD) op for op, so the factors are bit-equal on the CPU.

// Note [The package's group sizes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Observed on sdnq 0.2.8 over 150 random (in_features, group) pairs, all matched:
//  - Default: 2^(bits + 2) inputs per group (64 for 4-bit types, 1024 for 8-bit ones), twice
//    that with SVD; per row for the int8-matmul layout.
//  - Then, with k = in / g (integer division): k <= 1 means one scale per row; g dividing `in`
//    is kept; otherwise k is lowered one by one, starting at k - 1, until it divides `in`, and
//    the group becomes in / k (per row again if k reaches 1). So 200 inputs with 64 asked give
//    100, 3000 with 512 give 750 (not 600: k = 5 itself is skipped), 2560 with 1024 per row.
//  - The int8-matmul layout needs both dimensions >= 32 and multiples of 16 and no groups;
//    otherwise the weight keeps the plain layout (with the default groups of its type).

namespace ddo::sdnq {
namespace {

double max_value(QuantType t) {
  switch (t) {
    case QuantType::kInt8:
      return 127.0;
    case QuantType::kUint8:
      return 255.0;
    case QuantType::kInt4:
      return 7.0;
    case QuantType::kUint4:
      return 15.0;
    case QuantType::kFloat8E4M3:
      return 448.0;
    case QuantType::kFloat8E5M2:
      return 57344.0;
  }
  return 1.0;
}

bool is_float8(QuantType t) {
  return t == QuantType::kFloat8E4M3 || t == QuantType::kFloat8E5M2;
}

// torch.svd_lowrank(a, q=rank, niter=steps) for a real 2-D float tensor, op for op (Halko et
// al., algorithms 4.4 and 5.1). The random basis comes from the default generator of a's
// device, as torch.randn draws it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> svd_lowrank(at::Tensor a, std::int64_t rank,
                                                           std::int64_t steps) {
  const bool wide = a.size(0) < a.size(1);
  if (wide) a = a.mH();
  const at::Tensor r = at::randn({a.size(1), rank}, a.options());
  at::Tensor q = std::get<0>(at::linalg_qr(at::matmul(a, r)));
  for (std::int64_t i = 0; i < steps; ++i) {
    q = std::get<0>(at::linalg_qr(at::matmul(a.mH(), q)));
    q = std::get<0>(at::linalg_qr(at::matmul(a, q)));
  }
  const at::Tensor b = at::matmul(q.mH(), a);
  auto [u, s, vh] = at::linalg_svd(b, /*full_matrices=*/false);
  at::Tensor v = vh.mH();
  u = q.matmul(u);
  if (wide) std::swap(u, v);
  return {u, s, v};
}

// Replaces zero scales by 1 for the division only (Note [Bit-equal quantize]).
at::Tensor divisor(const at::Tensor& scale) {
  return at::where(scale == 0, at::ones_like(scale), scale);
}

}  // namespace

std::int64_t resolve_group_size(const QuantizeOptions& options, std::int64_t in_features) {
  std::int64_t g = options.group_size;
  if (g < 0) {
    if ((options.transposed || options.quantized_matmul) && is_matmul_type(options.type)) {
      return 0;
    }
    g = (std::int64_t{1} << (num_bits(options.type) + 2)) * (options.use_svd ? 2 : 1);
  }
  if (g == 0) return 0;
  std::int64_t k = in_features / g;
  if (k <= 1) return 0;
  if (in_features % g == 0) return g;
  for (--k; in_features % k != 0; --k) {
  }
  return k <= 1 ? 0 : in_features / k;
}

bool transposed_layout_fits(std::int64_t out_features, std::int64_t in_features) {
  return out_features >= 32 && in_features >= 32 && out_features % 16 == 0 && in_features % 16 == 0;
}

std::pair<QuantizedWeight, Layout> quantize(const at::Tensor& dense_weight,
                                            const QuantizeOptions& options) {
  DDO_CHECK(dense_weight.dim() == 2, Code::kInvalidArgument,
            "SDNQ quantize: the weight must be 2-D [out, in], got ", dense_weight.dim(), "-D");
  DDO_CHECK(at::isFloatingType(dense_weight.scalar_type()), Code::kInvalidArgument,
            "SDNQ quantize: the weight is ", c10::toString(dense_weight.scalar_type()),
            "; quantize a floating-point weight");
  const bool matmul_type = is_matmul_type(options.type);
  DDO_CHECK(!options.transposed || matmul_type, Code::kInvalidArgument,
            "SDNQ quantize: transposed (the matmul layout) needs type int8 or float8_e4m3fn, got ",
            to_string(options.type));
  DDO_CHECK(!options.quantized_matmul || (matmul_type && options.group_size <= 0),
            Code::kInvalidArgument,
            "SDNQ quantize: quantized_matmul needs type int8 or float8_e4m3fn with one scale per "
            "row (group_size -1 or 0), got ",
            to_string(options.type), " with group_size ", options.group_size);
  DDO_CHECK(!options.use_svd || (options.svd_rank > 0 && options.svd_steps >= 0),
            Code::kInvalidArgument, "SDNQ quantize: svd_rank ", options.svd_rank, " and svd_steps ",
            options.svd_steps, " must be positive and non-negative");
  Layout layout;
  layout.type = options.type;
  layout.result_dtype = options.result_dtype.value_or(dense_weight.scalar_type());
  layout.out = dense_weight.size(0);
  layout.in = dense_weight.size(1);
  DDO_CHECK(!is_packed(layout.type) || (layout.out * layout.in) % 2 == 0, Code::kInvalidArgument,
            "SDNQ quantize: a ", to_string(layout.type), " weight packs two values per byte, but ",
            "[", layout.out, ", ", layout.in, "] has an odd number of elements; use an 8-bit type");
  // The package keeps the plain layout where the matmul one does not fit (see Note [The
  // package's group sizes]); its default groups then apply.
  QuantizeOptions effective = options;
  effective.transposed = options.transposed && options.group_size <= 0 &&
                         transposed_layout_fits(layout.out, layout.in);
  layout.group_size = resolve_group_size(effective, layout.in);
  layout.transposed = effective.transposed;
  layout.quantized_matmul = effective.transposed || options.quantized_matmul;
  DDO_CHECK(!(layout.transposed && options.use_svd), Code::kInvalidArgument,
            "SDNQ quantize: the matmul layout stores the SVD factors transposed, which ddo's "
            "layout does not hold; drop transposed or use_svd");

  at::Tensor w = dense_weight.to(at::kFloat);
  QuantizedWeight q;
  if (options.use_svd) {
    auto [u, s, v] = svd_lowrank(w, options.svd_rank, options.svd_steps);
    q.svd_up = at::mul(u, s).to(layout.result_dtype).contiguous();
    q.svd_down = v.t().to(layout.result_dtype).contiguous();
    w = at::sub(w, at::matmul(q.svd_up, q.svd_down).to(at::kFloat));
  }
  if (layout.group_size > 0) w = w.reshape({layout.out, layout.groups(), layout.group_size});

  const double qmax = max_value(layout.type);
  if (is_unsigned(layout.type)) {
    const at::Tensor mn = at::amin(w, {-1}, /*keepdim=*/true);
    const at::Tensor mx = at::amax(w, {-1}, /*keepdim=*/true);
    q.scale = at::div(at::sub(mx, mn), qmax);
    q.zero_point = mn;
    q.weight = at::round(at::div(at::sub(w, mn), divisor(q.scale))).clamp(0, qmax).to(at::kByte);
  } else {
    q.scale = at::div(at::amax(at::abs(w), {-1}, /*keepdim=*/true), qmax);
    const at::Tensor v = at::div(w, divisor(q.scale));
    if (is_float8(layout.type)) {
      q.weight = v.clamp(-qmax, qmax).to(storage_dtype(layout.type));
    } else {
      const at::Tensor r = at::round(v).clamp(-qmax - 1, qmax);
      q.weight = layout.type == QuantType::kInt4 ? at::add(r, 8).to(at::kByte) : r.to(at::kChar);
    }
  }

  if (is_packed(layout.type)) {
    const at::Tensor pairs = q.weight.reshape({-1, 2});
    q.weight = at::bitwise_or(pairs.select(1, 0), at::bitwise_left_shift(pairs.select(1, 1), 4));
  } else if (layout.transposed) {
    q.weight = q.weight.t();
    q.scale = q.scale.t();
    if (q.zero_point.defined()) q.zero_point = q.zero_point.t();
  }
  q.weight = q.weight.contiguous();
  q.scale = q.scale.contiguous();
  if (q.zero_point.defined()) q.zero_point = q.zero_point.contiguous();
  layout.check(q);
  return {q, layout};
}

}  // namespace ddo::sdnq
