// The operating system's file and process calls that the durable-file helpers of
// profile_files.cpp need, one function per step: POSIX in os_file_posix.cpp, Win32 in
// os_file_win32.cpp (internal to ddo_core). The helpers above them (write_file_atomic,
// read_text_file, keep_invalid_file, remove_stale_temp_files, FileLock) and their messages are
// written once.
//
//   os::Result r = os::write_new_file(temp, content);   // created, written, on the disk, closed
//   if (r.ok()) r = os::replace_file(temp, target);      // atomic, over an existing target
//   if (!r.ok()) ... r.text ...                          // "cannot rename onto 'x.json': <reason>"
//
// Note [File semantics per platform]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What the profile store relies on, and the call that gives it on each platform:
//   atomic replace   rename(2), then fsync of the directory   MoveFileExW(REPLACE_EXISTING |
//                                                             WRITE_THROUGH)
//   data on disk     fsync before the rename                  FlushFileBuffers before the move
//   exclusive create open(O_CREAT | O_EXCL)                   CreateFileW(CREATE_NEW)
//   lock             flock(LOCK_EX) on "<file>.lock"          LockFileEx(EXCLUSIVE) on it
//   no link followed open(O_NOFOLLOW), then fstat: regular,  CreateFileW(OPEN_REPARSE_POINT),
//                    one link, this user's                    then no reparse point, one link
//   backup name      link(2), EEXIST when taken               CreateHardLinkW, ERROR_ALREADY_EXISTS
//   owner gone       kill(pid, 0) == ESRCH                    OpenProcess fails with
//                                                             ERROR_INVALID_PARAMETER, or
//                                                             GetExitCodeProcess != STILL_ACTIVE
// Two Windows differences shape the callers:
// - A file that any process has open without FILE_SHARE_DELETE cannot be deleted or replaced.
//   Readers here open with every share flag; other programs (a virus scanner, an editor) may
//   not, so replace_file retries a sharing refusal for up to two seconds before it fails.
// - For the same reason a held lock file cannot be deleted (the lock handle does not share
//   delete), which is what the POSIX acquire loop's re-check guards against: there
//   ProfileStore::remove deletes the lock file after releasing it, and the delete succeeds only
//   when no other process has it open (kLockFileDeletableWhileHeld).
#pragma once

#include <cstdint>
#include <ctime>
#include <filesystem>
#include <string>
#include <string_view>

namespace ddo::core::os {

/// Why a call failed; kNone when it did not.
enum class Fail {
  kNone,
  kExists,       ///< the name is taken (exclusive create, hard link, move aside)
  kNotFound,     ///< the path does not exist
  kIsDirectory,  ///< a directory where a file was expected
  kNotRegular,   ///< a FIFO, device, socket, ...: `text` says which ("a FIFO")
  kTooLarge,     ///< larger than the caller's bound: `size` holds its size
  kOther,        ///< anything else: `text` says what failed and the system's reason
};

/// The outcome of one call.
struct Result {
  Fail fail = Fail::kNone;
  std::string text;         ///< what failed and why, for messages ("cannot write 'x': ...")
  std::uintmax_t size = 0;  ///< kTooLarge: the file's size in bytes
  bool ok() const { return fail == Fail::kNone; }
};

/// This process's id.
long current_process_id();

/// True only when no process with id `pid` exists now. False when it lives, and when the
/// system cannot tell (another user's process), so that callers never delete a live writer's
/// file.
bool process_is_gone(long pid);

/// Creates `path` (kExists when the name is taken), writes `content`, flushes it to the disk and
/// closes it. On failure the partial file is deleted.
Result write_new_file(const std::filesystem::path& path, std::string_view content);

/// Renames `from` over `to` in one step: readers see the old or the new file, never a mix or
/// none. Then makes the rename itself durable where the system allows. On failure `to` is
/// untouched and `from` stays for the caller to delete.
Result replace_file(const std::filesystem::path& from, const std::filesystem::path& to);

/// A second name `link` for the existing file `path` (kExists when `link` is taken; kOther where
/// the file system has no hard links).
Result hard_link(const std::filesystem::path& path, const std::filesystem::path& link);

/// Renames `from` to `to` unless `to` exists (kExists).
Result move_aside(const std::filesystem::path& from, const std::filesystem::path& to);

/// Reads the whole regular file `path` into `content` when it holds at most `max_bytes`:
/// kNotFound, kIsDirectory, kNotRegular, kTooLarge, or kOther (an error while opening or
/// reading). Never blocks on a FIFO.
Result read_regular_file(const std::filesystem::path& path, std::size_t max_bytes,
                         std::string* content);

/// Opens (creating) `lock_path` and locks it exclusively, waiting for other holders; `*fd` is a
/// C runtime file descriptor that unlock_file() releases. On POSIX it re-checks after locking
/// that the file was not deleted meanwhile (and retries on the current one). With `wait` false it
/// does not wait: kExists when another holder has it.
Result lock_file(const std::filesystem::path& lock_path, int* fd, bool wait = true);

/// Unlocks and closes a descriptor from lock_file() or lock_owned_file().
void unlock_file(int fd);

/// A lock for this user's processes at a fixed name in a folder every user can write (the
/// temporary folder), taken without waiting. Opens (creating, mode 0600) `lock_path` without
/// following a link there (O_NOFOLLOW; FILE_FLAG_OPEN_REPARSE_POINT) and refuses, with kNotRegular
/// and nothing created or written elsewhere, a symbolic link, a file that is not regular, one with
/// a second name (a hard link), and on POSIX one owned by another user (`text` names the owner's
/// uid). kExists when another process holds it: `*holder_pid` is the process id the holder wrote
/// into the file (0 when it cannot be read). Once locked the file holds this process's id.
Result lock_owned_file(const std::filesystem::path& lock_path, int* fd, long* holder_pid);

/// This user's id as text for per-user file names ("1000"); empty on Windows, whose temporary
/// folder is per user already.
std::string user_id_text();

/// Whether a held lock file can be deleted: true on POSIX (flock survives unlink, and
/// lock_file() re-checks), false on Windows (Note [File semantics per platform]).
#ifdef _WIN32
inline constexpr bool kLockFileDeletableWhileHeld = false;
#else
inline constexpr bool kLockFileDeletableWhileHeld = true;
#endif

/// The user's profile folder as the system knows it, for when the environment names none:
/// SHGetKnownFolderPath(FOLDERID_Profile) on Windows (a wide path, right for any user name);
/// empty on POSIX, where HOME is the rule, and when the system cannot say.
std::filesystem::path system_home_folder();

/// `seconds` as UTC calendar time (gmtime_r / gmtime_s).
std::tm utc_time(std::time_t seconds);

}  // namespace ddo::core::os
