// Offload::report() and summary(): what an attach did and how its steps ran, as JSON and as text.
#include <algorithm>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "ddo/core/checkpoint.h"
#include "ddo/engine/copy_scheduler.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"
#include "ddo/torch/weight_cache.h"
#include "attach_common.h"
#include "attach_quantize.h"
#include "offload_state.h"
#include "weight_source.h"

namespace ddo::adapter {

using internal::gib;
using internal::OffloadState;

namespace {

// report()["setup"]: what the attach did and what it cost.
nlohmann::json setup_report(const internal::SetupFigures& f) {
  nlohmann::json setup;
  setup = {{"seconds", f.total_seconds},
           {"resolve_seconds", f.resolve_seconds},
           {"plan_seconds", f.plan_seconds},
           {"pin_seconds", f.pin_seconds},
           {"moves_seconds", f.moves_seconds},
           {"bytes",
            {{"resident", f.resident_bytes},
             {"move_once", f.move_once_bytes},
             {"streamed", f.streamed_bytes},
             {"kept", f.kept_bytes},
             // Already on the execution device at attach (e.g. residents kept there by the
             // previous remove(keep_residents_on_device)): nothing moved.
             {"on_device", f.on_device_bytes}}},
           {"pinned_bytes", f.pinned_bytes},
           {"pageable_bytes", f.pageable_bytes},
           {"pin_fallback_bytes", f.pin_fallback_bytes},
           {"staging_bytes", f.staging_bytes},
           {"stream_units", f.stream_units},
           {"plan_cached", f.plan_cached},
           {"weight_cache",
            {{"status", f.weight_cache},
             // A hit pins nothing: its slabs were pinned by an earlier attach.
             {"pinned_new_bytes", f.weight_cache == "hit" ? 0 : f.pinned_bytes},
             {"reused_bytes", f.weight_cache_reused_bytes},
             {"refilled_bytes", f.weight_cache_refilled_bytes},
             {"changed_in_place", f.weight_cache_changed_in_place},
             {"process", pinned_weight_cache_stats().to_json()}}}};
  if (!f.load_path.empty()) {
    // Every weight went from the files to its place (loader.h); "tier": where streamed units
    // read from during steps (pinned host memory: the whole model was admitted).
    setup["load"] = {
        {"path", f.load_path},
        {"bytes", f.load_bytes},
        {"seconds", f.load_seconds},
        {"gbps",
         f.load_seconds > 0 ? static_cast<double>(f.load_bytes) / f.load_seconds / 1e9 : 0.0},
        // "host": every streamed unit in host memory; "host+disk": some read every step from
        // the files (the planner's disk tier, decision disk_tier).
        {"tier", f.disk_bytes > 0 ? "host+disk" : "host"},
        {"disk_bytes", f.disk_bytes},
        {"disk_ring_bytes", f.disk_ring_bytes},
        {"disk_spill_bytes", f.disk_spill_bytes},
        // Residents and move-once tensors that went file -> pinned bounce buffer -> device.
        {"bounced_bytes", f.bounced_bytes}};
  }
  // Streamed where the deferred loader pinned them (Note [Loader pins]): no slab, no copy.
  setup["loader_pins"] = {{"adopted_bytes", f.adopted_bytes}, {"adopted_units", f.adopted_units}};
  return setup;
}

// report()["run"]: what the steps since attach streamed, waited for and read, and the memory
// the probe saw.
nlohmann::json run_report(const OffloadState& s) {
  nlohmann::json run = nlohmann::json::object();
  if (s.runtime) {
    const engine::SchedulerStats st = s.runtime->scheduler->stats();
    run["intercepted_ops"] = s.runtime->intercepted_ops;
    run["weights_changed_in_place"] = s.runtime->changed_in_place;
    run["weights_frozen"] = s.runtime->frozen_weights;
    // Note [Training under offload]: streamed weights the host may train (ops with autograd
    // enabled that read one throw).
    run["weights_trainable"] = s.runtime->trainable_names.size();
    run["acquires"] = st.acquires;
    run["bytes_streamed"] = st.bytes_copied;
    // Totals from the timed samples (Note [Copy timing]): all of them in Timing::kFull.
    const double copy_scale = st.timed_copy_bytes > 0 ? static_cast<double>(st.bytes_copied) /
                                                            static_cast<double>(st.timed_copy_bytes)
                                                      : 0.0;
    const double wait_scale =
        st.timed_waits > 0 ? static_cast<double>(st.waits) / static_cast<double>(st.timed_waits)
                           : 0.0;
    run["copy_ms"] = st.copy_ms * copy_scale;
    run["compute_wait_ms"] = st.wait_ms * wait_scale;
    run["achieved_gbps"] =
        st.copy_ms > 0 ? static_cast<double>(st.timed_copy_bytes) / (st.copy_ms * 1e6) : 0.0;
    run["timed_copies"] = st.timed_copies;
    run["timing"] = engine::timing_name(s.runtime->scheduler->timing());
    run["prefetch_hits"] = st.prefetch_hits;
    run["on_demand"] = st.on_demand;
    run["order_misses"] = st.order_misses;
    run["relearns"] = st.relearns;
    run["trace_length"] = st.trace_length;
    run["peak_in_flight_bytes"] = st.peak_in_flight_bytes;
    run["disk_bytes_read"] = st.disk_bytes_read;
    run["disk_waits"] = st.disk_waits;
    run["disk_wait_ms"] = st.disk_wait_ms;
  }
  if (s.weights) {
    // The files' reads since the load began (load and disk tier; Note [Read meter]): whether the
    // disk was kept busy, and how many reads were in flight while it was.
    const core::ReadStats rs = s.weights->read_stats();
    run["file_reads"] = {{"bytes", rs.bytes},
                         {"reads", rs.reads},
                         {"busy_s", rs.busy_seconds},
                         {"depth_s", rs.depth_seconds}};
  }
  if (s.probe) {
    const MemorySnapshot snap = s.probe->snapshot();
    run["total_vram_bytes"] = snap.total_bytes;
    run["vram_used_bytes"] = snap.driver_used_bytes;
    run["peak_reserved_bytes"] = snap.allocator_peak_reserved_bytes;
    run["peak_vram_gb"] = gib(std::max(snap.driver_used_bytes, snap.allocator_peak_reserved_bytes));
  }
  return run;
}

}  // namespace

nlohmann::json Offload::report() const {
  const OffloadState& s = *state_;
  const internal::SetupFigures& f = s.setup;
  nlohmann::json r;
  r["model_class"] = s.model_class;
  r["execution_device"] = s.device_name;
  r["preset"] = s.settings.effective_preset;
  r["requested_preset"] = s.settings.requested_preset;
  r["execution_mode"] = core::to_string(s.settings.config.execution_mode);
  r["route"] = core::to_string(s.settings.config.route);
  r["executing"] = s.executing;
  r["active"] = s.active;
  r["setup"] = setup_report(f);
  r["modules_patched"] = f.modules_patched;
  r["resident_modules"] = s.plan.resident_module_names();
  r["resident_bytes"] = f.resident_bytes;
  r["pinned_bytes"] = f.pinned_bytes;
  nlohmann::json decisions = nlohmann::json::array();
  for (const core::Decision& d : s.plan.decisions) {
    decisions.push_back({{"name", d.name}, {"inputs", d.inputs}, {"detail", d.detail}});
  }
  r["decisions"] = std::move(decisions);
  r["run"] = run_report(s);
  r["profile_report"] = s.profile_report;
  r["kernels"] = internal::kernels_report(s.device_name);
  r["quantized_compute"] = internal::quantized_compute_report(s);
  r["plan"] = {{"resident_budget_bytes", s.plan.resident_budget_bytes},
               {"resident_used_bytes", s.plan.resident_used_bytes},
               {"always_resident_bytes", s.plan.always_resident_bytes},
               {"streamed_bytes", s.plan.streamed_bytes},
               {"move_once_bytes", s.plan.move_once_bytes},
               {"block_pattern", s.plan.block_pattern}};
  return r;
}

namespace internal {

Offload::Counters run_totals(const OffloadState& s) {
  if (s.totals_at_remove) return *s.totals_at_remove;
  Offload::Counters t;
  if (s.runtime) {
    const engine::SchedulerStats st = s.runtime->scheduler->stats();
    t.bytes_streamed = st.bytes_copied;
    t.disk_bytes_read = st.disk_bytes_read;
  }
  // The load's bytes; with the disk tier the files stay open and their meter counts the load
  // and every read since.
  t.file_bytes_read = s.setup.load_bytes;
  if (s.weights) {
    t.file_bytes_read =
        std::max(t.file_bytes_read, static_cast<std::int64_t>(s.weights->read_stats().bytes));
  }
  return t;
}

}  // namespace internal

Offload::Counters Offload::counters() const {
  return internal::run_totals(*state_);
}

std::string Offload::summary() const {
  const OffloadState& s = *state_;
  const nlohmann::json r = report();
  std::string out;  // no iostreams: Note [No iostreams] in ddo/core/status.h
  out += fmt::format(
      "ddo offload of {} on {} (preset {}, {}, route {}){}\n", s.model_class, s.device_name,
      s.settings.effective_preset, core::to_string(s.settings.config.execution_mode),
      core::to_string(s.settings.config.route), s.executing ? "" : " -- plan only, nothing moved");
  out += fmt::format(
      "  setup {:.2f} s (plan {:.2f}, pin {:.2f}, moves {:.2f}); resident {:.2f} GiB in {} "
      "modules, move-once {:.2f} GiB, streamed {:.2f} GiB in {} units, pinned {:.2f} GiB, "
      "staging {:.2f} GiB\n",
      s.setup.total_seconds, s.setup.plan_seconds, s.setup.pin_seconds, s.setup.moves_seconds,
      gib(s.setup.resident_bytes), s.setup.resident_modules, gib(s.setup.move_once_bytes),
      gib(s.setup.streamed_bytes), s.setup.stream_units, gib(s.setup.pinned_bytes),
      gib(s.setup.staging_bytes));
  const nlohmann::json& run = r["run"];
  if (run.contains("bytes_streamed")) {
    out += fmt::format(
        "  run: {} intercepted ops, streamed {:.3f} GiB, copy {:.1f} ms, compute waited {:.1f} ms, "
        "{:.1f} GB/s, {} prefetch hits, {} on demand, {} order misses\n",
        run["intercepted_ops"].get<std::int64_t>(), gib(run["bytes_streamed"].get<std::int64_t>()),
        run["copy_ms"].get<double>(), run["compute_wait_ms"].get<double>(),
        run["achieved_gbps"].get<double>(), run["prefetch_hits"].get<std::int64_t>(),
        run["on_demand"].get<std::int64_t>(), run["order_misses"].get<std::int64_t>());
  }
  if (run.contains("peak_vram_gb")) {
    out +=
        fmt::format("  memory: peak {:.2f} GiB of {:.2f} GiB\n", run["peak_vram_gb"].get<double>(),
                    gib(run["total_vram_bytes"].get<std::int64_t>()));
  }
  if (!s.quantize.empty()) {
    const nlohmann::json& q = r["quantized_compute"];
    std::string paths;
    for (const auto& [path, n] : q["counts"].items()) {
      paths += fmt::format("{}{} {}", paths.empty() ? "" : ", ", n.get<int>(), path);
    }
    out += fmt::format("  quantize {}: {} Linears ({}), {} kept dense\n", s.quantize,
                       q["layers"].size(), paths.empty() ? "none" : paths, q["kept_dense"].size());
  }
  const nlohmann::json& p = s.profile_report;
  if (p.contains("status")) {
    out += fmt::format("  profile: {} {}", p.value("name", std::string()),
                       p["status"].get<std::string>());
    if (p.contains("resident_budget_gb") && !p["resident_budget_gb"].is_null()) {
      out += fmt::format(", resident budget {:.2f} GiB", p["resident_budget_gb"].get<double>());
    }
    out += "\n";
  }
  out += s.plan.summary();
  return out;
}

}  // namespace ddo::adapter
