"""SDNQ models (quantized by the `sdnq` package, the test oracle) under enable_offload on the
host simulation: the runtime is chosen from the model, each layer's packed tensors stream as one
unit, outputs equal the package's own forward bit for bit, remove() restores the layers, layouts
ddo does not run keep their own forward on the device, and sdnq_runtime on a dense model is a
clear error."""

import os

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


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, 4 * h)
        self.down = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, h=128, n=3):
        super().__init__()
        self.proj_in = nn.Linear(h, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.conv = nn.Conv1d(h, h, 3, padding=1)  # dense, not quantized: a mixed model

    def forward(self, x):
        x = self.proj_in(x)
        for b in self.blocks:
            x = b(x)
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


def quantized(weights_dtype, **kw):
    model = Net().to(torch.bfloat16).eval()
    return sdnq.sdnq_post_load_quant(
        model, weights_dtype=weights_dtype, torch_dtype=torch.bfloat16, add_skip_keys=False, **kw
    )


LAYOUTS = [
    ("int8", {}),
    ("uint8", {}),
    ("int4", {}),
    ("uint4", {}),
    ("uint4", {"group_size": 32}),
    ("float8_e4m3fn", {}),
    ("int8", {"use_svd": True, "svd_rank": 8}),
    ("int8", {"group_size": 32}),
]


@pytest.mark.parametrize("weights_dtype,kw", LAYOUTS)
def test_streamed_sdnq_layers_equal_the_packages_forward(weights_dtype, kw):
    model = quantized(weights_dtype, **kw)
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    offload = ddo.enable_offload(model, preset="one_shot_fast", **STREAM)
    report = offload.report()
    assert report["execution_mode"] == "sdnq_runtime"
    assert any(d["name"] == "sdnq_runtime_auto" for d in report["decisions"])
    units = offload.plan()["stream_units"]
    layer_units = [u for u in units if u["name"].startswith("blocks.")]
    # One unit per quantized layer of the blocks, holding the packed weight and its scales.
    assert len(layer_units) == 6, units
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), ref)
    assert offload.report()["run"]["acquires"] >= 6
    offload.remove()
    assert "forward" not in model.blocks[0].up.__dict__
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_unsupported_layout_keeps_its_forward_on_the_device():
    model = quantized("int8", use_hadamard=True)
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    offload = ddo.enable_offload(model, preset="one_shot_fast", **STREAM)
    kept = offload.report()["python"]["kept_modules"]
    assert any("use_hadamard" in k["reason"] for k in kept), kept
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    offload.remove()


def test_sdnq_runtime_on_a_dense_model_is_a_clear_error():
    model = Net()
    with pytest.raises(ValueError, match="sdnq_runtime needs SDNQ layers"):
        ddo.enable_offload(model, preset="one_shot_fast", execution_mode="sdnq_runtime", **STREAM)
    # Nothing was moved or replaced.
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_plan_mode_classifies_without_replacing_forwards():
    model = quantized("uint4")
    offload = ddo.enable_offload(model, preset="off", execution_device="sim")
    assert offload.report()["executing"] is False
    assert "forward" not in model.blocks[0].up.__dict__


@torch.no_grad()
def test_a_small_card_leaves_room_for_the_dequantized_weight_or_is_refused():
    # Note [Dequantized temporaries]: while an SDNQ layer runs, its dequantized weight is on the
    # device beside staging. A card of half the packed model cannot hold it next to the smallest
    # staging: refused at attach, naming it, with nothing moved. A card with room for it runs
    # the first forward (it ran out of memory there before).
    torch.manual_seed(0)
    model = sdnq.sdnq_post_load_quant(
        Net(h=512, n=4).to(torch.bfloat16).eval(), weights_dtype="uint4",
        torch_dtype=torch.bfloat16, add_skip_keys=False)
    x = torch.randn(2, 8, 512, dtype=torch.bfloat16)
    expected = model(x)
    packed = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    small = dict(STREAM, auto_vram_headroom_gb=0.0, profile_vram_headroom_gb=0.0)
    with pytest.raises(torch.OutOfMemoryError, match="dequantized weight"):
        ddo.enable_offload(model, sim_device_capacity_gb=packed * 0.5 / 2**30, **small)
    assert not any(ddo._C.is_managed(p) for p in model.parameters())
    assert torch.equal(model(x), expected)
    # 512 x 2048 values at the reference path's 10 bytes each, beside a small staging ring.
    offload = ddo.enable_offload(model, sim_device_capacity_gb=(packed * 0.5 + 12 * 2**20) / 2**30,
                                 **small)
    assert torch.equal(model(x), expected)
    offload.remove()
