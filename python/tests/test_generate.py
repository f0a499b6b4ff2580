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
    # The size and the frames asked for are the ones written and reported.
    assert images.shape[:3] == ((1 if family == "flux" else 5), 32, 32)
    assert (report["frames"], report["height"], report["width"]) == images.shape[:3]
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


# Each refused flag: (the flags after --random DIR --device sim, what the message says). The
# folder-free flags are checked against the tiny random FLUX (multiples of 4) or Wan (multiples
# of 16, 2k + 1 frames) the folder would get.
REFUSED = [
    (["--steps", "0"], "--steps 0: a generation takes at least 1 denoising step"),
    (["--steps", "-3"], "--steps -3: a generation takes at least 1"),
    (["--height", "0"], "--height 0: FLUX takes multiples of 4"),
    (["--height", "-32"], "--height -32: FLUX takes multiples of 4"),
    (["--width", "30"], "--width 30: FLUX takes multiples of 4 (the VAE's 2x times 2x2 packing); "
                        "pass --width 28 or 32"),
    (["--family", "wan", "--height", "40"], "--height 40: Wan takes multiples of 16; pass "
                                            "--height 32 or 48"),
    (["--family", "wan", "--frames", "2"], "--frames 2: Wan takes 2k + 1 frames"),
    (["--family", "wan", "--frames", "0"], "pass --frames 1"),
    (["--family", "wan", "--frames", "6"], "pass --frames 5 or 7"),
    (["--fps", "0"], "--fps 0: frames per second must be positive"),
    (["--vram-cap", "-1"], "--vram-cap -1.0: GiB must be positive"),
    (["--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
    (["--calibrate"], "--calibrate measures and saves a named profile: pass --profile-name"),
    (["--output", "{tmp}/missing/out.png"], "--output {tmp}/missing/out.png: the folder "
                                            "{tmp}/missing does not exist"),
    (["--output", "{tmp}/out.foo"], "--output {tmp}/out.foo: Pillow writes no .foo files"),
    (["--family", "wan", "--output", "{tmp}/out.jpg"], "--output {tmp}/out.jpg: JPEG holds one "
                                                       "image and Wan writes 21 frames"),
    (["--report", "{tmp}"], "--report {tmp}: a folder; pass a file path"),
    (["--report", "{tmp}/missing/r.json"], "--report {tmp}/missing/r.json: the folder"),
    # ddo's options on a route without ddo would be ignored: refused instead.
    (["--no-ddo", "--quantize", "fp8"], "--quantize is a ddo option and --no-ddo runs without "
                                        "ddo; leave --quantize out or use --offload ddo"),
    (["--no-ddo", "--profile-name", "x"], "--profile-name is a ddo option and --no-ddo"),
    (["--no-ddo", "--stream-all"], "--stream-all is a ddo option and --no-ddo"),
    (["--no-ddo", "--host-ram-cap", "4"], "--host-ram-cap is a ddo option and --no-ddo"),
    (["--no-ddo", "--vram-cap", "8"], "--vram-cap caps ddo or the other offloads; --no-ddo keeps "
                                      "everything resident"),
]


def _refused(capsys, argv):
    gen = generate_module()
    with pytest.raises(SystemExit) as e:
        gen.generate(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags,message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_a_bad_flag_is_refused_by_name_before_anything_is_written(tmp_path, capsys, flags,
                                                                  message):
    tmp = str(tmp_path)
    argv = ["--random", f"{tmp}/folder", "--device", "sim", "--size", "tiny",
            "--output", f"{tmp}/out.png"] + [f.format(tmp=tmp) for f in flags]
    err = _refused(capsys, argv)
    assert message.format(tmp=tmp) in err, err
    assert sorted(os.listdir(tmp_path)) == []  # neither the folder nor the output


def _folder(tmp_path, index):
    folder = tmp_path / "pipe"
    folder.mkdir()
    if index is not None:
        (folder / "model_index.json").write_text(index)
    return str(folder)


@pytest.mark.parametrize("source,index,message", [
    ("--random", '{"_class_name": "FluxPipeline"}',
     "--family wan: {folder} holds a FluxPipeline (its model_index.json); leave --family out or "
     "pass --family flux"),
    ("--model", '{"_class_name": "FluxPipeline"}', "--family wan: {folder} holds a FluxPipeline"),
    ("--model", None, "--model {folder}: the folder has no model_index.json"),
    ("--model", '{"_diffusers_version": "0.42.1"}',
     "--model {folder}: its model_index.json names no pipeline"),
    ("--model", "not json", "--model {folder}: its model_index.json names no pipeline"),
    ("--model", '{"_class_name": "StableDiffusionPipeline"}',
     "--model {folder}: a StableDiffusionPipeline; generate.py runs FluxPipeline and "
     "WanPipeline folders"),
])
def test_a_folder_that_is_no_flux_or_wan_pipeline_or_not_the_family_given_is_refused(
        tmp_path, capsys, source, index, message):
    folder = _folder(tmp_path, index)
    before = sorted(os.listdir(folder))
    err = _refused(capsys, [source, folder, "--family", "wan", "--device", "sim",
                            "--output", str(tmp_path / "out.webp")])
    assert message.format(folder=folder) in err, err
    assert sorted(os.listdir(folder)) == before and not (tmp_path / "out.webp").exists()


def test_size_is_refused_with_a_model_folder(tmp_path, capsys):
    # --size sizes the folder --random writes; with --model it would be ignored.
    folder = _folder(tmp_path, '{"_class_name": "FluxPipeline"}')
    err = _refused(capsys, ["--model", folder, "--device", "sim", "--size", "full"])
    assert "--size full sizes the folder --random writes; --model's folder has its own size" in err


def test_a_missing_model_folder_is_refused_by_name(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    err = _refused(capsys, ["--model", missing, "--device", "sim"])
    assert f"--model {missing}: no such folder" in err, err


def test_a_size_off_the_default_is_written_and_reported_as_asked(tmp_path):
    gen = generate_module()
    out = str(tmp_path / "out.png")
    images, report = gen.generate(["--random", str(tmp_path / "flux"), "--size", "tiny",
                                   "--device", "sim", "--height", "36", "--width", "44",
                                   "--steps", "1", "--output", out])
    assert images.shape == (1, 36, 44, 3)
    assert (report["height"], report["width"], report["steps"]) == (36, 44, 1)
    assert Image.open(out).size == (44, 36)
