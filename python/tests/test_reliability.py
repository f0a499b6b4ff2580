"""From Python: a device index out of range is a clear error on every route.

``execution_device="sim:99999999999"`` reached the adapter's ``std::stoi`` and surfaced as
``stoi``; now every way of naming the device (the argument, a config mapping or object, settings
resolved first, the regular settings loader, a pipeline, the device opener itself) raises
``ValueError`` naming the value, the index and the range (core::check_device_index), and leaves
the model alone. ``execution_device`` has no ``DDO_*`` variable, so the environment has no route
to it."""

import re

import pytest
import torch

import ddo
from ddo import _C
from conftest import STREAM_ALL
from helpers import TinyNet, tiny_inputs

BAD = "sim:99999999999"
# The value, its index and the range, in the words of core::check_device_index.
RANGE = re.escape(f"'{BAD}': the index '99999999999' is not a number from 0 to 1023")
NO_DEVICE = {k: v for k, v in STREAM_ALL.items() if k != "execution_device"}


def routes(model):
    """Each route to the execution device, as a call that must raise."""
    return {
        "argument": lambda: ddo.enable_offload(model, execution_device=BAD, **NO_DEVICE),
        "config mapping": lambda: ddo.enable_offload(
            model, config={"execution_device": BAD}, **NO_DEVICE
        ),
        "config object": lambda: ddo.enable_offload(
            model, config=ddo.DynamicOffloadConfig(execution_device=BAD), **NO_DEVICE
        ),
        "settings": lambda: ddo.enable_offload(
            model,
            settings=ddo.DynamicOffloadSettings.from_env(execution_device=BAD),
            **NO_DEVICE,
        ),
        "settings loader (library name)": lambda: ddo.load_dynamic_offload_settings_from_env(
            execution_device=BAD
        ),
        "pipeline": lambda: ddo.enable_pipeline_offload(
            {"transformer": model}, execution_device=BAD, **NO_DEVICE
        ),
        "device opener": lambda: _C.open_execution_device(
            BAD, ddo.DynamicOffloadConfig().to_dict()
        ),
    }


@pytest.mark.parametrize("route", list(routes(None)))
@torch.no_grad()
def test_device_index_out_of_range_names_value_and_range(route):
    model = TinyNet().eval()
    ids = tiny_inputs()
    expected = model(ids)
    with pytest.raises(ValueError, match=RANGE) as caught:
        routes(model)[route]()
    assert "stoi" not in str(caught.value)
    assert "write e.g. sim:0" in str(caught.value)
    assert not hasattr(model, "_ddo_offload")
    assert not _C.is_managed(model.blocks[0][0].weight)
    assert torch.equal(model(ids), expected)


@torch.no_grad()
def test_device_index_range_edges():
    model = TinyNet().eval()
    ids = tiny_inputs()
    expected = model(ids)
    offload = ddo.enable_offload(model, execution_device="sim:1023", **NO_DEVICE)
    assert torch.equal(model(ids), expected)
    offload.remove()
    for bad in ("sim:1024", "sim:-1", "sim:1x", "cuda:99999999999"):
        with pytest.raises(ValueError, match=re.escape(f"'{bad}': the index")):
            ddo.enable_offload(model, execution_device=bad, **NO_DEVICE)
    assert torch.equal(model(ids), expected)
