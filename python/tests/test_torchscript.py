"""The C++ path of a diffusers model: a tiny FluxTransformer2DModel and UNet2DConditionModel are
traced to TorchScript (examples/python/trace_diffusers.py), tools/examples/torchscript_flow.cpp
loads each with torch::jit::load and runs the staged flow under a named profile on the sim device
(calibrate, then reuse), and its outputs equal the same loop on the eager model in Python.

The same traced modules under ddo.enable_offload from Python (the TorchScript path of
python/src/jit_bindings.cpp): every Linear/Conv streamed, outputs bit-equal to the module without
ddo, remove() restores it, a named profile keyed by the TorchScript type, frozen modules refused,
a pipeline with a traced component.

The program is found beside the ddo package of the build tree (scripts/test.sh builds both); with
an installed package, set DDO_TORCHSCRIPT_FLOW to its path or the test is skipped, saying so."""

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.jit._pickle

import ddo
from conftest import STREAM_ALL

diffusers = pytest.importorskip("diffusers")

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"
sys.path.insert(0, str(_EXAMPLES))
import trace_diffusers  # noqa: E402

# Read at import: the conftest fixture clears DDO_* variables around each test.
_RUNNER_ENV = os.environ.get("DDO_TORCHSCRIPT_FLOW")
STEPS = 3


def runner() -> Path:
    if _RUNNER_ENV:
        return Path(_RUNNER_ENV)
    # Build tree: <build>/python/ddo/_C*.so and <build>/tools/torchscript_flow.
    path = Path(ddo._C.__file__).resolve().parents[2] / "tools" / "torchscript_flow"
    if not path.is_file():
        pytest.skip(f"torchscript_flow not built ({path} missing); build the tree "
                    "(scripts/test.sh) or set DDO_TORCHSCRIPT_FLOW")
    return path


def graph_weight_ops(traced) -> int:
    """Weight ops per forward of the traced graph: what ddo intercepts when all are streamed."""
    kinds = ("aten::linear", "aten::_convolution", "aten::conv2d", "aten::embedding")
    return sum(1 for n in traced.inlined_graph.nodes() if n.kind() in kinds)


@pytest.mark.parametrize("kind", ["flux", "unet"])
def test_traced_model_in_cpp_equals_python(kind, tmp_path, profile_dir):
    model, inputs, latents = trace_diffusers.build(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about Python control flow
        traced = trace_diffusers.trace(model, inputs)
    model_path, inputs_path = trace_diffusers.save(traced, inputs, str(tmp_path / kind))
    first, final = trace_diffusers.denoise(model, inputs, latents, STEPS)

    out_path, report_path = tmp_path / "out.pt", tmp_path / "report.json"
    proc = subprocess.run(
        [str(runner()), "--model", model_path, "--inputs", inputs_path, "--out", str(out_path),
         "--report", str(report_path), "--device", "sim", "--profile", f"ts-{kind}",
         "--steps", str(STEPS), "--stream-all"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, DDO_PROFILE_DIR=str(profile_dir)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)

    # torch::pickle_save tags the dict with its TorchScript type: allow that one global.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        out = torch.load(out_path)
    for phase in ("calibrate", "reuse"):
        torch.testing.assert_close(out[f"{phase}.first"], first, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[f"{phase}.latents"], final, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["restored"], first, rtol=1e-5, atol=1e-6)

    report = json.loads(report_path.read_text())
    class_name = type(model).__name__
    assert report["model_class"].startswith("__torch__.diffusers.models.")
    assert report["model_class"].endswith("." + class_name)
    calibrate, reuse = report["calibrate"], report["reuse"]
    assert calibrate["profile"]["status"] == "saved", calibrate["profile"]
    assert reuse["profile"]["status"] == "applied", reuse["profile"]
    # Every weight streamed in the calibration run, and every weight op of the traced graph
    # (Linear as aten::linear, Conv as aten::_convolution) was served by ddo.
    run = calibrate["offload"]["run"]
    assert run["bytes_streamed"] > 0
    assert run["intercepted_ops"] == STEPS * graph_weight_ops(traced), run
    # The profile file carries the TorchScript class as its identity.
    saved = json.loads(Path(calibrate["profile"]["path"]).read_text())
    assert report["model_class"] in json.dumps(saved)


# ---------------------------------------------------------------------------------------------
# ddo.enable_offload on a TorchScript module from Python: the same C++ path as torchscript_flow
# (python/src/jit_bindings.cpp), the same OffloadResult as for an nn.Module.
# ---------------------------------------------------------------------------------------------

WEIGHT_MODULES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Embedding")


def traced_model(kind):
    model, inputs, latents = trace_diffusers.build(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about Python control flow
        traced = trace_diffusers.trace(model, inputs)
    return model, traced, inputs


def jit_class(model) -> str:
    """What C++ names a traced model: "__torch__." + its Python module path + its class."""
    return f"__torch__.{type(model).__module__}.{type(model).__qualname__}"


def weight_modules(traced):
    """(name, module) of every torch.nn Linear/Conv/Embedding in a TorchScript module."""
    return [(n, m) for n, m in traced.named_modules() if m.original_name in WEIGHT_MODULES]


def run(traced, inputs):
    return trace_diffusers.sample_of(traced(**inputs))


@pytest.mark.parametrize("kind", ["flux", "unet"])
@torch.no_grad()
def test_enable_offload_on_a_traced_module(kind):
    model, traced, inputs = traced_model(kind)
    expected = run(traced, inputs)
    before = {k: v.clone() for k, v in traced.state_dict().items()}
    # The eager model under the same settings: the traced one must get the same plan.
    eager = ddo.enable_offload(model, **STREAM_ALL)
    eager_setup = eager.report()["setup"]
    eager.remove()

    offload = ddo.enable_offload(traced, preset="auto", **STREAM_ALL)
    assert isinstance(offload, ddo.OffloadResult)
    assert offload.model_class == jit_class(model)
    assert traced._ddo_offload is offload
    modules = weight_modules(traced)
    assert modules
    for name, module in modules:
        assert ddo._C.is_managed(module.weight), f"{name}.weight is not streamed"
    report = offload.report()
    assert report["model_class"] == jit_class(model)
    setup = report["setup"]
    assert setup["stream_units"] > 0 and setup["bytes"]["streamed"] > 0
    assert setup["stream_units"] == eager_setup["stream_units"]
    assert setup["bytes"]["streamed"] == eager_setup["bytes"]["streamed"]
    assert f"ddo offload of {jit_class(model)}" in offload.summary()

    assert torch.equal(run(traced, inputs), expected)
    assert torch.equal(run(traced, inputs), expected)
    ran = offload.report()["run"]
    assert ran["bytes_streamed"] > 0
    assert ran["intercepted_ops"] == 2 * graph_weight_ops(traced), ran

    offload.remove()
    assert not offload.active
    assert not hasattr(traced, "_ddo_offload")
    for name, module in modules:
        assert not ddo._C.is_managed(module.weight), f"{name}.weight is still managed"
    after = traced.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].device.type == "cpu" and torch.equal(after[key], value), key
    assert torch.equal(run(traced, inputs), expected)
    assert ddo.remove_offload(traced) is False  # nothing attached any more


@torch.no_grad()
def test_named_profile_of_a_traced_module(profile_dir):
    model, traced, inputs = traced_model("flux")
    expected = run(traced, inputs)
    statuses = []
    for calibrate in (True, False):
        offload = ddo.enable_offload(traced, profile_name="ts-flux", build_profile=calibrate,
                                     **STREAM_ALL)
        with offload.profile_run() as report:
            out = run(traced, inputs)
        statuses.append(report["status"])
        assert torch.equal(out, expected)
        assert offload.report()["profile_report"]["status"] == report["status"]
        offload.remove()
    assert statuses == ["saved", "applied"]
    # The identity is the TorchScript type, as in C++: found through the traced module or its
    # class name, and not under the eager class of the same model.
    saved = ddo.load_profile("ts-flux", traced)
    assert saved is not None
    assert saved == ddo.load_profile("ts-flux", jit_class(model))
    assert jit_class(model) in json.dumps(saved)
    assert ddo.load_profile("ts-flux", model) is None


@torch.no_grad()
def test_scripted_and_loaded_module(tmp_path):
    from helpers import TinyNet, tiny_inputs

    net = TinyNet().eval()
    torch.jit.script(net).save(str(tmp_path / "tiny.pt"))
    loaded = torch.jit.load(str(tmp_path / "tiny.pt"))
    ids = tiny_inputs()
    expected = loaded(ids)
    offload = ddo.enable_offload(loaded, **STREAM_ALL)
    assert offload.model_class == "__torch__.helpers.TinyNet"
    kinds = sorted({m.original_name for _, m in weight_modules(loaded)})
    assert kinds == ["Conv2d", "Embedding", "Linear"]
    for name, module in weight_modules(loaded):
        assert ddo._C.is_managed(module.weight), f"{name}.weight is not streamed"
    assert torch.equal(loaded(ids), expected)
    offload.remove()
    assert torch.equal(loaded(ids), expected)


@torch.no_grad()
def test_frozen_module_is_refused():
    _, traced, inputs = traced_model("flux")
    frozen = torch.jit.freeze(traced)
    with pytest.raises(ValueError, match="frozen with torch.jit.freeze"):
        ddo.enable_offload(frozen, **STREAM_ALL)
    assert not hasattr(frozen, "_ddo_offload")


def test_the_jit_binding_takes_only_torchscript_modules():
    with pytest.raises(TypeError, match="expected a TorchScript module.*not Linear"):
        ddo._C.enable_offload_jit(torch.nn.Linear(2, 2), execution_device="sim")


@torch.no_grad()
def test_pipeline_with_a_traced_component(profile_dir):
    flux, traced, flux_inputs = traced_model("flux")
    unet, unet_inputs, _ = trace_diffusers.build("unet")  # an eager component beside it
    expected = run(traced, flux_inputs), run(unet, unet_inputs)

    pipe = types.SimpleNamespace(transformer=traced, unet=unet, scheduler="not a module")
    statuses = []
    for calibrate in (True, False):
        offload = ddo.enable_pipeline_offload(pipe, profile_name="ts-pipe",
                                              build_profile=calibrate, **STREAM_ALL)
        assert offload.routes == {"transformer": "dynamic", "unet": "dynamic"}
        assert offload.profiled_component == "transformer"
        # Both are denoisers: the unet is profiled under a name of its own.
        assert offload.profile_names == {"transformer": "ts-pipe", "unet": "ts-pipe.unet"}
        assert offload["transformer"].model_class == jit_class(flux)
        assert offload["unet"].model_class == "UNet2DConditionModel"
        if calibrate:  # everything streamed; the reuse run keeps what the profile recommends
            for name, module in weight_modules(traced):
                assert ddo._C.is_managed(module.weight), f"transformer {name}.weight"
            assert ddo._C.is_managed(unet.conv_in.weight)
        else:
            assert offload["transformer"].report()["resident_bytes"] > 0
            assert offload["unet"].profile_report["status"] == "applied"
        with offload.profile_run() as report:
            got = run(traced, flux_inputs), run(unet, unet_inputs)
        statuses.append(report["status"])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        offload.remove()
        assert not any(ddo._C.is_managed(m.weight) for _, m in weight_modules(traced))
    assert statuses == ["saved", "applied"]
    assert ddo.load_profile("ts-pipe", traced) is not None
    assert ddo.load_profile("ts-pipe.unet", unet) is not None
