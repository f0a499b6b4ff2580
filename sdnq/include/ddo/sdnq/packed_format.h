/// \file
/// SDNQ as a packed format of core (ddo/core/packed_format.h): its tensor names and roles, and
/// the values a packed element holds, registered once under the name "sdnq".
///
/// ```
/// ddo::sdnq::register_packed_format();  // idempotent; before reading roles or temporaries
/// ddo::core::find_packed_format(ddo::sdnq::kFormatName)->role_for("svd_up");
/// // PackedRole::kLowRankUp
/// ```
#pragma once

#include <string_view>

#include "ddo/core/packed_format.h"

namespace ddo::sdnq {

/// The format's name: ModuleInfo::packed_format of an SDNQ layer, and the kind text the Python
/// gatherer writes for one.
inline constexpr std::string_view kFormatName = "sdnq";

/// SDNQ's facts: weight, scale, zero_point, svd_up, svd_down and the double-quantization
/// auxiliaries by name; a one-byte packed weight holds two values (uint4).
const core::PackedFormat& packed_format();

/// Registers packed_format() with core; any number of calls, from any thread.
void register_packed_format();

}  // namespace ddo::sdnq
