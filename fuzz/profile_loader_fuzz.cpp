// Fuzz target: a profile file as the profile store reads it (bounded JSON parse, then
// ProfileRecord::from_json with its range and version checks). Invariants beyond "no crash":
// a record that loads writes back as JSON that loads again to the same JSON, since every saved
// file must read back (profile_store.h).
#include <cstddef>
#include <cstdint>
#include <string>

#include "ddo/core/profile_store.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ddo::core;
  const std::string_view text = ddo::fuzz::as_text(data, size);
  nlohmann::json value;
  if (!parse_json_bounded(text, &value).ok()) return 0;
  ProfileRecord record;
  if (!ProfileRecord::from_json(value, &record).ok()) return 0;

  const std::string written = canonical_json(record.to_json());
  nlohmann::json reread_value;
  DDO_FUZZ_EXPECT(parse_json_bounded(written, &reread_value).ok());
  ProfileRecord reread;
  DDO_FUZZ_EXPECT(ProfileRecord::from_json(reread_value, &reread).ok());
  DDO_FUZZ_EXPECT(canonical_json(reread.to_json()) == written);
  return 0;
}
