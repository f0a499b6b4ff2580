#include "ddo/torch/module_tree.h"

#include <typeinfo>

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "ddo/core/packed_format.h"
#include "ddo/sdnq/linear.h"
#include "ddo/sdnq/packed_format.h"
#include "loader_pins.h"

namespace ddo::adapter {
namespace {

core::ModuleKind detect_kind(const torch::nn::Module& module) {
  // Before the Linear rule: an SDNQ layer streams its packed tensors, not a dense weight.
  if (dynamic_cast<const sdnq::SdnqLinearImpl*>(&module) != nullptr) {
    return core::ModuleKind::kPacked;
  }
  if (dynamic_cast<const torch::nn::LinearImpl*>(&module) != nullptr) {
    return core::ModuleKind::kLinear;
  }
  if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&module) != nullptr) {
    return core::ModuleKind::kEmbedding;
  }
  if (dynamic_cast<const torch::nn::Conv1dImpl*>(&module) != nullptr ||
      dynamic_cast<const torch::nn::Conv2dImpl*>(&module) != nullptr ||
      dynamic_cast<const torch::nn::Conv3dImpl*>(&module) != nullptr) {
    return core::ModuleKind::kConv;
  }
  return core::ModuleKind::kOther;
}

}  // namespace

std::string module_class_name(const torch::nn::Module& module) {
  // Module::name() is the demangled dynamic type unless the module set its own name.
  return module.name();
}

ModuleTree module_tree_from(torch::nn::Module& model) {
  ModuleTree tree;
  tree.model_class = module_class_name(model);
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const std::shared_ptr<torch::nn::Module>& module = item.value();
    ModuleEntry entry;
    entry.name = item.key();
    entry.class_name = module_class_name(*module);
    entry.kind = detect_kind(*module);
    entry.stock_class =
        entry.kind != core::ModuleKind::kLinear || typeid(*module) == typeid(torch::nn::LinearImpl);
    if (const auto* sdnq_layer = dynamic_cast<const sdnq::SdnqLinearImpl*>(module.get())) {
      entry.sdnq_layout = sdnq_layer->layout().encode();
    }
    entry.is_leaf = module->children().empty();
    entry.training = module->is_training();
    for (const auto& p : module->named_parameters(/*recurse=*/false)) {
      if (p.value().defined()) entry.tensors.push_back({p.key(), p.value(), true});
    }
    for (const auto& b : module->named_buffers(/*recurse=*/false)) {
      if (b.value().defined()) entry.tensors.push_back({b.key(), b.value(), false});
    }
    tree.entries.push_back(std::move(entry));
  }
  return tree;
}

std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return "float32";
    case c10::ScalarType::Double:
      return "float64";
    case c10::ScalarType::Half:
      return "float16";
    case c10::ScalarType::BFloat16:
      return "bfloat16";
    case c10::ScalarType::Byte:
      return "uint8";
    case c10::ScalarType::Char:
      return "int8";
    case c10::ScalarType::Short:
      return "int16";
    case c10::ScalarType::Int:
      return "int32";
    case c10::ScalarType::Long:
      return "int64";
    case c10::ScalarType::Bool:
      return "bool";
    case c10::ScalarType::Float8_e4m3fn:
      return "float8_e4m3fn";
    case c10::ScalarType::Float8_e5m2:
      return "float8_e5m2";
    default:
      return c10::toString(type);
  }
}

core::ModelInventory to_inventory(const ModuleTree& tree, const c10::Device& execution_device) {
  core::ModelInventory inv;
  inv.model_class = tree.model_class;
  inv.modules.reserve(tree.entries.size());
  // A device apart from the host's memory: a tensor may already be on it, and pinning matters.
  const bool apart = !execution_device.is_cpu();
  // The adapter's packed layers are SDNQ's (SdnqLinear, the Python gatherer's kind "sdnq",
  // quantize= copies); their tensor roles are the format's registered facts.
  sdnq::register_packed_format();
  const core::PackedFormat& sdnq_format = sdnq::packed_format();
  for (const ModuleEntry& entry : tree.entries) {
    core::ModuleInfo info;
    info.name = entry.name;
    info.class_name = entry.class_name;
    info.kind = entry.kind;
    info.is_leaf = entry.is_leaf;
    if (entry.kind == core::ModuleKind::kPacked) info.packed_format = sdnq_format.name;
    for (const TensorSlot& slot : entry.tensors) {
      const at::Tensor& t = slot.tensor;
      core::TensorInfo ti;
      ti.name = slot.name;
      ti.shape.assign(t.sizes().begin(), t.sizes().end());
      ti.dtype = dtype_name(t.scalar_type());
      ti.bytes = static_cast<std::int64_t>(t.numel()) * static_cast<std::int64_t>(t.element_size());
      ti.is_parameter = slot.is_parameter;
      ti.on_device = apart && t.device() == execution_device;
      // The deferred loader's pins are known by their storage (Note [Loader pins]), on any
      // device; asking another CPU tensor whether it is pinned touches the device's hooks, only
      // worth it for a device apart from the host.
      ti.already_pinned =
          internal::is_pinned_loader_tensor(t) || (apart && t.device().is_cpu() && t.is_pinned());
      if (entry.kind == core::ModuleKind::kPacked) ti.packed_role = sdnq_format.role_for(slot.name);
      info.tensors.push_back(std::move(ti));
    }
    inv.modules.push_back(std::move(info));
  }
  return inv;
}

}  // namespace ddo::adapter
