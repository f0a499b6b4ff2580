// Child processes for tests that need more than one process: writers racing for a file lock, a
// writer killed before its rename, the pid of a process that has exited. One shape on every
// platform: a named child function, started in a new process with string arguments. And
// run_program(), for tests that run a built program as a user does (the `ddo` command) and read
// what it printed. Every test program has this folder on its include path (ddo_add_test).
//
//   DDO_TEST_CHILD(save_once) {             // int save_once(const std::vector<std::string>& args)
//     ... open the store in args[0], save ...
//     return ok ? 0 : 1;                    // the child's exit code
//   }
//   ChildProcess child = start_child("save_once", {dir.string()});
//   EXPECT_EQ(child.wait(), 0);
//
// POSIX forks and runs the function in the copy. Windows has no fork: the test program starts
// itself again with the child's name and arguments in the environment; a GoogleTest environment
// (set up after every static registration, before any test runs) sees them, runs the function
// and exits, so the child never runs a test. Its stdout (GoogleTest's banner) goes to NUL.
#pragma once

#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#else
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace ddo::testing {

/// A child's body: its arguments in, its exit code out.
using ChildMain = int (*)(const std::vector<std::string>& args);

inline std::map<std::string, ChildMain>& child_registry() {
  static std::map<std::string, ChildMain> registry;
  return registry;
}

/// Registers `name`, so that start_child(name, ...) can run `body` in a new process.
#define DDO_TEST_CHILD(name)                                                    \
  int ddo_test_child_##name(const std::vector<std::string>& args);              \
  [[maybe_unused]] const bool ddo_test_child_registered_##name =                \
      (::ddo::testing::child_registry()[#name] = &ddo_test_child_##name, true); \
  int ddo_test_child_##name([[maybe_unused]] const std::vector<std::string>& args)

/// A started child process.
class ChildProcess {
 public:
  /// The child's process id (valid after start, and after wait until it is reused).
  long pid() const { return pid_; }

  /// Waits for the child; its exit code, or -1 when it ended by a signal or could not start.
  int wait() {
#ifdef _WIN32
    if (process_ == nullptr) return -1;
    WaitForSingleObject(process_, INFINITE);
    DWORD code = 0;
    const bool ok = GetExitCodeProcess(process_, &code) != 0;
    CloseHandle(process_);
    process_ = nullptr;
    return ok ? static_cast<int>(code) : -1;
#else
    if (pid_ <= 0) return -1;
    int status = 0;
    if (::waitpid(static_cast<pid_t>(pid_), &status, 0) != static_cast<pid_t>(pid_)) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
#endif
  }

  long pid_ = -1;
#ifdef _WIN32
  HANDLE process_ = nullptr;
#endif
};

namespace internal {

inline constexpr const char* kChildVariable = "DDO_TEST_CHILD";

inline std::string arg_variable(std::size_t i) {
  return std::string(kChildVariable) + "_ARG" + std::to_string(i);
}

#ifdef _WIN32
// Runs the child named in the environment, if any, instead of the tests.
class ChildEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* name = std::getenv(kChildVariable);
    if (name == nullptr) return;
    auto it = child_registry().find(name);
    if (it == child_registry().end()) std::_Exit(125);
    std::vector<std::string> args;
    const char* count = std::getenv((std::string(kChildVariable) + "_ARGC").c_str());
    for (int i = 0, n = count ? std::atoi(count) : 0; i < n; ++i) {
      const char* value = std::getenv(arg_variable(static_cast<std::size_t>(i)).c_str());
      args.emplace_back(value ? value : "");
    }
    std::_Exit(it->second(args));
  }
};

inline ::testing::Environment* const kChildEnvironment =
    ::testing::AddGlobalTestEnvironment(new ChildEnvironment);
#endif

}  // namespace internal

/// Starts the child registered as `name` with `args`. pid() is -1 when it could not start.
inline ChildProcess start_child(const std::string& name, const std::vector<std::string>& args) {
  ChildProcess child;
#ifdef _WIN32
  // The child inherits this environment as it is at CreateProcess; the variables are removed
  // again right after, so later children and the tests never see them.
  const std::string count_variable = std::string(internal::kChildVariable) + "_ARGC";
  SetEnvironmentVariableA(internal::kChildVariable, name.c_str());
  SetEnvironmentVariableA(count_variable.c_str(), std::to_string(args.size()).c_str());
  for (std::size_t i = 0; i < args.size(); ++i) {
    SetEnvironmentVariableA(internal::arg_variable(i).c_str(), args[i].c_str());
  }
  wchar_t program[MAX_PATH * 4];
  const DWORD length = GetModuleFileNameW(nullptr, program, MAX_PATH * 4);
  std::wstring command_line = L"\"" + std::wstring(program, length) + L"\"";
  SECURITY_ATTRIBUTES inherit{sizeof(SECURITY_ATTRIBUTES), nullptr, TRUE};
  HANDLE null_out = CreateFileW(L"NUL", GENERIC_WRITE, FILE_SHARE_READ | FILE_SHARE_WRITE, &inherit,
                                OPEN_EXISTING, 0, nullptr);
  STARTUPINFOW startup{};
  startup.cb = sizeof(startup);
  startup.dwFlags = STARTF_USESTDHANDLES;
  startup.hStdInput = GetStdHandle(STD_INPUT_HANDLE);
  startup.hStdOutput = null_out;
  startup.hStdError = GetStdHandle(STD_ERROR_HANDLE);
  PROCESS_INFORMATION info{};
  if (CreateProcessW(program, command_line.data(), nullptr, nullptr, TRUE, 0, nullptr, nullptr,
                     &startup, &info)) {
    CloseHandle(info.hThread);
    child.process_ = info.hProcess;
    child.pid_ = static_cast<long>(info.dwProcessId);
  }
  if (null_out != INVALID_HANDLE_VALUE) CloseHandle(null_out);
  SetEnvironmentVariableA(internal::kChildVariable, nullptr);
  SetEnvironmentVariableA(count_variable.c_str(), nullptr);
  for (std::size_t i = 0; i < args.size(); ++i) {
    SetEnvironmentVariableA(internal::arg_variable(i).c_str(), nullptr);
  }
#else
  auto it = child_registry().find(name);
  if (it == child_registry().end()) return child;
  const pid_t pid = ::fork();
  if (pid == 0) std::_Exit(it->second(args));
  child.pid_ = static_cast<long>(pid);
#endif
  return child;
}

/// What run_program() saw.
struct ProgramResult {
  int exit_code = -1;  ///< the program's exit code; -1 when it ended by a signal or did not start
  std::string output;  ///< what it wrote to standard output
};

/// Runs `command` through the shell, waits for it and captures its standard output; a command
/// that ends in " 2>&1" captures standard error too.
inline ProgramResult run_program(const std::string& command) {
  ProgramResult result;
#ifdef _WIN32
  std::FILE* pipe = ::_popen(command.c_str(), "rb");
#else
  std::FILE* pipe = ::popen(command.c_str(), "r");
#endif
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer{};
  std::size_t got = 0;
  while ((got = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    result.output.append(buffer.data(), got);
  }
#ifdef _WIN32
  result.exit_code = ::_pclose(pipe);
#else
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
#endif
  return result;
}

/// The id of a process that has exited and been waited for: an owner that is certainly gone.
inline long exited_process_id() {
  ChildProcess child = start_child("exit_now", {});
  child.wait();
  return child.pid();
}

namespace internal {
inline int exit_now(const std::vector<std::string>&) {
  return 0;
}
inline const bool kExitNowRegistered = (child_registry()["exit_now"] = &exit_now, true);
}  // namespace internal

}  // namespace ddo::testing
