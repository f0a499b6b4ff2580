#include "ddo/core/status.h"

namespace ddo {

const char* code_name(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kInvalidArgument:
      return "invalid_argument";
    case Code::kFailedPrecondition:
      return "failed_precondition";
    case Code::kNotFound:
      return "not_found";
    case Code::kResourceExhausted:
      return "resource_exhausted";
    case Code::kUnavailable:
      return "unavailable";
    case Code::kDataLoss:
      return "data_loss";
    case Code::kInternal:
      return "internal";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(code_name(code_)) + ": " + message_;
}

namespace internal {
void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  throw Error(Code::kInternal,
              str_cat("ddo internal error: ", expr, " failed at ", file, ":", line,
                      msg.empty() ? "" : ": ", msg, " (this is a ddo bug; please report it)"));
}
}  // namespace internal

}  // namespace ddo
