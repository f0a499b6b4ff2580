"""The pipeline router (ddo/torch/pipeline_offload.h, route_pipeline): the one rule for which
treatment each component gets, which one is profiled and the device they share. Python's
enable_pipeline_offload calls it; these tests ask it directly, then check that the Python entry
point follows it."""

import pytest
import torch

import ddo
from ddo import _C
from conftest import STREAM_ALL
from helpers import TinyNet


def route(names, profile_component="", execution_device="", **settings_kwargs):
    settings = ddo.DynamicOffloadSettings.from_env(**settings_kwargs)
    return _C.route_pipeline(settings._native, names, profile_component, execution_device)


def test_routes_follow_each_components_policy(monkeypatch):
    monkeypatch.setenv("DDO_VAE_ROUTE", "device")
    monkeypatch.setenv("DDO_TEXT_ENCODER_ROUTE", "group_leaf")
    r = route(["text_encoder", "transformer", "vae"], execution_device="sim")
    assert r["components"] == [
        {"name": "text_encoder", "route": "group_leaf"},
        {"name": "transformer", "route": "dynamic"},
        {"name": "vae", "route": "device"},
    ]
    assert r["profiled"] == "transformer"  # the first on the dynamic route
    assert r["execution_device"] == "sim:0"  # normalized
    assert r["open_device"] is True


def test_named_profile_component_wins_and_unknown_is_not_found():
    assert route(["transformer", "vae"], "vae", "sim")["profiled"] == "vae"
    with pytest.raises(ddo.NotFoundError) as caught:
        route(["transformer", "vae"], "unet", "sim")
    assert str(caught.value) == (
        "profile_component 'unet' is not a component of the pipeline; components: transformer, vae"
    )


def test_no_dynamic_component_profiles_nothing(monkeypatch):
    monkeypatch.setenv("DDO_VAE_ROUTE", "none")
    assert route(["vae"], execution_device="sim")["profiled"] == ""


@pytest.mark.parametrize(
    "kwargs, device, opens",
    [
        ({}, "sim", True),
        ({"execution_mode": "plan"}, "sim", False),
        ({"preset": "off"}, "sim", False),
        ({}, "cpu", False),
    ],
)
def test_device_is_opened_only_when_executing(kwargs, device, opens):
    r = route(["transformer"], execution_device=device, **kwargs)
    assert r["open_device"] is opens
    assert r["execution_device"] == ("cpu" if device == "cpu" else "sim:0")


def test_device_from_settings_when_not_given():
    assert route(["transformer"], execution_device="")["execution_device"] == "cuda:0"
    settings = ddo.DynamicOffloadSettings.from_env(execution_device="sim:3")
    r = _C.route_pipeline(settings._native, ["transformer"], "", "")
    assert r["execution_device"] == "sim:3"
    assert _C.route_pipeline(settings._native, ["transformer"], "", "sim:1")["execution_device"] == "sim:1"


def test_python_entry_point_follows_the_router(monkeypatch):
    monkeypatch.setenv("DDO_VAE_ROUTE", "none")
    pipe = {"transformer": TinyNet().eval(), "vae": TinyNet().eval(), "tokenizer": "x"}
    offload = ddo.enable_pipeline_offload(pipe, **STREAM_ALL)
    expected = route(["transformer", "vae"], execution_device="sim")
    assert offload.routes == {c["name"]: c["route"] for c in expected["components"]}
    assert offload.profiled_component == expected["profiled"] == "transformer"
    assert offload.components["vae"] is None
    assert _C.is_managed(pipe["transformer"].blocks[0][0].weight)
    assert not _C.is_managed(pipe["vae"].blocks[0][0].weight)
    offload.remove()
    with pytest.raises(ddo.NotFoundError, match="'unet' is not a component"):
        ddo.enable_pipeline_offload(pipe, profile_component="unet", **STREAM_ALL)
    assert not _C.is_managed(pipe["transformer"].blocks[0][0].weight)


def test_route_names_are_read_by_one_rule(monkeypatch):
    """The diffusers route names are core's (parse_route, resolve_route_arguments): the same
    spellings work as route=, in DDO_<COMPONENT>_ROUTE, and fail with one message."""
    monkeypatch.setenv("DDO_VAE_ROUTE", "diffusers_group_offload")
    monkeypatch.setenv("DDO_TEXT_ENCODER_ROUTE", "linear_convolution")
    r = route(["text_encoder", "vae"], execution_device="sim")
    assert [c["route"] for c in r["components"]] == ["dynamic", "group_leaf"]
    model = TinyNet().eval()
    offload = ddo.enable_offload(model, route="diffusers_group_offload", offload_type="block_level",
                                 **STREAM_ALL)
    assert offload.settings.config.route == "group_block"
    offload.remove()
    with pytest.raises(ValueError, match=r'route "fast" is not one of .*; or auto'):
        ddo.enable_offload(model, route="fast", **STREAM_ALL)
    with pytest.raises(ValueError, match=r'offload_type="block" is not valid'):
        ddo.enable_offload(model, group_offload=True, offload_type="block", **STREAM_ALL)
    assert not _C.is_managed(model.blocks[0][0].weight)


def test_each_components_settings_come_from_the_router(monkeypatch):
    """PipelineRouting::settings_for: the component's route and the shared device; the profile
    options stay on the profiled component only."""
    monkeypatch.setenv("DDO_VAE_ROUTE", "device")
    settings = ddo.DynamicOffloadSettings.from_env(profile_name="w", execution_device="sim")
    r = _C.route_pipeline(settings._native, ["transformer", "vae"], "", "sim:2")
    per = [ddo.DynamicOffloadSettings(s).config for s in r["settings"]]
    assert [(c.route, c.execution_device, c.profile_name) for c in per] == [
        ("dynamic", "sim:2", "w"),
        ("device", "sim:2", ""),
    ]


def test_a_generation_reports_each_component_as_a_stage(monkeypatch):
    """offloads.generation(): one stage per component forward (C++ GenerationMeter), the bytes
    each component streamed in the generation, and outputs unchanged by the meter."""
    monkeypatch.setenv("DDO_VAE_ROUTE", "none")
    torch.manual_seed(5)
    pipe = {"text_encoder": TinyNet().eval(), "transformer": TinyNet().eval(),
            "vae": TinyNet().eval()}
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        expected = [pipe[n](ids) for n in ("text_encoder", "transformer", "transformer", "vae")]
    offload = ddo.enable_pipeline_offload(pipe, **STREAM_ALL)
    try:
        before = {n: offload[n].report()["run"]["bytes_streamed"]
                  for n in ("text_encoder", "transformer")}
        with torch.no_grad(), offload.generation() as gen:
            got = [pipe[n](ids) for n in ("text_encoder", "transformer", "transformer", "vae")]
        r = gen.report
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
        assert [s["name"] for s in r["stages"]] == ["text_encoder", "transformer", "vae"]
        assert [s["calls"] for s in r["stages"]] == [1, 2, 1]
        assert r["seconds"] >= sum(s["seconds"] for s in r["stages"])
        for name in ("text_encoder", "transformer"):
            gained = offload[name].report()["run"]["bytes_streamed"] - before[name]
            assert r["components"][name]["bytes_streamed"] == gained
        assert "vae" not in r["components"]  # route none: ddo places nothing
        assert r["bytes_streamed"] == sum(c["bytes_streamed"] for c in r["components"].values())
        assert r["device"] == "sim:0"
        assert r["peak_vram_bytes"] > 0 and r["peak_rss_bytes"] > 0
        # The hooks are gone: a forward after the block is not metered and nothing fails.
        with torch.no_grad():
            pipe["transformer"](ids)
        assert not pipe["transformer"]._forward_hooks and not pipe["transformer"]._forward_pre_hooks
    finally:
        offload.remove()


def test_a_generation_that_raises_still_reports(monkeypatch):
    pipe = {"transformer": TinyNet().eval()}
    offload = ddo.enable_pipeline_offload(pipe, **STREAM_ALL)
    try:
        gen = offload.generation()
        ids = torch.full((1, 2), 1000, dtype=torch.long)  # the embedding has 64 rows
        with pytest.raises(IndexError), torch.no_grad(), gen:
            pipe["transformer"](ids)
        assert [s["calls"] for s in gen.report["stages"]] == [1]  # ended by the forward hook
        assert not pipe["transformer"]._forward_hooks
    finally:
        offload.remove()

