/// \file
/// Status and errors shared by every ddo layer.
///
/// Fallible core and engine paths return `ddo::Status` (a code plus a message that says what was
/// seen and what to change). User-facing entry points throw `ddo::Error`, which carries the same
/// status, so the Python binding can map codes to exception types in one table.
///
/// ```
/// ddo::Status s = store.save(record);
/// if (!s.ok()) return s;                       // propagate
/// DDO_CHECK(headroom_gb >= 0, ddo::Code::kInvalidArgument,
///           "profile_vram_headroom_gb=", headroom_gb, " is negative; use a value >= 0");
/// ```
#pragma once

#include <charconv>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace ddo {

/// Few codes, each named by what the caller should do about it. The Python class of each is the
/// binding's one error table (python/src/errors.cpp; docs/design/0003-python.md): a full device
/// is torch.OutOfMemoryError, in setup as in a step, and so is any memory that ran out.
enum class Code {
  kOk = 0,
  kInvalidArgument,     ///< the caller passed a bad value: fix the input (Python: ValueError)
  kFailedPrecondition,  ///< the call is not allowed in this state (Python: RuntimeError)
  kNotFound,            ///< a named thing does not exist (Python: ddo.NotFoundError)
  kResourceExhausted,   ///< device, pinned or host memory ran out (Python: torch.OutOfMemoryError)
  kUnavailable,         ///< the device or platform feature is missing (Python: RuntimeError)
  kDataLoss,            ///< a stored file is corrupt or foreign (Python: ValueError)
  kInternal,            ///< a ddo bug: an invariant did not hold (Python: RuntimeError)
};

const char* code_name(Code code);  ///< "kInvalidArgument", ...: for messages and logs

/// A code and a message; ok() when the code is kOk. [[nodiscard]]: a status must be looked at.
class [[nodiscard]] Status {
 public:
  Status() = default;
  /// A status with `code`; the message says what was seen and what to change.
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  /// The ok status (code kOk, no message).
  static Status ok_status() { return {}; }

  /// True when the code is kOk.
  bool ok() const { return code_ == Code::kOk; }
  /// What the caller should do (see Code).
  Code code() const { return code_; }
  /// Empty for ok.
  const std::string& message() const { return message_; }
  std::string to_string() const;  ///< "<code name>: <message>", or "ok"

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

/// The exception thrown by public entry points; carries a Status.
class Error : public std::runtime_error {
 public:
  /// Throws a status that is not ok; what() is its message.
  explicit Error(Status status)
      : std::runtime_error(status.message()), status_(std::move(status)) {}
  /// The same from a code and message.
  Error(Code code, std::string message) : Error(Status(code, std::move(message))) {}
  /// The status thrown.
  const Status& status() const { return status_; }
  /// Its code.
  Code code() const { return status_.code(); }

 private:
  Status status_;
};

namespace internal {

// Note [No iostreams]
// ~~~~~~~~~~~~~~~~~~~
// Messages are built without <sstream>, so formatting a number needs no locale: on the GPU
// machine's toolchain, an ostream insertion compiled into libddo_torch.so can use its own copy of a
// locale facet id inside Python (whose libstdc++ torch loads and initialises first) and crash on
// the first number it formats (bench/results/2026-12-03-h200-python-crash/). Appending with
// std::to_chars needs no locale and reads as a stream would: integers in decimal, floating point as
// printf's %g (six significant digits), bool as 1 / 0, characters as themselves, pointers in hex.
inline void str_append(std::string& out, std::string_view s) {
  out.append(s);
}
inline void str_append(std::string& out, const char* s) {
  out.append(s != nullptr ? s : "(null)");
}
inline void str_append(std::string& out, char c) {
  out.push_back(c);
}
inline void str_append(std::string& out, bool b) {
  out.push_back(b ? '1' : '0');
}
inline void str_append(std::string& out, const void* p) {
  char buf[2 + 2 * sizeof(void*)] = {'0', 'x'};
  auto [end, ec] =
      std::to_chars(buf + 2, buf + sizeof(buf), reinterpret_cast<std::uintptr_t>(p), 16);
  out.append(buf, static_cast<std::size_t>(end - buf));
}
template <typename T>
requires(std::is_integral_v<T> && !std::is_same_v<T, bool> &&
         !std::is_same_v<T, char>) void str_append(std::string& out, T value) {
  if constexpr (std::is_same_v<T, signed char> || std::is_same_v<T, unsigned char>) {
    out.push_back(static_cast<char>(value));  // as a stream prints them
  } else {
    char buf[24];
    auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
    out.append(buf, static_cast<std::size_t>(end - buf));
  }
}
template <typename T>
requires std::is_floating_point_v<T>
void str_append(std::string& out, T value) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::general, 6);
  out.append(buf, static_cast<std::size_t>(end - buf));
}
template <typename T>
requires std::is_enum_v<T>
void str_append(std::string& out, T value) {
  str_append(out, static_cast<std::underlying_type_t<T>>(value));
}

/// Concatenates its arguments into one message. See Note [No iostreams].
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::string out;
  (str_append(out, args), ...);
  return out;
}
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace internal

/// Throws ddo::Error(code, message) when the condition is false; for user input.
#define DDO_CHECK(cond, code, ...)                                       \
  do {                                                                   \
    if (!(cond)) {                                                       \
      throw ::ddo::Error((code), ::ddo::internal::str_cat(__VA_ARGS__)); \
    }                                                                    \
  } while (0)

/// Invariants: a failure is a ddo bug. Always on (the checks are off the hot path).
#define DDO_ASSERT(cond, ...)                                                                \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      ::ddo::internal::assert_fail(#cond, __FILE__, __LINE__,                                \
                                   ::ddo::internal::str_cat("" __VA_OPT__(, ) __VA_ARGS__)); \
    }                                                                                        \
  } while (0)

/// Returns the status from the enclosing function when it is not ok.
#define DDO_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::ddo::Status ddo_status_ = (expr);        \
    if (!ddo_status_.ok()) return ddo_status_; \
  } while (0)

/// Throws ddo::Error when the status is not ok.
inline void throw_if_error(Status status) {
  if (!status.ok()) throw Error(std::move(status));
}

}  // namespace ddo
