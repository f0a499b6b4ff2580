// os_file.h on Windows: CreateFileW/FlushFileBuffers/MoveFileExW, LockFileEx, CreateHardLinkW,
// OpenProcess (Note [File semantics per platform] in os_file.h).
#ifdef _WIN32
#include "os_file.h"

#include "win32.h"
// After windows.h:
#include <fcntl.h>
#include <io.h>
#include <knownfolders.h>
#include <shlobj.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <limits>

#include <fmt/format.h>

namespace ddo::core::os {
namespace {

namespace fs = std::filesystem;

// The system's text for a GetLastError() code, without the trailing period and line break.
std::string win_error_text(DWORD err) {
  char* buffer = nullptr;
  const DWORD n = FormatMessageA(
      FORMAT_MESSAGE_ALLOCATE_BUFFER | FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS,
      nullptr, err, MAKELANGID(LANG_NEUTRAL, SUBLANG_DEFAULT), reinterpret_cast<LPSTR>(&buffer), 0,
      nullptr);
  std::string text = n > 0 && buffer != nullptr ? std::string(buffer, n) : std::string();
  if (buffer != nullptr) LocalFree(buffer);
  while (!text.empty() &&
         (text.back() == '\n' || text.back() == '\r' || text.back() == ' ' || text.back() == '.')) {
    text.pop_back();
  }
  if (text.empty()) return fmt::format("Windows error {}", static_cast<unsigned long>(err));
  return fmt::format("{} (Windows error {})", text, static_cast<unsigned long>(err));
}

Result other(std::string what, DWORD err) {
  return Result{Fail::kOther, fmt::format("{}: {}", what, win_error_text(err))};
}

bool is_sharing_refusal(DWORD err) {
  return err == ERROR_SHARING_VIOLATION || err == ERROR_ACCESS_DENIED ||
         err == ERROR_LOCK_VIOLATION;
}

class Handle {
 public:
  explicit Handle(HANDLE h) : h_(h) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() {
    if (valid()) CloseHandle(h_);
  }
  bool valid() const { return h_ != INVALID_HANDLE_VALUE && h_ != nullptr; }
  HANDLE get() const { return h_; }
  // Closes now; false (with GetLastError set) when CloseHandle failed.
  bool close() {
    const bool ok = CloseHandle(h_) != 0;
    h_ = INVALID_HANDLE_VALUE;
    return ok;
  }

 private:
  HANDLE h_;
};

}  // namespace

long current_process_id() {
  return static_cast<long>(GetCurrentProcessId());
}

bool process_is_gone(long pid) {
  if (pid <= 0 || static_cast<unsigned long>(pid) > std::numeric_limits<DWORD>::max()) {
    return false;
  }
  HANDLE process = OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, static_cast<DWORD>(pid));
  if (process == nullptr) {
    // No such process; ERROR_ACCESS_DENIED means one exists that we may not query.
    return GetLastError() == ERROR_INVALID_PARAMETER;
  }
  // A handle can outlive the process (someone still holds one): ask whether it has exited.
  // An exit code of STILL_ACTIVE (259) from a process that really returned 259 reads as alive,
  // which only keeps a file.
  DWORD code = 0;
  const bool exited = GetExitCodeProcess(process, &code) != 0 && code != STILL_ACTIVE;
  CloseHandle(process);
  return exited;
}

Result write_new_file(const fs::path& path, std::string_view content) {
  Handle file(CreateFileW(path.c_str(), GENERIC_WRITE, 0, nullptr, CREATE_NEW,
                          FILE_ATTRIBUTE_NORMAL, nullptr));
  if (!file.valid()) {
    const DWORD err = GetLastError();
    if (err == ERROR_FILE_EXISTS || err == ERROR_ALREADY_EXISTS) {
      return Result{Fail::kExists, fmt::format("'{}' exists", path.string())};
    }
    return other("cannot create a file", err);
  }
  auto fail = [&](const std::string& what) {
    const DWORD err = GetLastError();
    file.close();
    DeleteFileW(path.c_str());
    return other(what, err);
  };
  std::size_t written = 0;
  while (written < content.size()) {
    // WriteFile takes a DWORD count.
    const DWORD chunk = static_cast<DWORD>(
        std::min<std::size_t>(content.size() - written, std::numeric_limits<DWORD>::max()));
    DWORD n = 0;
    if (!WriteFile(file.get(), content.data() + written, chunk, &n, nullptr) || n == 0) {
      return fail("cannot write '" + path.filename().string() + "'");
    }
    written += n;
  }
  // The data must be on the disk before the move makes it visible (write_file_atomic).
  if (!FlushFileBuffers(file.get())) return fail("cannot sync '" + path.filename().string() + "'");
  if (!file.close()) {
    const DWORD err = GetLastError();
    DeleteFileW(path.c_str());
    return other("cannot close a file", err);
  }
  return {};
}

Result replace_file(const fs::path& from, const fs::path& to) {
  // Another program holding `to` open without FILE_SHARE_DELETE refuses the replace for as long
  // as it holds it; ddo's own readers share delete, so only those are waited for (2 s).
  constexpr int kAttempts = 200;
  for (int attempt = 1;; ++attempt) {
    if (MoveFileExW(from.c_str(), to.c_str(), MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH)) {
      return {};
    }
    const DWORD err = GetLastError();
    if (!is_sharing_refusal(err) || attempt == kAttempts) {
      return other(fmt::format("cannot rename onto '{}'", to.filename().string()), err);
    }
    Sleep(10);
  }
}

Result hard_link(const fs::path& path, const fs::path& link) {
  if (CreateHardLinkW(link.c_str(), path.c_str(), nullptr)) return {};
  const DWORD err = GetLastError();
  if (err == ERROR_ALREADY_EXISTS || err == ERROR_FILE_EXISTS) {
    return Result{Fail::kExists, fmt::format("'{}' exists", link.string())};
  }
  return other(fmt::format("cannot link '{}'", link.filename().string()), err);
}

Result move_aside(const fs::path& from, const fs::path& to) {
  // Without MOVEFILE_REPLACE_EXISTING the move itself refuses a taken name.
  if (MoveFileExW(from.c_str(), to.c_str(), MOVEFILE_WRITE_THROUGH)) return {};
  const DWORD err = GetLastError();
  if (err == ERROR_ALREADY_EXISTS || err == ERROR_FILE_EXISTS) {
    return Result{Fail::kExists, fmt::format("'{}' exists", to.string())};
  }
  return other(
      fmt::format("cannot rename '{}' to '{}'", from.filename().string(), to.filename().string()),
      err);
}

Result read_regular_file(const fs::path& path, std::size_t max_bytes, std::string* content) {
  // Every share flag, so that a writer's replace_file is never refused by a reader;
  // FILE_FLAG_BACKUP_SEMANTICS opens a directory too, so it is named instead of "access denied".
  Handle file(CreateFileW(
      path.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
      OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL | FILE_FLAG_BACKUP_SEMANTICS, nullptr));
  if (!file.valid()) {
    const DWORD err = GetLastError();
    if (err == ERROR_FILE_NOT_FOUND || err == ERROR_PATH_NOT_FOUND) {
      return Result{Fail::kNotFound, win_error_text(err)};
    }
    return Result{Fail::kOther, win_error_text(err)};
  }
  const DWORD type = GetFileType(file.get());
  if (type != FILE_TYPE_DISK) {
    return Result{Fail::kNotRegular, type == FILE_TYPE_PIPE ? "a pipe" : "a device"};
  }
  BY_HANDLE_FILE_INFORMATION info{};
  if (!GetFileInformationByHandle(file.get(), &info)) {
    return Result{Fail::kOther, win_error_text(GetLastError())};
  }
  if (info.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY) {
    return Result{Fail::kIsDirectory, "a directory"};
  }
  const std::uintmax_t size =
      (static_cast<std::uintmax_t>(info.nFileSizeHigh) << 32) | info.nFileSizeLow;
  if (size > max_bytes) return Result{Fail::kTooLarge, {}, size};
  content->clear();
  char buffer[1 << 14];
  for (;;) {
    DWORD n = 0;
    if (!ReadFile(file.get(), buffer, sizeof(buffer), &n, nullptr)) {
      return Result{Fail::kOther, win_error_text(GetLastError())};
    }
    if (n == 0) break;
    content->append(buffer, n);
    // The file may grow between the size check and the read; the bound holds for what is read.
    if (content->size() > max_bytes) return Result{Fail::kTooLarge, {}, content->size()};
  }
  return {};
}

Result lock_file(const fs::path& lock_path, int* out, bool wait) {
  // No FILE_SHARE_DELETE: while any process has the lock file open nobody can delete it, so the
  // file locked is always the file named (the POSIX re-check is not needed).
  HANDLE file = CreateFileW(lock_path.c_str(), GENERIC_READ | GENERIC_WRITE,
                            FILE_SHARE_READ | FILE_SHARE_WRITE, nullptr, OPEN_ALWAYS,
                            FILE_ATTRIBUTE_NORMAL, nullptr);
  if (file == INVALID_HANDLE_VALUE) {
    return other(fmt::format("cannot open lock file '{}'", lock_path.filename().string()),
                 GetLastError());
  }
  OVERLAPPED whole{};  // offset 0, the whole range below: one lock for the file
  const DWORD flags = LOCKFILE_EXCLUSIVE_LOCK | (wait ? 0 : LOCKFILE_FAIL_IMMEDIATELY);
  if (!LockFileEx(file, flags, 0, MAXDWORD, MAXDWORD, &whole)) {
    const DWORD err = GetLastError();
    CloseHandle(file);
    if (!wait && err == ERROR_LOCK_VIOLATION) {
      return Result{Fail::kExists,
                    fmt::format("'{}' is locked by another process", lock_path.string())};
    }
    return other(fmt::format("cannot lock '{}'", lock_path.filename().string()), err);
  }
  // A C runtime descriptor owns the handle from here (FileLock keeps an int).
  const int fd = _open_osfhandle(reinterpret_cast<intptr_t>(file), _O_RDWR);
  if (fd < 0) {
    OVERLAPPED again{};
    UnlockFileEx(file, 0, MAXDWORD, MAXDWORD, &again);
    CloseHandle(file);
    return Result{Fail::kOther, fmt::format("cannot lock '{}': out of C runtime descriptors",
                                            lock_path.filename().string())};
  }
  *out = fd;
  return {};
}

void unlock_file(int fd) {
  const auto file = reinterpret_cast<HANDLE>(_get_osfhandle(fd));
  if (file != INVALID_HANDLE_VALUE) {
    OVERLAPPED whole{};
    UnlockFileEx(file, 0, MAXDWORD, MAXDWORD, &whole);
  }
  _close(fd);  // closes the handle too
}

namespace {

// Where lock_owned_file() locks: one byte far past the process id at the start of the file, so
// that another process can read the id while the lock is held (Windows locks are mandatory: a
// locked range cannot be read).
constexpr DWORD kOwnedLockOffsetHigh = 0x40000000;

long read_holder_pid(HANDLE file) {
  char text[32] = {};
  OVERLAPPED at{};  // offset 0
  DWORD n = 0;
  if (!ReadFile(file, text, sizeof(text) - 1, &n, &at) || n == 0) return 0;
  char* end = nullptr;
  const long pid = std::strtol(text, &end, 10);
  return end != text && pid > 0 ? pid : 0;
}

}  // namespace

Result lock_owned_file(const fs::path& lock_path, int* out, long* holder_pid) {
  *holder_pid = 0;
  // FILE_FLAG_OPEN_REPARSE_POINT: a symbolic link or junction at the name is opened itself, not
  // followed, and refused below.
  HANDLE file = CreateFileW(lock_path.c_str(), GENERIC_READ | GENERIC_WRITE,
                            FILE_SHARE_READ | FILE_SHARE_WRITE, nullptr, OPEN_ALWAYS,
                            FILE_ATTRIBUTE_NORMAL | FILE_FLAG_OPEN_REPARSE_POINT, nullptr);
  if (file == INVALID_HANDLE_VALUE) {
    return other(fmt::format("cannot open lock file '{}'", lock_path.string()), GetLastError());
  }
  BY_HANDLE_FILE_INFORMATION info{};
  std::string refused;
  if (!GetFileInformationByHandle(file, &info)) {
    refused = fmt::format("cannot inspect lock file '{}'", lock_path.string());
  } else if ((info.dwFileAttributes & FILE_ATTRIBUTE_REPARSE_POINT) != 0) {
    refused = fmt::format(
        "'{}' is a symbolic link; a lock file is never followed through a link: delete the link",
        lock_path.string());
  } else if ((info.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY) != 0) {
    refused = fmt::format("'{}' is a directory, not a lock file: delete it", lock_path.string());
  } else if (info.nNumberOfLinks != 1) {
    refused = fmt::format("lock file '{}' has {} names (a hard link); delete it",
                          lock_path.string(), static_cast<unsigned long>(info.nNumberOfLinks));
  }
  if (!refused.empty()) {
    CloseHandle(file);
    return Result{Fail::kNotRegular, std::move(refused)};
  }
  OVERLAPPED far_byte{};
  far_byte.OffsetHigh = kOwnedLockOffsetHigh;
  if (!LockFileEx(file, LOCKFILE_EXCLUSIVE_LOCK | LOCKFILE_FAIL_IMMEDIATELY, 0, 1, 0, &far_byte)) {
    const DWORD err = GetLastError();
    if (err == ERROR_LOCK_VIOLATION) *holder_pid = read_holder_pid(file);
    CloseHandle(file);
    if (err == ERROR_LOCK_VIOLATION) {
      return Result{Fail::kExists,
                    fmt::format("'{}' is locked by another process", lock_path.string())};
    }
    return other(fmt::format("cannot lock '{}'", lock_path.string()), err);
  }
  // The holder's id for the next process's message; a failed write costs only that message.
  const std::string pid = std::to_string(current_process_id()) + "\r\n";
  OVERLAPPED start{};
  DWORD written = 0;
  (void)WriteFile(file, pid.data(), static_cast<DWORD>(pid.size()), &written, &start);
  const int fd = _open_osfhandle(reinterpret_cast<intptr_t>(file), _O_RDWR);
  if (fd < 0) {
    CloseHandle(file);  // also releases the lock
    return Result{Fail::kOther, fmt::format("cannot lock '{}': out of C runtime descriptors",
                                            lock_path.string())};
  }
  *out = fd;
  return {};
}

std::string user_id_text() {
  return {};
}

fs::path system_home_folder() {
  PWSTR folder = nullptr;
  fs::path out;
  if (SUCCEEDED(SHGetKnownFolderPath(FOLDERID_Profile, 0, nullptr, &folder))) out = folder;
  CoTaskMemFree(folder);  // also when the call failed (the documented contract)
  return out;
}

std::tm utc_time(std::time_t seconds) {
  std::tm utc{};
  gmtime_s(&utc, &seconds);
  return utc;
}

}  // namespace ddo::core::os
#endif  // _WIN32
