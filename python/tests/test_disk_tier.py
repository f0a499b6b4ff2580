"""The disk tier: with a host RAM cap below the streamed weights, the loader leaves part
of the model in its safetensors files and the copy scheduler reads those units every step into a
pinned ring, ahead of the device copies (Note [Disk tier] in engine/src/disk_tier_reader.cpp).
On the sim device: the same outputs as the library's own load, the report says which bytes come
from disk, remove() gives the host a complete model, and a load's peak RSS stays near the cap
instead of the model."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ddo
from conftest import STREAM_ALL
from helpers import RSS_PREAMBLE, quantizable_flux, tiny_flux_inputs

diffusers = pytest.importorskip("diffusers")
STREAM = dict(STREAM_ALL, execution_mode="linear_runtime")
GIB = 1 << 30


def tiny_flux():
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    ).eval()


def flux_inputs(seed):
    return tiny_flux_inputs(seed)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux-disk")
    model = tiny_flux()
    model.save_pretrained(root, max_shard_size="60KB")
    streamed = sum(p.numel() * p.element_size() for p in model.parameters())
    return root, streamed


def load(path, **config):
    return ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=dict(STREAM, **config),
    )


def put_back(shards, saved):
    """Each shard's bytes and times as `saved` has them ({path: (bytes, os.stat_result)}),
    written in place: a file restored from a copy that keeps its last-write time (cp -p)."""
    for f in shards:
        data, stat = saved[f]
        with open(f, "r+b") as fh:
            fh.write(data)
            fh.truncate(len(data))
        os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def write_in_place(shards):
    """The last value of each shard's last tensor set to +inf at the same size, in place (the
    same inode), with a later last-write time: what an overwrite in place leaves."""
    for f in shards:
        data = bytearray(f.read_bytes())
        data[-4:] = b"\x00\x00\x80\x7f"
        stat = f.stat()
        with open(f, "r+b") as fh:
            fh.write(data)
        os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


@torch.no_grad()
def test_capped_load_streams_part_from_disk_with_the_same_outputs(flux_dir):
    path, streamed = flux_dir
    library = diffusers.FluxTransformer2DModel.from_pretrained(path).eval()
    cap_gb = streamed * 0.6 / GIB
    # A small prefetch window keeps the device staging (window + 2 x the largest unit) well below
    # the disk bytes, so what it still holds from the step before cannot hide the re-reads below.
    loaded = load(path, host_ram_cap_gb=cap_gb, prefetch_window_mb=0.03)
    report = loaded.report()
    plan = report["setup"]["load"]
    assert plan["tier"] == "host+disk", report["setup"]
    assert 0 < plan["disk_bytes"] < streamed
    names = [d["name"] for d in report["decisions"]]
    assert "disk_tier" in names, names
    # Host RAM held for weights: the slabs plus the ring, within the cap.
    setup = report["setup"]
    held = setup["pinned_bytes"] + setup["pageable_bytes"] + plan["disk_ring_bytes"]
    assert held <= cap_gb * GIB + 4096 * setup["stream_units"], (held, cap_gb * GIB)
    steps = 3
    for seed in range(steps):
        expected = library(**flux_inputs(seed)).sample
        torch.testing.assert_close(loaded.module(**flux_inputs(seed)).sample, expected,
                                   rtol=1e-5, atol=1e-6)
    run = loaded.report()["run"]
    # Every step reads the disk-tier units again, except what is still held from the step before:
    # landed regions of the host ring (Note [Disk tier]: a landed region serves later copies of
    # its unit) and units still in the device staging (the scheduler's cached units). How much
    # of either survives depends on timing (with the default window the staging held the whole
    # model and runs read 418304 to 644608 bytes); neither can hold more than its size. So each
    # later step reads at least disk - ring - staging; a run that never re-read fails.
    ring = plan["disk_ring_bytes"]
    staging = setup["staging_bytes"]
    assert 0 < ring < plan["disk_bytes"], plan
    per_step = plan["disk_bytes"] - ring - staging
    assert per_step > 0, (plan, staging)  # else the bound below cannot fail
    least = plan["disk_bytes"] + (steps - 1) * per_step
    assert run["disk_bytes_read"] >= least, (run, plan, staging)
    loaded.offload.remove()
    # The host gets a complete model back: the disk-tier weights are read from the files again.
    for (name, a), (_, b) in zip(loaded.module.state_dict().items(),
                                 library.state_dict().items()):
        assert torch.equal(a, b), name


@torch.no_grad()
def test_capped_load_with_a_dtype_converts_the_disk_units_every_step(flux_dir):
    # dtype= with the disk tier: the f32 file's disk-tier tensors are read and converted to bf16
    # on the reader threads every step; outputs equal the library's own bf16 load.
    path, streamed = flux_dir
    library = diffusers.FluxTransformer2DModel.from_pretrained(
        path, torch_dtype=torch.bfloat16).eval()
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=dict(STREAM, host_ram_cap_gb=streamed * 0.3 / GIB),
        dtype=torch.bfloat16,
    )
    assert loaded.report()["setup"]["load"]["disk_bytes"] > 0
    assert all(p.dtype == torch.bfloat16 for p in loaded.module.parameters())
    for seed in range(2):
        inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                  for k, v in flux_inputs(seed).items()}
        expected = library(**inputs).sample
        torch.testing.assert_close(loaded.module(**inputs).sample, expected, rtol=0, atol=0)
    assert loaded.report()["run"]["disk_bytes_read"] > 0
    loaded.offload.remove()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@torch.no_grad()
def test_disk_tier_parameters_read_as_their_weights_and_a_write_is_refused(flux_dir, dtype):
    # Note [Disk-tier storage] in torch/src/attach_disk_tier.cpp): while the offload
    # is active a disk-tier parameter reads as its weight (not zeros), through ops ddo does not
    # intercept, state_dict and norms alike; with dtype= the converted values come from a
    # temporary file. An in-place write does not fault; serving it is refused, naming the disk
    # tier, and the checkpoint is unchanged.
    path, streamed = flux_dir
    library = diffusers.FluxTransformer2DModel.from_pretrained(path, torch_dtype=dtype).eval()
    before = {f: f.read_bytes() for f in path.glob("*.safetensors")}
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=dict(STREAM, host_ram_cap_gb=streamed * 0.4 / GIB,
                                    prefetch_window_mb=0.03),
        dtype=dtype,
    )
    load = loaded.report()["setup"]["load"]
    assert load["disk_bytes"] > 0, load
    assert (load["disk_spill_bytes"] > 0) == (dtype is not None), load
    expected = dict(library.state_dict())
    managed = [n for n, p in loaded.module.named_parameters() if ddo._C.is_managed(p)]
    assert managed
    for name, value in loaded.module.state_dict().items():
        assert torch.equal(value, expected[name]), name
        assert value.norm() == expected[name].norm(), name
    # An op ddo does not intercept reads the weight itself.
    layer = loaded.module.transformer_blocks[0].ff.net[2]
    ref_layer = library.transformer_blocks[0].ff.net[2]
    x = torch.randn(3, layer.weight.shape[1], dtype=layer.weight.dtype)
    torch.testing.assert_close(torch.nn.functional.linear(x, layer.weight * 1.0),
                               torch.nn.functional.linear(x, ref_layer.weight * 1.0))
    inputs = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
              for k, v in flux_inputs(0).items()}
    output = loaded.module(**inputs).sample
    torch.testing.assert_close(output, library(**inputs).sample, rtol=1e-5, atol=1e-6)
    # Every managed weight written in place: no fault; a disk-tier one cannot be served.
    for p in loaded.module.parameters():
        if ddo._C.is_managed(p):
            p.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"changed in place .*disk tier.*host_ram_cap_gb"):
        loaded.module(**inputs)
    loaded.offload.remove()
    assert {f: f.read_bytes() for f in path.glob("*.safetensors")} == before


@torch.no_grad()
def test_a_file_truncated_after_the_load_fails_the_step_clearly_until_attached_again(tmp_path):
    # The disk tier reads the files every step, so they can change under it (a model folder
    # rewritten, a download restarted in place). The step fails naming the file; a file written
    # in place is not trusted again, even with its old bytes back (Note [A shard changed under the
    # disk tier]): remove() still gives the host the model, and a new attach runs as before.
    root = tmp_path / "flux"
    model = tiny_flux()
    model.save_pretrained(root, max_shard_size="60KB")
    streamed = sum(p.numel() * p.element_size() for p in model.parameters())
    loaded = load(root, host_ram_cap_gb=streamed * 0.6 / GIB, prefetch_window_mb=0.03)
    inputs = flux_inputs(0)
    expected = loaded.module(**inputs).sample
    shards = sorted(root.glob("*.safetensors"))
    saved = {f: (f.read_bytes(), f.stat()) for f in shards}
    for f in shards:
        os.truncate(f, 100)
    with pytest.raises(RuntimeError, match=r"disk-tier unit .*safetensors' changed on disk"):
        loaded.module(**inputs)
    for f in shards:  # whole again, in place (the reader keeps its open descriptors)
        with open(f, "r+b") as fh:
            fh.write(saved[f][0])
    with pytest.raises(RuntimeError, match=r"changed on disk .* attach again"):
        loaded.module(**inputs)
    # remove() reads the weights back only from files as they were at the load (Note [Reads
    # that give the model back]): with their last-write times too.
    put_back(shards, saved)
    loaded.offload.remove()
    again = load(root, host_ram_cap_gb=streamed * 0.6 / GIB, prefetch_window_mb=0.03)
    torch.testing.assert_close(again.module(**inputs).sample, expected, rtol=0, atol=0)
    again.offload.remove()


@torch.no_grad()
def test_a_remove_that_cannot_read_the_files_changes_nothing_and_can_be_retried(tmp_path):
    # Note [Restore in two phases]: remove() reads the disk tier's weights back from the files;
    # when it cannot, it says so and the offload stays as it was (still serving the model), and
    # a second remove() once the files are whole gives the complete model.
    root = tmp_path / "flux"
    model = tiny_flux()
    model.save_pretrained(root, max_shard_size="60KB")
    streamed = sum(p.numel() * p.element_size() for p in model.parameters())
    loaded = load(root, host_ram_cap_gb=streamed * 0.6 / GIB, prefetch_window_mb=0.03)
    inputs = flux_inputs(0)
    expected = loaded.module(**inputs).sample
    shards = sorted(root.glob("*.safetensors"))
    saved = {f: (f.read_bytes(), f.stat()) for f in shards}
    for f in shards:
        os.truncate(f, 100)
    with pytest.raises(ValueError, match=r"remove\(\) could not restore .*still active"):
        loaded.offload.remove()
    assert loaded.offload.active
    # Whole again, in place, with the load's last-write times (a copy kept with cp -p): the
    # offload no longer serves them (changed on disk), but remove() reads the weights back.
    put_back(shards, saved)
    loaded.offload.remove()
    assert not loaded.offload.active
    assert not any(ddo._C.is_managed(p) for p in loaded.module.parameters())
    library = diffusers.FluxTransformer2DModel.from_pretrained(root).eval()
    for (name, a), (_, b) in zip(loaded.module.state_dict().items(),
                                 library.state_dict().items()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(loaded.module(**inputs).sample, expected, rtol=0, atol=0)


@torch.no_grad()
def test_without_a_cap_nothing_streams_from_disk(flux_dir):
    path, _ = flux_dir
    loaded = load(path)
    load_report = loaded.report()["setup"]["load"]
    assert load_report["tier"] == "host"
    assert load_report["disk_bytes"] == 0
    loaded.module(**flux_inputs(0))
    assert loaded.report()["run"]["disk_bytes_read"] == 0
    loaded.offload.remove()


@torch.no_grad()
def test_cap_on_weights_already_in_memory_is_reported_not_enforced(flux_dir):
    path, streamed = flux_dir
    model = diffusers.FluxTransformer2DModel.from_pretrained(path).eval()
    expected = model(**flux_inputs(0)).sample
    offload = ddo.enable_offload(model, host_ram_cap_gb=streamed * 0.5 / GIB, **STREAM)
    report = offload.report()
    assert "host_ram_cap_unmet" in [d["name"] for d in report["decisions"]]
    torch.testing.assert_close(model(**flux_inputs(0)).sample, expected)
    offload.remove()


def test_a_cap_too_small_for_the_ring_names_the_variable(flux_dir):
    path, _ = flux_dir
    with pytest.raises(Exception) as info:
        load(path, host_ram_cap_gb=2e-6)
    text = str(info.value)
    assert "host_ram_cap_gb" in text or "DDO_HOST_RAM_CAP_GB" in text, text


@torch.no_grad()
def test_the_environment_variable_caps_host_ram(flux_dir, monkeypatch):
    path, streamed = flux_dir
    # Without an explicit config the regular settings loader reads the DDO_ variables (an
    # explicit dynamic_offload_config does not): stream everything, cap host RAM.
    for name, value in dict(DDO_HOST_RAM_CAP_GB=repr(streamed * 0.6 / GIB),
                            DDO_AUTO_BUDGET_POLICY="off", DDO_RESIDENT_MODULE_BUDGET_GB="0",
                            DDO_ALWAYS_RESIDENT_MODULE_PATTERNS="",
                            DDO_SMALL_TENSOR_THRESHOLD_KB="0").items():
        monkeypatch.setenv(name, value)
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        execution_device="sim")
    assert loaded.report()["setup"]["load"]["tier"] == "host+disk"
    loaded.offload.remove()


_RSS_CHILD = RSS_PREAMBLE + textwrap.dedent(
    """
    path, cap = sys.argv[1], float(sys.argv[2])
    loaded = ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=dict(execution_device="sim", execution_mode="linear_runtime",
                                    sim_device_capacity_gb=8.0, auto_budget_policy="off",
                                    resident_module_budget_gb=0.0,
                                    always_resident_modules_pattern=[], host_ram_cap_gb=cap))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        loaded.module(
            hidden_states=torch.randn(1, 16, 64, generator=g),
            encoder_hidden_states=torch.randn(1, 8, 512, generator=g),
            pooled_projections=torch.randn(1, 512, generator=g), timestep=torch.tensor([0.5]),
            img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3))
    peak = (status_kb("VmHWM") - before) * 1024
    setup = loaded.report()["setup"]
    device = setup["staging_bytes"] + setup["bytes"]["resident"] + setup["bytes"]["move_once"]
    print(peak, device, setup["load"]["disk_bytes"])
    """
)


def test_peak_rss_follows_the_cap_not_the_model(tmp_path):
    # ~150 MB of weights, loaded and run once without a cap and once capped at a quarter: the
    # capped process holds about the model minus the cap less. Compared against the same run
    # uncapped, so the interpreter's and the first forward's working memory (which differ between
    # torch builds) cancel out.
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
        num_attention_heads=4, joint_attention_dim=512, pooled_projection_dim=512,
        axes_dims_rope=[16, 56, 56],
    )
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(tmp_path, max_shard_size="50MB")
    del model
    cap = model_bytes / 4
    runs = {}
    for name, cap_gb in (("uncapped", 0.0), ("capped", cap / GIB)):
        out = subprocess.run(
            [sys.executable, "-c", _RSS_CHILD, str(tmp_path), repr(cap_gb)], capture_output=True,
            text=True, env=dict(os.environ), check=True,
        )
        runs[name] = tuple(map(int, out.stdout.strip().splitlines()[-1].split()))
    (peak_u, device_u, disk_u), (peak_c, device_c, disk_c) = runs["uncapped"], runs["capped"]
    print(f"peak RSS growth: uncapped {peak_u / 1e6:.0f} MB, capped at {cap / 1e6:.0f} MB "
          f"{peak_c / 1e6:.0f} MB ({disk_c / 1e6:.0f} MB from disk); weights "
          f"{model_bytes / 1e6:.0f} MB; sim device {device_u / 1e6:.0f} / {device_c / 1e6:.0f} MB")
    assert disk_u == 0 and disk_c > model_bytes / 2
    # What the cap saves shows in the process: at least 70 % of the bytes it keeps out of RAM.
    saved = (peak_u - device_u) - (peak_c - device_c)
    assert saved >= 0.7 * (model_bytes - cap), (runs, model_bytes, cap)


@torch.no_grad()
def test_a_shard_written_in_place_while_attached_is_an_error(flux_dir, tmp_path):
    # Note [A shard changed under the disk tier] in core/src/checkpoint_reader.cpp: the disk
    # tier reads its units from the files every step; a shard overwritten in place at the same
    # size would change the output silently, so the next read of it is an error naming the file.
    import shutil
    source, streamed = flux_dir
    path = tmp_path / "flux"
    shutil.copytree(source, path)
    loaded = load(path, host_ram_cap_gb=streamed * 0.6 / GIB, prefetch_window_mb=0.03)
    assert loaded.report()["setup"]["load"]["disk_bytes"] > 0
    loaded.module(**flux_inputs(0))
    shards = sorted(path.glob("*.safetensors"))
    saved = {f: (f.read_bytes(), f.stat()) for f in shards}
    write_in_place(shards)
    with pytest.raises(Exception, match="changed on disk while ddo reads weights from it"):
        for seed in range(3):
            loaded.module(**flux_inputs(seed))
    # remove() reads the same files (Note [Reads that give the model back]).
    with pytest.raises(ValueError, match="is not the file the model was loaded from"):
        loaded.offload.remove()
    put_back(shards, saved)
    loaded.offload.remove()


@torch.no_grad()
def test_load_state_dict_while_attached_then_remove_gives_the_new_weights(flux_dir):
    # A write in place to a disk-tier weight cannot be served (the next forward refuses), and
    # remove() gives the host the bytes it wrote, not the checkpoint's: nothing the host wrote is
    # lost, with or without a forward in between.
    path, streamed = flux_dir
    for forward_between in (False, True):
        loaded = load(path, host_ram_cap_gb=streamed * 0.4 / GIB, prefetch_window_mb=0.03)
        assert loaded.report()["setup"]["load"]["disk_bytes"] > 0
        torch.manual_seed(7)
        new = {k: torch.randn_like(v) for k, v in loaded.module.state_dict().items()}
        loaded.module.load_state_dict(new)
        if forward_between:
            with pytest.raises(RuntimeError, match=r"changed in place .*disk tier"):
                loaded.module(**flux_inputs(0))
        loaded.offload.remove()
        back = loaded.module.state_dict()
        wrong = [k for k, v in new.items() if not torch.equal(back[k], v)]
        assert not wrong, (forward_between, len(wrong), len(new), wrong[:3])


@torch.no_grad()
def test_quantize_weights_over_the_checkpoint_come_back_by_reads(tmp_path):
    # The loader's quantize= keeps each quantized Linear's dense weight over the checkpoint's
    # mapping (Note [Mapped weights come back by reads]). remove() reads those bytes from the
    # file: a file truncated since the load is an error that changes nothing (no fault on a page
    # the file no longer has), and remove() succeeds once the file is whole; a weight the host
    # wrote while attached comes back as written.
    root = tmp_path / "flux"
    model = quantizable_flux()
    model.save_pretrained(root)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    def quantized_load():
        loaded = ddo.from_pretrained_with_dynamic_offload(
            root, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
            dynamic_offload_config=dict(STREAM), quantize="fp8")
        assert sum(loaded.report()["quantized_compute"]["counts"].values()) > 0
        return loaded

    loaded = quantized_load()
    shards = sorted(root.glob("*.safetensors"))
    saved = {f: (f.read_bytes(), f.stat()) for f in shards}
    for f in shards:
        os.truncate(f, 100)
    with pytest.raises(ValueError, match=r"remove\(\) could not restore .*safetensors' is not "
                       r"the file the model was loaded from.*call remove\(\) again"):
        loaded.offload.remove()
    put_back(shards, saved)
    loaded.offload.remove()
    back = loaded.module.state_dict()
    for k, v in expected.items():
        assert torch.equal(back[k], v), k

    loaded = quantized_load()
    layer = loaded.module.transformer_blocks[0].ff.net[2]
    layer.weight.mul_(2.0)
    loaded.offload.remove()
    torch.testing.assert_close(layer.weight, expected["transformer_blocks.0.ff.net.2.weight"] * 2,
                               rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_a_shard_written_in_place_is_refused_by_remove_until_it_is_put_back(tmp_path, quantize):
    # Note [Reads that give the model back] in torch/src/loader.cpp: remove() reads the disk
    # tier's weights (without quantize) and quantize='s dense weights over the mapping (with it)
    # back from the files. A shard written in place at its size since the load would give weights
    # the model never had: remove() refuses naming the file and changes nothing, and gives the
    # loaded model once the file is back as it was.
    root = tmp_path / "flux"
    model = quantizable_flux()
    model.save_pretrained(root, max_shard_size="200KB")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    streamed = sum(v.numel() * v.element_size() for v in expected.values())
    config = dict(STREAM) if quantize else dict(STREAM, host_ram_cap_gb=streamed * 0.6 / GIB,
                                                     prefetch_window_mb=0.03)
    loaded = ddo.from_pretrained_with_dynamic_offload(
        root, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=config, quantize=quantize)
    report = loaded.report()
    if quantize:
        assert sum(report["quantized_compute"]["counts"].values()) > 0, report
    else:
        assert report["setup"]["load"]["disk_bytes"] > 0, report["setup"]
    shards = sorted(root.glob("*.safetensors"))
    saved = {f: (f.read_bytes(), f.stat()) for f in shards}
    write_in_place(shards)
    with pytest.raises(ValueError, match=r"remove\(\) could not restore .*safetensors' is not the "
                       r"file the model was loaded from.*written in place.*Put the file back"):
        loaded.offload.remove()
    assert loaded.offload.active
    put_back(shards, saved)
    loaded.offload.remove()
    assert not loaded.offload.active
    back = loaded.module.state_dict()
    wrong = [k for k, v in expected.items() if not torch.equal(back[k], v)]
    assert not wrong, wrong[:3]
