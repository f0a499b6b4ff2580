// The C++ path of a diffusers model: load the TorchScript file that
// examples/python/trace_diffusers.py traced (a FluxTransformer2DModel or a UNet2DConditionModel),
// run the staged flow (docs/design/0007-named-profiles.md) on it under a named profile -- attach, a
// measured denoising loop, release; once calibrating, once reusing the saved profile -- and print
// the profile reports and timings. No Python runs: the TorchScript interpreter calls the aten ops
// and ddo serves the weights at the dispatcher, as for a torch::nn::Module.
//
//   torchscript_flow --model flux/model.pt --inputs flux/inputs.pt [--out out.pt]
//                    [--report report.json] [--device sim|cuda:N] [--profile NAME] [--steps N]
//                    [--latents NAME] [--warmup N] [--stream-all]
//
// --inputs: a dict of named tensors (torch.save), passed to forward() as keyword arguments. The
// one named by --latents (default: "hidden_states" or "sample", whichever is there) is what the
// loop updates, latents = latents - out / steps, with the other inputs fixed.
// --out: a dict of tensors: "calibrate.first" and "reuse.first" (the first step's output),
// "calibrate.latents" and "reuse.latents" (after the loop) and, off CUDA, "restored" (one forward
// after the offload was removed, on the model's own tensors again). Python reads it with
// torch.load inside torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]).
// --report: the phases' profile reports, offload reports and timings as JSON.
// --stream-all: no resident budget, no auto policy, every weight streamed (tiny models fit whole
// otherwise, and the calibration would measure nothing).
// --warmup: steps left out of the per-step figure, the median of the rest (default 1).
// examples/python/trace_diffusers.py --python-flow takes the same --steps and --warmup and writes
// the same report, so scripts/gpu-jit.sh sets the two paths side by side.
// Profiles go to DDO_PROFILE_DIR (default ~/.ddo/profiles).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/utils.h>

#include "ddo/torch/enable_offload.h"

namespace {

struct Args {
  std::string model;
  std::string inputs;
  std::string out;
  std::string report;
  std::string device = "sim";
  std::string profile = "torchscript-flow";
  std::string latents;
  int steps = 4;
  int warmup = 1;
  bool stream_all = false;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "torchscript_flow: %s\n"
               "usage: torchscript_flow --model M.pt --inputs I.pt [--out O.pt] [--report R.json]\n"
               "                        [--device sim|cuda:N] [--profile NAME] [--steps N]\n"
               "                        [--latents NAME] [--warmup N] [--stream-all]\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--stream-all") {
      a.stream_all = true;
      continue;
    }
    if (i + 1 >= argc) usage(("missing the value of " + flag).c_str());
    const std::string value = argv[++i];
    if (flag == "--model") {
      a.model = value;
    } else if (flag == "--inputs") {
      a.inputs = value;
    } else if (flag == "--out") {
      a.out = value;
    } else if (flag == "--report") {
      a.report = value;
    } else if (flag == "--device") {
      a.device = value;
    } else if (flag == "--profile") {
      a.profile = value;
    } else if (flag == "--latents") {
      a.latents = value;
    } else if (flag == "--steps") {
      a.steps = std::atoi(value.c_str());
      if (a.steps < 1) usage("--steps needs a positive number");
    } else if (flag == "--warmup") {
      a.warmup = std::atoi(value.c_str());
      if (a.warmup < 0) usage("--warmup needs a number of 0 or more");
    } else {
      usage(("unknown argument " + flag).c_str());
    }
  }
  if (a.model.empty() || a.inputs.empty()) usage("--model and --inputs are required");
  return a;
}

std::vector<char> read_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<char> bytes;
  char buf[1 << 16];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.insert(bytes.end(), buf, buf + n);
  std::fclose(f);
  return bytes;
}

void write_file(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw std::runtime_error("cannot write " + path);
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) throw std::runtime_error("cannot write " + path);
}

// A traced diffusers model returns {"sample": out}; a wrapper may return a tuple or the tensor.
at::Tensor sample_of(const c10::IValue& out) {
  if (out.isTensor()) return out.toTensor();
  if (out.isTuple()) return sample_of(out.toTupleRef().elements().at(0));
  if (out.isGenericDict()) {
    const c10::impl::GenericDict dict = out.toGenericDict();
    if (dict.contains("sample")) return dict.at("sample").toTensor();
    return dict.begin()->value().toTensor();
  }
  throw std::runtime_error("the model returned " + out.tagKind() + ", not a tensor");
}

struct Inputs {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;
  std::size_t latents = 0;  // index of the latents
};

Inputs load_inputs(const Args& args, const c10::Device& device) {
  const c10::IValue loaded = torch::jit::pickle_load(read_file(args.inputs));
  if (!loaded.isGenericDict()) throw std::runtime_error(args.inputs + " is not a dict of tensors");
  Inputs in;
  for (const auto& item : loaded.toGenericDict()) {
    in.names.push_back(item.key().toStringRef());
    in.tensors.push_back(item.value().toTensor().to(device));
  }
  const std::vector<std::string> wanted = args.latents.empty()
                                              ? std::vector<std::string>{"hidden_states", "sample"}
                                              : std::vector<std::string>{args.latents};
  for (const std::string& name : wanted) {
    for (std::size_t i = 0; i < in.names.size(); ++i) {
      if (in.names[i] == name) {
        in.latents = i;
        return in;
      }
    }
  }
  throw std::runtime_error("no input named " + wanted.front() + " in " + args.inputs +
                           "; name the latents with --latents");
}

at::Tensor forward(torch::jit::Module& model, const Inputs& in, const at::Tensor& latents) {
  torch::jit::Kwargs kwargs;
  for (std::size_t i = 0; i < in.names.size(); ++i) {
    kwargs[in.names[i]] = i == in.latents ? latents : in.tensors[i];
  }
  return sample_of(model.forward({}, kwargs));
}

struct Phase {
  at::Tensor first;
  at::Tensor latents;
  std::vector<double> step_ms;  // each step, device work included
  double seconds = 0.0;
  // The TorchScript executor profiles and optimizes the graph during the first calls (the tiny
  // test UNet: about 3 s for its first call, 3 ms later) and ddo's first step learns the fetch
  // order, so the steady state is the median of the steps after the first `warmup` (all of them
  // when there are no more; the upper middle one for an even count), as trace_diffusers.py's
  // steady_ms computes it.
  double steady_ms(int warmup) const {
    const auto wanted = static_cast<std::size_t>(warmup);
    const std::size_t skip = wanted < step_ms.size() ? wanted : 0;
    std::vector<double> later(step_ms.begin() + static_cast<std::ptrdiff_t>(skip), step_ms.end());
    std::sort(later.begin(), later.end());
    return later[later.size() / 2];
  }
};

// The denoising loop: the only part the profile measures.
Phase denoise(torch::jit::Module& model, const Inputs& in, int steps) {
  Phase p;
  at::Tensor latents = in.tensors[in.latents];
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor out = forward(model, in, latents);
    if (i == 0) p.first = out;
    latents = latents - out / steps;
    (void)latents.sum().item<double>();  // waits for the device
    p.step_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  p.latents = latents;
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  try {
    torch::NoGradGuard no_grad;
    const bool cuda = args.device.rfind("cuda", 0) == 0;
    const c10::Device tensors_on = cuda ? c10::Device(args.device) : c10::Device(c10::kCPU);

    // Weights load to host memory whatever device they were traced on; ddo places them.
    auto t0 = std::chrono::steady_clock::now();
    torch::jit::Module model = torch::jit::load(args.model, c10::Device(c10::kCPU));
    model.eval();
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const Inputs in = load_inputs(args, tensors_on);
    std::printf("loaded %s (%s) in %.2f s; latents: %s\n", args.model.c_str(),
                ddo::adapter::module_class_name(model).c_str(), load_s,
                in.names[in.latents].c_str());

    ddo::adapter::OffloadOptions options;
    options.execution_device = args.device;
    options.profile_name = args.profile;
    if (args.stream_all) {
      options.overrides = {{"small_tensor_threshold_bytes", 0},
                           {"auto_budget_policy", "off"},
                           {"resident_module_budget_gb", 0.0},
                           {"always_resident_modules_pattern", nlohmann::json::array()}};
    }

    nlohmann::json report = nlohmann::json::object();
    c10::impl::GenericDict outputs(c10::StringType::get(), c10::TensorType::get());
    for (const char* phase : {"calibrate", "reuse"}) {
      const bool calibrate = std::strcmp(phase, "calibrate") == 0;
      options.build_profile = calibrate;
      // Attach at the denoising stage, measure only the loop, release right after.
      t0 = std::chrono::steady_clock::now();
      std::unique_ptr<ddo::adapter::Offload> offload = ddo::adapter::enable_offload(model, options);
      const double attach_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      Phase p;
      const nlohmann::json profile =
          offload->profile_run([&] { p = denoise(model, in, args.steps); });
      const nlohmann::json offload_report = offload->report();
      std::printf(
          "\n== %s: attach %.3f s, %d steps in %.3f s (first %.1f ms, then %.1f ms/step)\n%s",
          phase, attach_s, args.steps, p.seconds, p.step_ms.front(), p.steady_ms(args.warmup),
          offload->summary().c_str());
      std::printf("profile report: %s\n", profile.dump().c_str());
      t0 = std::chrono::steady_clock::now();
      offload.reset();  // the model's tensors are ordinary again
      const double release_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      report[phase] = {{"attach_s", attach_s},
                       {"loop_s", p.seconds},
                       {"step_ms", p.step_ms},
                       {"first_ms", p.step_ms.front()},
                       {"steady_ms_per_step", p.steady_ms(args.warmup)},
                       {"release_s", release_s},
                       {"profile", profile},
                       {"offload", offload_report}};
      outputs.insert(std::string(phase) + ".first", p.first.cpu());
      outputs.insert(std::string(phase) + ".latents", p.latents.cpu());
    }
    if (!cuda) outputs.insert("restored", forward(model, in, in.tensors[in.latents]));
    report["model_class"] = ddo::adapter::module_class_name(model);
    report["steps"] = args.steps;
    report["warmup"] = args.warmup;
    report["load_s"] = load_s;
    std::printf(
        "\ntimings (median of the steps after the first %d): calibrate %.1f ms/step, reuse "
        "%.1f ms/step\n",
        args.warmup, report["calibrate"]["steady_ms_per_step"].get<double>(),
        report["reuse"]["steady_ms_per_step"].get<double>());

    if (!args.out.empty()) {
      const std::vector<char> bytes = torch::jit::pickle_save(outputs);
      write_file(args.out, std::string(bytes.begin(), bytes.end()));
    }
    if (!args.report.empty()) write_file(args.report, report.dump(2));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchscript_flow: %s\n", e.what());
    return 1;
  }
}
