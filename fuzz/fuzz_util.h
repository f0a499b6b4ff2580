// Helpers shared by the libFuzzer targets in fuzz/: splitting one input into parts, and a parse
// that never builds a document deeper than the harness can destroy.
//
//   auto [head, tail] = ddo::fuzz::split_once(text, "\n--\n");
//   nlohmann::json value;
//   if (ddo::fuzz::parse_json_for_harness(tail, &value)) { ... }
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "ddo/core/profile_store.h"

namespace ddo::fuzz {

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// (text before the first `separator`, text after it); the second is empty when there is none.
inline std::pair<std::string_view, std::string_view> split_once(std::string_view text,
                                                                std::string_view separator) {
  const std::size_t at = text.find(separator);
  if (at == std::string_view::npos) return {text, {}};
  return {text.substr(0, at), text.substr(at + separator.size())};
}

// Parses `text` for a target whose code under test takes a built document (the host-context
// normalizer, settings overrides). Deeper than kMaxJsonDepth + 16 is skipped: the code under test
// must reject depth above kMaxJsonDepth itself, which the 16 extra levels exercise, while the
// harness keeps its own stack use bounded.
inline bool parse_json_for_harness(std::string_view text, nlohmann::json* out) {
  if (ddo::core::json_nesting_depth(text) > ddo::core::kMaxJsonDepth + 16) return false;
  *out = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return !out->is_discarded();
}

// A violated invariant of the code under test: libFuzzer reports it as a crash with the input.
#define DDO_FUZZ_EXPECT(cond)  \
  do {                         \
    if (!(cond)) std::abort(); \
  } while (0)

}  // namespace ddo::fuzz
