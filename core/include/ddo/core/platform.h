/// \file
/// Platform facts the settings loader needs: WSL detection and host RAM from /proc/meminfo.
///
/// Each fact has a pure function over text (what tests call) and a thin wrapper that reads the
/// file. A file that cannot be read yields "unknown" (std::nullopt or false), never an error:
/// these facts only steer defaults, and the user can state them (DDO_AVAILABLE_SYSTEM_RAM_GB).
///
/// ```
/// ddo::core::detect_wsl({{"WSL_DISTRO_NAME", "Ubuntu"}}, "")            // true
/// ddo::core::detect_wsl({}, "Linux version 5.15.90.1-microsoft-standard-WSL2")  // true
/// auto info = ddo::core::parse_meminfo("MemTotal: 16 kB\nMemAvailable: 8 kB\n");
/// // info.total_bytes == 16384; info.available_bytes == 8192
/// ```
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace ddo::core {

/// The process environment as a map, so tests can pass their own (settings.h: process_env()).
using EnvMap = std::map<std::string, std::string>;

/// True when WSL_DISTRO_NAME or WSL_INTEROP is set in `env`, or `proc_version_text` (the content
/// of /proc/version) mentions "microsoft" in any case (WSL1 says "Microsoft", WSL2 "microsoft").
bool detect_wsl(const EnvMap& env, std::string_view proc_version_text);

/// detect_wsl(env, <content of /proc/version, or "" when unreadable>).
bool detect_wsl(const EnvMap& env);

/// Host RAM from /proc/meminfo text. Unknown values stay unset.
struct MemInfo {
  std::optional<std::int64_t> total_bytes;      ///< MemTotal
  std::optional<std::int64_t> available_bytes;  ///< see parse_meminfo
};

/// `available_bytes` counts reclaimable memory (page cache, reclaimable slab), since pinning may
/// evict it: MemAvailable when the kernel reports it (>= 3.14), else
/// MemFree + Buffers + Cached + SReclaimable (missing terms count 0; MemFree itself is required).
MemInfo parse_meminfo(std::string_view meminfo_text);

/// parse_meminfo over /proc/meminfo; both unset when it cannot be read.
MemInfo read_meminfo();
std::optional<std::int64_t> detect_available_ram_bytes();  ///< read_meminfo().available_bytes
std::optional<std::int64_t> detect_total_ram_bytes();      ///< read_meminfo().total_bytes

}  // namespace ddo::core
