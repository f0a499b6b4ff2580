"""A pipeline with two denoisers (Wan 2.2's transformer and transformer_2: two instances of one
class) on the sim, through the one C++ pipeline loop (enable_pipeline_components): each
denoiser is profiled under its own name, one profile_run() calibrates both and their saved
budgets share the measured room, a second run applies both; the overrides decide the routes
before any component attaches; a component that fails leaves none attached."""

import pytest
import torch

import ddo
from ddo import _C
from conftest import STREAM_ALL
from helpers import TinyNet

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))


def wan_like():
    torch.manual_seed(7)
    return {"text_encoder": TinyNet().eval(), "transformer": TinyNet().eval(),
            "transformer_2": TinyNet().eval(), "tokenizer": "not a module"}


def managed(module):
    return _C.is_managed(module.blocks[0][0].weight)


@torch.no_grad()
def test_two_denoisers_calibrate_in_one_region_and_share_the_room(profile_dir):
    pipe = wan_like()
    expected = [pipe[n](IDS) for n in ("transformer", "transformer_2")]

    offload = ddo.enable_pipeline_offload(pipe, profile_name="wan", build_profile=True,
                                          **STREAM_ALL)
    assert offload.profiled_components == ["transformer", "transformer_2"]
    assert offload.profile_names == {"transformer": "wan", "transformer_2": "wan.transformer_2"}
    assert offload.report()["profile_names"] == offload.profile_names
    assert "profile 'wan.transformer_2'" in offload.summary()
    with offload.profile_run() as report:
        got = [pipe[n](IDS) for n in ("transformer", "transformer_2")]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    first, second = report["components"]["transformer"], report["components"]["transformer_2"]
    assert (first["status"], second["status"]) == ("saved", "saved")
    assert (first["name"], second["name"]) == ("wan", "wan.transformer_2")
    assert report["status"] == "saved" and report["name"] == "wan"
    # One measurement: the room is total - peak - headroom, and the two saved budgets split it.
    assert first["peak_vram_gb"] == second["peak_vram_gb"]
    room = first["total_vram_gb"] - first["peak_vram_gb"] - first["headroom_gb"]
    saved = first["resident_budget_gb"] + second["resident_budget_gb"]
    assert room > 0
    assert saved <= room + 1e-12 and saved == pytest.approx(room, abs=1e-9)
    assert first["budget_share"] == second["budget_share"] == 0.5  # equal candidate bytes
    assert ddo.load_profile("wan", pipe["transformer"]) is not None
    assert ddo.load_profile("wan.transformer_2", pipe["transformer_2"]) is not None
    offload.remove()
    assert not managed(pipe["transformer"]) and not managed(pipe["transformer_2"])

    offload = ddo.enable_pipeline_offload(pipe, profile_name="wan", **STREAM_ALL)
    for name in ("transformer", "transformer_2"):
        applied = offload[name].profile_report
        assert applied["status"] == "applied", applied
        assert applied["resident_budget_gb"] == pytest.approx(room / 2, abs=1e-9)
    assert offload["text_encoder"].profile_report["status"] == "disabled"
    with offload.profile_run() as report:
        got = [pipe[n](IDS) for n in ("transformer", "transformer_2")]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert report["components"]["transformer_2"]["status"] == "applied"
    offload.remove()


def test_profile_component_takes_a_list():
    pipe = wan_like()
    offload = ddo.enable_pipeline_offload(pipe, profile_name="w",
                                          profile_component=["transformer_2", "text_encoder"],
                                          **STREAM_ALL)
    try:
        # In the pipeline's order: the first keeps the name.
        assert offload.profile_names == {"text_encoder": "w", "transformer_2": "w.transformer_2"}
    finally:
        offload.remove()


def test_overrides_decide_the_routes_before_any_component_attaches(monkeypatch):
    """A route override is the pipeline's own route, and a component's DDO_<COMPONENT>_ROUTE
    still wins over it: the override is applied once, to the settings the router reads."""
    monkeypatch.setenv("DDO_TEXT_ENCODER_ROUTE", "device")
    pipe = wan_like()
    offload = ddo.enable_pipeline_offload(pipe, route="group_leaf", **STREAM_ALL)
    try:
        assert offload.routes == {"text_encoder": "device", "transformer": "group_leaf",
                                  "transformer_2": "group_leaf"}
        assert offload["text_encoder"].route == "device"
        assert offload["transformer"].route == "group_leaf"
        assert offload.profiled_components == []  # no component on the dynamic route
    finally:
        offload.remove()


@torch.no_grad()
def test_a_failure_on_the_second_component_restores_the_first():
    pipe = {"transformer": TinyNet().eval(), "transformer_2": TinyNet().eval()}
    expected = pipe["transformer"](IDS)
    finished = []

    def record_event(name, seconds, payload):
        if finished:  # the second component's first event
            raise RuntimeError("the host refused transformer_2")
        if name == "setup":
            finished.append(name)

    with pytest.raises(RuntimeError, match="the host refused transformer_2"):
        ddo.enable_pipeline_offload(pipe, record_event=record_event, **STREAM_ALL)
    assert finished == ["setup"]  # the first component was attached
    assert not managed(pipe["transformer"]) and not managed(pipe["transformer_2"])
    assert not _C.interception_active()
    assert getattr(pipe["transformer"], "_ddo_offload", None) is None
    assert torch.equal(pipe["transformer"](IDS), expected)
    # Both attach again: nothing was left half attached.
    offload = ddo.enable_pipeline_offload(pipe, **STREAM_ALL)
    assert managed(pipe["transformer"]) and managed(pipe["transformer_2"])
    offload.remove()
