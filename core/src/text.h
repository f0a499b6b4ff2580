// Small text helpers shared by the settings, config and preset parsers (internal to ddo_core).
#pragma once

#include <cctype>
#include <cstddef>
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

// Length of the well-formed UTF-8 sequence at the start of `text` (1-4), or 0 when it is not one:
// a stray continuation byte, a truncated sequence, an overlong form, a surrogate, or a code point
// above U+10FFFF (the forms nlohmann::json refuses to dump and Python refuses to decode).
inline std::size_t utf8_sequence_length(std::string_view text) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  std::size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;   // overlong
    if (lead == 0xED) high = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;   // overlong
    if (lead == 0xF4) high = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (text.size() < length || byte(1) < low || byte(1) > high) return 0;
  for (std::size_t i = 2; i < length; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return length;
}

inline bool is_utf8(std::string_view text) {
  while (!text.empty()) {
    const std::size_t n = utf8_sequence_length(text);
    if (n == 0) return false;
    text.remove_prefix(n);
  }
  return true;
}

// `text` for a message: well-formed UTF-8 as is, every other byte as \xNN, so that a message
// quoting hostile input can itself be printed, dumped as JSON and raised in Python.
inline std::string printable(std::string_view text) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  while (!text.empty()) {
    std::size_t n = utf8_sequence_length(text);
    if (n == 0) {
      const auto b = static_cast<unsigned char>(text.front());
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 0xF];
      n = 1;
    } else {
      out.append(text.substr(0, n));
    }
    text.remove_prefix(n);
  }
  return out;
}

}  // namespace ddo::core::text
