// Copy-engine micro-benchmark (docs/design/0009-benchmarks.md, Micro (a)): B_pinned for one large
// pinned copy, then bytes/s streamed through engine::CopyScheduler for unit sizes 1-256 MB,
// with nothing to compute, against B_pinned. Target: >= 0.95 x B_pinned for large units.
//
//   copy_engine --out copy_engine.json [--device cuda|sim] [--total-mb 2048] [--passes 3]
//
// On the host simulation it runs the same code, and says that the numbers are CPU numbers.
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.h"
#include "ddo/engine/copy_scheduler.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/memory_probe.h"

int main(int argc, char** argv) {
  using nlohmann::json;
  ddo::bench::Args args(argc, argv);
  const std::string flag = args.get("device", "");
  const bool cuda = flag.empty() ? ddo::adapter::cuda_memory_probe_available() : flag == "cuda";
  const std::size_t total = std::size_t(args.get_int("total-mb", cuda ? 4096 : 2048)) << 20;
  const int passes = std::max(1, args.get_int("passes", 3));
  json doc = ddo::bench::machine_json(args, "copy_engine");
  ddo::core::DynamicOffloadConfig config;
  config.sim_device_capacity_gb = 2.0 * total / ddo::bench::kGiB + 1.0;
  auto dev = ddo::adapter::open_execution_device(cuda ? "cuda:0" : "sim", config);
  doc["gpu"] = dev->caps().name;
  if (!cuda) {
    doc["note"] = "host simulation: the numbers are CPU (memcpy) numbers, not a GPU's";
    std::fprintf(stderr, "copy_engine: no GPU: the numbers are CPU numbers\n");
  }
  const double b_pinned = ddo::bench::measure_b_pinned(*dev, std::min<std::size_t>(total, 1 << 30));
  doc["b_pinned_gbps"] = b_pinned / ddo::bench::kGB;

  void* host = nullptr;
  ddo::throw_if_error(dev->allocate_host(total, &host));
  std::memset(host, 3, total);
  ddo::engine::Stream compute = dev->create_stream();
  json rows = json::array();
  std::string md =
      "| unit MB | units | GB/s | x B_pinned | copy GB/s (device time) | on-demand |\n"
      "| --- | --- | --- | --- | --- | --- |\n";
  for (int unit_mb : {1, 4, 16, 64, 256}) {
    const std::size_t unit = std::size_t(unit_mb) << 20;
    const std::size_t n = total / unit;
    // A staging area that holds every unit would keep them across passes and copy nothing:
    // keep it at most a quarter of the bytes streamed per pass.
    ddo::engine::SchedulerOptions so;
    so.window_bytes = std::max<std::size_t>(2 * unit, std::size_t{64} << 20);
    so.staging_bytes = so.window_bytes + 2 * unit;
    if (n < 2 || 4 * so.staging_bytes > total) {
      std::fprintf(stderr, "copy_engine: %d MB units skipped: %zu MB per pass is too little\n",
                   unit_mb, total >> 20);
      continue;
    }
    ddo::engine::CopyScheduler scheduler(*dev, so);
    for (std::size_t i = 0; i < n; ++i) {
      scheduler.add(static_cast<char*>(host) + i * unit, unit, /*pinned=*/true);
    }
    ddo::throw_if_error(scheduler.finalize());
    auto pass = [&] {
      for (std::size_t i = 0; i < n; ++i) {
        scheduler.acquire(static_cast<int>(i), compute);
        scheduler.release(static_cast<int>(i), compute);
      }
      dev->synchronize_stream(compute);
    };
    pass();  // learns the order
    scheduler.reset_stats();
    const double t0 = ddo::bench::now_s();
    for (int p = 0; p < passes; ++p) pass();
    const double seconds = ddo::bench::now_s() - t0;
    const ddo::engine::SchedulerStats st = scheduler.stats();
    // What the scheduler really copied (prefetched units still count once each).
    const double rate = double(st.bytes_copied) / seconds;
    const double copy_rate = st.copy_ms > 0 ? st.bytes_copied / (st.copy_ms / 1e3) : 0.0;
    rows.push_back({{"unit_mb", unit_mb},
                    {"units", n},
                    {"gbps", rate / ddo::bench::kGB},
                    {"of_b_pinned", rate / b_pinned},
                    {"copy_gbps", copy_rate / ddo::bench::kGB},
                    {"on_demand", st.on_demand},
                    {"prefetch_hits", st.prefetch_hits},
                    {"staging_bytes", st.staging_bytes}});
    md += "| " + std::to_string(unit_mb) + " | " + std::to_string(n) + " | " +
          ddo::bench::fmt(rate / ddo::bench::kGB, 1) + " | " + ddo::bench::fmt(rate / b_pinned, 2) +
          " | " + ddo::bench::fmt(copy_rate / ddo::bench::kGB, 1) + " | " +
          std::to_string(st.on_demand) + " |\n";
  }
  dev->destroy_stream(compute);
  dev->deallocate_host(host);
  doc["rows"] = rows;
  ddo::bench::write_json(args.get("out", ""), doc);
  std::printf("copy engine on %s: B_pinned %.1f GB/s\n%s", doc["gpu"].get<std::string>().c_str(),
              b_pinned / ddo::bench::kGB, md.c_str());
  return 0;
}
