// W1 benchmark: the FLUX.1-sized MMDiT under emulated VRAM caps (docs/design/0009-benchmarks.md).
//
// For each cap: a calibration run of `one_shot_fast` under a profile name, a normal run that
// applies the saved recommendation, and the two classic routes (diffusers_offload_compat,
// diffusers_leaf_offload_compat) as baselines, all in one process against the same host copy of
// the model; plus one all-resident row (uncapped) that gives T_resident. B_pinned is measured in
// the same run. Each row: setup s, first step s, median steady step s, streamed GB per step,
// achieved GB/s, compute wait per step, peak VRAM (driver view, Note [Peak rule]), peak host
// RSS, bound = max(T_resident, streamed / B_pinned), efficiency = bound / median.
// See docs/design/0002-measurement.md.
//
//   w1 --size full --caps 8,12,16,24,0 --steps 5 --out w1.json
//   scripts/gpu-bench-table.py w1.json > w1.md                # the markdown table (one writer)
//   w1 --size tiny --device sim --caps 0.05,0 --steps 5      # the same flow on the simulation
//
// Flags: --size tiny|small|full, --caps GiB list (0 = uncapped), --steps N (>= 5 timed steps
// after one warm-up), --routes calibrated,block,leaf (subset), --device cuda|sim (default: cuda
// when a GPU is present), --no-resident (skip the resident row; then --t-resident S supplies it),
// --profile-dir DIR, --overrides JSON (config fields for every ddo row, e.g.
// '{"prefetch_window_mb":2048}'), --timeline (each ddo row keeps the per-unit copy and wait times
// of its last step: CopyScheduler::timeline), --out FILE.json (without it the document goes to
// stdout), --commit SHA. Each row is also logged to stderr as it finishes. Rows on CUDA also
// record the caching allocator's retries, cudaMallocs and syncs inside the timed steps.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "bench_util.h"
#include "ddo/core/status.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"
#include "ddo/torch/testing/flux_dit.h"

namespace {

using ddo::adapter::MemoryProbe;
using ddo::adapter::testing::FluxDiT;
using ddo::adapter::testing::FluxDiTImpl;
using ddo::adapter::testing::FluxDiTInputs;
using ddo::adapter::testing::FluxDiTOptions;
using ddo::bench::kGB;
using ddo::bench::kGiB;
using nlohmann::json;

struct Context {
  bool cuda = false;
  std::string exec_device;  // "cuda:0" or "sim"
  FluxDiT model{nullptr};
  FluxDiTInputs inputs;
  int steps = 5;
  double t_resident = 0.0;
  double b_pinned = 0.0;  // bytes per second
  double model_bytes = 0.0;
  std::string profile_dir;
  json overrides = json::object();  // --overrides: config fields for every ddo row
  bool timeline = false;            // --timeline: per-unit copy/wait times of the last step
};

// Waits for the device so that host timers measure device work.
void sync(MemoryProbe& probe) {
  probe.synchronize();
}

std::unique_ptr<MemoryProbe> open_probe(const Context& ctx,
                                        const std::shared_ptr<ddo::engine::Device>& device) {
  if (ctx.cuda) {
    std::unique_ptr<MemoryProbe> probe;
    ddo::throw_if_error(ddo::adapter::make_cuda_memory_probe(0, &probe));
    return probe;
  }
  return ddo::adapter::make_sim_memory_probe(*device);
}

// Runs one warm-up step and ctx.steps timed steps; returns {first, steps...} in seconds.
// `before_last` runs right before the last step is issued (after the sync), e.g. to mark it.
std::vector<double> run_steps(Context& ctx, MemoryProbe& probe,
                              const std::function<void()>& after_first = {},
                              const std::function<void()>& before_last = {}) {
  torch::NoGradGuard no_grad;
  std::vector<double> times;
  for (int i = 0; i <= ctx.steps; ++i) {
    sync(probe);
    if (i == ctx.steps && before_last) before_last();
    const double t0 = ddo::bench::now_s();
    torch::Tensor out = ctx.model->forward(ctx.inputs.img, ctx.inputs.txt, ctx.inputs.timestep);
    sync(probe);
    times.push_back(ddo::bench::now_s() - t0);
    if (i == 0 && after_first) after_first();
  }
  return times;
}

struct RowSpec {
  std::string route;   // resident, calibration, calibrated, block, leaf
  std::string preset;  // the ddo preset
  double cap_gib = 0.0;
};

json run_row(Context& ctx, const RowSpec& spec) {
  json row;
  row["workload"] = "flux-dit";
  row["cap_gib"] = spec.cap_gib;
  row["route"] = spec.route;
  row["preset"] = spec.preset;
  ddo::bench::reset_peak_rss();
  ddo::adapter::release_cached_device_memory();
  std::shared_ptr<ddo::engine::Device> sim;
  if (!ctx.cuda) {
    ddo::core::DynamicOffloadConfig config;
    config.sim_device_capacity_gb = spec.cap_gib > 0 ? spec.cap_gib : 4 * ctx.model_bytes / kGiB;
    config.sim_copy_gbps = 0.0;
    sim = ddo::adapter::open_execution_device("sim", config);
  } else {
    ddo::throw_if_error(
        ddo::adapter::apply_vram_cap(0, static_cast<std::int64_t>(spec.cap_gib * kGiB)));
  }
  std::unique_ptr<MemoryProbe> probe = open_probe(ctx, sim);
  ddo::throw_if_error(probe->start_sampling(std::chrono::milliseconds(2)));
  std::unique_ptr<ddo::adapter::Offload> offload;
  try {
    const double t0 = ddo::bench::now_s();
    if (spec.route == "resident") {
      if (ctx.cuda) ctx.model->to(torch::Device(torch::kCUDA, 0));
    } else {
      ddo::adapter::OffloadOptions options;
      options.preset = spec.preset;
      options.execution_device = ctx.exec_device;
      options.device = sim;
      if (spec.route == "calibration" || spec.route == "calibrated") {
        options.profile_name = ddo::internal::str_cat("w1-cap", spec.cap_gib);
        options.build_profile = spec.route == "calibration";
      }
      ddo::core::EnvMap env;
      env["DDO_PROFILE_DIR"] = ctx.profile_dir;
      options.env = env;
      options.overrides = ctx.overrides;
      if (ctx.cuda && spec.cap_gib > 0) options.overrides["vram_cap_gb"] = spec.cap_gib;
      if (!ctx.cuda) options.overrides["sim_device_capacity_gb"] = sim->memory().total_bytes / kGiB;
      offload = ddo::adapter::enable_offload(ctx.model.ptr(), options);
    }
    sync(*probe);
    row["setup_s"] = ddo::bench::now_s() - t0;
    std::vector<double> times;
    ddo::adapter::AllocatorCounters before;
    auto reset = [&] {
      if (offload) offload->reset_run_stats();
      before = ddo::adapter::allocator_counters(0);
    };
    std::function<void()> mark;
    if (offload && ctx.timeline) mark = [&] { offload->mark_step(); };
    if (offload && spec.route == "calibration") {
      row["profile_report"] =
          offload->profile_run([&] { times = run_steps(ctx, *probe, reset, mark); });
    } else {
      times = run_steps(ctx, *probe, reset, mark);
    }
    if (mark) row["timeline"] = offload->timeline();  // the last step, synchronized above
    if (ctx.cuda) {
      // Allocator events inside the timed steps: each retry frees the cache and synchronizes.
      const ddo::adapter::AllocatorCounters after = ddo::adapter::allocator_counters(0);
      row["timed_alloc_retries"] = after.alloc_retries - before.alloc_retries;
      row["timed_device_allocs"] = after.device_allocs - before.device_allocs;
      row["timed_allocator_syncs"] = after.sync_all_streams - before.sync_all_streams;
    }
    row["first_step_s"] = times.front();
    row["step_s"] = std::vector<double>(times.begin() + 1, times.end());
    const double median = ddo::bench::median({times.begin() + 1, times.end()});
    row["median_step_s"] = median;
    double streamed = 0.0;
    if (offload) {
      const json report = offload->report();
      const json run = report.value("run", json::object());
      streamed = run.value("bytes_streamed", 0.0) / ctx.steps;
      row["achieved_gbps"] = run.value("achieved_gbps", 0.0);
      row["compute_wait_s_per_step"] = run.value("compute_wait_ms", 0.0) / 1e3 / ctx.steps;
      row["resident_gb"] = report.value("resident_bytes", 0.0) / kGB;
      row["setup"] = report.value("setup", json::object());
      if (spec.route == "calibrated")
        row["profile_report"] = report.value("profile_report", json());
    }
    row["streamed_gb_per_step"] = streamed / kGB;
    if (spec.route == "resident") ctx.t_resident = median;
    const double bound = std::max(ctx.t_resident, streamed / ctx.b_pinned);
    row["bound_s"] = bound;
    row["efficiency"] = median > 0 ? bound / median : 0.0;
  } catch (const c10::Error& e) {  // out of memory at a cap: a result, not a crash
    row["error"] = e.what_without_backtrace();
    std::fprintf(stderr, "w1: %s at cap %g GiB failed: %s\n", spec.route.c_str(), spec.cap_gib,
                 e.what_without_backtrace());
  } catch (const std::exception& e) {
    row["error"] = e.what();
    std::fprintf(stderr, "w1: %s at cap %g GiB failed: %s\n", spec.route.c_str(), spec.cap_gib,
                 e.what());
  }
  // Host RAM of setup and steps (what the target is about); removal, which rebuilds ordinary
  // CPU tensors while the slabs still exist, is reported on its own.
  row["peak_host_rss_gib"] = ddo::bench::proc_status_bytes("VmHWM") / kGiB;
  offload.reset();  // restores the model to host memory
  if (spec.route == "resident" && ctx.cuda) ctx.model->to(torch::kCPU);
  const ddo::adapter::MeasurementResult m = probe->stop_sampling();
  row["peak_vram_gib"] = m.peak_bytes / kGiB;
  row["peak_driver_vram_gib"] = m.peak_driver_used_bytes / kGiB;
  row["total_vram_gib"] = m.total_bytes / kGiB;
  row["peak_host_rss_with_remove_gib"] = ddo::bench::proc_status_bytes("VmHWM") / kGiB;
  ddo::adapter::release_cached_device_memory();
  if (ctx.cuda) ddo::throw_if_error(ddo::adapter::apply_vram_cap(0, 0));
  std::fprintf(stderr, "w1: %s\n", row.dump().c_str());
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  ddo::bench::Args args(argc, argv);
  Context ctx;
  const std::string device_flag = args.get("device", "");
  ctx.cuda =
      device_flag.empty() ? ddo::adapter::cuda_memory_probe_available() : device_flag == "cuda";
  ctx.exec_device = ctx.cuda ? "cuda:0" : "sim";
  ctx.steps = std::max(1, args.get_int("steps", 5));
  const std::string size = args.get("size", ctx.cuda ? "full" : "tiny");
  const std::vector<double> caps = args.get_list("caps", ctx.cuda ? "8,12,16,24,0" : "0");
  const std::string routes = args.get("routes", "calibrated,block,leaf");
  // A fresh folder per run, so calibration starts from nothing. Not std::filesystem::remove_all:
  // libtorch.so exports its own copy of that symbol, which crashes when called from here.
  if (args.has("overrides")) {
    ctx.overrides = json::parse(args.get("overrides", "{}"));
    if (!ctx.overrides.is_object()) {
      std::fprintf(stderr, "w1: --overrides takes a JSON object of config fields\n");
      return 2;
    }
  }
  ctx.timeline = args.has("timeline");
  ctx.profile_dir = args.get("profile-dir", "");
  if (ctx.profile_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/ddo-w1-profiles-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      std::fprintf(stderr, "w1: cannot create a profile folder from %s\n", pattern.c_str());
      return 1;
    }
    ctx.profile_dir = pattern;
  }

  json doc = ddo::bench::machine_json(args, "w1");
  doc["device"] = ctx.exec_device;
  doc["size"] = size;
  doc["steps"] = ctx.steps;
  if (!ctx.overrides.empty()) doc["overrides"] = ctx.overrides;
  if (!ctx.cuda) {
    doc["note"] = "host simulation: the numbers are CPU numbers, not a GPU's";
    std::fprintf(stderr,
                 "w1: no GPU: running on the host simulation; the numbers are CPU numbers\n");
  }
  const FluxDiTOptions options = FluxDiTOptions::preset(size);
  ctx.model_bytes = static_cast<double>(FluxDiTImpl::parameter_bytes(options));
  doc["model_gb"] = ctx.model_bytes / kGB;
  doc["parameters"] = FluxDiTImpl::parameter_count(options);

  // The model lives in host memory once and is reused by every row (remove() restores it).
  double t0 = ddo::bench::now_s();
  const c10::Device init = ctx.cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  ctx.model = FluxDiT(options, c10::kCPU, init);
  ctx.inputs = ddo::adapter::testing::make_inputs(
      options, ctx.cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU));
  doc["model_build_s"] = ddo::bench::now_s() - t0;
  std::fprintf(stderr, "w1: built %s model (%.1f GB) in %.1f s\n", size.c_str(),
               ctx.model_bytes / kGB, ddo::bench::now_s() - t0);

  {
    ddo::core::DynamicOffloadConfig config;
    config.sim_device_capacity_gb = 2.0;
    auto dev = ddo::adapter::open_execution_device(ctx.exec_device, config);
    doc["gpu"] = dev->caps().name;
    const std::size_t bytes = ctx.cuda ? (std::size_t{1} << 30) : (std::size_t{256} << 20);
    ctx.b_pinned = ddo::bench::measure_b_pinned(*dev, bytes);
  }
  doc["b_pinned_gbps"] = ctx.b_pinned / kGB;
  ddo::adapter::release_cached_device_memory();

  json rows = json::array();
  if (!args.has("no-resident")) {
    rows.push_back(run_row(ctx, {"resident", "off", 0.0}));
  } else {
    ctx.t_resident = args.get_double("t-resident", 0.0);
  }
  doc["t_resident_s"] = ctx.t_resident;
  auto wants = [&](const std::string& r) { return routes.find(r) != std::string::npos; };
  for (double cap : caps) {
    if (wants("calibrated")) {
      rows.push_back(run_row(ctx, {"calibration", "one_shot_fast", cap}));
      rows.push_back(run_row(ctx, {"calibrated", "one_shot_fast", cap}));
    }
    if (wants("block")) rows.push_back(run_row(ctx, {"block", "diffusers_offload_compat", cap}));
    if (wants("leaf")) rows.push_back(run_row(ctx, {"leaf", "diffusers_leaf_offload_compat", cap}));
    doc["rows"] = rows;
    ddo::bench::write_json(args.get("out", ""), doc);  // partial results survive a timeout
  }
  doc["rows"] = rows;
  if (args.has("out")) {
    ddo::bench::write_json(args.get("out", ""), doc);
  } else {
    std::printf("%s\n", doc.dump(2).c_str());
  }
  return 0;
}
