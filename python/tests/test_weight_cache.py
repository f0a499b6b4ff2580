"""Repeat generations in one process: with cache_pinned_weights (the warm_process
preset) a second attach of the same model reuses the pinned host slabs -- nothing pinned, nothing
copied -- and the plan; a weight changed in place is not served stale; two models share the cache
without mixing; a small RAM budget evicts; clearing works; outputs stay equal throughout."""

import pytest
import torch
from torch import nn

import ddo
from ddo import _C
from conftest import STREAM_ALL
from helpers import TinyNet, snapshot, tiny_inputs


def cached(namespace, **extra):
    return dict(
        STREAM_ALL,
        cache_pinned_weights=True,
        pinned_weight_cache_namespace=namespace,
        pin_cpu_memory=True,
        available_system_ram_gb=16.0,
        system_ram_headroom_gb=0.0,
        **extra,
    )


def weight_cache(offload):
    return offload.report()["setup"]["weight_cache"]


@pytest.fixture(autouse=True)
def empty_caches():
    ddo.clear_pinned_weight_cache()
    ddo.clear_plan_cache()
    yield
    ddo.clear_pinned_weight_cache()
    ddo.clear_plan_cache()


@torch.no_grad()
def test_second_attach_hits_without_pinning_or_copying():
    model = TinyNet().eval()
    ids = tiny_inputs()
    expected = model(ids)
    before = ddo.pinned_weight_cache_stats()

    offload = ddo.enable_offload(model, **cached("py-reuse"))
    first = weight_cache(offload)
    assert first["status"] == "miss"
    assert first["pinned_new_bytes"] > 0
    streamed = offload.report()["setup"]["bytes"]["streamed"]
    assert torch.equal(model(ids), expected)
    offload.remove()
    assert not _C.is_managed(model.blocks[0][0].weight)
    assert torch.equal(model(ids), expected)  # usable on the host, weights in the cached slabs
    ptr = model.blocks[0][0].weight.data_ptr()

    for _ in range(2):
        offload = ddo.enable_offload(model, **cached("py-reuse"))
        report = offload.report()
        assert report["setup"]["weight_cache"]["status"] == "hit", report["setup"]
        assert report["setup"]["weight_cache"]["pinned_new_bytes"] == 0
        assert report["setup"]["weight_cache"]["reused_bytes"] == streamed
        assert report["setup"]["weight_cache"]["refilled_bytes"] == 0
        assert report["setup"]["plan_cached"] is True
        assert model.blocks[0][0].weight.data_ptr() == ptr  # not copied
        assert torch.equal(model(ids), expected)
        offload.remove()
    stats = ddo.pinned_weight_cache_stats()
    assert stats["hits"] == before["hits"] + 2
    assert stats["misses"] == before["misses"] + 1
    assert stats["entries"] == 1 and stats["bytes"] > 0


@torch.no_grad()
def test_warm_process_preset_caches():
    model = TinyNet().eval()
    ids = tiny_inputs()
    expected = model(ids)
    opts = dict(STREAM_ALL, preset="warm_process", available_system_ram_gb=16.0,
                system_ram_headroom_gb=0.0)
    ddo.enable_offload(model, **opts).remove()
    offload = ddo.enable_offload(model, **opts)
    assert weight_cache(offload)["status"] == "hit"
    assert torch.equal(model(ids), expected)
    offload.remove()


@torch.no_grad()
def test_weight_changed_in_place_or_replaced_is_not_served_stale():
    model = TinyNet().eval()
    ids = tiny_inputs()
    ddo.enable_offload(model, **cached("py-stale")).remove()
    model.blocks[0][0].weight.add_(0.25)  # a LoRA merged in place
    model.blocks[1][2].weight.data = model.blocks[1][2].weight.data * 2  # merged by re-pointing
    expected = model(ids)
    offload = ddo.enable_offload(model, **cached("py-stale"))
    wc = weight_cache(offload)
    assert wc["status"] == "hit"
    assert wc["changed_in_place"] >= 1
    assert wc["refilled_bytes"] == model.blocks[1][2].weight.numel() * 4
    assert torch.equal(model(ids), expected)
    offload.remove()
    assert torch.equal(model(ids), expected)


class TextEncoder(TinyNet):
    """Same layout as TinyNet, another class: another cache entry."""


@torch.no_grad()
def test_two_models_share_the_cache_without_mixing():
    a, b = TinyNet().eval(), TextEncoder().eval()
    ids = tiny_inputs()
    ea, eb = a(ids), b(ids)
    assert not torch.equal(ea, eb)
    for round_ in range(3):
        oa = ddo.enable_offload(a, **cached("py-two"))
        ob = ddo.enable_offload(b, **cached("py-two"))
        want = "miss" if round_ == 0 else "hit"
        assert weight_cache(oa)["status"] == want
        assert weight_cache(ob)["status"] == want
        assert torch.equal(a(ids), ea) and torch.equal(b(ids), eb)
        oa.remove()
        ob.remove()
    assert ddo.pinned_weight_cache_stats()["entries"] == 2


@torch.no_grad()
def test_small_ram_budget_evicts_least_recently_used():
    a, b = TinyNet().eval(), TextEncoder().eval()
    ids = tiny_inputs()
    ea, eb = a(ids), b(ids)
    probe = ddo.enable_offload(a, **cached("py-small"))
    probe.remove()
    one = ddo.pinned_weight_cache_stats()["bytes"]
    ddo.clear_pinned_weight_cache()
    # Room for one model's slabs, not two.
    budget_gb = 1.5 * one / 2**30
    before = ddo.pinned_weight_cache_stats()
    ddo.enable_offload(a, **cached("py-small", pin_weight_budget_gb=budget_gb)).remove()
    ddo.enable_offload(b, **cached("py-small", pin_weight_budget_gb=budget_gb)).remove()
    stats = ddo.pinned_weight_cache_stats()
    assert stats["evictions"] == before["evictions"] + 1
    assert stats["entries"] == 1 and stats["bytes"] <= 1.5 * one
    oa = ddo.enable_offload(a, **cached("py-small", pin_weight_budget_gb=budget_gb))
    assert weight_cache(oa)["status"] == "miss"  # a was evicted
    assert torch.equal(a(ids), ea)
    oa.remove()
    assert torch.equal(b(ids), eb)


@torch.no_grad()
def test_clear_and_remove_with_the_flag():
    model = TinyNet().eval()
    ids = tiny_inputs()
    expected = model(ids)
    before = snapshot(model)
    ddo.enable_offload(model, **cached("py-clear")).remove()
    assert ddo.clear_pinned_weight_cache("py-clear") > 0
    assert ddo.clear_pinned_weight_cache("py-clear") == 0
    offload = ddo.enable_offload(model, **cached("py-clear"))
    assert weight_cache(offload)["status"] == "miss"
    offload.remove(clear_weight_cache=True)
    assert ddo.pinned_weight_cache_stats()["entries"] == 0
    for name, value in snapshot(model).items():
        assert torch.equal(value, before[name]), name
    assert torch.equal(model(ids), expected)
    with pytest.raises(TypeError, match="clear_weight_cache"):
        offload.remove(clear_weight_cache="yes")
    with pytest.raises(TypeError, match="namespace"):
        ddo.clear_pinned_weight_cache(5)


@torch.no_grad()
def test_cache_off_replans_and_copies_out():
    model = TinyNet().eval()
    opts = dict(STREAM_ALL, cache_plan=False)
    ddo.enable_offload(model, **opts).remove()
    offload = ddo.enable_offload(model, **opts)
    report = offload.report()
    assert report["setup"]["plan_cached"] is False
    assert report["setup"]["weight_cache"]["status"] == "off"
    offload.remove()
    assert ddo.pinned_weight_cache_stats()["entries"] == 0


@torch.no_grad()
def test_verbose_prints_setup_phases_and_decisions(capfd):
    model = TinyNet().eval()
    ddo.enable_offload(model, **STREAM_ALL).remove()
    assert "ddo: " not in capfd.readouterr().err  # quiet by default
    ddo.enable_offload(model, verbose=True, **STREAM_ALL).remove()
    err = capfd.readouterr().err
    assert "ddo: plan " in err and "ddo: pin " in err and "ddo: setup " in err
    assert "ddo: decision " in err


@torch.no_grad()
def test_show_profile_prints_one_line_at_the_end_of_profile_run(capfd):
    model = TinyNet().eval()
    ids = tiny_inputs()
    offload = ddo.enable_offload(model, profile_name="warm-line", build_profile=True, **STREAM_ALL)
    with offload.profile_run():
        model(ids)
    lines = [l for l in capfd.readouterr().err.splitlines() if l.startswith("ddo profile:")]
    assert len(lines) == 1 and "name=warm-line" in lines[0] and "status=saved" in lines[0]
    offload.remove()
    offload = ddo.enable_offload(model, profile_name="warm-line", show_profile=False, **STREAM_ALL)
    with offload.profile_run():
        model(ids)
    offload.remove()
    assert "ddo profile:" not in capfd.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: residents kept on the "
                    "device need one (the sim device's tensors are host tensors)")
@torch.no_grad()
def test_residents_kept_on_the_gpu_are_not_moved_again():
    model = TinyNet().eval()
    ids = tiny_inputs()
    expected = model(ids)
    options = dict(cached("py-keep"), execution_device="cuda", resident_module_budget_gb=1.0,
                   small_tensor_threshold_bytes=1 << 20)
    offload = ddo.enable_offload(model, **options)
    moved = offload.report()["setup"]["bytes"]
    assert moved["resident"] + moved["move_once"] > 0
    on_first = model(ids.cuda()).cpu()
    torch.testing.assert_close(on_first, expected)  # GPU kernels against the CPU reference
    offload.remove(keep_residents=True)
    on_gpu = [p for p in model.parameters() if p.is_cuda]
    assert on_gpu, "keep_residents left nothing on the GPU"

    offload = ddo.enable_offload(model, **options)
    setup = offload.report()["setup"]
    assert setup["bytes"]["on_device"] == moved["resident"] + moved["move_once"]
    assert setup["bytes"]["resident"] + setup["bytes"]["move_once"] == 0
    assert torch.equal(model(ids.cuda()).cpu(), on_first)
    offload.remove()
    assert not any(p.is_cuda for p in model.parameters())
    assert torch.equal(model(ids), expected)
