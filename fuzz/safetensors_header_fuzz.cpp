// Fuzz target: a safetensors header as parse_safetensors_header reads it from a checkpoint
// (checkpoint.h), with 4 KiB of data after it. The header is untrusted: it decides where the
// reader reads and how much memory is filled (Note [Checkpoint validation] in
// safetensors_header.cpp). Invariants beyond "no crash": an error is kDataLoss and names the file;
// a header that passes describes only in-file, non-overlapping byte ranges that match each tensor's
// shape and dtype, sorted by offset, under unique non-empty names. The same input is parsed again
// under tight limits, which may only refuse more.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <set>
#include <string>

#include "ddo/core/checkpoint.h"
#include "ddo/core/status.h"
#include "fuzz_util.h"

namespace {

constexpr std::uint64_t kDataBytes = 4096;
const std::string kLabel = "fuzz.safetensors";

void check_header(const ddo::core::SafetensorsHeader& header, std::uint64_t file_bytes,
                  std::size_t text_bytes, const ddo::core::CheckpointLimits& limits) {
  using namespace ddo::core;
  DDO_FUZZ_EXPECT(header.file_bytes == file_bytes);
  DDO_FUZZ_EXPECT(header.data_offset == 8 + text_bytes);
  DDO_FUZZ_EXPECT(header.tensors.size() <= limits.max_tensors);
  std::set<std::string> names;
  std::uint64_t previous_offset = 0;
  std::uint64_t previous_end = 0;  // end of the last tensor holding bytes
  for (const CheckpointTensor& t : header.tensors) {
    DDO_FUZZ_EXPECT(!t.name.empty() && names.insert(t.name).second);
    DDO_FUZZ_EXPECT(t.file == 0);
    DDO_FUZZ_EXPECT(t.shape.size() <= static_cast<std::size_t>(limits.max_rank));
    std::uint64_t numel = 1;
    for (const std::int64_t d : t.shape) {
      DDO_FUZZ_EXPECT(d >= 0);
      numel *= static_cast<std::uint64_t>(d);  // cannot wrap: the parser bounds the product
    }
    DDO_FUZZ_EXPECT(t.bytes == numel * static_cast<std::uint64_t>(tensor_dtype_bytes(t.dtype)));
    DDO_FUZZ_EXPECT(t.offset >= header.data_offset && t.offset <= file_bytes);
    DDO_FUZZ_EXPECT(t.bytes <= file_bytes - t.offset);
    DDO_FUZZ_EXPECT(t.offset >= previous_offset);
    previous_offset = t.offset;
    if (t.bytes > 0) {
      DDO_FUZZ_EXPECT(t.offset >= previous_end);
      previous_end = t.offset + t.bytes;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ddo::core;
  const std::string_view text = ddo::fuzz::as_text(data, size);
  const std::uint64_t file_bytes = 8 + size + kDataBytes;

  const CheckpointLimits tight = [] {
    CheckpointLimits limits;
    limits.max_json_depth = 4;
    limits.max_rank = 3;
    limits.max_tensors = 4;
    return limits;
  }();
  const CheckpointLimits defaults;
  bool tight_ok = false;
  for (const CheckpointLimits* limits : {&tight, &defaults}) {
    SafetensorsHeader header;
    const ddo::Status status = parse_safetensors_header(text, file_bytes, kLabel, &header, *limits);
    if (status.ok()) {
      check_header(header, file_bytes, size, *limits);
    } else {
      DDO_FUZZ_EXPECT(status.code() == ddo::Code::kDataLoss);
      DDO_FUZZ_EXPECT(status.message().rfind(kLabel + ": ", 0) == 0);
      DDO_FUZZ_EXPECT(!tight_ok);  // what passes tight limits passes the defaults
    }
    if (limits == &tight) tight_ok = status.ok();
  }
  return 0;
}
