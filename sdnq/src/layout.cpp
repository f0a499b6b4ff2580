#include "ddo/sdnq/layout.h"

#include <array>
#include <utility>

#include "ddo/core/status.h"

namespace ddo::sdnq {
namespace {

constexpr std::int64_t kLayoutVersion = 2;
// The most elements a layout describes: 2^48 (a 16M x 16M weight).
constexpr std::int64_t kMaxLayoutElements = std::int64_t{1} << 48;

constexpr std::array<std::pair<QuantType, const char*>, 6> kTypeNames = {{
    {QuantType::kInt8, "int8"},
    {QuantType::kUint8, "uint8"},
    {QuantType::kInt4, "int4"},
    {QuantType::kUint4, "uint4"},
    {QuantType::kFloat8E4M3, "float8_e4m3fn"},
    {QuantType::kFloat8E5M2, "float8_e5m2"},
}};

std::string shape_text(c10::IntArrayRef shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

// A shape of at most three dimensions held inline: Layout::check runs on every call of the
// ddo::sdnq_* ops, and comparing against these allocates nothing.
struct Dims {
  std::array<std::int64_t, 3> d{};
  std::size_t n = 0;
  c10::IntArrayRef ref() const { return {d.data(), n}; }
};

Dims quantized_dims(const Layout& l) {
  if (l.transposed) return {{l.in, l.out}, 2};
  if (l.group_size > 0) return {{l.out, l.groups(), l.group_size}, 3};
  return {{l.out, l.in}, 2};
}

Dims scale_dims(const Layout& l) {
  if (l.transposed) return {{1, l.out}, 2};
  if (l.group_size > 0) return {{l.out, l.groups(), 1}, 3};
  return {{l.out, 1}, 2};
}

Dims stored_dims(const Layout& l) {
  if (is_packed(l.type)) return {{l.out * l.in / 2}, 1};
  return quantized_dims(l);
}

void check_tensor(const at::Tensor& t, const char* name, c10::ScalarType dtype, const Dims& shape,
                  const Layout& layout) {
  DDO_CHECK(t.defined(), Code::kInvalidArgument, "SDNQ ", to_string(layout.type), " layer: '", name,
            "' is missing; a ", to_string(layout.type), " layer needs it");
  DDO_CHECK(t.scalar_type() == dtype, Code::kInvalidArgument, "SDNQ ", to_string(layout.type),
            " layer: '", name, "' is ", c10::toString(t.scalar_type()), ", expected ",
            c10::toString(dtype));
  DDO_CHECK(t.sizes() == shape.ref(), Code::kInvalidArgument, "SDNQ ", to_string(layout.type),
            " layer [", layout.out, ", ", layout.in, "]: '", name, "' has shape ",
            shape_text(t.sizes()), ", expected ", shape_text(shape.ref()));
}

}  // namespace

const char* to_string(QuantType type) {
  for (const auto& [value, name] : kTypeNames) {
    if (value == type) return name;
  }
  return "unknown";
}

QuantType parse_quant_type(std::string_view text) {
  for (const auto& [value, name] : kTypeNames) {
    if (text == name) return value;
  }
  throw Error(Code::kInvalidArgument,
              ddo::internal::str_cat("SDNQ weights_dtype \"", text,
                                     "\" is not supported by ddo; use one of int8, uint8, int4, "
                                     "uint4, float8_e4m3fn, float8_e5m2"));
}

c10::ScalarType storage_dtype(QuantType t) {
  switch (t) {
    case QuantType::kInt8:
      return c10::kChar;
    case QuantType::kFloat8E4M3:
      return c10::ScalarType::Float8_e4m3fn;
    case QuantType::kFloat8E5M2:
      return c10::ScalarType::Float8_e5m2;
    default:
      return c10::kByte;
  }
}

std::vector<std::int64_t> Layout::quantized_shape() const {
  return quantized_dims(*this).ref().vec();
}

std::vector<std::int64_t> Layout::scale_shape() const {
  return scale_dims(*this).ref().vec();
}

std::vector<std::int64_t> Layout::stored_shape() const {
  return stored_dims(*this).ref().vec();
}

std::vector<std::int64_t> Layout::encode() const {
  return {kLayoutVersion,
          static_cast<std::int64_t>(type),
          static_cast<std::int64_t>(result_dtype),
          out,
          in,
          group_size,
          transposed ? 1 : 0,
          quantized_matmul ? 1 : 0};
}

Layout Layout::decode(c10::IntArrayRef code) {
  const bool v1 = code.size() == 7 && code[0] == 1;
  DDO_CHECK(v1 || (code.size() == 8 && code[0] == kLayoutVersion), Code::kInvalidArgument,
            "SDNQ layout code ", shape_text(code),
            " is not a ddo layout (version 2 with 8 integers, or 1 with 7); build it with "
            "Layout::encode() or ddo._C.sdnq_layout_code");
  Layout l;
  DDO_CHECK(code[1] >= 0 && code[1] <= static_cast<std::int64_t>(QuantType::kFloat8E5M2),
            Code::kInvalidArgument, "SDNQ layout code: unknown type ", code[1]);
  l.type = static_cast<QuantType>(code[1]);
  const auto dtype = static_cast<c10::ScalarType>(code[2]);
  DDO_CHECK(dtype == c10::kBFloat16 || dtype == c10::kHalf || dtype == c10::kFloat,
            Code::kInvalidArgument, "SDNQ layout code: result dtype ", code[2],
            " is not bfloat16, float16 or float32");
  l.result_dtype = dtype;
  l.out = code[3];
  l.in = code[4];
  l.group_size = code[5];
  l.transposed = code[6] != 0;
  l.quantized_matmul = v1 ? l.transposed : code[7] != 0;
  DDO_CHECK(l.out > 0 && l.in > 0, Code::kInvalidArgument, "SDNQ layout code: shape [", l.out, ", ",
            l.in, "] must be positive");
  // Every size derived from the shape (elements, packed bytes, the dequantized float32 bytes)
  // stays far inside int64 below this; a larger product would wrap in those computations.
  DDO_CHECK(l.out <= kMaxLayoutElements / l.in, Code::kInvalidArgument, "SDNQ layout code: shape [",
            l.out, ", ", l.in,
            "] has more than 2^48 elements; no Linear weight is that large, so "
            "the code is damaged");
  DDO_CHECK(l.group_size >= 0 && (l.group_size == 0 || l.in % l.group_size == 0),
            Code::kInvalidArgument, "SDNQ layout code: group size ", l.group_size,
            " must be 0 (per row) or divide the ", l.in, " input features");
  DDO_CHECK(
      !((l.transposed || l.quantized_matmul) && (l.group_size > 0 || !is_matmul_type(l.type))),
      Code::kInvalidArgument, "SDNQ layout code: the ",
      l.transposed ? "transposed (matmul) layout" : "quantized matmul",
      " needs an int8 or float8_e4m3fn weight with one scale per row; got ", to_string(l.type),
      l.group_size > 0 ? " with groups" : "");
  DDO_CHECK(!is_packed(l.type) || (l.out * l.in) % 2 == 0, Code::kInvalidArgument,
            "SDNQ layout code: a 4-bit weight needs an even number of elements");
  return l;
}

void Layout::check(const QuantizedWeight& w) const {
  check_tensor(w.weight, "weight", storage_dtype(type), stored_dims(*this), *this);
  DDO_CHECK(w.scale.defined(), Code::kInvalidArgument, "SDNQ layer: 'scale' is missing");
  const c10::ScalarType compute = w.scale.scalar_type();
  DDO_CHECK(compute == c10::kFloat || compute == c10::kBFloat16 || compute == c10::kHalf,
            Code::kInvalidArgument, "SDNQ layer: 'scale' is ", c10::toString(compute),
            "; expected float32, bfloat16 or float16");
  check_tensor(w.scale, "scale", compute, scale_dims(*this), *this);
  if (is_unsigned(type)) {
    check_tensor(w.zero_point, "zero_point", compute, scale_dims(*this), *this);
  } else {
    DDO_CHECK(!w.zero_point.defined(), Code::kInvalidArgument, "SDNQ ", to_string(type),
              " layer has a 'zero_point', but signed types are symmetric; drop it or use the "
              "unsigned type");
  }
  DDO_CHECK(w.svd_up.defined() == w.svd_down.defined(), Code::kInvalidArgument,
            "SDNQ layer: 'svd_up' and 'svd_down' come together; one of them is missing");
  if (w.svd_up.defined()) {
    DDO_CHECK(w.svd_up.dim() == 2 && w.svd_down.dim() == 2 && w.svd_up.size(0) == out &&
                  w.svd_down.size(1) == in && w.svd_up.size(1) == w.svd_down.size(0),
              Code::kInvalidArgument, "SDNQ layer [", out, ", ", in, "]: svd_up ",
              shape_text(w.svd_up.sizes()), " and svd_down ", shape_text(w.svd_down.sizes()),
              " must be [out, r] and [r, in]");
    DDO_CHECK(w.svd_up.scalar_type() == result_dtype && w.svd_down.scalar_type() == result_dtype,
              Code::kInvalidArgument, "SDNQ layer: the SVD factors must be ",
              c10::toString(result_dtype), " (the result dtype)");
  }
}

}  // namespace ddo::sdnq
