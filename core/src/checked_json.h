// Parsing untrusted JSON in one linear pass (internal to ddo_core): nlohmann's SAX parser with a
// handler that builds the document and refuses, as it goes, duplicate keys in the top-level
// object and in the objects directly inside it, and more keys at those two levels than a limit.
//
//   CheckedJson r = parse_checked_json(text, /*max_keys=*/1 << 20);
//   if (!r.ok()) ... r.duplicate / r.too_many_keys / r.error_byte / r.number_overflow ...
//
// Note [Linear JSON parsing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The parse is O(n) in the text, and the key count stops it as soon as it passes the limit, not
// after a document of any size has been built. This handler keeps no discard logic: each value is
// appended where it belongs and each key is checked in a hash set. json::parse with a
// parser_callback_t instead rescans the parent container for discarded values each time a child
// container ends, which makes a header of n tensor entries O(n^2) (50k entries: 35 s).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ddo::core::internal {

struct CheckedJson {
  nlohmann::json value;
  std::string duplicate;         ///< "'a' twice", "field 'b' twice in 'a'"; empty when none
  bool too_many_keys = false;    ///< more than max_keys keys at depths 1 and 2
  bool number_overflow = false;  ///< a number beyond a double (1e999)
  bool parse_error = false;      ///< not JSON: error_byte says where
  std::size_t error_byte = 0;    ///< 1-based, one past the end when the text stops early
  bool ok() const {
    return duplicate.empty() && !too_many_keys && !number_overflow && !parse_error;
  }
};

CheckedJson parse_checked_json(std::string_view text, std::size_t max_keys);

/// `text` cut to at most 200 bytes at a UTF-8 boundary: a name or value from a file may be
/// megabytes long, a message should not be.
std::string excerpt(std::string_view text);

}  // namespace ddo::core::internal
