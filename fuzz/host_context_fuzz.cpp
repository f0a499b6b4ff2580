// Fuzz target: the host-context normalizer (normalize_context, context_key) on any JSON document,
// and a context file as HostContextStore reads it (bounded parse, ContextRecord::from_json).
// Invariants: normalizing is idempotent and the key of a context equals the key of its normal
// form; a record that loads writes back as JSON that loads again.
//
// The first byte picks the mode, so one corpus covers both.
#include <cstddef>
#include <cstdint>
#include <string>

#include "ddo/core/host_context.h"
#include "ddo/core/status.h"
#include "fuzz_util.h"

namespace {

void fuzz_normalize(std::string_view text) {
  using namespace ddo::core;
  nlohmann::json context;
  if (!ddo::fuzz::parse_json_for_harness(text, &context)) return;
  nlohmann::json normal;
  try {
    normal = normalize_context(context);
  } catch (const ddo::Error&) {
    return;  // a clear error is a correct answer
  }
  DDO_FUZZ_EXPECT(normalize_context(normal) == normal);
  DDO_FUZZ_EXPECT(context_key(context) == context_key(normal));
  DDO_FUZZ_EXPECT(context_file_name(context_key(normal)).size() ==
                  kContextFilePrefix.size() + kProfileKeyHexDigits + 5);  // ".json"
}

void fuzz_record(std::string_view text) {
  using namespace ddo::core;
  nlohmann::json value;
  if (!parse_json_bounded(text, &value).ok()) return;
  ContextRecord record;
  if (!ContextRecord::from_json(value, &record).ok()) return;
  const std::string written = canonical_json(record.to_json());
  nlohmann::json reread_value;
  DDO_FUZZ_EXPECT(parse_json_bounded(written, &reread_value).ok());
  ContextRecord reread;
  DDO_FUZZ_EXPECT(ContextRecord::from_json(reread_value, &reread).ok());
  DDO_FUZZ_EXPECT(canonical_json(reread.to_json()) == written);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view text = ddo::fuzz::as_text(data + 1, size - 1);
  if (data[0] & 1) {
    fuzz_record(text);
  } else {
    fuzz_normalize(text);
  }
  return 0;
}
