/// \file
/// The pipeline router: which treatment each component of a pipeline gets, which one the profile
/// options apply to, and the execution device they share. enable_pipeline_offload
/// (enable_offload.h) follows it, and so does Python's ddo.enable_pipeline_offload, which only
/// gathers the components (their names, in the pipeline's order) and calls it through ddo._C, so
/// the rule is written once.
///
/// ```
/// core::DynamicOffloadSettings settings = ...;  // DDO_VAE_ROUTE=device in the environment
/// ddo::adapter::PipelineRouting r =
///     ddo::adapter::route_pipeline(settings, {"transformer", "vae"}, "", "sim");
/// // r.components: {transformer, kDynamic}, {vae, kDeviceMove}
/// // r.profiled == "transformer" (the first on the dynamic route)
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
  };
  std::vector<Component> components;  ///< in the order the names were given
  /// The component the profile options (profile_name, build_profile) apply to: the one named,
  /// else the first on the dynamic route; "" when there is none. The others get no profile.
  std::string profiled;
  /// The device every component executes on, normalized ("sim" -> "sim:0", "cuda" -> "cuda:0").
  std::string execution_device;
  /// True when the components execute, so one device is opened and shared: the settings are
  /// enabled, the mode is not plan and the device is not "cpu".
  bool open_device = false;

  /// The settings component `index` is attached with: `shared` on the component's route and the
  /// shared execution device, and without profile_name / build_profile unless it is the profiled
  /// one (the caller passes the profile options to that one alone).
  core::DynamicOffloadSettings settings_for(const core::DynamicOffloadSettings& shared,
                                            std::size_t index) const;
};

/// Routes the components `names` under `settings`; `execution_device` ("" = the settings') and
/// `profile_component` ("" = the first on the dynamic route) as enable_pipeline_offload takes
/// them. Throws ddo::Error: kNotFound when `profile_component` is not one of `names` (the message
/// lists them), kInvalidArgument for a device name that is not cpu, cuda[:N] or sim[:N].
PipelineRouting route_pipeline(const core::DynamicOffloadSettings& settings,
                               const std::vector<std::string>& names,
                               const std::string& profile_component,
                               const std::string& execution_device);

}  // namespace ddo::adapter
