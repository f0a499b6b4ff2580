/// \file
/// GenerationMeter: one report per generation of a pipeline (prompt encoders, denoising steps,
/// decode): seconds per stage, bytes streamed and read from disk, peak VRAM and peak RSS.
///
/// A stage is a span of the host's program with a name; the meter synchronizes the device at its
/// boundaries, so a stage's seconds are the work queued inside it, not the time it took to queue.
/// Between begin and finish a sampling thread reads the device's used memory (the driver's view,
/// which counts every allocation on the card) and the process's resident memory; it never resets
/// the allocator's peak counters, so a profile_run() region inside the generation measures as it
/// would without the meter.
/// ```
/// auto pipe = ddo::adapter::enable_pipeline_offload({{"text_encoder", te}, {"transformer", dit},
///                                                    {"vae", vae}}, options);
/// ddo::adapter::GenerationMeter meter(*pipe);
/// { auto stage = meter.stage("text_encoder"); ids_embedded = te->forward(ids); }
/// for (int step = 0; step < steps; ++step) {
///   auto stage = meter.stage("transformer");
///   latents = step_of(dit->forward(latents, ids_embedded, t[step]));
/// }
/// { auto stage = meter.stage("vae"); image = vae->forward(latents); }
/// nlohmann::json report = meter.finish();
/// // report["stages"] == [{"name": "text_encoder", "seconds": .., "calls": 1}, {"name":
/// //   "transformer", "calls": 28, ..}, ..]; report["bytes_streamed"], ["disk_bytes_read"],
/// //   ["peak_vram_gb"], ["peak_rss_gb"], ["components"][name]["bytes_streamed"], ...
/// ```
/// Python: `with offloads.generation() as gen: pipe(...)`, then `gen.report` (one stage per
/// component, timed by forward hooks on the components).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddo/torch/enable_offload.h"

namespace ddo::engine {
class Device;
}  // namespace ddo::engine

namespace ddo::adapter {

class MemoryProbe;

/// Meters one generation; see the file comment. Stages may be begun and ended from several
/// threads at once: each thread's spans are its own (two threads timing one stage name both
/// count, as two calls), and a thread ends only what it began. Adding and dropping offloads is for
/// one thread.
class GenerationMeter {
 public:
  /// Meters `offloads` (by component name; null for a component ddo does not place) on the
  /// device of the first one that executes, or on `cuda_device` ("cuda:N") when given: a run
  /// whose components ddo does not place (a comparison without ddo) gets the same VRAM readings.
  /// With neither, only seconds and RSS are measured. The offloads must outlive the meter.
  /// Starts the generation: its seconds, the sampling.
  explicit GenerationMeter(const std::vector<std::pair<std::string, const Offload*>>& offloads,
                           const std::string& cuda_device = "");
  /// Meters every component of `pipeline`.
  explicit GenerationMeter(PipelineOffload& pipeline);
  ~GenerationMeter();  ///< stops the sampling thread
  GenerationMeter(const GenerationMeter&) = delete;
  GenerationMeter& operator=(const GenerationMeter&) = delete;

  /// Meters `offload` too from now on, as component `name` (a staged flow attaches each stage's
  /// offload when the stage begins). Its device serves for VRAM when the meter has none yet; its
  /// file reads count from its load (it was loaded for this generation), the rest from now. A
  /// name dropped before counts on in the same entry (a component released and attached again);
  /// throws for a name whose offload is still read.
  void add_offload(const std::string& name, const Offload* offload);
  /// Stops reading `offload` of component `name`, keeping what it streamed and read so far.
  /// After Offload::remove() (the handle still alive) that is the totals the run ended with,
  /// the disk tier's read-ahead included; call it before the handle is destroyed.
  void drop_offload(const std::string& name);

  /// Begins a stage (synchronizes the device first). Stages may nest; a stage begun again
  /// before it ended (a component calling itself) counts once, as one call.
  void begin_stage(const std::string& name);
  /// Ends the stage `name` (synchronizes the device first). Throws for a stage not begun.
  void end_stage(const std::string& name);

  /// Ends its stage when it goes out of scope (also when the stage throws).
  class Stage {
   public:
    Stage(GenerationMeter* meter, std::string name);  ///< begins stage `name` of `meter`
    ~Stage();
    Stage(Stage&& other) noexcept;  ///< takes the stage over; `other` ends nothing
    Stage(const Stage&) = delete;
    Stage& operator=(const Stage&) = delete;
    Stage& operator=(Stage&&) = delete;

   private:
    GenerationMeter* meter_;
    std::string name_;
  };
  /// begin_stage(name) now, end_stage(name) when the result is destroyed.
  [[nodiscard]] Stage stage(const std::string& name);

  /// Ends the generation and returns its report (see the file comment; JSON-safe). Stages still
  /// open are ended first. Calling it again returns the same report.
  nlohmann::json finish();

 private:
  struct StageFigures {
    std::string name;
    double seconds = 0;      // SUM over ended spans
    std::int64_t calls = 0;  // COUNT of ended spans
  };
  // One thread's open span of one stage.
  struct OpenSpan {
    std::thread::id thread;
    std::string name;
    int depth = 0;  // open begin_stage calls of this thread
    std::chrono::steady_clock::time_point began{};
  };
  void synchronize();
  void read_memory_now();
  void sample_loop();
  StageFigures* find_stage(const std::string& name);  // adds it when new; stages_mu_ held

  struct Metered {
    std::string name;
    const Offload* offload = nullptr;  // null once dropped, or for a component ddo does not place
    bool placed = false;               // an offload was given for it
    Offload::Counters at_start{};
    Offload::Counters gained{};  // what it streamed and read until dropped
  };
  void open_probe(const Offload* offload);
  static Offload::Counters gained_since(const Offload::Counters& now,
                                        const Offload::Counters& then);

  std::vector<Metered> metered_;
  std::shared_ptr<engine::Device> device_;
  std::string device_name_;
  std::unique_ptr<MemoryProbe> probe_;
  std::mutex stages_mu_;
  std::vector<StageFigures> stages_;  // LOCK: stages_mu_; in the order they first began
  std::vector<OpenSpan> open_;        // LOCK: stages_mu_
  std::chrono::steady_clock::time_point started_;
  std::int64_t start_rss_bytes_ = -1;
  std::atomic<std::int64_t> peak_vram_bytes_{-1};
  std::atomic<std::int64_t> peak_rss_bytes_{-1};
  std::atomic<std::int64_t> samples_{0};
  std::atomic<bool> stop_{false};
  std::thread sampler_;
  bool finished_ = false;
  nlohmann::json report_;
};

}  // namespace ddo::adapter
