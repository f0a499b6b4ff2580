#include "ddo/core/packed_format.h"

#include <deque>
#include <mutex>

namespace ddo::core {
namespace {

// Note [Packed formats]
// ~~~~~~~~~~~~~~~~~~~~~
// Core knows one packed layer: ModuleKind::kPacked, whose direct tensors carry a PackedRole. The
// planner streams a packed layer's role-carrying tensors as one unit, pins them under the packed
// admission and leaves dense fallbacks resident; calibration probes a resident budget for any
// packed model, since every packed layer dequantizes into a temporary the zero-resident peak
// misses. None of that reads a format's name. A format's own facts (its tensor names, how many
// values a packed element holds) are data in this registry, written by the format's code (SDNQ:
// sdnq/src/packed_format.cpp) and read by name: the adapter asks for roles when it writes the
// inventory, the inventory for values when it bounds the dequantized temporaries. A second format
// adds its layer code and one registration; core's inventory, planner and calibration stay as
// they are. The registry is process-wide (Note [One core per process] in core/CMakeLists.txt)
// and only grows, so a returned pointer stays valid; a deque keeps elements in place as it grows.
struct Registry {
  std::mutex mu;
  std::deque<PackedFormat> formats;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: lookups may run during exit
  return *r;
}

}  // namespace

PackedRole PackedFormat::role_for(std::string_view tensor_name) const {
  for (const auto& [name, role] : roles) {
    if (name == tensor_name) return role;
  }
  return PackedRole::kNone;
}

std::int64_t PackedFormat::values_in(std::string_view dtype, std::int64_t numel) const {
  for (const auto& [name, count] : values_per_element) {
    if (name == dtype) return count * numel;
  }
  return numel;
}

Status register_packed_format(const PackedFormat& format) {
  if (format.name.empty()) {
    return {Code::kInvalidArgument, "a packed format needs a name; set PackedFormat::name"};
  }
  for (const auto& [name, role] : format.roles) {
    if (role == PackedRole::kNone) {
      return {Code::kInvalidArgument,
              internal::str_cat("packed format '", format.name, "' lists tensor '", name,
                                "' with role none; leave it out instead")};
    }
  }
  for (const auto& [dtype, count] : format.values_per_element) {
    if (count < 1) {
      return {Code::kInvalidArgument,
              internal::str_cat("packed format '", format.name, "' says a ", dtype,
                                " element holds ", count, " values; it holds at least 1")};
    }
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.mu);
  for (const PackedFormat& known : r.formats) {
    if (known.name != format.name) continue;
    if (known == format) return Status::ok_status();
    return {
        Code::kInvalidArgument,
        internal::str_cat("packed format '", format.name,
                          "' is registered with other facts; give the new format its own name")};
  }
  r.formats.push_back(format);
  return Status::ok_status();
}

const PackedFormat* find_packed_format(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> guard(r.mu);
  for (const PackedFormat& known : r.formats) {
    if (known.name == name) return &known;
  }
  return nullptr;
}

}  // namespace ddo::core
