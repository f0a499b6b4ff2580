"""The C++ path of a diffusers model: a tiny FluxTransformer2DModel and UNet2DConditionModel are
traced to TorchScript (examples/python/trace_diffusers.py), tools/examples/torchscript_flow.cpp
loads each with torch::jit::load and runs the staged flow under a named profile on the sim device
(calibrate, then reuse), and its outputs equal the same loop on the eager model in Python.

The program is found beside the ddo package of the build tree (scripts/test.sh builds both); with
an installed package, set DDO_TORCHSCRIPT_FLOW to its path or the test is skipped, saying so."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.jit._pickle

import ddo

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
