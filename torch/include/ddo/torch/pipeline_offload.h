/// \file
/// The pipeline router: which treatment each component of a pipeline gets, which components the
/// profile options apply to and under which profile names, and the execution device they share.
/// enable_pipeline_offload (enable_offload.h) follows it, and so does Python's
/// ddo.enable_pipeline_offload, which gathers the components and makes one call into the same
/// C++ loop (enable_pipeline_components), so the rule is written once.
///
/// The profiled components are the pipeline's denoisers (core::is_denoiser_component:
/// "transformer", "transformer_2", "unet", "prior", ...) on the dynamic route, in the pipeline's
/// order, else the first component on the dynamic route; `profile_components` names them instead.
/// The first keeps the settings' profile_name, each further one gets a name of its own
/// (core::denoiser_profile_name: "wan-5s.transformer_2"), and one profile_run() region measures
/// them all and shares its room between them (Note [Denoisers share one calibration] in
/// ddo/core/pipeline_profiles.h).
///
/// ```
/// core::DynamicOffloadSettings settings = ...;  // profile_name "wan", DDO_VAE_ROUTE=device
/// ddo::adapter::PipelineRouting r = ddo::adapter::route_pipeline(
///     settings, {"text_encoder", "transformer", "transformer_2", "vae"}, {}, "sim");
/// // r.components: {text_encoder, kDynamic, ""}, {transformer, kDynamic, "wan"},
/// //               {transformer_2, kDynamic, "wan.transformer_2"}, {vae, kDeviceMove, ""}
/// // r.profiled == {"transformer", "transformer_2"}
/// // r.execution_device == "sim:0", r.open_device == true
/// ```
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "ddo/core/settings.h"

namespace ddo::adapter {

/// The router's decision for a pipeline.
struct PipelineRouting {
  /// One component and the route it takes.
  struct Component {
    std::string name;                           ///< the component's name in the pipeline
    core::Route route = core::Route::kDynamic;  ///< settings.policy_for(name).route
    bool profiled = false;  ///< the profile options apply to it (one of `profiled`)
    /// The profile name it is attached with: the settings' profile_name for the first profiled
    /// component, core::denoiser_profile_name for a further one; "" when not profiled or when
    /// the settings name no profile.
    std::string profile_name;
  };
  std::vector<Component> components;  ///< in the order the names were given
  /// The components the profile options apply to, in the pipeline's order: those named, else
  /// the denoisers on the dynamic route, else the first component on the dynamic route; empty
  /// when there is none. The others get no profile.
  std::vector<std::string> profiled;
  /// The device every component executes on, normalized ("sim" -> "sim:0", "cuda" -> "cuda:0").
  std::string execution_device;
  /// True when the components execute, so one device is opened and shared: the settings are
  /// enabled, the mode is not plan and the device is not "cpu".
  bool open_device = false;

  /// The settings component `index` is attached with: `shared` on the component's route and the
  /// shared execution device, with its profile_name, and build_profile only where profiled.
  core::DynamicOffloadSettings settings_for(const core::DynamicOffloadSettings& shared,
                                            std::size_t index) const;
};

/// Routes the components `names` under `settings` (resolved, overrides included: they decide
/// the routes, the profile name and the device); `profile_components` (empty: the rule above)
/// and `execution_device` ("" = the settings') as enable_pipeline_offload takes them. Throws
/// ddo::Error: kNotFound when a name in `profile_components` is not one of `names` (the message
/// lists them), kInvalidArgument for a device name that is not cpu, cuda[:N] or sim[:N].
PipelineRouting route_pipeline(const core::DynamicOffloadSettings& settings,
                               const std::vector<std::string>& names,
                               const std::vector<std::string>& profile_components,
                               const std::string& execution_device);

}  // namespace ddo::adapter
