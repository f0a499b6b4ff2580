// GenerationMeter (ddo/torch/generation.h): one report per generation of a pipeline.
#include "ddo/torch/generation.h"

#include <algorithm>

#include "ddo/core/device_name.h"
#include "ddo/core/os_memory.h"
#include "ddo/core/status.h"
#include "ddo/core/units.h"
#include "ddo/engine/device.h"
#include "ddo/torch/memory_probe.h"
#include "backend.h"

namespace ddo::adapter {
namespace {

// Often enough to catch a decode's or an encoder's peak (each lasts far longer), rarely enough
// that the thread costs nothing measurable (one /proc read and one memory query per period).
constexpr std::chrono::milliseconds kSamplePeriod{5};

// -1 (a figure nobody measured) stays -1.
double to_gib(std::int64_t bytes) {
  return bytes < 0 ? -1.0 : core::bytes_to_gib(bytes);
}

void raise_to(std::atomic<std::int64_t>& peak, std::int64_t value) {
  std::int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

Offload::Counters plus(const Offload::Counters& a, const Offload::Counters& b) {
  return {a.bytes_streamed + b.bytes_streamed, a.disk_bytes_read + b.disk_bytes_read,
          a.file_bytes_read + b.file_bytes_read};
}

std::vector<std::pair<std::string, const Offload*>> offloads_of(PipelineOffload& pipeline) {
  std::vector<std::pair<std::string, const Offload*>> out;
  for (const std::string& name : pipeline.component_names()) {
    out.emplace_back(name, pipeline.component(name));
  }
  return out;
}

}  // namespace

GenerationMeter::GenerationMeter(
    const std::vector<std::pair<std::string, const Offload*>>& offloads,
    const std::string& cuda_device) {
  if (!cuda_device.empty()) {
    core::DeviceName name;
    throw_if_error(core::parse_device_name("GenerationMeter's cuda_device", cuda_device, &name));
    DDO_CHECK(name.type == core::DeviceType::kCuda, Code::kInvalidArgument,
              "GenerationMeter's cuda_device is '", cuda_device,
              "'; name a GPU (cuda or cuda:N), or leave it empty to measure on the device of the "
              "metered offloads");
    device_name_ = name.str();
    throw_if_error(make_cuda_memory_probe(name.index, &probe_));
  }
  for (const auto& [name, offload] : offloads) {
    metered_.push_back(
        Metered{.name = name,
                .offload = offload,
                .placed = offload != nullptr,
                .at_start = offload != nullptr ? offload->counters() : Offload::Counters{}});
    open_probe(offload);
  }
  synchronize();
  start_rss_bytes_ = core::os::process_memory().resident_bytes;
  read_memory_now();
  started_ = std::chrono::steady_clock::now();
  sampler_ = std::thread([this] { sample_loop(); });
}

GenerationMeter::GenerationMeter(PipelineOffload& pipeline)
    : GenerationMeter(offloads_of(pipeline)) {}

GenerationMeter::~GenerationMeter() {
  stop_.store(true);
  if (sampler_.joinable()) sampler_.join();
}

// The device of the first metered offload that executes gives the VRAM readings. The sampling
// thread reads probe_ only after it is set: the constructor sets it before starting the thread,
// add_offload() stops the thread around the change.
void GenerationMeter::open_probe(const Offload* offload) {
  if (probe_ || offload == nullptr || !offload->device()) return;
  const bool sampling = sampler_.joinable();
  if (sampling) {
    stop_.store(true);
    sampler_.join();
    stop_.store(false);
  }
  device_ = offload->device();
  const engine::DeviceCaps caps = device_->caps();
  const internal::Backend& backend = internal::backend_for(caps.kind);
  device_name_ = backend.device_name(caps.index);
  throw_if_error(backend.make_probe(*device_, caps.index, &probe_));
  if (sampling) sampler_ = std::thread([this] { sample_loop(); });
}

Offload::Counters GenerationMeter::gained_since(const Offload::Counters& now,
                                                const Offload::Counters& then) {
  // reset_stats() between the two readings would make a difference negative: count from 0.
  const auto delta = [](std::int64_t a, std::int64_t b) { return a >= b ? a - b : a; };
  return {delta(now.bytes_streamed, then.bytes_streamed),
          delta(now.disk_bytes_read, then.disk_bytes_read),
          delta(now.file_bytes_read, then.file_bytes_read)};
}

void GenerationMeter::add_offload(const std::string& name, const Offload* offload) {
  DDO_CHECK(!finished_, Code::kFailedPrecondition, "add_offload('", name,
            "') after finish(): a meter measures one generation; make a new one");
  Offload::Counters now = offload != nullptr ? offload->counters() : Offload::Counters{};
  // An offload added during the generation was loaded for it: its load's reads count too.
  now.file_bytes_read = 0;
  for (Metered& m : metered_) {
    if (m.name != name) continue;
    // A component released and attached again (dropped first) adds to its one entry.
    DDO_CHECK(m.offload == nullptr, Code::kInvalidArgument, "add_offload('", name,
              "'): the meter still reads an offload of that component; drop_offload('", name,
              "') before its next offload is added");
    m.offload = offload;
    m.placed = m.placed || offload != nullptr;
    m.at_start = now;
    open_probe(offload);
    return;
  }
  metered_.push_back(
      Metered{.name = name, .offload = offload, .placed = offload != nullptr, .at_start = now});
  open_probe(offload);
}

void GenerationMeter::drop_offload(const std::string& name) {
  for (Metered& m : metered_) {
    if (m.name != name || m.offload == nullptr) continue;
    m.gained = plus(m.gained, gained_since(m.offload->counters(), m.at_start));
    m.offload = nullptr;
    return;
  }
  throw Error(Code::kNotFound,
              ddo::internal::str_cat("drop_offload('", name,
                                     "'): the meter reads no offload of that name"));
}

void GenerationMeter::synchronize() {
  if (probe_) probe_->synchronize();
}

void GenerationMeter::read_memory_now() {
  if (probe_) {
    const MemorySnapshot snap = probe_->snapshot();
    raise_to(peak_vram_bytes_, std::max(snap.driver_used_bytes, snap.allocator_reserved_bytes));
  }
  raise_to(peak_rss_bytes_, core::os::process_memory().resident_bytes);
}

void GenerationMeter::sample_loop() {
  while (!stop_.load(std::memory_order_relaxed)) {
    if (probe_) raise_to(peak_vram_bytes_, probe_->driver_used_bytes());
    raise_to(peak_rss_bytes_, core::os::process_memory().resident_bytes);
    samples_.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(kSamplePeriod);
  }
}

GenerationMeter::StageFigures* GenerationMeter::find_stage(const std::string& name) {
  for (StageFigures& s : stages_) {
    if (s.name == name) return &s;
  }
  stages_.push_back(StageFigures{.name = name});
  return &stages_.back();
}

namespace {

template <typename Span>
auto find_span(std::vector<Span>& open, std::thread::id thread, const std::string& name) {
  return std::find_if(open.begin(), open.end(),
                      [&](const Span& s) { return s.thread == thread && s.name == name; });
}

}  // namespace

// Note [Stages from several threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pipeline may run a stage on a worker thread (a text encoder beside the denoiser's setup), and
// a user who times one stage name from two threads expects both spans. So an open span belongs to
// (thread, name): a thread's nested begin of a stage it has open is re-entry (the outer call
// times it), another thread's begin is a span of its own, and each ended span adds its seconds
// and one call to the stage. The device is synchronized outside the lock.
void GenerationMeter::begin_stage(const std::string& name) {
  const std::thread::id self = std::this_thread::get_id();
  {
    std::lock_guard<std::mutex> guard(stages_mu_);
    DDO_CHECK(!finished_, Code::kFailedPrecondition, "begin_stage('", name,
              "') after finish(): a meter measures one generation; make a new one");
    (void)find_stage(name);
    auto span = find_span(open_, self, name);
    if (span != open_.end()) {
      ++span->depth;  // re-entered: the outer call times it
      return;
    }
    open_.push_back(OpenSpan{self, name, 1, std::chrono::steady_clock::now()});
  }
  synchronize();
  read_memory_now();
  std::lock_guard<std::mutex> guard(stages_mu_);
  auto span = find_span(open_, self, name);
  if (span != open_.end()) span->began = std::chrono::steady_clock::now();
}

void GenerationMeter::end_stage(const std::string& name) {
  const std::thread::id self = std::this_thread::get_id();
  std::chrono::steady_clock::time_point began;
  {
    std::lock_guard<std::mutex> guard(stages_mu_);
    auto span = find_span(open_, self, name);
    DDO_CHECK(span != open_.end(), Code::kFailedPrecondition, "end_stage('", name,
              "') without a begin_stage('", name,
              "') open on this thread (each thread ends the stages it began)");
    if (--span->depth > 0) return;
    began = span->began;
    open_.erase(span);
  }
  synchronize();
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> guard(stages_mu_);
    StageFigures* stage = find_stage(name);
    stage->seconds += std::chrono::duration<double>(now - began).count();
    ++stage->calls;
  }
  read_memory_now();
}

GenerationMeter::Stage::Stage(GenerationMeter* meter, std::string name)
    : meter_(meter), name_(std::move(name)) {
  meter_->begin_stage(name_);
}

GenerationMeter::Stage::Stage(Stage&& other) noexcept
    : meter_(std::exchange(other.meter_, nullptr)), name_(std::move(other.name_)) {}

GenerationMeter::Stage::~Stage() {
  if (meter_ == nullptr) return;
  try {
    meter_->end_stage(name_);
  } catch (...) {  // a destructor does not throw; the stage stays unended and finish() ends it
  }
}

GenerationMeter::Stage GenerationMeter::stage(const std::string& name) {
  return Stage(this, name);
}

nlohmann::json GenerationMeter::finish() {
  {
    std::lock_guard<std::mutex> guard(stages_mu_);
    if (finished_) return report_;
  }
  synchronize();
  read_memory_now();
  std::lock_guard<std::mutex> guard(stages_mu_);
  if (finished_) return report_;
  const auto ended = std::chrono::steady_clock::now();
  for (const OpenSpan& span : open_) {  // every thread's spans still open end here
    StageFigures* stage = find_stage(span.name);
    stage->seconds += std::chrono::duration<double>(ended - span.began).count();
    ++stage->calls;
  }
  open_.clear();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  stop_.store(true);
  if (sampler_.joinable()) sampler_.join();
  finished_ = true;

  nlohmann::json stages = nlohmann::json::array();
  double staged = 0;
  for (const StageFigures& s : stages_) {
    stages.push_back({{"name", s.name}, {"seconds", s.seconds}, {"calls", s.calls}});
    staged += s.seconds;
  }
  Offload::Counters total;
  nlohmann::json components = nlohmann::json::object();
  for (Metered& m : metered_) {
    if (!m.placed) continue;  // a component ddo does not place streams and reads nothing
    if (m.offload != nullptr) {
      m.gained = plus(m.gained, gained_since(m.offload->counters(), m.at_start));
      m.offload = nullptr;
    }
    components[m.name] = {{"bytes_streamed", m.gained.bytes_streamed},
                          {"disk_bytes_read", m.gained.disk_bytes_read},
                          {"file_bytes_read", m.gained.file_bytes_read}};
    total.bytes_streamed += m.gained.bytes_streamed;
    total.disk_bytes_read += m.gained.disk_bytes_read;
    total.file_bytes_read += m.gained.file_bytes_read;
  }
  const core::os::ProcessMemory memory = core::os::process_memory();
  const std::int64_t peak_vram = probe_ ? peak_vram_bytes_.load() : -1;
  report_ = {
      {"seconds", seconds},
      {"stages", std::move(stages)},
      // Outside every stage: the pipeline's own work (schedulers, latents, image output).
      {"unstaged_seconds", std::max(0.0, seconds - staged)},
      {"bytes_streamed", total.bytes_streamed},
      {"disk_bytes_read", total.disk_bytes_read},
      {"file_bytes_read", total.file_bytes_read},
      {"components", std::move(components)},
      {"device", device_name_.empty() ? nlohmann::json(nullptr) : nlohmann::json(device_name_)},
      // The driver's view (every allocation on the card) and the allocator's reserved
      // bytes, read at stage boundaries and every few milliseconds in between.
      {"peak_vram_bytes", peak_vram},
      {"peak_vram_gb", to_gib(peak_vram)},
      // Resident memory sampled the same way; the process's own high-water mark (since it
      // began, or since the peak was last reset) beside it, never below a sample: the kernel's
      // high-water mark lags the per-thread RSS counters by a few pages.
      {"start_rss_gb", to_gib(start_rss_bytes_)},
      {"peak_rss_bytes", peak_rss_bytes_.load()},
      {"peak_rss_gb", to_gib(peak_rss_bytes_.load())},
      {"process_peak_rss_gb",
       to_gib(std::max<std::int64_t>(memory.peak_resident_bytes, peak_rss_bytes_.load()))},
      {"samples", samples_.load()}};
  return report_;
}

}  // namespace ddo::adapter
