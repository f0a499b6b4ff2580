// Small text helpers shared by the settings, config and preset parsers (internal to ddo_core).
#pragma once

#include <cctype>
#include <string>
#include <string_view>

namespace ddo::core::text {

// `text` without leading and trailing whitespace.
inline std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
    text.remove_prefix(1);
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
    text.remove_suffix(1);
  }
  return text;
}

inline std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The spelling users' names are compared in: trimmed and lower-case ("  Auto " -> "auto").
inline std::string normalize_token(std::string_view text) {
  return lower(trim(text));
}

}  // namespace ddo::core::text
