/// \file
/// The process-lifetime caches behind the `warm_process` preset: pinned host weights and plans.
///
/// With `cache_pinned_weights`, Offload::remove() keeps the host slabs of the streamed weights in
/// a cache keyed by `pinned_weight_cache_namespace`, the model class and the execution device,
/// and the model's weights stay on the host pointing at that memory (held once, not twice). The
/// next enable_offload() of the same model finds them there: no new pinning and no copy. With
/// `cache_plan`, the plan of the same inventory, settings and card is reused. See
/// Note [Pinned-weight cache] in weight_cache.cpp for ownership and staleness.
///
/// ```
/// ddo::adapter::OffloadOptions opts;
/// opts.preset = "warm_process";                 // cache_pinned_weights and cache_plan on
/// auto offload = ddo::adapter::enable_offload(model, opts);  // pins and fills host slabs
/// offload->remove();                            // slabs cached, model usable on the host
/// offload = ddo::adapter::enable_offload(model, opts);       // reuses them
/// ddo::adapter::pinned_weight_cache_stats().hits;            // 1
/// ddo::adapter::clear_pinned_weight_cache();                 // releases what no model uses
/// ```
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace ddo::adapter {

/// Figures of the pinned-weight cache since the process started (or since the last clear).
struct PinnedWeightCacheStats {
  std::int64_t entries = 0;           ///< models cached now
  std::int64_t bytes = 0;             ///< slab bytes the cache holds now
  std::int64_t budget_bytes = -1;     ///< the bound applied at the last insertion; -1 = none
  std::int64_t hits = 0;              ///< COUNT: attaches that reused a cached entry
  std::int64_t misses = 0;            ///< COUNT: attaches (cache on) that found no usable entry
  std::int64_t evictions = 0;         ///< COUNT: entries dropped, least recently used first
  std::int64_t stale = 0;             ///< COUNT: entries dropped because the model changed shape
  std::int64_t rejected = 0;          ///< COUNT: entries larger than the budget, not kept
  std::int64_t reused_bytes = 0;      ///< SUM: weight bytes served from the cache without a copy
  std::int64_t refilled_bytes = 0;    ///< SUM: bytes copied into reused slabs (weights replaced)
  std::int64_t changed_in_place = 0;  ///< COUNT: cached weights written in place while cached
  nlohmann::json to_json() const;     ///< the fields by name
};

/// The current figures (thread-safe).
PinnedWeightCacheStats pinned_weight_cache_stats();

/// Drops every entry, or only those of namespace `ns`, and returns the slab bytes dropped. Memory
/// a restored model still points at is freed when the model lets go of it. Counters are kept.
std::int64_t clear_pinned_weight_cache(const std::optional<std::string>& ns = std::nullopt);

/// Figures of the plan cache.
struct PlanCacheStats {
  std::int64_t entries = 0;        ///< plans cached now
  std::int64_t hits = 0;           ///< COUNT: plans reused
  std::int64_t misses = 0;         ///< COUNT: plans computed with the cache on
  nlohmann::json to_json() const;  ///< the fields by name
};

/// The current figures (thread-safe).
PlanCacheStats plan_cache_stats();

/// Forgets every cached plan.
void clear_plan_cache();

}  // namespace ddo::adapter
