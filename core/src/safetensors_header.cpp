// The safetensors format: its element types and the header checks (Note [Checkpoint
// validation]) that turn an untrusted header into tensors whose byte ranges lie inside the file.
// Separate from the directory index (checkpoint.cpp) and the reader (checkpoint_reader.cpp):
// this file decides what a single .safetensors file may promise.
#include "safetensors_header.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checked_json.h"
#include "checkpoint_file.h"
#include "ddo/core/checkpoint.h"
#include "ddo/core/profile_store.h"  // json_nesting_depth: one depth rule for every JSON ddo reads

namespace ddo::core {
using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Element types.

namespace {

struct DtypeInfo {
  TensorDtype dtype;
  const char* name;
  int bytes;
};

// In the order of the enum, so tensor_dtype_name and tensor_dtype_bytes index it directly.
constexpr DtypeInfo kDtypes[] = {
    {TensorDtype::kF64, "F64", 8},        {TensorDtype::kF32, "F32", 4},
    {TensorDtype::kF16, "F16", 2},        {TensorDtype::kBF16, "BF16", 2},
    {TensorDtype::kI64, "I64", 8},        {TensorDtype::kI32, "I32", 4},
    {TensorDtype::kI16, "I16", 2},        {TensorDtype::kI8, "I8", 1},
    {TensorDtype::kU8, "U8", 1},          {TensorDtype::kBool, "BOOL", 1},
    {TensorDtype::kF8E4M3, "F8_E4M3", 1}, {TensorDtype::kF8E5M2, "F8_E5M2", 1},
};

const DtypeInfo& dtype_info(TensorDtype dtype) {
  const auto index = static_cast<std::size_t>(dtype);
  DDO_ASSERT(index < std::size(kDtypes) && kDtypes[index].dtype == dtype, "dtype ", index);
  return kDtypes[index];
}

std::string known_dtype_names() {
  std::string out;
  for (const DtypeInfo& info : kDtypes) {
    if (!out.empty()) out += ", ";
    out += info.name;
  }
  return out;
}

}  // namespace

std::optional<TensorDtype> parse_tensor_dtype(std::string_view name) {
  for (const DtypeInfo& info : kDtypes) {
    if (name == info.name) return info.dtype;
  }
  return std::nullopt;
}

const char* tensor_dtype_name(TensorDtype dtype) {
  return dtype_info(dtype).name;
}

int tensor_dtype_bytes(TensorDtype dtype) {
  return dtype_info(dtype).bytes;
}

// ---------------------------------------------------------------------------------------------
// Header validation.

// Note [Checkpoint validation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A safetensors header is untrusted input that decides where ddo reads and how many bytes it
// writes into memory sized from the same header. A header that lies (a bad download, a buggy
// converter, a hostile file) must therefore become an error naming the file and the tensor before
// any byte is used, never a read outside the file, a buffer overrun, or a tensor that silently
// aliases another. Every promise the header makes is checked against the file itself:
//
//  * Size of the text: the header length is at most CheckpointLimits::max_header_bytes (the
//    100 MiB safetensors itself allows) and lies inside the file, checked before it is read.
//  * Nesting: measured by a linear scan (json_nesting_depth, Note [Bounded JSON] in
//    profile_files.cpp) before nlohmann builds a document, so "[[[[..." a megabyte long is an
//    error instead of a document whose recursive copy or destruction overflows the stack. The
//    parse itself reports duplicate keys: two entries for one tensor name would let two readers
//    of the same file disagree on where its bytes are.
//  * Shape of the document: an object of tensor entries, each exactly {dtype, shape,
//    data_offsets}, plus an optional `__metadata__` of strings. Unknown fields are refused
//    rather than ignored: they mean a format this code does not understand.
//  * Each tensor: a known dtype; rank at most max_rank; dimensions non-negative integers whose
//    product times the element size fits in int64 (the nonzero ones: torch computes numel in
//    int64 in any order, and with every partial product bounded no order overflows); begin <= end;
//    end - begin equal to that byte count, so reading the tensor fills exactly the memory its
//    shape asks for; data_offset + end within the file, so every read is in range.
//  * Between tensors: sorted by begin, no two byte ranges that hold data overlap (a zero-size
//    tensor owns no bytes). Gaps are allowed: the safetensors library writes none, but a gap
//    cannot send a read out of range, so refusing it would only refuse files torch loads.
// The file's size is taken when it is opened; CheckpointReader checks it again on open and treats
// a short read (the file truncated since) as kDataLoss, never as zeros.

namespace {

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kCorruptAdvice =
    "the file is corrupt or was written by a buggy tool — re-download or re-save it";

}  // namespace

namespace internal {

Status corrupt(std::string_view label, std::string_view detail) {
  return Status(Code::kDataLoss, fmt::format("{}: {}; {}", label, detail, kCorruptAdvice));
}

Status parse_bounded(std::string_view text, const std::string& label, std::string_view what,
                     int max_depth, std::size_t max_tensors, std::size_t max_keys, json* out) {
  // safetensors refuses a byte-order mark (nlohmann would skip it) and a header padded with
  // anything but spaces after its JSON (nlohmann stops at a NUL); so does ddo.
  if (text.starts_with("\xEF\xBB\xBF")) {
    return corrupt(label, fmt::format("its {} starts with a UTF-8 byte-order mark", what));
  }
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return corrupt(
        label, fmt::format("its {} holds a NUL byte at byte {} of {}", what, nul + 1, text.size()));
  }
  if (const int depth = json_nesting_depth(text); depth > max_depth) {
    return corrupt(label, fmt::format("its {} is nested {} levels deep, more than the {} a "
                                      "safetensors {} needs",
                                      what, depth, max_depth, what));
  }
  internal::CheckedJson parsed = internal::parse_checked_json(text, max_keys);
  if (parsed.parse_error) {
    // Only the position: the text need not be valid UTF-8. The byte count is 1-based and one
    // past the end when the text stops early.
    if (parsed.error_byte > text.size()) {
      return corrupt(label, fmt::format("its {} is not valid JSON (it ends early, after {} bytes)",
                                        what, text.size()));
    }
    return corrupt(label, fmt::format("its {} is not valid JSON (error at byte {} of {})", what,
                                      parsed.error_byte, text.size()));
  }
  if (parsed.number_overflow) {
    // Found by fuzz/safetensors_header_fuzz.cpp; kept in its corpus as number_overflow.json.
    return corrupt(label, fmt::format("its {} holds a number too large for a double", what));
  }
  if (parsed.too_many_keys) {
    return corrupt(label, fmt::format("its {} lists more entries than the limit of {} tensors",
                                      what, max_tensors));
  }
  if (!parsed.duplicate.empty()) {
    return corrupt(label, fmt::format("its {} names {}", what, parsed.duplicate));
  }
  *out = std::move(parsed.value);
  return Status::ok_status();
}

}  // namespace internal

namespace {

using internal::corrupt;
using internal::excerpt;
using internal::File;
using internal::kMaxMetadataKeys;
using internal::parse_bounded;
using internal::read_exact;

std::string json_excerpt(const json& value) {
  return excerpt(value.dump());
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ","));
}

// A JSON non-negative integer (nlohmann keeps "-0" as a signed zero); nullopt for anything else,
// floats and integers beyond uint64 (which nlohmann stores as floats) included.
std::optional<std::uint64_t> as_count(const json& value) {
  if (value.is_number_unsigned()) return value.get<std::uint64_t>();
  if (value.is_number_integer() && value.get<std::int64_t>() >= 0) {
    return static_cast<std::uint64_t>(value.get<std::int64_t>());
  }
  return std::nullopt;
}

Status parse_metadata(const json& value, const std::string& label,
                      std::map<std::string, std::string>* out) {
  if (!value.is_object()) {
    return corrupt(label, fmt::format("'__metadata__' is {} {}, expected an object of strings",
                                      value.is_array() ? "an" : "a", value.type_name()));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return corrupt(label, fmt::format("'__metadata__' entry '{}' is a {}, expected a string",
                                        excerpt(key), item.type_name()));
    }
    (*out)[key] = item.get<std::string>();
  }
  return Status::ok_status();
}

// Reads a tensor's shape into out->shape and its byte count into out->bytes; what is wrong with
// it ("" when nothing), in the words of parse_tensor's errors.
std::string shape_problem(const json& shape, std::uint64_t elem_bytes,
                          const CheckpointLimits& limits, CheckpointTensor* out) {
  if (!shape.is_array()) {
    return fmt::format("has a {} for shape, expected an array of sizes", shape.type_name());
  }
  if (shape.size() > static_cast<std::size_t>(limits.max_rank)) {
    return fmt::format("has {} dimensions, more than the {} ddo allows", shape.size(),
                       limits.max_rank);
  }
  // See Note [Checkpoint validation]: the product of the nonzero sizes, times the element size,
  // fits in int64.
  constexpr std::uint64_t kMaxBytes = std::numeric_limits<std::int64_t>::max();
  std::uint64_t nonzero_bytes = elem_bytes;
  bool empty = false;
  out->shape.clear();
  for (const json& dim : shape) {
    const std::optional<std::uint64_t> size = as_count(dim);
    if (!size) {
      return fmt::format("has shape {}, expected non-negative integer sizes", json_excerpt(dim));
    }
    if (*size == 0) {
      empty = true;
    } else if (*size > kMaxBytes / nonzero_bytes) {
      return fmt::format("has shape {}, whose byte count does not fit in 64 bits",
                         json_excerpt(shape));
    } else {
      nonzero_bytes *= *size;
    }
    out->shape.push_back(static_cast<std::int64_t>(*size));
  }
  out->bytes = empty ? 0 : nonzero_bytes;
  return {};
}

// One entry of the header: fills *out (offset relative to the data section) and *end.
Status parse_tensor(const std::string& name, const json& entry, std::uint64_t data_bytes,
                    const std::string& label, const CheckpointLimits& limits, CheckpointTensor* out,
                    std::uint64_t* end) {
  const auto bad = [&](std::string_view detail) {
    return corrupt(label, fmt::format("tensor '{}' {}", excerpt(name), detail));
  };
  if (!entry.is_object()) {
    return bad(fmt::format("is a {}, expected an object with dtype, shape and data_offsets",
                           entry.type_name()));
  }
  for (const auto& [key, item] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return bad(fmt::format("has a field '{}'; expected exactly dtype, shape and data_offsets",
                             excerpt(key)));
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) return bad(fmt::format("has no '{}'", key));
  }

  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) {
    return bad(fmt::format("has a {} for dtype, expected a string", dtype.type_name()));
  }
  const std::optional<TensorDtype> parsed = parse_tensor_dtype(dtype.get_ref<const std::string&>());
  if (!parsed) {
    // Not necessarily corrupt (safetensors knows U16, F8_E8M0, ...): say what ddo reads instead.
    return Status(
        Code::kDataLoss,
        fmt::format("{}: tensor '{}' has dtype '{}', which ddo cannot read (it reads {}); "
                    "convert the checkpoint to one of those",
                    label, excerpt(name), excerpt(dtype.get_ref<const std::string&>()),
                    known_dtype_names()));
  }
  out->dtype = *parsed;
  const std::uint64_t elem_bytes = static_cast<std::uint64_t>(tensor_dtype_bytes(*parsed));

  if (std::string problem = shape_problem(entry["shape"], elem_bytes, limits, out);
      !problem.empty()) {
    return bad(problem);
  }

  const json& offsets = entry["data_offsets"];
  std::optional<std::uint64_t> begin;
  std::optional<std::uint64_t> stop;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = as_count(offsets[0]);
    stop = as_count(offsets[1]);
  }
  if (!begin || !stop) {
    return bad(fmt::format("has data_offsets {}, expected [begin, end] as non-negative integers",
                           json_excerpt(offsets)));
  }
  if (*begin > *stop) {
    return bad(
        fmt::format("has data_offsets [{}, {}], which end before they begin", *begin, *stop));
  }
  if (*stop - *begin != out->bytes) {
    return bad(fmt::format("says shape {} {} ({} bytes) but data_offsets [{}, {}] hold {} bytes",
                           shape_text(out->shape), tensor_dtype_name(*parsed), out->bytes, *begin,
                           *stop, *stop - *begin));
  }
  if (*stop > data_bytes) {
    return bad(
        fmt::format("has data_offsets [{}, {}] but the data section after the header "
                    "holds only {} bytes (the file is truncated or the offsets are wrong)",
                    *begin, *stop, data_bytes));
  }
  out->offset = *begin;
  *end = *stop;
  return Status::ok_status();
}

}  // namespace

Status parse_safetensors_header(std::string_view header_json, std::uint64_t file_bytes,
                                const std::string& label, SafetensorsHeader* out,
                                const CheckpointLimits& limits) {
  if (header_json.size() > limits.max_header_bytes) {
    return corrupt(label, fmt::format("its header is {} bytes, more than the limit of {}",
                                      header_json.size(), limits.max_header_bytes));
  }
  const std::uint64_t data_offset = 8 + static_cast<std::uint64_t>(header_json.size());
  if (data_offset > file_bytes) {
    return corrupt(label, fmt::format("its header ends at byte {} but the file is {} bytes",
                                      data_offset, file_bytes));
  }
  json doc;
  // Keys at depths 1 and 2: one per tensor and __metadata__, plus each entry's three fields and
  // the metadata's strings.
  DDO_RETURN_IF_ERROR(parse_bounded(header_json, label, "header", limits.max_json_depth,
                                    limits.max_tensors,
                                    4 * (limits.max_tensors + 1) + kMaxMetadataKeys, &doc));
  if (!doc.is_object()) {
    return corrupt(
        label, fmt::format("its header is a {}, expected an object of tensors", doc.type_name()));
  }
  const std::size_t entries = doc.size() - (doc.contains(kMetadataKey) ? 1 : 0);
  if (entries > limits.max_tensors) {
    return corrupt(label, fmt::format("its header lists {} tensors, more than the limit of {}",
                                      entries, limits.max_tensors));
  }

  SafetensorsHeader header;
  header.file_bytes = file_bytes;
  header.data_offset = data_offset;
  header.tensors.reserve(entries);
  std::vector<std::uint64_t> ends;  // parallel to header.tensors until sorted
  ends.reserve(entries);
  for (const auto& [name, entry] : doc.items()) {
    if (name == kMetadataKey) {
      DDO_RETURN_IF_ERROR(parse_metadata(entry, label, &header.metadata));
      continue;
    }
    if (name.empty()) return corrupt(label, "its header has a tensor with an empty name");
    CheckpointTensor tensor;
    tensor.name = name;
    std::uint64_t end = 0;
    DDO_RETURN_IF_ERROR(
        parse_tensor(name, entry, file_bytes - data_offset, label, limits, &tensor, &end));
    header.tensors.push_back(std::move(tensor));
    ends.push_back(end);
  }

  std::vector<std::size_t> order(header.tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const CheckpointTensor& x = header.tensors[a];
    const CheckpointTensor& y = header.tensors[b];
    return std::tie(x.offset, ends[a], x.name) < std::tie(y.offset, ends[b], y.name);
  });
  std::vector<CheckpointTensor> sorted;
  sorted.reserve(order.size());
  const CheckpointTensor* previous = nullptr;  // the last tensor that holds bytes
  std::uint64_t previous_end = 0;
  for (const std::size_t i : order) {
    const CheckpointTensor& tensor = header.tensors[i];
    if (tensor.bytes > 0) {
      if (previous != nullptr && tensor.offset < previous_end) {
        return corrupt(label,
                       fmt::format("tensors '{}' (data_offsets [{}, {}]) and '{}' (data_offsets "
                                   "[{}, {}]) share bytes; every tensor must own its range",
                                   excerpt(previous->name), previous->offset, previous_end,
                                   excerpt(tensor.name), tensor.offset, ends[i]));
      }
      previous = &tensor;
      previous_end = ends[i];
    }
  }
  for (const std::size_t i : order) {
    CheckpointTensor& tensor = header.tensors[i];
    tensor.offset += data_offset;
    sorted.push_back(std::move(tensor));
  }
  header.tensors = std::move(sorted);
  *out = std::move(header);
  return Status::ok_status();
}

Status read_safetensors_header(const std::string& path, SafetensorsHeader* out,
                               const CheckpointLimits& limits) {
  File file;
  std::uint64_t file_bytes = 0;
  DDO_RETURN_IF_ERROR(File::open(path, &file, &file_bytes));
  if (file_bytes < 8) {
    return corrupt(path, fmt::format("it is {} bytes, shorter than the 8-byte header length a "
                                     "safetensors file starts with",
                                     file_bytes));
  }
  unsigned char length_bytes[8];
  DDO_RETURN_IF_ERROR(read_exact(file, path, "the header length", length_bytes, 8, 0));
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | length_bytes[i];  // little-endian
  // The number itself is not shown: it is the first 8 bytes of whatever file the path names
  // (a link to any file), which a message has no business repeating.
  if (length > limits.max_header_bytes) {
    return corrupt(path, fmt::format("its first 8 bytes are not a safetensors header length: "
                                     "they promise more than the limit of {} bytes (not a "
                                     "safetensors file?)",
                                     limits.max_header_bytes));
  }
  if (length > file_bytes - 8) {
    return corrupt(path, fmt::format("its header length promises more bytes than the {} that "
                                     "follow the 8-byte length (the file is truncated?)",
                                     file_bytes - 8));
  }
  std::string text(static_cast<std::size_t>(length), '\0');
  DDO_RETURN_IF_ERROR(read_exact(file, path, "the header", text.data(), length, 8));
  return parse_safetensors_header(text, file_bytes, path, out, limits);
}

}  // namespace ddo::core
