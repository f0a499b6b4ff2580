// The CUDA backend: the runtime API only, and the only file in ddo that includes it.
//
// Note [No device-wide synchronization]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Nothing here calls cudaDeviceSynchronize: ordering is expressed with events and stream waits,
// and the host blocks only in synchronize_event / synchronize_stream, which wait for one event
// or one stream. Streams are created with cudaStreamNonBlocking so they never serialize with the
// legacy default stream. The remaining implicit synchronizations are cudaFree / cudaFreeHost /
// cudaHostRegister, which run at setup and teardown only (the torch adapter supplies alloc/free
// hooks into LibTorch's caching allocator, which avoids even those for device memory).
//
// Note [CUDA errors]
// ~~~~~~~~~~~~~~~~~~
// Calls that return Status turn a CUDA error into a Status naming what was attempted and
// cudaGetErrorString. Calls whose signature returns nothing or a handle (streams, events, stream
// waits) throw ddo::Error(kInternal) instead: such a failure means the context is broken (a
// sticky error from an earlier kernel, an invalid handle) and silently continuing would compute
// with data that never arrived.
#include <cuda_runtime_api.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "ddo/engine/device.h"

namespace ddo::engine {
namespace {

std::string cuda_message(cudaError_t error, const std::string& what) {
  return internal::str_cat("CUDA error during ", what, ": ", cudaGetErrorString(error), " (",
                           cudaGetErrorName(error), ")");
}

Status cuda_status(cudaError_t error, Code code, const std::string& what) {
  if (error == cudaSuccess) return {};
  return Status(code, cuda_message(error, what));
}

void throw_on_cuda_error(cudaError_t error, const char* what) {
  if (error != cudaSuccess) throw Error(Code::kInternal, cuda_message(error, what));
}

cudaStream_t as_stream(Stream stream) {
  return static_cast<cudaStream_t>(stream);
}
cudaEvent_t as_event(Event event) {
  return static_cast<cudaEvent_t>(event);
}

class CudaDevice final : public Device {
 public:
  CudaDevice(const CudaDeviceOptions& options, std::string name)
      : options_(options), name_(std::move(name)) {}

  DeviceCaps caps() const override {
    DeviceCaps caps;
    caps.kind = DeviceKind::kCuda;
    caps.index = options_.index;
    caps.name = name_;
    caps.async_copy = true;
    caps.pinned_host = true;
    caps.host_register = true;
    caps.timing_events = true;
    return caps;
  }

  Status allocate(std::size_t bytes, void** out) override {
    *out = nullptr;
    DDO_RETURN_IF_ERROR(set_device("allocate"));
    if (options_.alloc) {
      void* ptr = nullptr;
      try {
        ptr = options_.alloc(bytes);
      } catch (const std::exception& e) {
        return Status(Code::kResourceExhausted,
                      internal::str_cat("device allocation of ", bytes,
                                        " bytes on cuda:", options_.index, " failed: ", e.what()));
      }
      if (ptr == nullptr && bytes > 0) {
        return Status(Code::kResourceExhausted,
                      internal::str_cat("device allocation of ", bytes, " bytes on cuda:",
                                        options_.index, " failed (the allocator returned null)"));
      }
      *out = ptr;
      return {};
    }
    void* ptr = nullptr;
    const cudaError_t error = cudaMalloc(&ptr, bytes);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();  // an allocation failure is not sticky; clear it
      return Status(Code::kResourceExhausted,
                    cuda_message(error, internal::str_cat("cudaMalloc of ", bytes,
                                                          " bytes on cuda:", options_.index)));
    }
    *out = ptr;
    return {};
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    if (options_.free) {
      options_.free(ptr);
      return;
    }
    throw_on_cuda_error(cudaSetDevice(options_.index), "cudaSetDevice before cudaFree");
    throw_on_cuda_error(cudaFree(ptr), "cudaFree");
  }

  Status allocate_host(std::size_t bytes, void** out) override {
    *out = nullptr;
    DDO_RETURN_IF_ERROR(set_device("allocate_host"));
    DDO_RETURN_IF_ERROR(reserve_pinned(bytes, "cudaHostAlloc"));
    void* ptr = nullptr;
    const cudaError_t error = cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      unreserve_pinned(bytes);
      return Status(
          Code::kResourceExhausted,
          cuda_message(error, internal::str_cat("cudaHostAlloc of ", bytes, " pinned bytes")));
    }
    note_pinned(ptr, bytes);
    *out = ptr;
    return {};
  }

  void deallocate_host(void* ptr) override {
    if (ptr == nullptr) return;
    forget_pinned(ptr);
    throw_on_cuda_error(cudaFreeHost(ptr), "cudaFreeHost");
  }

  Status register_host(void* ptr, std::size_t bytes) override {
    DDO_RETURN_IF_ERROR(set_device("register_host"));
    DDO_RETURN_IF_ERROR(reserve_pinned(bytes, "cudaHostRegister"));
    const cudaError_t error = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      unreserve_pinned(bytes);
      return Status(
          Code::kResourceExhausted,
          cuda_message(error, internal::str_cat("cudaHostRegister of ", bytes, " bytes")));
    }
    note_pinned(ptr, bytes);
    return {};
  }

  void unregister_host(void* ptr) override {
    forget_pinned(ptr);
    throw_on_cuda_error(cudaHostUnregister(ptr), "cudaHostUnregister");
  }

  Stream create_stream() override {
    throw_on_cuda_error(cudaSetDevice(options_.index), "cudaSetDevice before creating a stream");
    cudaStream_t stream = nullptr;
    throw_on_cuda_error(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                        "cudaStreamCreateWithFlags");
    return stream;
  }

  void destroy_stream(Stream stream) override {
    if (stream == kDefaultStream) return;
    throw_on_cuda_error(cudaStreamDestroy(as_stream(stream)), "cudaStreamDestroy");
  }

  Event create_event(bool timing) override {
    throw_on_cuda_error(cudaSetDevice(options_.index), "cudaSetDevice before creating an event");
    cudaEvent_t event = nullptr;
    throw_on_cuda_error(
        cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming),
        "cudaEventCreateWithFlags");
    return event;
  }

  void destroy_event(Event event) override {
    if (event == nullptr) return;
    throw_on_cuda_error(cudaEventDestroy(as_event(event)), "cudaEventDestroy");
  }

  // Hot path: streams carry their device, so no cudaSetDevice here.
  Status copy_to_device_async(void* dst, const void* src, std::size_t bytes,
                              Stream stream) override {
    return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, as_stream(stream)),
                       Code::kInternal,
                       internal::str_cat("cudaMemcpyAsync host-to-device of ", bytes, " bytes"));
  }

  Status copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    DDO_RETURN_IF_ERROR(set_device("copy_to_host"));
    return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), Code::kInternal,
                       internal::str_cat("cudaMemcpy device-to-host of ", bytes, " bytes"));
  }

  Status copy_on_device_async(void* dst, const void* src, std::size_t bytes,
                              Stream stream) override {
    return cuda_status(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)),
        Code::kInternal,
        internal::str_cat("cudaMemcpyAsync device-to-device of ", bytes, " bytes"));
  }

  void record_event(Event event, Stream stream) override {
    throw_on_cuda_error(cudaEventRecord(as_event(event), as_stream(stream)), "cudaEventRecord");
  }

  void stream_wait_event(Stream stream, Event event) override {
    throw_on_cuda_error(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0),
                        "cudaStreamWaitEvent");
  }

  void synchronize_event(Event event) override {
    throw_on_cuda_error(cudaEventSynchronize(as_event(event)), "cudaEventSynchronize");
  }

  bool event_done(Event event) override {
    const cudaError_t error = cudaEventQuery(as_event(event));
    if (error == cudaErrorNotReady) return false;
    throw_on_cuda_error(error, "cudaEventQuery");
    return true;
  }

  float elapsed_ms(Event start, Event end) override {
    float ms = 0.0f;
    const cudaError_t error = cudaEventElapsedTime(&ms, as_event(start), as_event(end));
    if (error == cudaErrorNotReady || error == cudaErrorInvalidResourceHandle) {
      (void)cudaGetLastError();
      return -1.0f;  // not complete yet, or not a timing event: see device.h
    }
    throw_on_cuda_error(error, "cudaEventElapsedTime");
    return ms;
  }

  void synchronize_stream(Stream stream) override {
    throw_on_cuda_error(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
  }

  DeviceMemory memory() override {
    throw_on_cuda_error(cudaSetDevice(options_.index), "cudaSetDevice before cudaMemGetInfo");
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    throw_on_cuda_error(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    DeviceMemory memory;
    memory.used_bytes = static_cast<std::int64_t>(total_bytes - free_bytes);
    memory.total_bytes =
        options_.cap_bytes > 0 ? options_.cap_bytes : static_cast<std::int64_t>(total_bytes);
    return memory;
  }

 private:
  // Pinned-byte accounting for CudaDeviceOptions::pinnable_bytes (setup and teardown only, never
  // on the hot path; registration may run on several threads, hence the mutex).
  Status reserve_pinned(std::size_t bytes, const char* what) {
    if (options_.pinnable_bytes < 0) return {};
    std::lock_guard<std::mutex> lock(pin_mu_);
    const auto n = static_cast<std::int64_t>(bytes);
    if (pinned_bytes_ + n > options_.pinnable_bytes) {
      return Status(Code::kResourceExhausted,
                    internal::str_cat(what, " of ", bytes, " bytes refused: ", pinned_bytes_,
                                      " of the ", options_.pinnable_bytes,
                                      " pinnable bytes (CudaDeviceOptions::pinnable_bytes) are "
                                      "already pinned"));
    }
    pinned_bytes_ += n;
    return {};
  }
  void unreserve_pinned(std::size_t bytes) {
    if (options_.pinnable_bytes < 0) return;
    std::lock_guard<std::mutex> lock(pin_mu_);
    pinned_bytes_ -= static_cast<std::int64_t>(bytes);
  }
  void note_pinned(void* ptr, std::size_t bytes) {
    if (options_.pinnable_bytes < 0) return;
    std::lock_guard<std::mutex> lock(pin_mu_);
    pinned_sizes_[ptr] = bytes;
  }
  void forget_pinned(void* ptr) {
    if (options_.pinnable_bytes < 0) return;
    std::lock_guard<std::mutex> lock(pin_mu_);
    auto it = pinned_sizes_.find(ptr);
    if (it == pinned_sizes_.end()) return;
    pinned_bytes_ -= static_cast<std::int64_t>(it->second);
    pinned_sizes_.erase(it);
  }

  std::mutex pin_mu_;
  std::int64_t pinned_bytes_ = 0;                        // guarded by pin_mu_
  std::unordered_map<void*, std::size_t> pinned_sizes_;  // guarded by pin_mu_
  Status set_device(const char* what) {
    return cuda_status(cudaSetDevice(options_.index), Code::kInternal,
                       internal::str_cat("cudaSetDevice(", options_.index, ") before ", what));
  }

  const CudaDeviceOptions options_;
  const std::string name_;
};

}  // namespace

bool cuda_available() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
}

Status make_cuda_device(const CudaDeviceOptions& options, std::unique_ptr<Device>* out) {
  out->reset();
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return Status(Code::kUnavailable,
                  error != cudaSuccess
                      ? cuda_message(error, "cudaGetDeviceCount (is a GPU and its driver present?)")
                      : std::string("no CUDA device is present; use the simulation backend or a "
                                    "machine with a GPU"));
  }
  if (options.index < 0 || options.index >= count) {
    return Status(Code::kInvalidArgument,
                  internal::str_cat("cuda:", options.index, " does not exist; this machine has ",
                                    count, " CUDA device(s), use an index in [0, ", count, ")"));
  }
  if (static_cast<bool>(options.alloc) != static_cast<bool>(options.free)) {
    return Status(Code::kInvalidArgument, "CudaDeviceOptions: set both alloc and free, or neither");
  }
  cudaDeviceProp props{};
  DDO_RETURN_IF_ERROR(
      cuda_status(cudaGetDeviceProperties(&props, options.index), Code::kUnavailable,
                  internal::str_cat("cudaGetDeviceProperties(", options.index, ")")));
  *out = std::make_unique<CudaDevice>(options, std::string(props.name));
  return {};
}

}  // namespace ddo::engine
