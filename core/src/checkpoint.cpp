#include "ddo/core/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <filesystem>
#include <limits>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checked_json.h"
#include "ddo/core/profile_store.h"  // json_nesting_depth: one depth rule for every JSON ddo reads

#ifdef _WIN32
#include "win32.h"
#else
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace ddo::core {
namespace fs = std::filesystem;
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
// Files: positional reads on POSIX and on Windows.

namespace {

// Paths travel as UTF-8 std::string (the header's API); std::filesystem converts them to the
// platform's form, so a non-ASCII directory name survives on Windows too.
fs::path to_path(const std::string& utf8) {
  return fs::path(std::u8string(utf8.begin(), utf8.end()));
}

std::string path_string(const fs::path& path) {
  const std::u8string utf8 = path.u8string();
  return std::string(utf8.begin(), utf8.end());
}

// One read call moves at most this much: Linux caps read() at 0x7ffff000 bytes, ReadFile takes a
// 32-bit count.
constexpr std::uint64_t kMaxReadCall = std::uint64_t{1} << 30;

// An open file for positional reads, shared by reader threads (pread and ReadFile with an offset
// carry no file position between calls).
class File {
 public:
  File() = default;
  File(File&& other) noexcept : handle_(std::exchange(other.handle_, kNoHandle)) {}
  File& operator=(File&& other) noexcept {
    if (this != &other) {
      close();
      handle_ = std::exchange(other.handle_, kNoHandle);
    }
    return *this;
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() { close(); }

  // kNotFound naming `path` when it cannot be opened; kInvalidArgument when it is not a regular
  // file (a FIFO would block a reader forever). Sets *size_bytes to its size.
  static Status open(const std::string& path, File* out, std::uint64_t* size_bytes);

  // Reads up to `bytes` at `offset` into `dst`: the count read, 0 at the end of the file, or -1
  // with *error set.
  std::int64_t read_at(void* dst, std::uint64_t bytes, std::uint64_t offset,
                       std::string* error) const;

  // Asks the OS to drop the page-cache pages wholly inside [offset, offset + bytes). A hint: no
  // error, and nothing on systems without posix_fadvise.
  void drop_cached(std::uint64_t offset, std::uint64_t bytes) const;

  // The file's size and last-write time now; false when the system cannot say.
  bool stamp(std::uint64_t* size, std::int64_t* modified) const;

 private:
#ifdef _WIN32
  using Handle = HANDLE;
  static inline const Handle kNoHandle = INVALID_HANDLE_VALUE;
#else
  using Handle = int;
  static constexpr Handle kNoHandle = -1;
#endif
  void close();

  Handle handle_ = kNoHandle;
};

Status cannot_open(const std::string& path, const std::string& reason) {
  return Status(
      Code::kNotFound,
      fmt::format("cannot open '{}': {}; check the path and its permissions", path, reason));
}

#ifdef _WIN32

std::string windows_error_text(DWORD error) {
  return std::system_category().message(static_cast<int>(error));
}

Status File::open(const std::string& path, File* out, std::uint64_t* size_bytes) {
  const std::wstring wide = to_path(path).wstring();
  // Sharing write and delete as well: a reader must not stop the user from replacing a file; a
  // replaced file shows up as a size change or a short read, both errors.
  const HANDLE handle = ::CreateFileW(
      wide.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
      OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL | FILE_FLAG_SEQUENTIAL_SCAN, nullptr);
  if (handle == INVALID_HANDLE_VALUE)
    return cannot_open(path, windows_error_text(::GetLastError()));
  File file;
  file.handle_ = handle;
  if (::GetFileType(handle) != FILE_TYPE_DISK) {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' is not a regular file; pass a .safetensors file", path));
  }
  LARGE_INTEGER size;
  if (!::GetFileSizeEx(handle, &size)) {
    return cannot_open(path, windows_error_text(::GetLastError()));
  }
  *size_bytes = static_cast<std::uint64_t>(size.QuadPart);
  *out = std::move(file);
  return Status::ok_status();
}

std::int64_t File::read_at(void* dst, std::uint64_t bytes, std::uint64_t offset,
                           std::string* error) const {
  OVERLAPPED at = {};
  at.Offset = static_cast<DWORD>(offset & 0xffffffffu);
  at.OffsetHigh = static_cast<DWORD>(offset >> 32);
  DWORD got = 0;
  if (!::ReadFile(handle_, dst, static_cast<DWORD>(std::min(bytes, kMaxReadCall)), &got, &at)) {
    const DWORD code = ::GetLastError();
    if (code == ERROR_HANDLE_EOF) return 0;
    *error = windows_error_text(code);
    return -1;
  }
  return static_cast<std::int64_t>(got);
}

void File::drop_cached(std::uint64_t, std::uint64_t) const {}  // Windows: no such hint

bool File::stamp(std::uint64_t* size, std::int64_t* modified) const {
  BY_HANDLE_FILE_INFORMATION info;
  if (!::GetFileInformationByHandle(handle_, &info)) return false;
  *size = (static_cast<std::uint64_t>(info.nFileSizeHigh) << 32) | info.nFileSizeLow;
  *modified = static_cast<std::int64_t>(
      (static_cast<std::uint64_t>(info.ftLastWriteTime.dwHighDateTime) << 32) |
      info.ftLastWriteTime.dwLowDateTime);
  return true;
}

void File::close() {
  if (handle_ != kNoHandle) ::CloseHandle(handle_);
  handle_ = kNoHandle;
}

#else  // POSIX

std::string errno_text(int err) {
  return std::error_code(err, std::generic_category()).message();
}

Status File::open(const std::string& path, File* out, std::uint64_t* size_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it has no effect on regular files.
  int flags = O_RDONLY | O_NONBLOCK;
#ifdef O_CLOEXEC
  flags |= O_CLOEXEC;
#endif
  int fd = -1;
  do {
    fd = ::open(path.c_str(), flags);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return cannot_open(path, errno_text(errno));
  File file;
  file.handle_ = fd;
  struct stat st;
  if (::fstat(fd, &st) != 0) return cannot_open(path, errno_text(errno));
  if (!S_ISREG(st.st_mode)) {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' is not a regular file; pass a .safetensors file", path));
  }
#if defined(POSIX_FADV_SEQUENTIAL)
  // A hint only (larger read-ahead): each reader thread walks its pieces forwards.
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  *size_bytes = static_cast<std::uint64_t>(st.st_size);
  *out = std::move(file);
  return Status::ok_status();
}

std::int64_t File::read_at(void* dst, std::uint64_t bytes, std::uint64_t offset,
                           std::string* error) const {
  for (;;) {
    const ssize_t got =
        ::pread(handle_, dst, static_cast<std::size_t>(std::min(bytes, kMaxReadCall)),
                static_cast<off_t>(offset));
    if (got >= 0) return static_cast<std::int64_t>(got);
    if (errno == EINTR) continue;
    *error = errno_text(errno);
    return -1;
  }
}

bool File::stamp(std::uint64_t* size, std::int64_t* modified) const {
  struct stat st;
  if (::fstat(handle_, &st) != 0) return false;
  *size = static_cast<std::uint64_t>(st.st_size);
  *modified = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return true;
}

void File::drop_cached(std::uint64_t offset, std::uint64_t bytes) const {
#if defined(POSIX_FADV_DONTNEED)
  (void)::posix_fadvise(handle_, static_cast<off_t>(offset), static_cast<off_t>(bytes),
                        POSIX_FADV_DONTNEED);
#else
  (void)offset;
  (void)bytes;
#endif
}

void File::close() {
  if (handle_ != kNoHandle) ::close(handle_);
  handle_ = kNoHandle;
}

#endif  // _WIN32

// Reads exactly `bytes` at `offset`; `what` says what the bytes are, for the message. kDataLoss
// when the file ends first or the read fails.
Status read_exact(const File& file, const std::string& path, std::string_view what, void* dst,
                  std::uint64_t bytes, std::uint64_t offset) {
  auto* out = static_cast<char*>(dst);
  std::uint64_t done = 0;
  while (done < bytes) {
    std::string error;
    const std::int64_t got = file.read_at(out + done, bytes - done, offset + done, &error);
    if (got < 0) {
      return Status(Code::kDataLoss,
                    fmt::format("{}: reading {} ({} bytes at offset {}) failed: {}", path, what,
                                bytes, offset, error));
    }
    if (got == 0) {
      return Status(Code::kDataLoss,
                    fmt::format("file truncated: {}: {} expected {} bytes at offset {} but the "
                                "file ended after {}; it changed on disk since it was opened or "
                                "the download is incomplete — re-download it and open it again",
                                path, what, bytes, offset, done));
    }
    done += static_cast<std::uint64_t>(got);
  }
  return Status::ok_status();
}

}  // namespace

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
//    profile_store.cpp) before nlohmann builds a document, so "[[[[..." a megabyte long is an
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
// Keys a header's __metadata__ or an index's top level may hold besides the tensors: generous
// (they are short strings), and bounded, so that the key limit of parse_bounded stays linear.
constexpr std::size_t kMaxMetadataKeys = 1u << 16;
constexpr std::string_view kCorruptAdvice =
    "the file is corrupt or was written by a buggy tool — re-download or re-save it";

Status corrupt(std::string_view label, std::string_view detail) {
  return Status(Code::kDataLoss, fmt::format("{}: {}; {}", label, detail, kCorruptAdvice));
}

using internal::excerpt;

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

// Parses `text` as one JSON document nested at most `max_depth` deep, refusing duplicate keys in
// the top-level object and in the objects directly inside it, and more than `max_keys` keys at
// those two levels (what `max_tensors` tensors need), in one linear pass (Note [Linear JSON
// parsing] in checked_json.h). `what` names the document in messages ("header", "index").
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

// ---------------------------------------------------------------------------------------------
// Directories and indexes.

namespace {

constexpr std::string_view kWeightsSuffix = ".safetensors";
constexpr std::string_view kIndexSuffix = ".safetensors.index.json";
constexpr std::string_view kDiffusersWeights = "diffusion_pytorch_model.safetensors";
constexpr std::string_view kDiffusersIndex = "diffusion_pytorch_model.safetensors.index.json";
constexpr std::string_view kTransformersWeights = "model.safetensors";
constexpr std::string_view kTransformersIndex = "model.safetensors.index.json";

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

std::string name_list(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 20;
  if (names.empty()) return "nothing";
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return out;
}

// The one standard name among `found`: diffusers' or transformers', when exactly one of them is
// there.
std::optional<std::string> standard_name(const std::vector<std::string>& found,
                                         std::string_view diffusers,
                                         std::string_view transformers) {
  const bool has_diffusers = std::find(found.begin(), found.end(), diffusers) != found.end();
  const bool has_transformers = std::find(found.begin(), found.end(), transformers) != found.end();
  if (has_diffusers == has_transformers) return std::nullopt;
  return std::string(has_diffusers ? diffusers : transformers);
}

// A shard name from an index must stay inside the directory: a plain file name.
bool is_plain_file_name(const std::string& name) {
  if (name.empty() || name == "." || name == "..") return false;
  if (name.find_first_of(std::string_view("/\\\0", 3)) != std::string::npos) return false;
  return !to_path(name).has_root_name() && !to_path(name).is_absolute();
}

Status add_file(const std::string& path, SafetensorsHeader header, Checkpoint* ckpt) {
  const int file = static_cast<int>(ckpt->files.size());
  ckpt->files.push_back(path);
  ckpt->file_bytes.push_back(header.file_bytes);
  for (CheckpointTensor& tensor : header.tensors) {
    const auto [it, inserted] = ckpt->by_name.emplace(tensor.name, ckpt->tensors.size());
    if (!inserted) {
      const CheckpointTensor& other = ckpt->tensors[it->second];
      return Status(
          Code::kDataLoss,
          fmt::format("tensor '{}' is in both '{}' and '{}'; a checkpoint holds each "
                      "tensor once — remove the stray file",
                      tensor.name, ckpt->files[static_cast<std::size_t>(other.file)], path));
    }
    tensor.file = file;
    ckpt->tensors.push_back(std::move(tensor));
  }
  return Status::ok_status();
}

Status read_text_file(const std::string& path, std::uint64_t max_bytes, std::string* out) {
  File file;
  std::uint64_t size = 0;
  DDO_RETURN_IF_ERROR(File::open(path, &file, &size));
  if (size > max_bytes) {
    return corrupt(path, fmt::format("it is {} bytes, more than the limit of {}", size, max_bytes));
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  DDO_RETURN_IF_ERROR(read_exact(file, path, "the index", text.data(), size, 0));
  *out = std::move(text);
  return Status::ok_status();
}

// Reads the index `index_name` in `dir` and every shard it names; see open_checkpoint.
Status open_index(const fs::path& dir, const std::string& index_name, Checkpoint* out,
                  const CheckpointLimits& limits) {
  const std::string index_path = path_string(dir / to_path(index_name));
  std::string text;
  DDO_RETURN_IF_ERROR(read_text_file(index_path, limits.max_header_bytes, &text));
  json index;
  DDO_RETURN_IF_ERROR(parse_bounded(text, index_path, "index", limits.max_json_depth,
                                    limits.max_tensors, limits.max_tensors + kMaxMetadataKeys,
                                    &index));
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return corrupt(index_path, "it has no 'weight_map' object (tensor name -> shard file)");
  }
  const json& weight_map = index["weight_map"];
  std::map<std::string, std::string> shard_of;                 // tensor -> shard
  std::map<std::string, std::vector<std::string>> tensors_of;  // shard -> tensors (sorted)
  for (const auto& [name, shard] : weight_map.items()) {
    if (!shard.is_string()) {
      return corrupt(index_path, fmt::format("weight_map gives tensor '{}' a {}, expected a "
                                             "shard file name",
                                             excerpt(name), shard.type_name()));
    }
    const auto& shard_name = shard.get_ref<const std::string&>();
    if (!is_plain_file_name(shard_name)) {
      return corrupt(index_path, fmt::format("weight_map puts tensor '{}' in '{}', which is not a "
                                             "plain file name in the index's directory",
                                             excerpt(name), excerpt(shard_name)));
    }
    shard_of[name] = shard_name;
    tensors_of[shard_name].push_back(name);
  }
  if (shard_of.empty()) return corrupt(index_path, "its weight_map is empty");

  for (const auto& [shard_name, listed] : tensors_of) {
    const std::string shard_path = path_string(dir / to_path(shard_name));
    SafetensorsHeader header;
    const Status read = read_safetensors_header(shard_path, &header, limits);
    if (read.code() == Code::kNotFound) {
      return Status(Code::kDataLoss,
                    fmt::format("{}: weight_map puts tensor '{}' in '{}', which cannot be opened "
                                "({}); the download is incomplete — download the missing shard",
                                index_path, listed.front(), shard_name, read.message()));
    }
    DDO_RETURN_IF_ERROR(read);
    for (const CheckpointTensor& tensor : header.tensors) {
      const auto it = shard_of.find(tensor.name);
      if (it == shard_of.end()) {
        return Status(Code::kDataLoss,
                      fmt::format("{}: shard '{}' holds tensor '{}', which the index does not "
                                  "list; the index and its shards do not match — re-download both",
                                  index_path, shard_name, tensor.name));
      }
      if (it->second != shard_name) {
        return Status(Code::kDataLoss,
                      fmt::format("{}: weight_map puts tensor '{}' in '{}' but shard '{}' holds "
                                  "it; the index and its shards do not match — re-download both",
                                  index_path, tensor.name, it->second, shard_name));
      }
    }
    for (const std::string& name : listed) {
      const bool found = std::any_of(header.tensors.begin(), header.tensors.end(),
                                     [&](const CheckpointTensor& t) { return t.name == name; });
      if (!found) {
        return Status(Code::kDataLoss,
                      fmt::format("{}: weight_map puts tensor '{}' in '{}' but that shard has no "
                                  "such tensor; the index and its shards do not match — "
                                  "re-download both",
                                  index_path, name, shard_name));
      }
    }
    DDO_RETURN_IF_ERROR(add_file(shard_path, std::move(header), out));
  }
  return Status::ok_status();
}

Status open_single(const std::string& path, Checkpoint* out, const CheckpointLimits& limits) {
  SafetensorsHeader header;
  DDO_RETURN_IF_ERROR(read_safetensors_header(path, &header, limits));
  return add_file(path, std::move(header), out);
}

Status open_directory(const std::string& path, const fs::path& dir, Checkpoint* out,
                      const CheckpointLimits& limits) {
  std::vector<std::string> names;  // every non-directory entry, for messages
  std::vector<std::string> indexes;
  std::vector<std::string> weights;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    // Not is_regular_file: a broken link named model.safetensors (an interrupted download into
    // the Hugging Face cache) is picked and then fails to open, saying so, instead of vanishing.
    std::error_code type_ec;
    if (it->is_directory(type_ec)) continue;
    std::string name = path_string(it->path().filename());
    if (ends_with(name, kIndexSuffix)) indexes.push_back(name);
    if (ends_with(name, kWeightsSuffix)) weights.push_back(name);
    names.push_back(std::move(name));
  }
  if (ec) {
    return Status(Code::kNotFound,
                  fmt::format("cannot list the checkpoint directory '{}': {}", path, ec.message()));
  }
  std::sort(names.begin(), names.end());
  std::sort(indexes.begin(), indexes.end());
  std::sort(weights.begin(), weights.end());

  if (indexes.size() == 1) return open_index(dir, indexes.front(), out, limits);
  if (indexes.size() > 1) {
    const std::optional<std::string> index =
        standard_name(indexes, kDiffusersIndex, kTransformersIndex);
    if (!index) {
      return Status(Code::kInvalidArgument,
                    fmt::format("'{}' holds several safetensors indexes ({}) and not exactly one "
                                "of the standard {} and {}; pass the index file to use",
                                path, name_list(indexes), kDiffusersIndex, kTransformersIndex));
    }
    return open_index(dir, *index, out, limits);
  }
  if (weights.empty()) {
    return Status(Code::kNotFound,
                  fmt::format("'{}' holds no .safetensors file (found: {}); pass a diffusers or "
                              "transformers component directory, e.g. model/transformer",
                              path, name_list(names)));
  }
  std::optional<std::string> file;
  if (weights.size() == 1) {
    file = weights.front();
  } else {
    file = standard_name(weights, kDiffusersWeights, kTransformersWeights);
  }
  if (!file) {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' holds several .safetensors files ({}), no index, and not "
                              "exactly one of the standard {} and {}; pass the file to use",
                              path, name_list(weights), kDiffusersWeights, kTransformersWeights));
  }
  return open_single(path_string(dir / to_path(*file)), out, limits);
}

}  // namespace

const CheckpointTensor* Checkpoint::find(const std::string& name) const {
  const auto it = by_name.find(name);
  return it == by_name.end() ? nullptr : &tensors[it->second];
}

std::uint64_t Checkpoint::total_bytes() const {
  std::uint64_t total = 0;
  for (const CheckpointTensor& tensor : tensors) total += tensor.bytes;
  return total;
}

Status open_checkpoint(const std::string& path, Checkpoint* out, const CheckpointLimits& limits) {
  const fs::path target = to_path(path);
  std::error_code ec;
  const fs::file_status status = fs::status(target, ec);
  if (status.type() == fs::file_type::not_found) {
    return Status(Code::kNotFound,
                  fmt::format("checkpoint '{}' does not exist; pass a component directory (e.g. "
                              "model/transformer) or a .safetensors file",
                              path));
  }
  if (ec) {
    return Status(Code::kNotFound,
                  fmt::format("cannot read checkpoint '{}': {}", path, ec.message()));
  }
  Checkpoint ckpt;
  ckpt.root = path;
  if (fs::is_directory(status)) {
    DDO_RETURN_IF_ERROR(open_directory(path, target, &ckpt, limits));
  } else if (ends_with(path, kIndexSuffix)) {
    DDO_RETURN_IF_ERROR(
        open_index(target.parent_path(), path_string(target.filename()), &ckpt, limits));
  } else if (ends_with(path, kWeightsSuffix)) {
    DDO_RETURN_IF_ERROR(open_single(path, &ckpt, limits));
  } else {
    return Status(Code::kInvalidArgument,
                  fmt::format("'{}' is neither a directory nor a .safetensors file; pass a "
                              "component directory (e.g. model/transformer)",
                              path));
  }
  *out = std::move(ckpt);
  return Status::ok_status();
}

// ---------------------------------------------------------------------------------------------
// Reading.

// Note [Read meter]
// ~~~~~~~~~~~~~~~~~
// Whether reads keep a disk busy is the question every slow load or disk-tier step raises: a
// drive reading at its bandwidth but idle between reads, and one kept busy but reading slowly
// (too few requests in flight, scattered ranges), call for different fixes. So the reader counts,
// for every pread it issues, the wall time with at least one in flight and the integral of how
// many are, beside the bytes. Each read is a piece of at most a few MiB taking milliseconds; one
// short critical section before and after it costs well under a microsecond.
class ReadMeter {
 public:
  void begin() {
    std::lock_guard<std::mutex> lock(mutex_);
    advance(Clock::now());
    ++in_flight_;
  }
  void end(std::uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    advance(Clock::now());
    --in_flight_;
    stats_.bytes += bytes;
    ++stats_.reads;
  }
  ReadStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    ReadStats s = stats_;
    add_stretch(Clock::now(), &s);  // the running stretch up to now
    return s;
  }

 private:
  using Clock = std::chrono::steady_clock;
  // Adds the stretch since the last change of in_flight_ up to `now` to `s`.
  void add_stretch(Clock::time_point now, ReadStats* s) const {
    if (in_flight_ == 0) return;
    const double dt = std::chrono::duration<double>(now - since_).count();
    s->busy_seconds += dt;
    s->depth_seconds += dt * in_flight_;
  }
  void advance(Clock::time_point now) {
    add_stretch(now, &stats_);
    since_ = now;
  }
  mutable std::mutex mutex_;
  int in_flight_ = 0;        // guarded by mutex_
  Clock::time_point since_;  // guarded by mutex_: the last change of in_flight_
  ReadStats stats_;          // guarded by mutex_
};

// Jobs cut into pieces of at most piece_bytes, numbered across all jobs (Note [Parallel
// checkpoint reads]); validated once, before any byte is read.
class PiecePlan {
 public:
  struct Piece {
    const ReadJob* job = nullptr;
    std::uint64_t start = 0;  // within the job
    std::uint64_t bytes = 0;
  };

  // Checks every job against `ckpt` (tensor index, range inside the tensor, a destination) and
  // numbers the pieces; `caller` names the API in messages.
  static Status make(const Checkpoint& ckpt, const std::vector<ReadJob>& jobs,
                     std::uint64_t piece_bytes, std::string_view caller, PiecePlan* out) {
    if (piece_bytes == 0) {
      return Status(Code::kInvalidArgument,
                    fmt::format("{}: piece_bytes is 0; pass at least 1", caller));
    }
    PiecePlan plan;
    plan.jobs_ = &jobs;
    plan.piece_bytes_ = piece_bytes;
    plan.first_piece_.assign(jobs.size() + 1, 0);
    for (std::size_t j = 0; j < jobs.size(); ++j) {
      const ReadJob& job = jobs[j];
      if (job.tensor >= ckpt.tensors.size()) {
        return Status(Code::kInvalidArgument,
                      fmt::format("{}: job {} names tensor {} but the checkpoint has {}", caller, j,
                                  job.tensor, ckpt.tensors.size()));
      }
      const CheckpointTensor& tensor = ckpt.tensors[job.tensor];
      if (job.offset > tensor.bytes || job.bytes > tensor.bytes - job.offset) {
        return Status(Code::kInvalidArgument,
                      fmt::format("{}: job {} reads {} bytes at offset {} of tensor '{}', "
                                  "which holds {} bytes",
                                  caller, j, job.bytes, job.offset, tensor.name, tensor.bytes));
      }
      if (job.bytes > 0 && job.dst == nullptr) {
        return Status(Code::kInvalidArgument, fmt::format("{}: job {} (tensor '{}') has a null dst",
                                                          caller, j, tensor.name));
      }
      plan.first_piece_[j + 1] = plan.first_piece_[j] + (job.bytes + piece_bytes - 1) / piece_bytes;
      plan.total_bytes_ += job.bytes;
    }
    *out = std::move(plan);
    return Status::ok_status();
  }

  std::uint64_t pieces() const { return first_piece_.empty() ? 0 : first_piece_.back(); }
  std::uint64_t total_bytes() const { return total_bytes_; }

  // Piece `n` (< pieces()): its job by binary search over the jobs' first piece numbers, so
  // pieces are never materialised (O(jobs) memory even for a tiny piece size).
  Piece at(std::uint64_t n) const {
    const auto j = static_cast<std::size_t>(
        std::upper_bound(first_piece_.begin(), first_piece_.end(), n) - first_piece_.begin() - 1);
    const ReadJob& job = (*jobs_)[j];
    const std::uint64_t start = (n - first_piece_[j]) * piece_bytes_;
    return {&job, start, std::min(piece_bytes_, job.bytes - start)};
  }

 private:
  const std::vector<ReadJob>* jobs_ = nullptr;
  std::vector<std::uint64_t> first_piece_;  // job j's pieces are [first_piece_[j], [j + 1])
  std::uint64_t piece_bytes_ = 0;
  std::uint64_t total_bytes_ = 0;
};

// Note [Read queue]
// ~~~~~~~~~~~~~~~~~
// The disk tier reads a unit of tens to a hundred MB at a time on each of the copy scheduler's
// reader threads. Splitting each unit over threads of its own made the drive's queue uneven: deep
// while two units were read, shallow at each unit's tail and whenever the ring let only one be
// read (11 reads in flight on average on an H100 machine's disk, 0.89 of its sequential sweep
// while busy). A drive reads fastest with a steady number of large requests in flight, as a
// sequential sweep has. So the reader owns one queue of pieces served first come first served by
// a fixed set of threads: a call appends its pieces as one batch and waits for them; a worker
// takes the next piece of the oldest batch that has one left, so the pieces of the unit read next
// follow the tail of the current one without a gap, and the depth stays at the worker count
// however many callers there are. The workers start on the first call and stop with the reader;
// one mutex guards the batches (a lock per piece of milliseconds). A failed piece stops its batch
// from handing out more; the caller returns once the pieces already running are done, since their
// destinations are the caller's. Measured since (bench/results/2026-12-06-h100-8abc593-disk-queue):
// 7 reads in flight and the files busy for the whole disk-bound stretch; a gain over the per-unit
// threads was not isolated (the two runs had different machines and methods).
class ReadQueue {
 public:
  using ReadPiece = std::function<Status(const PiecePlan::Piece& piece, bool drop_behind)>;
  ReadQueue(int workers, ReadPiece read) : workers_(workers), read_(std::move(read)) {}
  ~ReadQueue() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  ReadQueue(const ReadQueue&) = delete;
  ReadQueue& operator=(const ReadQueue&) = delete;

  Status run(const PiecePlan& plan, bool drop_behind) {
    if (plan.pieces() == 0) return Status::ok_status();
    Batch batch;
    batch.plan = &plan;
    batch.drop_behind = drop_behind;
    std::unique_lock<std::mutex> lock(mutex_);
    start_workers();
    if (threads_.empty()) {  // no thread could start: read on the caller's thread
      lock.unlock();
      for (std::uint64_t p = 0; p < plan.pieces(); ++p) {
        DDO_RETURN_IF_ERROR(read_(plan.at(p), drop_behind));
      }
      return Status::ok_status();
    }
    batches_.push_back(&batch);
    work_.notify_all();
    batch.done_cv.wait(lock, [&] { return batch.finished(); });
    return std::move(batch.error);
  }

 private:
  struct Batch {
    const PiecePlan* plan = nullptr;
    bool drop_behind = false;
    std::uint64_t taken = 0;  // guarded by ReadQueue::mutex_, as are the fields below
    std::uint64_t done = 0;
    bool failed = false;
    Status error;
    std::condition_variable done_cv;
    bool exhausted() const { return failed || taken == plan->pieces(); }
    bool finished() const { return exhausted() && done == taken; }
  };

  void start_workers() {  // under mutex_
    if (started_) return;
    started_ = true;
    for (int i = 0; i < workers_; ++i) {
      try {
        threads_.emplace_back([this] { work(); });
      } catch (const std::system_error&) {
        break;  // fewer workers
      }
    }
  }

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !batches_.empty(); });
      if (stop_) return;
      Batch* b = batches_.front();
      const std::uint64_t piece = b->taken++;
      if (b->exhausted()) batches_.pop_front();
      lock.unlock();
      Status status = read_(b->plan->at(piece), b->drop_behind);
      lock.lock();
      ++b->done;
      if (!status.ok() && !b->failed) {
        b->failed = true;
        b->error = std::move(status);
        // Hand out no more of it: drop it from the queue if still there.
        for (auto it = batches_.begin(); it != batches_.end(); ++it) {
          if (*it == b) {
            batches_.erase(it);
            break;
          }
        }
      }
      if (b->finished()) b->done_cv.notify_one();  // b may be gone once the lock is released
    }
  }

  const int workers_;
  const ReadPiece read_;
  std::mutex mutex_;
  std::condition_variable work_;
  std::deque<Batch*> batches_;  // guarded by mutex_: batches with pieces left to hand out
  bool stop_ = false;           // guarded by mutex_
  bool started_ = false;        // guarded by mutex_
  std::vector<std::thread> threads_;
};

struct CheckpointReader::Impl {
  const Checkpoint* checkpoint = nullptr;
  std::vector<File> files;  // parallel to checkpoint->files
  // Note [A shard changed under the disk tier]: each file's last-write time when opened (0 when
  // the system could not say), parallel to `files`.
  std::vector<std::int64_t> modified;
  ReadMeter meter;
  std::unique_ptr<ReadQueue> queue;  // Note [Read queue]
};

CheckpointReader::~CheckpointReader() = default;

Status CheckpointReader::open(const Checkpoint& checkpoint, std::unique_ptr<CheckpointReader>* out,
                              int queue_workers) {
  if (queue_workers < 1 || queue_workers > 256) {
    return Status(Code::kInvalidArgument,
                  fmt::format("queue_workers={} is out of range; use 1..256", queue_workers));
  }
  DDO_ASSERT(checkpoint.files.size() == checkpoint.file_bytes.size(), "files ",
             checkpoint.files.size(), " sizes ", checkpoint.file_bytes.size());
  auto impl = std::make_unique<Impl>();
  impl->checkpoint = &checkpoint;
  impl->files.reserve(checkpoint.files.size());
  for (std::size_t i = 0; i < checkpoint.files.size(); ++i) {
    const std::string& path = checkpoint.files[i];
    File file;
    std::uint64_t size = 0;
    const Status opened = File::open(path, &file, &size);
    if (!opened.ok()) {
      return Status(Code::kDataLoss,
                    fmt::format("{} (it was there when the checkpoint was opened); open the "
                                "checkpoint again",
                                opened.message()));
    }
    if (size != checkpoint.file_bytes[i]) {
      return Status(Code::kDataLoss,
                    fmt::format("'{}' is now {} bytes but was {} bytes when the checkpoint was "
                                "opened; it changed on disk — open the checkpoint again",
                                path, size, checkpoint.file_bytes[i]));
    }
    std::uint64_t stamped_size = 0;
    std::int64_t modified = 0;
    impl->modified.push_back(file.stamp(&stamped_size, &modified) ? modified : 0);
    impl->files.push_back(std::move(file));
  }
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  const CheckpointReader* self = reader.get();
  impl->queue = std::make_unique<ReadQueue>(
      queue_workers, [self](const PiecePlan::Piece& piece, bool drop_behind) {
        return self->read_piece(*piece.job, piece.start, piece.bytes, drop_behind);
      });
  reader->impl_ = std::move(impl);
  *out = std::move(reader);
  return Status::ok_status();
}

const Checkpoint& CheckpointReader::checkpoint() const {
  return *impl_->checkpoint;
}

Status CheckpointReader::read(const CheckpointTensor& tensor, std::uint64_t offset, void* dst,
                              std::uint64_t bytes) const {
  const Checkpoint& ckpt = *impl_->checkpoint;
  if (tensor.file < 0 || static_cast<std::size_t>(tensor.file) >= impl_->files.size()) {
    return Status(Code::kInvalidArgument,
                  fmt::format("tensor '{}' names file {} but the checkpoint has {} files",
                              tensor.name, tensor.file, impl_->files.size()));
  }
  const auto file = static_cast<std::size_t>(tensor.file);
  if (offset > tensor.bytes || bytes > tensor.bytes - offset) {
    return Status(Code::kInvalidArgument,
                  fmt::format("reading {} bytes at offset {} of tensor '{}', which holds {} bytes; "
                              "read inside the tensor",
                              bytes, offset, tensor.name, tensor.bytes));
  }
  // A tensor the caller built (not one of ckpt.tensors) must still lie inside its file.
  if (tensor.offset > ckpt.file_bytes[file] ||
      tensor.bytes > ckpt.file_bytes[file] - tensor.offset) {
    return Status(Code::kInvalidArgument,
                  fmt::format("tensor '{}' says bytes [{}, {}) of '{}', which is {} bytes; pass a "
                              "tensor of this checkpoint",
                              tensor.name, tensor.offset, tensor.offset + tensor.bytes,
                              ckpt.files[file], ckpt.file_bytes[file]));
  }
  if (bytes == 0) return Status::ok_status();
  if (dst == nullptr) {
    return Status(Code::kInvalidArgument,
                  fmt::format("reading tensor '{}' into a null buffer", tensor.name));
  }
  impl_->meter.begin();
  Status status =
      read_exact(impl_->files[file], ckpt.files[file], fmt::format("tensor '{}'", tensor.name), dst,
                 bytes, tensor.offset + offset);
  impl_->meter.end(status.ok() ? bytes : 0);
  return status;
}

// A piece of a job that PiecePlan::make validated.
Status CheckpointReader::read_piece(const ReadJob& job, std::uint64_t start, std::uint64_t bytes,
                                    bool drop_behind) const {
  const CheckpointTensor& tensor = impl_->checkpoint->tensors[job.tensor];
  DDO_RETURN_IF_ERROR(read(tensor, job.offset + start, static_cast<char*>(job.dst) + start, bytes));
  if (drop_behind) {
    impl_->files[static_cast<std::size_t>(tensor.file)].drop_cached(
        tensor.offset + job.offset + start, bytes);
  }
  return Status::ok_status();
}

// Note [A shard changed under the disk tier]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The disk tier reads its weights from the checkpoint every step (read_queued with drop_behind).
// A shard replaced by a new file is safe: the open handle still reads the old one. A shard
// overwritten in place keeps its size, and its new bytes would change the output without a word.
// So every such read first compares each file it touches with the size and last-write time it had
// when the reader opened it: one fstat per file per unit read, beside reads of megabytes.
Status CheckpointReader::check_unchanged(const std::vector<ReadJob>& jobs) const {
  const Checkpoint& checkpoint = *impl_->checkpoint;
  int last = -1;
  for (const ReadJob& job : jobs) {
    if (job.tensor >= checkpoint.tensors.size()) continue;  // PiecePlan::make reports it
    const int f = checkpoint.tensors[job.tensor].file;
    if (f == last || f < 0 || static_cast<std::size_t>(f) >= impl_->files.size()) continue;
    last = f;
    if (impl_->modified[f] == 0) continue;  // the system gave no stamp at open
    std::uint64_t size = 0;
    std::int64_t modified = 0;
    if (!impl_->files[f].stamp(&size, &modified)) continue;
    if (size != checkpoint.file_bytes[f] || modified != impl_->modified[f]) {
      return Status(Code::kDataLoss,
                    fmt::format("'{}' changed on disk while ddo reads weights from it (its size "
                                "or last-write time is not what it was when it was opened); "
                                "replace checkpoint files with new files instead of writing into "
                                "them, and attach again (remove the offload, load, enable)",
                                checkpoint.files[f]));
    }
  }
  return Status::ok_status();
}

Status CheckpointReader::read_queued(const std::vector<ReadJob>& jobs, std::uint64_t piece_bytes,
                                     bool drop_behind) const {
  if (drop_behind) DDO_RETURN_IF_ERROR(check_unchanged(jobs));
  PiecePlan plan;
  DDO_RETURN_IF_ERROR(PiecePlan::make(*impl_->checkpoint, jobs, piece_bytes, "read_queued", &plan));
  return impl_->queue->run(plan, drop_behind);
}

ReadStats CheckpointReader::stats() const {
  return impl_->meter.stats();
}

// Note [Parallel checkpoint reads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Jobs are cut into pieces of at most piece_bytes, numbered across all jobs; workers take the
// next number from one atomic counter, so a single 10 GB tensor keeps every thread busy and no
// thread waits behind another's large job. Pieces are never materialised: a piece number maps to
// its job by binary search over each job's first piece number (O(jobs) memory even when a tiny
// piece size makes billions of pieces). The first error is kept under a mutex and raises a flag
// that stops every worker taking new pieces; the calling thread works too, so workers <= 1 runs
// inline and a failure to start a thread only means fewer threads.
Status CheckpointReader::read_all(const std::vector<ReadJob>& jobs, int workers,
                                  const ReadProgress& progress, std::uint64_t piece_bytes) const {
  PiecePlan plan;
  DDO_RETURN_IF_ERROR(PiecePlan::make(*impl_->checkpoint, jobs, piece_bytes, "read_all", &plan));
  const std::uint64_t pieces = plan.pieces();
  const std::uint64_t total = plan.total_bytes();
  if (pieces == 0) return Status::ok_status();

  std::atomic<std::uint64_t> next{0};
  std::atomic<std::uint64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  Status first_error;  // guarded by error_mutex
  const auto work = [&] {
    while (!failed.load(std::memory_order_relaxed)) {
      const std::uint64_t n = next.fetch_add(1, std::memory_order_relaxed);
      if (n >= pieces) return;
      const PiecePlan::Piece piece = plan.at(n);
      Status status = read_piece(*piece.job, piece.start, piece.bytes, /*drop_behind=*/false);
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!failed.load(std::memory_order_relaxed)) first_error = std::move(status);
        failed.store(true, std::memory_order_relaxed);
        return;
      }
      const std::uint64_t now =
          done.fetch_add(piece.bytes, std::memory_order_relaxed) + piece.bytes;
      if (progress) progress(now, total);
    }
  };

  const std::uint64_t threads =
      std::min<std::uint64_t>(pieces, static_cast<std::uint64_t>(std::max(workers, 1)));
  std::vector<std::thread> helpers;
  helpers.reserve(static_cast<std::size_t>(threads - 1));
  for (std::uint64_t i = 1; i < threads; ++i) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // fewer threads; the pieces still all get read
    }
  }
  work();
  for (std::thread& helper : helpers) helper.join();
  std::lock_guard<std::mutex> lock(error_mutex);
  return first_error;
}

}  // namespace ddo::core
