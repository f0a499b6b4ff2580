// Planner phases that match module names: the skip and always-resident patterns, and the auto
// block pattern (the repeated block lists).
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "planner_internal.h"

// Note [Auto block pattern]
// The residency pattern `auto` takes the one repeated list (`<prefix>.<n>`, >= 2 members with
// streamable weights) with the most bytes. A FLUX transformer has two (19 double blocks, 38 single
// blocks); with only the larger as candidates, 24 GiB buys nothing over 16
// (docs/design/0009-benchmarks.md, section 4). The `auto_all` token (or
// PlanContext::all_block_lists) makes every qualifying list a candidate, largest first, dropping
// lists nested inside a member of a list already taken (`blocks.3.ff.net.0`, `blocks.3.ff.net.2`
// inside `blocks.3`). A root whose children are `0`, `1`, ... (a Sequential) gives the prefix ""
// and the pattern `^[0-9]+$`.

namespace ddo::core::planner_internal {

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

bool Planner::flagged_or_ancestor(std::size_t m, const std::vector<bool>& flags) const {
  for (std::optional<std::size_t> cur = m; cur; cur = parent_[*cur]) {
    if (flags[*cur]) return true;
  }
  return false;
}

void Planner::mark_with_descendants(const std::function<bool(std::size_t)>& matches,
                                    std::vector<bool>* flags,
                                    std::vector<std::string>* matched) const {
  std::vector<bool> direct(n_, false);
  for (std::size_t m = 0; m < n_; ++m) {
    if (matches(m)) {
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
  mark_with_descendants([&](std::size_t m) { return patterns.search(name_of(m)); }, &skipped_,
                        &matched);
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

// Note [Adapter modules]
// ~~~~~~~~~~~~~~~~~~~~~~
// PEFT (and diffusers' load_lora_adapter / load_lora_weights through it) adds a layer's adapter
// as small modules beside its base: `to_q.lora_A.<adapter>` and `to_q.lora_B.<adapter>` (rank r
// by the layer's width: a rank-16 adapter on a FLUX transformer is about 1% of its bytes), DoRA's
// `lora_magnitude_vector`, an Embedding's `lora_embedding_A/B`. They are resident on the
// execution device whatever the patterns say, on top of the budget like
// always_resident_modules_pattern and counted in always_resident_bytes: streamed, every adapter
// would be a unit of a few KiB copied per step, fusing (B @ A per layer) would read each through
// the scheduler, and an adapter being trained needs its weights where its gradient is made
// (Note [Training under offload] in torch/src/attach_plan.cpp). skip_modules_pattern still wins.
//
// Which modules: those with a name component equal to one of PEFT's LoraLayer.adapter_layer_names
// (lora_A, lora_B, lora_embedding_A, lora_embedding_B, lora_magnitude_vector), or to diffusers'
// own non-PEFT `lora_layer` (LoRACompatibleLinear/Conv, diffusers/models/lora.py), together with
// everything inside them. Exact names, not "a component starting with lora": kohya's lora_up and
// lora_down are checkpoint keys that diffusers converts to PEFT's names before it builds modules,
// and a model's own module that happens to start with "lora" is not an adapter. The same rule
// decides what the planner keeps resident (below), what quantize= keeps dense
// (torch/src/attach_quantize.cpp) and which tensors added after an attach ddo places as adapters
// (python/ddo/adapters.py, through ddo._C.is_adapter_module).
void Planner::apply_always_resident() {
  always_resident_.assign(n_, false);
  // Marks the modules `patterns` match and their descendants; adds the bytes of those newly
  // marked to always_resident_bytes_ and records the decision `what`.
  std::vector<bool> holds_bytes(n_, false);  // the module or a descendant has tensors
  for (std::size_t m = 0; m < n_; ++m) {
    if (inv_.modules[m].bytes() == 0) continue;
    for (std::optional<std::size_t> cur = m; cur && !holds_bytes[*cur]; cur = parent_[*cur]) {
      holds_bytes[*cur] = true;
    }
  }
  // `with_bytes`: list only matched modules that hold bytes (PEFT adds an empty lora_embedding_A
  // to every Linear it wraps).
  auto mark = [&](const std::function<bool(std::size_t)>& direct, nlohmann::json rule,
                  const char* what, const char* summary, bool with_bytes) {
    std::vector<bool> flags;
    std::vector<std::string> matched;
    mark_with_descendants(direct, &flags, &matched);
    std::int64_t bytes = 0;
    for (std::size_t m = 0; m < n_; ++m) {
      if (skipped_[m]) flags[m] = false;  // skip wins: the host owns those
      if (!flags[m] || always_resident_[m]) continue;
      always_resident_[m] = true;
      bytes += inv_.modules[m].bytes();
    }
    always_resident_bytes_ += bytes;
    if (std::string_view(what) == "adapters_resident") adapter_bytes_ = bytes;
    std::vector<std::string> kept;
    for (const std::string& name : matched) {
      auto index = inv_.module_index(name);
      if (!index || !flags[*index]) continue;
      if (with_bytes && !holds_bytes[*index]) continue;
      kept.push_back(name);
    }
    if (kept.empty()) return;
    nlohmann::json inputs = std::move(rule);
    inputs["matched"] = names_json(kept);
    inputs["modules_matched"] = kept.size();
    inputs["bytes"] = bytes;
    decide(what, std::move(inputs),
           fmt::format("{} modules ({}) {}", kept.size(), gib(bytes), summary));
  };
  if (!config_.always_resident_modules_pattern.empty()) {
    CompiledPatterns patterns =
        compile(config_.always_resident_modules_pattern, "always_resident_modules_pattern");
    mark([&](std::size_t m) { return patterns.search(name_of(m)); },
         {{"patterns", patterns.sources}}, "always_resident", "resident on top of the budget",
         false);
  }
  // Note [Adapter modules]: the outermost adapter module of each adapter (`to_q.lora_A`), whose
  // descendants follow it.
  mark(
      [&](std::size_t m) {
        return is_adapter_module(name_of(m)) &&
               !(parent_[m] && is_adapter_module(name_of(*parent_[m])));
      },
      {{"names", adapter_module_names()}}, "adapters_resident",
      "of adapters (LoRA) resident on top of the budget", true);
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

}  // namespace ddo::core::planner_internal

namespace ddo::core {

const std::vector<std::string>& adapter_module_names() {
  static const std::vector<std::string> names = {
      "lora_A",    "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
      "lora_layer"};
  return names;
}

std::string_view adapter_component(std::string_view module_name) {
  const std::vector<std::string>& names = adapter_module_names();
  for (std::size_t begin = 0; begin <= module_name.size();) {
    std::size_t end = module_name.find('.', begin);
    if (end == std::string_view::npos) end = module_name.size();
    const std::string_view component = module_name.substr(begin, end - begin);
    if (std::find(names.begin(), names.end(), component) != names.end()) return component;
    begin = end + 1;
  }
  return {};
}

}  // namespace ddo::core
