"""ddo's loader: diffusers and transformers
components written by their own save_pretrained (one file and sharded), read by ddo straight into
place on the sim device, and compared with the libraries' own from_pretrained; bad directories and
files give errors that name the file and tensor and leave nothing attached; a load's peak RSS stays
near one copy."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ddo
from conftest import STREAM_ALL
from helpers import RSS_PREAMBLE, tiny_flux_inputs

diffusers = pytest.importorskip("diffusers")
# An explicit config starts from the built-in defaults (plan mode): ask for the runtime.
STREAM = dict(STREAM_ALL, execution_mode="linear_runtime")
transformers = pytest.importorskip("transformers")


def tiny_flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()


def flux_inputs(dtype=torch.float32):
    return tiny_flux_inputs(2, dtype)


@pytest.fixture(scope="module")
def flux_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux")
    model = tiny_flux()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="30KB")
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    return root


def assert_same_output(actual, expected):
    # The parameters are bit-equal (assert_same_state); outputs may differ in the last bit:
    # the library's tensors view its mmap'ed file at unaligned offsets, and CPU matmul kernels
    # take other paths for unaligned data.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("layout", ["single", "sharded"])
@torch.no_grad()
def test_diffusers_load_equals_from_pretrained(flux_dirs, layout):
    path = flux_dirs / layout
    library = diffusers.FluxTransformer2DModel.from_pretrained(path).eval()
    expected = library(**flux_inputs()).sample
    events = []
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=STREAM, record_event=lambda *e: events.append(e),
    )
    assert_same_output(loaded.module(**flux_inputs()).sample, expected)
    report = loaded.report()
    assert report["executing"] and report["setup"]["bytes"]["streamed"] > 0
    load = report["setup"]["load"]
    total = sum(t.numel() * t.element_size() for t in library.state_dict().values())
    assert load["bytes"] == total
    assert load["path"] == str(path)
    assert [e[0] for e in events].count("load") == 1
    loaded.offload.remove()
    assert_same_state(loaded.module, library)


@torch.no_grad()
def test_without_model_loader_the_class_comes_from_config_json(flux_dirs):
    # As in diffusers-dynamic-offloader: model_loader defaults to diffusers.AutoModel, which
    # config.json's _class_name resolves, and ddo's own loader reads the files.
    path = flux_dirs / "sharded"
    library = diffusers.FluxTransformer2DModel.from_pretrained(path).eval()
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, apply_dynamic=True, dynamic_offload_config=STREAM)
    assert type(loaded.module) is diffusers.FluxTransformer2DModel
    assert loaded.report()["setup"]["load"]["path"] == str(path)
    assert_same_output(loaded.module(**flux_inputs()).sample, library(**flux_inputs()).sample)
    loaded.offload.remove()
    assert_same_state(loaded.module, library)


def test_a_config_naming_an_unknown_class_says_to_pass_model_loader(flux_dirs, tmp_path):
    target = tmp_path / "odd"
    shutil.copytree(flux_dirs / "single", target)
    config = json.loads((target / "config.json").read_text())
    config["_class_name"] = "NoSuchModel"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="NoSuchModel.*model_loader="):
        ddo.from_pretrained_with_dynamic_offload(target)


@torch.no_grad()
def test_deferred_load_then_enable_offload(flux_dirs):
    library = diffusers.FluxTransformer2DModel.from_pretrained(flux_dirs / "sharded").eval()
    expected = library(**flux_inputs()).sample
    loaded = ddo.from_pretrained_with_dynamic_offload(
        flux_dirs / "sharded", model_loader=diffusers.FluxTransformer2DModel
    )
    assert loaded.offload is None
    assert not any(ddo._C.is_placeholder(p) for p in loaded.module.parameters())
    assert_same_state(loaded.module, library)
    offload = ddo.enable_offload(loaded.module, **STREAM_ALL)
    assert_same_output(loaded.module(**flux_inputs()).sample, expected)
    offload.remove()


DEVICES = ["sim", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU: the CUDA case of the resident upload"))]


def held_params(module):
    # References to every parameter's memory as it is now. Holding them keeps that memory alive,
    # so a later parameter at the same address is that memory, not a freed block the allocator
    # handed out again (on CUDA the attach frees host copies of tensors it moves to the device, and
    # remove() may get the same address back for their new copies).
    return {name: p.detach() for name, p in module.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_deferred_load_pins_and_the_attach_streams_from_the_pins(flux_dirs, device):
    # Note [Loader pins]: apply_dynamic=False reads into pinned slabs for the device the settings
    # name; enable_offload streams those weights where they lie (no new slab, no copy), and
    # remove() gives the loader's tensors back, so a second attach adopts them again.
    library = diffusers.FluxTransformer2DModel.from_pretrained(flux_dirs / "sharded").eval()
    inputs = flux_inputs()
    expected = library(**inputs).sample
    config = dict(STREAM, execution_device=device, pin_cpu_memory=True)
    loaded = ddo.from_pretrained_with_dynamic_offload(
        flux_dirs / "sharded", model_loader=diffusers.FluxTransformer2DModel,
        dynamic_offload_config=config,
    )
    total = sum(t.numel() * t.element_size() for t in library.state_dict().values())
    pins = loaded.load_report
    assert pins["pinned"] is True, pins
    # Pinned: every weight the attach's plan streams and pins (here all streamed ones); the rest
    # (tensors it moves to the device once) are ordinary CPU tensors.
    assert total > pins["pinned_bytes"] >= pins["plan"]["streamed_bytes"] > 0, (pins, total)
    assert pins["pageable_bytes"] == 0, pins
    assert pins["device"] == device + ":0", pins
    assert_same_state(loaded.module, library)
    before = held_params(loaded.module)
    if device == "cuda":
        assert any(p.is_pinned() for p in loaded.module.parameters())
    for attach in range(2):
        offload = ddo.enable_offload(loaded.module, config=config)
        setup = offload.report()["setup"]
        streamed = setup["bytes"]["streamed"]
        assert streamed > 0
        # Every streamed weight of this model is a one-tensor unit: all adopted, nothing pinned
        # or copied anew.
        assert setup["loader_pins"]["adopted_bytes"] == streamed, setup
        assert setup["loader_pins"]["adopted_units"] == setup["stream_units"], setup
        assert setup["pinned_bytes"] == 0 and setup["pageable_bytes"] == 0, setup
        on = {k: v.to(device) for k, v in inputs.items()} if device == "cuda" else inputs
        assert_same_output(loaded.module(**on).sample.cpu(), expected)
        assert offload.report()["run"]["bytes_streamed"] >= streamed
        offload.remove()
        # Each adopted weight is the loader's tensor again (the same memory), so the next attach
        # adopts it once more; every value is the library's.
        after = dict(loaded.module.named_parameters())
        same = sum(after[name].data_ptr() == t.data_ptr() for name, t in before.items())
        assert same == setup["loader_pins"]["adopted_units"], f"attach {attach}"
        assert_same_state(loaded.module, library)


@torch.no_grad()
def test_deferred_load_pins_what_the_attach_would_pin(flux_dirs):
    # The planner's RAM admission bounds the loader's pins as it bounds the attach's: with RAM
    # for about half the weights, about half are pinned, the attach streams those where they lie
    # and gives the others slabs of its own, and the outputs are the library's.
    library = diffusers.FluxTransformer2DModel.from_pretrained(flux_dirs / "single").eval()
    total = sum(t.numel() * t.element_size() for t in library.state_dict().values())
    config = dict(STREAM, execution_device="sim", pin_cpu_memory=True,
                  available_system_ram_gb=total * 0.5 / (1 << 30), system_ram_headroom_gb=0.0)
    loaded = ddo.from_pretrained_with_dynamic_offload(
        flux_dirs / "single", model_loader=diffusers.FluxTransformer2DModel,
        dynamic_offload_config=config,
    )
    pins = loaded.load_report
    assert 0 < pins["pinned_bytes"] < pins["plan"]["streamed_bytes"], pins
    assert pins["plan"]["pinned_bytes"] <= pins["plan"]["pin_budget_bytes"], pins
    offload = ddo.enable_offload(loaded.module, config=config)
    setup = offload.report()["setup"]
    adopted = setup["loader_pins"]["adopted_bytes"]
    assert 0 < adopted < setup["bytes"]["streamed"], setup
    assert adopted <= pins["pinned_bytes"]
    assert_same_output(loaded.module(**flux_inputs()).sample, library(**flux_inputs()).sample)
    offload.remove()
    assert_same_state(loaded.module, library)


def test_deferred_load_for_plan_mode_is_ordinary_memory(flux_dirs):
    # Plan mode executes nothing: nothing to pin for, and the report says so.
    loaded = ddo.from_pretrained_with_dynamic_offload(
        flux_dirs / "single", model_loader=diffusers.FluxTransformer2DModel,
        dynamic_offload_config=dict(STREAM, execution_mode="plan"),
    )
    assert loaded.load_report["pinned"] is False
    assert "plan mode" in loaded.load_report["reason"], loaded.load_report
    assert not any(ddo._C.is_placeholder(p) for p in loaded.module.parameters())
    # Pinning turned off in the settings: the same, with that reason.
    loaded = ddo.from_pretrained_with_dynamic_offload(
        flux_dirs / "single", model_loader=diffusers.FluxTransformer2DModel,
        dynamic_offload_config=dict(STREAM, pin_cpu_memory=False),
    )
    assert loaded.load_report["pinned"] is False
    assert "pin_cpu_memory" in loaded.load_report["reason"], loaded.load_report


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_residents_go_from_the_file_through_bounce_buffers(flux_dirs, device):
    """Residents and move-once tensors the loader reads go file -> pinned bounce buffer ->
    device (Note [Host uploads]): every byte of them, with the library's outputs."""
    path = flux_dirs / "sharded"
    library = diffusers.FluxTransformer2DModel.from_pretrained(path).eval()
    expected = library(**flux_inputs()).sample
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=dict(STREAM, execution_device=device,
                                    resident_module_budget_gb=1.0,
                                    small_tensor_threshold_bytes=1 << 20),
    )
    setup = loaded.report()["setup"]
    placed = setup["bytes"]["resident"] + setup["bytes"]["move_once"]
    assert placed > 0, setup
    assert setup["load"]["bounced_bytes"] == placed, setup
    inputs = {k: v.to(device) if device == "cuda" else v for k, v in flux_inputs().items()}
    out = loaded.module(**inputs).sample.cpu()
    if device == "cuda":  # GPU kernels against the CPU reference
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    else:
        assert_same_output(out, expected)
    loaded.offload.remove()
    assert_same_state(loaded.module, library)


@torch.no_grad()
def test_dtype_converts_like_the_library(flux_dirs):
    library = diffusers.FluxTransformer2DModel.from_pretrained(
        flux_dirs / "single", torch_dtype=torch.bfloat16
    ).eval()
    loaded = ddo.from_pretrained_with_dynamic_offload(
        flux_dirs / "single", model_loader=diffusers.FluxTransformer2DModel,
        dtype=torch.bfloat16, apply_dynamic=True, dynamic_offload_config=STREAM,
    )
    out = loaded.module(**flux_inputs(torch.bfloat16)).sample
    torch.testing.assert_close(out, library(**flux_inputs(torch.bfloat16)).sample)
    loaded.offload.remove()
    assert_same_state(loaded.module, library)


@torch.no_grad()
def test_transformers_sharded_text_encoder_with_tied_weights(tmp_path):
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    transformers.T5EncoderModel(config).save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    library = transformers.T5EncoderModel.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (1, 7))
    expected = library(input_ids=ids).last_hidden_state
    loaded = ddo.from_pretrained_with_dynamic_offload(
        tmp_path, model_loader=transformers.T5EncoderModel, apply_dynamic=True,
        dynamic_offload_config=STREAM,
    )
    assert_same_output(loaded.module(input_ids=ids).last_hidden_state, expected)
    loaded.offload.remove()
    # Tied in the module, stored once in the files: still one Parameter after the load.
    assert loaded.module.shared.weight is loaded.module.encoder.embed_tokens.weight
    assert_same_state(loaded.module, library)


def test_library_loader_is_still_available(flux_dirs):
    loaded = ddo.from_pretrained_with_dynamic_offload(
        flux_dirs / "single", model_loader=diffusers.FluxTransformer2DModel, loader="library",
        apply_dynamic=True, dynamic_offload_config=STREAM,
    )
    assert "load" not in loaded.report()["setup"]
    loaded.offload.remove()


# --- bad input ---------------------------------------------------------------------------------


def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def load(path, **kw):
    return ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=STREAM, loader="ddo", **kw,
    )


def test_missing_shard_names_it(flux_dirs, tmp_path):
    d = copy_dir(flux_dirs / "sharded", tmp_path / "d")
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(Exception, match=shard.name):
        load(d)


def test_truncated_file_names_file_and_tensor(flux_dirs, tmp_path):
    d = copy_dir(flux_dirs / "single", tmp_path / "d")
    f = next(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f.name):
        load(d)


def test_index_naming_a_tensor_no_shard_holds(flux_dirs, tmp_path):
    d = copy_dir(flux_dirs / "sharded", tmp_path / "d")
    index = next(d.glob("*.index.json"))
    doc = json.loads(index.read_text())
    shard = next(iter(doc["weight_map"].values()))
    doc["weight_map"]["ghost.weight"] = shard
    index.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="ghost.weight"):
        load(d)


def test_lying_header_is_an_error_not_a_crash(flux_dirs, tmp_path):
    d = copy_dir(flux_dirs / "single", tmp_path / "d")
    f = next(d.glob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 2  # wrong size for its shape
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    with pytest.raises(ValueError, match=name):
        load(d)


def test_wrong_model_class_lists_missing_and_leaves_placeholders(flux_dirs, tmp_path):
    # A config for a bigger model than the weights: the module has tensors the files lack.
    d = copy_dir(flux_dirs / "single", tmp_path / "d")
    config = json.loads((d / "config.json").read_text())
    config["num_single_layers"] = 2
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"single_transformer_blocks\.1\."):
        load(d)


def test_unexpected_keys_are_an_error_unless_allowed(flux_dirs, tmp_path):
    d = copy_dir(flux_dirs / "single", tmp_path / "d")
    config = json.loads((d / "config.json").read_text())
    config["num_single_layers"] = 0
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="allow_unexpected_keys"):
        load(d)
    loaded = load(d, allow_unexpected_keys=True)
    loaded.offload.remove()


def test_unreadable_or_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        load(tmp_path)
    with pytest.raises(ValueError, match="loader must be one of"):
        ddo.from_pretrained_with_dynamic_offload(
            tmp_path, model_loader=diffusers.FluxTransformer2DModel, loader="fast"
        )
    with pytest.raises(Exception, match="missing-dir"):
        ddo._C.load_weights_for_offload("M", [], {"path": str(tmp_path / "missing-dir")})


def test_shape_mismatch_names_both_shapes(flux_dirs, tmp_path):
    d = copy_dir(flux_dirs / "single", tmp_path / "d")
    config = json.loads((d / "config.json").read_text())
    config["joint_attention_dim"] = 48
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"context_embedder\.weight' is \[32, 32\]"):
        load(d)


# --- memory ------------------------------------------------------------------------------------

_RSS_CHILD = RSS_PREAMBLE + textwrap.dedent(
    """
    path, how = sys.argv[1], sys.argv[2]
    if how == "ddo":
        loaded = ddo.from_pretrained_with_dynamic_offload(
            path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
            dynamic_offload_config=dict(execution_device="sim", execution_mode="linear_runtime", sim_device_capacity_gb=8.0,
                                        auto_budget_policy="off", resident_module_budget_gb=0.0,
                                        always_resident_modules_pattern=[]))
    else:
        m = diffusers.FluxTransformer2DModel.from_pretrained(path)
        o = ddo.enable_offload(m, execution_device="sim", execution_mode="linear_runtime", sim_device_capacity_gb=8.0,
                               auto_budget_policy="off", resident_module_budget_gb=0.0,
                               always_resident_modules_pattern=[])
    peak = (status_kb("VmHWM") - before) * 1024
    # The sim device's memory (staging ring, residents, move-once) is host memory too.
    setup = (loaded.report() if how == "ddo" else o.report())["setup"]
    device = setup["staging_bytes"] + setup["bytes"]["resident"] + setup["bytes"]["move_once"]
    print(peak, device)
    """
)


def test_peak_rss_of_a_load_stays_near_one_copy(tmp_path):
    # ~200 MB of weights: large enough that the allocator's noise is small against it.
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
        num_attention_heads=4, joint_attention_dim=512, pooled_projection_dim=512,
        axes_dims_rope=[16, 56, 56],
    )
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(tmp_path, max_shard_size="50MB")
    del model
    peaks, device = {}, {}
    for how in ("ddo", "library"):
        out = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, str(tmp_path), how], capture_output=True,
            text=True, env=dict(os.environ), check=True,
        )
        peaks[how], device[how] = map(int, out.stdout.strip().splitlines()[-1].split())
    assert model_bytes > 120e6
    # One copy (the slabs) plus working memory; the library's load + enable_offload holds two.
    print(f"peak RSS growth: ddo {peaks['ddo'] / 1e6:.0f} MB, library + enable_offload "
          f"{peaks['library'] / 1e6:.0f} MB; weights {model_bytes / 1e6:.0f} MB, sim device "
          f"memory {device['ddo'] / 1e6:.0f} MB")
    # One copy (the slabs), the sim device's memory (host memory here, touched as it is used)
    # and the interpreter's working memory; the library's load + enable_offload holds two.
    assert peaks["ddo"] <= model_bytes * 1.1 + device["ddo"] + (64 << 20), (peaks, device)
    assert peaks["ddo"] < peaks["library"], (peaks, device)


@torch.no_grad()
def test_loader_lifecycle_calibrates_then_reuses_a_named_profile(flux_dirs, profile_dir):
    # The loader takes the named-profile options with apply_dynamic=True: the first load
    # calibrates under loaded.profile_run(), the second applies the saved profile.
    path = flux_dirs / "sharded"
    expected = diffusers.FluxTransformer2DModel.from_pretrained(path).eval()(**flux_inputs()).sample
    reports = []
    for calibrate in (True, False):
        loaded = ddo.from_pretrained_with_dynamic_offload(
            path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
            profile_name="loaded-flux", build_profile=calibrate,
            dynamic_offload_config=dict(STREAM, resident_module_budget_gb=0.0),
        )
        with loaded.profile_run() as report:
            out = loaded.module(**flux_inputs()).sample
        assert_same_output(out, expected)
        reports.append(dict(report))
        loaded.offload.remove()
    assert reports[0]["status"] == "saved", reports[0]
    assert reports[1]["status"] == "applied", reports[1]
    assert reports[1]["path"] == reports[0]["path"]


def test_deferred_load_refuses_profile_options(flux_dirs):
    for options in (dict(profile_name="staged"), dict(build_profile=True)):
        with pytest.raises(ValueError, match="later enable_offload call"):
            ddo.from_pretrained_with_dynamic_offload(
                flux_dirs / "single", model_loader=diffusers.FluxTransformer2DModel, **options)
