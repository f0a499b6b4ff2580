// The pinned-weight cache and the plan cache (ddo/torch/weight_cache.h).
#include "ddo/torch/weight_cache.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include <ATen/core/TensorBody.h>
#include <c10/core/TensorImpl.h>

#include "host_tensor.h"
#include "weight_cache_internal.h"

namespace ddo::adapter {
namespace internal {

// Note [Pinned-weight cache]
// --------------------------
// A repeat generation attaches the same model again; without a cache every attach pins and fills
// the host slabs anew (2.5-4.7 s for a FLUX-sized transformer on the H200). With
// cache_pinned_weights:
//
// Ownership. remove() does not copy the streamed weights out of the slabs. Each weight becomes a
// plain CPU tensor over its region of the slabs (make_cached_view), whose storage holds a lease
// that holds the slabs (and, through them, the device that pinned them). The cache holds the
// slabs too, and a weak reference to each lease. So the memory exists once: the model uses it on
// the host as ordinary weights, the cache keeps it pinned for the next attach, and it is freed
// when both have let go -- an evicted or cleared entry whose model is alive stays until the model
// drops its weights; a cached entry whose model was deleted stays until evicted or cleared.
//
// Reuse. The next attach takes the entry out of the cache (an active offload owns it; a second
// offload of the same class in the same namespace meanwhile finds none and pins its own), and
// uses it when the stream units have the same sizes and every weight the same name, shape,
// strides, dtype and place. A weight whose data pointer is its cached region is served as it is:
// no pin, no copy. It cannot be stale: a weight changed in place (a LoRA merged with +=) was
// changed in the slab itself, so the bytes streamed are the bytes the model holds. The content
// check (sample_fingerprint at remove, compared at attach) only reports such writes
// (changed_in_place) -- no copy is needed. A weight the user re-pointed (weight.data = merged,
// load_state_dict with assign, a model loaded again) is copied into its cached region, but only
// when no host view of that region is alive (its lease expired); otherwise the whole entry is
// dropped and the attach pins anew, as without a cache, since overwriting memory another tensor
// still reads would change that tensor. A layout that differs (another plan, another model under
// the same class) drops the entry as stale.
//
// Bound. At remove, the cache may hold at most the planner's RAM admission for pins: the explicit
// pin bounds (pin_weight_budget_gb, max_pin_weight_budget_gb) when set, else available RAM plus
// what the cache and this entry already hold, minus system_ram_headroom_gb. Least recently used
// entries go first; an entry larger than the bound is not kept (its model's weights are copied
// out of the slabs as without the cache). Every access is under one mutex; slabs are freed
// outside it (a cudaHostUnregister can take milliseconds).

namespace {

struct WeightCache {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<CachedWeights>> entries;  // guarded by mu
  PinnedWeightCacheStats stats;                                   // guarded by mu
  std::uint64_t clock = 0;                                        // guarded by mu
};

WeightCache& weight_cache() {
  static WeightCache* cache = new WeightCache();  // never destroyed: slabs may outlive statics
  return *cache;
}

struct PlanCache {
  std::mutex mu;
  std::map<std::string, std::pair<core::Plan, std::uint64_t>> plans;  // guarded by mu
  PlanCacheStats stats;                                               // guarded by mu
  std::uint64_t clock = 0;                                            // guarded by mu
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache();
  return *cache;
}

constexpr std::size_t kMaxCachedPlans = 16;

// What a cached view's storage owns: the slabs, through `keep`.
struct Lease {
  std::shared_ptr<void> keep;
};

void cached_view_deleter(void* context) {
  delete static_cast<std::shared_ptr<Lease>*>(context);
}

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  // FNV-1a over the 8 bytes of v.
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ULL;
  }
  return h;
}

}  // namespace

std::string weight_cache_key(const std::string& ns, const std::string& model_class,
                             const std::string& device_name) {
  return ns + '\x1f' + model_class + '\x1f' + device_name;
}

std::shared_ptr<CachedWeights> take_cached_weights(const std::string& key) {
  WeightCache& c = weight_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.entries.find(key);
  if (it == c.entries.end()) return nullptr;
  std::shared_ptr<CachedWeights> entry = std::move(it->second);
  c.entries.erase(it);
  c.stats.entries = static_cast<std::int64_t>(c.entries.size());
  c.stats.bytes -= entry->bytes;
  return entry;
}

bool put_cached_weights(std::shared_ptr<CachedWeights> entry,
                        std::optional<std::int64_t> budget_bytes) {
  std::vector<std::shared_ptr<CachedWeights>> dropped;  // freed after the lock
  WeightCache& c = weight_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.stats.budget_bytes = budget_bytes.value_or(-1);
  if (auto it = c.entries.find(entry->key); it != c.entries.end()) {
    c.stats.bytes -= it->second->bytes;
    dropped.push_back(std::move(it->second));
    c.entries.erase(it);
    ++c.stats.evictions;
  }
  if (budget_bytes && entry->bytes > *budget_bytes) {
    ++c.stats.rejected;
    c.stats.entries = static_cast<std::int64_t>(c.entries.size());
    return false;
  }
  while (budget_bytes && c.stats.bytes + entry->bytes > *budget_bytes && !c.entries.empty()) {
    auto lru = std::min_element(
        c.entries.begin(), c.entries.end(),
        [](const auto& a, const auto& b) { return a.second->last_used < b.second->last_used; });
    c.stats.bytes -= lru->second->bytes;
    dropped.push_back(std::move(lru->second));
    c.entries.erase(lru);
    ++c.stats.evictions;
  }
  entry->last_used = ++c.clock;
  c.stats.bytes += entry->bytes;
  c.entries[entry->key] = std::move(entry);
  c.stats.entries = static_cast<std::int64_t>(c.entries.size());
  return true;
}

void count_weight_cache_attach(bool hit, std::int64_t reused_bytes, std::int64_t refilled_bytes,
                               std::int64_t changed_in_place) {
  WeightCache& c = weight_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  ++(hit ? c.stats.hits : c.stats.misses);
  c.stats.reused_bytes += reused_bytes;
  c.stats.refilled_bytes += refilled_bytes;
  c.stats.changed_in_place += changed_in_place;
}

void count_weight_cache_stale() {
  WeightCache& c = weight_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  ++c.stats.stale;
}

std::uint64_t sample_fingerprint(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = mix(0xcbf29ce484222325ULL, bytes);
  if (bytes == 0) return h;
  constexpr std::size_t kSamples = 16;
  for (std::size_t k = 0; k <= kSamples; ++k) {
    // Fixed fractions of the span, the last sample ending at its last byte.
    const std::size_t n = std::min<std::size_t>(8, bytes);
    const std::size_t at = (bytes - n) * k / kSamples;
    std::uint64_t v = 0;
    std::memcpy(&v, p + at, n);
    h = mix(h, v);
  }
  return h;
}

at::Tensor make_cached_view(void* data, std::size_t bytes, at::IntArrayRef sizes,
                            at::IntArrayRef strides, c10::ScalarType dtype,
                            std::shared_ptr<void> keep, std::weak_ptr<void>* lease) {
  auto shared = std::make_shared<Lease>(Lease{std::move(keep)});
  *lease = shared;
  auto* context = new std::shared_ptr<Lease>(std::move(shared));
  return cpu_tensor_over(data, bytes, sizes, strides, dtype, context, &cached_view_deleter);
}

bool is_cached_view(const at::Tensor& t) {
  return has_deleter(t, &cached_view_deleter);
}

void unmark_cached_views(const ModuleTree& tree, core::ModelInventory* inventory) {
  for (std::size_t m = 0; m < tree.entries.size() && m < inventory->modules.size(); ++m) {
    const ModuleEntry& entry = tree.entries[m];
    core::ModuleInfo& info = inventory->modules[m];
    for (std::size_t t = 0; t < entry.tensors.size() && t < info.tensors.size(); ++t) {
      if (is_cached_view(entry.tensors[t].tensor)) info.tensors[t].already_pinned = false;
    }
  }
}

std::string plan_cache_key(const core::ModelInventory& inventory,
                           const core::DynamicOffloadConfig& config, const core::PlanContext& ctx) {
  // Detected free RAM is left out on purpose: it moves from one attach to the next, and a plan
  // that changed with it would change the slab layout the weight cache reuses. A simulated RAM
  // size (available_system_ram_gb) is part of the config and so of the key.
  nlohmann::json key = {
      {"inventory", inventory.to_json()},
      {"config", core::config_to_json(config)},
      {"total_vram_bytes", ctx.total_vram_bytes},
      {"profile_budget_bytes", ctx.profile_budget_bytes ? *ctx.profile_budget_bytes : -1},
      {"calibrating", ctx.calibrating},
      {"pin_allowed", ctx.pin_allowed},
      {"staging_bytes", ctx.staging_bytes ? *ctx.staging_bytes : -1},
      {"all_block_lists", ctx.all_block_lists},
      {"candidate_compute_ms", ctx.candidate_compute_ms},
      {"ram_known", ctx.available_ram_bytes.has_value()},
      {"resident_budget_origin", ctx.resident_budget_origin},
      {"weights_in_file", ctx.weights_in_file}};
  // With the weights in a file the detected RAM decides which units stay on disk (decision
  // disk_tier), so it is part of the plan.
  if (ctx.weights_in_file && ctx.available_ram_bytes) key["ram_bytes"] = *ctx.available_ram_bytes;
  return key.dump();
}

std::optional<core::Plan> find_cached_plan(const std::string& key) {
  PlanCache& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.plans.find(key);
  if (it == c.plans.end()) {
    ++c.stats.misses;
    return std::nullopt;
  }
  ++c.stats.hits;
  it->second.second = ++c.clock;
  return it->second.first;
}

void store_cached_plan(const std::string& key, const core::Plan& plan) {
  PlanCache& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.plans[key] = {plan, ++c.clock};
  while (c.plans.size() > kMaxCachedPlans) {
    auto lru = std::min_element(c.plans.begin(), c.plans.end(), [](const auto& a, const auto& b) {
      return a.second.second < b.second.second;
    });
    c.plans.erase(lru);
  }
  c.stats.entries = static_cast<std::int64_t>(c.plans.size());
}

}  // namespace internal

nlohmann::json PinnedWeightCacheStats::to_json() const {
  return {{"entries", entries},
          {"bytes", bytes},
          {"budget_bytes", budget_bytes},
          {"hits", hits},
          {"misses", misses},
          {"evictions", evictions},
          {"stale", stale},
          {"rejected", rejected},
          {"reused_bytes", reused_bytes},
          {"refilled_bytes", refilled_bytes},
          {"changed_in_place", changed_in_place}};
}

PinnedWeightCacheStats pinned_weight_cache_stats() {
  internal::WeightCache& c = internal::weight_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.stats;
}

std::int64_t clear_pinned_weight_cache(const std::optional<std::string>& ns) {
  std::vector<std::shared_ptr<internal::CachedWeights>> dropped;  // freed after the lock
  std::int64_t bytes = 0;
  {
    internal::WeightCache& c = internal::weight_cache();
    std::lock_guard<std::mutex> lock(c.mu);
    for (auto it = c.entries.begin(); it != c.entries.end();) {
      if (ns && it->second->ns != *ns) {
        ++it;
        continue;
      }
      bytes += it->second->bytes;
      dropped.push_back(std::move(it->second));
      it = c.entries.erase(it);
    }
    c.stats.bytes -= bytes;
    c.stats.entries = static_cast<std::int64_t>(c.entries.size());
  }
  return bytes;
}

nlohmann::json PlanCacheStats::to_json() const {
  return {{"entries", entries}, {"hits", hits}, {"misses", misses}};
}

PlanCacheStats plan_cache_stats() {
  internal::PlanCache& c = internal::plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.stats;
}

void clear_plan_cache() {
  internal::PlanCache& c = internal::plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.plans.clear();
  c.stats.entries = 0;
}

}  // namespace ddo::adapter
