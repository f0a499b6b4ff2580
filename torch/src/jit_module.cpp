// TorchScript modules: the module tree of a torch::jit::Module and enable_offload over it.
//
// Note [TorchScript modules]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A C++ deployment of a diffusers model loads a traced (or scripted) file with torch::jit::load
// and runs it in the TorchScript interpreter. ddo needs nothing from the interpreter:
//
// - Tensors. A jit module keeps each parameter and buffer in an attribute slot of its object;
//   named_parameters(false) / named_buffers(false) hand out at::Tensor handles to the same
//   TensorImpl, so ddo's set_data re-points what the interpreter reads, and remove() puts the
//   original storage back, exactly as for a torch::nn::Module. Tensor attributes that are neither
//   parameters nor buffers are left out, as the Python glue leaves out plain tensor attributes.
// - Ops. The interpreter calls aten ops through the dispatcher, so ddo's kernels serve it. The
//   one difference: torch.jit.trace records a Conv's call as aten::_convolution (the op that
//   aten::convolution forwards to), not aten::convolution, so the interception covers
//   aten::_convolution too (intercept_conv.h); Linear is recorded as aten::linear, which
//   reaches aten::addmm / aten::mm as in eager mode.
// - Kinds. A jit type has no C++ class to dynamic_cast and no Python base classes, only its
//   qualified name: "__torch__." + the Python module path + the class. torch.nn's Linear, Conv
//   and Embedding are recognised by name; a user's subclass of nn.Linear (a different name) is
//   kOther, so its weight is moved or kept resident instead of streamed (correct, just not
//   streamed). Compiling or tracing one class twice in a process inserts "___torch_mangle_N"
//   into the name; it is removed, so the profile identity of a model does not depend on how many
//   models the exporting process traced before it.
// - Frozen modules. torch::jit::freeze (and optimize_for_inference) fold the parameters into
//   graph constants; such a module has nothing for ddo to re-point and is refused by name.
#include "ddo/torch/module_tree.h"

#include <algorithm>
#include <string>
#include <string_view>

#include <torch/csrc/jit/api/module.h>

#include "ddo/core/status.h"
#include "ddo/torch/enable_offload.h"

namespace ddo::adapter {
namespace {

constexpr std::string_view kMangleAtom = "___torch_mangle_";

// "__torch__.torch.nn.modules.linear.___torch_mangle_7.Linear" -> "...linear.Linear".
std::string demangle(std::string_view qualified) {
  std::string out;
  out.reserve(qualified.size());
  std::size_t start = 0;
  while (start <= qualified.size()) {
    std::size_t dot = qualified.find('.', start);
    if (dot == std::string_view::npos) dot = qualified.size();
    const std::string_view atom = qualified.substr(start, dot - start);
    if (atom.substr(0, kMangleAtom.size()) != kMangleAtom) {
      if (!out.empty()) out += '.';
      out += atom;
    }
    start = dot + 1;
  }
  return out;
}

core::ModuleKind detect_kind(std::string_view class_name) {
  static constexpr std::string_view kNn = "__torch__.torch.nn.modules.";
  if (class_name.substr(0, kNn.size()) != kNn) return core::ModuleKind::kOther;
  const std::string_view rest = class_name.substr(kNn.size());
  if (rest == "linear.Linear") return core::ModuleKind::kLinear;
  if (rest == "sparse.Embedding") return core::ModuleKind::kEmbedding;
  if (rest == "conv.Conv1d" || rest == "conv.Conv2d" || rest == "conv.Conv3d") {
    return core::ModuleKind::kConv;
  }
  return core::ModuleKind::kOther;
}

}  // namespace

std::string module_class_name(const torch::jit::Module& module) {
  return demangle(module.type()->name()->qualifiedName());
}

ModuleTree module_tree_from(const torch::jit::Module& model) {
  ModuleTree tree;
  tree.model_class = module_class_name(model);
  for (const auto& item : model.named_modules()) {
    const torch::jit::Module& module = item.value;
    ModuleEntry entry;
    entry.name = item.name;
    entry.class_name = module_class_name(module);
    entry.kind = detect_kind(entry.class_name);
    entry.is_leaf = module.children().size() == 0;
    entry.training = module.is_training();
    for (const auto& p : module.named_parameters(/*recurse=*/false)) {
      if (p.value.defined()) entry.tensors.push_back({p.name, p.value, true});
    }
    for (const auto& b : module.named_buffers(/*recurse=*/false)) {
      if (b.value.defined()) entry.tensors.push_back({b.name, b.value, false});
    }
    tree.entries.push_back(std::move(entry));
  }
  return tree;
}

std::unique_ptr<Offload> enable_offload(const torch::jit::Module& model,
                                        const OffloadOptions& options) {
  ModuleTree tree = module_tree_from(model);
  const bool has_tensors = std::any_of(tree.entries.begin(), tree.entries.end(),
                                       [](const ModuleEntry& e) { return !e.tensors.empty(); });
  // torch::jit::freeze and optimize_for_inference fold parameters into graph constants, which
  // no op receives as a module tensor: nothing would be left for ddo to place.
  DDO_CHECK(has_tensors, Code::kInvalidArgument, "the TorchScript module ", tree.model_class,
            " has no parameters or buffers (frozen with torch.jit.freeze or "
            "optimize_for_inference?); ddo serves a module's parameters, so pass the module "
            "before freezing it");
  return enable_offload_tree(std::move(tree), options);
}

}  // namespace ddo::adapter
