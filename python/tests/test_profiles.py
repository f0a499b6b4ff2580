"""Named workload profiles through the exact code shape of docs/design/0007-named-profiles.md,
on the sim device: calibrate -> save -> reuse, untouched on exceptions, names independent, manual
budget and max cap, the environment variables, and the same files as the C++ store."""

import json
import os
import shutil
import subprocess

import pytest
import torch

import ddo
from ddo import _C, enable_offload
from helpers import TinyNet, tiny_inputs


def make_workload():
    model = TinyNet().eval()
    ids = tiny_inputs()

    @torch.no_grad()
    def pipeline(**inputs):
        return model(inputs["ids"])

    return model, pipeline, {"ids": ids}


def seed_run(model, pipeline, inputs, calibrate, name="my-workload", **overrides):
    # The code of docs/design/0007-named-profiles.md, section 1, with the simulation device.
    offload = enable_offload(
        model, preset="auto", profile_name=name, build_profile=calibrate,
        execution_device="sim", **overrides,
    )
    with offload.profile_run() as profile_report:
        output = pipeline(**inputs)
    offload.remove()
    return output, profile_report


def profile_file(model, name="my-workload"):
    return ddo.profile_path(name, model)


def test_calibrate_save_reuse(profile_dir):
    model, pipeline, inputs = make_workload()
    expected = pipeline(**inputs)

    out, report = seed_run(model, pipeline, inputs, calibrate=True)
    assert torch.equal(out, expected)
    assert report["status"] == "saved", report
    assert report["name"] == "my-workload"
    assert report["profile_measurement_kind"] == "baseline"
    for key in ("resident_budget_gb", "peak_vram_gb", "total_vram_gb", "headroom_gb", "path"):
        assert key in report, key
    json.dumps(report)
    path = profile_file(model)
    assert report["path"] == path
    assert os.path.dirname(path) == str(profile_dir)
    record = ddo.load_profile("my-workload", model)
    # diffusers-dynamic-offloader's file: its identity is the "context", its budget key its own.
    assert record["context"]["name"] == "my-workload"
    assert record["context"]["model_class"] == "TinyNet"  # the class qualified name
    assert record["context"]["execution_mode"] == "linear_runtime"
    saved_budget = record["recommendation"]["profile_resident_module_budget_gb"]
    assert saved_budget == pytest.approx(report["resident_budget_gb"])

    # Normal run: the recommendation is applied at setup; the region is a no-op.
    before = open(path, "rb").read()
    out, report = seed_run(model, pipeline, inputs, calibrate=False)
    assert torch.equal(out, expected)
    assert report["status"] == "applied", report
    assert report["resident_budget_gb"] == pytest.approx(saved_budget)
    assert open(path, "rb").read() == before


def test_exception_inside_profile_run_leaves_the_profile_untouched():
    model, pipeline, inputs = make_workload()
    seed_run(model, pipeline, inputs, calibrate=True)
    path = profile_file(model)
    before = open(path, "rb").read()

    offload = enable_offload(model, preset="auto", profile_name="my-workload",
                             build_profile=True, execution_device="sim")
    with pytest.raises(ZeroDivisionError):
        with offload.profile_run() as report:
            pipeline(**inputs)
            1 / 0
    assert report["status"] != "saved"
    assert open(path, "rb").read() == before
    offload.remove()

    # And without a previous file, nothing is created.
    other, pipeline2, inputs2 = make_workload()
    offload = enable_offload(other, preset="auto", profile_name="never-saved",
                             build_profile=True, execution_device="sim")
    with pytest.raises(RuntimeError, match="boom"):
        with offload.profile_run():
            raise RuntimeError("boom")
    offload.remove()
    assert not os.path.exists(profile_file(other, "never-saved"))


def test_different_names_are_independent():
    model, pipeline, inputs = make_workload()
    seed_run(model, pipeline, inputs, calibrate=True, name="video-5s")
    a = open(profile_file(model, "video-5s"), "rb").read()
    _, report = seed_run(model, pipeline, inputs, calibrate=False, name="video-8s")
    assert report["status"] == "missing"
    seed_run(model, pipeline, inputs, calibrate=True, name="video-8s")
    assert profile_file(model, "video-5s") != profile_file(model, "video-8s")
    assert open(profile_file(model, "video-5s"), "rb").read() == a
    names = sorted(p["name"] for p in ddo.list_profiles())
    assert names == ["video-5s", "video-8s"]


def test_no_name_disables_profile_lookup():
    model, pipeline, inputs = make_workload()
    offload = enable_offload(model, preset="auto", execution_device="sim")
    with offload.profile_run() as report:
        pipeline(**inputs)
    assert report["status"] == "disabled"
    offload.remove()
    with pytest.raises(ValueError, match="name"):
        enable_offload(model, preset="auto", build_profile=True, execution_device="sim")


def test_manual_budget_wins_over_the_profile():
    # diffusers-dynamic-offloader reports {"name", "status": "disabled"} and does not load the profile;
    # ddo says the same and keeps its fields that say why.
    model, pipeline, inputs = make_workload()
    seed_run(model, pipeline, inputs, calibrate=True)
    _, report = seed_run(model, pipeline, inputs, calibrate=False, resident_module_budget_gb=0.25)
    assert report["status"] == "disabled"
    assert report["resident_budget_gb"] == pytest.approx(0.25)
    assert report.get("budget_source") == "manual"
    assert "recommended_budget_gb" not in report
    assert any("overrides profile reuse" in note for note in report["notes"])


def test_max_cap_caps_the_recommendation():
    model, pipeline, inputs = make_workload()
    seed_run(model, pipeline, inputs, calibrate=True)
    saved = ddo.load_profile("my-workload", model)["recommendation"][
        "profile_resident_module_budget_gb"
    ]
    assert saved > 0.5
    _, report = seed_run(model, pipeline, inputs, calibrate=False,
                         max_resident_module_budget_gb=0.5)
    assert report["status"] == "applied"
    assert report["resident_budget_gb"] == pytest.approx(0.5)


def test_profile_dir_env_is_honoured(monkeypatch, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("DDO_PROFILE_DIR", str(elsewhere))
    model, pipeline, inputs = make_workload()
    _, report = seed_run(model, pipeline, inputs, calibrate=True)
    assert os.path.dirname(report["path"]) == str(elsewhere)
    files = os.listdir(elsewhere)
    key = ddo.profile_key("my-workload", model)
    assert f"{key}.json" in files and key.startswith("ddo-capacity-v1-")


def test_headroom_env_is_honoured(monkeypatch):
    model, pipeline, inputs = make_workload()
    monkeypatch.setenv("DDO_PROFILE_VRAM_HEADROOM_GB", "2.5")
    _, report = seed_run(model, pipeline, inputs, calibrate=True)
    assert report["headroom_gb"] == pytest.approx(2.5)
    expected = max(0.0, report["total_vram_gb"] - report["peak_vram_gb"] - 2.5)
    assert report["resident_budget_gb"] == pytest.approx(expected, abs=1e-6)
    monkeypatch.setenv("DDO_PROFILE_VRAM_HEADROOM_GB", "-1")
    with pytest.raises(ValueError, match="(?i)headroom"):
        seed_run(model, pipeline, inputs, calibrate=True)


def test_nested_regions_are_refused():
    model, pipeline, inputs = make_workload()
    offload = enable_offload(model, preset="auto", profile_name="nested",
                             build_profile=True, execution_device="sim")
    with offload.profile_run():
        with pytest.raises(RuntimeError):
            with offload.profile_run():
                pass
    offload.remove()


def test_calibration_on_a_device_that_cannot_measure_is_refused():
    model, _, _ = make_workload()
    with pytest.raises((RuntimeError, ValueError), match="cpu|plan"):
        enable_offload(model, preset="auto", profile_name="x", build_profile=True,
                       execution_device="cpu", execution_mode="plan")


def test_python_profile_is_visible_to_the_cpp_store(profile_dir):
    model, pipeline, inputs = make_workload()
    _, report = seed_run(model, pipeline, inputs, calibrate=True, name="shared-with-cli")
    key = ddo.profile_key("shared-with-cli", model)
    # The C++ store (the same code `ddo profiles list` runs) sees it under the same file name.
    store = _C.ProfileStore(str(profile_dir))
    listing = store.list()
    assert [(p["name"], p["model_class"], p["profile_key"]) for p in listing] == [
        ("shared-with-cli", "TinyNet", key)
    ]
    assert not listing[0].get("problem")
    assert os.path.basename(report["path"]) == f"{key}.json"
    assert store.load_by_key(key)["context"]["name"] == "shared-with-cli"
    cli = os.environ.get("DDO_CLI") or shutil.which("ddo")
    if cli:
        out = subprocess.run([cli, "profiles", "list"], capture_output=True, text=True,
                             env={**os.environ, "DDO_PROFILE_DIR": str(profile_dir)})
        assert out.returncode == 0, out.stderr
        assert "shared-with-cli" in out.stdout


def test_a_preset_budget_that_disables_the_named_profile_warns(profile_dir, monkeypatch):
    # Note [Preset budgets and named profiles]: the preset's fixed budget still wins (as in
    # diffusers-dynamic-offloader), but the user who named a profile hears why it is not used.
    for preset, env in (("warm_process", None), (None, "low_ram_safe")):
        if env:
            monkeypatch.setenv("DDO_PRESET", env)
        model = TinyNet().eval()
        with pytest.warns(UserWarning, match=r"profile 'named' is not used: preset "
                                             r"(warm_process|low_ram_safe) sets a fixed resident "
                                             r"budget of \d+ GiB.*resident_module_budget_gb=0"):
            offload = enable_offload(model, preset=preset, profile_name="named",
                                     execution_device="sim")
        report = offload.profile_report
        assert report["status"] == "disabled"
        assert any("is not used" in n for n in report["notes"]), report
        offload.remove()
    # A budget the user set is the user's choice: no warning.
    import warnings as _warnings

    with _warnings.catch_warnings():
        _warnings.simplefilter("error")
        offload = enable_offload(TinyNet().eval(), preset="warm_process", profile_name="named",
                                 execution_device="sim", resident_module_budget_gb=2.0)
    assert offload.profile_report["status"] == "disabled"
    offload.remove()


class Tokens(torch.nn.Module):
    """Activations that grow with the sequence, as a video's grow with its frames."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(6))

    def forward(self, x):
        outs = []
        for layer in self.layers:
            x = torch.tanh(layer(x))
            outs.append(x)  # kept alive: the peak grows with the length
        return torch.stack(outs).sum(0)


def tokens_run(name, length, calibrate, **config):
    torch.manual_seed(0)
    model = Tokens().eval()
    offload = enable_offload(model, preset="auto", profile_name=name, build_profile=calibrate,
                             execution_device="sim", small_tensor_threshold_bytes=0,
                             profile_vram_headroom_gb=0.0, show_profile=False, **config)
    try:
        with torch.no_grad(), offload.profile_run() as report:
            model(torch.randn(length, 256))
    finally:
        offload.remove()
    return report


CAP_GB = 3.5 / 1024  # 3.5 MiB: the weights (1.5 MiB) and a short sequence's activations


@pytest.mark.parametrize("name,length", [("video-5s", 48), ("video-8s", 80)])
def test_each_video_profile_is_reused_under_its_cap(profile_dir, name, length):
    saved = tokens_run(name, length, True, vram_cap_gb=CAP_GB)
    assert saved["status"] == "saved", saved
    reused = tokens_run(name, length, False, vram_cap_gb=CAP_GB)
    assert reused["status"] == "applied", reused
    assert 0 < reused["run_peak_vram_gb"] <= CAP_GB, reused


def test_an_image_profile_reused_for_a_longer_video_fails_saying_to_calibrate(profile_dir):
    # Note [A reused profile is checked]: video capacity is never inferred from an image profile.
    # Calibrated on a short sequence, the saved budget holds the image; the long one
    # peaks above the (emulated) card, and the run fails naming the profile and what to do.
    assert tokens_run("image", 16, True, vram_cap_gb=CAP_GB)["status"] == "saved"
    before = open(ddo.profile_path("image", Tokens())).read()
    assert tokens_run("image", 16, False, vram_cap_gb=CAP_GB)["status"] == "applied"
    # The sim device, like a CUDA device under vram_cap_gb, runs out of memory at the cap inside
    # the region: the error raised in its place gives the advice, chained to the device's. (A
    # peak above the card measured without running out, memory outside the allocator, fails the
    # region's end the same way: CalibrationTest.AReusedProfileThatOutgrewItsCardFails.)
    with pytest.raises(torch.OutOfMemoryError,
                       match=r"profile 'image' was measured on a smaller workload.*Calibrate this "
                             r"workload under its own name") as err:
        tokens_run("image", 2048, False, vram_cap_gb=CAP_GB)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert open(ddo.profile_path("image", Tokens())).read() == before  # nothing saved


def test_a_reuse_region_inside_another_models_calibration_is_not_checked(profile_dir):
    # The check resets the device's peak counters; inside a region that saves (another model's
    # calibration on the same device) it stands aside so that measurement stays whole.
    assert tokens_run("inner", 16, True, vram_cap_gb=CAP_GB)["status"] == "saved"
    outer_model, outer_pipeline, outer_inputs = make_workload()
    outer = enable_offload(outer_model, preset="auto", profile_name="outer", build_profile=True,
                           execution_device="sim", show_profile=False)
    with outer.profile_run() as outer_report:
        outer_pipeline(**outer_inputs)
        inner = tokens_run("inner", 16, False, vram_cap_gb=CAP_GB)
    outer.remove()
    assert inner["status"] == "applied" and "run_peak_vram_gb" not in inner, inner
    assert outer_report["status"] == "saved", outer_report
