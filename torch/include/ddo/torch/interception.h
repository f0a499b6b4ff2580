/// \file
/// Interception: how ddo diverts weight ops to staged copies (public queries and test hooks).
///
/// While at least one offload is active, ddo has kernels registered for aten::addmm, aten::mm,
/// aten::bmm, aten::convolution, aten::_convolution (what traced TorchScript models call) and
/// aten::embedding on the CPU key (execution on the "sim" device) and, in CUDA builds, on the
/// CUDA key. A kernel whose arguments are not managed calls the original kernel directly; a
/// managed weight (a CPU tensor whose storage is a ddo host slab) is staged on the execution
/// device first. The registrations are made by the first enable_offload and removed with the last
/// offload, so a process without an active offload runs stock LibTorch. See
/// docs/design/0001-interception.md.
///
/// ```
/// auto offload = ddo::adapter::enable_offload(model, opts);
/// ddo::adapter::interception_active();          // true
/// ddo::adapter::is_managed(linear->weight);     // true when the weight is streamed
/// offload.reset();
/// ddo::adapter::interception_active();          // false
/// ```
#pragma once

#include <ATen/core/Tensor.h>

namespace ddo::adapter {

/// True when `t` (or the storage it views) is a streamed weight managed by an active offload.
bool is_managed(const at::Tensor& t);

/// True while ddo's kernels are registered (some offload is alive).
bool interception_active();

namespace testing {
/// Called with every staged view handed to an original kernel and its unit id; null turns it
/// off. For tests: lets them check where the weight an op reads lives.
using StageObserver = void (*)(const at::Tensor& staged, int unit);
/// Installs `observer` for every offload in the process (tests only).
void set_stage_observer(StageObserver observer);
}  // namespace testing

}  // namespace ddo::adapter
