// Per-op overhead micro-benchmark (docs/design/0009-benchmarks.md, Micro (b)): a stack of tiny
// Linears, host time per op with no offload, for unmanaged ops while an offload is active elsewhere
// in the process (the interception's cost on everyone else), and for managed (streamed) weights,
// with the steady state's sampled copy timing and with every copy timed; and per op of a stack that
// streams for real (a copy and a wait per op), sampled against full timing. Target: <= 5 us of host
// time added per intercepted op.
//
//   op_overhead --out op_overhead.json [--device cuda|sim] [--layers 64] [--iters 200]
#include <algorithm>
#include <cstdio>
#include <vector>
#include <string>

#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "bench_util.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"

namespace {

torch::nn::Sequential make_stack(int layers, int width) {
  torch::nn::Sequential seq;
  for (int i = 0; i < layers; ++i) seq->push_back(torch::nn::Linear(width, width));
  return seq;
}

// Host seconds per op: `iters` forwards queued back to back, then one wait for the device.
double per_op_s(torch::nn::Sequential& seq, const torch::Tensor& x, int iters, int layers,
                ddo::adapter::MemoryProbe* probe) {
  torch::NoGradGuard no_grad;
  for (int i = 0; i < 5; ++i) seq->forward(x);  // warm-up; the offload learns its order
  if (probe) probe->synchronize();
  const double t0 = ddo::bench::now_s();
  for (int i = 0; i < iters; ++i) seq->forward(x);
  if (probe) probe->synchronize();
  return (ddo::bench::now_s() - t0) / (double(iters) * layers);
}

}  // namespace

int main(int argc, char** argv) {
  using nlohmann::json;
  ddo::bench::Args args(argc, argv);
  const std::string flag = args.get("device", "");
  const bool cuda = flag.empty() ? ddo::adapter::cuda_memory_probe_available() : flag == "cuda";
  const int layers = args.get_int("layers", 64);
  const int width = args.get_int("width", 64);
  const int iters = args.get_int("iters", 200);
  json doc = ddo::bench::machine_json(args, "op_overhead");
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  std::unique_ptr<ddo::adapter::MemoryProbe> probe;
  if (cuda) ddo::throw_if_error(ddo::adapter::make_cuda_memory_probe(0, &probe));
  if (!cuda) doc["note"] = "host simulation: CPU numbers";

  torch::Tensor x = at::randn({1, width}).to(device);
  torch::nn::Sequential plain = make_stack(layers, width);
  plain->to(device);
  const double none_s = per_op_s(plain, x, iters, layers, probe.get());

  torch::nn::Sequential managed = make_stack(layers, width);
  ddo::adapter::OffloadOptions options;
  options.preset = "one_shot_fast";
  options.execution_device = cuda ? "cuda:0" : "sim";
  options.env = ddo::core::EnvMap{};
  options.overrides = {{"small_tensor_threshold_bytes", 0},
                       {"auto_budget_policy", "off"},
                       {"resident_module_budget_gb", 0.0},
                       {"always_resident_modules_pattern", json::array()}};
  double unmanaged_s = 0.0;
  double managed_s = 0.0;
  double managed_full_s = 0.0;
  double streamed_s = 0.0;
  double streamed_full_s = 0.0;
  json report;
  json streamed_report;
  {
    auto offload = ddo::adapter::enable_offload(managed.ptr(), options);
    unmanaged_s = per_op_s(plain, x, iters, layers, probe.get());
    offload->reset_run_stats();
    managed_s = per_op_s(managed, x, iters, layers, probe.get());  // sampled copy timing
    report = offload->report().value("run", json::object());
    offload->time_all_copies(true);  // every copy and wait timed (Note [Copy timing])
    managed_full_s = per_op_s(managed, x, iters, layers, probe.get());
  }
  {
    // Streaming for real: wider layers and a staging area of a quarter of them, so every op
    // waits on a copy issued a few ops earlier. Sampled and full timing alternate `rounds` times
    // (medians), so drift of the host between phases cancels out.
    const int sw = args.get_int("stream-width", 256);
    torch::nn::Sequential streamed = make_stack(layers, sw);
    torch::Tensor xs = at::randn({1, sw}).to(device);
    ddo::adapter::OffloadOptions so = options;
    const double unit_mib = double(sw) * sw * 4 / (1 << 20);
    so.overrides["staging_mb"] = unit_mib * layers / 4;
    so.overrides["prefetch_window_mb"] = unit_mib * 4;
    auto offload = ddo::adapter::enable_offload(streamed.ptr(), so);
    const int rounds = args.get_int("rounds", 5);
    std::vector<double> sampled, full;
    for (int r = 0; r < rounds; ++r) {
      offload->time_all_copies(false);
      if (r == 0) offload->reset_run_stats();
      sampled.push_back(per_op_s(streamed, xs, iters, layers, probe.get()));
      if (r == 0) streamed_report = offload->report().value("run", json::object());
      offload->time_all_copies(true);
      full.push_back(per_op_s(streamed, xs, iters, layers, probe.get()));
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    streamed_s = median(sampled);
    streamed_full_s = median(full);
    doc["stream_width"] = sw;
    doc["rounds"] = rounds;
  }
  doc["layers"] = layers;
  doc["width"] = width;
  doc["no_offload_us_per_op"] = none_s * 1e6;
  doc["unmanaged_with_offload_us_per_op"] = unmanaged_s * 1e6;
  doc["managed_us_per_op"] = managed_s * 1e6;
  doc["added_unmanaged_us_per_op"] = (unmanaged_s - none_s) * 1e6;
  doc["added_managed_us_per_op"] = (managed_s - none_s) * 1e6;
  doc["managed_full_timing_us_per_op"] = managed_full_s * 1e6;
  doc["added_managed_full_timing_us_per_op"] = (managed_full_s - none_s) * 1e6;
  doc["streamed_us_per_op"] = streamed_s * 1e6;
  doc["streamed_full_timing_us_per_op"] = streamed_full_s * 1e6;
  doc["full_timing_costs_us_per_op"] = (streamed_full_s - streamed_s) * 1e6;
  doc["streamed_run"] = streamed_report;
  doc["managed_run"] = report;
  ddo::bench::write_json(args.get("out", ""), doc);
  std::printf(
      "| variant | us per op | added us per op |\n| --- | --- | --- |\n"
      "| no offload | %.2f | - |\n| unmanaged, offload active | %.2f | %.2f |\n"
      "| managed (held in staging) | %.2f | %.2f |\n"
      "| managed, every copy timed | %.2f | %.2f |\n"
      "| streamed (copy per op), sampled timing | %.2f | - |\n"
      "| streamed (copy per op), every copy timed | %.2f | %.2f vs sampled |\n",
      none_s * 1e6, unmanaged_s * 1e6, (unmanaged_s - none_s) * 1e6, managed_s * 1e6,
      (managed_s - none_s) * 1e6, managed_full_s * 1e6, (managed_full_s - none_s) * 1e6,
      streamed_s * 1e6, streamed_full_s * 1e6, (streamed_full_s - streamed_s) * 1e6);
  return 0;
}
