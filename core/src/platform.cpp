#include "ddo/core/platform.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>

#ifdef _WIN32
#include "win32.h"
#else
#include <fcntl.h>
#include <unistd.h>
#endif

namespace ddo::core {
namespace {

// Note [Platform facts on Windows]
// Windows has no /proc: RAM comes from GlobalMemoryStatusEx (ullAvailPhys counts the standby
// list, the counterpart of MemAvailable's reclaimable cache), and a native Windows process is
// never WSL (only the environment can say so). The text parsers stay the same on every platform.
#ifdef _WIN32
std::string read_file(const char* /*path*/) {
  return {};
}
#else
// POSIX reads, not <fstream>: see Note [No iostreams] in ddo/core/status.h.
std::string read_file(const char* path) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fd);
  return out;
}
#endif

bool contains_ignore_case(std::string_view haystack, std::string_view needle) {
  auto it = std::search(haystack.begin(), haystack.end(), needle.begin(), needle.end(),
                        [](char a, char b) {
                          return std::tolower(static_cast<unsigned char>(a)) ==
                                 std::tolower(static_cast<unsigned char>(b));
                        });
  return it != haystack.end();
}

// Parses "<value> kB" (or a bare number of bytes, as some tables use) into bytes.
std::optional<std::int64_t> parse_meminfo_value(std::string_view rest) {
  std::size_t i = 0;
  while (i < rest.size() && std::isspace(static_cast<unsigned char>(rest[i]))) ++i;
  std::int64_t value = 0;
  auto [end, ec] = std::from_chars(rest.data() + i, rest.data() + rest.size(), value);
  if (ec != std::errc() || value < 0) return std::nullopt;
  std::string_view unit(end, static_cast<std::size_t>(rest.data() + rest.size() - end));
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) {
    unit.remove_prefix(1);
  }
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) {
    unit.remove_suffix(1);
  }
  if (unit.empty()) return value;
  if (unit == "kB" || unit == "KB" || unit == "kb") return value * 1024;
  return std::nullopt;
}

}  // namespace

bool detect_wsl(const EnvMap& env, std::string_view proc_version_text) {
  if (env.count("WSL_DISTRO_NAME") != 0 || env.count("WSL_INTEROP") != 0) return true;
  return contains_ignore_case(proc_version_text, "microsoft");
}

bool detect_wsl(const EnvMap& env) {
  return detect_wsl(env, read_file("/proc/version"));
}

MemInfo parse_meminfo(std::string_view text) {
  std::map<std::string, std::int64_t, std::less<>> values;
  while (!text.empty()) {
    const std::size_t newline = text.find('\n');
    std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    if (auto bytes = parse_meminfo_value(line.substr(colon + 1))) {
      values[std::string(line.substr(0, colon))] = *bytes;
    }
  }
  auto get = [&](std::string_view key) -> std::optional<std::int64_t> {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };

  MemInfo info;
  info.total_bytes = get("MemTotal");
  if (auto available = get("MemAvailable")) {
    info.available_bytes = available;
  } else if (auto free_bytes = get("MemFree")) {
    info.available_bytes = *free_bytes + get("Buffers").value_or(0) + get("Cached").value_or(0) +
                           get("SReclaimable").value_or(0);
  }
  return info;
}

MemInfo read_meminfo() {
#ifdef _WIN32
  MEMORYSTATUSEX status{};
  status.dwLength = sizeof(status);
  if (!GlobalMemoryStatusEx(&status)) return {};
  MemInfo info;
  info.total_bytes = static_cast<std::int64_t>(status.ullTotalPhys);
  info.available_bytes = static_cast<std::int64_t>(status.ullAvailPhys);
  return info;
#else
  return parse_meminfo(read_file("/proc/meminfo"));
#endif
}

std::optional<std::int64_t> detect_available_ram_bytes() {
  return read_meminfo().available_bytes;
}

std::optional<std::int64_t> detect_total_ram_bytes() {
  return read_meminfo().total_bytes;
}

}  // namespace ddo::core
