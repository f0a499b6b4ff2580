// enable_pipeline_components: one settings object over the components of a pipeline, routed by
// route_pipeline (ddo/torch/pipeline_offload.h); Python's enable_pipeline_offload gathers the
// components and calls this loop too.

#include "ddo/torch/pipeline_offload.h"

#include <algorithm>
#include <exception>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddo/core/pipeline_profiles.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "offload_state.h"

namespace ddo::adapter {

namespace {

// The profiled components: those named (checked), else the denoisers on the dynamic route,
// else the first component on the dynamic route.
std::vector<std::string> choose_profiled(const PipelineRouting& routing,
                                         const std::vector<std::string>& names,
                                         const std::vector<std::string>& profile_components) {
  std::vector<std::string> chosen;
  for (const std::string& named : profile_components) {
    if (std::find(names.begin(), names.end(), named) == names.end()) {
      throw Error(Code::kNotFound,
                  fmt::format("profile_component '{}' is not a component of the pipeline; "
                              "components: {}",
                              named, fmt::join(names, ", ")));
    }
  }
  for (const PipelineRouting::Component& c : routing.components) {
    const bool named = std::find(profile_components.begin(), profile_components.end(), c.name) !=
                       profile_components.end();
    const bool denoiser = c.route == core::Route::kDynamic && core::is_denoiser_component(c.name);
    if (profile_components.empty() ? denoiser : named) chosen.push_back(c.name);
  }
  if (chosen.empty() && profile_components.empty()) {
    for (const PipelineRouting::Component& c : routing.components) {
      if (c.route == core::Route::kDynamic) {
        chosen.push_back(c.name);
        break;
      }
    }
  }
  return chosen;
}

}  // namespace

PipelineRouting route_pipeline(const core::DynamicOffloadSettings& settings,
                               const std::vector<std::string>& names,
                               const std::vector<std::string>& profile_components,
                               const std::string& execution_device) {
  PipelineRouting routing;
  routing.components.reserve(names.size());
  for (const std::string& name : names) {
    routing.components.push_back({name, settings.policy_for(name).route, false, ""});
  }
  routing.profiled = choose_profiled(routing, names, profile_components);
  std::size_t index = 0;
  for (PipelineRouting::Component& c : routing.components) {
    if (std::find(routing.profiled.begin(), routing.profiled.end(), c.name) ==
        routing.profiled.end()) {
      continue;
    }
    c.profiled = true;
    c.profile_name = core::denoiser_profile_name(settings.config.profile_name, c.name, index++);
  }
  routing.execution_device = internal::normalize_device_name(
      execution_device.empty() ? settings.config.execution_device : execution_device);
  const bool plan_only =
      settings.config.execution_mode == core::ExecutionMode::kPlan || !settings.enabled;
  routing.open_device = !plan_only && routing.execution_device != "cpu";
  return routing;
}

core::DynamicOffloadSettings PipelineRouting::settings_for(
    const core::DynamicOffloadSettings& shared, std::size_t index) const {
  DDO_CHECK(index < components.size(), Code::kInvalidArgument, "pipeline component index ", index,
            " is out of range: the pipeline has ", components.size(), " components");
  const Component& c = components[index];
  core::DynamicOffloadSettings s = shared;
  s.config.route = c.route;
  s.config.execution_device = execution_device;
  s.config.profile_name = c.profile_name;
  s.config.build_profile = c.profiled && shared.config.build_profile;
  return s;
}

// Note [The pipeline loop]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// One loop for C++ and Python (ddo.enable_pipeline_offload hands each component's module tree
// over as a PipelineComponent). The order matters:
//   1. the settings are resolved once, with the overrides: an override of the route, the
//      profile name, the device capacity or the execution mode must decide the routes, the
//      profiled components' names and the shared device, not only each component's attach;
//   2. route_pipeline decides every component's route and profile name from those settings;
//   3. the shared device is opened once, from the same settings (its capacity, the VRAM cap);
//   4. each component attaches with exactly PipelineRouting::settings_for's settings and no
//      overrides of its own: applying the overrides again per component would undo the router
//      (an overridden route over a component's DDO_<COMPONENT>_ROUTE, a profile name on every
//      component);
//   5. a component that fails leaves none attached: those already attached are removed in
//      reverse order before the error goes on.

std::unique_ptr<PipelineOffload> enable_pipeline_components(
    std::vector<PipelineComponent> components, const OffloadOptions& options,
    const std::vector<std::string>& profile_components) {
  const core::EnvMap env = options.env ? *options.env : core::process_env();
  const core::DynamicOffloadSettings settings = internal::resolve_settings(options, env);
  std::vector<std::string> names;
  for (const PipelineComponent& c : components) {
    DDO_CHECK(static_cast<bool>(c.attach), Code::kInvalidArgument, "pipeline component '", c.name,
              "' has no attach function");
    names.push_back(c.name);
  }
  const PipelineRouting routing =
      route_pipeline(settings, names, profile_components, options.execution_device);

  auto pipe = std::unique_ptr<PipelineOffload>(new PipelineOffload());
  pipe->profiled_ = routing.profiled;
  for (std::size_t i = 0; i < components.size(); ++i) {
    PipelineOffload::Component c;
    c.name = routing.components[i].name;
    c.route = routing.components[i].route;
    c.profile_name = routing.components[i].profile_name;
    c.module = components[i].module;
    pipe->components_.push_back(std::move(c));
  }

  std::shared_ptr<engine::Device> device = options.device;
  if (!device && routing.open_device) {
    device = open_execution_device(routing.execution_device, settings.config);
  }
  try {
    for (std::size_t i = 0; i < pipe->components_.size(); ++i) {
      PipelineOffload::Component& c = pipe->components_[i];
      if (c.route == core::Route::kNone) continue;
      OffloadOptions o;
      o.settings = routing.settings_for(settings, i);
      o.execution_device = routing.execution_device;
      o.record_event = options.record_event;
      o.env = env;
      o.device = device;
      if (routing.components[i].profiled) o.model_class = options.model_class;
      c.offload = components[i].attach(o);
    }
  } catch (...) {
    pipe->remove();
    throw;
  }
  return pipe;
}

std::unique_ptr<PipelineOffload> enable_pipeline_offload(
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> components,
    const OffloadOptions& options, const std::vector<std::string>& profile_components) {
  std::vector<PipelineComponent> prepared;
  for (auto& [name, module] : components) {
    DDO_CHECK(module != nullptr, Code::kInvalidArgument, "pipeline component '", name,
              "' is a null module");
    PipelineComponent c;
    c.name = name;
    c.module = module;
    c.attach = [module](const OffloadOptions& o) { return enable_offload(module, o); };
    prepared.push_back(std::move(c));
  }
  return enable_pipeline_components(std::move(prepared), options, profile_components);
}

PipelineOffload::~PipelineOffload() {
  remove();
}

Offload* PipelineOffload::component(const std::string& name) {
  for (auto& c : components_) {
    if (c.name == name) return c.offload.get();
  }
  throw Error(Code::kNotFound, ddo::internal::str_cat("pipeline has no component '", name, "'"));
}

std::vector<std::string> PipelineOffload::component_names() const {
  std::vector<std::string> names;
  for (const auto& c : components_) names.push_back(c.name);
  return names;
}

core::Route PipelineOffload::route_of(const std::string& name) const {
  for (const auto& c : components_) {
    if (c.name == name) return c.route;
  }
  throw Error(Code::kNotFound, ddo::internal::str_cat("pipeline has no component '", name, "'"));
}

void PipelineOffload::remove() {
  for (auto it = components_.rbegin(); it != components_.rend(); ++it) {
    if (it->offload) it->offload->remove();
  }
}

std::string PipelineOffload::profile_name_of(const std::string& name) const {
  for (const auto& c : components_) {
    if (c.name == name) return c.profile_name;
  }
  throw Error(Code::kNotFound, ddo::internal::str_cat("pipeline has no component '", name, "'"));
}

ProfileRun PipelineOffload::profile_run() {
  std::vector<internal::OffloadState*> offloads;
  std::vector<std::string> names;
  for (const std::string& name : profiled_) {
    Offload* o = component(name);
    if (o == nullptr) continue;  // the "none" route: nothing attached to measure
    offloads.push_back(o->state_.get());
    names.push_back(name);
  }
  DDO_CHECK(!offloads.empty(), Code::kFailedPrecondition,
            "profile_run() on a pipeline without a component on the dynamic route; route the "
            "denoiser (e.g. transformer) to dynamic offload");
  return ProfileRun(internal::open_region(std::move(offloads), std::move(names)));
}

nlohmann::json PipelineOffload::profile_run(const std::function<void()>& region) {
  return internal::run_region(profile_run(), region);
}

nlohmann::json PipelineOffload::report() const {
  nlohmann::json r = nlohmann::json::object();
  r["profiled_component"] = profiled_.empty() ? std::string() : profiled_.front();
  r["profiled_components"] = profiled_;
  nlohmann::json names = nlohmann::json::object();
  for (const auto& c : components_) {
    if (!c.profile_name.empty()) names[c.name] = c.profile_name;
  }
  r["profile_names"] = std::move(names);
  nlohmann::json comps = nlohmann::json::object();
  for (const auto& c : components_) {
    nlohmann::json one = c.offload ? c.offload->report() : nlohmann::json::object();
    one["route_policy"] = core::to_string(c.route);
    comps[c.name] = std::move(one);
  }
  r["components"] = std::move(comps);
  return r;
}

std::string PipelineOffload::summary() const {
  std::string out;  // no iostreams: Note [No iostreams] in ddo/core/status.h
  for (const auto& c : components_) {
    out += fmt::format("[{}] route {}", c.name, core::to_string(c.route));
    if (!c.profile_name.empty()) out += fmt::format(", profile '{}'", c.profile_name);
    out += "\n";
    if (c.offload) out += c.offload->summary();
  }
  return out;
}

}  // namespace ddo::adapter
