/// \file
/// ModuleTree: the torch-side description of a model that enable_offload works on.
///
/// ddo never touches module code. It needs, once at enable_offload, every module in model order
/// (a parent before its children) with its dotted name, class name, kind (what its weight op is:
/// Linear, Embedding, Conv, other) and its direct parameters and buffers as tensor handles. Those
/// handles are what ddo re-points (`tensor.set_data(...)`) into host slabs or device memory and
/// back, so the model keeps its own Parameter objects and Python sees the same tensors.
///
/// For LibTorch models the tree comes from `torch::nn::Module::named_modules()`, with the kind
/// detected from the stock module types. The Python glue builds the same structure from
/// `nn.Module.named_modules()` and passes kinds it detected itself. A TorchScript module
/// (`torch::jit::load` of a traced or scripted model) gives the same tree from its own
/// `named_modules()`, with the kind read from the qualified type name (see Note [TorchScript
/// modules] in jit_module.cpp).
///
/// ```
/// torch::nn::Sequential net(torch::nn::Linear(64, 64), torch::nn::ReLU());
/// ddo::adapter::ModuleTree tree = ddo::adapter::module_tree_from(*net);
/// // tree.entries[1].name == "0"; tree.entries[1].kind == ModuleKind::kLinear
/// // tree.entries[1].tensors[0].name == "weight"
/// ddo::core::ModelInventory inv = ddo::adapter::to_inventory(tree, c10::Device("cuda:0"));
///
/// torch::jit::Module traced = torch::jit::load("flux.pt");
/// ddo::adapter::ModuleTree jit_tree = ddo::adapter::module_tree_from(traced);
/// // jit_tree.model_class ==
/// //   "__torch__.diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"
/// // jit_tree.entries[i].class_name == "__torch__.torch.nn.modules.linear.Linear" for a Linear
/// ```
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "ddo/core/inventory.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace torch::jit {
struct Module;
}  // namespace torch::jit

namespace ddo::adapter {

/// One direct parameter or buffer of a module: a handle to the model's own tensor.
struct TensorSlot {
  std::string name;   ///< local name, e.g. "weight"
  at::Tensor tensor;  ///< shares storage with the model: replacing its data changes the model
  bool is_parameter = true;  ///< false for a buffer
};

/// One module of the model with its direct tensors (not its children's).
struct ModuleEntry {
  std::string name;        ///< dotted; "" is the root
  std::string class_name;  ///< "torch::nn::LinearImpl", "my::Block", or the Python class name
  /// Linear, Conv or Embedding: the ops ddo intercepts.
  core::ModuleKind kind = core::ModuleKind::kOther;
  bool is_leaf = true;  ///< no child modules
  /// In training mode (`module.training`, `is_training()`): a streamed weight that requires grad
  /// here is refused at attach (Note [Training under offload] in attach_plan.cpp).
  bool training = false;
  /// For a Linear: the framework's own class (Python `type(m) is nn.Linear`, LibTorch
  /// `torch::nn::LinearImpl`), not a subclass whose forward is its own and may not read the
  /// weight as a Linear does. quantize= serves stock Linears only (Note [Quantized dense weights]
  /// in attach_quantize.cpp); a subclass still streams as a Linear.
  bool stock_class = true;
  /// For an SDNQ layer: its layout code (sdnq::Layout::encode()), which the report's
  /// quantized_compute reads to say which path the layer takes; empty when the builder did not
  /// read it.
  std::vector<std::int64_t> sdnq_layout;
  std::vector<TensorSlot> tensors;  ///< direct parameters, then buffers
};

/// A model as enable_offload sees it, built once at setup from C++ or Python modules.
struct ModuleTree {
  std::string model_class;  ///< fully qualified class of the root (the profile identity uses it)
  std::vector<ModuleEntry> entries;  ///< model order; names unique
};

/// Walks a LibTorch module: named_modules() order, direct named_parameters / named_buffers, kinds
/// from torch::nn::LinearImpl, Conv1d/2d/3dImpl and EmbeddingImpl. Undefined tensors (a Linear
/// without bias) are left out.
ModuleTree module_tree_from(torch::nn::Module& model);

/// The demangled, fully qualified C++ class of a module ("ddo::adapter::testing::FluxDiTImpl").
std::string module_class_name(const torch::nn::Module& module);

/// Walks a TorchScript module: named_modules() order, direct parameters and buffers (attributes
/// that are neither are left out, as the Python glue leaves out plain tensor attributes), kinds
/// from the qualified type names of torch.nn's Linear, Conv1d/2d/3d and Embedding. The handles
/// share the module's slots, so re-pointing them changes what the interpreter reads.
ModuleTree module_tree_from(const torch::jit::Module& model);

/// The qualified type name of a TorchScript module without the mangling TorchScript adds when
/// one class is compiled or traced twice ("__torch__.torch.nn.modules.linear.___torch_mangle_7.
/// Linear" becomes "__torch__.torch.nn.modules.linear.Linear"), so profile identities stay stable.
std::string module_class_name(const torch::jit::Module& module);

/// The planner's view of the tree. `execution_device` marks tensors already there (on_device);
/// pinned CPU tensors are reported as already pinned (a loader's pins are kept).
core::ModelInventory to_inventory(const ModuleTree& tree, const c10::Device& execution_device);

/// The dtype spelling the inventory uses ("float32", "bfloat16", "uint8", ...).
std::string dtype_name(c10::ScalarType type);

}  // namespace ddo::adapter
