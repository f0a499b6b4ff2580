#include "ddo/core/inventory.h"

#include <algorithm>
#include <array>
#include <set>
#include <utility>

#include "ddo/core/packed_format.h"

namespace ddo::core {
namespace {

constexpr std::array<std::pair<ModuleKind, const char*>, 5> kModuleKindNames = {{
    {ModuleKind::kLinear, "linear"},
    {ModuleKind::kEmbedding, "embedding"},
    {ModuleKind::kConv, "conv"},
    {ModuleKind::kPacked, "packed"},
    {ModuleKind::kOther, "other"},
}};

constexpr std::array<std::pair<PackedRole, const char*>, 7> kPackedRoleNames = {{
    {PackedRole::kNone, "none"},
    {PackedRole::kPackedWeight, "packed_weight"},
    {PackedRole::kScale, "scale"},
    {PackedRole::kZeroPoint, "zero_point"},
    {PackedRole::kLowRankUp, "low_rank_up"},
    {PackedRole::kLowRankDown, "low_rank_down"},
    {PackedRole::kAuxiliary, "auxiliary"},
}};

// SDNQ's spellings, read and never written: the Python gatherer's kind of an SDNQ layer and the
// role names of existing inventory files. The kind's text is also the layer's format.
constexpr std::string_view kSdnqKind = "sdnq";
constexpr std::array<std::pair<PackedRole, const char*>, 2> kPackedRoleAliases = {{
    {PackedRole::kLowRankUp, "svd_up"},
    {PackedRole::kLowRankDown, "svd_down"},
}};

template <typename Enum, std::size_t N>
Status parse_name(const std::array<std::pair<Enum, const char*>, N>& table, std::string_view what,
                  std::string_view text, Enum* out) {
  std::string valid;
  for (const auto& [value, name] : table) {
    if (text == name) {
      *out = value;
      return Status::ok_status();
    }
    valid += valid.empty() ? "" : ", ";
    valid += name;
  }
  return {Code::kInvalidArgument,
          internal::str_cat(what, " '", text, "' is unknown; use one of: ", valid)};
}

// Reads an optional member with a default; a member of the wrong type is an error, never ignored.
template <typename T>
Status get_field(const nlohmann::json& object, const char* key, bool required, T* out,
                 std::string_view where) {
  auto it = object.find(key);
  if (it == object.end()) {
    if (required) {
      return {Code::kInvalidArgument,
              internal::str_cat(where, " has no '", key, "' member; add it")};
    }
    return Status::ok_status();
  }
  try {
    *out = it->template get<T>();
  } catch (const nlohmann::json::exception& e) {
    return {Code::kInvalidArgument,
            internal::str_cat(where, " member '", key, "' has the wrong type (", it->type_name(),
                              "): ", e.what())};
  }
  return Status::ok_status();
}

Status tensor_from_json(const nlohmann::json& json, std::string_view where, TensorInfo* out) {
  if (!json.is_object()) {
    return {Code::kInvalidArgument, internal::str_cat(where, " is not a JSON object")};
  }
  TensorInfo t;
  DDO_RETURN_IF_ERROR(get_field(json, "name", true, &t.name, where));
  DDO_RETURN_IF_ERROR(get_field(json, "shape", false, &t.shape, where));
  DDO_RETURN_IF_ERROR(get_field(json, "dtype", false, &t.dtype, where));
  DDO_RETURN_IF_ERROR(get_field(json, "bytes", true, &t.bytes, where));
  DDO_RETURN_IF_ERROR(get_field(json, "is_parameter", false, &t.is_parameter, where));
  DDO_RETURN_IF_ERROR(get_field(json, "already_pinned", false, &t.already_pinned, where));
  DDO_RETURN_IF_ERROR(get_field(json, "on_device", false, &t.on_device, where));
  std::string role = "none";
  DDO_RETURN_IF_ERROR(get_field(json, "sdnq_role", false, &role, where));
  DDO_RETURN_IF_ERROR(get_field(json, "packed_role", false, &role, where));
  DDO_RETURN_IF_ERROR(parse_packed_role(role, &t.packed_role));
  *out = std::move(t);
  return Status::ok_status();
}

Status module_from_json(const nlohmann::json& json, std::string_view where, ModuleInfo* out) {
  if (!json.is_object()) {
    return {Code::kInvalidArgument, internal::str_cat(where, " is not a JSON object")};
  }
  ModuleInfo m;
  DDO_RETURN_IF_ERROR(get_field(json, "name", true, &m.name, where));
  DDO_RETURN_IF_ERROR(get_field(json, "class_name", false, &m.class_name, where));
  std::string kind = "other";
  DDO_RETURN_IF_ERROR(get_field(json, "kind", false, &kind, where));
  DDO_RETURN_IF_ERROR(parse_module_kind(kind, &m.kind));
  if (kind == kSdnqKind) m.packed_format = kSdnqKind;
  DDO_RETURN_IF_ERROR(get_field(json, "packed_format", false, &m.packed_format, where));
  DDO_RETURN_IF_ERROR(get_field(json, "is_leaf", false, &m.is_leaf, where));
  auto tensors = json.find("tensors");
  if (tensors != json.end()) {
    if (!tensors->is_array()) {
      return {Code::kInvalidArgument,
              internal::str_cat(where, " member 'tensors' is not an array")};
    }
    for (std::size_t i = 0; i < tensors->size(); ++i) {
      TensorInfo t;
      DDO_RETURN_IF_ERROR(tensor_from_json(
          (*tensors)[i], internal::str_cat("module '", m.name, "' tensor ", i), &t));
      m.tensors.push_back(std::move(t));
    }
  }
  *out = std::move(m);
  return Status::ok_status();
}

}  // namespace

const char* to_string(ModuleKind kind) {
  for (const auto& [value, name] : kModuleKindNames) {
    if (value == kind) return name;
  }
  return "other";
}

const char* to_string(PackedRole role) {
  for (const auto& [value, name] : kPackedRoleNames) {
    if (value == role) return name;
  }
  return "none";
}

Status parse_module_kind(std::string_view text, ModuleKind* out) {
  if (text == kSdnqKind) {
    *out = ModuleKind::kPacked;
    return Status::ok_status();
  }
  return parse_name(kModuleKindNames, "module kind", text, out);
}

Status parse_packed_role(std::string_view text, PackedRole* out) {
  for (const auto& [value, name] : kPackedRoleAliases) {
    if (text == name) {
      *out = value;
      return Status::ok_status();
    }
  }
  return parse_name(kPackedRoleNames, "packed role", text, out);
}

bool is_within(std::string_view name, std::string_view ancestor) {
  if (ancestor.empty()) return true;
  if (name.size() < ancestor.size() || name.substr(0, ancestor.size()) != ancestor) return false;
  return name.size() == ancestor.size() || name[ancestor.size()] == '.';
}

std::int64_t ModuleInfo::bytes() const {
  std::int64_t total = 0;
  for (const TensorInfo& t : tensors) total += t.bytes;
  return total;
}

std::int64_t ModelInventory::total_bytes() const {
  std::int64_t total = 0;
  for (const ModuleInfo& m : modules) total += m.bytes();
  return total;
}

bool ModelInventory::has_packed_layers() const {
  return std::any_of(modules.begin(), modules.end(),
                     [](const ModuleInfo& m) { return m.kind == ModuleKind::kPacked; });
}

// Note [Dequantized temporaries]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A packed layer runs as dequantize-then-GEMM: while it runs, the device holds its dequantized
// weight, [out, in] in the result dtype, next to the packed bytes in staging; for SDNQ uint4
// that is four times the streamed unit. The working set must leave room for it (the staging
// window is sized from what is left after it, and a card that cannot hold it with the smallest
// staging is refused before anything moves), or the first forward runs out of memory on a card
// the plan said was large enough. The inventory does not carry a format's layout, so the count
// is taken from the packed weight: its element count times the values one element holds, a fact
// of the format (Note [Packed formats] in packed_format.cpp; SDNQ: two for a one-byte weight, as
// uint4 packs two values per byte and an int8 layer is over-counted by two, which only shrinks
// the window a little). A format nobody registered counts one value per element. The bytes per
// value are the caller's: the CUDA kernel writes the result dtype once (2 for bf16/fp16); the
// ATen reference (the host simulation, a GPU without a kernel image) holds float32 values and
// products beside the result, 10 in all.
std::int64_t ModelInventory::largest_packed_temporary_bytes(std::int64_t bytes_per_element) const {
  std::int64_t largest = 0;
  for (const ModuleInfo& m : modules) {
    if (m.kind != ModuleKind::kPacked) continue;
    const PackedFormat* format = find_packed_format(m.packed_format);
    for (const TensorInfo& t : m.tensors) {
      if (t.packed_role != PackedRole::kPackedWeight) continue;
      std::int64_t numel = 1;
      for (const std::int64_t d : t.shape) numel *= d;
      const std::int64_t values = format != nullptr ? format->values_in(t.dtype, numel) : numel;
      largest = std::max(largest, values * bytes_per_element);
    }
  }
  return largest;
}

const ModuleInfo* ModelInventory::find_module(std::string_view name) const {
  auto index = module_index(name);
  return index ? &modules[*index] : nullptr;
}

std::optional<std::size_t> ModelInventory::module_index(std::string_view name) const {
  for (std::size_t i = 0; i < modules.size(); ++i) {
    if (modules[i].name == name) return i;
  }
  return std::nullopt;
}

Status ModelInventory::validate() const {
  std::set<std::string_view> seen;
  for (const ModuleInfo& m : modules) {
    if (!seen.insert(m.name).second) {
      return {Code::kInvalidArgument,
              internal::str_cat("module name '", m.name, "' appears twice in the inventory of ",
                                model_class, "; names must be unique")};
    }
    std::set<std::string_view> tensor_names;
    for (const TensorInfo& t : m.tensors) {
      if (!tensor_names.insert(t.name).second) {
        return {Code::kInvalidArgument,
                internal::str_cat("tensor '", t.name, "' of module '", m.name, "' appears twice")};
      }
      if (t.bytes < 0) {
        return {Code::kInvalidArgument,
                internal::str_cat("tensor '", m.name, m.name.empty() ? "" : ".", t.name,
                                  "' has bytes=", t.bytes, "; bytes must be >= 0")};
      }
      for (std::int64_t d : t.shape) {
        if (d < 0) {
          return {Code::kInvalidArgument,
                  internal::str_cat("tensor '", m.name, m.name.empty() ? "" : ".", t.name,
                                    "' has a negative dimension ", d)};
        }
      }
    }
  }
  return Status::ok_status();
}

nlohmann::json ModelInventory::to_json() const {
  nlohmann::json mods = nlohmann::json::array();
  for (const ModuleInfo& m : modules) {
    nlohmann::json tensors_json = nlohmann::json::array();
    for (const TensorInfo& t : m.tensors) {
      tensors_json.push_back({{"name", t.name},
                              {"shape", t.shape},
                              {"dtype", t.dtype},
                              {"bytes", t.bytes},
                              {"is_parameter", t.is_parameter},
                              {"already_pinned", t.already_pinned},
                              {"on_device", t.on_device},
                              {"packed_role", to_string(t.packed_role)}});
    }
    nlohmann::json module_json = {{"name", m.name},
                                  {"class_name", m.class_name},
                                  {"kind", to_string(m.kind)},
                                  {"is_leaf", m.is_leaf},
                                  {"tensors", std::move(tensors_json)}};
    if (!m.packed_format.empty()) module_json["packed_format"] = m.packed_format;
    mods.push_back(std::move(module_json));
  }
  return {{"model_class", model_class}, {"modules", std::move(mods)}};
}

Status ModelInventory::from_json(const nlohmann::json& json, ModelInventory* out) {
  if (!json.is_object()) {
    return {Code::kInvalidArgument,
            internal::str_cat("an inventory must be a JSON object, got ", json.type_name())};
  }
  ModelInventory inv;
  DDO_RETURN_IF_ERROR(get_field(json, "model_class", false, &inv.model_class, "inventory"));
  auto mods = json.find("modules");
  if (mods == json.end() || !mods->is_array()) {
    return {Code::kInvalidArgument, "inventory has no 'modules' array; add one"};
  }
  for (std::size_t i = 0; i < mods->size(); ++i) {
    ModuleInfo m;
    DDO_RETURN_IF_ERROR(module_from_json((*mods)[i], internal::str_cat("module ", i), &m));
    inv.modules.push_back(std::move(m));
  }
  DDO_RETURN_IF_ERROR(inv.validate());
  *out = std::move(inv);
  return Status::ok_status();
}

std::string ModelInventory::weights_summary() const {
  std::set<std::string> packed;
  std::set<std::string> dense;
  for (const ModuleInfo& m : modules) {
    for (const TensorInfo& t : m.tensors) {
      if (m.kind == ModuleKind::kPacked && t.packed_role == PackedRole::kPackedWeight) {
        packed.insert((m.packed_format.empty() ? "packed" : m.packed_format) + " " + t.dtype);
      } else if (m.kind != ModuleKind::kPacked && m.kind != ModuleKind::kOther &&
                 t.name == "weight") {
        dense.insert(t.dtype);
      }
    }
  }
  std::string out;
  // Packed formats first: they say how the model computes.
  for (const std::set<std::string>* formats : {&packed, &dense}) {
    for (const std::string& f : *formats) out += out.empty() ? f : " + " + f;
  }
  return out;
}

}  // namespace ddo::core
