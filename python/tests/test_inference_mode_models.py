"""A model built under ``torch.inference_mode()`` (Note [Inference tensors as weights]).

Its weights are inference tensors, which have no version counter. enable_offload must attach
to it, its forwards must give the resident outputs, and remove() must give the weights back
without a warning, after which the model runs in every grad mode."""

import warnings

import pytest
import torch

import ddo
from conftest import STREAM_ALL
from helpers import TinyNet, tiny_inputs


def built_in_inference_mode():
    torch.manual_seed(0)
    with torch.inference_mode():
        model = TinyNet().eval()
    assert all(p.is_inference() for p in model.parameters())
    return model


@pytest.mark.parametrize("route", ["streamed", "resident"])
def test_attach_forward_and_remove(route, capfd):
    model = built_in_inference_mode()
    ids = tiny_inputs()
    with torch.no_grad():
        expected = model(ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = dict(STREAM_ALL) if route == "streamed" else dict(execution_device="sim")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload = ddo.enable_offload(model, preset="one_shot_fast", **config)
        with torch.no_grad():
            torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
        with torch.inference_mode():
            torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
        offload.remove()
    assert "restoring the model failed" not in capfd.readouterr().err
    after = model.state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
    # Ordinary tensors from the attach on: grad mode runs too (an inference tensor cannot).
    out = model(ids)
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)


def test_a_write_while_attached_is_seen():
    model = built_in_inference_mode()
    ids = tiny_inputs()
    offload = ddo.enable_offload(model, preset="one_shot_fast", **STREAM_ALL)
    try:
        with torch.no_grad():
            model.blocks[0][0].weight.mul_(2.0)
            doubled = model(ids)
        offload.remove()
        with torch.no_grad():
            torch.testing.assert_close(model(ids), doubled, rtol=0, atol=0)
    finally:
        offload.remove()
