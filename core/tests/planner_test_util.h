// Test helpers shared by the planner tests (planner_*_test.cpp): a FLUX-like inventory builder
// with diffusers module names, the configs most tests start from, and lookups into a plan.
//
//   const Plan plan = make_plan(flux_inventory({.double_blocks = 2}), linear_config(), {});
//   EXPECT_EQ(decision(plan, "resident_selection").inputs["chosen"], 0);
#pragma once

#include <algorithm>
#include <cstdint>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ddo/core/inventory.h"
#include "ddo/core/planner.h"
#include "ddo/core/units.h"

namespace ddo::core::planner_test {

// A GiB in bytes, as the planner's *_gb fields count it; byte counts go back to those fields
// through core::bytes_to_gib (ddo/core/units.h).
inline constexpr std::int64_t kGB = kGiBBytes;

// Builds a FLUX-like inventory (diffusers module names) with hidden size `h`, bf16.
class InventoryBuilder {
 public:
  explicit InventoryBuilder(std::string model_class) { inv_.model_class = std::move(model_class); }

  void container(const std::string& name) {
    inv_.modules.push_back({name, "Container", ModuleKind::kOther, false, {}});
  }
  void linear(const std::string& name, std::int64_t out, std::int64_t in, bool bias = true) {
    ModuleInfo m{name, "Linear", ModuleKind::kLinear, true, {}};
    m.tensors.push_back({"weight", {out, in}, "bfloat16", out * in * 2});
    if (bias) m.tensors.push_back({"bias", {out}, "bfloat16", out * 2});
    inv_.modules.push_back(std::move(m));
  }
  void norm(const std::string& name, std::int64_t dim) {
    ModuleInfo m{name, "RMSNorm", ModuleKind::kOther, true, {}};
    m.tensors.push_back({"weight", {dim}, "bfloat16", dim * 2});
    inv_.modules.push_back(std::move(m));
  }
  // An SDNQ uint4 Linear, group 64: packed [out, in/2] bytes, scales and zero points [out, g, 1].
  void sdnq(const std::string& name, std::int64_t out, std::int64_t in, bool svd = false) {
    const std::int64_t groups = in / 64;
    ModuleInfo m{name, "SDNQLinear", ModuleKind::kPacked, true, {}, "sdnq"};
    TensorInfo packed{"weight", {out, in / 2}, "uint8", out * in / 2};
    packed.packed_role = PackedRole::kPackedWeight;
    TensorInfo scale{"scale", {out, groups, 1}, "bfloat16", out * groups * 2};
    scale.packed_role = PackedRole::kScale;
    TensorInfo zero{"zero_point", {out, groups, 1}, "bfloat16", out * groups * 2};
    zero.packed_role = PackedRole::kZeroPoint;
    m.tensors = {packed, scale, zero};
    if (svd) {
      TensorInfo up{"svd_up", {out, 32}, "bfloat16", out * 32 * 2};
      up.packed_role = PackedRole::kLowRankUp;
      TensorInfo down{"svd_down", {32, in}, "bfloat16", 32 * in * 2};
      down.packed_role = PackedRole::kLowRankDown;
      m.tensors.push_back(up);
      m.tensors.push_back(down);
    }
    m.tensors.push_back({"bias", {out}, "bfloat16", out * 2});
    inv_.modules.push_back(std::move(m));
  }
  ModelInventory take() { return std::move(inv_); }

 private:
  ModelInventory inv_;
};

struct FluxShape {
  std::int64_t h = 128;  // 128: a h*h bf16 weight is 32 KiB, above the 16 KiB default threshold
  int double_blocks = 19;
  int single_blocks = 38;
  bool sdnq = false;  // block Linears SDNQ-quantized; norm1 modulation stays a dense fallback
};

inline ModelInventory flux_inventory(FluxShape s = {}) {
  InventoryBuilder b("FluxTransformer2DModel");
  const std::int64_t h = s.h;
  auto block_linear = [&](const std::string& name, std::int64_t out, std::int64_t in) {
    if (s.sdnq) {
      b.sdnq(name, out, in);
    } else {
      b.linear(name, out, in);
    }
  };
  b.container("");
  b.linear("proj_in", h, 64);
  b.container("time_embed");
  b.linear("time_embed.linear_1", h, 256);
  b.linear("time_embed.linear_2", h, h);
  b.container("transformer_blocks");
  for (int i = 0; i < s.double_blocks; ++i) {
    const std::string p = "transformer_blocks." + std::to_string(i);
    b.container(p);
    b.linear(p + ".norm1.linear", 6 * h, h);  // dense even under SDNQ: a fallback Linear
    b.linear(p + ".norm1_context.linear", 6 * h, h);
    b.container(p + ".attn");
    for (const char* n : {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"}) {
      block_linear(p + ".attn." + n, h, h);
    }
    b.norm(p + ".attn.norm_q", 128);
    block_linear(p + ".attn.to_out.0", h, h);
    block_linear(p + ".attn.to_add_out", h, h);
    for (const char* ff : {".ff", ".ff_context"}) {
      b.container(p + ff);
      b.container(p + ff + ".net");
      b.container(p + ff + ".net.0");
      block_linear(p + ff + ".net.0.proj", 4 * h, h);
      block_linear(p + ff + ".net.2", h, 4 * h);
    }
  }
  b.container("single_transformer_blocks");
  for (int i = 0; i < s.single_blocks; ++i) {
    const std::string p = "single_transformer_blocks." + std::to_string(i);
    b.container(p);
    b.linear(p + ".norm.linear", 3 * h, h);
    block_linear(p + ".proj_mlp", 4 * h, h);
    b.container(p + ".attn");
    for (const char* n : {"to_q", "to_k", "to_v"}) block_linear(p + ".attn." + n, h, h);
    block_linear(p + ".proj_out", h, 5 * h);  // matched by the default always-resident pattern
  }
  b.container("norm_out");
  b.linear("norm_out.linear", 2 * h, h);
  b.linear("proj_out", 64, h);
  return b.take();
}

// Streamable bytes of one FLUX double block (linear runtime): 36 h*h bf16 weights.
inline std::int64_t double_block_bytes(std::int64_t h) {
  return 36 * h * h * 2;
}

inline DynamicOffloadConfig linear_config() {
  DynamicOffloadConfig c;
  c.execution_mode = ExecutionMode::kLinearRuntime;
  c.resident_module_patterns = {"auto"};
  return c;
}

inline const ModulePlan& module(const Plan& plan, const std::string& name) {
  for (const ModulePlan& m : plan.modules) {
    if (m.name == name) return m;
  }
  ADD_FAILURE() << "no module " << name;
  return plan.modules.front();
}

inline std::vector<std::string> resident_blocks(const Plan& plan, const std::string& prefix) {
  std::vector<std::string> out;
  const std::regex block("^" + prefix + R"(\.[0-9]+$)");
  for (const ModulePlan& m : plan.modules) {
    if (m.placement == Placement::kResident && std::regex_search(m.name, block)) {
      out.push_back(m.name);
    }
  }
  return out;
}

inline const Decision& decision(const Plan& plan, const std::string& name) {
  const Decision* d = plan.find_decision(name);
  if (d == nullptr) {
    ADD_FAILURE() << "decision " << name << " not recorded; plan:\n" << plan.summary();
    static const Decision kEmpty;
    return kEmpty;
  }
  return *d;
}

inline DynamicOffloadConfig pin_config() {
  DynamicOffloadConfig c = linear_config();
  c.pin_cpu_memory = true;
  c.system_ram_headroom_gb = 6.0;
  return c;
}

}  // namespace ddo::core::planner_test
