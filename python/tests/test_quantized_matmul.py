"""Quantized compute on the host simulation: SDNQ's matmul layouts (int8, float8_e4m3fn) against
the `sdnq` package's own quantized-matmul forward on the CPU, ddo's `quantize=` keyword on a bf16
model, the per-layer report, and DDO_QUANTIZED_MATMUL=off. The CUDA kernels and GEMMs:
sdnq/tests/gpu/quantized_matmul_kernel_test.cpp."""

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


@pytest.mark.parametrize("quantize,bound", [("int8", 0.02), ("fp8", 0.06)])
@torch.no_grad()
def test_quantize_keyword_on_a_bf16_model(quantize, bound):
    torch.manual_seed(1)
    model = Mlp().to(torch.bfloat16).eval()
    x = torch.randn(2, 48, 256, dtype=torch.bfloat16)
    reference = model(x)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    offload = ddo.enable_offload(model, preset="one_shot_fast", quantize=quantize, **STREAM)
    assert isinstance(model.blocks[0][0], ddo.sdnq.QuantizedLinear)
    assert model.blocks[0][0].ddo_sdnq_layout[7] == 1  # quantized_matmul
    assert type(model.head) is nn.Linear  # [40, 256]: not a multiple of 16
    report = offload.report()["quantized_compute"]
    assert report["quantize"] == quantize
    gemm = "int8_gemm" if quantize == "int8" else "fp8_gemm"
    assert report["counts"] == {gemm: 4}, report
    assert "multiple of 16" in report["kept_dense"]["head"]
    packed_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert packed_bytes < 0.6 * dense_bytes  # one byte per weight plus the scales
    out = model(x)
    assert rel_l2(out, reference) < bound
    # Fewer than 32 rows dequantize: the same weights, another path, still close.
    assert rel_l2(model(x[:1, :8]), reference[:1, :8]) < bound
    offload.remove()
    assert isinstance(model.blocks[0][0], ddo.sdnq.QuantizedLinear)  # stays quantized
    assert torch.equal(model(x), out)


def test_quantize_keyword_errors_leave_the_model_as_it_was():
    model = Mlp().to(torch.bfloat16)
    with pytest.raises(ValueError, match='"fp8"'):
        ddo.enable_offload(model, quantize="uint4", **STREAM)
    with pytest.raises(TypeError, match="quantize"):
        ddo.enable_offload(model, quantize=8, **STREAM)
    assert type(model.blocks[0][0]) is nn.Linear
    assert not any(ddo._C.is_managed(p) for p in model.parameters())


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


@pytest.mark.parametrize("apply_dynamic", [True, False])
@torch.no_grad()
def test_the_loader_quantizes_a_bf16_checkpoint(tmp_path, apply_dynamic):
    # from_pretrained_with_dynamic_offload(quantize=) reads the dense weights, then replaces each
    # qualifying Linear as enable_offload(quantize=) does; no sdnq package involved.
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
    loaded = ddo.from_pretrained_with_dynamic_offload(
        tmp_path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=apply_dynamic,
        dynamic_offload_config=dict(STREAM, execution_mode="sdnq_runtime") if apply_dynamic else None,
        quantize="fp8",
        dtype=torch.bfloat16,
    )
    module = loaded.module
    quantized = [n for n, m in module.named_modules() if isinstance(m, ddo.sdnq.QuantizedLinear)]
    assert "transformer_blocks.0.ff.net.2" in quantized, quantized
    assert type(module.context_embedder) is torch.nn.Linear  # 32 x 128: under 16384 weights
    if apply_dynamic:
        report = loaded.report()["quantized_compute"]
        assert report["quantize"] == "fp8"
        assert sum(report["counts"].values()) == len(quantized), report
        assert "context_embedder" in report["kept_dense"]
        offload = loaded.offload
    else:
        assert loaded.load_report["quantize"] == "fp8"
        assert "context_embedder" in loaded.load_report["kept_dense"]
        offload = ddo.enable_offload(module, **STREAM)
    assert any(ddo._C.is_managed(p) for p in module.parameters())
    out = module(**inputs).sample
    assert rel_l2(out, reference) < 0.1, rel_l2(out, reference)
    offload.remove()


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
@torch.no_grad()
def test_quantize_keyword_on_a_torchscript_model(quantize):
    # A traced module keeps its graph and modules: C++ serves each Linear's weight from a
    # quantized copy (OffloadOptions::quantize), with the outputs of Python's quantize= on the
    # same weights, and gives the dense weights back on remove().
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
    python_path = ddo.enable_offload(model, preset="one_shot_fast", quantize=quantize, **STREAM)
    expected = model(x)
    python_path.remove()
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
    assert type(model.time_embedder[2]) is nn.Linear
    assert isinstance(model.blocks[0][0], ddo.sdnq.QuantizedLinear)
    assert torch.isfinite(model(x)).all()
    offload.remove()
