// printable_text: a name or message from a file or a user made safe for a terminal (escapes for
// control characters and invalid UTF-8). Separate because it is used wherever ddo prints text
// it did not write, not only by the profile store.
#include "ddo/core/profile_store.h"

#include <algorithm>

#include <fmt/format.h>

namespace ddo::core {

std::string printable_text(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    // The length of a well-formed UTF-8 sequence starting here (0: not one).
    // 0xC0, 0xC1 and 0xF5.. never start one.
    std::size_t n = c < 0x80                       ? 1
                    : c == 0xC0 || c == 0xC1       ? 0
                    : (c >> 5) == 0x6              ? 2
                    : (c >> 4) == 0xE              ? 3
                    : (c >> 3) == 0x1E && c < 0xF5 ? 4
                                                   : 0;
    for (std::size_t k = 1; k < n; ++k) {
      if (i + k >= text.size() || (static_cast<unsigned char>(text[i + k]) >> 6) != 0x2) n = 0;
    }
    // U+0080..U+009F (C1 controls) are 0xC2 0x80..0x9F.
    const bool c1 = n == 2 && c == 0xC2 && static_cast<unsigned char>(text[i + 1]) < 0xA0;
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (n == 0 || c < 0x20 || c == 0x7F || c1) {
      for (std::size_t k = 0; k < std::max<std::size_t>(n, 1); ++k) {
        out += fmt::format("\\x{:02x}", static_cast<unsigned char>(text[i + k]));
      }
    } else {
      out.append(text.substr(i, n));
    }
    i += std::max<std::size_t>(n, 1);
  }
  return out;
}

}  // namespace ddo::core
