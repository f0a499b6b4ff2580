// The CUDA backend record: "cuda:N", a GPU through LibTorch's caching allocator (engine's
// cuda_device.cpp below the seam). Its interception kernels serve the CUDA dispatch key: the
// input is a CUDA tensor and the managed weight a CPU tensor, so the union of their keys
// dispatches to CUDA. In a build without CUDA the record only plans (every slot null).
#include "backend.h"

#ifdef DDO_HAVE_CUDA
#include <map>
#include <mutex>
#include <utility>

#include <ATen/Context.h>
#include <ATen/ops/addmm_cuda_dispatch.h>
#include <ATen/ops/bmm_cuda_dispatch.h>
#include <ATen/ops/mm_cuda_dispatch.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ddo/core/config.h"
#include "ddo/core/units.h"
#include "ddo/torch/memory_probe.h"
#include "kernels.h"
#endif

namespace ddo::adapter::internal {

#ifdef DDO_HAVE_CUDA
namespace {

struct CudaKernels {
  static const Backend& backend() { return kCudaBackend; }
  static at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                          const c10::Scalar& beta, const c10::Scalar& alpha) {
    return at::cuda::addmm(self, mat1, mat2, beta, alpha);
  }
  static at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
    return at::cuda::mm(self, mat2);
  }
  static at::Tensor bmm(const at::Tensor& self, const at::Tensor& mat2) {
    return at::cuda::bmm(self, mat2);
  }
};

engine::Stream cuda_current_stream(c10::DeviceIndex index) {
  return static_cast<engine::Stream>(c10::cuda::getCurrentCUDAStream(index).stream());
}

std::shared_ptr<engine::Device> open_cuda(int index, const core::DynamicOffloadConfig& config) {
  DDO_CHECK(engine::cuda_available(), Code::kUnavailable, "execution_device \"",
            kCudaBackend.device_name(index),
            "\" needs a GPU, but CUDA reports none; use execution_device=\"sim\" to run on the "
            "host simulation");
  // raw_alloc asserts unless LibTorch's CUDA state exists; a host that has not touched CUDA
  // yet (no CUDA tensor made) would otherwise fail at the first staging allocation.
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  const std::int64_t cap = core::effective_card_bytes(0, config);  // 0: no cap
  const std::int64_t cap_before = vram_cap_bytes(index);
  if (cap > 0) throw_if_error(apply_vram_cap(index, cap));
  engine::CudaDeviceOptions o;
  o.index = index;
  o.cap_bytes = cap;
  // The pin-failure knob works on a real card too, so fallback is testable there.
  o.pinnable_bytes = config.sim_pinnable_gb < 0
                         ? -1
                         : core::to_bytes_or_throw(config.sim_pinnable_gb, core::ByteUnit::kGiB,
                                                   "sim_pinnable_gb");
  // Through LibTorch's caching allocator, so its statistics and the emulated cap see ddo's
  // staging and residents.
  o.alloc = [index](std::size_t bytes) -> void* {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
  };
  o.free = [index](void* ptr) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
    c10::cuda::CUDACachingAllocator::raw_delete(ptr);
  };
  std::unique_ptr<engine::Device> dev;
  throw_if_error(engine::make_cuda_device(o, &dev));
  if (cap <= 0) return std::shared_ptr<engine::Device>(std::move(dev));
  // The emulated card lasts as long as the devices that asked for it: when the last one goes
  // (the offload, every component of a pipeline), the process gets back the cap it had before
  // the first. Counted per GPU, since setup may open a device more than once.
  struct CapHolders {
    std::mutex mu;
    std::map<int, std::pair<int, std::int64_t>> by_index;  // index -> (holders, cap before)
  };
  static CapHolders* holders = new CapHolders();  // never destroyed: devices may outlive statics
  {
    std::lock_guard<std::mutex> lock(holders->mu);
    auto& [count, before] = holders->by_index[index];
    if (count++ == 0) before = cap_before;
  }
  return std::shared_ptr<engine::Device>(dev.release(), [index](engine::Device* d) {
    delete d;
    std::lock_guard<std::mutex> lock(holders->mu);
    auto& [count, before] = holders->by_index[index];
    if (--count > 0) return;
    try {
      (void)apply_vram_cap(index, before);
    } catch (...) {  // at process exit CUDA may already be gone; nothing is left to restore
    }
  });
}

Status make_cuda_probe(engine::Device& /*device*/, int index, std::unique_ptr<MemoryProbe>* out) {
  return make_cuda_memory_probe(index, out);
}

}  // namespace
#endif

// Without CUDA the slots stay null: the record plans for a GPU and opens none.
const Backend kCudaBackend{
    .kind = engine::DeviceKind::kCuda,
    .name = "cuda",
    .title = "CUDA",
    .inputs_on = "a CUDA device",
    .torch_type = c10::DeviceType::CUDA,
    .dispatch_key = c10::DispatchKey::CUDA,
    .memory_is_host = false,
    .sdnq_kernels = true,
#ifdef DDO_HAVE_CUDA
    .current_stream = &cuda_current_stream,
    .open = &open_cuda,
    .make_probe = &make_cuda_probe,
    .plan_total_bytes = nullptr,
    .register_kernels = &register_interception_kernels<CudaKernels>,
#endif
};

}  // namespace ddo::adapter::internal
