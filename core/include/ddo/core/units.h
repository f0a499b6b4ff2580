/// \file
/// Byte units: the GiB / MiB / KiB figures users write (doubles) converted to bytes (int64) with a
/// check, the way back for reports (figures and the "1.50 GiB" text), and align_up. Every
/// conversion of a user's figure to bytes in core and the engine goes through here, so none of them
/// can be an out-of-range float-to-int cast (undefined behaviour: DDO_VRAM_CAP_GB=16000000000 once
/// became -9223372036854775808 bytes).
///
/// ```
/// ddo::core::gib_to_bytes(1.5);    // 1610612736
/// ddo::core::gib_to_bytes(16e9);   // nullopt: 1.7e19 bytes do not fit in int64
/// std::int64_t cap = 0;
/// ddo::Status s = ddo::core::to_bytes(16e9, ddo::core::ByteUnit::kGiB, "DDO_VRAM_CAP_GB", &cap);
/// // s.code() == kInvalidArgument: "DDO_VRAM_CAP_GB=1.6e+10 GiB does not fit in 64-bit bytes
/// // (at most 8589934592 GiB); ..."
/// ddo::core::bytes_to_gib(std::int64_t{3} << 29);  // 1.5
/// ddo::core::format_gib(1.5);                      // "1.50 GiB"
/// ddo::core::align_up(1000, 256);                  // 1024
/// ```
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ddo/core/status.h"

namespace ddo::core {

/// As doubles, for arithmetic on users' figures and for reports.
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
inline constexpr double kMiB = 1024.0 * 1024.0;  ///< 2^20
inline constexpr double kKiB = 1024.0;           ///< 2^10
/// As byte counts.
inline constexpr std::int64_t kGiBBytes = std::int64_t{1} << 30;
inline constexpr std::int64_t kMiBBytes = std::int64_t{1} << 20;  ///< 2^20
inline constexpr std::int64_t kKiBBytes = std::int64_t{1} << 10;  ///< 2^10

/// The unit of a figure, as its size in bytes.
enum class ByteUnit : std::int64_t {
  kBytes = 1,
  kKiB = kKiBBytes,
  kMiB = kMiBBytes,
  kGiB = kGiBBytes,
};

/// "bytes", "KiB", "MiB", "GiB".
const char* to_string(ByteUnit unit);

/// `amount` units in bytes, rounded to the nearest byte; nullopt when `amount` is not finite or the
/// result does not fit in int64.
std::optional<std::int64_t> to_bytes(double amount, ByteUnit unit);

/// The same for a figure read from `source` (a DDO_ variable, an override key, a config field): on
/// failure kInvalidArgument naming the source, the figure and the largest one that fits; `out` is
/// unchanged.
Status to_bytes(double amount, ByteUnit unit, std::string_view source, std::int64_t* out);

/// The same, throwing ddo::Error; for figures a validated config guarantees to fit.
std::int64_t to_bytes_or_throw(double amount, ByteUnit unit, std::string_view source);

/// to_bytes(gib, ByteUnit::kGiB).
inline std::optional<std::int64_t> gib_to_bytes(double gib) {
  return to_bytes(gib, ByteUnit::kGiB);
}
/// to_bytes(mib, ByteUnit::kMiB).
inline std::optional<std::int64_t> mib_to_bytes(double mib) {
  return to_bytes(mib, ByteUnit::kMiB);
}
/// to_bytes(kib, ByteUnit::kKiB).
inline std::optional<std::int64_t> kib_to_bytes(double kib) {
  return to_bytes(kib, ByteUnit::kKiB);
}

/// Bytes as GiB, for reports.
inline constexpr double bytes_to_gib(std::int64_t bytes) {
  return static_cast<double>(bytes) / kGiB;
}
/// Bytes as MiB, for reports.
inline constexpr double bytes_to_mib(std::int64_t bytes) {
  return static_cast<double>(bytes) / kMiB;
}

/// A figure in GiB as reports and messages write it: format_gib(1.5) == "1.50 GiB".
std::string format_gib(double gib);
/// Bytes the same way: format_bytes_as_gib(std::int64_t{3} << 29) == "1.50 GiB".
inline std::string format_bytes_as_gib(std::int64_t bytes) {
  return format_gib(bytes_to_gib(bytes));
}

/// `value` rounded up to a multiple of `alignment` (a power of two, checked).
std::size_t align_up(std::size_t value, std::size_t alignment);

}  // namespace ddo::core
