/// \file
/// The loader (docs/design/0008-loading-and-reports.md): a component directory of safetensors files
/// read straight into the memory each tensor will live in, so the host never holds the model twice.
///
/// The module's weights start as placeholders (Note [Placeholders] in loader.cpp: CPU tensors
/// of the right shape and dtype that take no memory). Python builds the module on the meta device
/// and swaps in placeholders; C++ calls release_weights() on a constructed module. Then every
/// tensor the files hold goes from the file to where the plan puts it: streamed weights into
/// their slab (read with several threads, then pinned), residents and move-once tensors to the
/// device, anything else into an ordinary CPU tensor. Tensors the files do not hold (the
/// non-persistent buffers a module computes itself) keep their values; a placeholder the files do
/// not hold is a missing weight. The files are checked against the module before anything is read
/// or moved: missing or unexpected keys, shapes or dtypes that do not match are one error listing
/// them, and the module is untouched.
///
/// ```
/// auto model = std::make_shared<MyTransformer>(config);
/// ddo::adapter::release_weights(*model);    // drop the random init; keep shapes and dtypes
/// ddo::adapter::LoadOptions load;
/// load.path = "flux/transformer";              // a directory or one .safetensors file
/// ddo::adapter::OffloadOptions opts;
/// opts.profile_name = "my-workload";
/// auto offload = ddo::adapter::load_with_offload(*model, load, opts);
/// ```
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include "ddo/torch/enable_offload.h"
#include "ddo/torch/module_tree.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace ddo::adapter {

/// Called as a load goes: bytes read so far, bytes to read, seconds since the reading began.
using LoadProgress =
    std::function<void(std::uint64_t done_bytes, std::uint64_t total_bytes, double seconds)>;

/// Where the weights come from and how they are read.
struct LoadOptions {
  std::string path;  ///< a component directory (one file or shards + index) or a .safetensors
  /// Floating-point tensors of the file are converted to this dtype; unset: to the module's
  /// tensor dtype (a mismatch of non-floating types is an error).
  std::optional<c10::ScalarType> dtype;
  /// Threads reading the files (pread); 0: the machine's cores, at least 4 and at most 16.
  int read_workers = 0;
  bool allow_unexpected_keys = false;  ///< tensors in the file the module does not have
  /// Reported about 5 times a second from the calling thread, and once at the end; the setup
  /// events (OffloadOptions::record_event) get the same as "load" events.
  LoadProgress progress;
};

/// The opened, validated checkpoint behind a load (internal; loader.cpp).
class WeightSource;

/// Replaces every parameter and buffer of the module with a placeholder of its shape and dtype,
/// freeing its memory (the C++ way to get a module ready for loading).
void release_weights(torch::nn::Module& model);
/// The same for a module tree (what the Python glue builds).
void release_weights(const ModuleTree& tree);
/// A placeholder tensor (Note [Placeholders]): CPU, contiguous, no memory of its own.
at::Tensor make_placeholder(at::IntArrayRef sizes, c10::ScalarType dtype);
/// True for a placeholder.
bool is_placeholder(const at::Tensor& t);

/// Opens `options.path` and checks it against the module: every placeholder of the module must
/// be in the files with the same shape and a convertible dtype; with
/// allow_unexpected_keys false, every tensor of the file must be one of the module's. Throws
/// ddo::Error (kNotFound, kDataLoss, kInvalidArgument) naming the file and the tensors; nothing
/// is read yet.
std::shared_ptr<WeightSource> open_weight_source(const ModuleTree& tree,
                                                 const LoadOptions& options);

/// Reads every tensor of `tree` that the files hold into an ordinary CPU tensor (the
/// deferred flow: enable_offload comes later). One copy of each weight, read in place.
/// `events` gets "load_progress" events as the reads go and a final "load" event.
void load_weights(const ModuleTree& tree, const LoadOptions& options,
                  const RecordEvent& events = {});
/// The same for a LibTorch module.
void load_weights(torch::nn::Module& model, const LoadOptions& options);

/// The tensors of the checkpoint at `path` (opened as open_weight_source opens it: index, shards,
/// validated headers) as meta tensors of their stored shapes and dtypes, by name; no tensor bytes
/// are read. Throws ddo::Error naming the file for a missing or malformed checkpoint.
std::map<std::string, at::Tensor> checkpoint_meta_tensors(const std::string& path);

/// The deferred flow with pins (Note [Loader pins] in loader_pins.cpp): reads every tensor the
/// files hold into pinned host slabs for the execution device that `options` resolve to, as the
/// later enable_offload(model, options) will, which then streams those weights from where they
/// lie instead of copying them into new slabs. Plan mode, a disabled offload, "cpu" or pinning
/// turned off load into ordinary CPU tensors, as load_weights. Returns what was done:
/// {"device", "pinned", "pinned_bytes", "pageable_bytes", "pin_fallback_bytes", "reason"?, ...};
/// `events` gets the load events and a final "load_pins" event with the same figures.
nlohmann::json load_weights_for_offload(const ModuleTree& tree, const LoadOptions& load,
                                        const OffloadOptions& options,
                                        const RecordEvent& events = {});

/// Loads and offloads in one pass: plans as enable_offload() does, then reads each tensor
/// straight into its place. On any error the module's weights are placeholders again. With
/// OffloadOptions::quantize under host_ram_cap_gb, the dense weights it reads into memory (a file
/// in another dtype than the module's) count against the cap with the plan's host bytes: over it
/// is ddo::Error kResourceExhausted naming what to change, thrown after the offload's remove()
/// (the module then holds its loaded weights, not placeholders).
std::unique_ptr<Offload> load_with_offload(ModuleTree tree, const LoadOptions& load,
                                           const OffloadOptions& options);
/// The same for a LibTorch module.
std::unique_ptr<Offload> load_with_offload(torch::nn::Module& model, const LoadOptions& load,
                                           const OffloadOptions& options = {});

}  // namespace ddo::adapter
