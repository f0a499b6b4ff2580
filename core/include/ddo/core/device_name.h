/// \file
/// DeviceName: an execution device's name, parsed once.
///
/// ddo executes on "cuda:N" (a GPU), "sim:N" (the host simulation) and, in plan mode, "cpu".
/// Every layer that takes a device name (the config check, the calibration region lock, the
/// adapter that opens the device, the `ddo demo --device` option) parses it here, so one
/// spelling is accepted everywhere and "cuda", "cuda:0" and "cuda:00" are one device.
///
/// ```
/// DeviceName d;
/// parse_device_name("execution_device", "cuda:03", &d);  // ok: d.type == kCuda, d.index == 3
/// d.str();                                               // "cuda:3"
/// parse_device_name("execution_device", "mps", &d).message();
/// // "execution_device \"mps\" is not a device ddo executes on; use \"cuda:N\" (a GPU), ..."
/// ```
#pragma once

#include <string>
#include <string_view>

#include "ddo/core/status.h"

namespace ddo::core {

/// The largest device index ddo accepts in "cuda:N" and "sim:N": far above any machine, small
/// enough for an int in every layer.
inline constexpr int kMaxDeviceIndex = 1023;

/// The kinds of device ddo executes on.
enum class DeviceType {
  kCpu,   ///< "cpu": plan mode only (nothing is streamed)
  kCuda,  ///< "cuda:N": a GPU
  kSim,   ///< "sim:N": the host simulation of a device
};

/// A parsed device name.
struct DeviceName {
  DeviceType type = DeviceType::kCpu;  ///< its kind
  int index = 0;                       ///< N of cuda:N / sim:N; 0 for cpu

  /// The canonical spelling: "cpu", "cuda:N", "sim:N" (no leading zeros).
  std::string str() const;
  bool operator==(const DeviceName&) const = default;  ///< same type and index
};

/// Parses "cpu", "cuda", "cuda:N", "sim", "sim:N" (N decimal digits worth 0 to kMaxDeviceIndex,
/// leading zeros allowed). kInvalidArgument names `source` and the text: for an index out of
/// range or not digits, the range; for another name, the three kinds. `out` is unchanged on error.
Status parse_device_name(std::string_view source, std::string_view text, DeviceName* out);

/// The check of a device name's index, done for config fields and options that may hold names ddo
/// does not open itself: in "cuda:N" and "sim:N", N must be decimal digits worth 0 to
/// kMaxDeviceIndex (parse_device_name's rule and message). Other names ("cpu", "cuda", "sim", or
/// a kind ddo does not know) pass; the layer that opens the device judges them.
///
/// ```
/// check_device_index("--device", "sim:99999999999").message();
/// // "--device 'sim:99999999999': the index '99999999999' is not a number from 0 to 1023;
/// //  write e.g. sim:0"
/// ```
Status check_device_index(std::string_view source, std::string_view device);

}  // namespace ddo::core
