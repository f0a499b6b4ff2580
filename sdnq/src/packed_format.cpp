#include "ddo/sdnq/packed_format.h"

#include <string>

#include "ddo/core/status.h"

namespace ddo::sdnq {

const core::PackedFormat& packed_format() {
  using core::PackedRole;
  static const core::PackedFormat* format = new core::PackedFormat{
      std::string(kFormatName),
      {
          {"weight", PackedRole::kPackedWeight},
          {"scale", PackedRole::kScale},
          {"zero_point", PackedRole::kZeroPoint},
          {"svd_up", PackedRole::kLowRankUp},
          {"svd_down", PackedRole::kLowRankDown},
          // Double quantization's second level and the zero point's own scales.
          {"scale_2", PackedRole::kAuxiliary},
          {"scale_zero_point", PackedRole::kAuxiliary},
          {"zero_point_scale", PackedRole::kAuxiliary},
          {"zero_point_2", PackedRole::kAuxiliary},
      },
      // A uint4 weight packs two values per byte; an int8 one is counted twice too (the layout
      // code is not in the inventory), which over-states its temporary: Note [Dequantized
      // temporaries] in core/src/inventory.cpp.
      {{"uint8", 2}, {"int8", 2}},
  };
  return *format;
}

void register_packed_format() {
  // The facts are fixed and valid: a failure here is a second "sdnq" with other facts.
  static const bool registered = [] {
    throw_if_error(core::register_packed_format(packed_format()));
    return true;
  }();
  (void)registered;
}

}  // namespace ddo::sdnq
