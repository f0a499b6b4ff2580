// enable_offload: the attach in its phases (attach_setup.cpp: settings, inventory, device,
// profile, plan, placement; attach_quantize.cpp: quantize=; attach_plan.cpp: placement;
// attach_restore.cpp: remove()) and the Offload handle. The execution device:
// execution_device.cpp; the report: offload_report.cpp.
#include "ddo/torch/enable_offload.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "ddo/core/config.h"
#include "ddo/core/presets.h"
#include "ddo/core/units.h"
#include "ddo/engine/device.h"
#include "ddo/torch/weight_cache.h"
#include "attach_common.h"
#include "attach_quantize.h"
#include "intercept_common.h"
#include "offload_state.h"
#include "registration.h"
#include "weight_cache_internal.h"
#include "attach_setup.h"
#include "weight_source.h"

namespace ddo::adapter {

using internal::OffloadState;

// --- enable_offload ------------------------------------------------------------------------------

std::unique_ptr<Offload> enable_offload(torch::nn::Module& model, const OffloadOptions& options) {
  return enable_offload_tree(module_tree_from(model), options);
}

std::unique_ptr<Offload> enable_offload(const std::shared_ptr<torch::nn::Module>& model,
                                        const OffloadOptions& options) {
  DDO_CHECK(model != nullptr, Code::kInvalidArgument, "enable_offload got a null module");
  return enable_offload(*model, options);
}

std::unique_ptr<Offload> enable_offload_tree(ModuleTree tree, const OffloadOptions& options) {
  const auto start = internal::Clock::now();
  auto s = std::make_unique<OffloadState>();
  s->tree = std::move(tree);
  s->model_class = options.model_class.empty() ? s->tree.model_class : options.model_class;
  s->tree.model_class = s->model_class;
  s->record_event = options.record_event;
  s->weights = options.weights;
  if (s->weights) s->setup.load_path = s->weights->checkpoint().root;
  const core::EnvMap env = options.env ? *options.env : core::process_env();

  // The phases, in attach_setup.cpp: each returns its values, stored here in the state the
  // later phases and the handle read.
  const auto t0 = internal::Clock::now();
  internal::AttachSettings resolved = internal::resolve_attach_settings(options, env);
  s->settings = std::move(resolved.settings);
  s->device_name = s->settings.config.execution_device;
  s->backend = resolved.backend;
  s->torch_device = resolved.torch_device;
  s->executing = resolved.executing;
  internal::quantize_linears(*s, options);
  internal::AttachInventory inventory = internal::take_inventory(*s);
  s->inventory = std::move(inventory.inventory);
  s->weight_cache_key = std::move(inventory.weight_cache_key);
  s->settings.config.execution_mode = inventory.mode;
  internal::DeviceContext device = internal::open_attach_device(*s, options);
  s->device = std::move(device.device);
  s->probe = std::move(device.probe);
  s->counting = std::move(device.counting);
  s->setup.resolve_seconds = internal::seconds_since(t0);
  const std::string budget_origin = internal::resident_budget_origin(*s, options, env);
  internal::AttachProfile profile =
      internal::prepare_attach_profile(*s, resolved.device, env, device.total_vram, budget_origin);
  s->store = std::move(profile.store);
  s->prepared = std::move(profile.prepared);
  s->profile_report = std::move(profile.report);
  internal::PlannedAttach planned =
      internal::plan_attach(*s, device.total_vram, budget_origin, inventory.requested_mode);
  s->plan = std::move(planned.plan);
  s->setup.plan_cached = planned.cached;
  s->setup.plan_seconds = planned.seconds;
  internal::print_decisions(*s);
  internal::place_attach(*s);

  // Closes the files, unless the disk tier reads from them every step or quantize= keeps dense
  // weights over their mapping: remove() reads those weights back from them (Note [Mapped
  // weights come back by reads] in attach_quantize.cpp).
  const bool mapped = std::any_of(s->quantized.begin(), s->quantized.end(),
                                  [](const internal::QuantizedLinear& q) { return q.mapped; });
  if ((s->setup.disk_bytes == 0 && !mapped) || !s->active) s->weights.reset();
  s->setup.total_seconds = internal::seconds_since(start);
  internal::emit(*s, "setup", s->setup.total_seconds,
                 {{"device", s->device_name}, {"preset", s->settings.effective_preset}});
  return std::unique_ptr<Offload>(new Offload(std::move(s)));
}

namespace internal {

void mark_compute_stream(const OffloadState& s) {
  if (!s.runtime) return;
  time_all_copies(s, true);  // timeline() and calibration read every unit's copy and wait
  s.runtime->scheduler->mark(s.backend->stream(s.runtime->execution_device.index()));
}

void time_all_copies(const OffloadState& s, bool on) {
  if (s.runtime) {
    s.runtime->scheduler->set_timing(on ? engine::Timing::kFull : engine::Timing::kSampled);
  }
}

std::map<std::string, double> measured_candidate_compute(const OffloadState& s) {
  std::map<std::string, double> out;
  if (!s.runtime) return out;
  const std::vector<engine::UnitTiming> t = s.runtime->scheduler->timeline();
  const std::vector<std::string>& candidate = s.runtime->unit_candidate;
  for (std::size_t j = 0; j + 1 < t.size(); ++j) {
    const std::size_t unit = static_cast<std::size_t>(t[j].unit);
    if (unit >= candidate.size() || candidate[unit].empty()) continue;
    // From this unit's op being able to run to the next acquire: its op and whatever unmanaged
    // work (attention, norms) follows it on the compute stream.
    const double dt = t[j + 1].wait_start_ms - t[j].wait_end_ms;
    if (std::isfinite(dt) && dt >= 0.0) out[candidate[unit]] += dt;
  }
  return out;
}

}  // namespace internal

// --- Offload -------------------------------------------------------------------------------------

Offload::Offload(std::unique_ptr<internal::OffloadState> state) : state_(std::move(state)) {}

Offload::~Offload() {
  try {
    remove();
  } catch (const std::exception& e) {
    // A destructor must not throw; the model may be left partly restored.
    std::fprintf(stderr, "ddo: warning: restoring the model failed: %s\n", e.what());
  }
}

void Offload::remove() {
  state_->restore();
}
void Offload::remove(const RemoveOptions& options) {
  state_->restore(/*keep_weight_cache=*/!options.clear_weight_cache, /*setup_failed=*/false,
                  options.keep_residents_on_device);
}
bool Offload::active() const {
  return state_->active;
}
const core::Plan& Offload::plan() const {
  return state_->plan;
}
const core::DynamicOffloadSettings& Offload::settings() const {
  return state_->settings;
}
std::shared_ptr<engine::Device> Offload::device() const {
  return state_->device;
}
nlohmann::json Offload::profile_report() const {
  return state_->profile_report;
}

void Offload::reset_run_stats() {
  if (state_->runtime) state_->runtime->scheduler->reset_stats();
  if (state_->probe) state_->probe->reset_peak();
}

void Offload::mark_step() {
  internal::mark_compute_stream(*state_);
}

void Offload::time_all_copies(bool on) {
  internal::time_all_copies(*state_, on);
}

nlohmann::json Offload::timeline() const {
  nlohmann::json out = nlohmann::json::array();
  if (!state_->runtime) return out;
  auto ms = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
  for (const engine::UnitTiming& t : state_->runtime->scheduler->timeline()) {
    out.push_back({{"unit", t.unit},
                   {"bytes", t.bytes},
                   {"copy_start_ms", ms(t.copy_start_ms)},
                   {"copy_end_ms", ms(t.copy_end_ms)},
                   {"wait_start_ms", ms(t.wait_start_ms)},
                   {"wait_end_ms", ms(t.wait_end_ms)}});
  }
  return out;
}

}  // namespace ddo::adapter
