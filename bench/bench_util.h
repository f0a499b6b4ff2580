// Helpers shared by ddo's benchmarks (bench/*.cpp; this header is not a benchmark itself).
//
// Flags are `--name value` or `--name=value`; every benchmark writes one JSON file (--out) with
// the machine facts of docs/design/0009-benchmarks.md (GPU, driver, torch version, commit, command)
// and prints a markdown table last, so the tail of a log is the result.
//
//   ddo::bench::Args args(argc, argv);
//   const int steps = args.get_int("steps", 5);
//   nlohmann::json doc = ddo::bench::machine_json(args, "w1");
//   ddo::bench::write_json(args.get("out", ""), doc);
#pragma once

#ifdef __GLIBC__
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <torch/version.h>
#include <nlohmann/json.hpp>

#include "ddo/core/os_memory.h"
#include "ddo/core/status.h"
#include "ddo/engine/device.h"

namespace ddo::bench {

constexpr double kGB = 1e9;  // link figures in GB/s (10^9), as in docs/design/0009-benchmarks.md
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

class Args {
 public:
  Args(int argc, char** argv) {
    for (int i = 0; i < argc; ++i) command_ += (i ? " " : "") + std::string(argv[i]);
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) {
        std::fprintf(stderr, "unexpected argument \"%s\"; flags are --name value\n", a.c_str());
        std::exit(2);
      }
      a = a.substr(2);
      const auto eq = a.find('=');
      if (eq != std::string::npos) {
        values_[a.substr(0, eq)] = a.substr(eq + 1);
      } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
        values_[a] = argv[++i];
      } else {
        values_[a] = "1";
      }
    }
  }
  std::string get(const std::string& name, const std::string& fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  int get_int(const std::string& name, int fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : std::stoi(it->second);
  }
  double get_double(const std::string& name, double fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : std::stod(it->second);
  }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  // "8,12,16" -> {8, 12, 16}
  std::vector<double> get_list(const std::string& name, const std::string& fallback) const {
    std::vector<double> out;
    std::stringstream in(get(name, fallback));
    std::string item;
    while (std::getline(in, item, ',')) {
      if (!item.empty()) out.push_back(std::stod(item));
    }
    return out;
  }
  const std::string& command() const { return command_; }

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
};

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); -1 where unreadable.
inline std::int64_t proc_status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::stoll(line.substr(field.size() + 1)) * 1024;  // the kernel writes kB
    }
  }
  return -1;
}

// Resets VmHWM to the current RSS. Heap pages that earlier work freed are handed back first
// (core::os::trim_heap), so a row's peak does not start from the previous rows' garbage.
inline bool reset_peak_rss() {
  ddo::core::os::trim_heap();
  std::ofstream out("/proc/self/clear_refs");
  if (!out) return false;
  out << "5";
  return static_cast<bool>(out.flush());
}

inline std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The machine facts every result file carries. The commit comes from --commit or DDO_COMMIT
// (the script passes `git rev-parse HEAD`; the GPU machine has no git history).
inline nlohmann::json machine_json(const Args& args, const std::string& benchmark) {
  nlohmann::json j;
  j["benchmark"] = benchmark;
  j["command"] = args.command();
  const char* commit = std::getenv("DDO_COMMIT");
  j["commit"] = args.get("commit", commit ? commit : "unknown");
  j["torch_version"] = TORCH_VERSION;
  const std::string driver = first_line("/proc/driver/nvidia/version");
  j["driver"] = driver.empty() ? "none" : driver;
  char host[256] = {0};
  std::FILE* f = std::fopen("/proc/sys/kernel/hostname", "r");
  if (f) {
    if (std::fgets(host, sizeof(host), f) == nullptr) host[0] = 0;
    std::fclose(f);
  }
  j["host"] = std::string(host).substr(0, std::string(host).find('\n'));
  const auto t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  j["utc"] = when;
  return j;
}

inline void write_json(const std::string& path, const nlohmann::json& doc) {
  if (path.empty()) return;
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  std::fprintf(stderr, "wrote %s\n", path.c_str());
}

inline std::string fmt(double v, int precision = 3) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", precision, v);
  return buf;
}

// Bytes per second of one large pinned host-to-device copy on `dev` (best of three after a
// warm-up): B_pinned of docs/design/0009-benchmarks.md. Device time from timing events where the
// backend has them.
inline double measure_b_pinned(engine::Device& dev, std::size_t bytes) {
  void* host = nullptr;
  void* device = nullptr;
  throw_if_error(dev.allocate_host(bytes, &host));
  throw_if_error(dev.allocate(bytes, &device));
  std::memset(host, 1, bytes);
  engine::Stream stream = dev.create_stream();
  engine::Event start = dev.create_event(true);
  engine::Event end = dev.create_event(true);
  double best = 0.0;
  for (int i = 0; i < 4; ++i) {
    const double t0 = now_s();
    dev.record_event(start, stream);
    throw_if_error(dev.copy_to_device_async(device, host, bytes, stream));
    dev.record_event(end, stream);
    dev.synchronize_event(end);
    const float ms = dev.elapsed_ms(start, end);
    const double s = ms > 0 ? ms / 1e3 : now_s() - t0;
    if (i > 0) best = std::max(best, static_cast<double>(bytes) / s);  // the first warms up
  }
  dev.destroy_event(start);
  dev.destroy_event(end);
  dev.destroy_stream(stream);
  dev.deallocate(device);
  dev.deallocate_host(host);
  return best;
}

}  // namespace ddo::bench
