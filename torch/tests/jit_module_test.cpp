// TorchScript modules (torch::jit::Module) under enable_offload on the sim device: the module
// tree found by name with kinds from the qualified type names, handles that share the module's
// slots, outputs equal to the unmanaged module when the interpreter runs it (a traced Conv's
// aten::_convolution included), remove() giving the module back its ordinary tensors, and the
// root's qualified type name as the profile identity.
//
// The module is built in C++ (register_parameter + define), as torch.jit.trace / torch.jit.script
// would leave it: torch.nn's qualified type names, a second class of one name mangled, a Conv
// that calls aten::_convolution as traced code does. python/tests/test_torchscript.py runs real
// traced diffusers models through tools/examples/torchscript_flow.cpp.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ATen/ops/equal.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/utils.h>

#include "ddo/torch/enable_offload.h"
#include "ddo/torch/interception.h"
#include "ddo/torch/module_tree.h"
#include "test_util.h"

namespace ddo::adapter {
namespace {

using test::TempDir;

constexpr int64_t kVocab = 32;
constexpr int64_t kDim = 16;

torch::jit::Module new_module(const std::string& qualified_name,
                              const std::shared_ptr<torch::jit::CompilationUnit>& cu) {
  // shouldMangle: a second class of the same name becomes "...___torch_mangle_N.<Name>", as when
  // Python scripts or traces one class twice.
  return torch::jit::Module(c10::QualifiedName(qualified_name), cu, /*shouldMangle=*/true);
}

torch::jit::Module linear(const std::shared_ptr<torch::jit::CompilationUnit>& cu, int64_t in,
                          int64_t out, bool bias) {
  torch::jit::Module m = new_module("__torch__.torch.nn.modules.linear.Linear", cu);
  m.register_parameter("weight", at::randn({out, in}), /*is_buffer=*/false);
  if (bias) {
    m.register_parameter("bias", at::randn({out}), /*is_buffer=*/false);
  } else {
    m.register_attribute("bias", c10::NoneType::get(), c10::IValue());
  }
  m.define("def forward(self, x):\n  return torch.linear(x, self.weight, self.bias)\n");
  return m;
}

// Builds TinyNet: Embedding -> Linear -> GELU -> Linear (no bias) -> a module of another kind
// with a parameter, a buffer and a plain tensor attribute -> two Conv2d, one calling
// aten::_convolution as torch.jit.trace records it, one calling conv2d as a scripted Conv2d does.
torch::jit::Module make_tiny_net() {
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  torch::jit::Module embed = new_module("__torch__.torch.nn.modules.sparse.Embedding", cu);
  embed.register_parameter("weight", at::randn({kVocab, kDim}), false);
  embed.define("def forward(self, ids):\n  return torch.embedding(self.weight, ids)\n");

  torch::jit::Module scale = new_module("__torch__.my_models.Scale", cu);
  scale.register_parameter("weight", at::randn({kDim}), false);
  scale.register_buffer("shift", at::randn({kDim}));
  scale.register_attribute("cache", c10::TensorType::get(), at::randn({kDim}));
  scale.define("def forward(self, x):\n  return x * self.weight + self.shift\n");

  torch::jit::Module traced_conv = new_module("__torch__.torch.nn.modules.conv.Conv2d", cu);
  traced_conv.register_parameter("weight", at::randn({4, 1, 3, 3}), false);
  traced_conv.register_parameter("bias", at::randn({4}), false);
  traced_conv.define(
      "def forward(self, x):\n"
      "  return torch._convolution(x, self.weight, self.bias, [1, 1], [1, 1], [1, 1], False,\n"
      "                            [0, 0], 1, False, False, True, True)\n");
  torch::jit::Module scripted_conv = new_module("__torch__.torch.nn.modules.conv.Conv2d", cu);
  scripted_conv.register_parameter("weight", at::randn({2, 4, 3, 3}), false);
  scripted_conv.register_parameter("bias", at::randn({2}), false);
  scripted_conv.define(
      "def forward(self, x):\n"
      "  return torch.conv2d(x, self.weight, self.bias, [1, 1], [1, 1], [1, 1], 1)\n");

  torch::jit::Module net = new_module("__torch__.my_models.TinyNet", cu);
  net.register_module("embed", embed);
  net.register_module("proj", linear(cu, kDim, 2 * kDim, /*bias=*/true));
  net.register_module("head", linear(cu, 2 * kDim, kDim, /*bias=*/false));
  net.register_module("scale", scale);
  net.register_module("traced_conv", traced_conv);
  net.register_module("scripted_conv", scripted_conv);
  net.define(
      "def forward(self, ids):\n"
      "  h = self.head.forward(torch.gelu(self.proj.forward(self.embed.forward(ids))))\n"
      "  x = torch.unsqueeze(self.scale.forward(h), 1)\n"
      "  return self.scripted_conv.forward(self.traced_conv.forward(x))\n");
  net.eval();
  return net;
}

// The weights enable_offload streams in TinyNet (threshold 0, no resident budget): one weight op
// each per forward.
const std::vector<std::string> kStreamed = {"embed", "proj", "head", "traced_conv",
                                            "scripted_conv"};

at::Tensor run(torch::jit::Module& net, const at::Tensor& ids) {
  torch::NoGradGuard no_grad;
  return net.forward({ids}).toTensor();
}

std::vector<at::Tensor> snapshot(const torch::jit::Module& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net.named_parameters()) out.push_back(p.value.detach().clone());
  for (const auto& b : net.named_buffers()) out.push_back(b.value.detach().clone());
  return out;
}

at::Tensor weight_of(const torch::jit::Module& net, const std::string& child) {
  return net.attr(child).toModule().attr("weight").toTensor();
}

const ModuleEntry* find(const ModuleTree& tree, const std::string& name) {
  for (const ModuleEntry& e : tree.entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

TEST(JitModuleTree, NamesKindsAndSlotsByName) {
  torch::manual_seed(0);
  torch::jit::Module net = make_tiny_net();
  const ModuleTree tree = module_tree_from(net);

  EXPECT_EQ(tree.model_class, "__torch__.my_models.TinyNet");
  std::vector<std::string> names;
  for (const ModuleEntry& e : tree.entries) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"", "embed", "proj", "head", "scale", "traced_conv",
                                             "scripted_conv"}));

  const ModuleEntry* root = find(tree, "");
  ASSERT_NE(root, nullptr);
  EXPECT_FALSE(root->is_leaf);
  EXPECT_EQ(root->kind, core::ModuleKind::kOther);
  EXPECT_TRUE(root->tensors.empty());

  EXPECT_EQ(find(tree, "embed")->kind, core::ModuleKind::kEmbedding);
  EXPECT_EQ(find(tree, "proj")->kind, core::ModuleKind::kLinear);
  EXPECT_EQ(find(tree, "traced_conv")->kind, core::ModuleKind::kConv);
  EXPECT_EQ(find(tree, "scale")->kind, core::ModuleKind::kOther);
  EXPECT_EQ(find(tree, "scale")->class_name, "__torch__.my_models.Scale");

  // The second Linear and Conv2d classes carry TorchScript's mangling; the tree does not.
  const ModuleEntry* head = find(tree, "head");
  ASSERT_NE(head, nullptr);
  const std::string raw = net.attr("head").toModule().type()->name()->qualifiedName();
  EXPECT_NE(raw.find("___torch_mangle_"), std::string::npos) << raw;
  EXPECT_EQ(head->class_name, "__torch__.torch.nn.modules.linear.Linear");
  EXPECT_EQ(head->kind, core::ModuleKind::kLinear);
  EXPECT_EQ(find(tree, "scripted_conv")->class_name, "__torch__.torch.nn.modules.conv.Conv2d");
  EXPECT_EQ(find(tree, "scripted_conv")->kind, core::ModuleKind::kConv);

  // Direct tensors only: parameters, then buffers; a None bias and a plain tensor attribute are
  // left out.
  ASSERT_EQ(head->tensors.size(), 1u);
  EXPECT_EQ(head->tensors[0].name, "weight");
  ASSERT_EQ(find(tree, "proj")->tensors.size(), 2u);
  const ModuleEntry* scale = find(tree, "scale");
  ASSERT_EQ(scale->tensors.size(), 2u);
  EXPECT_EQ(scale->tensors[0].name, "weight");
  EXPECT_TRUE(scale->tensors[0].is_parameter);
  EXPECT_EQ(scale->tensors[1].name, "shift");
  EXPECT_FALSE(scale->tensors[1].is_parameter);

  // The handles are the module's own tensors: ddo's set_data reaches the interpreter.
  for (const ModuleEntry& e : tree.entries) {
    if (e.name.empty()) continue;
    const torch::jit::Module child = net.attr(e.name).toModule();
    for (const TensorSlot& slot : e.tensors) {
      EXPECT_EQ(slot.tensor.unsafeGetTensorImpl(),
                child.attr(slot.name).toTensor().unsafeGetTensorImpl())
          << e.name << "." << slot.name;
    }
  }
  const core::ModelInventory inv = to_inventory(tree, c10::Device(c10::kCPU));
  EXPECT_EQ(inv.model_class, tree.model_class);
  EXPECT_EQ(inv.modules.size(), tree.entries.size());
}

TEST(JitModuleOffload, OutputsEqualAndRemoveRestores) {
  torch::manual_seed(0);
  torch::jit::Module net = make_tiny_net();
  const at::Tensor ids = at::randint(0, kVocab, {2, 8});
  const at::Tensor ref = run(net, ids);
  const std::vector<at::Tensor> before = snapshot(net);

  TempDir dir;
  std::unique_ptr<Offload> offload = enable_offload(net, test::sim_options(dir));
  ASSERT_TRUE(offload->active());
  EXPECT_TRUE(interception_active());
  for (const std::string& child : kStreamed) {
    EXPECT_TRUE(is_managed(weight_of(net, child))) << child << "\n" << offload->summary();
  }

  test::ManagedReadGuard::clear();
  {
    test::ManagedReadGuard guard;
    // The profiling executor runs a profiled graph first and an optimized one afterwards: both
    // must be served.
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(run(net, ids), ref)) << "run " << i;
  }
  const std::set<std::string> violations = test::ManagedReadGuard::violations();
  EXPECT_TRUE(violations.empty()) << "un-intercepted ops read managed weights: "
                                  << *violations.begin();
  const nlohmann::json report = offload->report();
  EXPECT_EQ(report["model_class"], "__torch__.my_models.TinyNet");
  EXPECT_EQ(report["run"]["intercepted_ops"].get<int64_t>(),
            3 * static_cast<int64_t>(kStreamed.size()))
      << report["run"].dump(2);
  EXPECT_GT(report["run"]["bytes_streamed"].get<int64_t>(), 0);

  offload->remove();
  EXPECT_FALSE(interception_active());
  const std::vector<at::Tensor> after = snapshot(net);
  ASSERT_EQ(after.size(), before.size());
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i])) << i;
  for (const auto& p : net.named_parameters()) EXPECT_FALSE(is_managed(p.value)) << p.name;
  EXPECT_TRUE(at::equal(run(net, ids), ref));
}

TEST(JitModuleOffload, NamedProfileUsesTheQualifiedTypeName) {
  torch::manual_seed(0);
  torch::jit::Module net = make_tiny_net();
  const at::Tensor ids = at::randint(0, kVocab, {2, 8});
  const at::Tensor ref = run(net, ids);
  TempDir dir;
  const nlohmann::json overrides = {{"sim_device_capacity_gb", 0.25},
                                    {"profile_vram_headroom_gb", 0.01}};
  {
    OffloadOptions o = test::sim_options(dir, overrides);
    o.profile_name = "jit-tiny";
    o.build_profile = true;
    auto offload = enable_offload(net, o);
    const nlohmann::json report = offload->profile_run([&] {
      for (int i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(run(net, ids), ref));
    });
    EXPECT_EQ(report["status"], "saved") << report.dump(2);
  }
  {
    OffloadOptions o = test::sim_options(dir, overrides);
    o.profile_name = "jit-tiny";
    auto offload = enable_offload(net, o);
    EXPECT_EQ(offload->profile_report()["status"], "applied") << offload->profile_report().dump(2);
    EXPECT_TRUE(at::equal(run(net, ids), ref));
  }
  {  // Another class under the same profile name is another identity: nothing to apply.
    torch::jit::Module other = make_tiny_net();
    OffloadOptions o = test::sim_options(dir, overrides);
    o.profile_name = "jit-tiny";
    o.model_class = "__torch__.my_models.OtherNet";
    auto offload = enable_offload(other, o);
    EXPECT_EQ(offload->profile_report()["status"], "missing") << offload->profile_report().dump(2);
  }
}

TEST(JitModuleOffload, FrozenModuleIsRefusedByName) {
  torch::manual_seed(0);
  const torch::jit::Module frozen = torch::jit::freeze(make_tiny_net());
  TempDir dir;
  try {
    (void)enable_offload(frozen, test::sim_options(dir));
    FAIL() << "a frozen module was accepted";
  } catch (const ddo::Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("torch.jit.freeze"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(interception_active());
}

}  // namespace
}  // namespace ddo::adapter
