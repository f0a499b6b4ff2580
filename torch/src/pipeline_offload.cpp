// enable_pipeline_offload: one settings object over the components of a pipeline, routed by
// route_pipeline (ddo/torch/pipeline_offload.h), the rule Python's enable_pipeline_offload calls
// too.

#include "ddo/torch/pipeline_offload.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "offload_state.h"

namespace ddo::adapter {

PipelineRouting route_pipeline(const core::DynamicOffloadSettings& settings,
                               const std::vector<std::string>& names,
                               const std::string& profile_component,
                               const std::string& execution_device) {
  PipelineRouting routing;
  routing.components.reserve(names.size());
  for (const std::string& name : names) {
    routing.components.push_back({name, settings.policy_for(name).route});
  }
  if (!profile_component.empty()) {
    if (std::find(names.begin(), names.end(), profile_component) == names.end()) {
      throw Error(Code::kNotFound,
                  fmt::format("profile_component '{}' is not a component of the pipeline; "
                              "components: {}",
                              profile_component, fmt::join(names, ", ")));
    }
    routing.profiled = profile_component;
  } else {
    for (const PipelineRouting::Component& c : routing.components) {
      if (c.route == core::Route::kDynamic) {
        routing.profiled = c.name;
        break;
      }
    }
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
  core::DynamicOffloadSettings s = shared;
  s.config.route = components[index].route;
  s.config.execution_device = execution_device;
  if (components[index].name != profiled) {
    s.config.profile_name.clear();
    s.config.build_profile = false;
  }
  return s;
}

std::unique_ptr<PipelineOffload> enable_pipeline_offload(
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> components,
    const OffloadOptions& options, const std::string& profile_component) {
  const core::EnvMap env = options.env ? *options.env : core::process_env();
  // Resolve once, as a single model's attach does (overrides included: a vram_cap_gb or
  // execution_mode override decides the shared device below); every component uses these
  // settings with its own route.
  const core::DynamicOffloadSettings settings = internal::resolve_settings(options, env);
  std::vector<std::string> names;
  for (const auto& [name, module] : components) {
    DDO_CHECK(module != nullptr, Code::kInvalidArgument, "pipeline component '", name,
              "' is a null module");
    names.push_back(name);
  }
  const PipelineRouting routing =
      route_pipeline(settings, names, profile_component, options.execution_device);

  auto pipe = std::unique_ptr<PipelineOffload>(new PipelineOffload());
  pipe->profiled_ = routing.profiled;
  for (std::size_t i = 0; i < components.size(); ++i) {
    PipelineOffload::Component c;
    c.name = routing.components[i].name;
    c.module = components[i].second;
    c.route = routing.components[i].route;
    pipe->components_.push_back(std::move(c));
  }

  std::shared_ptr<engine::Device> device = options.device;
  if (!device && routing.open_device) {
    device = open_execution_device(routing.execution_device, settings.config);
  }
  for (std::size_t i = 0; i < pipe->components_.size(); ++i) {
    PipelineOffload::Component& c = pipe->components_[i];
    if (c.route == core::Route::kNone) continue;
    OffloadOptions o;
    o.settings = routing.settings_for(settings, i);
    o.overrides = options.overrides;
    o.execution_device = routing.execution_device;
    o.record_event = options.record_event;
    o.env = env;
    o.device = device;
    if (c.name == pipe->profiled_) {
      o.profile_name = options.profile_name;
      o.build_profile = options.build_profile;
      o.model_class = options.model_class;
    }
    c.offload = enable_offload(c.module, o);
  }
  return pipe;
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

ProfileRun PipelineOffload::profile_run() {
  Offload* o = profiled_.empty() ? nullptr : component(profiled_);
  DDO_CHECK(o != nullptr, Code::kFailedPrecondition,
            "profile_run() on a pipeline without a component on the dynamic route; route the "
            "denoiser (e.g. transformer) to dynamic offload");
  return o->profile_run();
}

nlohmann::json PipelineOffload::profile_run(const std::function<void()>& region) {
  Offload* o = profiled_.empty() ? nullptr : component(profiled_);
  DDO_CHECK(o != nullptr, Code::kFailedPrecondition,
            "profile_run() on a pipeline without a component on the dynamic route; route the "
            "denoiser (e.g. transformer) to dynamic offload");
  return o->profile_run(region);
}

nlohmann::json PipelineOffload::report() const {
  nlohmann::json r = nlohmann::json::object();
  r["profiled_component"] = profiled_;
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
    out += fmt::format("[{}] route {}\n", c.name, core::to_string(c.route));
    if (c.offload) out += c.offload->summary();
  }
  return out;
}

}  // namespace ddo::adapter
