"""What a user changes on an attached model: nothing is silently dropped.

A change ddo cannot serve (a dtype change by ``model.double()`` or ``model.to(torch.float16)``)
is refused with an error naming the tensor and the way out, and the model keeps running as
before; a change it can serve (``param.data = t`` of the same shape and dtype, a
``requires_grad`` flip) is what the next forward and remove() see."""

import copy

import pytest
import torch

import ddo
from conftest import STREAM_ALL
from helpers import TinyNet, tiny_inputs


@pytest.mark.parametrize(
    "change", [lambda m: m.double(), lambda m: m.to(torch.float16)], ids=["double", "to_half"]
)
def test_a_dtype_change_is_refused_and_the_model_still_runs(change):
    torch.manual_seed(0)
    model = TinyNet().eval()
    ids = tiny_inputs()
    with torch.no_grad():
        expected = model(ids)
    offload = ddo.enable_offload(model, preset="one_shot_fast", **STREAM_ALL)
    try:
        with pytest.raises(RuntimeError, match=r"'embed\.weight\.data = t'.*remove\(\)"):
            change(model)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
        assert offload.report()["active"] is True
    finally:
        offload.remove()
    assert model.embed.weight.dtype == torch.float32


def test_data_assignment_is_served_and_kept():
    torch.manual_seed(0)
    model = TinyNet().eval()
    ids = tiny_inputs()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.blocks[0][0].weight.zero_()
        expected = reference(ids)
    offload = ddo.enable_offload(model, preset="one_shot_fast", **STREAM_ALL)
    try:
        model.blocks[0][0].weight.data = torch.zeros_like(model.blocks[0][0].weight)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
    finally:
        offload.remove()
    assert torch.count_nonzero(model.blocks[0][0].weight) == 0


def test_requires_grad_set_while_attached_stays_after_remove():
    """A resident weight's flag is the host's throughout; a streamed weight reads False while
    attached (Note [Training under offload]) and gets its attach-time flag back unless the host
    set it True meanwhile."""
    torch.manual_seed(0)
    model = TinyNet().eval()
    offload = ddo.enable_offload(model, preset="one_shot_fast", execution_device="sim")
    try:
        model.blocks[1][0].weight.requires_grad_(False)
    finally:
        offload.remove()
    assert model.blocks[1][0].weight.requires_grad is False
    assert model.blocks[2][0].weight.requires_grad is True

    streamed = TinyNet().eval()
    offload = ddo.enable_offload(streamed, preset="one_shot_fast", **STREAM_ALL)
    try:
        assert streamed.blocks[0][0].weight.requires_grad is False  # frozen while streamed
    finally:
        offload.remove()
    assert all(p.requires_grad for p in streamed.parameters())
