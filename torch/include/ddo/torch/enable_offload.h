/// \file
/// enable_offload: ddo's entry point for LibTorch models (the named-profile API of
/// docs/design/0007-named-profiles.md, in C++).
///
/// enable_offload takes over weight placement of a model whose weights do not all fit, or should
/// not all sit, on the execution device: some modules stay resident, large weights of the others
/// stay in (pinned) host memory and are streamed just before the op that reads them, small
/// tensors are moved once. The model's code is not changed and ddo never looks at inference
/// arguments; interception happens at the dispatcher (interception.h). Destroying the returned
/// handle (or remove()) restores ordinary CPU tensors with the original values.
///
/// ```
/// ddo::adapter::OffloadOptions opts;
/// opts.profile_name = "my-workload";
/// opts.build_profile = calibrate;            // true for the calibration run
/// opts.execution_device = "cuda:0";          // or "sim" for the host simulation
/// std::unique_ptr<ddo::adapter::Offload> offload = ddo::adapter::enable_offload(model, opts);
/// nlohmann::json profile = offload->profile_run([&] { latents = denoise(latents); });
/// std::cout << offload->summary();
/// offload.reset();                           // the model is ordinary again
/// ```
///
/// Execution devices: "cuda:N" (a GPU; needs a CUDA build and a GPU), "sim" / "sim:N" (the host
/// simulation: a capacity-limited arena of host memory stands in for VRAM, tensors are CPU
/// tensors), "cpu" (plan mode only). Settings follow the override order of
/// docs/design/0006-configuration.md, section 3 (settings.h): defaults < preset < DDO_* variables <
/// an explicit config < `overrides` < a saved profile recommendation (unless the manual resident
/// budget is positive) < the auto policy.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/core/calibration.h"
#include "ddo/core/planner.h"
#include "ddo/core/settings.h"
#include "ddo/torch/module_tree.h"
#include "ddo/torch/profile_run.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace torch::jit {
struct Module;
}  // namespace torch::jit

namespace ddo::engine {
class Device;
}  // namespace ddo::engine

namespace ddo::adapter {

class WeightSource;  // loader.h

/// Setup events for the host's metrics: name ("plan", "pin", "moves", ...), seconds, payload.
using RecordEvent =
    std::function<void(const std::string& name, double seconds, const nlohmann::json& payload)>;

/// What enable_offload() takes besides the model; every field has a working default.
struct OffloadOptions {
  /// A preset name (presets.h; "auto" is one_shot_fast). Unset: DDO_PRESET, else "auto", as the
  /// regular settings loader does for a preset the code did not choose (settings.h).
  std::optional<std::string> preset;
  std::string profile_name;    ///< "" disables profile lookup
  bool build_profile = false;  ///< true for a calibration run: profile_run() measures and saves
  /// Resolved settings (then `overrides` still apply) or an explicit config (replaces defaults,
  /// preset and DDO_* variables); neither: resolved from `preset` and the environment.
  std::optional<core::DynamicOffloadSettings> settings;
  std::optional<core::DynamicOffloadConfig> config;  ///< see `settings`
  /// Per-field overrides by field name (config.h); unknown names are an error listing them.
  nlohmann::json overrides = nlohmann::json::object();
  /// Patterns appended to skip_modules_pattern after everything above is resolved: modules the
  /// host keeps where they are (e.g. the Python package's tensor subclasses ddo cannot stream),
  /// whatever the preset, environment, config and overrides say.
  std::vector<std::string> extra_skip_patterns;
  std::string execution_device;  ///< "" = the config's (default "cuda:0")
  RecordEvent record_event;      ///< called once per setup event; may be empty
  std::string model_class;       ///< "" = the demangled C++ class of the module
  /// The environment for the settings loader and DDO_PROFILE_DIR; unset = the process's.
  std::optional<core::EnvMap> env;
  /// Use this device instead of opening one from execution_device (a pipeline shares one device
  /// between its components; tests wrap one). Its kind must match execution_device.
  std::shared_ptr<engine::Device> device;
  /// The loader's checkpoint (loader.h): the tensors it holds are read from it straight
  /// into the memory the plan gives them. Null: the model's own tensors are the source.
  std::shared_ptr<WeightSource> weights;
  /// "fp8" or "int8": each dense Linear that qualifies (ddo/sdnq/quantize_model.h) computes with
  /// a copy quantized to one scale per output row, on the card's low-precision GEMM where it has
  /// one (fp8: sm_89+, int8: sm_80+; elsewhere it dequantizes), and streams that copy: about half
  /// the bytes of bf16. The model keeps its dense weights in host memory as the tensors its code
  /// and the host see (Note [Quantized dense weights] in attach_quantize.cpp), so host memory
  /// holds the dense model and the quantized copy, and remove() gives the model back unchanged.
  /// report()["quantized_compute"] names each layer's path and why, and the Linears kept dense.
  /// A named profile's identity does not include the quantization: a bf16 and an fp8 run under
  /// one name share its budget (recalibrate, or use another name). "" or "none": no quantization.
  /// With the loader (load_with_offload), a quantized Linear's dense weight points into the
  /// checkpoint file (mapped copy-on-write: page cache, no memory of its own) where the file
  /// holds it in the model's dtype, and is read into host memory otherwise.
  std::string quantize;
  /// Module names a model keeps at full precision (diffusers' and transformers'
  /// `_keep_in_fp32_modules`): under `quantize=` a Linear with one of them as a component of its
  /// dotted name stays dense, matched as those libraries' loaders match it.
  std::vector<std::string> keep_dense_modules;
};

/// The handle enable_offload() returns: the model's weights are placed by ddo for as long as it
/// lives, and are ordinary tensors again once it is destroyed or remove() ran.
class Offload {
 public:
  ~Offload();  ///< restores the model (remove())
  Offload(const Offload&) = delete;
  Offload& operator=(const Offload&) = delete;

  /// Restores the model: drains the scheduler, then every managed, resident and moved tensor
  /// becomes an ordinary tensor on its original device with its original values and
  /// requires_grad. Idempotent.
  void remove();
  /// What remove(const RemoveOptions&) may do besides restoring the model.
  struct RemoveOptions {
    /// Drop this model's pinned-weight cache entry and copy its weights out of the slabs, as
    /// without cache_pinned_weights (weight_cache.h).
    bool clear_weight_cache = false;
    /// CUDA: resident and move-once tensors stay on the device, so the next enable_offload of
    /// this model finds them there and moves nothing (a staged flow that releases the denoiser
    /// only to run the VAE). Until then the module is split between host and device; a later
    /// remove() without this flag returns them to the host.
    bool keep_residents_on_device = false;
  };
  /// remove() with options; see RemoveOptions.
  void remove(const RemoveOptions& options);
  bool active() const;  ///< false once remove() ran

  /// The measured region (profile_run.h).
  ProfileRun profile_run();
  /// Runs `region` as the measured region and returns its profile report (ProfileRun::finish()).
  nlohmann::json profile_run(const std::function<void()>& region);
  /// The latest profile report (setup's until a region ends).
  nlohmann::json profile_report() const;

  /// JSON-safe report (docs/design/0008-loading-and-reports.md, section 2): settings, setup seconds
  /// and bytes per action, modules patched, resident modules and bytes, pinned bytes, decisions,
  /// run figures, profile report.
  nlohmann::json report() const;
  /// One screen for humans.
  std::string summary() const;
  const core::Plan& plan() const;  ///< what the planner decided for every module and tensor
  /// The settings after preset, environment and overrides.
  const core::DynamicOffloadSettings& settings() const;
  /// The device the offload executes on (null in plan mode).
  std::shared_ptr<engine::Device> device() const;

  /// The running totals report()["run"] gives, read without building the report (a
  /// GenerationMeter reads them at every stage boundary); after remove(), the totals it ended
  /// with.
  struct Counters {
    std::int64_t bytes_streamed = 0;   ///< host -> device copies of streamed units
    std::int64_t disk_bytes_read = 0;  ///< disk-tier reads during steps
    std::int64_t file_bytes_read = 0;  ///< every read from the checkpoint (load and disk tier)
  };
  Counters counters() const;  ///< the totals so far (zeros in plan mode)
  /// Clears the per-run figures (bytes streamed, copy and wait time, peaks).
  void reset_run_stats();
  /// Diagnostics: mark_step() records a reference point on the compute stream (e.g. before a
  /// step); timeline(), after the device is synchronized, lists every streamed unit of the trace
  /// with its last copy and compute-side wait in ms after that point (JSON array of
  /// {unit, bytes, copy_start_ms, copy_end_ms, wait_start_ms, wait_end_ms}; null where unknown).
  /// From the first mark_step() on every copy is timed (a few us more per streamed op); before,
  /// one copy in 16 is (report()'s run.timing).
  void mark_step();
  nlohmann::json timeline() const;  ///< see mark_step()
  /// Diagnostics: true times every copy and wait from now on (as mark_step() does), false
  /// returns to the steady state's one copy in 16 (Note [Copy timing]).
  void time_all_copies(bool on);

 private:
  friend std::unique_ptr<Offload> enable_offload_tree(ModuleTree tree, const OffloadOptions&);
  friend class PipelineOffload;  // its profile_run() measures several offloads in one region
  explicit Offload(std::unique_ptr<internal::OffloadState> state);
  std::unique_ptr<internal::OffloadState> state_;
};

/// Attaches offload to a LibTorch module (any torch::nn::Module: a transformer, a UNet, ...).
std::unique_ptr<Offload> enable_offload(torch::nn::Module& model,
                                        const OffloadOptions& options = {});
/// The same for a module held by shared_ptr (what a TORCH_MODULE holder gives with .ptr()).
std::unique_ptr<Offload> enable_offload(const std::shared_ptr<torch::nn::Module>& model,
                                        const OffloadOptions& options = {});
/// The same for a TorchScript module (`torch::jit::load`, or one scripted or traced in C++): its
/// parameters and buffers are found by name (module_tree.h), its Linear/Conv/Embedding weights are
/// served by the same interception when the interpreter runs it, and the root's qualified type
/// name ("__torch__.diffusers.models...FluxTransformer2DModel") is the profile's class identity.
std::unique_ptr<Offload> enable_offload(const torch::jit::Module& model,
                                        const OffloadOptions& options = {});
/// The same over a prepared module tree (the Python glue builds one from nn.Module).
std::unique_ptr<Offload> enable_offload_tree(ModuleTree tree, const OffloadOptions& options);

/// Opens the execution device a config names ("cuda:N" or "sim[:N]"), as enable_offload does.
/// Throws ddo::Error: kUnavailable for CUDA without a GPU or CUDA build, kInvalidArgument for an
/// unknown device.
std::shared_ptr<engine::Device> open_execution_device(const std::string& execution_device,
                                                      const core::DynamicOffloadConfig& config);

// --- pipelines -----------------------------------------------------------------------------------

struct PipelineComponent;

/// Offload over the components of a pipeline with one settings object, routed by route_pipeline
/// (pipeline_offload.h): each component takes settings.policy_for(name).route -- dynamic offload,
/// classic group streaming (block or leaf), a plain device move, or nothing -- and all share one
/// execution device. The profile options apply to the pipeline's denoisers, each under its own
/// profile name, and one profile_run() region measures them all (Note [Denoisers share one
/// calibration] in ddo/core/pipeline_profiles.h).
///
/// ```
/// // transformer is profiled as "wan-5s", transformer_2 as "wan-5s.transformer_2"
/// opts.profile_name = "wan-5s";
/// opts.build_profile = calibrate;
/// auto pipe = ddo::adapter::enable_pipeline_offload(
///     {{"text_encoder", te}, {"transformer", high}, {"transformer_2", low}, {"vae", vae}}, opts);
/// nlohmann::json report = pipe->profile_run([&] { video = generate(); });
/// // report["components"]["transformer_2"]["status"] == "saved" on a calibration run
/// ```
class PipelineOffload {
 public:
  ~PipelineOffload();  ///< restores every component (remove())
  PipelineOffload(const PipelineOffload&) = delete;
  PipelineOffload& operator=(const PipelineOffload&) = delete;

  /// The component's offload; null for a component on the "none" route. Throws for unknown names.
  Offload* component(const std::string& name);
  std::vector<std::string> component_names() const;  ///< in the order the components were given
  /// The component's route; throws for unknown names.
  core::Route route_of(const std::string& name) const;
  /// The components the profile options apply to, in the pipeline's order
  /// (PipelineRouting::profiled).
  const std::vector<std::string>& profiled_components() const { return profiled_; }
  /// The profile name the component was attached with ("" when none); throws for unknown names.
  std::string profile_name_of(const std::string& name) const;
  /// Restores every component (reverse order). Idempotent.
  void remove();

  /// One measured region over every profiled component that ddo attached: one calibration lock,
  /// one measurement, each component's recommendation its share of the room (saved under its
  /// own profile name), or each saved recommendation checked against the run. The report is the
  /// first profiled component's, with "components": {name: that component's report}. Throws
  /// kFailedPrecondition when no profiled component is attached.
  ProfileRun profile_run();
  /// Runs `region` as the measured region of profile_run(); returns its report.
  nlohmann::json profile_run(const std::function<void()>& region);

  /// JSON: the profiled components ("profiled_component": the first, "profiled_components":
  /// all, "profile_names": name -> profile name) and, per component, its route and report().
  nlohmann::json report() const;
  /// One screen for humans: each component's route and summary().
  std::string summary() const;

 private:
  friend std::unique_ptr<PipelineOffload> enable_pipeline_components(
      std::vector<PipelineComponent> components, const OffloadOptions& options,
      const std::vector<std::string>& profile_components);
  PipelineOffload() = default;

  struct Component {
    std::string name;
    core::Route route = core::Route::kDynamic;
    std::string profile_name;
    std::shared_ptr<torch::nn::Module> module;  ///< kept alive with its offload; may be null
    std::unique_ptr<Offload> offload;
  };
  std::vector<Component> components_;
  std::vector<std::string> profiled_;
};

/// One component of a pipeline as enable_pipeline_components attaches it: its name and how to
/// attach it. The Python package gives each component's module tree this way; a LibTorch
/// module's is enable_offload(module, options).
struct PipelineComponent {
  std::string name;  ///< the component's name in the pipeline ("transformer", "vae", ...)
  /// Attaches the component with the options the pipeline decided for it: `settings` resolved
  /// for its route, the shared device and its profile name; `execution_device`, `device`,
  /// `env`, `record_event`, and `model_class` where profiled. It may add what belongs to the
  /// component alone (its extra skip patterns, its model class) and nothing the pipeline decides.
  std::function<std::unique_ptr<Offload>(const OffloadOptions& options)> attach;
  std::shared_ptr<torch::nn::Module> module;  ///< kept alive with its offload; may be null
};

/// Offloads the components of a pipeline as PipelineOffload describes, in one loop: resolves the
/// settings once (preset, environment, config, `options.overrides`: so an override decides the
/// routes, the profile name and the device), routes (route_pipeline, with `profile_components`),
/// opens the shared device once, attaches each component on its route in the given order, and
/// when one fails removes those already attached (reverse order) and rethrows.
std::unique_ptr<PipelineOffload> enable_pipeline_components(
    std::vector<PipelineComponent> components, const OffloadOptions& options = {},
    const std::vector<std::string>& profile_components = {});

/// enable_pipeline_components over LibTorch modules.
std::unique_ptr<PipelineOffload> enable_pipeline_offload(
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> components,
    const OffloadOptions& options = {}, const std::vector<std::string>& profile_components = {});

}  // namespace ddo::adapter
