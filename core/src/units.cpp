#include "ddo/core/units.h"

#include <cmath>

#include <fmt/format.h>

namespace ddo::core {
namespace {

// 2^63 exactly, as a double: every double strictly inside (-2^63, 2^63) rounds to an int64.
constexpr double kTwoTo63 = 9223372036854775808.0;

}  // namespace

const char* to_string(ByteUnit unit) {
  switch (unit) {
    case ByteUnit::kBytes:
      return "bytes";
    case ByteUnit::kKiB:
      return "KiB";
    case ByteUnit::kMiB:
      return "MiB";
    case ByteUnit::kGiB:
      return "GiB";
  }
  return "bytes";
}

std::optional<std::int64_t> to_bytes(double amount, ByteUnit unit) {
  const double bytes = amount * static_cast<double>(static_cast<std::int64_t>(unit));
  // The check comes before the cast: converting an out-of-range double is undefined behaviour,
  // and llround's result for one is unspecified.
  if (!std::isfinite(bytes) || std::abs(bytes) >= kTwoTo63) return std::nullopt;
  const double rounded = std::round(bytes);
  if (std::abs(rounded) >= kTwoTo63) return std::nullopt;
  return static_cast<std::int64_t>(rounded);
}

Status to_bytes(double amount, ByteUnit unit, std::string_view source, std::int64_t* out) {
  DDO_ASSERT(out != nullptr);
  const std::optional<std::int64_t> bytes = to_bytes(amount, unit);
  if (!bytes) {
    const double largest = kTwoTo63 / static_cast<double>(static_cast<std::int64_t>(unit));
    return Status(
        Code::kInvalidArgument,
        internal::str_cat(
            source, "=", amount, " ", to_string(unit), " does not fit in 64-bit bytes (at most ",
            largest, " ", to_string(unit), "); ",
            unit == ByteUnit::kBytes
                ? "use a smaller figure"
                : internal::str_cat("write the figure in ", to_string(unit), ", not in bytes")));
  }
  *out = *bytes;
  return Status::ok_status();
}

std::int64_t to_bytes_or_throw(double amount, ByteUnit unit, std::string_view source) {
  std::int64_t bytes = 0;
  throw_if_error(to_bytes(amount, unit, source, &bytes));
  return bytes;
}

std::string format_gib(double gib) {
  return fmt::format("{:.2f} GiB", gib);
}

std::size_t align_up(std::size_t value, std::size_t alignment) {
  DDO_ASSERT(alignment != 0 && (alignment & (alignment - 1)) == 0, "alignment ", alignment,
             " is not a power of two");
  DDO_ASSERT(value <= SIZE_MAX - (alignment - 1), "align_up(", value, ", ", alignment,
             ") overflows size_t");
  return (value + alignment - 1) & ~(alignment - 1);
}

}  // namespace ddo::core
