#include "ddo/core/profile_store.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <system_error>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "os_file.h"

namespace ddo::core {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

Status unavailable_dir(const fs::path& directory, const std::string& what) {
  return Status(Code::kUnavailable,
                fmt::format("cannot write profiles in '{}': {}; set DDO_PROFILE_DIR to a writable "
                            "directory",
                            directory.string(), what));
}

Status data_loss(std::string message) {
  return Status(Code::kDataLoss, std::move(message));
}

std::string range_text(const NumberRange& range) {
  return fmt::format("{:g} to {:g}{}{}", range.min, range.max, *range.unit ? " " : "", range.unit);
}

}  // namespace

// json numbers may be stored as integers when they are whole; a 1e400 literal already fails to
// parse.
Status checked_number(const json& value, std::string_view where, const NumberRange& range,
                      double* out) {
  if (!value.is_number()) {
    return data_loss(fmt::format("{} is {}, not a number", where, value.type_name()));
  }
  const double number = value.get<double>();
  if (!(number >= range.min && number <= range.max)) {
    return data_loss(fmt::format("{} is {}, outside {}; recalibrate or delete the file", where,
                                 value.dump(), range_text(range)));
  }
  *out = number;
  return Status::ok_status();
}

namespace {

// An optional number field: absent or null leaves *out and *present unchanged.
Status optional_number(const json& object, const char* key, std::string_view prefix,
                       const NumberRange& range, double* out, bool* present = nullptr) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return Status::ok_status();
  DDO_RETURN_IF_ERROR(checked_number(*it, fmt::format("{}{}", prefix, key), range, out));
  if (present != nullptr) *present = true;
  return Status::ok_status();
}

Status required_number(const json& object, const char* key, std::string_view prefix,
                       const NumberRange& range, double* out) {
  if (!object.contains(key)) return data_loss(fmt::format("{}{} is missing", prefix, key));
  return optional_number(object, key, prefix, range, out);
}

}  // namespace

// Compared in 64 bits: 4294967297 is not 1 (it was, when read as a 32-bit int).
Status version_field(const json& object, const char* key, std::string_view prefix, int expected,
                     std::string_view advice) {
  auto it = object.find(key);
  if (it == object.end()) return data_loss(fmt::format("{}{} is missing; {}", prefix, key, advice));
  bool matches = false;
  if (it->is_number_unsigned()) {
    matches = it->get<std::uint64_t>() == static_cast<std::uint64_t>(expected);
  } else if (it->is_number_integer()) {
    matches = it->get<std::int64_t>() == expected;
  } else {
    return data_loss(
        fmt::format("{}{} is {}, not an integer; {}", prefix, key, it->dump(), advice));
  }
  if (!matches) {
    return data_loss(fmt::format("{}{} is {}, not the supported version {}; {}", prefix, key,
                                 it->dump(), expected, advice));
  }
  return Status::ok_status();
}

namespace {

bool get_string(const json& object, const char* key, std::string* out) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return false;
  *out = it->get<std::string>();
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Durable-file helpers.
// ---------------------------------------------------------------------------------------------

// sha256_hex: sha256.cpp (Note [SHA-256 per platform]).

// Note [diffusers-dynamic-offloader's files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// diffusers-dynamic-offloader 0.1.0rc2 keeps named profiles and host
// contexts in one folder and one format, learned by running it (python/tests/test_compat.py
// writes with one and reads with the other):
//   file  "ddo-capacity-v1-" + sha256(json.dumps(context, sort_keys=True,
//         separators=(",", ":"))).hexdigest()[:24] + ".json"
//   body  {"capacity_limits": {metric: {"max_success": x, "min_failure": y}},
//          "context": {...}, "observations": [... last 20 ...], "profile_key": <file stem>,
//          "recommendation": {...} (only once one was stored), "schema_version": 1,
//          "updated_at": ISO-8601}
// A named profile is the context {"execution_mode", "identity_version": 2, "model_class",
// "name"} whose recommendation holds "profile_resident_module_budget_gb" (and, while an SDNQ
// probe is pending, "sdnq_probe_resident_budget_gb"). The library ignores fields it does not
// know, so ddo writes its own (measured_at, candidate_compute_ms, ...) beside the library's and
// keeps the library's fields it does not know when it rewrites a file. Only the key needs the
// text to match byte for byte: canonical_json below writes what Python's json.dumps writes.

namespace {

// Python's float repr (the 'r' format): the shortest digits that round-trip, positional when
// the decimal exponent is in [-4, 16), scientific otherwise, always with a '.' or an 'e'.
void append_python_float(std::string& out, double value) {
  if (std::isnan(value)) {
    out += "NaN";
    return;
  }
  if (std::isinf(value)) {
    out += value > 0 ? "Infinity" : "-Infinity";
    return;
  }
  char buffer[64];
  auto [end, ec] =
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  DDO_ASSERT(ec == std::errc(), "to_chars failed on a double");
  std::string_view text(buffer, static_cast<std::size_t>(end - buffer));
  if (text.front() == '-') {
    out.push_back('-');
    text.remove_prefix(1);
  }
  const std::size_t e = text.find('e');
  std::string digits(text.substr(0, e));
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exponent = 0;
  std::from_chars(text.data() + e + (text[e + 1] == '+' ? 2 : 1), text.data() + text.size(),
                  exponent);
  const int decpt = exponent + 1;  // digits before the decimal point
  const int ndigits = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out += digits.substr(0, 1);
    if (ndigits > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exponent < 0 ? '-' : '+', std::abs(exponent));
  } else if (decpt <= 0) {
    out += "0." + std::string(static_cast<std::size_t>(-decpt), '0') + digits;
  } else if (decpt < ndigits) {
    out += digits.substr(0, static_cast<std::size_t>(decpt)) + "." +
           digits.substr(static_cast<std::size_t>(decpt));
  } else {
    out += digits + std::string(static_cast<std::size_t>(decpt - ndigits), '0') + ".0";
  }
}

// Python's ensure_ascii string: \" \\ \b \f \n \r \t, other bytes outside ' '..'~' as \uXXXX
// (lower-case hex; UTF-16 surrogate pairs above U+FFFF).
void append_python_string(std::string& out, std::string_view text) {
  out.push_back('"');
  for (std::size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    std::uint32_t cp = 0;
    int length = 1;
    if (c < 0x80) {
      cp = c;
    } else if ((c & 0xe0) == 0xc0) {
      cp = c & 0x1f, length = 2;
    } else if ((c & 0xf0) == 0xe0) {
      cp = c & 0x0f, length = 3;
    } else if ((c & 0xf8) == 0xf0) {
      cp = c & 0x07, length = 4;
    } else {
      length = 0;
    }
    for (int k = 1; length > 0 && k < length; ++k) {
      const std::size_t at = i + static_cast<std::size_t>(k);
      const auto next = at < text.size() ? static_cast<unsigned char>(text[at]) : 0;
      if ((next & 0xc0) != 0x80) {
        length = 0;
        break;
      }
      cp = (cp << 6) | (next & 0x3f);
    }
    DDO_CHECK(length > 0, Code::kInvalidArgument,
              "a string holds bytes that are not UTF-8 (at byte ", i,
              "); profile contexts and files hold text only");
    i += static_cast<std::size_t>(length);
    switch (cp) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      default:
        break;
    }
    if (cp >= 0x20 && cp <= 0x7e) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x10000) {
      out += fmt::format("\\u{:04x}", cp);
    } else {
      const std::uint32_t v = cp - 0x10000;
      out += fmt::format("\\u{:04x}\\u{:04x}", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
    }
  }
  out.push_back('"');
}

// Iterative (an explicit stack), so that no input depth costs native stack (Note [Bounded JSON]).
void append_canonical(std::string& out, const json& root) {
  struct Frame {
    const json* value;
    json::const_iterator next;
    bool first = true;
  };
  std::vector<Frame> stack;
  auto emit = [&](const json& value) {
    switch (value.type()) {
      case json::value_t::null:
        out += "null";
        return;
      case json::value_t::boolean:
        out += value.get<bool>() ? "true" : "false";
        return;
      case json::value_t::number_integer:
        out += std::to_string(value.get<std::int64_t>());
        return;
      case json::value_t::number_unsigned:
        out += std::to_string(value.get<std::uint64_t>());
        return;
      case json::value_t::number_float:
        append_python_float(out, value.get<double>());
        return;
      case json::value_t::string:
        append_python_string(out, value.get_ref<const std::string&>());
        return;
      case json::value_t::array:
        out.push_back('[');
        stack.push_back({&value, value.begin()});
        return;
      case json::value_t::object:
        out.push_back('{');
        stack.push_back({&value, value.begin()});
        return;
      case json::value_t::binary:
      case json::value_t::discarded:
        break;
    }
    throw Error(Code::kInvalidArgument, "binary or discarded JSON values have no JSON text");
  };
  emit(root);
  while (!stack.empty()) {
    Frame& frame = stack.back();
    if (frame.next == frame.value->end()) {
      out.push_back(frame.value->is_object() ? '}' : ']');
      stack.pop_back();
      continue;
    }
    if (!frame.first) out.push_back(',');
    frame.first = false;
    const json::const_iterator item = frame.next++;
    if (frame.value->is_object()) {
      // nlohmann::json objects are std::map-backed: keys come in UTF-8 byte order, which is code
      // point order, which is Python's sort order for str.
      append_python_string(out, item.key());
      out.push_back(':');
    }
    emit(*item);  // may push a frame; `frame` is not used after this
  }
}

}  // namespace

std::string canonical_json(const json& value) {
  std::string out;
  append_canonical(out, value);
  return out;
}

std::string capacity_key(const json& normalized) {
  return fmt::format("{}{}", kProfileFilePrefix,
                     sha256_hex(canonical_json(normalized)).substr(0, kProfileKeyHexDigits));
}

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

std::string utc_now_iso8601() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto millis =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  const std::tm utc = os::utc_time(seconds);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%dT%H:%M:%S", &utc);
  return fmt::format("{}.{:03d}Z", buffer, static_cast<int>(millis));
}

fs::path resolve_profile_dir(const std::map<std::string, std::string>& env) {
  auto lookup = [&env](const char* name) -> std::string {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  std::string dir = lookup("DDO_PROFILE_DIR");
  // A leading "~" is the home folder, as diffusers-dynamic-offloader's Path.expanduser reads it: a
  // shell that did not expand DDO_PROFILE_DIR="~/p" must not give ddo a folder named "~".
  const bool home_relative = dir == "~" || dir.starts_with("~/");
  if (!dir.empty() && !home_relative) return fs::path(dir);
#ifdef _WIN32
  fs::path home = lookup("USERPROFILE");
  if (home.empty()) home = lookup("HOME");
  if (home.empty()) home = os::system_home_folder();
#else
  fs::path home = lookup("HOME");
  if (home.empty()) home = lookup("USERPROFILE");
#endif
  DDO_CHECK(!home.empty(), Code::kFailedPrecondition,
            "cannot find the profile directory: neither HOME nor USERPROFILE is set; set "
            "DDO_PROFILE_DIR to a writable directory");
  if (home_relative) return dir.size() <= 2 ? home : home / dir.substr(2);
  return home / ".ddo" / "profiles";
}

Status ensure_profile_directory(const fs::path& directory) {
  if (directory.empty()) {
    return Status(Code::kFailedPrecondition,
                  "the profile directory is empty; set DDO_PROFILE_DIR to a writable directory");
  }
  std::error_code ec;
  fs::create_directories(directory, ec);
  if (ec) return unavailable_dir(directory, ec.message());
  if (!fs::is_directory(directory, ec)) return unavailable_dir(directory, "not a directory");
  return Status::ok_status();
}

Status write_file_atomic(const fs::path& target, std::string_view content,
                         const DurableWriteOptions& options) {
  const fs::path directory = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  // A unique temporary name per process and call, hidden (leading dot) and never matching the
  // "ddo-profile-*.json" pattern, so a leftover from a killed writer is never listed or loaded.
  static std::atomic<unsigned> counter{0};
  const fs::path temp = directory / fmt::format(".{}.tmp-{}-{}", target.filename().string(),
                                                os::current_process_id(), counter.fetch_add(1));
  // The data is on the disk before the rename makes it visible, or a power loss could leave an
  // empty file under the final name (the classic ext4 rename-without-fsync bug).
  os::Result written = os::write_new_file(temp, content);
  if (!written.ok()) return unavailable_dir(directory, written.text);
  if (options.before_rename) options.before_rename(temp);
  os::Result replaced = os::replace_file(temp, target);
  if (!replaced.ok()) {
    std::error_code ec;
    fs::remove(temp, ec);
    return unavailable_dir(directory, replaced.text);
  }
  return Status::ok_status();
}

Status read_text_file(const fs::path& path, std::string* content, std::size_t max_bytes) {
  const os::Result read = os::read_regular_file(path, max_bytes, content);
  switch (read.fail) {
    case os::Fail::kNone:
      return Status::ok_status();
    case os::Fail::kNotFound:
      return Status(Code::kNotFound, fmt::format("'{}' does not exist", path.string()));
    case os::Fail::kIsDirectory:
    case os::Fail::kNotRegular:
      return data_loss(
          fmt::format("'{}' is {}, not a file; move it away", path.string(), read.text));
    case os::Fail::kTooLarge:
      return data_loss(
          fmt::format("'{}' holds {} bytes or more, more than the {} bytes a ddo "
                      "file may hold",
                      path.string(), read.size, max_bytes));
    case os::Fail::kExists:
    case os::Fail::kOther:
      break;
  }
  return Status(Code::kUnavailable, fmt::format("cannot read '{}': {}", path.string(), read.text));
}

// Note [Bounded JSON]
// ~~~~~~~~~~~~~~~~~~~
// nlohmann::json parses and destroys iteratively, but copies, compares and dumps recursively, one
// stack frame per level: a profile with a value nested 50,000-200,000 deep parsed fine and then
// overflowed the stack on the first copy of the document (`ddo profiles list` crashed,
// so the user could not even find the file), and a 21 KB one nested 10,000 deep survived and was
// written back by the next calibration with two spaces of indentation per level, 200 MB. So every
// text is measured before a document is built: its size (kMaxProfileFileBytes, checked while
// reading) and its nesting depth by a linear scan (json_nesting_depth) against kMaxJsonDepth. A
// file that fails either is invalid like any corrupt file: listed with the reason, ignored by load,
// kept aside by save. In-memory values from callers (host contexts) are bounded while they are
// normalized (host_context.cpp).
int json_nesting_depth(std::string_view text) {
  int depth = 0;
  int deepest = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

Status parse_json_bounded(std::string_view text, json* out) {
  if (text.size() > kMaxProfileFileBytes) {
    return data_loss(fmt::format("it is {} bytes, more than the {} bytes a ddo file may hold",
                                 text.size(), kMaxProfileFileBytes));
  }
  if (const int depth = json_nesting_depth(text); depth > kMaxJsonDepth) {
    return data_loss(fmt::format(
        "it is nested {} levels deep, more than the {} levels a ddo file may hold (not a file "
        "ddo wrote)",
        depth, kMaxJsonDepth));
  }
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return data_loss("not valid JSON (truncated or corrupt)");
  *out = std::move(value);
  return Status::ok_status();
}

Status keep_invalid_file(const fs::path& path, fs::path* kept) {
  // Backups are created only under the file's lock, so names are not contended among ddo
  // writers; a hard link refusing an existing name keeps any other file safe too.
  constexpr int kMaxBackups = 1000;
  for (int n = 1; n <= kMaxBackups; ++n) {
    fs::path backup = path;
    backup += n == 1 ? std::string(".invalid") : fmt::format(".invalid-{}", n);
    os::Result linked = os::hard_link(path, backup);
    if (linked.fail == os::Fail::kExists) continue;
    if (!linked.ok()) {
      // No hard links on this file system (some FUSE and FAT mounts): move the file aside
      // instead. It was unusable, so its brief absence reads as "no profile", as before.
      linked = os::move_aside(path, backup);
      if (linked.fail == os::Fail::kExists) continue;
    }
    if (!linked.ok()) {
      return unavailable_dir(
          path.parent_path(),
          fmt::format("cannot keep a backup of the unreadable '{}' as '{}': {}",
                      path.filename().string(), backup.filename().string(), linked.text));
    }
    *kept = std::move(backup);
    return Status::ok_status();
  }
  return Status(Code::kFailedPrecondition,
                fmt::format("'{}' is unreadable and already has {} backups beside it "
                            "('{}.invalid*'); delete the backups you do not need",
                            path.string(), kMaxBackups, path.filename().string()));
}

// Note [Stale temporary files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// write_file_atomic names its temporary ".<file>.tmp-<pid>-<n>"; a writer killed between creating
// it and the rename leaves it behind (about half of 50 kill -9 in a loop did). The next update in
// the directory deletes such files when their owner is certainly gone: the system says there is
// no such process (os::process_is_gone: a live process, or one we may not ask about, is never
// touched) AND the file is older than a minute. The age guard covers writers that share the
// directory from another PID namespace (a container) or another host (a network file system),
// whose pids mean nothing here: a save takes milliseconds, so a minute-old temporary file has no
// writer left. Only names of ddo's own files are considered.
int remove_stale_temp_files(const fs::path& directory) {
  constexpr auto kMinAge = std::chrono::seconds(60);
  int removed = 0;
  std::error_code ec;
  const fs::file_time_type now = fs::file_time_type::clock::now();
  for (fs::directory_iterator it(directory, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // Also the names of ddo 0.1.0 before diffusers-dynamic-offloader's files (Note
    // [diffusers-dynamic-offloader's files]), whose leftovers may still sit in the folder.
    const bool ours = name.starts_with(fmt::format(".{}", kProfileFilePrefix)) ||
                      name.starts_with(".ddo-profile-") || name.starts_with(".ddo-context-");
    const std::size_t tmp = name.rfind(".tmp-");
    if (!ours || tmp == std::string::npos) continue;
    // "<pid>-<n>" after ".tmp-".
    const std::string_view rest = std::string_view(name).substr(tmp + 5);
    const std::size_t dash = rest.find('-');
    if (dash == std::string_view::npos || dash == 0 || dash + 1 == rest.size()) continue;
    long pid = 0;
    auto [end_pid, pid_ec] = std::from_chars(rest.data(), rest.data() + dash, pid);
    if (pid_ec != std::errc() || end_pid != rest.data() + dash || pid <= 0) continue;
    const std::string_view counter = rest.substr(dash + 1);
    if (!std::all_of(counter.begin(), counter.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    if (!os::process_is_gone(pid)) continue;  // alive, or unknown
    // symlink_status: a link or directory that merely carries such a name is never followed or
    // removed.
    std::error_code file_ec;
    if (!fs::is_regular_file(fs::symlink_status(it->path(), file_ec))) continue;
    const fs::file_time_type written = fs::last_write_time(it->path(), file_ec);
    if (file_ec || now - written < kMinAge) continue;
    if (fs::remove(it->path(), file_ec)) ++removed;
  }
  return removed;
}

FileLock::FileLock(FileLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

FileLock::~FileLock() {
  release();
}

void FileLock::release() {
  if (fd_ >= 0) {
    os::unlock_file(fd_);
    fd_ = -1;
  }
}

Status FileLock::acquire(const fs::path& lock_path, FileLock* out) {
  int fd = -1;
  const os::Result locked = os::lock_file(lock_path, &fd);
  if (!locked.ok()) return unavailable_dir(lock_path.parent_path(), locked.text);
  out->release();
  out->fd_ = fd;
  return Status::ok_status();
}

fs::path lock_path_for(const fs::path& target) {
  fs::path lock = target;
  lock += ".lock";
  return lock;
}

Status update_file_locked(const fs::path& target, const FileUpdate& update,
                          const DurableWriteOptions& options, const WarningSink& warn) {
  DDO_RETURN_IF_ERROR(ensure_profile_directory(target.parent_path()));
  FileLock lock;
  DDO_RETURN_IF_ERROR(FileLock::acquire(lock_path_for(target), &lock));
  (void)remove_stale_temp_files(target.parent_path());
  std::optional<std::string> current;
  std::string content;
  Status read = read_text_file(target, &content);
  if (read.ok()) {
    current = std::move(content);
  } else if (read.code() == Code::kDataLoss) {
    // Not something a rename can replace (a directory) or too large to read: a directory is the
    // user's to move; an oversized file is kept aside like any unreadable one.
    std::error_code ec;
    if (!fs::is_regular_file(target, ec)) {
      return Status(Code::kFailedPrecondition,
                    fmt::format("cannot save {}: {}", target.filename().string(), read.message()));
    }
    fs::path kept;
    DDO_RETURN_IF_ERROR(keep_invalid_file(target, &kept));
    if (warn) {
      warn(fmt::format("replacing unreadable '{}' ({}); its content is kept in '{}'",
                       target.string(), read.message(), kept.string()));
    }
  } else if (read.code() != Code::kNotFound) {
    return read;
  }
  std::string next;
  DDO_RETURN_IF_ERROR(update(current, &next));
  if (next.size() > kMaxProfileFileBytes) {
    return Status(Code::kInvalidArgument,
                  fmt::format("not saving '{}': it would be {} bytes, more than the {} bytes a "
                              "ddo file may hold and be read back; record smaller details",
                              target.string(), next.size(), kMaxProfileFileBytes));
  }
  return write_file_atomic(target, next, options);
}

void update_limits(CapacityLimits& limits, const std::string& metric, double value, bool success) {
  MetricLimits& entry = limits[metric];
  if (success) {
    if (!entry.max_success || value > *entry.max_success) entry.max_success = value;
  } else {
    if (!entry.min_failure || value < *entry.min_failure) entry.min_failure = value;
  }
}

void update_limits_from_observation(CapacityLimits& limits, const json& observation) {
  if (!observation.is_object()) return;
  auto status = observation.find("status");
  auto capacity = observation.find("capacity");
  if (status == observation.end() || !status->is_string() || capacity == observation.end() ||
      !capacity->is_object()) {
    return;
  }
  const std::string& state = status->get_ref<const std::string&>();
  if (state != "success" && state != "failure") return;
  auto metric = capacity->find("metric");
  auto value = capacity->find("value");
  if (metric == capacity->end() || !metric->is_string() ||
      metric->get_ref<const std::string&>().empty() || value == capacity->end() ||
      !(value->is_number() || value->is_boolean())) {
    return;
  }
  // A bool counts as 0 or 1, as Python's bool is an int (the library's arithmetic).
  const double number =
      value->is_boolean() ? (value->get<bool>() ? 1.0 : 0.0) : value->get<double>();
  if (!std::isfinite(number)) return;
  update_limits(limits, metric->get<std::string>(), number, state == "success");
}

json limits_to_json(const CapacityLimits& limits) {
  json out = json::object();
  for (const auto& [metric, entry] : limits) {
    json item = json::object();
    if (entry.max_success) item["max_success"] = *entry.max_success;
    if (entry.min_failure) item["min_failure"] = *entry.min_failure;
    out[metric] = std::move(item);
  }
  return out;
}

Status limits_from_json(const json& value, CapacityLimits* out, const NumberRange& range) {
  if (!value.is_object()) return data_loss("capacity_limits is not an object");
  CapacityLimits limits;
  for (const auto& [metric, item] : value.items()) {
    if (!item.is_object()) {
      return data_loss(fmt::format("capacity_limits '{}' is not an object", metric));
    }
    MetricLimits entry;
    const std::string prefix = fmt::format("capacity_limits.{}.", metric);
    double number = 0.0;
    bool present = false;
    DDO_RETURN_IF_ERROR(optional_number(item, "max_success", prefix, range, &number, &present));
    if (present) entry.max_success = number;
    present = false;
    DDO_RETURN_IF_ERROR(optional_number(item, "min_failure", prefix, range, &number, &present));
    if (present) entry.min_failure = number;
    limits[metric] = entry;
  }
  *out = std::move(limits);
  return Status::ok_status();
}

WarningSink stderr_warning_sink() {
  return [](const std::string& message) { fmt::print(stderr, "ddo: warning: {}\n", message); };
}

// ---------------------------------------------------------------------------------------------
// Records (Note [diffusers-dynamic-offloader's files]).
// ---------------------------------------------------------------------------------------------

namespace {

constexpr std::string_view kLibraryProbeKey = "sdnq_probe_resident_budget_gb";

bool is_known_kind(std::string_view kind) {
  return kind == kKindBaseline || kind == kKindSdnqBaselineSafe || kind == kKindSdnqProbePending ||
         kind == kKindSdnqProbe;
}

// The fields of `object` whose names are not in `known`.
json unknown_fields(const json& object, std::initializer_list<std::string_view> known) {
  json out = json::object();
  for (const auto& [key, item] : object.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) out[key] = item;
  }
  return out;
}

// `base` with every field of `extra` that `base` does not set.
json with_extra(json base, const json& extra) {
  for (const auto& [key, item] : extra.items()) {
    if (!base.contains(key)) base[key] = item;
  }
  return base;
}

}  // namespace

json ProfileIdentity::to_json() const {
  return json{{"execution_mode", execution_mode},
              {"identity_version", identity_version},
              {"model_class", model_class},
              {"name", name}};
}

std::string profile_key(const ProfileIdentity& identity) {
  return capacity_key(identity.to_json());
}

std::string profile_file_name(std::string_view key) {
  return fmt::format("{}.json", key);
}

bool is_valid_profile_key(std::string_view key) {
  if (!key.starts_with(kProfileFilePrefix)) return false;
  const std::string_view hex = key.substr(kProfileFilePrefix.size());
  return hex.size() == kProfileKeyHexDigits && std::all_of(hex.begin(), hex.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool is_named_profile_context(const json& context) {
  if (!context.is_object() || context.size() != 4) return false;
  for (const char* key : {"name", "model_class", "execution_mode"}) {
    auto it = context.find(key);
    if (it == context.end() || !it->is_string()) return false;
  }
  auto version = context.find("identity_version");
  return version != context.end() && version->is_number_integer();
}

json ProfileRecommendation::to_json() const {
  json out{{kRecommendedBudgetKey, resident_budget_gb},
           {"profile_measurement_kind", profile_measurement_kind},
           {"peak_vram_gb", peak_vram_gb},
           {"total_vram_gb", total_vram_gb},
           {"headroom_gb", headroom_gb},
           {"measured_at", measured_at}};
  // The library tells a pending probe by this key alone.
  if (probe_pending) out[kLibraryProbeKey] = probe_budget_gb.value_or(resident_budget_gb);
  if (!probe_pending && probe_budget_gb) out["probe_budget_gb"] = *probe_budget_gb;
  if (safe_budget_gb) out["safe_budget_gb"] = *safe_budget_gb;
  if (!candidate_compute_ms.empty()) out["candidate_compute_ms"] = candidate_compute_ms;
  if (!weights.empty()) out["weights"] = weights;
  return with_extra(std::move(out), extra);
}

Status ProfileRecommendation::from_json(const json& value, ProfileRecommendation* out,
                                        const json& last_observation) {
  if (!value.is_object()) return data_loss("recommendation is not an object");
  constexpr std::string_view kPrefix = "recommendation.";
  ProfileRecommendation r;
  if (!value.contains(kRecommendedBudgetKey)) {
    return data_loss(fmt::format("recommendation.{} is missing", kRecommendedBudgetKey));
  }
  DDO_RETURN_IF_ERROR(required_number(value, kRecommendedBudgetKey.data(), kPrefix, kProfileGbRange,
                                      &r.resident_budget_gb));
  double number = 0;
  bool present = false;
  DDO_RETURN_IF_ERROR(
      optional_number(value, kLibraryProbeKey.data(), kPrefix, kProfileGbRange, &number, &present));
  if (present) {
    r.probe_pending = true;
    r.probe_budget_gb = number;
  }
  // What the library does not write comes from its last observation of the same run.
  const json empty = json::object();
  const json& observed = last_observation.is_object() ? last_observation : empty;
  if (!get_string(value, "profile_measurement_kind", &r.profile_measurement_kind)) {
    std::string kind;
    if (r.probe_pending) {
      r.profile_measurement_kind = std::string(kKindSdnqProbePending);
    } else if (get_string(observed, "profile_measurement_kind", &kind) && is_known_kind(kind) &&
               kind != kKindSdnqProbePending) {
      r.profile_measurement_kind = kind;
    } else {
      r.profile_measurement_kind = std::string(kKindBaseline);
    }
  }
  const std::string& kind = r.profile_measurement_kind;
  if (!is_known_kind(kind)) {
    return data_loss(fmt::format("unknown profile_measurement_kind '{}'", kind));
  }
  if (r.probe_pending != (kind == kKindSdnqProbePending)) {
    return data_loss(fmt::format("recommendation.{} disagrees with its measurement kind '{}'",
                                 kLibraryProbeKey, kind));
  }
  for (auto [key, field] :
       {std::pair{"peak_vram_gb", &r.peak_vram_gb}, std::pair{"total_vram_gb", &r.total_vram_gb},
        std::pair{"headroom_gb", &r.headroom_gb}}) {
    const bool in_recommendation = value.contains(key) && !value[key].is_null();
    DDO_RETURN_IF_ERROR(optional_number(in_recommendation ? value : observed, key,
                                        in_recommendation ? kPrefix : "observations[-1].",
                                        kProfileGbRange, field));
  }
  if (!get_string(value, "measured_at", &r.measured_at)) {
    get_string(observed, "recorded_at", &r.measured_at);
  }
  present = false;
  DDO_RETURN_IF_ERROR(
      optional_number(value, "safe_budget_gb", kPrefix, kProfileGbRange, &number, &present));
  if (present) r.safe_budget_gb = number;
  if (!r.probe_pending) {
    present = false;
    DDO_RETURN_IF_ERROR(
        optional_number(value, "probe_budget_gb", kPrefix, kProfileGbRange, &number, &present));
    if (present) r.probe_budget_gb = number;
  }
  if (auto it = value.find("candidate_compute_ms"); it != value.end() && !it->is_null()) {
    if (!it->is_object()) return data_loss("recommendation.candidate_compute_ms is not an object");
    constexpr NumberRange kMs{0.0, kMaxProfileComputeMs, "ms"};
    for (const auto& [name, ms] : it->items()) {
      DDO_RETURN_IF_ERROR(
          checked_number(ms, fmt::format("recommendation.candidate_compute_ms[\"{}\"]", name), kMs,
                         &r.candidate_compute_ms[name]));
    }
  }
  if (auto it = value.find("weights"); it != value.end() && !it->is_null()) {
    if (!it->is_string() || it->get_ref<const std::string&>().size() > 256) {
      return data_loss("recommendation.weights is not a string of at most 256 bytes");
    }
    r.weights = it->get<std::string>();
  }
  r.extra =
      unknown_fields(value, {kRecommendedBudgetKey, kLibraryProbeKey, "profile_measurement_kind",
                             "peak_vram_gb", "total_vram_gb", "headroom_gb", "measured_at",
                             "safe_budget_gb", "probe_budget_gb", "candidate_compute_ms", "weights",
                             // ddo 0.1.0's own spellings, dropped on rewrite
                             "resident_budget_gb", "probe_pending"});
  *out = std::move(r);
  return Status::ok_status();
}

json ProfileObservation::to_json() const {
  json out{{"status", success ? "success" : "failure"},
           {"capacity", {{"metric", "resident_budget_gb"}, {"value", resident_budget_gb}}},
           {"recorded_at", recorded_at},
           {"profile_measurement_kind", profile_measurement_kind},
           {"resident_budget_gb", resident_budget_gb},
           {"peak_vram_gb", peak_vram_gb},
           {"total_vram_gb", total_vram_gb},
           {"headroom_gb", headroom_gb},
           {"recommended_budget_gb", recommended_budget_gb},
           {"measurement", measurement}};
  return with_extra(std::move(out), extra);
}

namespace {

// `prefix` names the observation in errors: "observations[3]." inside a record. Fields a library
// observation lacks keep their defaults (a library run's "capacity" is absent: its budget was 0).
Status observation_from_json(const json& value, const std::string& prefix,
                             ProfileObservation* out) {
  if (!value.is_object()) {
    return data_loss(fmt::format("{} is not an object", prefix.substr(0, prefix.size() - 1)));
  }
  ProfileObservation o;
  get_string(value, "recorded_at", &o.recorded_at);
  get_string(value, "profile_measurement_kind", &o.profile_measurement_kind);
  if (std::string status; get_string(value, "status", &status)) o.success = status != "failure";
  for (auto [key, field] :
       {std::pair{"peak_vram_gb", &o.peak_vram_gb},
        std::pair{"resident_budget_gb", &o.resident_budget_gb},
        std::pair{"total_vram_gb", &o.total_vram_gb}, std::pair{"headroom_gb", &o.headroom_gb},
        std::pair{"recommended_budget_gb", &o.recommended_budget_gb}}) {
    DDO_RETURN_IF_ERROR(optional_number(value, key, prefix, kProfileGbRange, field));
  }
  // Informational: ddo writes an object, the library a string; the reader bounded its depth
  // (Note [Bounded JSON]).
  if (auto it = value.find("measurement"); it != value.end()) o.measurement = *it;
  o.extra = unknown_fields(value, {"status", "capacity", "recorded_at", "profile_measurement_kind",
                                   "resident_budget_gb", "peak_vram_gb", "total_vram_gb",
                                   "headroom_gb", "recommended_budget_gb", "measurement"});
  *out = std::move(o);
  return Status::ok_status();
}

}  // namespace

Status ProfileObservation::from_json(const json& value, ProfileObservation* out) {
  return observation_from_json(value, "observation.", out);
}

json ProfileRecord::to_json() const {
  json history = json::array();
  for (const ProfileObservation& o : observations) history.push_back(o.to_json());
  json out{{"schema_version", kProfileSchemaVersion},
           {"profile_key", profile_key},
           {"updated_at", updated_at},
           {"context", identity.to_json()},
           {"observations", std::move(history)},
           {"capacity_limits", limits_to_json(capacity)}};
  if (recommendation) out["recommendation"] = recommendation->to_json();
  return with_extra(std::move(out), extra);
}

Status ProfileRecord::from_json(const json& value, ProfileRecord* out) {
  if (!value.is_object()) return data_loss("the file is not a JSON object");
  if (!value.contains("schema_version")) return data_loss("no schema_version; not a ddo profile");
  DDO_RETURN_IF_ERROR(
      version_field(value, "schema_version", "", kProfileSchemaVersion, "recalibrate"));
  ProfileRecord r;
  auto context = value.find("context");
  if (context == value.end() || !context->is_object()) return data_loss("context is missing");
  if (!is_named_profile_context(*context)) {
    return data_loss(
        "not a named profile: its context is not {name, model_class, identity_version, "
        "execution_mode} (a host context's file)");
  }
  get_string(*context, "name", &r.identity.name);
  get_string(*context, "model_class", &r.identity.model_class);
  get_string(*context, "execution_mode", &r.identity.execution_mode);
  DDO_RETURN_IF_ERROR(version_field(*context, "identity_version", "context.",
                                    kProfileIdentityVersion, "recalibrate"));
  r.identity.identity_version = kProfileIdentityVersion;
  if (!get_string(value, "profile_key", &r.profile_key) ||
      r.profile_key != core::profile_key(r.identity)) {
    return data_loss("profile_key does not match the stored context");
  }
  get_string(value, "updated_at", &r.updated_at);
  json last_observation;
  if (auto it = value.find("observations"); it != value.end()) {
    if (!it->is_array()) return data_loss("observations is not an array");
    for (std::size_t i = 0; i < it->size(); ++i) {
      ProfileObservation o;
      DDO_RETURN_IF_ERROR(observation_from_json((*it)[i], fmt::format("observations[{}].", i), &o));
      r.observations.push_back(std::move(o));
    }
    if (!it->empty()) last_observation = it->back();
  }
  if (auto it = value.find("capacity_limits"); it != value.end()) {
    DDO_RETURN_IF_ERROR(limits_from_json(*it, &r.capacity, kProfileGbRange));
  }
  if (auto it = value.find("recommendation"); it != value.end() && !it->is_null()) {
    ProfileRecommendation rec;
    DDO_RETURN_IF_ERROR(ProfileRecommendation::from_json(*it, &rec, last_observation));
    r.recommendation = std::move(rec);
  }
  r.extra = unknown_fields(value, {"schema_version", "profile_key", "updated_at", "context",
                                   "observations", "capacity_limits", "recommendation"});
  *out = std::move(r);
  return Status::ok_status();
}

json ProfileListing::to_json() const {
  json out{{"profile_key", profile_key},
           {"name", name},
           {"model_class", model_class},
           {"execution_mode", execution_mode},
           {"profile_measurement_kind", profile_measurement_kind},
           {"updated_at", updated_at},
           {"path", path.string()}};
  out["resident_budget_gb"] = resident_budget_gb ? json(*resident_budget_gb) : json(nullptr);
  if (!problem.empty()) out["problem"] = problem;
  return out;
}

// ---------------------------------------------------------------------------------------------
// ProfileStore.
// ---------------------------------------------------------------------------------------------

ProfileStore::ProfileStore(ProfileStoreOptions options) : options_(std::move(options)) {
  if (!options_.warn) options_.warn = stderr_warning_sink();
}

fs::path ProfileStore::path_for(const ProfileIdentity& identity) const {
  return options_.directory / profile_file_name(profile_key(identity));
}

fs::path ProfileStore::path_for_key(std::string_view key) const {
  DDO_CHECK(is_valid_profile_key(key), Code::kInvalidArgument, "profile key '", key, "' is not '",
            kProfileFilePrefix, "' followed by ", kProfileKeyHexDigits,
            " lower-case hex digits; copy it from `ddo profiles list`");
  return options_.directory / profile_file_name(key);
}

namespace {

// Parses a profile file; a non-ok status says why it must be ignored.
Status parse_record(const std::string& content, ProfileRecord* record) {
  json value;
  DDO_RETURN_IF_ERROR(parse_json_bounded(content, &value));
  return ProfileRecord::from_json(value, record);
}

}  // namespace

std::optional<ProfileRecord> ProfileStore::load_path(const fs::path& path,
                                                     const std::optional<ProfileIdentity>& expected,
                                                     std::string_view expected_key) const {
  std::string content;
  Status read = read_text_file(path, &content);
  if (read.code() == Code::kNotFound) return std::nullopt;
  if (!read.ok()) {
    options_.warn(fmt::format("ignoring profile '{}': {}", path.string(), read.message()));
    return std::nullopt;
  }
  ProfileRecord record;
  Status parsed = parse_record(content, &record);
  if (parsed.ok() && record.profile_key != expected_key) {
    parsed =
        data_loss(fmt::format("it holds profile key {}, not {}", record.profile_key, expected_key));
  }
  if (parsed.ok() && expected && record.identity != *expected) {
    parsed = data_loss(fmt::format("it holds name '{}' class '{}', not name '{}' class '{}'",
                                   record.identity.name, record.identity.model_class,
                                   expected->name, expected->model_class));
  }
  if (!parsed.ok()) {
    options_.warn(fmt::format("ignoring profile '{}': {}", path.string(), parsed.message()));
    return std::nullopt;
  }
  return record;
}

std::optional<ProfileRecord> ProfileStore::load(const ProfileIdentity& identity) const {
  return load_path(path_for(identity), identity, profile_key(identity));
}

std::optional<ProfileRecord> ProfileStore::load_by_key(std::string_view key) const {
  return load_path(path_for_key(key), std::nullopt, key);
}

Status ProfileStore::save(const ProfileIdentity& identity, const ProfileObservation& observation,
                          const ProfileRecommendation& recommendation) {
  if (identity.name.empty() || identity.model_class.empty()) {
    return Status(Code::kInvalidArgument,
                  fmt::format("a profile needs a non-empty name and model class (got name '{}', "
                              "class '{}')",
                              identity.name, identity.model_class));
  }
  const std::string key = profile_key(identity);
  const fs::path path = path_for(identity);
  const WarningSink& warn = options_.warn;
  auto update = [&](const std::optional<std::string>& current, std::string* next) -> Status {
    ProfileRecord record;
    bool reused = false;
    if (current) {
      Status parsed = parse_record(*current, &record);
      if (parsed.ok() && (record.profile_key != key || record.identity != identity)) {
        parsed = data_loss("it holds another identity");
      }
      if (parsed.ok()) {
        reused = true;
      } else {
        // Keep what was there: a foreign or damaged file may still matter to someone, and so
        // may every earlier backup (each gets a name of its own).
        fs::path kept;
        DDO_RETURN_IF_ERROR(keep_invalid_file(path, &kept));
        warn(fmt::format("replacing unreadable profile '{}' ({}); its content is kept in '{}'",
                         path.string(), parsed.message(), kept.string()));
      }
    }
    if (!reused) {
      record = ProfileRecord{};
      record.identity = identity;
      record.profile_key = key;
    }
    record.updated_at = utc_now_iso8601();
    ProfileObservation stored = observation;
    if (stored.recorded_at.empty()) stored.recorded_at = record.updated_at;
    // The library's generic rule over the observation as written: {"status", "capacity":
    // {"metric": "resident_budget_gb", ...}}.
    update_limits_from_observation(record.capacity, stored.to_json());
    record.observations.push_back(std::move(stored));
    if (record.observations.size() > kMaxProfileObservations) {
      record.observations.erase(
          record.observations.begin(),
          record.observations.end() - static_cast<std::ptrdiff_t>(kMaxProfileObservations));
    }
    ProfileRecommendation rec = recommendation;
    if (rec.measured_at.empty()) rec.measured_at = record.updated_at;
    record.recommendation = std::move(rec);
    *next = record.to_json().dump(2) + "\n";
    return Status::ok_status();
  };
  return update_file_locked(path, update, options_.write, warn);
}

Status ProfileStore::check_writable(const ProfileIdentity& identity) const {
  DDO_RETURN_IF_ERROR(ensure_profile_directory(options_.directory));
  const fs::path path = path_for(identity);
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    return Status(Code::kFailedPrecondition,
                  fmt::format("cannot save profile '{}' for class '{}': its file '{}' is {}, not "
                              "a file; move it away or set DDO_PROFILE_DIR to another directory",
                              identity.name, identity.model_class, path.string(),
                              fs::is_directory(status) ? "a directory" : "not a regular file"));
  }
  // Create and delete a file the way a save does. Its name is a temporary file's, so a process
  // killed in between leaves one that the next save removes (Note [Stale temporary files]).
  static std::atomic<unsigned> counter{0};
  const fs::path probe =
      options_.directory / fmt::format(".{}writable-check.tmp-{}-{}", kProfileFilePrefix,
                                       os::current_process_id(), counter.fetch_add(1));
  const os::Result created = os::write_new_file(probe, {});
  if (!created.ok()) return unavailable_dir(options_.directory, created.text);
  fs::remove(probe, ec);
  return Status::ok_status();
}

std::vector<ProfileListing> ProfileStore::list(
    std::vector<std::filesystem::path>* host_contexts) const {
  std::vector<ProfileListing> rows;
  std::error_code ec;
  const fs::file_status dir_status = fs::status(options_.directory, ec);
  DDO_CHECK(!ec || dir_status.type() == fs::file_type::not_found, Code::kUnavailable,
            "cannot read the profile directory '", options_.directory.string(), "': ", ec.message(),
            "; check its permissions or set DDO_PROFILE_DIR");
  if (!fs::exists(dir_status)) return rows;  // nothing saved yet
  DDO_CHECK(fs::is_directory(dir_status), Code::kFailedPrecondition, "the profile directory '",
            options_.directory.string(),
            "' is not a directory; set DDO_PROFILE_DIR to a directory (or unset it to use "
            "~/.ddo/profiles)");
  fs::directory_iterator entries(options_.directory, ec);
  DDO_CHECK(!ec, Code::kUnavailable, "cannot list the profile directory '",
            options_.directory.string(), "': ", ec.message(),
            "; check its permissions or set DDO_PROFILE_DIR");
  for (; entries != fs::directory_iterator(); entries.increment(ec)) {
    const fs::directory_entry& entry = *entries;
    const std::string file = entry.path().filename().string();
    if (!file.ends_with(".json")) continue;
    const std::string key = file.substr(0, file.size() - 5);
    if (!is_valid_profile_key(key)) continue;
    ProfileListing row;
    row.profile_key = key;
    row.path = entry.path();
    std::string content;
    ProfileRecord record;
    json value;
    Status status = read_text_file(entry.path(), &content);
    if (status.ok()) status = parse_json_bounded(content, &value);
    if (status.ok() && value.is_object()) {
      // A host context's file shares the folder and the key space (host_context.h): not a row.
      auto context = value.find("context");
      if (context != value.end() && context->is_object() && !is_named_profile_context(*context)) {
        if (host_contexts != nullptr) host_contexts->push_back(entry.path());
        continue;
      }
    }
    if (status.ok()) status = ProfileRecord::from_json(value, &record);
    if (status.ok() && record.profile_key != key) {
      status = data_loss("its profile_key does not match its file name");
    }
    if (!status.ok()) {
      row.problem = status.message();
    } else {
      row.name = record.identity.name;
      row.model_class = record.identity.model_class;
      row.execution_mode = record.identity.execution_mode;
      row.updated_at = record.updated_at;
      if (record.recommendation) {
        row.resident_budget_gb = record.recommendation->resident_budget_gb;
        row.profile_measurement_kind = record.recommendation->profile_measurement_kind;
      }
    }
    rows.push_back(std::move(row));
  }
  if (host_contexts != nullptr) std::sort(host_contexts->begin(), host_contexts->end());
  std::sort(rows.begin(), rows.end(), [](const ProfileListing& a, const ProfileListing& b) {
    return std::tie(a.name, a.model_class, a.execution_mode, a.profile_key) <
           std::tie(b.name, b.model_class, b.execution_mode, b.profile_key);
  });
  return rows;
}

Status ProfileStore::remove_path(const fs::path& path, std::string_view what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return Status(Code::kNotFound,
                  fmt::format("no profile {} in '{}'", what, options_.directory.string()));
  }
  // Only a profile file is deleted: a directory or device under a profile's name is not ours.
  if (const fs::file_status st = fs::symlink_status(path, ec); !fs::is_regular_file(st)) {
    return Status(Code::kFailedPrecondition,
                  fmt::format("'{}' is not a profile file (it is not a regular file); nothing was "
                              "deleted: remove it yourself if it should go",
                              path.string()));
  }
  FileLock lock;
  DDO_RETURN_IF_ERROR(FileLock::acquire(lock_path_for(path), &lock));
  if (!fs::remove(path, ec) && ec) {
    return unavailable_dir(options_.directory, fmt::format("cannot delete '{}': {}",
                                                           path.filename().string(), ec.message()));
  }
  // POSIX: unlinked while held; a writer that opened the old lock file re-checks and retries.
  // Windows: a lock file open anywhere cannot be deleted, so it is released first and the delete
  // succeeds only when no other process has it open (Note [File semantics per platform]).
  if (!os::kLockFileDeletableWhileHeld) lock.release();
  fs::remove(lock_path_for(path), ec);
  return Status::ok_status();
}

Status ProfileStore::remove(const ProfileIdentity& identity) {
  return remove_path(path_for(identity),
                     fmt::format("named '{}' for class '{}' in {}", identity.name,
                                 identity.model_class, identity.execution_mode));
}

Status ProfileStore::remove_by_key(std::string_view key) {
  return remove_path(path_for_key(key), fmt::format("with key {}", key));
}

}  // namespace ddo::core
