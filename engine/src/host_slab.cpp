#include "ddo/engine/host_slab.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#ifdef _WIN32
#include <malloc.h>  // _aligned_malloc
#else
#include <sys/mman.h>
#endif

#include "ddo/core/units.h"

namespace ddo::engine {

// Note [Exact-size slabs]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Streamed weights need one host copy each, readable by the copy engine at full speed. Pinning
// per tensor costs one cudaHostAlloc per weight (hundreds of slow driver calls), and a caching
// host allocator that rounds to powers of two can nearly double host RAM for a 24 GB model. So
// tensors are packed, in the caller's order, into a few slabs of at most max_slab_bytes each,
// each slab exactly the sum of its tensors plus the padding that puts every tensor on a
// kTensorAlignment boundary (no trailing padding, no rounding). A tensor larger than
// max_slab_bytes gets a slab of its own, of exactly its size. The host RAM peak is then the
// model bytes plus at most 255 bytes per tensor.
//
// Pinned slabs come from Device::allocate_host (cudaHostAlloc), or, with pin_by_register, from
// ordinary memory that fill() writes first and pin_registered() then registers
// (Device::register_host). Copies read either at the same speed, but setup does not: measured on
// the H200 machine (docs/design/0009-benchmarks.md, section 4), cudaHostAlloc runs at about 2.2
// GB/s because the driver faults and pins every page itself, while registering memory that is
// already paged in runs at 14.7 GB/s and a 16-thread fill of fresh memory is far faster than
// either. Registering before the fill makes the kernel fault the pages inside the call: 3.1 GB/s.
// So the register path allocates 2 MiB-aligned memory advised for transparent huge pages (fewer
// faults during the fill), fills it, and registers it afterwards, slabs in parallel. Until then its
// tensors report tensor_pinned() == false. When pinning a slab fails and fallback is allowed, that
// slab's tensors stay in (or are packed again into) ordinary memory: only slower to copy, never
// wrong; slabs that did pin stay pinned.
//
// Note [Balanced fill]
// ~~~~~~~~~~~~~~~~~~~~
// fill() splits the concatenation of all tensors into `workers` equal byte ranges, so one huge
// tensor is copied by several threads and many small ones do not leave threads idle. Each
// worker touches its destination pages first, spreading page-fault cost across threads too.

namespace {

constexpr std::size_t kTensorAlignment = 256;
constexpr std::size_t kPageBytes = 4096;
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

using core::align_up;  // the one definition (ddo/core/units.h)

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// kPendingRegister: ordinary memory that pin_registered() will register.
enum class SlabMemory { kHostAlloc, kRegistered, kPendingRegister, kOrdinary };

struct Slab {
  char* base = nullptr;
  std::size_t bytes = 0;
  SlabMemory memory = SlabMemory::kOrdinary;
  std::vector<std::size_t> tensors;  // indices into the tensor list, in slab order
};

// Packs `indices` in order into slabs of at most `max_slab_bytes`; fills offsets[i].
std::vector<Slab> pack(const std::vector<SlabTensor>& tensors,
                       const std::vector<std::size_t>& indices, std::size_t max_slab_bytes,
                       std::vector<std::size_t>* offsets) {
  std::vector<Slab> slabs;
  Slab current;
  for (std::size_t i : indices) {
    const std::size_t bytes = tensors[i].bytes;
    std::size_t offset = current.tensors.empty() ? 0 : align_up(current.bytes, kTensorAlignment);
    if (!current.tensors.empty() && offset + bytes > max_slab_bytes) {
      slabs.push_back(std::move(current));
      current = Slab{};
      offset = 0;
    }
    current.tensors.push_back(i);
    (*offsets)[i] = offset;
    current.bytes = offset + bytes;
  }
  if (!current.tensors.empty()) slabs.push_back(std::move(current));
  return slabs;
}

void* ordinary_alloc(std::size_t bytes, std::size_t alignment) {
#ifdef _WIN32
  return _aligned_malloc(std::max<std::size_t>(bytes, 1), alignment);  // no posix_memalign
#else
  void* ptr = nullptr;
  if (posix_memalign(&ptr, alignment, std::max<std::size_t>(bytes, 1)) != 0) return nullptr;
  return ptr;
#endif
}

// Frees what ordinary_alloc returned.
void ordinary_free(void* ptr) {
#ifdef _WIN32
  _aligned_free(ptr);
#else
  std::free(ptr);
#endif
}

// Memory for a slab that will be registered after the fill: huge-page aligned and advised, so
// the fill faults 2 MiB pages instead of 4 KiB ones where the kernel allows it.
void* register_ready_alloc(std::size_t bytes) {
  const std::size_t alignment = bytes >= kHugePageBytes ? kHugePageBytes : kPageBytes;
  void* ptr = ordinary_alloc(bytes, alignment);
#ifdef MADV_HUGEPAGE
  if (ptr != nullptr && bytes >= kHugePageBytes) {
    (void)madvise(ptr, bytes / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE);  // advice only
  }
#endif
  return ptr;
}

}  // namespace

struct HostSlabs::Impl {
  Device* device = nullptr;
  std::vector<SlabTensor> tensors;
  std::vector<std::size_t> slab_of;  // tensor -> index into slabs
  std::vector<char*> ptrs;           // tensor -> address
  std::vector<Slab> slabs;
  // Slab address ranges sorted by start, for contains().
  std::vector<std::pair<const char*, const char*>> ranges;
  HostSlabStats stats;
  bool allow_pin_fallback = true;

  ~Impl() {
    for (Slab& slab : slabs) {
      switch (slab.memory) {
        case SlabMemory::kHostAlloc:
          device->deallocate_host(slab.base);
          break;
        case SlabMemory::kRegistered:
          device->unregister_host(slab.base);
          ordinary_free(slab.base);
          break;
        case SlabMemory::kPendingRegister:
        case SlabMemory::kOrdinary:
          ordinary_free(slab.base);
          break;
      }
    }
  }

  // Tries to pin `slab`; on failure leaves it unallocated and returns the error.
  Status pin(Slab& slab, bool by_register) {
    if (!by_register) {
      void* ptr = nullptr;
      DDO_RETURN_IF_ERROR(device->allocate_host(slab.bytes, &ptr));
      slab.base = static_cast<char*>(ptr);
      slab.memory = SlabMemory::kHostAlloc;
      return {};
    }
    // Registered after fill() (see Note [Exact-size slabs]); whole pages, so page-aligned.
    void* ptr = register_ready_alloc(slab.bytes);
    if (ptr == nullptr) {
      return Status(Code::kResourceExhausted,
                    internal::str_cat("host allocation of ", slab.bytes, " bytes failed"));
    }
    slab.base = static_cast<char*>(ptr);
    slab.memory = SlabMemory::kPendingRegister;
    return {};
  }
  // create(): the pinned slabs; the tensors of a slab that fails to pin are appended to
  // *fallback (when the options allow it).
  Status make_pinned_slabs(const std::vector<std::size_t>& want_pinned,
                           const HostSlabOptions& options, bool by_register,
                           std::vector<std::size_t>* offsets, std::vector<std::size_t>* fallback) {
    for (Slab& slab : pack(tensors, want_pinned, options.max_slab_bytes, offsets)) {
      Status status = pin(slab, by_register);
      if (!status.ok()) {
        if (!options.allow_pin_fallback) {
          std::int64_t wanted = 0;
          for (std::size_t i : want_pinned) wanted += static_cast<std::int64_t>(tensors[i].bytes);
          return Status(
              Code::kResourceExhausted,
              internal::str_cat(
                  "pinning a host slab of ", slab.bytes, " bytes failed after ", stats.pinned_bytes,
                  " of ", wanted, " wanted bytes were pinned (", status.message(),
                  "); set allow_pin_memory_fallback (DDO_ALLOW_PIN_MEMORY_FALLBACK=1) "
                  "to place the rest in ordinary memory, or lower the pin budget "
                  "(DDO_PIN_WEIGHT_BUDGET_GB)"));
        }
        for (std::size_t i : slab.tensors) {
          fallback->push_back(i);
          stats.pin_fallback_bytes += static_cast<std::int64_t>(tensors[i].bytes);
        }
        continue;
      }
      if (slab.memory != SlabMemory::kPendingRegister) {
        for (std::size_t i : slab.tensors) {
          stats.pinned_bytes += static_cast<std::int64_t>(tensors[i].bytes);
        }
        ++stats.pinned_slabs;
      }
      stats.slab_bytes += static_cast<std::int64_t>(slab.bytes);
      slabs.push_back(std::move(slab));
    }
    return {};
  }

  // create(): the ordinary (pageable) slabs, in the caller's order so neighbours stay neighbours.
  Status make_ordinary_slabs(const std::vector<std::size_t>& ordinary,
                             const HostSlabOptions& options, std::vector<std::size_t>* offsets) {
    for (Slab& slab : pack(tensors, ordinary, options.max_slab_bytes, offsets)) {
      void* ptr = ordinary_alloc(slab.bytes, kTensorAlignment);
      if (ptr == nullptr) {
        return Status(Code::kResourceExhausted,
                      internal::str_cat("host allocation of a ", slab.bytes,
                                        "-byte slab failed "
                                        "with ",
                                        stats.slab_bytes,
                                        " bytes already in slabs; "
                                        "free host RAM or stream fewer weights"));
      }
      slab.base = static_cast<char*>(ptr);
      slab.memory = SlabMemory::kOrdinary;
      for (std::size_t i : slab.tensors) {
        stats.pageable_bytes += static_cast<std::int64_t>(tensors[i].bytes);
      }
      stats.slab_bytes += static_cast<std::int64_t>(slab.bytes);
      ++stats.pageable_slabs;
      slabs.push_back(std::move(slab));
    }
    return {};
  }
};

Status HostSlabs::create(Device& device, const std::vector<SlabTensor>& tensors,
                         const HostSlabOptions& options, std::unique_ptr<HostSlabs>* out) {
  out->reset();
  if (options.max_slab_bytes == 0) {
    return Status(Code::kInvalidArgument,
                  "HostSlabOptions::max_slab_bytes is 0; use a positive "
                  "size such as 1 GiB");
  }
  const bool by_register = options.pin_by_register && device.caps().host_register;
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<HostSlabs> slabs(new HostSlabs());
  slabs->impl_ = std::make_unique<Impl>();
  Impl& impl = *slabs->impl_;
  impl.device = &device;
  impl.tensors = tensors;
  impl.slab_of.assign(tensors.size(), 0);
  impl.ptrs.assign(tensors.size(), nullptr);
  std::vector<std::size_t> offsets(tensors.size(), 0);

  std::vector<std::size_t> want_pinned;
  std::vector<std::size_t> ordinary;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    (tensors[i].want_pinned ? want_pinned : ordinary).push_back(i);
  }

  // Pinned slabs first; the tensors of a slab that fails to pin join the ordinary list.
  std::vector<std::size_t> fallback;
  DDO_RETURN_IF_ERROR(
      impl.make_pinned_slabs(want_pinned, options, by_register, &offsets, &fallback));
  ordinary.insert(ordinary.end(), fallback.begin(), fallback.end());
  std::sort(ordinary.begin(), ordinary.end());
  DDO_RETURN_IF_ERROR(impl.make_ordinary_slabs(ordinary, options, &offsets));

  for (std::size_t s = 0; s < impl.slabs.size(); ++s) {
    const Slab& slab = impl.slabs[s];
    for (std::size_t i : slab.tensors) {
      impl.slab_of[i] = s;
      impl.ptrs[i] = slab.base + offsets[i];
    }
    impl.ranges.emplace_back(slab.base, slab.base + std::max<std::size_t>(slab.bytes, 1));
  }
  std::sort(impl.ranges.begin(), impl.ranges.end());
  impl.stats.alloc_seconds = seconds_since(start);
  impl.allow_pin_fallback = options.allow_pin_fallback;
  *out = std::move(slabs);
  return {};
}

HostSlabs::~HostSlabs() = default;

void HostSlabs::fill(const std::vector<const void*>& sources, int workers) {
  Impl& impl = *impl_;
  DDO_CHECK(sources.size() == impl.tensors.size(), Code::kInvalidArgument, "HostSlabs::fill got ",
            sources.size(), " sources for ", impl.tensors.size(), " tensors; pass one per tensor");
  const auto start = std::chrono::steady_clock::now();
  // begin[i]: where tensor i starts in the concatenation of all tensors. See Note [Balanced fill].
  std::vector<std::size_t> begin(impl.tensors.size() + 1, 0);
  for (std::size_t i = 0; i < impl.tensors.size(); ++i) {
    begin[i + 1] = begin[i] + impl.tensors[i].bytes;
  }
  const std::size_t total = begin.back();
  // Below a few MiB per thread, starting threads costs more than it saves.
  constexpr std::size_t kMinBytesPerWorker = std::size_t{4} << 20;
  const std::size_t max_workers = std::max<std::size_t>(1, total / kMinBytesPerWorker);
  const std::size_t n = std::min<std::size_t>(std::max(workers, 1), max_workers);

  auto copy_range = [&](std::size_t lo, std::size_t hi) {
    // The first tensor whose range ends after lo.
    std::size_t i = static_cast<std::size_t>(std::upper_bound(begin.begin(), begin.end(), lo) -
                                             begin.begin() - 1);
    for (; i < impl.tensors.size() && begin[i] < hi; ++i) {
      const std::size_t from = std::max(lo, begin[i]);
      const std::size_t to = std::min(hi, begin[i + 1]);
      if (to <= from) continue;
      DDO_CHECK(sources[i] != nullptr, Code::kInvalidArgument, "HostSlabs::fill: source ", i,
                " is null");
      std::memcpy(impl.ptrs[i] + (from - begin[i]),
                  static_cast<const char*>(sources[i]) + (from - begin[i]), to - from);
    }
  };

  if (n <= 1) {
    copy_range(0, total);
  } else {
    std::vector<std::thread> threads;
    threads.reserve(n - 1);
    std::vector<std::exception_ptr> errors(n);
    for (std::size_t w = 1; w < n; ++w) {
      threads.emplace_back([&, w] {
        try {
          copy_range(total * w / n, total * (w + 1) / n);
        } catch (...) {
          errors[w] = std::current_exception();  // rethrown on the caller below
        }
      });
    }
    try {
      copy_range(0, total / n);
    } catch (...) {
      errors[0] = std::current_exception();
    }
    for (std::thread& t : threads) t.join();
    for (const std::exception_ptr& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }
  impl.stats.fill_seconds += seconds_since(start);
}

Status HostSlabs::pin_registered(int workers) {
  Impl& impl = *impl_;
  std::vector<std::size_t> pending;
  for (std::size_t s = 0; s < impl.slabs.size(); ++s) {
    if (impl.slabs[s].memory == SlabMemory::kPendingRegister) pending.push_back(s);
  }
  if (pending.empty()) return {};
  const auto start = std::chrono::steady_clock::now();
  // One status per slab; threads take slabs in turn (registration of different ranges runs
  // concurrently in the driver and kernel).
  std::vector<Status> results(pending.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t k = next++; k < pending.size(); k = next++) {
      Slab& slab = impl.slabs[pending[k]];
      results[k] = impl.device->register_host(slab.base, slab.bytes);
    }
  };
  const std::size_t n = std::min<std::size_t>(std::max(workers, 1), pending.size());
  {
    std::vector<std::thread> threads;
    for (std::size_t w = 1; w < n; ++w) threads.emplace_back(work);
    work();
    for (std::thread& t : threads) t.join();
  }
  Status first_error;
  std::int64_t refused = 0;
  for (std::size_t k = 0; k < pending.size(); ++k) {
    Slab& slab = impl.slabs[pending[k]];
    std::int64_t bytes = 0;
    for (std::size_t i : slab.tensors) bytes += static_cast<std::int64_t>(impl.tensors[i].bytes);
    if (results[k].ok()) {
      slab.memory = SlabMemory::kRegistered;
      impl.stats.pinned_bytes += bytes;
      ++impl.stats.pinned_slabs;
      continue;
    }
    // The data is already in place; the slab simply stays ordinary memory.
    slab.memory = SlabMemory::kOrdinary;
    impl.stats.pageable_bytes += bytes;
    impl.stats.pin_fallback_bytes += bytes;
    ++impl.stats.pageable_slabs;
    refused += static_cast<std::int64_t>(slab.bytes);
    if (first_error.ok()) first_error = results[k];
  }
  impl.stats.register_seconds += seconds_since(start);
  if (!first_error.ok() && !impl.allow_pin_fallback) {
    return Status(Code::kResourceExhausted,
                  internal::str_cat("registering ", refused, " bytes of host slabs failed (",
                                    first_error.message(),
                                    "); set allow_pin_memory_fallback "
                                    "(DDO_ALLOW_PIN_MEMORY_FALLBACK=1) to keep them in ordinary "
                                    "memory, or lower the pin budget (DDO_PIN_WEIGHT_BUDGET_GB)"));
  }
  return {};
}

void* HostSlabs::tensor_ptr(std::size_t i) const {
  DDO_CHECK(i < impl_->ptrs.size(), Code::kInvalidArgument, "tensor index ", i,
            " is out of range; there are ", impl_->ptrs.size(), " tensors");
  return impl_->ptrs[i];
}

bool HostSlabs::tensor_pinned(std::size_t i) const {
  DDO_CHECK(i < impl_->ptrs.size(), Code::kInvalidArgument, "tensor index ", i,
            " is out of range; there are ", impl_->ptrs.size(), " tensors");
  const SlabMemory memory = impl_->slabs[impl_->slab_of[i]].memory;
  return memory == SlabMemory::kHostAlloc || memory == SlabMemory::kRegistered;
}

std::size_t HostSlabs::size() const {
  return impl_->tensors.size();
}

const HostSlabStats& HostSlabs::stats() const {
  return impl_->stats;
}

bool HostSlabs::contains(const void* ptr) const {
  const auto* p = static_cast<const char*>(ptr);
  const auto& ranges = impl_->ranges;
  // The last slab starting at or before p.
  auto it =
      std::upper_bound(ranges.begin(), ranges.end(), p,
                       [](const char* value, const auto& range) { return value < range.first; });
  if (it == ranges.begin()) return false;
  --it;
  return p < it->second;
}

}  // namespace ddo::engine
