// `ddo demo`: the named-profile flow (docs/design/0007-named-profiles.md) on a FLUX-style DiT
// built from stock LibTorch layers (the W1 benchmark's model), recorded under the public class
// name ddo.demo.FluxStyleDiT.
//
//   ddo demo --profile demo-dit --calibrate     # "== ddo demo 1/2: calibration ...", "profile:
//   saved" ddo demo --profile demo-dit                 # "== ddo demo 2/2: reuse ...", then first
//                                               # "calibration bought: 2 of 12 blocks stay ..."
//   --verbose adds the planner's decisions and the stream statistics; --json gives the same
//   figures as JSON ("calibration_bought").
//
// On a machine with CUDA it runs on cuda:0, otherwise on the host simulation ("sim"), whose
// card is sized below the model so that the saved budget keeps some blocks resident and the rest
// stream (Note [Demo card]). Its profiles live in ~/.ddo/demo-profiles unless DDO_PROFILE_DIR
// says otherwise, apart from the user's workloads. The preset is --preset, else DDO_PRESET, else
// auto, like every other ddo entry point (settings.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <regex>
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
#include "ddo/core/profile_store.h"
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
  bool verbose = false;
  std::string quantize;  // "" = dense; "fp8" / "int8": OffloadOptions::quantize
};

// The model's class as profiles record it: a public name, not the C++ type of the test model.
constexpr const char* kDemoModelClass = "ddo.demo.FluxStyleDiT";

// A size for people: MiB below a GiB, GiB above, rounded.
std::string size_text(double gib_value) {
  if (gib_value < 1.0) return fmt::format("{:.0f} MiB", gib_value * 1024.0);
  return fmt::format("{:.2f} GiB", gib_value);
}

double gib(double bytes) {
  return bytes / core::kGiB;
}

// Checks --device: "sim", "sim:N", "cuda" or "cuda:N" with N an index (core's one rule,
// core::DeviceName), and for CUDA that a GPU with that index is there. Throws ddo::Error naming
// the text and what to write instead.
core::DeviceName check_device(const std::string& device) {
  throw_if_error(core::check_device_index("--device", device));
  core::DeviceName name;
  DDO_CHECK(core::parse_device_name("--device", device, &name).ok() &&
                name.type != core::DeviceType::kCpu,
            Code::kInvalidArgument, "--device '", device,
            "' is not a device the demo runs on; use sim (the host simulation) or cuda:N (a GPU)");
  if (name.type == core::DeviceType::kCuda) {
    DDO_CHECK(engine::cuda_available(), Code::kUnavailable, "--device '", device,
              "': no CUDA GPU is usable here (none found, or this ddo was built without CUDA); "
              "use --device sim to run the demo on the host simulation");
    const auto gpus = static_cast<int>(torch::cuda::device_count());
    DDO_CHECK(name.index < gpus, Code::kInvalidArgument, "--device '", device,
              "': this machine has ", gpus, " CUDA GPU(s), cuda:0 to cuda:", gpus - 1,
              "; or use --device sim");
  }
  return name;
}

// Note [Demo card]
// ~~~~~~~~~~~~~~~~
// The demo shows what calibration buys, so on the host simulation its card and link are sized
// for that. The calibration run measures the peak with nothing resident: the modules moved once,
// the staging ring (Note [Working set]: a window of at most half the room the card leaves, plus
// two of the largest unit) and the activations. The saved budget is the card less that peak and
// the headroom, about half the room: a card of 60% of the model left a budget smaller than any
// block, and the second run streamed exactly as much as the first. At kDemoCardFraction of the
// model the budget keeps some of the small model's 12 blocks and the rest stream (2 to 4 in runs
// here: the measured peak moves by a few MiB with the copies in flight; tools/tests/demo_test.cpp).
// ddo matters where the link bounds a step (a small card), but a host copy is as fast as the
// host's compute, so streaming less would not show in the step time. The simulated link is
// therefore scaled to the model: streaming all of it takes kDemoStreamSeconds (0.14 GB/s for the
// small model, never below the sim's floor of 0.1 GB/s), and the inputs have a sixteenth of the
// preset's tokens, so the copies, not the host's compute, set the step time. DDO_SIM_COPY_GBPS
// still wins.
constexpr double kDemoCardFraction = 0.85;
constexpr double kDemoHeadroomFraction = 0.05;  // of the card
constexpr double kDemoStreamSeconds = 2.0;
constexpr double kMinSimCopyGbps = 0.1;  // config's floor for sim_copy_gbps

// What one run of the demo measured, for the comparison the second run prints.
struct RunSummary {
  double streamed_gib_per_step = 0;
  double copy_seconds_per_step = 0;  // the link's busy time: set by the bytes and the link rate
  double step_seconds = 0;           // the fastest step: the least of what else the host did
  int resident_blocks = 0;
  int blocks = 0;
  double resident_gib = 0;

  nlohmann::json to_json() const {
    return {{"streamed_gib_per_step", streamed_gib_per_step},
            {"copy_seconds_per_step", copy_seconds_per_step},
            {"step_seconds", step_seconds},
            {"resident_blocks", resident_blocks},
            {"blocks", blocks},
            {"resident_gib", resident_gib}};
  }
  static std::optional<RunSummary> from_json(const nlohmann::json& j) {
    RunSummary r;
    try {
      r.streamed_gib_per_step = j.at("streamed_gib_per_step").get<double>();
      r.copy_seconds_per_step = j.at("copy_seconds_per_step").get<double>();
      r.step_seconds = j.at("step_seconds").get<double>();
      r.resident_blocks = j.at("resident_blocks").get<int>();
      r.blocks = j.at("blocks").get<int>();
      r.resident_gib = j.at("resident_gib").get<double>();
    } catch (const nlohmann::json::exception&) {
      return std::nullopt;  // written by another version of the demo: no comparison
    }
    return r;
  }
};

// Resident blocks: report["resident_modules"] names whole blocks ("transformer_blocks.2") when
// the budget keeps them.
RunSummary summarize(const nlohmann::json& report, const std::vector<double>& step_seconds,
                     const adapter::testing::FluxDiTOptions& opts) {
  RunSummary r;
  r.blocks = opts.double_blocks + opts.single_blocks;
  const std::regex block(R"(^(single_)?transformer_blocks\.[0-9]+$)");
  for (const auto& name : report.value("resident_modules", nlohmann::json::array())) {
    if (name.is_string() && std::regex_match(name.get<std::string>(), block)) ++r.resident_blocks;
  }
  const nlohmann::json& plan = report["plan"];
  r.resident_gib = gib(plan.value("resident_used_bytes", 0.0));
  const nlohmann::json& run = report["run"];
  const double steps = std::max<double>(1, static_cast<double>(step_seconds.size()));
  r.streamed_gib_per_step = gib(run.value("bytes_streamed", 0.0)) / steps;
  r.copy_seconds_per_step = run.value("copy_ms", 0.0) / 1e3 / steps;
  r.step_seconds =
      step_seconds.empty() ? 0.0 : *std::min_element(step_seconds.begin(), step_seconds.end());
  return r;
}

// The calibration run's summary sits beside its profile ("<profile>.json.demo-run.json", which
// `ddo profiles` does not list), so that the second run can say what calibration bought.
std::filesystem::path summary_path(const std::string& profile_path) {
  return std::filesystem::path(profile_path + ".demo-run.json");
}

void save_summary(const std::string& profile_path, const RunSummary& summary) {
  const Status s = core::write_file_atomic(summary_path(profile_path), summary.to_json().dump(2));
  if (!s.ok()) {
    std::fprintf(stderr, "ddo: warning: the run's summary was not kept: %s\n", s.message().c_str());
  }
}

std::optional<RunSummary> load_summary(const std::string& profile_path) {
  std::string text;
  nlohmann::json j;
  if (!core::read_text_file(summary_path(profile_path), &text).ok() ||
      !core::parse_json_bounded(text, &j).ok()) {
    return std::nullopt;
  }
  return RunSummary::from_json(j);
}

// The demo's profiles live apart from the user's (~/.ddo/profiles): DDO_PROFILE_DIR when set,
// else ~/.ddo/demo-profiles.
core::EnvMap demo_env() {
  core::EnvMap env = core::process_env();
  auto it = env.find("DDO_PROFILE_DIR");
  if (it == env.end() || it->second.empty()) env["DDO_PROFILE_DIR"] = "~/.ddo/demo-profiles";
  env["DDO_PROFILE_DIR"] = core::resolve_profile_dir(env).string();
  return env;
}

// What calibration bought, from the reuse run's summary and the calibration run's: the one
// computation behind the text's first line and the JSON's "calibration_bought".
struct Benefit {
  bool compared = false;  // false: no calibration run to compare with
  bool any = false;       // false: the saved budget keeps no block here
  int resident_blocks = 0;
  int blocks = 0;
  double resident_gib = 0;
  double streamed_gib = 0, streamed_gib_before = 0, streamed_less_percent = 0;
  double copy_seconds = 0, copy_seconds_before = 0;
  double step_seconds = 0, step_seconds_before = 0, speedup = 0;

  nlohmann::json to_json() const {
    return {{"compared", compared},
            {"resident_blocks", resident_blocks},
            {"blocks", blocks},
            {"resident_gib", resident_gib},
            {"streamed_gib_per_step", streamed_gib},
            {"calibration_streamed_gib_per_step", streamed_gib_before},
            {"streamed_less_percent", streamed_less_percent},
            {"copy_seconds_per_step", copy_seconds},
            {"calibration_copy_seconds_per_step", copy_seconds_before},
            {"fastest_step_seconds", step_seconds},
            {"calibration_fastest_step_seconds", step_seconds_before},
            {"speedup", speedup}};
  }

  std::string text() const {
    if (!compared) {
      return fmt::format(
          "{} of {} blocks stay on the card ({}); no calibration run to compare with (run with "
          "--calibrate first)",
          resident_blocks, blocks, size_text(resident_gib));
    }
    if (!any) {
      return fmt::format(
          "calibration bought nothing here: the saved budget keeps no block on this card, and "
          "each step streams {} as in the calibration run",
          size_text(streamed_gib));
    }
    return fmt::format(
        "calibration bought: {} of {} blocks ({}) stay on the card, so each step streams {} "
        "instead of {} ({:.0f}% less); copies take {:.2f} s per step instead of {:.2f} s, and the "
        "fastest step {:.2f} s instead of {:.2f} s ({:.2f}x as fast)",
        resident_blocks, blocks, size_text(resident_gib), size_text(streamed_gib),
        size_text(streamed_gib_before), streamed_less_percent, copy_seconds, copy_seconds_before,
        step_seconds, step_seconds_before, speedup);
  }
};

Benefit benefit_of(const RunSummary& now, const std::optional<RunSummary>& calibration) {
  Benefit b;
  b.resident_blocks = now.resident_blocks;
  b.blocks = now.blocks;
  b.resident_gib = now.resident_gib;
  b.streamed_gib = now.streamed_gib_per_step;
  b.copy_seconds = now.copy_seconds_per_step;
  b.step_seconds = now.step_seconds;
  if (!calibration) return b;
  const RunSummary& c = *calibration;
  b.compared = true;
  b.streamed_gib_before = c.streamed_gib_per_step;
  b.copy_seconds_before = c.copy_seconds_per_step;
  b.step_seconds_before = c.step_seconds;
  const double saved = c.streamed_gib_per_step - now.streamed_gib_per_step;
  b.any = now.resident_blocks > 0 && saved > 0;
  b.streamed_less_percent =
      c.streamed_gib_per_step > 0 ? 100.0 * saved / c.streamed_gib_per_step : 0.0;
  b.speedup = now.step_seconds > 0 ? c.step_seconds / now.step_seconds : 0.0;
  return b;
}

// The demo's offload options: the regular settings loader (--preset, else DDO_PRESET, else
// auto), the profile, and on the simulation the demo card (Note [Demo card]); *card says what it
// runs on.
adapter::OffloadOptions demo_options(const DemoArgs& args, const std::string& device, bool sim,
                                     double model_bytes, const core::EnvMap& env,
                                     std::string* card) {
  adapter::OffloadOptions o;
  // The regular settings loader: --preset when given, else DDO_PRESET, else auto.
  core::SettingsRequest request;
  if (!args.preset.empty()) request.preset = args.preset;
  o.settings = core::DynamicOffloadSettings::from_env(request, env);
  o.env = env;
  o.profile_name = args.profile;
  o.build_profile = args.calibrate;
  o.execution_device = device;
  o.model_class = kDemoModelClass;
  o.quantize = args.quantize;
  // The demo prints the profile's outcome itself (show_profile would add a second, terser line).
  nlohmann::json overrides = {{"show_profile", false}};
  *card = device;
  if (sim) {
    // Note [Demo card].
    const double card_gb = std::max(gib(model_bytes) * kDemoCardFraction, 0.0625);
    const double link_gbps =
        o.settings->config.sim_copy_gbps > 0
            ? o.settings->config.sim_copy_gbps
            : std::max(model_bytes / 1e9 / kDemoStreamSeconds, kMinSimCopyGbps);
    overrides["sim_device_capacity_gb"] = card_gb;
    overrides["profile_vram_headroom_gb"] = card_gb * kDemoHeadroomFraction;
    overrides["auto_vram_headroom_gb"] = card_gb * kDemoHeadroomFraction;
    overrides["sim_copy_gbps"] = link_gbps;
    *card = fmt::format(
        "the host simulation of a {} card ({:.0f}% of the model) with a {:.2f} GB/s "
        "link",
        size_text(card_gb), 100 * kDemoCardFraction, link_gbps);
  }
  o.overrides = overrides;
  return o;
}

// --quantize: how many Linears compute from quantized copies, by path, and how many stay dense.
void print_quantized(const nlohmann::json& q) {
  std::string paths;
  for (const auto& [path, n] : q["counts"].items()) {
    paths += fmt::format("{}{} {}", paths.empty() ? "" : ", ", n.get<int>(), path);
  }
  std::printf("compute: %s: %zu Linears from quantized copies (%s), %zu kept dense\n",
              q["quantize"].get<std::string>().c_str(), q["layers"].size(),
              paths.empty() ? "none" : paths.c_str(), q["kept_dense"].size());
}

// The outcome for a person: what calibration bought (reuse) or saved (calibration), the run.
void print_outcome(const DemoArgs& args, const adapter::testing::FluxDiTOptions& opts,
                   double model_bytes, const std::string& card, const nlohmann::json& profile,
                   const RunSummary& summary, const std::optional<Benefit>& benefit,
                   const std::string& profiles_dir) {
  const std::string status = profile.value("status", "");
  const auto num = [&](const char* key) {
    return profile.contains(key) && profile[key].is_number() ? profile[key].get<double>() : 0.0;
  };
  // The outcome first: what calibration bought (reuse) or what it saved (calibration).
  if (benefit) std::printf("%s\n", benefit->text().c_str());
  std::printf("model:   a FLUX-style DiT (%s: %.1f M parameters, %s) on %s\n", args.size.c_str(),
              static_cast<double>(adapter::testing::FluxDiTImpl::parameter_count(opts)) / 1e6,
              size_text(gib(model_bytes)).c_str(), card.c_str());
  if (status == "saved") {
    std::printf("profile: saved; %s may stay resident (card %s - measured peak %s - headroom %s)\n",
                size_text(num("resident_budget_gb")).c_str(),
                size_text(num("total_vram_gb")).c_str(), size_text(num("peak_vram_gb")).c_str(),
                size_text(num("headroom_gb")).c_str());
  } else if (status == "applied") {
    std::printf("profile: applied; %s may stay resident (budget from the %s)\n",
                size_text(num("resident_budget_gb")).c_str(),
                profile.value("budget_source", "profile").c_str());
  } else {
    std::printf("profile: %s\n", status.c_str());
  }
  if (profile.contains("notes")) {
    for (const auto& n : profile["notes"]) {
      std::printf("  note: %s\n", n.get<std::string>().c_str());
    }
  }
  std::printf("steps:   %d; fastest %.2f s; %d of %d blocks resident; %s streamed per step\n",
              args.steps, summary.step_seconds, summary.resident_blocks, summary.blocks,
              size_text(summary.streamed_gib_per_step).c_str());
  if (status == "saved") std::printf("next:    run again without --calibrate to reuse it\n");
  std::printf("profiles are kept in %s (the demo's own folder; DDO_PROFILE_DIR overrides)\n",
              profiles_dir.c_str());
}

// --verbose: what the planner decided and how the run went, in detail.
void print_details(const adapter::Offload& offload, const nlohmann::json& report,
                   const std::vector<std::pair<std::string, double>>& events,
                   const std::vector<double>& step_seconds, int steps_run) {
  std::printf("\npreset: %s (requested: %s)\n", offload.settings().effective_preset.c_str(),
              offload.settings().requested_preset.c_str());
  std::printf("%s\n", offload.plan().summary().c_str());
  std::printf("setup:");
  for (const auto& [name, seconds] : events) std::printf(" %s %.3f s", name.c_str(), seconds);
  std::printf("\nsteps:");
  for (double t : step_seconds) std::printf(" %.3f", t);
  std::printf(" s\n");
  const nlohmann::json& run = report["run"];
  if (run.contains("bytes_streamed")) {
    const double steps = std::max<double>(1, steps_run);
    std::printf(
        "streamed %s per step, copies %.1f ms, compute waited %.1f ms, %.2f GB/s, %lld "
        "prefetch hits, %lld on demand\n",
        size_text(gib(run["bytes_streamed"].get<double>()) / steps).c_str(),
        run["copy_ms"].get<double>(), run["compute_wait_ms"].get<double>(),
        run["achieved_gbps"].get<double>(),
        static_cast<long long>(run["prefetch_hits"].get<std::int64_t>()),
        static_cast<long long>(run["on_demand"].get<std::int64_t>()));
  }
  if (run.contains("peak_vram_gb")) {
    std::printf("peak device memory %s of %s\n",
                size_text(run["peak_vram_gb"].get<double>()).c_str(),
                size_text(gib(run["total_vram_bytes"].get<double>())).c_str());
  }
  std::printf("kept resident: %zu modules (whole blocks and small layers), %s; pinned %s\n",
              report["resident_modules"].size(),
              size_text(gib(report["resident_bytes"].get<double>())).c_str(),
              size_text(gib(report["pinned_bytes"].get<double>())).c_str());
}

int run_demo(const DemoArgs& args) {
  using adapter::testing::FluxDiT;
  using adapter::testing::FluxDiTOptions;
  std::string device = args.device;
  if (device.empty()) device = engine::cuda_available() ? "cuda:0" : "sim";
  const bool sim = check_device(device).type == core::DeviceType::kSim;
  FluxDiTOptions opts = FluxDiTOptions::preset(args.size);
  if (sim) {
    // Note [Demo card]: so that the host's compute does not hide the copies.
    opts.img_tokens = std::max(opts.img_tokens / 16, 4);
    opts.txt_tokens = std::max(opts.txt_tokens / 16, 4);
  }
  const double model_bytes =
      static_cast<double>(adapter::testing::FluxDiTImpl::parameter_bytes(opts));
  const core::EnvMap env = demo_env();
  const std::string profiles_dir = env.at("DDO_PROFILE_DIR");
  FluxDiT model(opts);
  const c10::Device input_device = sim ? c10::Device(c10::kCPU) : c10::Device(device);
  adapter::testing::FluxDiTInputs in = adapter::testing::make_inputs(opts, input_device);

  std::string card;
  adapter::OffloadOptions o = demo_options(args, device, sim, model_bytes, env, &card);
  if (!args.json) {
    std::printf(
        args.calibrate
            ? "== ddo demo 1/2: calibration of profile '%s' (measure what fits, save it) ==\n"
            : "== ddo demo 2/2: reuse of profile '%s' (apply what calibration saved) ==\n",
        core::printable_text(args.profile).c_str());  // a name is the user's text: never raw
  }
  std::vector<std::pair<std::string, double>> events;
  o.record_event = [&](const std::string& name, double seconds, const nlohmann::json&) {
    events.emplace_back(name, seconds);
  };
  std::unique_ptr<adapter::Offload> offload = adapter::enable_offload(*model, o);

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
  const RunSummary summary = summarize(report, step_seconds, opts);
  const std::string status = profile.value("status", "");
  const std::string path = profile.value("path", "");
  if (status == "saved" && !path.empty()) save_summary(path, summary);
  std::optional<Benefit> benefit;
  if (status == "applied") benefit = benefit_of(summary, load_summary(path));

  if (args.json) {
    nlohmann::json out = {{"profile_report", profile},
                          {"report", report},
                          {"step_seconds", step_seconds},
                          {"summary", summary.to_json()}};
    if (status == "applied" && !path.empty()) {
      if (std::optional<RunSummary> c = load_summary(path)) out["calibration_run"] = c->to_json();
    }
    if (benefit) out["calibration_bought"] = benefit->to_json();
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  print_outcome(args, opts, model_bytes, card, profile, summary, benefit, profiles_dir);
  if (!args.quantize.empty()) print_quantized(report["quantized_compute"]);
  if (args.verbose) print_details(*offload, report, events, step_seconds, args.steps);
  return 0;
}

}  // namespace

void add_demo_command(CLI::App& app, int& exit_code) {
  auto args = std::make_shared<DemoArgs>();
  CLI::App* demo = app.add_subcommand(
      "demo", "Run a FLUX-style DiT under a named profile: calibrate once, then reuse the profile");
  demo->add_option("--profile", args->profile, "Profile name (e.g. demo-dit)")->required();
  demo->add_flag("--calibrate", args->calibrate, "Calibration run: measure and save the profile");
  demo->add_option("--preset", args->preset,
                   "Preset (see `ddo presets`; default: DDO_PRESET, else auto)");
  demo->add_option("--device", args->device, "sim, sim:N or cuda:N (default: cuda:0 if present)");
  // Defaults and ranges are in ddo's own words: CLI11's wording of both differs by version.
  demo->add_option("--size", args->size, "Model size: tiny, small or full (default: small)")
      ->check(CLI::IsMember({"tiny", "small", "full"}));
  demo->add_option("--steps", args->steps,
                   "Forward passes inside the measured region, 1 to 100000 (default: 4)")
      ->check(CLI::Validator(
          [](const std::string& text) -> std::string {
            int value = 0;
            if (!CLI::detail::lexical_cast(text, value) || value < 1 || value > 100000) {
              return "--steps " + text + ": pass a number from 1 to 100000";
            }
            return {};
          },
          "1 to 100000"));
  demo->add_option("--quantize", args->quantize,
                   "Compute the Linears from fp8 or int8 copies (OffloadOptions::quantize)")
      ->check(CLI::IsMember({"fp8", "int8"}));
  demo->add_flag("--json", args->json, "Print the reports as JSON (the same figures as the text)");
  demo->add_flag("--verbose", args->verbose,
                 "Also print the planner's decisions, setup phases and stream statistics");
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
