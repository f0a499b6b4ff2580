// `ddo demo`: the seed page's flow on the W1 model (a FLUX-style DiT from stock LibTorch layers).
//
//   ddo demo --profile demo-dit --calibrate     # calibrate: "profile saved: ..."
//   ddo demo --profile demo-dit                 # reuse:     "profile applied: ..."
//
// On a machine with CUDA it runs on cuda:0, otherwise on the host simulation ("sim"), whose
// card is sized below the model so that streaming and residency both show. The preset is
// --preset, else DDO_PRESET, else auto, like every other ddo entry point (settings.h).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>

#include "commands.h"
#include "ddo/core/config.h"
#include "ddo/core/settings.h"
#include "ddo/core/status.h"
#include "ddo/engine/device.h"
#include "ddo/torch/enable_offload.h"
#include "ddo/torch/testing/flux_dit.h"

namespace ddo::cli {
namespace {

struct DemoArgs {
  std::string profile;
  bool calibrate = false;
  std::string preset;  // "" = DDO_PRESET, else auto
  std::string device;
  std::string size = "small";
  int steps = 4;
  bool json = false;
};

double gib(double bytes) {
  return bytes / core::kGiB;
}

// The largest device index the demo accepts; far above any machine, small enough for an int.
constexpr int kMaxDeviceIndex = 1023;

// Checks --device: "sim", "sim:N", "cuda" or "cuda:N" with N an index, and for CUDA that a GPU
// with that index is there. Throws ddo::Error naming the text and what to write instead.
void check_device(const std::string& device) {
  std::string_view kind = device;
  std::string_view index;
  if (const std::size_t colon = device.find(':'); colon != std::string::npos) {
    kind = std::string_view(device).substr(0, colon);
    index = std::string_view(device).substr(colon + 1);
  }
  DDO_CHECK(kind == "sim" || kind == "cuda", Code::kInvalidArgument, "--device '", device,
            "' is not a device the demo runs on; use sim (the host simulation) or cuda:N (a GPU)");
  int n = 0;
  if (device.find(':') != std::string::npos) {
    auto [end, ec] = std::from_chars(index.data(), index.data() + index.size(), n);
    DDO_CHECK(!index.empty() && ec == std::errc() && end == index.data() + index.size() && n >= 0 &&
                  n <= kMaxDeviceIndex,
              Code::kInvalidArgument, "--device '", device, "': the index '", index,
              "' is not a number from 0 to ", kMaxDeviceIndex, "; write e.g. ", kind, ":0");
  }
  if (kind == "cuda") {
    DDO_CHECK(engine::cuda_available(), Code::kUnavailable, "--device '", device,
              "': no CUDA GPU is usable here (none found, or this ddo was built without CUDA); "
              "use --device sim to run the demo on the host simulation");
    const auto gpus = static_cast<int>(torch::cuda::device_count());
    DDO_CHECK(n < gpus, Code::kInvalidArgument, "--device '", device, "': this machine has ", gpus,
              " CUDA GPU(s), cuda:0 to cuda:", gpus - 1, "; or use --device sim");
  }
}

int run_demo(const DemoArgs& args) {
  using adapter::testing::FluxDiT;
  using adapter::testing::FluxDiTOptions;
  std::string device = args.device;
  if (device.empty()) device = engine::cuda_available() ? "cuda:0" : "sim";
  check_device(device);
  const bool sim = device.rfind("sim", 0) == 0;
  FluxDiTOptions opts = FluxDiTOptions::preset(args.size);
  const double model_bytes =
      static_cast<double>(adapter::testing::FluxDiTImpl::parameter_bytes(opts));
  if (!args.json) {
    std::printf("ddo demo: W1 flux-dit (%s, %.1f M parameters, %.2f GiB) on %s, profile '%s'%s\n",
                args.size.c_str(),
                static_cast<double>(adapter::testing::FluxDiTImpl::parameter_count(opts)) / 1e6,
                gib(model_bytes), device.c_str(), args.profile.c_str(),
                args.calibrate ? " (calibration run)" : "");
  }
  FluxDiT model(opts);
  const c10::Device input_device = sim ? c10::Device(c10::kCPU) : c10::Device(device);
  adapter::testing::FluxDiTInputs in = adapter::testing::make_inputs(opts, input_device);

  adapter::OffloadOptions o;
  // The regular settings loader: --preset when given, else DDO_PRESET, else auto. (Leaving
  // o.preset at its "auto" default would ignore DDO_PRESET, as the demo did.)
  core::SettingsRequest request;
  if (!args.preset.empty()) request.preset = args.preset;
  o.settings = core::DynamicOffloadSettings::from_env(request, core::process_env());
  o.profile_name = args.profile;
  o.build_profile = args.calibrate;
  o.execution_device = device;
  nlohmann::json overrides = nlohmann::json::object();
  if (sim) {
    // A simulated card smaller than the model, with a headroom to match its size.
    const double card_gb = std::max(gib(model_bytes) * 0.6, 0.0625);
    overrides["sim_device_capacity_gb"] = card_gb;
    overrides["profile_vram_headroom_gb"] = card_gb * 0.05;
    if (!args.json) {
      std::printf("simulated card: %.3f GiB (60%% of the model), profile headroom %.3f GiB\n",
                  card_gb, card_gb * 0.05);
    }
  }
  o.overrides = overrides;
  std::vector<std::pair<std::string, double>> events;
  o.record_event = [&](const std::string& name, double seconds, const nlohmann::json&) {
    events.emplace_back(name, seconds);
  };
  std::unique_ptr<adapter::Offload> offload = adapter::enable_offload(*model, o);
  if (!args.json) {
    std::printf("preset: %s (requested: %s)\n", offload->settings().effective_preset.c_str(),
                offload->settings().requested_preset.c_str());
    std::printf("\n%s\n", offload->plan().summary().c_str());
  }

  std::vector<double> step_seconds;
  nlohmann::json profile = offload->profile_run([&] {
    torch::NoGradGuard no_grad;
    for (int i = 0; i < args.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      torch::Tensor out = model->forward(in.img, in.txt, in.timestep);
      if (!sim) out = out.to(c10::kCPU);  // the step ends when its output is on the host
      step_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  });
  nlohmann::json report = offload->report();

  if (args.json) {
    nlohmann::json out = {
        {"profile_report", profile}, {"report", report}, {"step_seconds", step_seconds}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  const std::string status = profile.value("status", "");
  const std::string path = profile.value("path", "");
  const auto num = [&](const char* key) {
    return profile.contains(key) && profile[key].is_number() ? profile[key].get<double>() : 0.0;
  };
  if (status == "saved") {
    std::printf(
        "profile saved: %s\n  resident budget %.3f GiB = total %.3f GiB - peak %.3f GiB - "
        "headroom %.3f GiB\n",
        path.c_str(), num("resident_budget_gb"), num("total_vram_gb"), num("peak_vram_gb"),
        num("headroom_gb"));
  } else if (status == "applied") {
    std::printf("profile applied: %s\n  resident budget %.3f GiB (%s)\n", path.c_str(),
                num("resident_budget_gb"), profile.value("budget_source", "profile").c_str());
  } else {
    std::printf("profile %s: %s\n", status.c_str(), profile.dump().c_str());
  }
  if (profile.contains("notes")) {
    for (const auto& n : profile["notes"])
      std::printf("  note: %s\n", n.get<std::string>().c_str());
  }
  std::printf("\nsetup:");
  for (const auto& [name, seconds] : events) std::printf(" %s %.3f s", name.c_str(), seconds);
  std::printf("\nsteps:");
  for (double s : step_seconds) std::printf(" %.3f", s);
  std::printf(" s\n");
  const nlohmann::json& run = report["run"];
  if (run.contains("bytes_streamed")) {
    const double steps = std::max<double>(1, args.steps);
    std::printf(
        "streamed %.3f GiB per step, copy %.1f ms, compute waited %.1f ms, %.1f GB/s, "
        "%lld prefetch hits, %lld on demand\n",
        gib(run["bytes_streamed"].get<double>()) / steps, run["copy_ms"].get<double>(),
        run["compute_wait_ms"].get<double>(), run["achieved_gbps"].get<double>(),
        static_cast<long long>(run["prefetch_hits"].get<std::int64_t>()),
        static_cast<long long>(run["on_demand"].get<std::int64_t>()));
  }
  if (run.contains("peak_vram_gb")) {
    std::printf("peak device memory %.3f GiB of %.3f GiB\n", run["peak_vram_gb"].get<double>(),
                gib(run["total_vram_bytes"].get<double>()));
  }
  std::printf("resident modules: %zu, resident %.3f GiB, pinned %.3f GiB\n",
              report["resident_modules"].size(), gib(report["resident_bytes"].get<double>()),
              gib(report["pinned_bytes"].get<double>()));
  return 0;
}

}  // namespace

void add_demo_command(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* demo = app.add_subcommand(
      "demo", "Run the W1 DiT under a named profile: calibrate once, then reuse the profile");
  demo->add_option("--profile", args->profile, "Profile name (e.g. demo-dit)")->required();
  demo->add_flag("--calibrate", args->calibrate, "Calibration run: measure and save the profile");
  demo->add_option("--preset", args->preset,
                   "Preset (see `ddo presets`; default: DDO_PRESET, else auto)");
  demo->add_option("--device", args->device, "sim, sim:N or cuda:N (default: cuda:0 if present)");
  demo->add_option("--size", args->size, "Model size: tiny, small or full")
      ->check(CLI::IsMember({"tiny", "small", "full"}));
  demo->add_option("--steps", args->steps, "Forward passes inside the measured region")
      ->check(CLI::PositiveNumber);
  demo->add_flag("--json", args->json, "Print the reports as JSON");
  demo->callback([args, &exit_code] {
    try {
      exit_code = run_demo(*args);
    } catch (const c10::Error& e) {
      // Torch's own message carries a C++ backtrace; the user needs the reason and the way out.
      const bool gpu = args->device.empty() || args->device.rfind("cuda", 0) == 0;
      throw Error(Code::kUnavailable,
                  fmt::format("{}{}", e.what_without_backtrace(),
                              gpu ? "; to run without a GPU, use --device sim" : ""));
    }
  });
}

}  // namespace ddo::cli
