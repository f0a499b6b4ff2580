"""Quantized compute on the host simulation: SDNQ's matmul layouts (int8, float8_e4m3fn) against
the `sdnq` package's own quantized-matmul forward on the CPU, ddo's `quantize=` keyword on a bf16
model, the per-layer report, and DDO_QUANTIZED_MATMUL=off. The CUDA kernels and GEMMs:
sdnq/tests/gpu/quantized_matmul_kernel_test.cpp."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import ddo
from helpers import import_sdnq_oracle

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
sdnq = import_sdnq_oracle()

STREAM = dict(
    execution_device="sim",
    auto_budget_policy="off",
    resident_module_budget_gb=0.0,
    small_tensor_threshold_bytes=1024,
    always_resident_modules_pattern=[],
)


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Mlp(nn.Module):
    def __init__(self, h=256, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)) for _ in range(n)
        )
        self.head = nn.Linear(h, 40)  # 40 is no multiple of 16: kept dense by quantize=

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


@pytest.mark.parametrize("weights_dtype,bound", [("int8", 0.01), ("float8_e4m3fn", 0.03)])
@torch.no_grad()
def test_matmul_layout_matches_the_packages_quantized_forward(weights_dtype, bound):
    torch.manual_seed(0)
    model = Mlp().to(torch.bfloat16).eval()
    dense = Mlp().to(torch.bfloat16).eval()
    dense.load_state_dict(model.state_dict())
    sdnq.sdnq_post_load_quant(model, weights_dtype=weights_dtype, use_quantized_matmul=True,
                              torch_dtype=torch.bfloat16, add_skip_keys=False)
    layer = model.blocks[0][0]
    assert layer.sdnq_dequantizer.use_quantized_matmul  # the package's matmul layout
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)  # 96 rows: the GEMM path for both
    package = model(x)
    offload = ddo.enable_offload(model, preset="one_shot_fast", **STREAM)
    report = offload.report()["quantized_compute"]
    gemm = "int8_gemm" if weights_dtype == "int8" else "fp8_gemm"
    assert report["layers"]["blocks.0.0"]["path"] == gemm, report
    ours = model(x)
    # The same quantized weights and the same per-token activation rounding. int8: exact integer
    # sums on both sides, so only the scale arithmetic's last bits differ. fp8: the package's CPU
    # path multiplies through a per-tensor torch._scaled_mm or float16 products (its rounding),
    # ddo's reference in float32; measured 0.005 over the two blocks.
    assert rel_l2(ours, package) < (2e-3 if weights_dtype == "int8" else 1e-2)
    assert rel_l2(ours, dense(x)) < 4 * bound  # the weights' and activations' rounding
    offload.remove()


def resident_quantized(model, quantize):
    """The same model with its Linears replaced by ddo.sdnq.quantize_model (the explicit offline
    tool: quantize_linear(..., quantized_matmul=True) layers, resident on the CPU): what the
    attach's quantized copies must compute."""
    resident = copy.deepcopy(model)
    ddo.sdnq.quantize_model(resident, quantize)
    return resident


def modules_and_weights(model):
    """What an attach must leave as it was: each module and tensor object, dtype and values."""
    return ([(n, m, type(m), m.training) for n, m in model.named_modules()],
            [(n, p, p.dtype, p.detach().clone()) for n, p in model.named_parameters()])


def assert_unchanged(model, before):
    modules, weights = before
    now_modules, now_weights = modules_and_weights(model)
    assert [(n, id(m), t, tr) for n, m, t, tr in now_modules] == \
        [(n, id(m), t, tr) for n, m, t, tr in modules]
    assert len(now_weights) == len(weights)
    for (n, p, dtype, value), (n2, p2, dtype2, _) in zip(weights, now_weights):
        assert n == n2 and p is p2 and dtype == dtype2, n
        assert torch.equal(p2.detach(), value), n
        assert not ddo._C.is_managed(p2), n


@pytest.mark.parametrize("quantize,bound", [("int8", 0.02), ("fp8", 0.06)])
@torch.no_grad()
def test_quantize_keyword_on_a_bf16_model(quantize, bound):
    torch.manual_seed(1)
    model = Mlp().to(torch.bfloat16).eval()
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    reference = model(x)
    expected = resident_quantized(model, quantize)(x)
    before = modules_and_weights(model)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    offload = ddo.enable_offload(model, preset="one_shot_fast", quantize=quantize, **STREAM)
    # The model keeps its modules and dtypes: its Linears are served from quantized copies.
    assert type(model.blocks[0][0]) is nn.Linear
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    report = offload.report()["quantized_compute"]
    assert report["quantize"] == quantize
    gemm = "int8_gemm" if quantize == "int8" else "fp8_gemm"
    assert report["counts"] == {gemm: 4}, report
    assert sorted(report["layers"]) == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert "multiple of 16" in report["kept_dense"]["head"]
    # What streams is the quantized copy: one byte per weight plus the scales.
    assert offload.report()["plan"]["streamed_bytes"] < 0.6 * dense_bytes
    # Reads outside the Linear's own ops see the dense weight.
    assert torch.equal(model.blocks[0][0].weight, before[1][0][3])
    out = model(x)
    assert rel_l2(out, expected) < 1e-3, rel_l2(out, expected)  # the same quantized weights
    assert rel_l2(out, reference) < bound
    # Fewer than 32 rows dequantize: the same weights, another path, still close.
    assert rel_l2(model(x[:1, :8]), reference[:1, :8]) < bound
    offload.remove()
    assert_unchanged(model, before)
    assert torch.equal(model(x), reference)


def test_quantize_keyword_errors_leave_the_model_as_it_was():
    model = Mlp().to(torch.bfloat16)
    before = modules_and_weights(model)
    with pytest.raises(ValueError, match='"fp8"'):
        ddo.enable_offload(model, quantize="uint4", **STREAM)
    with pytest.raises(TypeError, match="quantize"):
        ddo.enable_offload(model, quantize=8, **STREAM)
    with pytest.raises(ValueError, match="preset"):
        ddo.enable_offload(model, preset="no_such_preset", quantize="fp8", **STREAM)
    with pytest.raises(TypeError, match="no_such_field"):
        ddo.enable_offload(model, quantize="fp8", no_such_field=1, **STREAM)
    with pytest.raises(ValueError, match="host_ram_cap_gb"):
        ddo.enable_offload(model, quantize="fp8", host_ram_cap_gb=-1.0, **STREAM)
    assert_unchanged(model, before)


@torch.no_grad()
def test_a_second_quantize_on_an_attached_model_is_refused():
    model = Mlp().to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 256, dtype=torch.bfloat16)
    offload = ddo.enable_offload(model, quantize="fp8", **STREAM)
    out = model(x)
    with pytest.raises(RuntimeError, match=r"quantize='fp8'.*quantize='int8'.*remove_offload"):
        ddo.enable_offload(model, quantize="int8", **STREAM)
    assert offload.active and torch.equal(model(x), out)
    assert offload.report()["quantized_compute"]["quantize"] == "fp8"
    offload.remove()
    again = ddo.enable_offload(model, quantize="int8", **STREAM)  # after remove(): a fresh choice
    assert again.report()["quantized_compute"]["quantize"] == "int8"
    again.remove()


@torch.no_grad()
def test_quantize_keeps_hooks_training_flags_and_the_state_dict():
    torch.manual_seed(4)
    model = Mlp().to(torch.bfloat16).eval()
    model.blocks[1].train()  # a flag the attach must not touch
    model.requires_grad_(False)
    seen = []
    model.blocks[0][0].register_forward_pre_hook(lambda m, args: seen.append("pre"))
    model.blocks[0][0].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    flags = [m.training for m in model.modules()]
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    offload = ddo.enable_offload(model, quantize="int8", **STREAM)
    model(x)
    assert seen == ["pre", torch.bfloat16]
    assert [m.training for m in model.modules()] == flags
    saved = model.state_dict()
    assert saved.keys() == state.keys()
    assert all(saved[k].dtype == v.dtype and torch.equal(saved[k], v) for k, v in state.items())
    offload.remove()
    assert [m.training for m in model.modules()] == flags


@torch.no_grad()
def test_load_state_dict_while_attached_is_quantized_again():
    # A dense state dict loaded into the attached model (load_state_dict copies into each weight
    # in place) reaches the next forward, quantized again from the new dense values.
    torch.manual_seed(5)
    model = Mlp().to(torch.bfloat16).eval()
    other = Mlp().to(torch.bfloat16).eval()
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    expected = resident_quantized(other, "fp8")(x)
    offload = ddo.enable_offload(model, quantize="fp8", **STREAM)
    first = model(x)
    model.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  other.state_dict().values()))
    out = model(x)
    assert not torch.equal(out, first)
    assert rel_l2(out, expected) < 1e-3, rel_l2(out, expected)
    assert offload.report()["run"]["weights_changed_in_place"] > 0
    offload.remove()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  other.state_dict().values()))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 256, bias=False)
        self.mid = nn.Linear(256, 256)
        self.down = nn.Linear(256, 256, bias=False)
        self.down.weight = self.up.weight  # tied

    def forward(self, x):
        return self.down(torch.relu(self.mid(self.up(x))))


@torch.no_grad()
def test_tied_weights_stay_tied_and_dense():
    model = Tied().to(torch.bfloat16).eval()
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    expected = copy.deepcopy(model)  # the tie kept, mid quantized
    expected.mid = ddo.sdnq.quantize_linear(expected.mid, "int8", 0, quantized_matmul=True)
    offload = ddo.enable_offload(model, quantize="int8", **STREAM)
    q = offload.report()["quantized_compute"]
    assert "tied" in q["kept_dense"]["up"] and "tied" in q["kept_dense"]["down"], q
    assert list(q["layers"]) == ["mid"]
    assert model.down.weight is model.up.weight
    out = model(x)
    offload.remove()
    assert model.down.weight is model.up.weight
    assert rel_l2(out, expected(x)) < 1e-3


class MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class LoraStyle(nn.Module):
    """A wrapper holding an adapter as peft does (lora_A, lora_B beside the base layer)."""

    def __init__(self):
        super().__init__()
        self.base_layer = nn.Linear(256, 256)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(256, 64, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(64, 256, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


@torch.no_grad()
def test_linears_that_cannot_be_quantized_stay_dense_and_say_why():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = MyLinear(256, 256)
            self.attn = LoraStyle()
            self.plain = nn.Linear(256, 256)

        def forward(self, x):
            return self.plain(self.attn(self.sub(x)))

    model = Mixed().to(torch.bfloat16).eval()
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    reference = model(x)
    offload = ddo.enable_offload(model, quantize="fp8", **STREAM)
    q = offload.report()["quantized_compute"]
    assert q["kept_dense"]["sub"] == ("a subclass of Linear (MyLinear) whose forward is its own: "
                                      "quantize= serves the stock Linear only"), q
    assert "LoRA adapter (lora_A" in q["kept_dense"]["attn.lora_A.default"], q
    assert "LoRA adapter (lora_B" in q["kept_dense"]["attn.lora_B.default"], q
    assert sorted(q["layers"]) == ["attn.base_layer", "plain"], q
    assert rel_l2(model(x), reference) < 0.06
    offload.remove()


@torch.no_grad()
def test_a_float64_linear_is_kept_dense():
    model = Mlp().double().eval()
    x = torch.randn(2, 48, 256, dtype=torch.float64)
    reference = model(x)
    offload = ddo.enable_offload(model, quantize="int8", **STREAM)
    q = offload.report()["quantized_compute"]
    assert q["layers"] == {} and q["counts"] == {}, q
    assert q["kept_dense"]["blocks.0.0"] == ("the weight is neither bfloat16, float16 nor float32 "
                                            "(a quantized layer computes in one of those)"), q
    assert torch.allclose(model(x), reference)
    offload.remove()


# Placed on the device as a whole: a plan with nothing to stream still serves the placeholders
# (the interception is active), so the layer computes from its quantized copy, not the dense bytes.
ON_DEVICE = dict(execution_device="sim", sim_device_capacity_gb=8)


@pytest.mark.parametrize("placement", ["streamed", "on_device"])
@pytest.mark.parametrize("quantize", ["int8", "fp8"])
@torch.no_grad()
def test_a_bare_linear_model(quantize, placement):
    torch.manual_seed(6)
    model = nn.Linear(256, 512).to(torch.bfloat16).eval()
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    dense = model.weight.detach().clone()
    expected = ddo.sdnq.quantize_linear(model, "int8" if quantize == "int8" else "float8_e4m3fn",
                                        0, quantized_matmul=True)(x)
    offload = ddo.enable_offload(model, quantize=quantize,
                                 **(STREAM if placement == "streamed" else ON_DEVICE))
    report = offload.report()
    q = report["quantized_compute"]
    assert list(q["layers"]) == ["<root>"], q
    assert (report["setup"]["bytes"]["streamed"] > 0) == (placement == "streamed"), report["setup"]
    out = model(x)
    assert rel_l2(out, expected) < 1e-3, rel_l2(out, expected)
    assert rel_l2(out, torch.nn.functional.linear(x, dense, model.bias)) > 1e-3
    offload.remove()
    assert torch.equal(model.weight, dense) and model.weight.dtype == torch.bfloat16


@torch.no_grad()
def test_a_profile_calibrated_with_quantize_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("DDO_PROFILE_DIR", str(tmp_path))
    x = torch.randn(1, 64, 256, dtype=torch.bfloat16)
    model = Mlp().to(torch.bfloat16).eval()
    offload = ddo.enable_offload(model, preset="auto", profile_name="q", build_profile=True,
                                 quantize="fp8", execution_device="sim")
    with offload.profile_run() as saved:
        model(x)
    offload.remove()
    assert saved["status"] == "saved", saved
    again = Mlp().to(torch.bfloat16).eval()
    reuse = ddo.enable_offload(again, preset="auto", profile_name="q", quantize="fp8",
                               execution_device="sim")
    assert reuse.profile_report["status"] == "applied", reuse.profile_report
    again(x)
    reuse.remove()


@torch.no_grad()
def test_the_profile_names_the_weights_its_budget_was_measured_with(tmp_path, monkeypatch):
    # Note [Profiles and quantization]: int8 and fp8 runs under one name share the profile
    # (both sdnq_runtime); the reuse says what the saved budget was measured with.
    monkeypatch.setenv("DDO_PROFILE_DIR", str(tmp_path))
    x = torch.randn(1, 64, 256, dtype=torch.bfloat16)
    reports = {}
    for quantize, build in (("int8", True), ("int8", False), ("fp8", False)):
        model = Mlp().to(torch.bfloat16).eval()
        offload = ddo.enable_offload(model, preset="auto", profile_name="q", build_profile=build,
                                     quantize=quantize, execution_device="sim", show_profile=False)
        with offload.profile_run() as report:
            model(x)
        offload.remove()
        reports[(quantize, build)] = report
    saved = reports[("int8", True)]
    assert saved["status"] == "saved" and saved["measured_weights"] == "sdnq int8 + bfloat16"
    same = reports[("int8", False)]
    assert same["status"] == "applied" and not any("calibrate this" in n for n in same.get("notes", []))
    other = reports[("fp8", False)]
    assert other["status"] == "applied", other
    assert other["weights"] == "sdnq float8_e4m3fn + bfloat16"
    assert other["measured_weights"] == "sdnq int8 + bfloat16"
    assert any("calibrate this name again" in n for n in other["notes"]), other


def test_off_switch_takes_the_dequantize_path_bit_for_bit(tmp_path):
    script = tmp_path / "off.py"
    script.write_text(textwrap.dedent("""
        import torch, ddo
        torch.manual_seed(2)
        lin = torch.nn.Linear(256, 512).to(torch.bfloat16)
        q = ddo.sdnq.quantize_linear(lin, "int8", 0, quantized_matmul=True)
        x = torch.randn(64, 256, dtype=torch.bfloat16)
        deq = torch.nn.functional.linear(x, ddo.sdnq.dequantize(q), q.bias)
        print("equal" if torch.equal(q(x), deq) else "differs")
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    outs = {}
    for mode in ("off", "auto"):
        env["DDO_QUANTIZED_MATMUL"] = mode
        run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                             text=True, check=True)
        outs[mode] = run.stdout.strip().splitlines()[-1]
    assert outs == {"off": "equal", "auto": "differs"}


@pytest.mark.parametrize("loader", ["ddo", "library"])
@torch.no_grad()
def test_the_loader_quantizes_a_bf16_checkpoint(tmp_path, loader):
    # from_pretrained_with_dynamic_offload(quantize=, apply_dynamic=True) is enable_offload's
    # quantize= on the loaded module: the modules and dtypes stay (FluxPipeline reads
    # transformer.dtype), the Linears compute from quantized copies; no sdnq package involved.
    diffusers = pytest.importorskip("diffusers")
    from helpers import tiny_flux_inputs

    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=64,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[16, 16, 32],
    ).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path)
    inputs = tiny_flux_inputs(0, torch.bfloat16)
    reference = model(**inputs).sample
    expected = resident_quantized(model, "fp8")(**inputs).sample
    loaded = ddo.from_pretrained_with_dynamic_offload(
        tmp_path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=dict(STREAM, execution_mode="sdnq_runtime"), quantize="fp8",
        dtype=torch.bfloat16, loader=loader,
    )
    module = loaded.module
    assert module.dtype == torch.bfloat16
    assert not any(isinstance(m, ddo.sdnq.QuantizedLinear) for m in module.modules())
    report = loaded.report()["quantized_compute"]
    assert report["quantize"] == "fp8"
    assert "transformer_blocks.0.ff.net.2" in report["layers"], report
    assert "context_embedder" in report["kept_dense"]  # 32 x 128: under 16384 weights
    assert any(ddo._C.is_managed(p) for p in module.parameters())
    out = module(**inputs).sample
    assert rel_l2(out, expected) < 1e-3, rel_l2(out, expected)
    assert rel_l2(out, reference) < 0.1, rel_l2(out, reference)
    loaded.offload.remove()
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(),
                                                  model.state_dict().values()))


def test_a_deferred_load_takes_quantize_at_the_later_attach(tmp_path):
    with pytest.raises(ValueError, match="later enable_offload"):
        ddo.from_pretrained_with_dynamic_offload(tmp_path, model_loader=lambda p: nn.Linear(2, 2),
                                                 apply_dynamic=False, quantize="fp8")


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
@torch.no_grad()
def test_quantize_keyword_on_a_torchscript_model(quantize):
    # A traced module keeps its graph and modules: C++ serves each Linear's weight from a
    # quantized copy (OffloadOptions::quantize), with the outputs of the same quantized layers
    # resident on the CPU, and gives the dense weights back on remove().
    torch.manual_seed(3)
    model = Mlp().to(torch.bfloat16).eval()
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    traced = torch.jit.trace(model, (x,))
    dense = [p.detach().clone() for p in traced.parameters()]
    offload = ddo.enable_offload(traced, preset="one_shot_fast", quantize=quantize, **STREAM)
    report = offload.report()["quantized_compute"]
    gemm = "int8_gemm" if quantize == "int8" else "fp8_gemm"
    assert report["quantize"] == quantize
    assert report["counts"] == {gemm: 4}, report
    assert "multiple of 16" in report["kept_dense"]["head"]
    # Reads outside the ops see the model's own weights, not zeros and not the quantized ones.
    assert all(torch.equal(p, d) for p, d in zip(traced.parameters(), dense))
    out = traced(x)
    expected = resident_quantized(model, quantize)(x)
    assert rel_l2(out, expected) < 1e-3, rel_l2(out, expected)
    offload.remove()
    assert all(torch.equal(p, d) for p, d in zip(traced.parameters(), dense))
    assert not any(ddo._C.is_managed(p) for p in traced.parameters())


@torch.no_grad()
def test_quantize_keeps_the_modules_a_model_keeps_at_full_precision():
    # diffusers' and transformers' _keep_in_fp32_modules, matched as their loaders match it (a
    # component of the name): Wan's time embedder is one, and its forward casts the timestep to
    # its first parameter's dtype, which an fp8 weight would make fp8.
    class Embedded(Mlp):
        _keep_in_fp32_modules = ["time_embedder"]

        def __init__(self):
            super().__init__()
            self.time_embedder = nn.Sequential(nn.Linear(256, 256), nn.SiLU(), nn.Linear(256, 256))

        def forward(self, x):
            dtype = next(iter(self.time_embedder.parameters())).dtype
            return super().forward(x + self.time_embedder(x.to(dtype)))

    model = Embedded().to(torch.bfloat16).eval()
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    offload = ddo.enable_offload(model, preset="one_shot_fast", quantize="fp8", **STREAM)
    kept = offload.report()["quantized_compute"]["kept_dense"]
    assert kept["time_embedder.0"] == ("the model keeps it at full precision "
                                       "(_keep_in_fp32_modules: time_embedder)")
    assert "time_embedder.2" in kept
    assert "blocks.0.0" in offload.report()["quantized_compute"]["layers"]
    assert torch.isfinite(model(x)).all()
    offload.remove()
