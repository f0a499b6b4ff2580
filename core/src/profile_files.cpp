// Durable files for profiles and host contexts: the profile directory, atomic writes, bounded
// reads (Note [Bounded JSON]), backups of unreadable files, stale temporary files and the file
// lock that serializes read-modify-write updates. Separate from the record schema
// (profile_schema.cpp): this file knows bytes and files, not what a record holds.
#include "ddo/core/profile_store.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "os_file.h"
#include "profile_store_internal.h"

namespace ddo::core {
namespace fs = std::filesystem;
using nlohmann::json;

namespace internal {

Status unavailable_dir(const fs::path& directory, const std::string& what) {
  return Status(Code::kUnavailable,
                fmt::format("cannot write profiles in '{}': {}; set DDO_PROFILE_DIR to a writable "
                            "directory",
                            directory.string(), what));
}

Status data_loss(std::string message) {
  return Status(Code::kDataLoss, std::move(message));
}

}  // namespace internal

using internal::data_loss;
using internal::unavailable_dir;

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
// Every profile text is measured before a document is built: its size (kMaxProfileFileBytes,
// checked while reading) and its nesting depth by a linear scan (json_nesting_depth) against
// kMaxJsonDepth. A file that fails either is invalid like any corrupt file: listed with the
// reason, ignored by load, kept aside by save; it never overflows the stack and is never written
// back many times its size. The reason: nlohmann::json parses and destroys iteratively, but
// copies, compares and dumps recursively, one stack frame per level. A value nested
// 50,000-200,000 deep parses and then overflows the stack on the first copy of the document
// (`ddo profiles list` would die, and the user could not even find the file), and a 21 KB file
// nested 10,000 deep, dumped with two spaces of indentation per level, is 200 MB. In-memory
// values from callers (host contexts) are bounded while they are normalized (host_context.cpp).
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
// A temporary file of a dead writer does not outlive the next update in its directory.
// write_file_atomic names its temporary ".<file>.tmp-<pid>-<n>"; a writer killed between creating
// it and the rename leaves it behind (about half of 50 kill -9 in a loop do). The next update in
// the directory deletes such files when their owner is certainly gone: the system says there is no
// such process (os::process_is_gone: a live process, or one we may not ask about, is never touched)
// AND the file is older than a minute. The age guard covers writers that share the directory from
// another PID namespace (a container) or another host (a network file system), whose pids mean
// nothing here: a save takes milliseconds, so a minute-old temporary file has no writer left. Only
// names of ddo's own files are considered.
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

}  // namespace ddo::core
