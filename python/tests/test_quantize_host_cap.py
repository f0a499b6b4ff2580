"""The loader's quantize= under host_ram_cap_gb: its quantized copies are made at attach and no
checkpoint holds them, so they stay in host memory and count against the cap (Note [Only
parameters stay in the file] in core/src/planner_tiers.cpp), as do dense weights read into memory
because the file holds another dtype (Note [Dense weights under the host cap] in
torch/src/loader.cpp). A cap the model cannot meet is an error that names what to change."""

import re

import pytest
import torch

import ddo
from conftest import STREAM_ALL
from helpers import quantizable_flux

diffusers = pytest.importorskip("diffusers")
STREAM = dict(STREAM_ALL, execution_mode="linear_runtime")
GIB = 1 << 30


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    """A FLUX whose Linears mostly qualify for quantize= (dimensions of 128 and 512), a few kept
    dense (x_embedder and proj_out have fewer than 16384 weights), saved in float32 shards."""
    root = tmp_path_factory.mktemp("flux-quantize-cap")
    model = quantizable_flux()
    model.save_pretrained(root, max_shard_size="200KB")
    return root


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 16, 16, generator=g, dtype=dtype),
        encoder_hidden_states=torch.randn(1, 8, 128, generator=g, dtype=dtype),
        pooled_projections=torch.randn(1, 128, generator=g, dtype=dtype),
        timestep=torch.tensor([0.5], dtype=dtype),
        img_ids=torch.zeros(16, 3, dtype=dtype),
        txt_ids=torch.zeros(8, 3, dtype=dtype),
    )


def load(path, dtype=None, **config):
    return ddo.from_pretrained_with_dynamic_offload(
        path, model_loader=diffusers.FluxTransformer2DModel, apply_dynamic=True,
        dynamic_offload_config=dict(STREAM, **config), quantize="fp8", dtype=dtype)


def held_bytes(report):
    """Host memory the plan holds for the weights: slabs and the disk ring."""
    setup = report["setup"]
    return setup["pinned_bytes"] + setup["pageable_bytes"] + setup["load"]["disk_ring_bytes"]


@torch.no_grad()
def test_quantized_copies_stay_on_the_host_within_the_cap(flux_dir):
    # Under quantize= the model runs its packed layers' rules: the dense Linears it keeps stay on
    # the device, and what streams is the quantized copies, none of which a file can serve. So
    # a cap just below them is an error naming the figure that holds them, and that figure runs
    # with every copy in host memory, within the cap.
    uncapped = load(flux_dir)
    report = uncapped.report()
    assert sum(report["quantized_compute"]["counts"].values()) > 0, report["quantized_compute"]
    total = held_bytes(report)
    expected = uncapped.module(**inputs()).sample
    uncapped.offload.remove()
    with pytest.raises(torch.OutOfMemoryError) as info:
        load(flux_dir, host_ram_cap_gb=(total - 4096) / GIB)
    text = str(info.value)
    match = re.search(r"at least ([0-9.e-]+) \(GiB\)", text)
    assert match, text
    cap_gb = float(match.group(1))
    assert total <= cap_gb * GIB < total + 4096, (total, cap_gb * GIB)
    capped = load(flux_dir, host_ram_cap_gb=cap_gb)
    report = capped.report()
    assert report["setup"]["load"]["disk_bytes"] == 0, report["setup"]
    assert held_bytes(report) <= cap_gb * GIB, (held_bytes(report), cap_gb * GIB)
    torch.testing.assert_close(capped.module(**inputs()).sample, expected, rtol=0, atol=0)
    capped.offload.remove()


def test_a_cap_below_the_quantized_copies_names_the_cap_and_quantize(flux_dir):
    uncapped = load(flux_dir)
    total = held_bytes(uncapped.report())
    uncapped.offload.remove()
    with pytest.raises(torch.OutOfMemoryError) as info:
        load(flux_dir, host_ram_cap_gb=total * 0.5 / GIB)
    text = str(info.value)
    assert "units holding buffers (quantize='s copies" in text, text
    assert "Raise host_ram_cap_gb" in text, text
    assert "load without it" in text, text
    assert "from_pretrained_with_dynamic_offload" not in text, text  # the call already made


@torch.no_grad()
def test_dense_weights_read_into_memory_count_against_the_cap(flux_dir):
    # The file is float32 and the model bfloat16: each quantized Linear's dense weight is read
    # into memory at attach instead of mapped, beside the plan's units.
    uncapped = load(flux_dir, dtype=torch.bfloat16)
    report = uncapped.report()
    layers = report["quantized_compute"]["layers"]
    dense = sum(uncapped.module.get_submodule(name).weight.numel() * 2 for name in layers)
    total = held_bytes(report)
    expected = uncapped.module(**inputs(torch.bfloat16)).sample
    uncapped.offload.remove()
    assert dense > 0 and total > 0
    # Every unit fits, but not with the dense weights beside them.
    with pytest.raises(torch.OutOfMemoryError) as info:
        load(flux_dir, dtype=torch.bfloat16, host_ram_cap_gb=(total + dense // 2) / GIB)
    text = str(info.value)
    assert f"holds {dense} bytes of dense Linear weights" in text, text
    assert "Load with dtype= the checkpoint's dtype" in text, text
    assert "raise host_ram_cap_gb" in text and "without quantize=" in text, text
    # The figure it names is enough.
    fits = load(flux_dir, dtype=torch.bfloat16, host_ram_cap_gb=(total + dense + 4096) / GIB)
    torch.testing.assert_close(fits.module(**inputs(torch.bfloat16)).sample, expected, rtol=0,
                               atol=0)
    fits.offload.remove()
