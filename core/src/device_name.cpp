#include "ddo/core/device_name.h"

#include <algorithm>
#include <charconv>

namespace ddo::core {
namespace {

constexpr std::string_view type_name(DeviceType type) {
  switch (type) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kCuda:
      return "cuda";
    case DeviceType::kSim:
      return "sim";
  }
  return "cpu";
}

// "cuda" / "sim" followed by ':' or the end; kCpu otherwise (the caller checks for "cpu").
bool indexed_type(std::string_view text, DeviceType* type, std::string_view* rest) {
  for (DeviceType t : {DeviceType::kCuda, DeviceType::kSim}) {
    const std::string_view name = type_name(t);
    if (text.starts_with(name) && (text.size() == name.size() || text[name.size()] == ':')) {
      *type = t;
      *rest = text.substr(name.size());
      return true;
    }
  }
  return false;
}

Status bad_index(std::string_view source, std::string_view text, DeviceType type,
                 std::string_view index) {
  return Status(
      Code::kInvalidArgument,
      internal::str_cat(source, " '", text, "': the index '", index, "' is not a number from 0 to ",
                        kMaxDeviceIndex, "; write e.g. ", type_name(type), ":0"));
}

// N of "<type>:N", or the error; `rest` is ":N".
Status parse_index(std::string_view source, std::string_view text, DeviceType type,
                   std::string_view rest, int* out) {
  const std::string_view index = rest.substr(1);
  const bool digits = !index.empty() && std::all_of(index.begin(), index.end(),
                                                    [](char c) { return c >= '0' && c <= '9'; });
  int n = 0;
  const auto [end, ec] = std::from_chars(index.data(), index.data() + index.size(), n);
  if (!digits || ec != std::errc() || end != index.data() + index.size() || n > kMaxDeviceIndex) {
    return bad_index(source, text, type, index);
  }
  *out = n;
  return Status::ok_status();
}

}  // namespace

std::string DeviceName::str() const {
  if (type == DeviceType::kCpu) return "cpu";
  return internal::str_cat(type_name(type), ":", index);
}

Status parse_device_name(std::string_view source, std::string_view text, DeviceName* out) {
  DDO_ASSERT(out != nullptr);
  if (text == "cpu") {
    *out = DeviceName{DeviceType::kCpu, 0};
    return Status::ok_status();
  }
  DeviceType type = DeviceType::kCpu;
  std::string_view rest;
  if (!indexed_type(text, &type, &rest)) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat(source, " \"", text,
                                    "\" is not a device ddo executes on; use \"cuda:N\" (a GPU), "
                                    "\"sim\" / \"sim:N\" (the host simulation) or \"cpu\" (plan "
                                    "mode only)"));
  }
  int index = 0;
  if (!rest.empty()) DDO_RETURN_IF_ERROR(parse_index(source, text, type, rest, &index));
  *out = DeviceName{type, index};
  return Status::ok_status();
}

Status check_device_index(std::string_view source, std::string_view device) {
  DeviceType type = DeviceType::kCpu;
  std::string_view rest;
  if (!indexed_type(device, &type, &rest) || rest.empty()) return Status::ok_status();
  int index = 0;
  return parse_index(source, device, type, rest, &index);
}

}  // namespace ddo::core
