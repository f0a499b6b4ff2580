// Helpers the attach's files share (internal): the clock, the byte span of a tensor, the setup
// events and the alignment of staged views. See Note [Attach phases] in attach_plan.cpp.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ddo/core/units.h"
#include "offload_state.h"

namespace ddo::adapter::internal {

inline constexpr std::size_t kTensorAlignment = 256;  // staged views start 256-byte aligned
inline constexpr std::size_t kFillChunkBytes = std::size_t{1} << 30;

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

using core::align_up;  // one rounding rule (ddo/core/units.h)

// Bytes from the tensor's first element to one past its last (non-negative strides).
inline std::size_t span_bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) >= 0, "ddo: tensor with a negative stride cannot be offloaded");
    last += (t.size(d) - 1) * t.stride(d);
  }
  return static_cast<std::size_t>(last + 1) * t.element_size();
}

// A CPU tensor whose bytes can be read at data_ptr (copies non-CPU tensors).
// Note [Inference tensors as weights]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A model built under torch.inference_mode() holds inference tensors: no version counter. Once
// set_data points such a parameter at ddo's data, the parameter takes the data's dispatch keys
// (no longer an inference tensor) but keeps the disabled counter, and the next view of it or
// _version() throws ("Inference tensors do not track version counter"), in a forward or in
// remove(). The parameter therefore gets a counter of its own with its new data: it is an
// ordinary tensor from the attach on, and stays one after remove(), which torch allows in every
// grad mode.
inline void set_weight(at::Tensor& handle, const at::Tensor& data) {
  at::AutoGradMode no_grad(false);
  const bool was_inference = handle.is_inference();
  handle.set_data(data);
  if (was_inference && !handle.is_inference()) {
    handle.unsafeGetTensorImpl()->set_version_counter(c10::VariableVersion(0));
  }
}

inline at::Tensor host_source(const at::Tensor& t) {
  if (t.device().is_cpu()) return t;
  return t.to(c10::kCPU);
}

inline void emit(const OffloadState& s, const std::string& name, double seconds,
                 const nlohmann::json& payload) {
  if (s.record_event) s.record_event(name, seconds, payload);
  if (s.settings.config.verbose) {
    // verbose: each setup phase as it happens, on stderr (Note [No iostreams]).
    std::fputs(fmt::format("ddo: {} {:.3f} s {}\n", name, seconds, payload.dump()).c_str(), stderr);
  }
}

// verbose: the planner's decisions, one line each.
inline void print_decisions(const OffloadState& s) {
  if (!s.settings.config.verbose) return;
  std::string out;
  for (const core::Decision& d : s.plan.decisions) {
    out += fmt::format("ddo: decision {}: {}\n", d.name, d.detail);
  }
  std::fputs(out.c_str(), stderr);
}

// Bytes per value of an SDNQ layer's dequantized weight on this offload's device (Note
// [Dequantized temporaries] in core/src/inventory.cpp): the kernel's result dtype, or the
// reference path's float32 intermediates.
std::int64_t sdnq_temporary_bytes_per_value(const OffloadState& s);

// Remembers a storage remove(keep_residents_on_device) left on the device, so the next attach of
// the model knows it from tensors the host put there itself (attach_plan.cpp).
void remember_kept_on_device(const at::Tensor& t);

// Carries the plan out (Note [Attach phases] in attach_plan.cpp); throws with the state's
// replaced tensors recorded, so OffloadState::restore(setup_failed) can put the model back.
void apply_plan(OffloadState& s, int pin_workers);

}  // namespace ddo::adapter::internal
