// Status and errors shared by every ddo layer.
//
// Fallible core and engine paths return `ddo::Status` (a code plus a message that says what was
// seen and what to change). User-facing entry points throw `ddo::Error`, which carries the same
// status, so the Python binding can map codes to exception types in one table.
//
//   ddo::Status s = store.save(record);
//   if (!s.ok()) return s;                       // propagate
//   DDO_CHECK(headroom_gb >= 0, ddo::Code::kInvalidArgument,
//             "profile_vram_headroom_gb=", headroom_gb, " is negative; use a value >= 0");
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddo {

// Few codes, each named by what the caller should do about it.
enum class Code {
  kOk = 0,
  kInvalidArgument,     // the caller passed a bad value: fix the input (Python: ValueError)
  kFailedPrecondition,  // the call is not allowed in this state (Python: RuntimeError)
  kNotFound,            // a named thing does not exist (Python: KeyError/FileNotFoundError)
  kResourceExhausted,   // memory (device, pinned, host) ran out (Python: MemoryError)
  kUnavailable,         // the device or platform feature is missing (Python: RuntimeError)
  kDataLoss,            // a stored file is corrupt or foreign (Python: ValueError)
  kInternal,            // a ddo bug: an invariant did not hold (Python: RuntimeError)
};

const char* code_name(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// The exception thrown by public entry points; carries a Status.
class Error : public std::runtime_error {
 public:
  explicit Error(Status status)
      : std::runtime_error(status.message()), status_(std::move(status)) {}
  Error(Code code, std::string message) : Error(Status(code, std::move(message))) {}
  const Status& status() const { return status_; }
  Code code() const { return status_.code(); }

 private:
  Status status_;
};

namespace internal {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace internal

// Throws ddo::Error(code, message) when the condition is false; for user input.
#define DDO_CHECK(cond, code, ...)                                       \
  do {                                                                   \
    if (!(cond)) {                                                       \
      throw ::ddo::Error((code), ::ddo::internal::str_cat(__VA_ARGS__)); \
    }                                                                    \
  } while (0)

// Invariants: a failure is a ddo bug. Always on (the checks are off the hot path).
#define DDO_ASSERT(cond, ...)                                                                \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      ::ddo::internal::assert_fail(#cond, __FILE__, __LINE__,                                \
                                   ::ddo::internal::str_cat("" __VA_OPT__(, ) __VA_ARGS__)); \
    }                                                                                        \
  } while (0)

// Returns the status from the enclosing function when it is not ok.
#define DDO_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::ddo::Status ddo_status_ = (expr);        \
    if (!ddo_status_.ok()) return ddo_status_; \
  } while (0)

// Throws ddo::Error when the status is not ok.
inline void throw_if_error(Status status) {
  if (!status.ok()) throw Error(std::move(status));
}

}  // namespace ddo
