// os_file.h on POSIX (Linux): open/fsync/rename, flock, link, kill(pid, 0).
#ifndef _WIN32
#include "os_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <system_error>

#include <fmt/format.h>

namespace ddo::core::os {
namespace {

namespace fs = std::filesystem;

std::string errno_text(int err) {
  return std::error_code(err, std::generic_category()).message();
}

Result other(std::string what, int err) {
  return Result{Fail::kOther, fmt::format("{}: {}", what, errno_text(err))};
}

// What a non-regular file is, for messages.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

long current_process_id() {
  return static_cast<long>(::getpid());
}

bool process_is_gone(long pid) {
  if (pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

Result write_new_file(const fs::path& path, std::string_view content) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) return Result{Fail::kExists, fmt::format("'{}' exists", path.string())};
    return other("cannot create a file", err);
  }
  auto fail = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return other(what, err);
  };
  std::size_t written = 0;
  while (written < content.size()) {
    const ssize_t n = ::write(fd, content.data() + written, content.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail("cannot write '" + path.filename().string() + "'");
    }
    written += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("cannot sync '" + path.filename().string() + "'");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return other("cannot close a file", err);
  }
  return {};
}

Result replace_file(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return other(fmt::format("cannot rename onto '{}'", to.filename().string()), errno);
  }
  // Persist the rename itself. Failure here leaves a correct file that may not survive a power
  // loss; not worth failing the save for, and some file systems refuse directory fsync.
  const fs::path directory = to.parent_path().empty() ? fs::path(".") : to.parent_path();
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    (void)::fsync(dir_fd);
    ::close(dir_fd);
  }
  return {};
}

Result hard_link(const fs::path& path, const fs::path& link) {
  if (::link(path.c_str(), link.c_str()) == 0) return {};
  const int err = errno;
  if (err == EEXIST) return Result{Fail::kExists, fmt::format("'{}' exists", link.string())};
  return other(fmt::format("cannot link '{}'", link.filename().string()), err);
}

Result move_aside(const fs::path& from, const fs::path& to) {
  // rename(2) replaces silently; the check narrows that to a race no ddo writer takes part in
  // (backups are made under the file's lock).
  std::error_code ec;
  if (fs::exists(to, ec)) return Result{Fail::kExists, fmt::format("'{}' exists", to.string())};
  if (::rename(from.c_str(), to.c_str()) == 0) return {};
  return other(
      fmt::format("cannot rename '{}' to '{}'", from.filename().string(), to.filename().string()),
      errno);
}

Result read_regular_file(const fs::path& path, std::size_t max_bytes, std::string* content) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Result{Fail::kNotFound, errno_text(err)};
    if (err == EISDIR) return Result{Fail::kIsDirectory, "a directory"};
    return Result{Fail::kOther, errno_text(err)};
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int err = errno;
    ::close(fd);
    return Result{Fail::kOther, errno_text(err)};
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return Result{S_ISDIR(info.st_mode) ? Fail::kIsDirectory : Fail::kNotRegular,
                  file_kind(info.st_mode)};
  }
  if (static_cast<std::uintmax_t>(info.st_size) > max_bytes) {
    ::close(fd);
    return Result{Fail::kTooLarge, {}, static_cast<std::uintmax_t>(info.st_size)};
  }
  content->clear();
  char buffer[1 << 14];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return Result{Fail::kOther, errno_text(err)};
    }
    content->append(buffer, static_cast<std::size_t>(n));
    // The file may grow between fstat and read; the bound holds for what is read.
    if (content->size() > max_bytes) {
      ::close(fd);
      return Result{Fail::kTooLarge, {}, content->size()};
    }
  }
  ::close(fd);
  return {};
}

Result lock_file(const fs::path& lock_path, int* out, bool wait) {
  for (;;) {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return other(fmt::format("cannot open lock file '{}'", lock_path.filename().string()), errno);
    }
    int rc = 0;
    while ((rc = ::flock(fd, wait ? LOCK_EX : LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
      const int err = errno;
      ::close(fd);
      if (!wait && err == EWOULDBLOCK) {
        return Result{Fail::kExists,
                      fmt::format("'{}' is locked by another process", lock_path.string())};
      }
      return other(fmt::format("cannot lock '{}'", lock_path.filename().string()), err);
    }
    // If a remover unlinked the lock file between our open and flock, we hold a lock nobody
    // else can see; retry on the current file.
    struct stat held {};
    struct stat current {};
    if (::fstat(fd, &held) == 0 && ::stat(lock_path.c_str(), &current) == 0 &&
        held.st_ino == current.st_ino && held.st_dev == current.st_dev) {
      *out = fd;
      return {};
    }
    ::close(fd);
  }
}

void unlock_file(int fd) {
  ::flock(fd, LOCK_UN);
  ::close(fd);
}

namespace {

// The process id a lock holder wrote at the start of its lock file; 0 when there is none.
long read_holder_pid(int fd) {
  char text[32] = {};
  const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
  if (n <= 0) return 0;
  char* end = nullptr;
  const long pid = std::strtol(text, &end, 10);
  return end != text && pid > 0 ? pid : 0;
}

}  // namespace

Result lock_owned_file(const fs::path& lock_path, int* out, long* holder_pid) {
  *holder_pid = 0;
  // O_NOFOLLOW: a symbolic link at the name (another user's, pointing anywhere) fails with ELOOP
  // and creates nothing at its target; O_NONBLOCK: a FIFO there does not block the open.
  const int fd =
      ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) {
      return Result{Fail::kNotRegular,
                    fmt::format("'{}' is a symbolic link; a lock file is never followed through a "
                                "link: delete the link",
                                lock_path.string())};
    }
    if (err == EISDIR) {
      return Result{
          Fail::kNotRegular,
          fmt::format("'{}' is a directory, not a lock file: delete it", lock_path.string())};
    }
    return other(fmt::format("cannot open lock file '{}'", lock_path.string()), err);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return other(fmt::format("cannot inspect lock file '{}'", lock_path.string()), err);
  }
  std::string refused;
  if (!S_ISREG(st.st_mode)) {
    refused = fmt::format("'{}' is {}, not a lock file: delete it", lock_path.string(),
                          file_kind(st.st_mode));
  } else if (st.st_uid != ::geteuid()) {
    refused = fmt::format(
        "lock file '{}' belongs to user id {}, not to this user (id {}); another user's file is "
        "never used as this user's lock: ask its owner or an administrator to delete it",
        lock_path.string(), static_cast<long>(st.st_uid), static_cast<long>(::geteuid()));
  } else if (st.st_nlink != 1) {
    refused = fmt::format("lock file '{}' has {} names (a hard link); delete it",
                          lock_path.string(), static_cast<long>(st.st_nlink));
  }
  if (!refused.empty()) {
    ::close(fd);
    return Result{Fail::kNotRegular, std::move(refused)};
  }
  int rc = 0;
  while ((rc = ::flock(fd, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
  }
  if (rc != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) *holder_pid = read_holder_pid(fd);
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return Result{Fail::kExists,
                    fmt::format("'{}' is locked by another process", lock_path.string())};
    }
    return other(fmt::format("cannot lock '{}'", lock_path.string()), err);
  }
  // The holder's id for the next process's message; a failed write costs only that message.
  const std::string pid = std::to_string(current_process_id()) + "\n";
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, pid.data(), pid.size(), 0);
  *out = fd;
  return {};
}

std::string user_id_text() {
  return std::to_string(static_cast<long>(::geteuid()));
}

fs::path system_home_folder() {
  return {};
}

std::tm utc_time(std::time_t seconds) {
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  return utc;
}

}  // namespace ddo::core::os
#endif  // !_WIN32
