"""examples/python/generate.py at tiny sizes on the sim device: a whole generation from
a folder it writes itself (random weights, token ids instead of a tokenizer), FLUX and Wan, each
component loaded by ddo's loader, streamed, released; the image and the frames are written, equal
to the same stages run without ddo, and the report gives each stage's figures."""

import importlib.util
import json
import os

import numpy as np
import pytest

pytest.importorskip("diffusers")
from PIL import Image  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate_module():
    path = os.path.join(ROOT, "examples", "python", "generate.py")
    spec = importlib.util.spec_from_file_location("ddo_generate_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family,output", [("flux", "out.png"), ("wan", "out.webp")])
def test_a_tiny_generation_streams_every_stage_and_equals_the_resident_run(tmp_path, family,
                                                                          output):
    gen = generate_module()
    folder = str(tmp_path / f"{family}-tiny")
    common = ["--family", family, "--random", folder, "--size", "tiny", "--device", "sim",
              "--frames", "5", "--seed", "3"]
    reference, _ = gen.generate(common + ["--no-ddo"])
    out = str(tmp_path / output)
    images, report = gen.generate(common + ["--stream-all", "--output", out,
                                            "--report", str(tmp_path / "report.json"),
                                            "--profile-name", f"{family}-test", "--calibrate"])
    assert images.dtype == np.uint8 and images.shape == reference.shape
    assert images.shape[0] == (1 if family == "flux" else 3)
    # The same stages, the same kernels on the same CPU: the decoded pixels agree.
    assert np.abs(images.astype(int) - reference.astype(int)).max() <= 1
    assert report["ddo"] and report["family"] == family
    for stage in ("encode", "denoise", "decode"):
        entry = report["stages"][stage]
        assert entry["read_bytes"] > 0, (stage, entry)  # from the folder, by ddo's loader
        assert entry["streamed_bytes"] > 0, (stage, entry)
        assert entry["seconds"] > 0 and entry["peak_rss_gb"] > 0
    assert report["profile"]["status"] == "saved", report["profile"]
    # ddo's generation report (GenerationMeter) agrees with the stages' own figures.
    g = report["generation"]
    assert [s["name"] for s in g["stages"]] == ["encode", "denoise", "decode"]
    assert g["bytes_streamed"] == sum(e["streamed_bytes"] for e in report["stages"].values())
    assert g["components"]["transformer"]["bytes_streamed"] == (
        report["stages"]["denoise"]["streamed_bytes"])
    assert g["device"] == "sim:0" and g["peak_vram_bytes"] > 0 and g["peak_rss_bytes"] > 0
    assert g["file_bytes_read"] >= sum(e["read_bytes"] for e in report["stages"].values())
    assert json.load(open(tmp_path / "report.json"))["stages"].keys() == report["stages"].keys()
    written = Image.open(out)
    assert written.size == (images.shape[2], images.shape[1])
    assert getattr(written, "n_frames", 1) == images.shape[0]
    # The profile is reused under its name by the next generation.
    _, again = gen.generate(common + ["--stream-all", "--profile-name", f"{family}-test"])
    assert again["profile"]["status"] == "applied", again["profile"]


def test_a_host_ram_cap_reads_the_denoiser_from_disk_with_the_same_image(tmp_path):
    gen = generate_module()
    common = ["--family", "flux", "--random", str(tmp_path / "flux"), "--size", "tiny",
              "--device", "sim", "--seed", "1"]
    reference, _ = gen.generate(common + ["--no-ddo"])
    images, report = gen.generate(common + ["--stream-all", "--host-ram-cap", "0.0003"])
    assert report["stages"]["denoise"]["disk_bytes_read"] > 0, report["stages"]
    assert report["generation"]["components"]["transformer"]["disk_bytes_read"] == (
        report["stages"]["denoise"]["disk_bytes_read"])
    assert np.abs(images.astype(int) - reference.astype(int)).max() <= 1


def test_video_profiles_are_calibrated_and_reused_under_their_own_names(tmp_path):
    # The video profile names of docs/design/0007-named-profiles.md, on Wan: "video-5s" (21 frames) and "video-8s" (33 frames), each
    # calibrated once and reused by its next generation within the card it was made for.
    gen = generate_module()
    common = ["--family", "wan", "--random", str(tmp_path / "wan"), "--size", "tiny",
              "--device", "sim", "--stream-all", "--vram-cap", "0.01"]
    for name, frames in (("video-5s", "21"), ("video-8s", "33")):
        _, saved = gen.generate(common + ["--frames", frames, "--profile-name", name,
                                          "--calibrate"])
        assert saved["profile"]["status"] == "saved", saved["profile"]
        _, reused = gen.generate(common + ["--frames", frames, "--profile-name", name])
        profile = reused["profile"]
        assert profile["status"] == "applied" and profile["name"] == name, profile
        assert 0 < profile["run_peak_vram_gb"] <= 0.01, profile


def test_the_other_offload_routes_say_they_need_a_gpu(tmp_path, capsys):
    gen = generate_module()
    with pytest.raises(SystemExit):
        gen.parse(["--random", str(tmp_path / "f"), "--device", "sim",
                   "--offload", "diffusers-group-leaf"])
    assert "runs on a GPU only (--device cuda)" in capsys.readouterr().err
    args = gen.parse(["--random", str(tmp_path / "f"), "--device", "sim", "--no-ddo"])
    assert args.offload == "resident" and args.no_ddo
