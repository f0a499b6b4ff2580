// quantize= at attach: a bf16 model's Linears computed by the card's low-precision GEMM.
#include "attach_quantize.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "ddo/core/mapped_file.h"
#include "ddo/core/planner.h"
#include "ddo/core/status.h"
#include "ddo/sdnq/quantize.h"
#include "ddo/sdnq/quantize_model.h"
#include "ddo/sdnq/quantized_matmul.h"
#include "ddo/torch/loader.h"
#include "attach_common.h"
#include "host_tensor.h"
#include "quantized_dense.h"
#include "weight_source.h"

namespace ddo::adapter::internal {

// Note [Quantized dense weights]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// quantize= makes a model compute its Linears with int8 or fp8 GEMMs without changing its code.
// A LibTorch module's forward calls its own Linear holders and a TorchScript graph its own
// aten::linear, so neither can be handed another module; what both read is the weight, and that
// is where the quantization goes. Each qualifying Linear's tree entry takes a quantized copy (one
// scale per output row: quantize_model.h) where its dense weight was, with the kind of an SDNQ
// layer, so the planner sizes, places and streams the copy as it does an SDNQ layer's tensors.
// The model's weight then becomes a placeholder: a CPU tensor over the dense weight's own host
// bytes whose storage carries a ManagedWeight record pointing at the placed copy
// (QuantizedDense). The interception recognises it as it recognises any managed weight: a
// Linear's read (addmm, mm, bmm over W.t()) runs the layer's quantized forward, and any other
// intercepted read gets the dequantized weight (intercept_quantized.cpp).
//
// The dense bytes stay because everything that is not an intercepted op (weight.norm(), a
// state_dict save, the host's own code) reads the placeholder's storage and must see the model's
// values, never zeros. They are also what remove() gives back, so the model is unchanged after
// it, and where an in-place write (a LoRA fuse) lands: the gate sees the version change and
// quantizes the layer again from them (requantize). The cost is host memory: the dense model and
// its quantized copy. With the loader's checkpoint the dense bytes cost no memory of their own:
// the placeholder points into the checkpoint file, mapped copy-on-write as the disk tier maps it
// (page cache; a write gets a private page), unless the file holds another dtype, in which case
// it is read into ordinary memory once. The copy in the tree is never read from the files, and
// remove() gives the model weights with memory of their own.

namespace {

// Storages read by more than one tensor of the model: a tied weight is not quantized, since the
// other reader (an embedding, another Linear) would see the placeholder.
std::unordered_map<const c10::StorageImpl*, int> storage_uses(const ModuleTree& tree) {
  std::unordered_map<const c10::StorageImpl*, int> uses;
  for (const ModuleEntry& entry : tree.entries) {
    for (const TensorSlot& slot : entry.tensors) {
      if (slot.tensor.defined() && slot.tensor.has_storage()) {
        ++uses[slot.tensor.storage().unsafeGetStorageImpl()];
      }
    }
  }
  return uses;
}

const char* skip_reason(const at::Tensor& w,
                        const std::unordered_map<const c10::StorageImpl*, int>& uses) {
  if (w.dim() != 2) return "the weight is not 2-D";
  if (const char* why = sdnq::quantize_skip_reason(w.size(0), w.size(1), w.scalar_type())) {
    return why;
  }
  if (!w.has_storage() || w.is_meta()) return "the weight has no data";
  if (!w.is_contiguous()) return "the weight is not contiguous";
  if (uses.at(w.storage().unsafeGetStorageImpl()) > 1) {
    return "the weight's memory is shared with another tensor of the model (tied weights)";
  }
  return nullptr;
}

// Why a Linear stays dense whatever its weight holds: its class, its role, or the model's own
// wish; nullopt when its weight decides (skip_reason). A subclass's forward is its own (a LoRA
// wrapper's, a library's custom Linear) and may read the weight in ways the placeholder does not
// serve as a Linear. An adapter module (core::is_adapter_module: PEFT's lora_A, lora_B, ...,
// diffusers' lora_layer; Note [Adapter modules] in core/src/planner_patterns.cpp) holds small
// updates that quantizing would lose, and is what a host trains or swaps. A module the model keeps
// at full precision (diffusers' and transformers' _keep_in_fp32_modules, matched as their loaders
// match it: a component of the name) is one whose forward reads its parameters' dtype.
std::optional<std::string> module_keep_reason(const ModuleEntry& entry,
                                              const OffloadOptions& options) {
  if (!entry.stock_class) {
    return fmt::format(
        "a subclass of Linear ({}) whose forward is its own: quantize= serves the stock Linear "
        "only",
        entry.class_name);
  }
  std::vector<std::string_view> components;
  for (std::size_t begin = 0; begin <= entry.name.size();) {
    std::size_t end = entry.name.find('.', begin);
    if (end == std::string::npos) end = entry.name.size();
    components.emplace_back(std::string_view(entry.name).substr(begin, end - begin));
    begin = end + 1;
  }
  for (const std::string& kept : options.keep_dense_modules) {
    for (std::string_view c : components) {
      if (c == kept) {
        return fmt::format("the model keeps it at full precision (_keep_in_fp32_modules: {})",
                           kept);
      }
    }
  }
  const std::string_view adapter = core::adapter_component(entry.name);
  if (!adapter.empty()) {
    return fmt::format("a LoRA adapter ({} in its name): adapters stay at the model's precision",
                       adapter);
  }
  return std::nullopt;
}

// The checkpoint files that dense weights of quantized Linears point into, each mapped
// copy-on-write once; the tensors over them keep this alive.
struct MappedCheckpoint {
  std::map<int, core::MappedFile> files;
};

// The loader's tensor `name` as `like` (a placeholder) looks: a CPU tensor over the checkpoint
// file itself, mapped copy-on-write as the disk tier maps it (Note [Disk-tier storage] in
// attach_plan.cpp), when the file holds it in `like`'s dtype and aligned (`*mapped`); else read
// into ordinary memory.
at::Tensor dense_from_checkpoint(const OffloadState& s, const std::string& name,
                                 const at::Tensor& like, std::shared_ptr<MappedCheckpoint>& files,
                                 bool* mapped) {
  const core::CheckpointTensor& t = s.weights->find(name);
  const auto element = static_cast<std::uint64_t>(like.element_size());
  *mapped = to_scalar_type(t.dtype) == like.scalar_type() && t.offset % element == 0;
  if (!*mapped) return s.weights->read_cpu(name, like, s.record_event);
  if (!files) files = std::make_shared<MappedCheckpoint>();
  auto [it, fresh] = files->files.try_emplace(t.file);
  if (fresh) {
    throw_if_error(
        core::MappedFile::map_private(s.weights->checkpoint().files[t.file], &it->second));
  }
  return at::from_blob(
      it->second.data() + t.offset, like.sizes(), [files](void*) {},
      at::TensorOptions().dtype(like.scalar_type()));
}

}  // namespace

void quantize_linears(OffloadState& s, const OffloadOptions& options) {
  const std::optional<sdnq::QuantType> type = sdnq::parse_quantize_option(options.quantize);
  if (!type) return;
  s.quantize = *type == sdnq::QuantType::kFloat8E4M3 ? "fp8" : "int8";
  const sdnq::QuantizeOptions quantize_options = sdnq::quantize_model_options(*type);
  const auto uses = storage_uses(s.tree);
  std::shared_ptr<MappedCheckpoint> files;
  at::AutoGradMode no_grad(false);
  for (std::size_t e = 0; e < s.tree.entries.size(); ++e) {
    ModuleEntry& entry = s.tree.entries[e];
    if (entry.kind != core::ModuleKind::kLinear) continue;
    std::size_t w = 0;
    while (w < entry.tensors.size() && entry.tensors[w].name != "weight") ++w;
    if (w == entry.tensors.size()) continue;
    const at::Tensor weight = entry.tensors[w].tensor;
    // The report names layers by module, as Python's quantize= does.
    const std::string name = entry.name.empty() ? "<root>" : entry.name;
    if (std::optional<std::string> why = module_keep_reason(entry, options)) {
      s.kept_dense[name] = std::move(*why);
      continue;
    }
    if (const char* why = skip_reason(weight, uses)) {
      s.kept_dense[name] = why;
      continue;
    }
    QuantizedLinear q;
    q.entry = e;
    q.slot = w;
    q.name = name;
    q.handle = weight;
    q.original_device = weight.device();
    q.requires_grad = weight.requires_grad();
    if (s.weights && is_placeholder(weight)) {
      const std::string tensor_name = slot_name(entry, entry.tensors[w]);
      q.host = dense_from_checkpoint(s, tensor_name, weight, files, &q.mapped);
      if (q.mapped) q.checkpoint_name = tensor_name;
    } else {
      q.host = weight.device().is_cpu() ? weight.detach() : weight.detach().to(c10::kCPU);
    }
    auto [quantized, layout] = sdnq::quantize(q.host, quantize_options);
    q.layout_code = layout.encode();
    // The copy is not the model's: buffers, so that whether the model is being trained is read
    // from its dense weight (refuse_trainable_streamed).
    entry.kind = core::ModuleKind::kPacked;
    entry.tensors[w] = TensorSlot{"weight", quantized.weight, /*is_parameter=*/false};
    entry.tensors.insert(entry.tensors.begin() + static_cast<std::ptrdiff_t>(w) + 1,
                         TensorSlot{"scale", quantized.scale, /*is_parameter=*/false});
    s.quantized.push_back(std::move(q));
  }
}

void install_quantized_weights(OffloadState& s) {
  at::AutoGradMode no_grad(false);
  std::vector<QuantizedLinear> served;
  for (QuantizedLinear& q : s.quantized) {
    const ModuleEntry& entry = s.tree.entries[q.entry];
    if (s.plan.modules[q.entry].tensors[q.slot].action == core::TensorAction::kKeep) {
      s.kept_dense[q.name] = "the plan keeps its module where it is (skip_modules_pattern)";
      continue;
    }
    auto info = std::make_shared<QuantizedDense>();
    info->packed = entry.tensors[q.slot].tensor;
    info->scale = entry.tensors[q.slot + 1].tensor;
    info->layout_code = q.layout_code;
    info->dense = q.host;
    info->backend = s.backend;
    info->execution_device = s.torch_device;
    info->name = q.name;
    auto* record = new ManagedWeight{s.runtime.get(), -1, 0, s.runtime};
    record->quant = info;
    const at::Tensor placeholder =
        cpu_tensor_over(q.host.data_ptr(), q.host.nbytes(), q.host.sizes(), q.host.strides(),
                        q.host.scalar_type(), record, &managed_deleter);
    set_weight(q.handle, placeholder);
    if (q.handle.requires_grad()) {
      // Inference-only, as every streamed weight (Note [Training under offload]).
      q.handle.set_requires_grad(false);
      if (s.runtime) ++s.runtime->frozen_weights;
    }
    record->version = q.handle.is_inference() ? 0 : q.handle._version();
    q.attach_version = record->version;
    q.served = std::move(info);
    served.push_back(std::move(q));
  }
  s.quantized = std::move(served);
}

std::vector<at::Tensor> quantized_weights_back(const OffloadState& s) {
  std::vector<at::Tensor> back;
  back.reserve(s.quantized.size());
  for (const QuantizedLinear& q : s.quantized) {
    if (!q.handle.defined()) continue;  // given back by an earlier remove()
    // Note [Mapped weights come back by reads]
    // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    // A weight over the checkpoint's mapping gets its own memory back: the model no longer
    // depends on the file once the offload is gone. Its bytes are read from the checkpoint, as
    // the loader read them: a file truncated or replaced since the load is then an error that
    // names it (and remove() changes nothing, Note [Restore in two phases]), never a fault on a
    // page the file no longer has. Only a weight the host wrote while attached is copied out of
    // the mapping: its written pages are the process's own.
    if (q.mapped) {
      const bool written = !q.handle.is_inference() &&
                           static_cast<std::uint32_t>(q.handle._version()) != q.attach_version;
      back.push_back(written || !s.weights
                         ? q.host.clone()
                         : s.weights->read_cpu(q.checkpoint_name, q.host, s.record_event));
    } else {
      back.push_back(q.original_device.is_cpu() ? q.host : q.host.to(q.original_device));
    }
  }
  return back;
}

void put_back_quantized_weights(OffloadState& s, const std::vector<at::Tensor>& back) {
  at::AutoGradMode no_grad(false);
  for (std::size_t i = 0; i < back.size(); ++i) {
    QuantizedLinear& q = s.quantized[i];
    q.handle.set_data(back[i]);
    if (q.handle.is_leaf() && q.handle.requires_grad() != q.requires_grad) {
      q.handle.set_requires_grad(q.requires_grad);
    }
    // The names and layouts stay for the report; the tensors are the model's again, and the
    // quantized copy is dropped with the tree's hold on it (a pinned-weight cache entry made of
    // its slabs is then free for the next attach to refill).
    ModuleEntry& entry = s.tree.entries[q.entry];
    entry.tensors[q.slot].tensor = at::Tensor();
    entry.tensors[q.slot + 1].tensor = at::Tensor();
    q.handle = at::Tensor();
    q.host = at::Tensor();
    q.served.reset();
  }
}

nlohmann::json quantized_compute_report(const OffloadState& s) {
  nlohmann::json layers = nlohmann::json::object();
  std::map<std::string, int> counts;
  const sdnq::GemmTarget target = sdnq::gemm_target(s.torch_device);
  // A full-size input: the rows of a diffusion step's tokens.
  constexpr std::int64_t kRows = 4096;
  for (const QuantizedLinear& q : s.quantized) {
    const sdnq::Layout layout = sdnq::Layout::decode(q.layout_code);
    const sdnq::LinearPathChoice c =
        sdnq::choose_linear_path(layout, c10::kFloat, layout.result_dtype, kRows, target);
    layers[q.name] = {{"path", sdnq::to_string(c.path)}, {"why", std::string(c.why)}};
    ++counts[sdnq::to_string(c.path)];
  }
  // The model's own SDNQ layers (the sdnq package's, ddo's QuantizedLinear, SdnqLinear) take
  // the same choice with their scales' dtype.
  for (const ModuleEntry& entry : s.tree.entries) {
    if (entry.kind != core::ModuleKind::kPacked || entry.sdnq_layout.empty()) continue;
    const sdnq::Layout layout = sdnq::Layout::decode(entry.sdnq_layout);
    c10::ScalarType scale_dtype = c10::kFloat;
    for (const TensorSlot& slot : entry.tensors) {
      if (slot.name == "scale" && slot.tensor.defined()) scale_dtype = slot.tensor.scalar_type();
    }
    const sdnq::LinearPathChoice c =
        sdnq::choose_linear_path(layout, scale_dtype, layout.result_dtype, kRows, target);
    layers[entry.name.empty() ? "<root>" : entry.name] = {{"path", sdnq::to_string(c.path)},
                                                          {"why", std::string(c.why)}};
    ++counts[sdnq::to_string(c.path)];
  }
  return {{"quantize", s.quantize.empty() ? "none" : s.quantize},
          {"counts", counts},
          {"layers", layers},
          {"kept_dense", s.kept_dense}};
}

}  // namespace ddo::adapter::internal
