/// \file
/// HostSlabs: one copy of every streamed weight, packed into a few exact-size host slabs.
///
/// Pinned memory is expensive to allocate per tensor and wasteful when rounded to powers of two
/// (see Note [Exact-size slabs] in host_slab.cpp). The planner decides which tensors are pinned;
/// HostSlabs packs the pinned ones into pinned slabs (each at most `max_slab_bytes`, sized to the
/// exact sum of its tensors plus 256-byte alignment) and the rest into ordinary slabs. When pinning
/// fails and `allow_pin_fallback` is set, the failed slab's tensors move to ordinary memory and the
/// fallback is recorded; otherwise create() fails with the sizes that were refused.
///
/// ```
/// HostSlabOptions opts;
/// opts.max_slab_bytes = 1 << 30;
/// std::unique_ptr<HostSlabs> slabs;
/// DDO_RETURN_IF_ERROR(HostSlabs::create(device, {{bytes0, true}, {bytes1, false}}, opts,
/// &slabs));
/// slabs->fill({src0, src1}, /*workers=*/4);   // parallel memcpy into the slabs
/// DDO_RETURN_IF_ERROR(slabs->pin_registered(4));  // only with pin_by_register
/// const void* w0 = slabs->tensor_ptr(0);
/// ```
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ddo/core/status.h"
#include "ddo/engine/device.h"

namespace ddo::engine {

/// One tensor to place: its size and whether the planner wants it pinned.
struct SlabTensor {
  std::size_t bytes = 0;     ///< the tensor's bytes
  bool want_pinned = false;  ///< the planner chose to pin it
};

/// How HostSlabs packs and pins.
struct HostSlabOptions {
  /// Largest slab; a larger tensor gets a slab of exactly its size.
  std::size_t max_slab_bytes = std::size_t{1} << 30;
  bool allow_pin_fallback = true;  ///< a slab that cannot be pinned becomes ordinary memory
  /// Pin by registering ordinary memory after it is filled (Device::register_host, in
  /// pin_registered()) instead of Device::allocate_host; used only when caps().host_register.
  /// Several times faster on CUDA; see Note [Exact-size slabs] for the measurements.
  bool pin_by_register = false;
};

/// What create(), fill() and pin_registered() did.
struct HostSlabStats {
  std::int64_t pinned_bytes = 0;        ///< tensor bytes placed in pinned slabs
  std::int64_t pageable_bytes = 0;      ///< tensor bytes placed in ordinary slabs
  std::int64_t slab_bytes = 0;          ///< bytes allocated for slabs (tensors + alignment)
  std::int64_t pin_fallback_bytes = 0;  ///< wanted pinned, placed in ordinary memory
  int pinned_slabs = 0;                 ///< COUNT
  int pageable_slabs = 0;               ///< COUNT
  double alloc_seconds = 0.0;     ///< allocating (and pinning, without pin_by_register) the slabs
  double fill_seconds = 0.0;      ///< copying the tensors in
  double register_seconds = 0.0;  ///< pin_registered()
};

/// The slabs holding one host copy of every streamed tensor; see the file comment.
class HostSlabs {
 public:
  /// Lays out `tensors` in slabs and allocates them; see the file comment for pinning and fallback.
  static Status create(Device& device, const std::vector<SlabTensor>& tensors,
                       const HostSlabOptions& options, std::unique_ptr<HostSlabs>* out);
  ~HostSlabs();
  HostSlabs(const HostSlabs&) = delete;
  HostSlabs& operator=(const HostSlabs&) = delete;

  /// Copies sources[i] (tensors[i].bytes each) into the slabs with `workers` threads.
  void fill(const std::vector<const void*>& sources, int workers);

  /// With pin_by_register: registers the slabs waiting for it, `workers` at a time. Call after
  /// the data is in place. A slab that cannot be pinned stays ordinary memory when fallback is
  /// allowed (recorded in stats()); otherwise the error names the sizes and the option. Until
  /// then (or without pin_by_register) it does nothing and tensor_pinned() reports false.
  Status pin_registered(int workers);

  void* tensor_ptr(std::size_t i) const;    ///< where tensors[i] lives
  bool tensor_pinned(std::size_t i) const;  ///< whether that memory is pinned
  std::size_t size() const;                 ///< number of tensors
  const HostSlabStats& stats() const;       ///< see HostSlabStats

  /// True when `ptr` lies inside one of these slabs (used to recognise managed storage).
  bool contains(const void* ptr) const;

 private:
  HostSlabs() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddo::engine
