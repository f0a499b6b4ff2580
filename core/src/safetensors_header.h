// What the component directory index shares with the safetensors header checks (internal to
// ddo_core): the corrupt-file error and the bounded JSON parse, so that an index and a header
// are refused in the same words and under the same limits (Note [Checkpoint validation] in
// safetensors_header.cpp).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ddo/core/status.h"

namespace ddo::core::internal {

// Keys a header's __metadata__ or an index's top level may hold besides the tensors: generous
// (they are short strings), and bounded, so that the key limit of parse_bounded stays linear.
constexpr std::size_t kMaxMetadataKeys = 1u << 16;

// kDataLoss: `label` (the file), what is wrong with it, and what to do about a corrupt file.
Status corrupt(std::string_view label, std::string_view detail);

// Parses `text` as one JSON document nested at most `max_depth` deep, refusing duplicate keys in
// the top-level object and in the objects directly inside it, and more than `max_keys` keys at
// those two levels (what `max_tensors` tensors need), in one linear pass (Note [Linear JSON
// parsing] in checked_json.h). `what` names the document in messages ("header", "index").
Status parse_bounded(std::string_view text, const std::string& label, std::string_view what,
                     int max_depth, std::size_t max_tensors, std::size_t max_keys,
                     nlohmann::json* out);

}  // namespace ddo::core::internal
