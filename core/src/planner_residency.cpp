// Planner phases that choose residents: candidates and their costs, the resident budget (manual,
// profile, calibration, balanced policy) and its fit to the card, and the selection orders.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddo/core/calibration.h"
#include "ddo/core/working_set.h"
#include "planner_internal.h"

// Note [Resident cost]
// A resident candidate (a block) costs what residency adds to the device: the bytes of its
// streamable tensors. Its small tensors (bias, norms) go to the device once either way and are
// counted in move_once_bytes; its always-resident parts (e.g. the `proj_out` Linear inside each
// FLUX single block, which the default always-resident pattern matches) are counted once, in
// always_resident_bytes, and never again in a block's cost. The balanced policy subtracts
// move-once and always-resident bytes from the VRAM before it hands the rest to candidates:
// docs/design/0009-benchmarks.md (section 4) records a system whose always-resident modules came on
// top of its budget and broke an 8 GiB cap.
//
// Note [Always-resident fits the card]
// The default always-resident pattern matches every module named proj_out, and FLUX has one in
// each of its 38 single blocks: 3.3 GiB that a 4 GiB card cannot hold next to the CUDA context,
// the staging ring and a step's activations (setup failed there before this rule). Always-resident
// is a preference for small modules that every step reads, not a promise: when the streamable
// bytes of always-resident modules exceed what the card leaves after the balanced headroom, the
// move-once tensors and the staging estimate, the largest of them stream instead until the rest
// fit (their small tensors stay on the device, as any streamed module's), and the decision
// always_resident_fit names them. Only the card's size decides this, never the resident budget:
// the budget is handed out after, from what is left.
//
// Note [Resident budget fits the card]
// A fixed resident budget was handed to residents as it was, on top of everything else the card
// holds: resident_module_budget_gb (set by code, an override, DDO_RESIDENT_MODULE_BUDGET_GB or a
// preset: 3 GiB in low_ram_safe, 6 GiB in wsl_compat and warm_process) and a saved profile's
// recommendation (calibrated on whichever card or cap it ran on). On the H200 at an 8 GiB cap,
// with a FLUX-sized model whose always-resident modules take 3.4 GiB, a 4 GiB budget made setup
// fail while moving residents, with an error that did not name the budget. The card holds, for
// budget-chosen residents, what the balanced policy hands out: usable VRAM - headroom -
// always-resident - move-once - staging estimate (resident_room). When the residents a fixed
// budget asks for, min(budget, candidate bytes), exceed that room, the budget becomes the room
// (0 when there is none) and the decision resident_budget_fit names the budget, where it came
// from, the figures and what to change. A budget that fits is used as given, and so is one above
// the room whose candidates all fit: the greedy fill places the same modules either way.
//
// The headroom is the budget source's. A config budget gets the balanced policy's
// (vram_headroom(): the CUDA context, library workspaces and a step's activations, which nothing
// here measures). A profile recommendation gets profile_vram_headroom_gb: it was computed as
// total - measured zero-resident peak - that headroom, and that peak already holds the
// always-resident, move-once and staging bytes and the activations, so a recommendation measured
// on this card always fits and is used unchanged. The table headroom would cut it: at a 16 GiB
// cap the W1-py calibration recommends 9.04 GiB (peak 5.96 GiB) where the balanced room is
// 8.9 GiB. A recommendation measured on a larger card is cut to what this card holds after the
// profile headroom; its activations are not subtracted, as the context carries the budget only,
// not the peak it was derived from.
//
// Only a card of known size is fitted: a device that reported its memory, or vram_cap_gb. Plan
// mode without a cap and the host simulation ("sim") without a cap keep the budget as given: the
// simulated arena has no CUDA context, and tests size it to tiny models (0.25 GiB), where the
// headroom table alone would take every resident away. A cap on the simulation emulates a card.
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
// Note [Estimated compute]
// Without a profile nothing has been measured, and index-even spreading assumes that compute
// follows bytes: on FLUX at a 16 GiB cap that left the double blocks copy-bound and the step at
// 1.18x the calibrated one (0.231 s against 0.195 s, W1-py on the H200). The first run therefore
// places residents by Note [Balanced order] with an estimate: every candidate does the same work
// per step. Weight shapes alone cannot tell more (a Linear's work is its bytes times the rows it
// sees, and the rows are only known once the model runs), but the estimate holds for the models
// ddo is for, because their designers balance compute per block: FLUX's double and single blocks
// both spend about 1.3 TFLOP per step at 4096 + 512 tokens (the double block's extra bytes are
// the text stream, which sees 512 tokens, and the modulation Linears, which see one row), a
// UNet's levels trade channels for resolution (C^2 * H * W stays about constant), and
// Wan/LTX/SD3-style transformers repeat one block. Where blocks have the same size the estimate
// places residents as index-even spreading does. A calibration measures the real figures and a
// saved profile replaces the estimate (decision balanced_order, "source": "measured"); a profile
// missing a candidate's figure (the model changed) falls back to the estimate and names it.
//

namespace ddo::core {
namespace planner_internal {
namespace {

// The host-simulation device ("sim", "sim:N"), whose capacity is an arena, not a card.
bool is_host_simulation(const std::string& device) {
  const std::optional<std::string> normalized = normalize_calibration_device(device);
  return normalized && normalized->starts_with("sim:");
}

// GiB rounded down to 2 decimals: a figure to write into a config field that still fits.
double gib_floor(std::int64_t bytes) {
  return std::floor(bytes_to_gib(bytes) * 100.0) / 100.0;
}

}  // namespace

std::vector<std::size_t> spread_indices(std::size_t n, std::size_t k) {
  // Note [Spread order].
  std::vector<std::size_t> out;
  k = std::min(k, n);
  out.reserve(k);
  for (std::size_t i = 0; i < k; ++i) out.push_back((2 * i + 1) * n / (2 * k));
  return out;
}

void Planner::compute_costs() {
  // Always-resident parts cost nothing extra to a block (Note [Resident cost]).
  subtree_cost_.assign(n_, 0);
  move_once_bytes_ = 0;
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

void Planner::fit_always_resident() {
  // Note [Always-resident fits the card].
  const std::int64_t total = usable_vram();
  if (total <= 0 || always_resident_bytes_ == 0) return;
  std::int64_t streamable = 0, fixed = 0;
  std::vector<std::size_t> movable;
  for (std::size_t m = 0; m < n_; ++m) {
    if (!always_resident_[m]) continue;
    streamable += own_cost_[m];
    fixed += inv_.modules[m].bytes() - own_cost_[m];
    if (own_cost_[m] > 0) movable.push_back(m);
  }
  const std::int64_t headroom = vram_headroom();
  const std::int64_t staging = staging_estimate(/*with_always_resident=*/true);
  const std::int64_t room = total - headroom - move_once_bytes_ - fixed - staging;
  if (streamable <= room) return;
  // Largest first, later ones first among equals: the fewest modules leave, and the first blocks
  // of a list (which run while the copy stream has nothing queued yet) keep theirs.
  std::stable_sort(movable.begin(), movable.end(), [&](std::size_t a, std::size_t b) {
    return own_cost_[a] != own_cost_[b] ? own_cost_[a] > own_cost_[b] : a > b;
  });
  std::vector<std::string> demoted;
  std::int64_t demoted_bytes = 0;
  for (std::size_t m : movable) {
    if (streamable <= room) break;
    always_resident_[m] = false;
    streamable -= own_cost_[m];
    demoted_bytes += own_cost_[m];
    demoted.push_back(name_of(m));
  }
  always_resident_bytes_ = 0;
  for (std::size_t m = 0; m < n_; ++m) {
    if (always_resident_[m]) always_resident_bytes_ += inv_.modules[m].bytes();
  }
  compute_costs();  // the demoted modules' weights now stream and count in their blocks
  decide("always_resident_fit",
         {{"total_vram_bytes", total},
          {"headroom_bytes", headroom},
          {"move_once_bytes", move_once_bytes_},
          {"staging_bytes", staging},
          {"room_bytes", std::max<std::int64_t>(0, room)},
          {"demoted", names_json(demoted)},
          {"modules_demoted", demoted.size()},
          {"demoted_bytes", demoted_bytes},
          {"always_resident_bytes", always_resident_bytes_}},
         fmt::format("{} always-resident modules ({}) stream instead: total {} - headroom {} - "
                     "move-once {} - staging {} leaves {} for them",
                     demoted.size(), gib(demoted_bytes), gib(total), gib(headroom),
                     gib(move_once_bytes_), gib(staging), gib(std::max<std::int64_t>(0, room))));
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

std::int64_t Planner::usable_vram() const {
  std::int64_t total = ctx_.total_vram_bytes;
  const std::int64_t cap = field_bytes(config_.vram_cap_gb, "vram_cap_gb");
  if (cap > 0) total = total > 0 ? std::min(total, cap) : cap;
  return total;
}

std::int64_t Planner::vram_headroom() const {
  return config_.auto_vram_headroom_gb > 0
             ? field_bytes(config_.auto_vram_headroom_gb, "auto_vram_headroom_gb")
             : balanced_headroom_bytes(usable_vram());
}

std::int64_t Planner::staging_estimate(bool with_always_resident) {
  // The units this route streams (build_stream_units): tensors (packed layers whole) on the dynamic
  // route, leaf modules or blocks on the classic ones. Residents are not known yet, so every
  // streamable byte counts as streamed: the window is bounded by it, an upper bound is enough.
  // With always-resident modules counted, only their largest unit counts: the estimate is the
  // staging that keeps them resident, or the staging for any one of them that has to stream.
  std::int64_t largest = 0, streamed = 0;
  const char* unit = "tensor";
  for (std::size_t m = 0; m < n_; ++m) {
    if (skipped_[m] || (always_resident_[m] && !with_always_resident)) continue;
    const bool whole = config_.route == Route::kGroupLeaf ||
                       (plan_.packed && inv_.modules[m].kind == ModuleKind::kPacked);
    for (std::size_t t = 0; t < streamable_[m].size(); ++t) {
      if (!streamable_[m][t]) continue;
      const std::int64_t bytes = inv_.modules[m].tensors[t].bytes;
      if (!always_resident_[m]) streamed += bytes;
      if (!whole) largest = std::max(largest, bytes);
    }
    if (whole) largest = std::max(largest, own_cost_[m]);
  }
  if (config_.route == Route::kGroupLeaf) unit = "leaf module";
  if (config_.route == Route::kGroupBlock) {
    // A block the card cannot stage (three of them, Note [Working set]) streams by module.
    std::int64_t block = 0;
    for (const BlockGroup& g : find_block_groups()) {
      for (std::size_t m : g.members) block = std::max(block, subtree_cost_[m]);
    }
    const std::int64_t total = usable_vram();
    const std::int64_t room = total - vram_headroom() - always_resident_bytes_ - move_once_bytes_;
    split_blocks_ = !with_always_resident && total > 0 && min_staging_bytes(block) > room;
    if (split_blocks_) {
      split_reason_ = fmt::format(
          "group_block route split into modules: staging three blocks of {} needs {}, the card "
          "leaves {} after headroom, always-resident and move-once",
          gib(block), gib(min_staging_bytes(block)), gib(std::max<std::int64_t>(0, room)));
      unit = "leaf module";
      largest = 0;
      for (std::size_t m = 0; m < n_; ++m) {
        if (!skipped_[m] && !always_resident_[m]) largest = std::max(largest, own_cost_[m]);
      }
    } else {
      unit = "block";
      largest = std::max(largest, block);
    }
  }
  StagingRequest request;
  request.largest_unit_bytes = largest;
  request.streamed_bytes = streamed;
  request.one_unit_ahead = config_.route != Route::kDynamic;
  request.window_bytes =
      to_bytes_or_throw(config_.prefetch_window_mb, ByteUnit::kMiB, "prefetch_window_mb");
  request.staging_bytes = to_bytes_or_throw(config_.staging_mb, ByteUnit::kMiB, "staging_mb");
  StagingSize size = size_staging(request);
  std::string source = config_.staging_mb > 0 ? "staging_mb" : "window + 2 x largest unit";
  if (ctx_.staging_bytes) {
    size.staging_bytes = *ctx_.staging_bytes;
    source = "context";
  }
  if (!with_always_resident) {
    plan_.staging_estimate_bytes = size.staging_bytes;
    decide("working_set",
           {{"unit", unit},
            {"largest_unit_bytes", largest},
            {"streamable_bytes", streamed},
            {"window_bytes", size.window_bytes},
            {"staging_bytes", size.staging_bytes},
            {"source", source}},
           fmt::format("staging {} ({}): window {} + 2 x largest {} {}", gib(size.staging_bytes),
                       source, gib(size.window_bytes), unit, gib(largest)));
  }
  return size.staging_bytes;
}

Planner::ResidentRoom Planner::resident_room(std::int64_t headroom) const {
  ResidentRoom r;
  r.total = usable_vram();
  r.headroom = headroom;
  r.staging = plan_.staging_estimate_bytes;
  r.room = r.total - headroom - always_resident_bytes_ - move_once_bytes_ - r.staging;
  return r;
}

void Planner::fit_budget_to_card(FixedBudget source) {
  // Note [Resident budget fits the card].
  const std::int64_t budget = plan_.resident_budget_bytes;
  const bool card_known =
      config_.vram_cap_gb > 0 ||
      (ctx_.total_vram_bytes > 0 && !is_host_simulation(config_.execution_device));
  if (!card_known || budget <= 0) return;
  const bool profile = source == FixedBudget::kProfile;
  const ResidentRoom r = resident_room(
      profile ? field_bytes(config_.profile_vram_headroom_gb, "profile_vram_headroom_gb")
              : vram_headroom());
  const std::int64_t candidates = plan_.resident_candidate_bytes;
  if (std::min(budget, candidates) <= r.room) return;
  const std::int64_t fitted = std::max<std::int64_t>(0, r.room);
  plan_.resident_budget_bytes = fitted;

  const char* headroom_source = profile                             ? "profile_vram_headroom_gb"
                                : config_.auto_vram_headroom_gb > 0 ? "auto_vram_headroom_gb"
                                                                    : "table";
  std::string origin, what, to_change;
  if (profile) {
    origin = config_.profile_name.empty() ? std::string("saved profile")
                                          : fmt::format("saved profile '{}'", config_.profile_name);
    what = fmt::format("the recommendation of {}", origin);
    to_change = fmt::format(
        "the profile was measured on a larger card or cap: recalibrate it on this one "
        "(build_profile=true), or set resident_module_budget_gb to {:.2f} or less to override it",
        gib_floor(fitted));
  } else {
    origin = ctx_.resident_budget_origin.empty()
                 ? std::string("config field resident_module_budget_gb")
                 : ctx_.resident_budget_origin;
    what = ctx_.resident_budget_origin.empty()
               ? fmt::format("resident_module_budget_gb={}", config_.resident_module_budget_gb)
               : fmt::format("resident_module_budget_gb={} from {}",
                             config_.resident_module_budget_gb, ctx_.resident_budget_origin);
    to_change = fitted > 0 ? fmt::format(
                                 "set resident_module_budget_gb to {:.2f} or less (0 lets the "
                                 "balanced policy size it), or use a card or vram_cap_gb with "
                                 "more memory",
                                 gib_floor(fitted))
                           : std::string(
                                 "this card has no room for residents beside the working set: "
                                 "set resident_module_budget_gb to 0, or use a card or "
                                 "vram_cap_gb with more memory");
  }
  decide(
      "resident_budget_fit",
      {{"source", profile ? "profile" : "resident_module_budget_gb"},
       {"origin", origin},
       {"requested_budget_bytes", budget},
       {"candidate_bytes", candidates},
       {"total_vram_bytes", r.total},
       {"vram_cap_gb", config_.vram_cap_gb},
       {"headroom_bytes", r.headroom},
       {"headroom_source", headroom_source},
       {"always_resident_bytes", always_resident_bytes_},
       {"move_once_bytes", move_once_bytes_},
       {"staging_bytes", r.staging},
       {"room_bytes", fitted},
       {"budget_bytes", fitted}},
      fmt::format("resident budget {} ({}) does not fit the card, so residents get {}: total "
                  "{} - headroom {} ({}) - always-resident {} - move-once {} - staging {}; {}",
                  gib(budget), what, gib(fitted), gib(r.total), gib(r.headroom), headroom_source,
                  gib(always_resident_bytes_), gib(move_once_bytes_), gib(r.staging), to_change));
}

void Planner::resolve_resident_budget() {
  const std::int64_t candidates = plan_.resident_candidate_bytes;
  // diffusers-dynamic-offloader: calibration "forces the resident module budget to zero", so it
  // comes before the manual budget; an ignored manual budget is recorded, never silently dropped.
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
    fit_budget_to_card(FixedBudget::kConfig);
    return;
  }
  if (ctx_.profile_budget_bytes) {
    // Note [Adapters under a saved profile]
    // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    // Adapters are not part of a profile's identity (docs/design/0007-named-profiles.md): a host
    // switches LoRAs between generations under one name. The recommendation is total - peak -
    // headroom, with the calibration's adapters inside that peak; a larger adapter loaded since
    // (rank 16 after rank 4) adds its extra bytes on top of the budget (Note [Adapter modules]),
    // and when the budget fits resident_room the run would peak above the card by them. The
    // profile does not record its adapters, so this run's adapter bytes come out of the
    // recommendation: the run peaks at most at total - headroom - the calibration's adapter bytes,
    // whatever adapter is loaded, and a run with the calibration's own adapter keeps their bytes
    // (about 1% of a FLUX transformer at rank 16) fewer resident.
    const std::int64_t budget =
        std::max<std::int64_t>(0, *ctx_.profile_budget_bytes - adapter_bytes_);
    plan_.resident_budget_bytes = budget;
    decide("resident_budget_profile",
           {{"profile_budget_bytes", *ctx_.profile_budget_bytes},
            {"adapter_bytes", adapter_bytes_},
            {"budget_bytes", budget},
            {"profile_name", config_.profile_name}},
           adapter_bytes_ > 0
               ? fmt::format("saved profile recommendation {} less the adapters' {} replaces the "
                             "heuristic",
                             gib(*ctx_.profile_budget_bytes), gib(adapter_bytes_))
               : fmt::format("saved profile recommendation {} replaces the heuristic",
                             gib(plan_.resident_budget_bytes)));
    fit_budget_to_card(FixedBudget::kProfile);
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

  const bool manual_headroom = config_.auto_vram_headroom_gb > 0;
  const ResidentRoom r = resident_room(vram_headroom());
  const std::int64_t total = r.total, headroom = r.headroom, staging = r.staging, room = r.room;
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
  // Note [Balanced order] with measured compute per candidate (a profile), else Note [Estimated
  // compute]: the same work for every candidate.
  bool balanced = false;
  if (config_.resident_module_selection == Selection::kSpread) {
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
    const bool measured = missing.empty();
    if (!measured) compute.assign(candidates_.size(), 1.0);
    balanced = true;
    std::string detail;
    if (measured) {
      detail = "residents placed by measured compute per candidate (saved profile)";
    } else if (ctx_.candidate_compute_ms.empty()) {
      detail =
          "no measured compute (no profile): residents placed by an estimate, the same work "
          "for every candidate (Note [Estimated compute])";
    } else {
      detail = fmt::format(
          "the profile has no measured compute for candidate '{}': residents "
          "placed by the estimate, the same work for every candidate",
          missing);
    }
    decide("balanced_order",
           {{"measured_candidates", ctx_.candidate_compute_ms.size()},
            {"candidates", candidates_.size()},
            {"source", measured ? "measured" : "estimate"},
            {"missing", missing},
            {"used", true}},
           detail);
    order = balanced_order(costs, compute, budget);
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
          {"balanced", balanced},
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

}  // namespace planner_internal

std::int64_t balanced_headroom_bytes(std::int64_t total_vram_bytes) {
  // <= 8.5 GiB: 2.5 GiB, the middle of the 2-3 GiB of docs/design/0006-configuration.md, section 6.
  // The CUDA context, library workspaces and one step's activations do not shrink with the card, so
  // the small-card headroom cannot go far below the 12 GiB tier's; 3 GiB would cost an 8 GiB card a
  // further 6% of its memory.
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
  std::vector<std::size_t> out = planner_internal::spread_indices(n, k);
  std::vector<bool> taken(n, false);
  for (std::size_t index : out) taken[index] = true;
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

}  // namespace ddo::core
