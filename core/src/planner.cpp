#include "ddo/core/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <regex>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddo/core/status.h"

// Note [Resident cost]
// A resident candidate (a block) costs what residency adds to the device: the bytes of its
// streamable tensors. Its small tensors (bias, norms) go to the device once either way and are
// counted in move_once_bytes; its always-resident parts (e.g. the `proj_out` Linear inside each
// FLUX single block, which the default always-resident pattern matches) are counted once, in
// always_resident_bytes, and never again in a block's cost. The balanced policy subtracts
// move-once and always-resident bytes from the VRAM before it hands the rest to candidates:
// benchmarks.md records a system whose always-resident modules came on top of its budget and
// broke an 8 GiB cap.
//
// Note [Spread order]
// `spread` keeps residents evenly spaced through the block list so that streamed blocks are
// interleaved with resident ones and each copy hides behind a resident block's compute. For n
// candidates of total size T and a budget B it takes k = min(n, floor(B / (T / n))) (how many
// fit by average size) at the centres of k equal strides, index_i = floor((2i + 1) * n / (2k))
// for i = 0..k-1 (n = 19, k = 5 gives 1, 5, 9, 13, 17), then every other candidate in model
// order. The greedy fill after it skips what does not fit and keeps going, so a budget slightly
// above k averages still fills with later, smaller candidates.
//
// Note [Balanced order]
// When copies dominate (streamed bytes / link speed near or above compute time), a step is only
// as fast as the copy stream is busy: it must never idle ahead of compute (its lead is bounded by
// the staging window) nor fall behind where compute is short. So streamed bytes should follow
// compute along the step. Index-even spreading does that only when every candidate has the same
// compute per byte; a FLUX transformer's double blocks do about half the work per byte of its
// single blocks (half their weights see only the 512 text tokens), so evenly spread residents
// leave the double blocks copy-bound and the single blocks idling the link (seen on the H200:
// 28 ms of copy idle per step at a 16 GiB cap). With a measured compute time c_i per candidate
// (the calibration run times every candidate, all streamed; ProfileRecommendation::
// candidate_compute_ms) and S = candidate bytes - budget to stream, the candidates are walked in
// model order and each is streamed when that brings the streamed bytes closer to
// S * (compute so far, this one included) / (all compute), else kept resident: error diffusion
// of S along compute. Residents so chosen come first in the order, the streamed ones after, so the
// greedy fill can still use budget that rounding left over.
//
// Note [Auto block pattern]
// The spec's `auto` takes the one repeated list (`<prefix>.<n>`, >= 2 members with streamable
// weights) with the most bytes. A FLUX transformer has two (19 double blocks, 38 single blocks);
// with only the larger as candidates, 24 GiB buys nothing over 16 (benchmarks.md). The `auto_all`
// token (or PlanContext::all_block_lists) makes every qualifying list a candidate, largest first,
// dropping lists nested inside a member of a list already taken (`blocks.3.ff.net.0`,
// `blocks.3.ff.net.2` inside `blocks.3`). A root whose children are `0`, `1`, ... (a Sequential)
// gives the prefix "" and the pattern `^[0-9]+$`.

namespace ddo::core {
namespace {

// Below this much usable RAM (or a quarter of the candidates, if smaller) pinning is skipped:
// the machine is already short and a sliver of pinned weights gains little.
constexpr std::int64_t kMinUsefulPinBytes = kGiBBytes;
constexpr double kPinSnapRatio = 0.95;

// A GiB field of the config in bytes. validate_config bounds every such field so that this fits;
// the check stays, naming the field, for a config that skipped it.
std::int64_t field_bytes(double gib, const char* field) {
  return to_bytes_or_throw(gib, ByteUnit::kGiB, field);
}
std::string gib(std::int64_t bytes) {
  return fmt::format("{:.2f} GiB", bytes_to_gib(bytes));
}

std::string regex_escape(std::string_view text) {
  static constexpr std::string_view kSpecial = R"(\^$.|?*+()[]{})";
  std::string out;
  for (char c : text) {
    if (kSpecial.find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

bool all_digits(std::string_view text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

struct CompiledPatterns {
  std::vector<std::string> sources;
  std::vector<std::regex> regexes;

  bool search(const std::string& name) const {
    return std::any_of(regexes.begin(), regexes.end(),
                       [&](const std::regex& r) { return std::regex_search(name, r); });
  }
};

CompiledPatterns compile(const std::vector<std::string>& patterns, std::string_view field) {
  CompiledPatterns out;
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    const std::string& p = patterns[i];
    // Note [Pattern limits] (config.cpp): bounded before std::regex sees it. The inferred block
    // patterns come from module names, which validate_config never saw.
    throw_if_error(check_module_pattern(field, i, p));
    try {
      out.regexes.emplace_back(p, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw Error(Code::kInvalidArgument,
                  internal::str_cat(field, " pattern '", p, "' is not a valid regex (", e.what(),
                                    "); write an ECMAScript regex searched in module names"));
    }
    out.sources.push_back(p);
  }
  return out;
}

nlohmann::json names_json(const std::vector<std::string>& names, std::size_t limit = 16) {
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t i = 0; i < names.size() && i < limit; ++i) out.push_back(names[i]);
  if (names.size() > limit) out.push_back(fmt::format("... {} more", names.size() - limit));
  return out;
}

struct BlockGroup {
  std::string prefix;
  std::vector<std::size_t> members;  // modules with streamable weights, model order
  std::int64_t bytes = 0;
  std::size_t first = 0;  // model index of the first member (tie-break)

  std::string pattern() const {
    return prefix.empty() ? std::string("^[0-9]+$") : "^" + regex_escape(prefix) + R"(\.[0-9]+$)";
  }
};

class Planner {
 public:
  Planner(const ModelInventory& inventory, const DynamicOffloadConfig& config,
          const PlanContext& context)
      : inv_(inventory), config_(config), ctx_(context), n_(inventory.modules.size()) {}

  Plan run();

 private:
  void decide(std::string name, nlohmann::json inputs, std::string detail) {
    plan_.decisions.push_back({std::move(name), std::move(inputs), std::move(detail)});
  }
  const std::string& name_of(std::size_t m) const { return inv_.modules[m].name; }
  const TensorInfo& tensor(TensorRef ref) const {
    return inv_.modules[ref.module].tensors[ref.tensor];
  }

  void check_inputs() const;
  void index_parents();
  void mark_with_descendants(const CompiledPatterns& patterns, std::vector<bool>* flags,
                             std::vector<std::string>* matched) const;
  bool flagged_or_ancestor(std::size_t m, const std::vector<bool>& flags) const;
  void classify_tensors();
  void apply_skip();
  void apply_always_resident();
  void compute_costs();
  std::vector<BlockGroup> find_block_groups() const;
  std::vector<BlockGroup> choose_block_groups(bool all_lists);
  void resolve_resident_candidates();
  std::int64_t staging_estimate();
  void resolve_resident_budget();
  void select_residents();
  void assign_placements();
  void plan_pinning();
  void admit_linear_pins(std::int64_t candidates);
  void admit_sdnq_pins(std::int64_t candidates);
  void pin_selected(const std::vector<TensorRef>& candidates, std::int64_t budget);
  void build_stream_units();
  void plan_whole_route();

  const ModelInventory& inv_;
  const DynamicOffloadConfig& config_;
  const PlanContext& ctx_;
  const std::size_t n_;
  Plan plan_;

  std::vector<std::optional<std::size_t>> parent_;  // nearest ancestor present in the inventory
  std::vector<bool> skipped_;
  std::vector<bool> always_resident_;
  std::vector<std::vector<bool>> streamable_;  // [module][tensor]
  std::vector<std::int64_t> own_cost_;         // streamable bytes of a module's own tensors
  std::vector<std::int64_t> subtree_cost_;     // own_cost_ over the module and its descendants
  std::vector<bool> candidate_;                // outermost resident candidates
  std::vector<bool> resident_;                 // chosen resident (with descendants)
  std::vector<std::size_t> candidates_;        // candidate module indices, model order
  std::vector<BlockGroup> block_groups_;       // the groups behind block_patterns
  std::int64_t always_resident_bytes_ = 0;
  std::int64_t move_once_bytes_ = 0;
  std::vector<TensorRef> streamed_;  // model order
};

void Planner::check_inputs() const {
  // The config's rules live in one place, validate_config; only the context is checked here.
  throw_if_error(validate_config(config_));
  DDO_CHECK(!ctx_.profile_budget_bytes || *ctx_.profile_budget_bytes >= 0, Code::kInvalidArgument,
            "profile budget of ", ctx_.profile_budget_bytes.value_or(0),
            " bytes is negative; the caller must clamp the recommendation at 0");
  DDO_CHECK(ctx_.total_vram_bytes >= 0, Code::kInvalidArgument,
            "total_vram_bytes=", ctx_.total_vram_bytes, " is negative");
}

void Planner::index_parents() {
  // An ordered map used for lookups only; nothing iterates it.
  std::map<std::string_view, std::size_t> index;
  for (std::size_t m = 0; m < n_; ++m) index.emplace(name_of(m), m);
  parent_.assign(n_, std::nullopt);
  for (std::size_t m = 0; m < n_; ++m) {
    std::string_view name = name_of(m);
    if (name.empty()) continue;
    while (true) {
      std::size_t dot = name.rfind('.');
      name = dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
      auto it = index.find(name);
      if (it != index.end()) {
        parent_[m] = it->second;
        break;
      }
      if (name.empty()) break;
    }
  }
}

bool Planner::flagged_or_ancestor(std::size_t m, const std::vector<bool>& flags) const {
  for (std::optional<std::size_t> cur = m; cur; cur = parent_[*cur]) {
    if (flags[*cur]) return true;
  }
  return false;
}

void Planner::mark_with_descendants(const CompiledPatterns& patterns, std::vector<bool>* flags,
                                    std::vector<std::string>* matched) const {
  std::vector<bool> direct(n_, false);
  for (std::size_t m = 0; m < n_; ++m) {
    if (patterns.search(name_of(m))) {
      direct[m] = true;
      matched->push_back(name_of(m));
    }
  }
  flags->assign(n_, false);
  for (std::size_t m = 0; m < n_; ++m) (*flags)[m] = flagged_or_ancestor(m, direct);
}

void Planner::apply_skip() {
  skipped_.assign(n_, false);
  if (config_.skip_modules_pattern.empty()) return;
  CompiledPatterns patterns = compile(config_.skip_modules_pattern, "skip_modules_pattern");
  std::vector<std::string> matched;
  mark_with_descendants(patterns, &skipped_, &matched);
  if (matched.empty()) return;
  std::int64_t bytes = 0;
  std::size_t modules = 0;
  for (std::size_t m = 0; m < n_; ++m) {
    if (!skipped_[m]) continue;
    ++modules;
    bytes += inv_.modules[m].bytes();
  }
  decide("skip_pattern",
         {{"patterns", patterns.sources},
          {"matched", names_json(matched)},
          {"modules", modules},
          {"bytes", bytes}},
         fmt::format("{} modules ({}) left where they are", modules, gib(bytes)));
}

void Planner::classify_tensors() {
  const std::int64_t threshold = config_.small_tensor_threshold_bytes;
  streamable_.assign(n_, {});
  own_cost_.assign(n_, 0);
  std::int64_t small_count = 0, small_bytes = 0;
  std::int64_t fallback_count = 0, fallback_bytes = 0;
  for (std::size_t m = 0; m < n_; ++m) {
    const ModuleInfo& mod = inv_.modules[m];
    streamable_[m].assign(mod.tensors.size(), false);
    if (skipped_[m]) continue;
    // Note [SDNQ layer units]: an SDNQ layer's packed weight and its scales, zero points and
    // SVD factors are read together by one dequantize, so they stream together or not at all.
    // The threshold applies to the layer's role bytes, not to each tensor: uint4 scales and
    // zero points (an eighth of the packed bytes each at group 64) would otherwise all be moved
    // once and fill a small card with tensors that are only read when their weight is.
    std::int64_t sdnq_layer_bytes = 0;
    if (plan_.sdnq && mod.kind == ModuleKind::kSdnq) {
      for (const TensorInfo& info : mod.tensors) {
        if (info.sdnq_role != SdnqRole::kNone) sdnq_layer_bytes += info.bytes;
      }
    }
    for (std::size_t t = 0; t < mod.tensors.size(); ++t) {
      const TensorInfo& info = mod.tensors[t];
      bool eligible = false;
      if (plan_.sdnq) {
        eligible = mod.kind == ModuleKind::kSdnq && info.sdnq_role != SdnqRole::kNone;
        if (mod.kind == ModuleKind::kLinear) {
          ++fallback_count;
          fallback_bytes += info.bytes;
        }
        if (eligible && sdnq_layer_bytes > threshold) {
          streamable_[m][t] = true;
          own_cost_[m] += info.bytes;
          continue;
        }
      } else {
        const bool is_weight = info.name == "weight";
        switch (mod.kind) {
          case ModuleKind::kLinear:
          case ModuleKind::kEmbedding:
            eligible = is_weight && info.ndim() == 2;
            break;
          case ModuleKind::kConv:
            eligible = is_weight && info.ndim() >= 3;
            break;
          default:
            break;
        }
      }
      if (!eligible) continue;
      if (info.bytes <= threshold) {
        ++small_count;
        small_bytes += info.bytes;
        continue;
      }
      streamable_[m][t] = true;
      own_cost_[m] += info.bytes;
    }
  }
  if (small_count > 0) {
    decide("small_tensor",
           {{"threshold_bytes", threshold}, {"tensors", small_count}, {"bytes", small_bytes}},
           fmt::format("{} streamable-kind tensors at or under {} bytes are moved once",
                       small_count, threshold));
  }
  if (fallback_count > 0) {
    decide("sdnq_dense_fallback_resident", {{"tensors", fallback_count}, {"bytes", fallback_bytes}},
           fmt::format("{} tensors of dense fallback Linears ({}) stay on the device and are not "
                       "SDNQ pin candidates",
                       fallback_count, gib(fallback_bytes)));
  }
}

void Planner::apply_always_resident() {
  always_resident_.assign(n_, false);
  if (config_.always_resident_modules_pattern.empty()) return;
  CompiledPatterns patterns =
      compile(config_.always_resident_modules_pattern, "always_resident_modules_pattern");
  std::vector<std::string> matched;
  mark_with_descendants(patterns, &always_resident_, &matched);
  std::vector<std::string> kept;
  for (std::size_t m = 0; m < n_; ++m) {
    if (skipped_[m]) always_resident_[m] = false;  // skip wins: the host owns those
    if (!always_resident_[m]) continue;
    always_resident_bytes_ += inv_.modules[m].bytes();
  }
  for (const std::string& name : matched) {
    auto index = inv_.module_index(name);
    if (index && always_resident_[*index]) kept.push_back(name);
  }
  if (kept.empty()) return;
  decide("always_resident",
         {{"patterns", patterns.sources},
          {"matched", names_json(kept)},
          {"modules_matched", kept.size()},
          {"bytes", always_resident_bytes_}},
         fmt::format("{} modules ({}) resident on top of the budget", kept.size(),
                     gib(always_resident_bytes_)));
}

void Planner::compute_costs() {
  // Always-resident parts cost nothing extra to a block (Note [Resident cost]).
  subtree_cost_.assign(n_, 0);
  for (std::size_t m = 0; m < n_; ++m) {
    if (always_resident_[m] || own_cost_[m] == 0) continue;
    for (std::optional<std::size_t> cur = m; cur; cur = parent_[*cur]) {
      subtree_cost_[*cur] += own_cost_[m];
    }
  }
  for (std::size_t m = 0; m < n_; ++m) {
    if (skipped_[m]) continue;
    const ModuleInfo& mod = inv_.modules[m];
    for (std::size_t t = 0; t < mod.tensors.size(); ++t) {
      if (!always_resident_[m] && !streamable_[m][t]) move_once_bytes_ += mod.tensors[t].bytes;
    }
  }
}

std::vector<BlockGroup> Planner::find_block_groups() const {
  std::map<std::string, BlockGroup> by_prefix;  // ordered: the result is sorted again below
  for (std::size_t m = 0; m < n_; ++m) {
    if (skipped_[m] || subtree_cost_[m] == 0) continue;
    const std::string& name = name_of(m);
    std::size_t dot = name.rfind('.');
    std::string_view last =
        dot == std::string::npos ? std::string_view(name) : std::string_view(name).substr(dot + 1);
    if (!all_digits(last)) continue;
    std::string prefix = dot == std::string::npos ? std::string() : name.substr(0, dot);
    BlockGroup& group = by_prefix[prefix];
    if (group.members.empty()) {
      group.prefix = prefix;
      group.first = m;
    }
    group.members.push_back(m);
    group.bytes += subtree_cost_[m];
  }
  std::vector<BlockGroup> groups;
  for (auto& [prefix, group] : by_prefix) {
    if (group.members.size() >= 2) groups.push_back(std::move(group));
  }
  std::sort(groups.begin(), groups.end(), [](const BlockGroup& a, const BlockGroup& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.first < b.first;
  });
  return groups;
}

std::vector<BlockGroup> Planner::choose_block_groups(bool all_lists) {
  std::vector<BlockGroup> groups = find_block_groups();
  std::vector<BlockGroup> chosen;
  for (BlockGroup& group : groups) {
    if (chosen.empty()) {
      chosen.push_back(std::move(group));
      if (!all_lists) break;
      continue;
    }
    const bool nested = std::any_of(chosen.begin(), chosen.end(), [&](const BlockGroup& taken) {
      for (std::size_t member : taken.members) {
        if (is_within(group.prefix, name_of(member))) return true;
      }
      for (std::size_t member : group.members) {
        if (is_within(taken.prefix, name_of(member))) return true;
      }
      return false;
    });
    if (!nested) chosen.push_back(std::move(group));
  }
  return chosen;
}

void Planner::resolve_resident_candidates() {
  candidate_.assign(n_, false);
  bool want_auto = false;
  bool want_all = ctx_.all_block_lists;
  std::vector<std::string> explicit_patterns;
  for (const std::string& p : config_.resident_module_patterns) {
    if (p == "auto") {
      want_auto = true;
    } else if (p == "auto_all") {
      want_auto = true;
      want_all = true;
    } else {
      explicit_patterns.push_back(p);
    }
  }
  // The group routes need the block list even when no residents are asked for.
  const bool need_blocks = want_auto || config_.route == Route::kGroupBlock;
  if (need_blocks) {
    // Classic block-level offload groups every repeated block list, not only the largest.
    block_groups_ = choose_block_groups(want_all || config_.route == Route::kGroupBlock);
    for (const BlockGroup& g : block_groups_) plan_.block_patterns.push_back(g.pattern());
    if (!block_groups_.empty()) plan_.block_pattern = block_groups_.front().pattern();
    nlohmann::json groups = nlohmann::json::array();
    for (const BlockGroup& g : block_groups_) {
      groups.push_back({{"prefix", g.prefix},
                        {"members", g.members.size()},
                        {"bytes", g.bytes},
                        {"pattern", g.pattern()}});
    }
    decide("auto_block_pattern",
           {{"mode", want_all ? "auto_all" : "auto"},
            {"requested_by", want_auto ? "resident_module_patterns" : "route"},
            {"chosen", std::move(groups)}},
           block_groups_.empty()
               ? std::string("no repeated block list (>= 2 members with streamable weights)")
               : fmt::format("{} ({} lists)", fmt::join(plan_.block_patterns, ", "),
                             block_groups_.size()));
  }
  if (want_auto) {
    plan_.resident_patterns = plan_.block_patterns;
  }
  for (const std::string& p : explicit_patterns) plan_.resident_patterns.push_back(p);
  if (plan_.resident_patterns.empty()) return;

  CompiledPatterns patterns = compile(plan_.resident_patterns, "resident_module_patterns");
  std::vector<bool> direct(n_, false);
  for (std::size_t m = 0; m < n_; ++m) {
    direct[m] = !skipped_[m] && !always_resident_[m] && patterns.search(name_of(m));
  }
  for (std::size_t m = 0; m < n_; ++m) {
    if (!direct[m] || subtree_cost_[m] == 0) continue;
    // Outermost only: a match inside a matched module is already covered by it.
    if (parent_[m] && flagged_or_ancestor(*parent_[m], direct)) continue;
    candidate_[m] = true;
    candidates_.push_back(m);
    plan_.resident_candidate_bytes += subtree_cost_[m];
  }
}

std::int64_t Planner::staging_estimate() {
  std::string source;
  std::int64_t bytes = 0;
  if (ctx_.staging_bytes) {
    bytes = *ctx_.staging_bytes;
    source = "context";
  } else if (config_.staging_mb > 0) {
    bytes = to_bytes_or_throw(config_.staging_mb, ByteUnit::kMiB, "staging_mb");
    source = "staging_mb";
  } else {
    // The engine double-buffers one unit ahead: two of the largest block, or of the largest
    // streamed tensor when there are no blocks.
    std::int64_t largest = 0;
    for (std::size_t m : candidates_) largest = std::max(largest, subtree_cost_[m]);
    source = "two_largest_blocks";
    if (largest == 0) {
      source = "two_largest_tensors";
      for (std::size_t m = 0; m < n_; ++m) {
        if (always_resident_[m]) continue;
        for (std::size_t t = 0; t < streamable_[m].size(); ++t) {
          if (streamable_[m][t]) largest = std::max(largest, inv_.modules[m].tensors[t].bytes);
        }
      }
    }
    bytes = 2 * largest;
  }
  plan_.staging_estimate_bytes = bytes;
  return bytes;
}

void Planner::resolve_resident_budget() {
  const std::int64_t candidates = plan_.resident_candidate_bytes;
  // The seed: calibration "forces the resident module budget to zero", so it comes before the
  // manual budget; an ignored manual budget is recorded, never silently dropped.
  if (ctx_.calibrating) {
    plan_.resident_budget_bytes = 0;
    decide("profile_calibration",
           {{"profile_name", config_.profile_name},
            {"candidate_bytes", candidates},
            {"ignored_resident_module_budget_gb", config_.resident_module_budget_gb}},
           "residency calibration forces the resident budget to 0");
    return;
  }
  if (config_.resident_module_budget_gb > 0) {
    plan_.resident_budget_bytes =
        field_bytes(config_.resident_module_budget_gb, "resident_module_budget_gb");
    decide("resident_budget_manual",
           {{"resident_module_budget_gb", config_.resident_module_budget_gb},
            {"budget_bytes", plan_.resident_budget_bytes},
            {"profile_budget_bytes", ctx_.profile_budget_bytes.has_value()
                                         ? nlohmann::json(*ctx_.profile_budget_bytes)
                                         : nlohmann::json(nullptr)},
            {"calibrating", ctx_.calibrating}},
           fmt::format("manual budget {} wins over profiles and the auto policy",
                       gib(plan_.resident_budget_bytes)));
    return;
  }
  if (ctx_.profile_budget_bytes) {
    plan_.resident_budget_bytes = *ctx_.profile_budget_bytes;
    decide("resident_budget_profile",
           {{"profile_budget_bytes", *ctx_.profile_budget_bytes},
            {"profile_name", config_.profile_name}},
           fmt::format("saved profile recommendation {} replaces the heuristic",
                       gib(plan_.resident_budget_bytes)));
    return;
  }
  if (config_.auto_budget_policy != AutoBudgetPolicy::kBalanced) {
    plan_.resident_budget_bytes = 0;
    decide("resident_budget_none",
           {{"auto_budget_policy", to_string(config_.auto_budget_policy)},
            {"resident_module_budget_gb", config_.resident_module_budget_gb},
            {"candidate_bytes", candidates}},
           "no manual budget, no profile and the auto policy is off: budget 0");
    return;
  }

  std::int64_t total = ctx_.total_vram_bytes;
  const std::int64_t cap = field_bytes(config_.vram_cap_gb, "vram_cap_gb");
  if (cap > 0) total = total > 0 ? std::min(total, cap) : cap;
  const bool manual_headroom = config_.auto_vram_headroom_gb > 0;
  const std::int64_t headroom =
      manual_headroom ? field_bytes(config_.auto_vram_headroom_gb, "auto_vram_headroom_gb")
                      : balanced_headroom_bytes(total);
  const std::int64_t staging = staging_estimate();
  const std::int64_t room = total - headroom - always_resident_bytes_ - move_once_bytes_ - staging;
  std::int64_t budget = total > 0 ? std::clamp<std::int64_t>(room, 0, candidates) : 0;
  decide("balanced_policy",
         {{"total_vram_bytes", total},
          {"vram_cap_gb", config_.vram_cap_gb},
          {"headroom_bytes", headroom},
          {"headroom_source", manual_headroom ? "auto_vram_headroom_gb" : "table"},
          {"always_resident_bytes", always_resident_bytes_},
          {"move_once_bytes", move_once_bytes_},
          {"staging_bytes", staging},
          {"candidate_bytes", candidates},
          {"budget_bytes", budget}},
         total > 0 ? fmt::format("{} = min(candidates {}, total {} - headroom {} - always-resident "
                                 "{} - move-once {} - staging {})",
                                 gib(budget), gib(candidates), gib(total), gib(headroom),
                                 gib(always_resident_bytes_), gib(move_once_bytes_), gib(staging))
                   : std::string("total VRAM unknown: budget 0"));
  const std::int64_t max_budget =
      field_bytes(config_.max_resident_module_budget_gb, "max_resident_module_budget_gb");
  if (max_budget > 0 && budget > max_budget) {
    decide("max_budget_cap",
           {{"max_resident_module_budget_gb", config_.max_resident_module_budget_gb},
            {"uncapped_bytes", budget},
            {"budget_bytes", max_budget}},
           fmt::format("capped {} to {}", gib(budget), gib(max_budget)));
    budget = max_budget;
  }
  plan_.resident_budget_bytes = budget;
}

void Planner::select_residents() {
  resident_.assign(n_, false);
  if (candidates_.empty()) return;
  std::vector<std::int64_t> costs;
  for (std::size_t m : candidates_) costs.push_back(subtree_cost_[m]);
  const std::int64_t budget = plan_.resident_budget_bytes;
  std::vector<std::size_t> order =
      selection_order(costs, config_.resident_module_selection, budget);
  // Note [Balanced order]: measured compute per candidate replaces index-even spreading.
  bool balanced = false;
  if (config_.resident_module_selection == Selection::kSpread &&
      !ctx_.candidate_compute_ms.empty()) {
    std::vector<double> compute;
    std::string missing;
    for (std::size_t m : candidates_) {
      auto it = ctx_.candidate_compute_ms.find(name_of(m));
      if (it == ctx_.candidate_compute_ms.end()) {
        missing = name_of(m);
        break;
      }
      compute.push_back(it->second);
    }
    balanced = missing.empty();
    decide("balanced_order",
           {{"measured_candidates", ctx_.candidate_compute_ms.size()},
            {"candidates", candidates_.size()},
            {"used", balanced}},
           balanced
               ? std::string("residents placed by measured compute per candidate")
               : fmt::format("no measured compute for candidate '{}': spread by index", missing));
    if (balanced) order = balanced_order(costs, compute, budget);
  }
  std::vector<std::size_t> chosen = greedy_fill(order, costs, budget);
  std::vector<bool> chosen_flag(n_, false);
  std::vector<std::string> chosen_names;
  std::sort(chosen.begin(), chosen.end());  // report in model order
  for (std::size_t i : chosen) {
    chosen_flag[candidates_[i]] = true;
    chosen_names.push_back(name_of(candidates_[i]));
    plan_.resident_used_bytes += costs[i];
  }
  std::size_t skipped_for_size = 0;
  std::int64_t used = 0;
  for (std::size_t i : order) {
    if (used + costs[i] <= budget) {
      used += costs[i];
    } else if (costs[i] <= budget) {
      ++skipped_for_size;  // would fit alone, not after earlier picks
    }
  }
  for (std::size_t m = 0; m < n_; ++m) {
    resident_[m] = !skipped_[m] && !always_resident_[m] && flagged_or_ancestor(m, chosen_flag);
  }
  decide("resident_selection",
         {{"selection", to_string(config_.resident_module_selection)},
          {"balanced_by_measured_compute", balanced},
          {"candidates", candidates_.size()},
          {"candidate_bytes", plan_.resident_candidate_bytes},
          {"budget_bytes", budget},
          {"chosen", chosen.size()},
          {"chosen_bytes", plan_.resident_used_bytes},
          {"skipped_for_size", skipped_for_size},
          {"chosen_modules", names_json(chosen_names)}},
         fmt::format("{} of {} candidates resident ({} of budget {}, {})", chosen.size(),
                     candidates_.size(), gib(plan_.resident_used_bytes), gib(budget),
                     to_string(config_.resident_module_selection)));
}

void Planner::assign_placements() {
  plan_.modules.resize(n_);
  for (std::size_t m = 0; m < n_; ++m) {
    const ModuleInfo& mod = inv_.modules[m];
    ModulePlan& mp = plan_.modules[m];
    mp.name = mod.name;
    mp.always_resident = always_resident_[m];
    mp.resident_candidate = candidate_[m];
    mp.tensors.resize(mod.tensors.size());
    const bool has_stream =
        std::find(streamable_[m].begin(), streamable_[m].end(), true) != streamable_[m].end();
    if (skipped_[m]) {
      mp.placement = Placement::kSkipped;
    } else if (always_resident_[m] || resident_[m]) {
      mp.placement = Placement::kResident;
    } else if (has_stream) {
      mp.placement = Placement::kStreamed;
    } else {
      mp.placement = Placement::kDeviceOnce;
    }
    for (std::size_t t = 0; t < mod.tensors.size(); ++t) {
      const TensorInfo& info = mod.tensors[t];
      TensorPlan& tp = mp.tensors[t];
      switch (mp.placement) {
        case Placement::kSkipped:
          tp.action = TensorAction::kKeep;
          plan_.skipped_bytes += info.bytes;
          break;
        case Placement::kResident:
          tp.action = TensorAction::kResident;
          break;
        case Placement::kStreamed:
        case Placement::kDeviceOnce:
          if (streamable_[m][t]) {
            tp.action = TensorAction::kStream;
            plan_.streamed_bytes += info.bytes;
            streamed_.push_back({m, t});
            if (info.already_pinned) {
              tp.loader_pinned = true;
              plan_.loader_pinned_bytes += info.bytes;
            }
          } else {
            tp.action = TensorAction::kMoveOnce;
          }
          break;
      }
    }
  }
  plan_.always_resident_bytes = always_resident_bytes_;
  plan_.move_once_bytes = move_once_bytes_;
}

void Planner::plan_pinning() {
  std::int64_t loader_tensors = 0;
  std::vector<TensorRef> fresh;
  for (TensorRef ref : streamed_) {
    if (tensor(ref).already_pinned) {
      ++loader_tensors;
    } else {
      fresh.push_back(ref);
      plan_.pin_candidate_bytes += tensor(ref).bytes;
    }
  }
  if (loader_tensors > 0) {
    decide("loader_pins_preserved",
           {{"tensors", loader_tensors}, {"bytes", plan_.loader_pinned_bytes}},
           fmt::format("{} streamed tensors ({}) pinned by the loader stay pinned and do not "
                       "count against new pins",
                       loader_tensors, gib(plan_.loader_pinned_bytes)));
  }
  if (!config_.pin_cpu_memory || !ctx_.pin_allowed) {
    decide("pin_disabled",
           {{"pin_cpu_memory", config_.pin_cpu_memory}, {"pin_allowed", ctx_.pin_allowed}},
           config_.pin_cpu_memory ? "the platform does not allow pinning (e.g. WSL)"
                                  : "pin_cpu_memory is off");
    return;
  }
  if (plan_.sdnq) {
    admit_sdnq_pins(plan_.pin_candidate_bytes);
  } else {
    admit_linear_pins(plan_.pin_candidate_bytes);
  }
  pin_selected(fresh, plan_.pin_budget_bytes);
  const std::int64_t all_streamed = plan_.pin_candidate_bytes + plan_.loader_pinned_bytes;
  if (plan_.resident_budget_bytes == 0 && all_streamed > 0 &&
      plan_.pinned_bytes == plan_.pin_candidate_bytes) {
    decide(
        "full_pin_zero_resident",
        {{"pinned_bytes", plan_.pinned_bytes},
         {"loader_pinned_bytes", plan_.loader_pinned_bytes},
         {"streamed_bytes", plan_.streamed_bytes}},
        fmt::format("resident budget 0 and every streamed weight pinned ({})", gib(all_streamed)));
  }
}

std::optional<std::int64_t> known_ram(const DynamicOffloadConfig& config, const PlanContext& ctx,
                                      std::string* source) {
  if (config.available_system_ram_gb) {
    *source = "available_system_ram_gb";
    return field_bytes(*config.available_system_ram_gb, "available_system_ram_gb");
  }
  if (ctx.available_ram_bytes) {
    *source = "detected";
    return *ctx.available_ram_bytes;
  }
  *source = "unknown";
  return std::nullopt;
}

void Planner::admit_linear_pins(std::int64_t candidates) {
  if (candidates == 0) return;
  // Explicit bounds: any that are set bound the budget together.
  std::optional<std::int64_t> bound;
  auto bound_by = [&](std::int64_t b) { bound = bound ? std::min(*bound, b) : b; };
  const double ratio = std::clamp(config_.pin_weight_budget_ratio, 0.0, 1.0);
  const std::int64_t max_bytes =
      field_bytes(config_.max_pin_weight_budget_gb, "max_pin_weight_budget_gb");
  if (config_.pin_weight_budget_gb > 0)
    bound_by(field_bytes(config_.pin_weight_budget_gb, "pin_weight_budget_gb"));
  if (ratio > 0) bound_by(static_cast<std::int64_t>(std::floor(ratio * candidates)));
  if (max_bytes > 0) bound_by(max_bytes);
  if (bound) {
    decide("pin_budget_explicit",
           {{"pin_weight_budget_gb", config_.pin_weight_budget_gb},
            {"pin_weight_budget_ratio", config_.pin_weight_budget_ratio},
            {"ratio_clamped", ratio},
            {"max_pin_weight_budget_gb", config_.max_pin_weight_budget_gb},
            {"candidate_bytes", candidates},
            {"bound_bytes", *bound}},
           fmt::format("explicit pin settings bound new pins to {}", gib(*bound)));
  }

  std::string ram_source;
  std::optional<std::int64_t> available = known_ram(config_, ctx_, &ram_source);
  std::int64_t budget = candidates;
  if (!available) {
    decide("pin_ram_unknown", {{"candidate_bytes", candidates}},
           "available RAM unknown: pin admission is not bounded by RAM");
  } else {
    const std::int64_t headroom =
        field_bytes(config_.system_ram_headroom_gb, "system_ram_headroom_gb");
    const std::int64_t usable = *available - headroom;
    const std::int64_t resident = plan_.resident_budget_bytes;
    nlohmann::json inputs = {
        {"available_bytes", *available},         {"available_source", ram_source},
        {"system_ram_headroom_bytes", headroom}, {"usable_bytes", usable},
        {"candidate_bytes", candidates},         {"resident_budget_bytes", resident}};
    if (usable >= candidates + resident) {
      decide("pin_all", inputs,
             fmt::format("usable RAM {} >= candidates {} + resident budget {}", gib(usable),
                         gib(candidates), gib(resident)));
    } else {
      const double tier = candidates <= 8 * kGiBBytes    ? 1.0
                          : candidates <= 16 * kGiBBytes ? 0.85
                                                         : 0.75;
      const std::int64_t tiered =
          std::min(static_cast<std::int64_t>(std::floor(tier * candidates)), usable);
      const std::int64_t too_small = std::min(kMinUsefulPinBytes, candidates / 4);
      inputs["tier_ratio"] = tier;
      inputs["min_useful_bytes"] = too_small;
      if (usable <= 0 || usable < too_small) {
        plan_.pin_budget_bytes = 0;
        decide("skip_insufficient_ram", inputs,
               fmt::format("usable RAM {} (available {} - headroom {}) is too small to pin any "
                           "of {}; weights stay in pageable memory",
                           gib(usable), gib(*available), gib(headroom), gib(candidates)));
        return;
      }
      budget = tiered;
      inputs["budget_bytes"] = budget;
      decide("pin_tiered", inputs,
             fmt::format("{:.0f}% of {} bounded by usable RAM {}: {}", tier * 100, gib(candidates),
                         gib(usable), gib(budget)));
    }
  }
  if (bound) budget = std::min(budget, *bound);
  // A maximum is a maximum: the snap never pins past max_pin_weight_budget_gb.
  const bool max_binds = max_bytes > 0 && max_bytes < candidates;
  if (budget < candidates && !max_binds &&
      static_cast<double>(budget) >= kPinSnapRatio * static_cast<double>(candidates)) {
    decide("pin_snap_95",
           {{"budget_bytes", budget},
            {"candidate_bytes", candidates},
            {"ratio", static_cast<double>(budget) / static_cast<double>(candidates)}},
           fmt::format("budget {} is >= 95% of {}: pin everything", gib(budget), gib(candidates)));
    budget = candidates;
  }
  plan_.pin_budget_bytes = budget;
}

void Planner::admit_sdnq_pins(std::int64_t fresh) {
  // Seed: counts direct packed tensors, scales and auxiliaries; the ceiling, ratio, maximum and
  // known RAM headroom bound new pins; loader pins are kept and any excess reported.
  std::map<std::string, std::int64_t> by_role;  // ordered for a stable JSON
  for (TensorRef ref : streamed_) by_role[to_string(tensor(ref).sdnq_role)] += tensor(ref).bytes;
  const std::int64_t existing = plan_.loader_pinned_bytes;
  const std::int64_t all = fresh + existing;
  const double ratio = std::clamp(config_.pin_weight_budget_ratio, 0.0, 1.0);
  const std::int64_t max_bytes =
      field_bytes(config_.max_pin_weight_budget_gb, "max_pin_weight_budget_gb");
  std::int64_t ceiling = all;
  if (config_.pin_weight_budget_gb > 0) {
    ceiling = std::min(ceiling, field_bytes(config_.pin_weight_budget_gb, "pin_weight_budget_gb"));
  }
  if (ratio > 0) ceiling = std::min(ceiling, static_cast<std::int64_t>(std::floor(ratio * all)));
  if (max_bytes > 0) ceiling = std::min(ceiling, max_bytes);
  std::string ram_source;
  std::optional<std::int64_t> available = known_ram(config_, ctx_, &ram_source);
  std::optional<std::int64_t> usable;
  if (available)
    usable = *available - field_bytes(config_.system_ram_headroom_gb, "system_ram_headroom_gb");
  std::int64_t budget = std::max<std::int64_t>(0, ceiling - existing);
  if (usable) budget = std::min(budget, std::max<std::int64_t>(0, *usable));
  budget = std::min(budget, fresh);
  plan_.pin_budget_bytes = budget;
  const nlohmann::json usable_json = usable ? nlohmann::json(*usable) : nlohmann::json(nullptr);
  decide("sdnq_pin_admission",
         {{"candidate_bytes", all},
          {"candidate_bytes_by_role", by_role},
          {"loader_pinned_bytes", existing},
          {"pin_weight_budget_gb", config_.pin_weight_budget_gb},
          {"ratio_clamped", ratio},
          {"max_pin_weight_budget_gb", config_.max_pin_weight_budget_gb},
          {"ceiling_bytes", ceiling},
          {"available_source", ram_source},
          {"usable_ram_bytes", usable_json},
          {"new_pin_budget_bytes", budget}},
         fmt::format("packed/scale/auxiliary candidates {}, ceiling {}, loader pins {}, new pins "
                     "up to {}",
                     gib(all), gib(ceiling), gib(existing), gib(budget)));
  if (usable && *usable <= 0 && fresh > 0 && ceiling > existing) {
    decide("skip_insufficient_ram",
           {{"available_bytes", *available},
            {"available_source", ram_source},
            {"usable_bytes", *usable},
            {"candidate_bytes", fresh}},
           fmt::format("usable RAM {} leaves no room for new pins", gib(*usable)));
  }
  if (existing > ceiling) {
    plan_.pin_excess_bytes = existing - ceiling;
    decide("sdnq_pin_excess",
           {{"loader_pinned_bytes", existing},
            {"ceiling_bytes", ceiling},
            {"excess_bytes", plan_.pin_excess_bytes}},
           fmt::format("the loader already pinned {} beyond the ceiling {}; kept, not unpinned",
                       gib(plan_.pin_excess_bytes), gib(ceiling)));
  }
}

void Planner::pin_selected(const std::vector<TensorRef>& candidates, std::int64_t budget) {
  std::vector<std::int64_t> bytes;
  std::int64_t total = 0;
  for (TensorRef ref : candidates) {
    bytes.push_back(tensor(ref).bytes);
    total += tensor(ref).bytes;
  }
  std::vector<std::size_t> chosen;
  if (budget >= total) {
    chosen.resize(candidates.size());
    std::iota(chosen.begin(), chosen.end(), std::size_t{0});
  } else if (budget > 0) {
    chosen =
        greedy_fill(selection_order(bytes, config_.pin_weight_selection, budget), bytes, budget);
  }
  for (std::size_t i : chosen) {
    plan_.modules[candidates[i].module].tensors[candidates[i].tensor].pin = true;
    plan_.pinned_bytes += bytes[i];
  }
}

void Planner::build_stream_units() {
  std::vector<StreamUnit>& units = plan_.stream_units;
  auto tensor_name = [&](TensorRef ref) {
    const std::string& module = name_of(ref.module);
    return module.empty() ? tensor(ref).name : module + "." + tensor(ref).name;
  };
  if (config_.route == Route::kDynamic) {
    // One unit per tensor, except SDNQ layers: one unit per layer (Note [SDNQ layer units]).
    for (TensorRef ref : streamed_) {
      const bool sdnq_layer = inv_.modules[ref.module].kind == ModuleKind::kSdnq;
      if (sdnq_layer && !units.empty() && units.back().tensors.back().module == ref.module) {
        units.back().tensors.push_back(ref);
        units.back().bytes += tensor(ref).bytes;
        continue;
      }
      units.push_back(
          {sdnq_layer ? name_of(ref.module) : tensor_name(ref), {ref}, tensor(ref).bytes});
    }
  } else {
    // Lookup only; units keep first-appearance (model) order.
    std::map<std::string, std::size_t> unit_of;
    std::vector<bool> block_member(n_, false);
    for (const BlockGroup& g : block_groups_) {
      for (std::size_t m : g.members) block_member[m] = true;
    }
    for (TensorRef ref : streamed_) {
      std::string key;
      if (config_.route == Route::kGroupLeaf) {
        key = name_of(ref.module);
      } else {
        std::optional<std::size_t> block;
        for (std::optional<std::size_t> cur = ref.module; cur; cur = parent_[*cur]) {
          if (block_member[*cur]) block = cur;
        }
        if (block) {
          key = name_of(*block);
        } else {
          const std::string& name = name_of(ref.module);
          key = name.substr(0, name.find('.'));
        }
      }
      auto [it, inserted] = unit_of.emplace(key, units.size());
      if (inserted) units.push_back({key, {}, 0});
      units[it->second].tensors.push_back(ref);
      units[it->second].bytes += tensor(ref).bytes;
    }
  }
  std::int64_t largest = 0;
  for (const StreamUnit& u : units) largest = std::max(largest, u.bytes);
  decide("stream_units",
         {{"route", to_string(config_.route)},
          {"units", units.size()},
          {"streamed_bytes", plan_.streamed_bytes},
          {"largest_unit_bytes", largest}},
         fmt::format("{} units over {} (largest {})", units.size(), gib(plan_.streamed_bytes),
                     gib(largest)));
}

// Routes that do not stream: a whole-component move, or nothing at all.
void Planner::plan_whole_route() {
  plan_.modules.resize(n_);
  const bool move = config_.route == Route::kDeviceMove;
  for (std::size_t m = 0; m < n_; ++m) {
    const ModuleInfo& mod = inv_.modules[m];
    ModulePlan& mp = plan_.modules[m];
    mp.name = mod.name;
    const bool keep = !move || skipped_[m];
    mp.placement = keep ? Placement::kSkipped : Placement::kDeviceOnce;
    mp.tensors.resize(mod.tensors.size());
    for (TensorPlan& tp : mp.tensors)
      tp.action = keep ? TensorAction::kKeep : TensorAction::kMoveOnce;
    (keep ? plan_.skipped_bytes : plan_.move_once_bytes) += mod.bytes();
  }
  decide(move ? "route_device_move" : "route_none",
         {{"route", to_string(config_.route)}, {"bytes", inv_.total_bytes()}},
         move ? "the whole component moves to the device once"
              : "the component is left where the host put it");
}

Plan Planner::run() {
  throw_if_error(inv_.validate());
  check_inputs();
  plan_.mode = config_.execution_mode;
  plan_.route = config_.route;
  plan_.execute = config_.execution_mode != ExecutionMode::kPlan;
  const bool has_sdnq = inv_.has_sdnq_layers();
  const ExecutionMode effective = resolve_execution_mode(config_.execution_mode, inv_);
  plan_.sdnq = effective == ExecutionMode::kSdnqRuntime ||
               (config_.execution_mode == ExecutionMode::kPlan && has_sdnq);
  if (effective != config_.execution_mode) {
    plan_.mode = effective;
    decide("sdnq_runtime_auto", {{"requested", to_string(config_.execution_mode)}},
           "the model has SDNQ layers: their packed tensors stream with the sdnq_runtime rules");
  }
  if (config_.execution_mode == ExecutionMode::kPlan) {
    decide("plan_mode",
           {{"classified_as",
             to_string(plan_.sdnq ? ExecutionMode::kSdnqRuntime : ExecutionMode::kLinearRuntime)}},
           "plan mode: placements are reported, nothing is moved");
  }
  index_parents();
  apply_skip();
  if (config_.route == Route::kDeviceMove || config_.route == Route::kNone) {
    plan_whole_route();
    return std::move(plan_);
  }
  classify_tensors();
  apply_always_resident();
  compute_costs();
  resolve_resident_candidates();
  resolve_resident_budget();
  select_residents();
  assign_placements();
  plan_pinning();
  build_stream_units();
  return std::move(plan_);
}

}  // namespace

ExecutionMode resolve_execution_mode(ExecutionMode requested, const ModelInventory& inventory) {
  const bool has_sdnq = inventory.has_sdnq_layers();
  if (requested == ExecutionMode::kSdnqRuntime) {
    DDO_CHECK(has_sdnq, Code::kInvalidArgument,
              "execution_mode sdnq_runtime needs SDNQ layers, "
              "but ",
              inventory.model_class.empty() ? "the model" : inventory.model_class,
              " has none; use linear_runtime (or preset auto, which picks the runtime from the "
              "model)");
    return requested;
  }
  if (requested == ExecutionMode::kLinearRuntime && has_sdnq) return ExecutionMode::kSdnqRuntime;
  return requested;
}

Plan make_plan(const ModelInventory& inventory, const DynamicOffloadConfig& config,
               const PlanContext& context) {
  return Planner(inventory, config, context).run();
}

const char* to_string(Placement placement) {
  switch (placement) {
    case Placement::kResident:
      return "resident";
    case Placement::kStreamed:
      return "streamed";
    case Placement::kDeviceOnce:
      return "device_once";
    case Placement::kSkipped:
      return "skipped";
  }
  return "skipped";
}

const char* to_string(TensorAction action) {
  switch (action) {
    case TensorAction::kResident:
      return "resident";
    case TensorAction::kStream:
      return "stream";
    case TensorAction::kMoveOnce:
      return "move_once";
    case TensorAction::kKeep:
      return "keep";
  }
  return "keep";
}

std::int64_t balanced_headroom_bytes(std::int64_t total_vram_bytes) {
  // <= 8.5 GiB: 2.5 GiB, the middle of the spec's 2-3 GiB. The CUDA context, library workspaces
  // and one step's activations do not shrink with the card, so the small-card headroom cannot
  // go far below the 12 GiB tier's; 3 GiB would cost an 8 GiB card a further 6% of its memory.
  if (total_vram_bytes <= static_cast<std::int64_t>(8.5 * kGiB)) return 5 * kGiBBytes / 2;
  if (total_vram_bytes <= static_cast<std::int64_t>(12.5 * kGiB)) return 5 * kGiBBytes / 2;
  return std::max<std::int64_t>(3 * kGiBBytes,
                                static_cast<std::int64_t>(std::llround(0.15 * total_vram_bytes)));
}

std::vector<std::size_t> selection_order(const std::vector<std::int64_t>& bytes,
                                         Selection selection, std::int64_t budget_bytes) {
  const std::size_t n = bytes.size();
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  switch (selection) {
    case Selection::kFirst:
      return order;
    case Selection::kLargest:
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return bytes[a] > bytes[b]; });
      return order;
    case Selection::kSpread:
      break;
  }
  // Note [Spread order].
  if (n == 0 || budget_bytes <= 0) return order;
  const std::int64_t total = std::accumulate(bytes.begin(), bytes.end(), std::int64_t{0});
  std::size_t k = n;
  if (total > 0) {
    // floor(B / (T / n)) = floor(B * n / T), in long double to keep large byte counts exact enough.
    const long double fit = static_cast<long double>(budget_bytes) * static_cast<long double>(n) /
                            static_cast<long double>(total);
    k = static_cast<std::size_t>(std::min<long double>(static_cast<long double>(n), fit));
  }
  if (k == 0) return order;
  std::vector<std::size_t> out;
  std::vector<bool> taken(n, false);
  for (std::size_t i = 0; i < k; ++i) {
    const std::size_t index = (2 * i + 1) * n / (2 * k);
    taken[index] = true;
    out.push_back(index);
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (!taken[i]) out.push_back(i);
  }
  return out;
}

std::vector<std::size_t> balanced_order(const std::vector<std::int64_t>& bytes,
                                        const std::vector<double>& compute_ms,
                                        std::int64_t budget_bytes) {
  // Note [Balanced order].
  const std::size_t n = bytes.size();
  DDO_CHECK(compute_ms.size() == n, Code::kInvalidArgument, "balanced_order: ", n,
            " candidates but ", compute_ms.size(), " compute figures");
  const std::int64_t total = std::accumulate(bytes.begin(), bytes.end(), std::int64_t{0});
  const double total_ms = std::accumulate(compute_ms.begin(), compute_ms.end(), 0.0);
  const long double to_stream =
      static_cast<long double>(std::max<std::int64_t>(0, total - budget_bytes));
  std::vector<std::size_t> resident, streamed;
  long double so_far = 0.0L;
  double ms_so_far = 0.0;
  std::int64_t bytes_so_far = 0;
  for (std::size_t i = 0; i < n; ++i) {
    ms_so_far += compute_ms[i];
    bytes_so_far += bytes[i];
    // Without compute figures, bytes stand in for compute.
    const long double share = total_ms > 0.0 ? ms_so_far / total_ms
                              : total > 0    ? static_cast<long double>(bytes_so_far) / total
                                             : 1.0L;
    const long double target = to_stream * share;
    const long double with = so_far + static_cast<long double>(bytes[i]);
    if (to_stream > 0 && std::abs(with - target) <= std::abs(so_far - target)) {
      so_far = with;
      streamed.push_back(i);
    } else {
      resident.push_back(i);
    }
  }
  resident.insert(resident.end(), streamed.begin(), streamed.end());
  return resident;
}

std::vector<std::size_t> greedy_fill(const std::vector<std::size_t>& order,
                                     const std::vector<std::int64_t>& bytes,
                                     std::int64_t budget_bytes) {
  std::vector<std::size_t> chosen;
  std::int64_t used = 0;
  for (std::size_t i : order) {
    if (bytes[i] <= budget_bytes - used) {
      used += bytes[i];
      chosen.push_back(i);
    }
  }
  return chosen;
}

const Decision* Plan::find_decision(std::string_view name) const {
  for (const Decision& d : decisions) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

std::vector<std::string> Plan::resident_module_names() const {
  std::vector<std::string> out;
  for (const ModulePlan& m : modules) {
    if (m.placement == Placement::kResident) out.push_back(m.name);
  }
  return out;
}

nlohmann::json Plan::to_json() const {
  nlohmann::json mods = nlohmann::json::array();
  for (const ModulePlan& m : modules) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const TensorPlan& t : m.tensors) {
      tensors.push_back(
          {{"action", to_string(t.action)}, {"pin", t.pin}, {"loader_pinned", t.loader_pinned}});
    }
    mods.push_back({{"name", m.name},
                    {"placement", to_string(m.placement)},
                    {"always_resident", m.always_resident},
                    {"resident_candidate", m.resident_candidate},
                    {"tensors", std::move(tensors)}});
  }
  nlohmann::json units = nlohmann::json::array();
  for (const StreamUnit& u : stream_units) {
    nlohmann::json refs = nlohmann::json::array();
    for (TensorRef r : u.tensors) refs.push_back({r.module, r.tensor});
    units.push_back({{"name", u.name}, {"bytes", u.bytes}, {"tensors", std::move(refs)}});
  }
  nlohmann::json decisions_json = nlohmann::json::array();
  for (const Decision& d : decisions) {
    decisions_json.push_back({{"name", d.name}, {"inputs", d.inputs}, {"detail", d.detail}});
  }
  return {{"mode", to_string(mode)},
          {"route", to_string(route)},
          {"execute", execute},
          {"sdnq", sdnq},
          {"block_pattern", block_pattern},
          {"block_patterns", block_patterns},
          {"resident_patterns", resident_patterns},
          {"resident_budget_bytes", resident_budget_bytes},
          {"resident_used_bytes", resident_used_bytes},
          {"resident_candidate_bytes", resident_candidate_bytes},
          {"always_resident_bytes", always_resident_bytes},
          {"move_once_bytes", move_once_bytes},
          {"streamed_bytes", streamed_bytes},
          {"skipped_bytes", skipped_bytes},
          {"staging_estimate_bytes", staging_estimate_bytes},
          {"pin_candidate_bytes", pin_candidate_bytes},
          {"pin_budget_bytes", pin_budget_bytes},
          {"pinned_bytes", pinned_bytes},
          {"loader_pinned_bytes", loader_pinned_bytes},
          {"pin_excess_bytes", pin_excess_bytes},
          {"modules", std::move(mods)},
          {"stream_units", std::move(units)},
          {"decisions", std::move(decisions_json)}};
}

std::string Plan::summary() const {
  std::size_t counts[4] = {0, 0, 0, 0};
  for (const ModulePlan& m : modules) ++counts[static_cast<int>(m.placement)];
  std::string out = fmt::format("ddo plan: {}, route {}{}{}\n", to_string(mode), to_string(route),
                                execute ? "" : " (report only)", sdnq ? ", sdnq" : "");
  out += fmt::format("  modules: {} resident, {} streamed, {} device-once, {} skipped\n", counts[0],
                     counts[1], counts[2], counts[3]);
  out += fmt::format("  resident: budget {}, used {} of {} candidates; always-resident {}\n",
                     gib(resident_budget_bytes), gib(resident_used_bytes),
                     gib(resident_candidate_bytes), gib(always_resident_bytes));
  if (!block_patterns.empty()) {
    out += fmt::format("  blocks: {}\n", fmt::join(block_patterns, ", "));
  }
  out += fmt::format("  streamed {} in {} units; move-once {}; skipped {}\n", gib(streamed_bytes),
                     stream_units.size(), gib(move_once_bytes), gib(skipped_bytes));
  out += fmt::format("  pinned {} of {} (budget {}); loader-pinned {}", gib(pinned_bytes),
                     gib(pin_candidate_bytes), gib(pin_budget_bytes), gib(loader_pinned_bytes));
  if (pin_excess_bytes > 0) out += fmt::format(", excess {}", gib(pin_excess_bytes));
  out += "\n  decisions:\n";
  for (const Decision& d : decisions) out += fmt::format("    {}: {}\n", d.name, d.detail);
  return out;
}

}  // namespace ddo::core
