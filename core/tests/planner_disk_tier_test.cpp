// Planner tests: the host RAM budget and the disk tier (Note [Disk tier plan] in
// planner_tiers.cpp, Note [Disk ring] in working_set.h), and the config field behind it,
// host_ram_cap_gb / DDO_HOST_RAM_CAP_GB.
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "ddo/core/config.h"
#include "ddo/core/planner.h"
#include "ddo/core/settings.h"
#include "ddo/core/working_set.h"
#include "planner_test_util.h"

namespace ddo::core {
namespace {

using namespace planner_test;  // the shared helpers (planner_test_util.h)

constexpr std::int64_t kMB = std::int64_t{1} << 20;
constexpr std::int64_t kH = 3072;                   // FLUX.1 hidden size: about 17 GiB streamed
constexpr std::int64_t kLargest = 6 * kH * kH * 2;  // a double block's norm1.linear weight

const ModelInventory& flux() {
  static const ModelInventory inv = flux_inventory({.h = kH});
  return inv;
}

DynamicOffloadConfig capped(double cap_gb) {
  DynamicOffloadConfig c = linear_config();
  c.host_ram_cap_gb = cap_gb;
  return c;
}

PlanContext in_file(bool weights_in_file = true) {
  PlanContext ctx;
  ctx.weights_in_file = weights_in_file;
  return ctx;
}

std::int64_t tier_bytes(const Plan& plan, const std::string& tier) {
  std::int64_t out = 0;
  for (const StreamUnit& u : plan.stream_units) {
    if (u.tier == tier) out += u.bytes;
  }
  return out;
}

// Positions of the disk units in the model order of the stream units.
std::vector<std::size_t> disk_positions(const Plan& plan) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < plan.stream_units.size(); ++i) {
    if (plan.stream_units[i].tier == "disk") out.push_back(i);
  }
  return out;
}

bool contains(const std::string& text, const std::string& fragment) {
  return text.find(fragment) != std::string::npos;
}

// --- size_disk_ring (Note [Disk ring]) ---------------------------------------------------------

TEST(DiskRing, DefaultIsTheWindowPlusTwoUnits) {
  DiskRingRequest r;
  r.largest_unit_bytes = 94 * kMB;
  r.disk_bytes = 8 * kGB;
  EXPECT_EQ(size_disk_ring(r), kDefaultPrefetchWindowBytes + 188 * kMB);
  r.window_bytes = 64 * kMB;  // prefetch_window_mb
  EXPECT_EQ(size_disk_ring(r), 64 * kMB + 188 * kMB);
}

TEST(DiskRing, RoomShrinksTheWindowButNeverBelowTwoUnits) {
  DiskRingRequest r;
  r.largest_unit_bytes = 94 * kMB;
  r.disk_bytes = 8 * kGB;
  r.room_bytes = 300 * kMB;
  EXPECT_EQ(size_disk_ring(r), 300 * kMB);
  r.room_bytes = 100 * kMB;  // below the floor: the caller sees the ring does not fit
  EXPECT_EQ(size_disk_ring(r), 188 * kMB);
  EXPECT_EQ(size_disk_ring(r), min_disk_ring_bytes(94 * kMB, 8 * kGB));
  r.room_bytes = -5 * kGB;
  EXPECT_EQ(size_disk_ring(r), 188 * kMB);
}

TEST(DiskRing, NeverMoreThanTheDiskBytes) {
  DiskRingRequest r;
  r.largest_unit_bytes = 94 * kMB;
  r.disk_bytes = 300 * kMB;
  EXPECT_EQ(size_disk_ring(r), 300 * kMB);
  r.disk_bytes = 94 * kMB;  // one unit: no second one to read ahead
  EXPECT_EQ(size_disk_ring(r), 94 * kMB);
  EXPECT_EQ(min_disk_ring_bytes(94 * kMB, 94 * kMB), 94 * kMB);
  r.disk_bytes = 0;
  r.largest_unit_bytes = 0;
  EXPECT_EQ(size_disk_ring(r), 0);
  EXPECT_EQ(min_disk_ring_bytes(0, 0), 0);
}

// --- the planner's tiers -----------------------------------------------------------------------

TEST(DiskTier, NoBudgetWithoutACapAndWithoutAFile) {
  const Plan plan = make_plan(flux(), linear_config(), PlanContext{});
  EXPECT_EQ(plan.host_ram_budget_bytes, 0);
  EXPECT_EQ(plan.disk_bytes, 0);
  EXPECT_EQ(plan.disk_ring_bytes, 0);
  EXPECT_FALSE(plan.has_decision("host_ram_budget_fits"));
  EXPECT_FALSE(plan.has_decision("disk_tier"));
  for (const StreamUnit& u : plan.stream_units) EXPECT_EQ(u.tier, "host") << u.name;
  // Weights in a file on a host of unknown RAM: unbounded.
  const Plan unknown = make_plan(flux(), linear_config(), in_file());
  EXPECT_EQ(unknown.host_ram_budget_bytes, 0);
  EXPECT_FALSE(unknown.has_decision("disk_tier"));
}

TEST(DiskTier, BudgetThatFitsKeepsEveryUnitOnTheHost) {
  const Plan plan = make_plan(flux(), capped(24), in_file());
  ASSERT_GT(plan.streamed_bytes, 16 * kGB);
  ASSERT_LT(plan.streamed_bytes, 24 * kGB);
  EXPECT_EQ(plan.host_ram_budget_bytes, 24 * kGB);
  EXPECT_EQ(plan.disk_bytes, 0);
  EXPECT_EQ(plan.disk_ring_bytes, 0);
  EXPECT_EQ(tier_bytes(plan, "host"), plan.streamed_bytes);
  const Decision& d = decision(plan, "host_ram_budget_fits");
  EXPECT_EQ(d.inputs["budget_bytes"], 24 * kGB);
  EXPECT_EQ(d.inputs["budget_origin"], "host_ram_cap_gb");
  EXPECT_EQ(d.inputs["streamed_bytes"], plan.streamed_bytes);
  EXPECT_FALSE(plan.has_decision("disk_tier"));
  // The same plan as without the cap, apart from that decision.
  const Plan uncapped = make_plan(flux(), linear_config(), in_file());
  EXPECT_EQ(plan.to_json()["stream_units"], uncapped.to_json()["stream_units"]);
}

TEST(DiskTier, CapBelowTheStreamedWeightsSpillsSpreadUnitsToDisk) {
  DynamicOffloadConfig config = capped(12);
  config.pin_cpu_memory = true;  // RAM unknown: every host-tier weight is pinned
  const Plan plan = make_plan(flux(), config, in_file());
  const std::int64_t cap = 12 * kGB;
  ASSERT_GT(plan.streamed_bytes, 16 * kGB);
  EXPECT_EQ(plan.host_ram_budget_bytes, cap);

  // Host units plus the ring fit the cap; the disk units carry the rest.
  EXPECT_GT(plan.disk_bytes, plan.streamed_bytes - cap);
  EXPECT_EQ(tier_bytes(plan, "disk"), plan.disk_bytes);
  EXPECT_EQ(tier_bytes(plan, "host"), plan.streamed_bytes - plan.disk_bytes);
  EXPECT_EQ(plan.host_tier_bytes(), plan.streamed_bytes - plan.disk_bytes);
  EXPECT_LE(plan.host_tier_bytes() + plan.disk_ring_bytes, cap);
  // The ring takes what the cap leaves, up to the window + 2 x the largest disk unit.
  std::int64_t largest_disk = 0;
  for (const StreamUnit& u : plan.stream_units) {
    if (u.tier == "disk") largest_disk = std::max(largest_disk, u.bytes);
  }
  EXPECT_GE(plan.disk_ring_bytes, 2 * largest_disk);
  EXPECT_EQ(plan.disk_ring_bytes,
            std::min(kDefaultPrefetchWindowBytes + 2 * largest_disk, cap - plan.host_tier_bytes()));

  // Spread through the model order: every quarter holds disk units and no gap is long.
  const std::vector<std::size_t> at = disk_positions(plan);
  const std::size_t n = plan.stream_units.size();
  ASSERT_GE(at.size(), 4u);
  for (std::size_t q = 0; q < 4; ++q) {
    EXPECT_TRUE(std::any_of(at.begin(), at.end(),
                            [&](std::size_t i) { return i >= q * n / 4 && i < (q + 1) * n / 4; }))
        << "no disk unit in quarter " << q;
  }
  const std::size_t stride = (n + at.size() - 1) / at.size();
  for (std::size_t i = 1; i < at.size(); ++i) EXPECT_LE(at[i] - at[i - 1], stride + 1);

  // Disk units are neither pinned nor pin candidates; every host unit is pinned.
  for (const StreamUnit& u : plan.stream_units) {
    for (TensorRef ref : u.tensors) {
      EXPECT_EQ(plan.modules[ref.module].tensors[ref.tensor].pin, u.tier == "host") << u.name;
    }
  }
  EXPECT_EQ(plan.pin_candidate_bytes, plan.host_tier_bytes());
  EXPECT_EQ(plan.pinned_bytes, plan.host_tier_bytes());
  EXPECT_FALSE(plan.has_decision("full_pin_zero_resident"));

  // The decision and its figures.
  const Decision& d = decision(plan, "disk_tier");
  EXPECT_EQ(d.inputs["budget_bytes"], cap);
  EXPECT_EQ(d.inputs["budget_origin"], "host_ram_cap_gb");
  EXPECT_EQ(d.inputs["streamed_bytes"], plan.streamed_bytes);
  EXPECT_EQ(d.inputs["host_bytes"], plan.host_tier_bytes());
  EXPECT_EQ(d.inputs["disk_bytes"], plan.disk_bytes);
  EXPECT_EQ(d.inputs["ring_bytes"], plan.disk_ring_bytes);
  EXPECT_EQ(d.inputs["units_on_disk"], at.size());
  EXPECT_EQ(d.inputs["units"], n);
  EXPECT_EQ(d.inputs["over_budget_bytes"], 0);
  EXPECT_TRUE(contains(d.detail, "host_ram_cap_gb")) << d.detail;
  EXPECT_TRUE(contains(d.detail, fmt::format("{} of {} units", at.size(), n))) << d.detail;

  // The report: each unit's tier and the three figures.
  const nlohmann::json j = plan.to_json();
  EXPECT_EQ(j["host_ram_budget_bytes"], cap);
  EXPECT_EQ(j["disk_bytes"], plan.disk_bytes);
  EXPECT_EQ(j["disk_ring_bytes"], plan.disk_ring_bytes);
  EXPECT_EQ(j["stream_units"][at.front()]["tier"], "disk");
  EXPECT_EQ(j["stream_units"][0]["tier"], at.front() == 0 ? "disk" : "host");
  const std::string summary = plan.summary();
  EXPECT_TRUE(contains(summary, fmt::format("from disk in {} units", at.size()))) << summary;
  EXPECT_TRUE(contains(summary, "host RAM budget 12.00 GiB")) << summary;
}

TEST(DiskTier, FewerUnitsOnDiskWhenTheCapIsLarger) {
  const Plan tight = make_plan(flux(), capped(8), in_file());
  const Plan loose = make_plan(flux(), capped(14), in_file());
  EXPECT_LT(loose.disk_bytes, tight.disk_bytes);
  EXPECT_LT(disk_positions(loose).size(), disk_positions(tight).size());
  EXPECT_LE(tight.host_tier_bytes() + tight.disk_ring_bytes, 8 * kGB);
  EXPECT_LE(loose.host_tier_bytes() + loose.disk_ring_bytes, 14 * kGB);
}

TEST(DiskTier, PlanModeReportsTheSameTiers) {
  DynamicOffloadConfig config = capped(12);
  const Plan run = make_plan(flux(), config, in_file());
  config.execution_mode = ExecutionMode::kPlan;
  const Plan report = make_plan(flux(), config, in_file());
  EXPECT_FALSE(report.execute);
  EXPECT_EQ(report.to_json()["stream_units"], run.to_json()["stream_units"]);
  EXPECT_EQ(report.disk_bytes, run.disk_bytes);
  EXPECT_EQ(report.disk_ring_bytes, run.disk_ring_bytes);
  EXPECT_TRUE(report.has_decision("disk_tier"));
}

TEST(DiskTier, CapOnWeightsAlreadyInMemoryIsReportedNotEnforced) {
  const Plan plan = make_plan(flux(), capped(12), in_file(false));
  EXPECT_EQ(plan.host_ram_budget_bytes, 12 * kGB);
  EXPECT_EQ(plan.disk_bytes, 0);
  EXPECT_EQ(plan.disk_ring_bytes, 0);
  for (const StreamUnit& u : plan.stream_units) EXPECT_EQ(u.tier, "host") << u.name;
  EXPECT_FALSE(plan.has_decision("disk_tier"));
  const Decision& d = decision(plan, "host_ram_cap_unmet");
  EXPECT_EQ(d.inputs["budget_bytes"], 12 * kGB);
  EXPECT_EQ(d.inputs["streamed_bytes"], plan.streamed_bytes);
  EXPECT_TRUE(contains(d.detail, "already in host memory")) << d.detail;
  EXPECT_TRUE(contains(d.detail, "not enforced")) << d.detail;
  EXPECT_TRUE(contains(d.detail, "checkpoint directory")) << d.detail;
}

TEST(DiskTier, CapTooSmallForTheRingIsAnErrorNamingTheFigureAndTheVariable) {
  // The smallest plan: every unit on disk and a ring of two of the largest unit (216 MiB).
  try {
    (void)make_plan(flux(), capped(0.125), in_file());
    FAIL() << "a 0.125 GiB cap cannot hold a 216 MiB ring";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.status().code(), Code::kResourceExhausted) << m;
    EXPECT_TRUE(contains(m, "host_ram_cap_gb=0.125")) << m;
    EXPECT_TRUE(contains(m, fmt::format("needs {:.2f} GiB", 2.0 * kLargest / kGiB))) << m;
    EXPECT_TRUE(contains(m, "DDO_HOST_RAM_CAP_GB")) << m;
    EXPECT_TRUE(contains(m, "at least 0.211")) << m;  // 216 MiB = 0.2109375 GiB, rounded up
  }
  // That figure is enough: everything from disk, the ring taking the whole cap.
  const Plan plan = make_plan(flux(), capped(0.211), in_file());
  EXPECT_EQ(plan.host_tier_bytes(), 0);
  EXPECT_GE(plan.disk_ring_bytes, 2 * kLargest);
  EXPECT_EQ(plan.disk_ring_bytes, plan.host_ram_budget_bytes);
}

TEST(DiskTier, RamAdmissionBoundsWeightsInAFileWithoutACap) {
  DynamicOffloadConfig config = linear_config();
  config.available_system_ram_gb = 18.0;
  config.system_ram_headroom_gb = 6.0;  // usable 12 GiB
  const Plan plan = make_plan(flux(), config, in_file());
  EXPECT_EQ(plan.host_ram_budget_bytes, 12 * kGB);
  EXPECT_GT(plan.disk_bytes, 0);
  EXPECT_LE(plan.host_tier_bytes() + plan.disk_ring_bytes, 12 * kGB);
  const Decision& d = decision(plan, "disk_tier");
  EXPECT_TRUE(contains(d.inputs["budget_origin"].get<std::string>(), "ram_admission"));
  EXPECT_TRUE(contains(d.inputs["budget_origin"].get<std::string>(), "available_system_ram_gb"));
  EXPECT_EQ(d.inputs["usable_bytes"], 12 * kGB);
  // The same machine with the weights already in memory: no budget, nothing on disk.
  const Plan in_memory = make_plan(flux(), config, in_file(false));
  EXPECT_EQ(in_memory.host_ram_budget_bytes, 0);
  EXPECT_EQ(in_memory.disk_bytes, 0);
  EXPECT_FALSE(in_memory.has_decision("host_ram_cap_unmet"));
  // Detected RAM counts the same way.
  PlanContext ctx = in_file();
  ctx.available_ram_bytes = 18 * kGB;
  const Plan detected = make_plan(flux(), linear_config(), ctx);
  EXPECT_EQ(detected.disk_bytes, plan.disk_bytes);
  EXPECT_TRUE(contains(decision(detected, "disk_tier").inputs["budget_origin"].get<std::string>(),
                       "detected"));
}

TEST(DiskTier, RamAdmissionTooShortForTheRingStreamsAllFromDiskInsteadOfFailing) {
  DynamicOffloadConfig config = linear_config();
  config.available_system_ram_gb = 4.0;  // below the 6 GiB reserve
  const Plan plan = make_plan(flux(), config, in_file());
  EXPECT_EQ(plan.host_ram_budget_bytes, 1);  // at least 1 byte: 0 means unbounded
  EXPECT_EQ(plan.disk_bytes, plan.streamed_bytes);
  EXPECT_EQ(plan.disk_ring_bytes, 2 * kLargest);
  const Decision& d = decision(plan, "disk_tier");
  EXPECT_EQ(d.inputs["over_budget_bytes"], 2 * kLargest - 1);
  EXPECT_TRUE(contains(d.detail, "over the estimate")) << d.detail;
}

TEST(DiskTier, UnitsALoaderPinnedStayOnTheHost) {
  ModelInventory inv = flux_inventory({.h = kH});
  // Pin every weight of the first four double blocks (2.5 GiB), as a loader (or the weight
  // cache) would.
  auto pinned_block = [](const std::string& name) {
    for (const char* b : {"transformer_blocks.0.", "transformer_blocks.1.", "transformer_blocks.2.",
                          "transformer_blocks.3."}) {
      if (name.starts_with(b)) return true;
    }
    return false;
  };
  for (ModuleInfo& m : inv.modules) {
    if (pinned_block(m.name)) {
      for (TensorInfo& t : m.tensors) t.already_pinned = true;
    }
  }
  DynamicOffloadConfig config = capped(12);
  const Plan plan = make_plan(inv, config, in_file());
  ASSERT_GT(plan.loader_pinned_bytes, 0);
  ASSERT_GT(plan.disk_bytes, 0);
  for (const StreamUnit& u : plan.stream_units) {
    if (pinned_block(u.name)) {
      EXPECT_EQ(u.tier, "host") << u.name;
    }
  }
  EXPECT_EQ(decision(plan, "disk_tier").inputs["loader_pinned_host_bytes"],
            plan.loader_pinned_bytes);
  EXPECT_LE(plan.host_tier_bytes() + plan.disk_ring_bytes, 12 * kGB);
  // Below what the loader's pins already take, the error says so.
  try {
    (void)make_plan(inv, capped(bytes_to_gib(plan.loader_pinned_bytes) - 1), in_file());
    FAIL() << "the loader's pins alone exceed the cap";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "a loader already pinned")) << e.what();
  }
}

// Note [Only parameters stay in the file]: a unit holding a buffer (quantize='s copies are
// buffers of their Linear's entry) stays in host memory and counts against the budget; the cap's
// error names those bytes and quantize=.
TEST(DiskTier, UnitsHoldingBuffersStayOnTheHostAndCount) {
  ModelInventory inv = flux_inventory({.h = kH});
  auto copied = [](const std::string& name) {
    return name.starts_with("transformer_blocks.0.") || name.starts_with("transformer_blocks.1.");
  };
  for (ModuleInfo& m : inv.modules) {
    if (copied(m.name)) {
      for (TensorInfo& t : m.tensors) t.is_parameter = false;
    }
  }
  const Plan plan = make_plan(inv, capped(12), in_file());
  ASSERT_GT(plan.disk_bytes, 0);
  std::int64_t buffers = 0;
  for (const StreamUnit& u : plan.stream_units) {
    if (copied(u.name)) {
      EXPECT_EQ(u.tier, "host") << u.name;
      buffers += u.bytes;
    }
  }
  ASSERT_GT(buffers, 0);
  EXPECT_EQ(decision(plan, "disk_tier").inputs["buffer_host_bytes"], buffers);
  EXPECT_LE(plan.host_tier_bytes() + plan.disk_ring_bytes, 12 * kGB);
  // Below what the buffers alone take: an error naming them and both ways out.
  try {
    (void)make_plan(inv, capped(bytes_to_gib(buffers) - 0.5), in_file());
    FAIL() << "the buffers alone exceed the cap";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.status().code(), Code::kResourceExhausted) << m;
    EXPECT_TRUE(contains(m, "units holding buffers (quantize='s copies")) << m;
    EXPECT_TRUE(contains(m, "Raise host_ram_cap_gb")) << m;
    EXPECT_TRUE(contains(m, "load without it")) << m;
    EXPECT_FALSE(contains(m, "from_pretrained_with_dynamic_offload")) << m;
  }
  // The same units as parameters may all go to disk.
  const Plan params = make_plan(flux(), capped(bytes_to_gib(buffers) - 0.5), in_file());
  EXPECT_GT(params.disk_bytes, 0);
}

TEST(DiskTier, BlockRouteSpillsWholeBlocks) {
  DynamicOffloadConfig config = capped(12);
  config.route = Route::kGroupBlock;
  const Plan plan = make_plan(flux(), config, in_file());
  EXPECT_GT(plan.disk_bytes, 0);
  for (const StreamUnit& u : plan.stream_units) {
    if (u.tier == "disk") {
      EXPECT_EQ(u.grain, "block") << u.name;
    }
  }
  EXPECT_LE(plan.host_tier_bytes() + plan.disk_ring_bytes, 12 * kGB);
}

// --- the config field --------------------------------------------------------------------------

SettingsRequest no_wsl() {
  SettingsRequest r;
  r.wsl = false;
  return r;
}

Status env_error(const EnvMap& env) {
  DynamicOffloadSettings out;
  return DynamicOffloadSettings::resolve(no_wsl(), env, &out);
}

TEST(HostRamCap, ReadFromTheEnvironment) {
  EXPECT_EQ(DynamicOffloadConfig{}.host_ram_cap_gb, 0.0);
  EXPECT_EQ(DynamicOffloadSettings::from_env(no_wsl(), {{"DDO_HOST_RAM_CAP_GB", "12.5"}})
                .config.host_ram_cap_gb,
            12.5);
  EXPECT_EQ(DynamicOffloadSettings::from_env(no_wsl(), {{"DDO_HOST_RAM_CAP_GB", "0"}})
                .config.host_ram_cap_gb,
            0.0);
}

TEST(HostRamCap, MalformedOrOutOfRangeNamesTheVariableAndTheRange) {
  Status s = env_error({{"DDO_HOST_RAM_CAP_GB", "-1"}});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(),
                       "DDO_HOST_RAM_CAP_GB=\"-1\" is negative; use GiB in [1e-06, "
                       "65536] or 0 (off)"))
      << s.message();
  s = env_error({{"DDO_HOST_RAM_CAP_GB", "abc"}});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "DDO_HOST_RAM_CAP_GB=\"abc\" is not a number")) << s.message();
  s = env_error({{"DDO_HOST_RAM_CAP_GB", "1e12"}});
  EXPECT_TRUE(contains(s.message(), "DDO_HOST_RAM_CAP_GB=\"1e12\" is out of range")) << s.message();
  // A cap that would round to 0 bytes, which would read as no cap.
  s = env_error({{"DDO_HOST_RAM_CAP_GB", "1e-12"}});
  EXPECT_TRUE(contains(s.message(), "DDO_HOST_RAM_CAP_GB=\"1e-12\" is out of range"))
      << s.message();
}

TEST(HostRamCap, JsonViewOverridesAndValidation) {
  const std::vector<std::string> names = config_field_names();
  const auto at = std::find(names.begin(), names.end(), "host_ram_cap_gb");
  ASSERT_NE(at, names.end());
  EXPECT_EQ(*(at - 1), "vram_cap_gb");  // declaration order

  DynamicOffloadConfig a;
  a.host_ram_cap_gb = 7.25;
  const nlohmann::json j = config_to_json(a);
  EXPECT_EQ(j.at("host_ram_cap_gb"), 7.25);
  DynamicOffloadConfig b;
  ASSERT_TRUE(apply_overrides(&b, j).ok());
  EXPECT_EQ(b.host_ram_cap_gb, 7.25);
  EXPECT_EQ(config_to_json(b), j);

  const Status s = apply_overrides(&b, {{"host_ram_cap_gb", -1}});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(s.message(), "override host_ram_cap_gb=-1 is negative")) << s.message();
  EXPECT_EQ(b.host_ram_cap_gb, 7.25);  // unchanged

  DynamicOffloadConfig c;
  c.host_ram_cap_gb = 16e9;  // bytes typed as GiB
  EXPECT_TRUE(contains(validate_config(c).message(),
                       "config field host_ram_cap_gb=1.6e+10 is out "
                       "of range; use GiB in [1e-06, 65536] or 0 "
                       "(off)"))
      << validate_config(c).message();
  c.host_ram_cap_gb = 0.0;
  EXPECT_TRUE(validate_config(c).ok());
}

}  // namespace
}  // namespace ddo::core
