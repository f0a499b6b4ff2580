// The caches behind ddo/torch/weight_cache.h, as the attach (attach_plan.cpp) uses them (internal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ddo/core/planner.h"
#include "ddo/engine/host_slab.h"
#include "ddo/torch/module_tree.h"

namespace ddo::adapter::internal {

// One streamed weight inside a cached entry's slabs.
struct CachedTensor {
  std::string name;  // "module.tensor"
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::size_t unit = 0;           // slab tensor (stream unit) index
  std::size_t offset = 0;         // byte offset inside the unit
  std::size_t span = 0;           // bytes
  std::uint64_t fingerprint = 0;  // sample_fingerprint() at remove()
  std::weak_ptr<void> lease;      // alive while a host view of this region exists
};

// The slabs of one removed offload. `slabs` keeps the device that pinned them alive.
struct CachedWeights {
  std::string ns;
  std::string key;
  std::shared_ptr<engine::HostSlabs> slabs;
  std::vector<std::size_t> unit_bytes;
  std::vector<CachedTensor> tensors;
  std::int64_t bytes = 0;  // slab bytes
  std::uint64_t last_used = 0;
};

std::string weight_cache_key(const std::string& ns, const std::string& model_class,
                             const std::string& device_name);

// Removes and returns the entry for `key` (null: none); the caller owns it until it puts it back.
std::shared_ptr<CachedWeights> take_cached_weights(const std::string& key);

// Inserts `entry`, evicting least recently used entries until the cache holds at most
// `budget_bytes` (unset: unbounded). Returns false, keeping nothing, when the entry alone exceeds
// the budget. An entry with the same key is replaced (counted as an eviction).
bool put_cached_weights(std::shared_ptr<CachedWeights> entry,
                        std::optional<std::int64_t> budget_bytes);

// Counters of one attach with the cache on.
void count_weight_cache_attach(bool hit, std::int64_t reused_bytes, std::int64_t refilled_bytes,
                               std::int64_t changed_in_place);
void count_weight_cache_stale();

// A cheap content check: 64-bit hash of the size and of up to 16 samples of 8 bytes at fixed
// fractions of the span, plus the first and last bytes. See Note [Pinned-weight cache].
std::uint64_t sample_fingerprint(const void* data, std::size_t bytes);

// A plain CPU tensor over `data` (a region of cached slabs) that keeps `keep` alive; *lease
// observes it. is_cached_view() recognises its storage.
at::Tensor make_cached_view(void* data, std::size_t bytes, at::IntArrayRef sizes,
                            at::IntArrayRef strides, c10::ScalarType dtype,
                            std::shared_ptr<void> keep, std::weak_ptr<void>* lease);
bool is_cached_view(const at::Tensor& t);

// Tensors that live in cached slabs are pinned by ddo, not by a loader: the inventory reports
// them as not already pinned, so the next attach plans (and caches its plan) as the first did.
void unmark_cached_views(const ModuleTree& tree, core::ModelInventory* inventory);

// The plan cache: key over the inventory, the settings as planned, the context and the card.
std::string plan_cache_key(const core::ModelInventory& inventory,
                           const core::DynamicOffloadConfig& config, const core::PlanContext& ctx);
std::optional<core::Plan> find_cached_plan(const std::string& key);
void store_cached_plan(const std::string& key, const core::Plan& plan);

}  // namespace ddo::adapter::internal
