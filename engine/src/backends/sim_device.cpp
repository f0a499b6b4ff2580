// The host-simulation backend: a capacity-limited host arena standing in for device memory, one
// worker thread per stream standing in for the copy engine. See Note [Simulated streams].
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#ifdef _WIN32
#include <malloc.h>  // _aligned_malloc
#endif

#include "ddo/core/units.h"
#include "ddo/engine/device.h"
#include "ddo/engine/sim_faults.h"

namespace ddo::engine {
namespace {

// Note [Simulated streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Each stream from create_stream() is a FIFO queue drained by one worker thread, so commands on
// one stream run in order and commands on different streams overlap, as on a GPU. The default
// stream (kDefaultStream) is the calling thread: work on it runs synchronously, and
// stream_wait_event on it blocks the caller until the event completes (the "device" the caller
// drives is the caller itself).
//
// Events follow CUDA's rules so the scheduler sees the same semantics on both backends:
//   * record_event captures a generation; the event is done once the stream reaches that record.
//   * Recording again resets the event: event_done is false until the newest record completes.
//   * stream_wait_event waits for the generation current at the call, not for later records.
//   * An event never recorded counts as done.
// An event's state is shared with the commands that reference it, so destroying an event with a
// record still queued (legal in CUDA) is safe here too.

using Clock = std::chrono::steady_clock;

constexpr std::size_t kDeviceAlignment = 64;
// Pinned host memory from the driver is page-aligned; callers may rely on it.
constexpr std::size_t kHostAlignment = 4096;

using core::align_up;  // the one definition (ddo/core/units.h); both alignments are powers of two

void* aligned_host_alloc(std::size_t bytes, std::size_t alignment) {
  // aligned_alloc needs a size that is a multiple of the alignment; zero-byte requests still get
  // a unique address so deallocate() can find them.
  const std::size_t size = align_up(std::max<std::size_t>(bytes, 1), alignment);
#ifdef _WIN32
  return _aligned_malloc(size, alignment);  // the C runtime of Windows has no aligned_alloc
#else
  return std::aligned_alloc(alignment, size);
#endif
}

void aligned_host_free(void* ptr) {
#ifdef _WIN32
  _aligned_free(ptr);
#else
  std::free(ptr);
#endif
}

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t recorded = 0;   // guarded by mu: generation of the newest record
  std::uint64_t completed = 0;  // guarded by mu: newest generation the stream has reached
  Clock::time_point time;       // guarded by mu: when `completed` was reached
  bool timing = false;          // immutable

  void complete(std::uint64_t generation) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (generation > completed) {
        completed = generation;
        time = Clock::now();
      }
    }
    cv.notify_all();
  }
  void wait_for(std::uint64_t generation) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return completed >= generation; });
  }
};

struct SimEvent {
  std::shared_ptr<EventState> state;
};

struct Command {
  enum class Kind { kCopy, kRecord, kWait };
  Kind kind = Kind::kCopy;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  std::shared_ptr<EventState> event;
  std::uint64_t generation = 0;
};

class SimDevice;

class SimStream {
 public:
  explicit SimStream(const SimDevice* device) : device_(device), worker_([this] { run(); }) {}
  ~SimStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();  // the worker drains the queue before it exits
  }

  void submit(Command command) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(command));
      ++submitted_;
    }
    cv_.notify_all();
  }

  void synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    const std::uint64_t target = submitted_;
    idle_cv_.wait(lock, [&] { return finished_ >= target; });
  }

 private:
  void run();

  const SimDevice* device_;
  std::mutex mu_;
  std::condition_variable cv_;       // work arrived or stop
  std::condition_variable idle_cv_;  // a command finished
  std::deque<Command> queue_;        // guarded by mu_
  std::uint64_t submitted_ = 0;      // guarded by mu_
  std::uint64_t finished_ = 0;       // guarded by mu_
  bool stop_ = false;                // guarded by mu_
  std::thread worker_;               // last: starts once the fields above exist
};

class SimDevice final : public Device {
 public:
  SimDevice(const SimDeviceOptions& options, std::shared_ptr<SimFaults> faults)
      : options_(options), faults_(std::move(faults)) {}

  ~SimDevice() override {
    for (auto& [ptr, bytes] : device_allocs_) aligned_host_free(ptr);
    for (auto& [ptr, bytes] : host_allocs_) aligned_host_free(ptr);
  }

  DeviceCaps caps() const override {
    DeviceCaps caps;
    caps.kind = DeviceKind::kSim;
    caps.index = options_.index;
    caps.name = "ddo-sim";
    caps.async_copy = true;
    caps.pinned_host = true;
    caps.host_register = true;
    caps.timing_events = true;
    return caps;
  }

  Status allocate(std::size_t bytes, void** out) override {
    *out = nullptr;
    DDO_RETURN_IF_ERROR(inject(SimFault::kAllocate, Code::kResourceExhausted, "allocate", bytes));
    std::lock_guard<std::mutex> lock(mu_);
    const auto requested = static_cast<std::int64_t>(bytes);
    if (used_bytes_ + requested > options_.capacity_bytes) {
      return Status(
          Code::kResourceExhausted,
          internal::str_cat("simulated device ", options_.index, " is full: requested ", requested,
                            " bytes with ", used_bytes_, " of ", options_.capacity_bytes,
                            " bytes in use; raise SimDeviceOptions::capacity_bytes or "
                            "free memory first"));
    }
    void* ptr = aligned_host_alloc(bytes, kDeviceAlignment);
    if (ptr == nullptr) {
      return Status(Code::kResourceExhausted,
                    internal::str_cat("simulated device ", options_.index,
                                      ": the host could not "
                                      "provide ",
                                      requested, " bytes for the device arena"));
    }
    device_allocs_.emplace(ptr, bytes);
    used_bytes_ += requested;
    *out = ptr;
    return {};
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = device_allocs_.find(ptr);
    DDO_ASSERT(it != device_allocs_.end(),
               "deallocate of a pointer the simulated device did not "
               "allocate");
    used_bytes_ -= static_cast<std::int64_t>(it->second);
    aligned_host_free(it->first);
    device_allocs_.erase(it);
  }

  Status allocate_host(std::size_t bytes, void** out) override {
    *out = nullptr;
    DDO_RETURN_IF_ERROR(inject(SimFault::kPin, Code::kResourceExhausted, "allocate_host", bytes));
    std::lock_guard<std::mutex> lock(mu_);
    DDO_RETURN_IF_ERROR(reserve_pinned_locked(bytes, "allocate_host"));
    void* ptr = aligned_host_alloc(bytes, kHostAlignment);
    if (ptr == nullptr) {
      pinned_bytes_ -= static_cast<std::int64_t>(bytes);
      return Status(Code::kResourceExhausted,
                    internal::str_cat("simulated pinned allocation of ", bytes, " bytes failed"));
    }
    host_allocs_.emplace(ptr, bytes);
    *out = ptr;
    return {};
  }

  void deallocate_host(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = host_allocs_.find(ptr);
    DDO_ASSERT(it != host_allocs_.end(),
               "deallocate_host of a pointer allocate_host did not "
               "return");
    pinned_bytes_ -= static_cast<std::int64_t>(it->second);
    aligned_host_free(it->first);
    host_allocs_.erase(it);
  }

  Status register_host(void* ptr, std::size_t bytes) override {
    DDO_RETURN_IF_ERROR(inject(SimFault::kPin, Code::kResourceExhausted, "register_host", bytes));
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_.count(ptr) != 0) {
      return Status(Code::kInvalidArgument, "register_host: this address is already registered");
    }
    DDO_RETURN_IF_ERROR(reserve_pinned_locked(bytes, "register_host"));
    registered_.emplace(ptr, bytes);
    return {};
  }

  void unregister_host(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = registered_.find(ptr);
    DDO_ASSERT(it != registered_.end(), "unregister_host of an address that is not registered");
    pinned_bytes_ -= static_cast<std::int64_t>(it->second);
    registered_.erase(it);
  }

  Stream create_stream() override { return new SimStream(this); }

  void destroy_stream(Stream stream) override {
    if (stream == kDefaultStream) return;
    delete static_cast<SimStream*>(stream);  // drains first
  }

  Event create_event(bool timing) override {
    auto* event = new SimEvent{std::make_shared<EventState>()};
    event->state->timing = timing;
    return event;
  }

  void destroy_event(Event event) override { delete static_cast<SimEvent*>(event); }

  Status copy_to_device_async(void* dst, const void* src, std::size_t bytes,
                              Stream stream) override {
    DDO_RETURN_IF_ERROR(inject(SimFault::kCopy, Code::kUnavailable, "copy_to_device_async", bytes));
    return submit_copy(dst, src, bytes, stream);
  }

  Status copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    DDO_RETURN_IF_ERROR(inject(SimFault::kCopy, Code::kUnavailable, "copy_to_host", bytes));
    copy_now(dst, src, bytes);
    return {};
  }

  Status copy_on_device_async(void* dst, const void* src, std::size_t bytes,
                              Stream stream) override {
    DDO_RETURN_IF_ERROR(inject(SimFault::kCopy, Code::kUnavailable, "copy_on_device_async", bytes));
    return submit_copy(dst, src, bytes, stream);
  }

  void record_event(Event event, Stream stream) override {
    const std::shared_ptr<EventState>& state = static_cast<SimEvent*>(event)->state;
    std::uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      generation = ++state->recorded;
    }
    if (stream == kDefaultStream) {
      state->complete(generation);
      return;
    }
    Command command;
    command.kind = Command::Kind::kRecord;
    command.event = state;
    command.generation = generation;
    static_cast<SimStream*>(stream)->submit(std::move(command));
  }

  void stream_wait_event(Stream stream, Event event) override {
    const std::shared_ptr<EventState>& state = static_cast<SimEvent*>(event)->state;
    std::uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      generation = state->recorded;
    }
    if (stream == kDefaultStream) {
      state->wait_for(generation);
      return;
    }
    Command command;
    command.kind = Command::Kind::kWait;
    command.event = state;
    command.generation = generation;
    static_cast<SimStream*>(stream)->submit(std::move(command));
  }

  void synchronize_event(Event event) override {
    EventState& state = *static_cast<SimEvent*>(event)->state;
    std::unique_lock<std::mutex> lock(state.mu);
    const std::uint64_t generation = state.recorded;
    state.cv.wait(lock, [&] { return state.completed >= generation; });
  }

  bool event_done(Event event) override {
    EventState& state = *static_cast<SimEvent*>(event)->state;
    std::lock_guard<std::mutex> lock(state.mu);
    return state.completed >= state.recorded;
  }

  float elapsed_ms(Event start, Event end) override {
    EventState& a = *static_cast<SimEvent*>(start)->state;
    EventState& b = *static_cast<SimEvent*>(end)->state;
    Clock::time_point ta, tb;
    {
      std::lock_guard<std::mutex> lock(a.mu);
      if (!a.timing || a.recorded == 0 || a.completed < a.recorded) return -1.0f;
      ta = a.time;
    }
    {
      std::lock_guard<std::mutex> lock(b.mu);
      if (!b.timing || b.recorded == 0 || b.completed < b.recorded) return -1.0f;
      tb = b.time;
    }
    return std::chrono::duration<float, std::milli>(tb - ta).count();
  }

  void synchronize_stream(Stream stream) override {
    if (stream == kDefaultStream) return;  // synchronous already
    static_cast<SimStream*>(stream)->synchronize();
  }

  DeviceMemory memory() override {
    std::lock_guard<std::mutex> lock(mu_);
    return DeviceMemory{options_.capacity_bytes, used_bytes_};
  }

  // For stream workers: see SimFaults::hold_stream_copies.
  void wait_while_stream_copies_held() const {
    if (faults_) faults_->wait_while_stream_copies_held();
  }

  // Runs on the caller (default stream) or a stream worker; throttled to the simulated link.
  void copy_now(void* dst, const void* src, std::size_t bytes) const {
    const Clock::time_point start = Clock::now();
    if (bytes > 0) std::memcpy(dst, src, bytes);
    if (options_.copy_bytes_per_second > 0.0) {
      const std::chrono::duration<double> duration(static_cast<double>(bytes) /
                                                   options_.copy_bytes_per_second);
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(duration));
    }
  }

 private:
  // See sim_faults.h: a chosen call fails before it has any effect.
  Status inject(SimFault kind, Code code, const char* call, std::size_t bytes) {
    if (!faults_) return {};
    return faults_->check(kind, code,
                          internal::str_cat("simulated device ", options_.index, ": ", call, " of ",
                                            bytes, " bytes failed"));
  }

  Status submit_copy(void* dst, const void* src, std::size_t bytes, Stream stream) {
    if (bytes > 0 && (dst == nullptr || src == nullptr)) {
      return Status(Code::kInvalidArgument,
                    internal::str_cat("copy of ", bytes, " bytes with a null address"));
    }
    if (stream == kDefaultStream) {
      copy_now(dst, src, bytes);
      return {};
    }
    Command command;
    command.kind = Command::Kind::kCopy;
    command.dst = dst;
    command.src = src;
    command.bytes = bytes;
    static_cast<SimStream*>(stream)->submit(std::move(command));
    return {};
  }

  Status reserve_pinned_locked(std::size_t bytes, const char* what) {
    const auto requested = static_cast<std::int64_t>(bytes);
    if (options_.pinnable_bytes >= 0 && pinned_bytes_ + requested > options_.pinnable_bytes) {
      return Status(Code::kResourceExhausted,
                    internal::str_cat(what, " of ", requested, " bytes refused: ", pinned_bytes_,
                                      " of ", options_.pinnable_bytes,
                                      " pinnable bytes already pinned (simulated pin limit)"));
    }
    pinned_bytes_ += requested;
    return {};
  }

  const SimDeviceOptions options_;
  const std::shared_ptr<SimFaults> faults_;  // null: no injected failures
  std::mutex mu_;
  std::int64_t used_bytes_ = 0;                           // guarded by mu_
  std::int64_t pinned_bytes_ = 0;                         // guarded by mu_
  std::unordered_map<void*, std::size_t> device_allocs_;  // guarded by mu_
  std::unordered_map<void*, std::size_t> host_allocs_;    // guarded by mu_
  std::unordered_map<void*, std::size_t> registered_;     // guarded by mu_
};

void SimStream::run() {
  for (;;) {
    Command command;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop requested and drained
      command = std::move(queue_.front());
      queue_.pop_front();
    }
    switch (command.kind) {
      case Command::Kind::kCopy:
        device_->wait_while_stream_copies_held();
        device_->copy_now(command.dst, command.src, command.bytes);
        break;
      case Command::Kind::kRecord:
        command.event->complete(command.generation);
        break;
      case Command::Kind::kWait:
        command.event->wait_for(command.generation);
        break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++finished_;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace

void SimFaults::fail_nth(SimFault kind, std::int64_t nth, std::int64_t count) {
  DDO_ASSERT(nth >= 1 && count >= 1, "SimFaults::fail_nth(", static_cast<int>(kind), ", ", nth,
             ", ", count, "): nth and count start at 1");
  const auto k = static_cast<std::size_t>(kind);
  std::lock_guard<std::mutex> lock(mu_);
  first_[k] = calls_[k] + nth;
  last_[k] = first_[k] + count - 1;
}

void SimFaults::clear(SimFault kind) {
  const auto k = static_cast<std::size_t>(kind);
  std::lock_guard<std::mutex> lock(mu_);
  first_[k] = last_[k] = 0;
}

std::int64_t SimFaults::calls(SimFault kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_[static_cast<std::size_t>(kind)];
}

std::int64_t SimFaults::injected(SimFault kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  return injected_[static_cast<std::size_t>(kind)];
}

Status SimFaults::check(SimFault kind, Code code, std::string_view what) {
  static constexpr const char* kNames[kKinds] = {"allocate", "pin", "copy"};
  const auto k = static_cast<std::size_t>(kind);
  std::lock_guard<std::mutex> lock(mu_);
  const std::int64_t call = ++calls_[k];
  if (first_[k] == 0 || call < first_[k] || call > last_[k]) return {};
  ++injected_[k];
  return Status(code,
                internal::str_cat(what, " (injected fault: ", kNames[k], " call ", call, ")"));
}

void SimFaults::hold_stream_copies() {
  std::lock_guard<std::mutex> lock(mu_);
  hold_copies_ = true;
}

void SimFaults::release_stream_copies() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    hold_copies_ = false;
  }
  released_.notify_all();
}

void SimFaults::wait_while_stream_copies_held() {
  std::unique_lock<std::mutex> lock(mu_);
  released_.wait(lock, [&] { return !hold_copies_; });
}

std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options) {
  return std::make_unique<SimDevice>(options, nullptr);
}

std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options,
                                        std::shared_ptr<SimFaults> faults) {
  return std::make_unique<SimDevice>(options, std::move(faults));
}

}  // namespace ddo::engine
