/// \file
/// ModelInventory: a plain, torch-free description of a model, the planner's only input about it.
///
/// The adapter walks a LibTorch or Python module once at `enable_offload` and writes down every
/// module (dotted name, class, kind) with its direct parameters and buffers (shape, dtype, bytes,
/// whether a loader already pinned it, its role in a packed layer). The planner (planner.h) reads
/// nothing else, so plans can be built, tested and inspected without torch: tests write inventories
/// in C++ or JSON.
///
/// ```
/// ddo::core::ModelInventory inv;
/// inv.model_class = "MyDiT";
/// inv.modules.push_back({"", "MyDiT", ModuleKind::kOther, /*is_leaf=*/false, {}});
/// inv.modules.push_back({"proj", "Linear", ModuleKind::kLinear, true,
///                        {{"weight", {64, 64}, "bfloat16", 8192, true}}});
/// inv.total_bytes();                 // 8192
/// inv.find_module("proj")->kind;     // ModuleKind::kLinear
/// ModelInventory back;
/// ddo::throw_if_error(ModelInventory::from_json(inv.to_json(), &back));  // back == inv
/// ```
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/status.h"

namespace ddo::core {

/// What a module computes, as far as streaming is concerned (docs/design/0006-configuration.md,
/// section 1).
enum class ModuleKind {
  kLinear,     ///< dense Linear: 2-D weight [out, in]
  kEmbedding,  ///< Embedding: 2-D weight [num, dim]
  kConv,       ///< Conv1d/2d/3d: weight of ndim >= 3
  kPacked,     ///< a packed (quantized) Linear of some format (ModuleInfo::packed_format)
  kOther,      ///< anything else (norms, containers, activations, custom layers)
};

/// The part a tensor plays in a packed layer, whatever its format; kNone for bias and for every
/// tensor of other modules. A format maps its tensor names to these (packed_format.h), so the
/// planner streams a layer's packed tensors together without knowing the format.
enum class PackedRole {
  kNone,
  kPackedWeight,  ///< the packed weight (e.g. SDNQ uint4: two values per byte)
  kScale,         ///< per-group (or per-block) scales
  kZeroPoint,     ///< per-group zero points or minimums (asymmetric types)
  kLowRankUp,     ///< low-rank correction, up factor (SDNQ's svd_up)
  kLowRankDown,   ///< low-rank correction, down factor (SDNQ's svd_down)
  kAuxiliary,     ///< other tensors the quantized forward reads (second-level scales, ...)
};

const char* to_string(ModuleKind kind);  ///< "linear", "conv", ...: the inventory JSON's spelling
const char* to_string(PackedRole role);  ///< the inventory JSON's spelling
/// Parse the names written by to_string; kInvalidArgument naming the valid ones otherwise. The
/// kind also reads "sdnq" as kPacked: the kind the Python gatherer writes for an SDNQ layer.
Status parse_module_kind(std::string_view text, ModuleKind* out);
/// See parse_module_kind; also reads "svd_up" and "svd_down" (SDNQ's names of the factors).
Status parse_packed_role(std::string_view text, PackedRole* out);

/// One direct parameter or buffer of a module.
struct TensorInfo {
  std::string name;                 ///< local name, e.g. "weight"
  std::vector<std::int64_t> shape;  ///< sizes; empty for a scalar
  std::string dtype;                ///< e.g. "bfloat16", "uint8"
  std::int64_t bytes = 0;           ///< storage bytes of this tensor (numel * element size)
  bool is_parameter = true;         ///< false: a buffer
  bool already_pinned = false;      ///< pinned by someone else (e.g. the loader); ddo keeps it
  bool on_device = false;  ///< already on the execution device when the inventory was taken
  PackedRole packed_role = PackedRole::kNone;  ///< its part in a packed layer

  /// Number of dimensions.
  std::size_t ndim() const { return shape.size(); }
  bool operator==(const TensorInfo&) const = default;  ///< field by field
};

/// One module; `tensors` are its direct parameters and buffers only (children list their own).
struct ModuleInfo {
  std::string name;                      ///< dotted name; "" is the root
  std::string class_name;                ///< e.g. "torch::nn::LinearImpl"; for reports and patterns
  ModuleKind kind = ModuleKind::kOther;  ///< decides which ops ddo intercepts for it
  bool is_leaf = true;                   ///< no child modules
  std::vector<TensorInfo> tensors;       ///< direct parameters and buffers
  /// For kPacked: the format's name ("sdnq"), whose facts packed_format.h registers; "" otherwise.
  /// Last, so that positional initializers of dense modules leave it out.
  std::string packed_format{};

  /// Sum of the direct tensors' bytes.
  std::int64_t bytes() const;
  bool operator==(const ModuleInfo&) const = default;  ///< field by field
};

/// The whole model, modules in model order (a parent before its children, as named_modules()
/// yields them). Names are unique.
struct ModelInventory {
  std::string model_class;          ///< fully qualified class name (C++) or qualified name (Python)
  std::vector<ModuleInfo> modules;  ///< model order

  std::int64_t total_bytes() const;  ///< sum over every module's direct tensors
  /// Any module of kind kPacked.
  bool has_packed_layers() const;
  /// An upper bound on the largest weight a packed layer materializes on the device while it
  /// runs: its dequantized [out, in] weight, `bytes_per_element` per value (the kernel path writes
  /// the result dtype; the reference path holds float32 intermediates too). Note [Dequantized
  /// temporaries] in inventory.cpp; 0 for a model without packed layers.
  std::int64_t largest_packed_temporary_bytes(std::int64_t bytes_per_element) const;
  /// How the weights of the ops ddo intercepts are stored, for a profile to say what it was
  /// measured with: the sorted, distinct dtypes of the Linear, Conv and Embedding weights and of
  /// the packed layers' packed weights, those prefixed by their format's name; joined by " + ",
  /// packed ones first. "bfloat16" for a bf16 model, "sdnq float8_e4m3fn + bfloat16" for one
  /// quantized to fp8 by SDNQ with layers kept dense.
  std::string weights_summary() const;
  /// Linear scan; the planner builds its own index once.
  const ModuleInfo* find_module(std::string_view name) const;
  /// The same as an index into `modules`.
  std::optional<std::size_t> module_index(std::string_view name) const;

  /// Names unique, bytes non-negative, shapes non-negative; kInvalidArgument naming the offender.
  Status validate() const;

  /// JSON shape: {"model_class": str, "modules": [{"name", "class_name", "kind", "is_leaf",
  /// "packed_format", "tensors": [{"name", "shape", "dtype", "bytes", "is_parameter",
  /// "already_pinned", "on_device", "packed_role"}]}]}. Optional members default as in
  /// ModuleInfo and TensorInfo. from_json also reads SDNQ's own spellings, which existing
  /// inventory files use: a module's kind "sdnq" (kPacked, format "sdnq") and a tensor's
  /// "sdnq_role".
  nlohmann::json to_json() const;
  /// Parses and validates; `out` is untouched on error.
  static Status from_json(const nlohmann::json& json, ModelInventory* out);

  bool operator==(const ModelInventory&) const = default;  ///< field by field
};

/// True when `name` is `ancestor` or lies below it in the dotted hierarchy ("" contains all).
bool is_within(std::string_view name, std::string_view ancestor);

}  // namespace ddo::core
