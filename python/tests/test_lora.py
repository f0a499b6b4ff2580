"""LoRA as users apply it, on the sim device: diffusers' load_lora_adapter (through PEFT) on a
small FluxTransformer2DModel before and after enable_offload, fusing and unfusing while attached,
several adapters, and the rules behind them (docs/guide.md, "LoRA and other adapters"): adapters
are resident (Note [Adapter modules] in core/src/planner_patterns.cpp), autograd at run time
decides what is trained (Note [Training under offload] in torch/src/attach_plan.cpp), and writes
through .data reach the streamed copies (python/ddo/adapters.py). Every result is compared with
the same model run resident; the LoRA state dicts are made here (nothing is downloaded)."""

import copy

import pytest
import torch
from torch import nn

import ddo
from conftest import STREAM_ALL
from helpers import tiny_flux_inputs

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]


def flux():
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=64,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=[16, 16, 32],
    ).eval()


def inputs():
    return tiny_flux_inputs()


def lora_state_dict(model, seed, rank=4):
    """A LoRA for `model` in the format diffusers' load_lora_adapter reads
    (``transformer.<module>.lora_A.weight``), with random nonzero A and B."""
    shadow = copy.deepcopy(model)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS)
    peft.inject_adapter_in_model(config, shadow)
    g = torch.Generator().manual_seed(seed)
    return {
        "transformer." + k: torch.randn(v.shape, generator=g) * 0.2
        for k, v in peft.get_peft_model_state_dict(shadow).items()
    }


def model_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def card(model):
    # A sim card that holds the staging of the streamed model, a small headroom and the
    # adapters, not the model twice: every weight streams (STREAM_ALL), so fused weights kept on
    # the device instead of streamed would not fit.
    size = model_bytes(model) / 2**30
    return dict(STREAM_ALL, sim_device_capacity_gb=1.5 * size, auto_vram_headroom_gb=size / 16)


_attached = []


@pytest.fixture(autouse=True)
def remove_offloads():
    # On the sim every CPU allocation counts against the card while an offload is active: a test
    # that fails attached must not fail the next ones.
    yield
    while _attached:
        _attached.pop().remove()


def attach(model, **options):
    offload = ddo.enable_offload(model, **options)
    _attached.append(offload)
    return offload


def pair():
    model = flux()
    return model, copy.deepcopy(model)


def both(models, fn):
    for m in models:
        fn(m)


def run(model):
    with torch.no_grad():
        return model(**inputs()).sample


def assert_same(model, reference):
    torch.testing.assert_close(run(model), run(reference), rtol=1e-5, atol=1e-6)


def streamed_lora_bases(model):
    return [m.base_layer.weight for m in model.modules() if hasattr(m, "base_layer")]


def load(models, seed=1, name="a", state_dict=None):
    # One state dict for both (the models are equal); made before an attach by a caller that
    # loads while attached: on the sim every CPU allocation counts against the card then.
    state_dict = state_dict or lora_state_dict(models[0], seed)
    for m in models:
        m.load_lora_adapter(dict(state_dict), prefix="transformer", adapter_name=name)


def test_an_adapter_loaded_before_attach_in_training_mode_runs_resident_and_as_resident():
    model, reference = pair()
    load((model, reference))
    lora = [m for n, m in model.named_modules() if n.endswith("lora_A.a")]
    # diffusers leaves the injected modules in training mode, weights requiring grad.
    assert lora and all(m.training and m.weight.requires_grad for m in lora)
    offload = attach(model, **card(model))
    assert all(ddo._C.is_managed(w) for w in streamed_lora_bases(model))
    assert not any(ddo._C.is_managed(m.weight) for m in lora)
    decision = next(d for d in offload.report()["decisions"] if d["name"] == "adapters_resident")
    lora_bytes = sum(
        p.numel() * 4 for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n
    )
    assert decision["inputs"]["bytes"] == lora_bytes, decision
    for _ in range(2):
        assert_same(model, reference)
    assert offload.report()["run"]["intercepted_ops"] > 0
    offload.remove()
    assert_same(model, reference)


def test_adapters_train_on_a_streamed_base_with_the_resident_gradients():
    # What load_lora_adapter leaves is a model whose adapters may be trained: autograd enabled,
    # the frozen base streamed, the resident adapters get the resident model's gradients.
    model, reference = pair()
    load((model, reference))
    offload = attach(model, **card(model))
    for m in (model, reference):
        m(**inputs()).sample.square().sum().backward()
    grads = 0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is not None:
            grads += 1
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert grads == len([n for n, _ in model.named_parameters() if ".lora_" in n])
    offload.remove()


def test_a_streamed_weight_the_host_trains_is_refused_when_autograd_runs():
    model, reference = pair()
    load((model, reference))
    model.proj_out.base_layer.requires_grad_(True)  # the host means to fine-tune it
    model.train()
    offload = attach(model, **card(model))  # attaching is not training
    assert ddo._C.is_managed(model.proj_out.base_layer.weight)
    streamed = sum(ddo._C.is_managed(p) for p in model.proj_out.base_layer.parameters())
    assert offload.report()["run"]["weights_trainable"] == streamed
    reference.train()
    assert_same(model, reference)  # inference under no_grad runs
    with torch.inference_mode():
        model(**inputs())
    with pytest.raises(RuntimeError) as err:
        model(**inputs()).sample.sum().backward()
    text = str(err.value)
    assert "proj_out.base_layer.weight" in text and "autograd" in text, text
    assert "torch.no_grad()" in text and "always_resident_modules_pattern" in text, text
    offload.remove()
    assert model.proj_out.base_layer.weight.requires_grad


def test_an_adapter_loaded_after_attach_is_placed_at_the_next_forward():
    model, reference = pair()
    first, second = lora_state_dict(model, 1), lora_state_dict(model, 3)
    offload = attach(model, **card(model))
    assert_same(model, reference)
    load((model, reference), state_dict=first)
    assert_same(model, reference)
    assert not model._forward_pre_hooks  # placed: the watch's hook is gone again
    added = offload.report()["python"]["adapters_added"]
    lora = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert added == {"tensors": len(lora), "bytes": sum(p.numel() * 4 for p in lora)}
    load((model, reference), name="b", state_dict=second)  # a second one into the watched ModuleDicts
    both((model, reference), lambda m: m.set_adapters(["a", "b"], [0.7, 0.4]))
    assert_same(model, reference)
    assert offload.report()["python"]["adapters_added"]["tensors"] == 2 * len(lora)
    offload.remove()
    assert_same(model, reference)


def test_a_tensor_added_after_attach_outside_an_adapter_asks_to_attach_again():
    model, _ = pair()
    offload = attach(model, **card(model))
    run(model)
    assert not model._forward_pre_hooks  # no hook while nothing was added
    model.transformer_blocks[0].extra = nn.Linear(4, 4)
    for _ in range(2):  # every forward, until the user attaches again
        with pytest.raises(RuntimeError) as err:
            run(model)
        text = str(err.value)
        assert "transformer_blocks.0.extra.weight" in text and "enable_offload again" in text
    offload.remove()
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("safe", [False, True])
def test_fuse_unfuse_and_unload_while_attached_reach_the_streamed_copies(safe):
    model, reference = pair()
    load((model, reference))
    base = copy.deepcopy(reference)
    base.unload_lora()
    offload = attach(model, **card(model))
    assert_same(model, reference)
    before = model.proj_out.base_layer.weight.detach().clone()
    both((model, reference), lambda m: m.fuse_lora(safe_fusing=safe))
    # The values landed in the streamed weights' host copies: still streamed, changed.
    bases = streamed_lora_bases(model)
    assert all(ddo._C.is_managed(w) for w in bases)
    assert not torch.equal(model.proj_out.base_layer.weight, before)
    for _ in range(2):
        assert_same(model, reference)
    assert offload.report()["run"]["weights_changed_in_place"] > 0
    both((model, reference), lambda m: m.unfuse_lora())
    assert_same(model, reference)
    both((model, reference), lambda m: m.fuse_lora(safe_fusing=safe))
    both((model, reference), lambda m: m.unload_lora())  # keeps the fused values
    assert_same(model, reference)
    assert not any(".lora_" in n for n, _ in model.named_parameters())
    offload.remove()
    assert_same(model, reference)
    with torch.no_grad():
        assert not torch.allclose(run(model), run(base))  # the fuse was not lost


def test_adapter_controls_while_attached_match_the_resident_model():
    model, reference = pair()
    load((model, reference), seed=1, name="a")
    load((model, reference), seed=3, name="b")
    offload = attach(model, **card(model))
    steps = [
        lambda m: m.set_adapters(["a", "b"], [1.0, 0.5]),
        lambda m: m.set_adapters("b", 0.3),
        lambda m: m.disable_lora(),
        lambda m: m.enable_lora(),
        lambda m: m.set_adapters(["a", "b"], [0.2, 1.0]),
        lambda m: m.delete_adapters("a"),
    ]
    outputs = []
    for step in steps:
        both((model, reference), step)
        assert_same(model, reference)
        outputs.append(run(reference))
    assert not torch.allclose(outputs[0], outputs[1]) and not torch.allclose(outputs[1], outputs[2])
    assert offload.report()["python"]["adapters_added"]["tensors"] == 0
    offload.remove()
    assert_same(model, reference)


def streamed_linears():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]).eval()
    reference = copy.deepcopy(model)
    return model, reference


@torch.no_grad()
def test_writes_through_data_are_seen_and_a_reshaping_one_is_refused_by_name():
    model, reference = streamed_linears()
    offload = attach(model, **STREAM_ALL)
    x = torch.randn(4, 32)
    for _ in range(3):  # the trace is learned; later units are prefetched across steps
        torch.testing.assert_close(model(x), reference(x))
    for m in (model, reference):
        m[0].weight.data += 0.5  # PEFT's merge
        m[1].weight.data.mul_(-1.0)
        m[2].weight.data = torch.full((32, 32), 0.01)  # PEFT's safe merge
    assert ddo._C.is_managed(model[2].weight)  # still streamed, not silently dropped
    torch.testing.assert_close(model(x), reference(x))
    # `weight.data += d` writes the host copy once: the in-place add, not also a copy of the
    # result onto itself (one version step, where a second write would make two).
    version = model[0].weight._version
    model[0].weight.data += 0.25
    reference[0].weight.data += 0.25
    assert model[0].weight._version == version + 1
    torch.testing.assert_close(model(x), reference(x))
    assert type(model[0].weight) is not nn.Parameter and isinstance(model[0].weight, nn.Parameter)
    with pytest.raises(RuntimeError, match=r"'1\.weight\.data = t'.*shape \(32, 32\)"):
        model[1].weight.data = torch.zeros(16, 32)
    offload.remove()
    assert type(model[0].weight) is nn.Parameter
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(p, q), name


# -- on a CUDA card (skipped, saying so, without one) ---------------------------------------------

def profiled_run(model, name, calibrate, cap_gb):
    """One generation under the named profile `name` on a sim card of `cap_gb` (profile_run's
    report, the run's report, the output)."""
    offload = attach(model, preset="auto", profile_name=name, build_profile=calibrate,
                     execution_device="sim", vram_cap_gb=cap_gb, small_tensor_threshold_bytes=0,
                     profile_vram_headroom_gb=0.0, show_profile=False)
    with offload.profile_run() as profile_report:
        out = run(model)
    report = offload.report()
    offload.remove()
    _attached.remove(offload)
    return profile_report, report, out


def test_a_named_profile_calibrated_with_one_adapter_holds_the_cap_after_switching_to_a_larger(
        profile_dir):
    # Adapters are not part of a profile's identity (docs/design/0007-named-profiles.md),
    # so one name serves a generation with adapter A (rank 4) and, after a switch, one with B
    # (rank 16, four times A's resident bytes). The profile's budget was measured with A resident
    # on top of it; B's extra bytes must come out of that budget, not out of the card.
    model, reference = pair()
    a = lora_state_dict(model, 1, rank=4)
    b = lora_state_dict(model, 2, rank=16)
    # 1.6 times the model: the calibration's peak (every weight streamed) leaves a budget that
    # holds some blocks but not all, so the budget, not the card, decides what is resident.
    cap_gb = 1.6 * model_bytes(model) / 2**30
    load((model,), state_dict=a, name="a")
    saved, calibration, _ = profiled_run(model, "lora-switch", True, cap_gb)
    assert saved["status"] == "saved", saved
    a_bytes = next(d for d in calibration["decisions"]
                   if d["name"] == "adapters_resident")["inputs"]["bytes"]

    model.unload_lora()  # the switch: A goes, B comes
    load((model, reference), state_dict=b, name="b")
    expected = run(reference)  # before the attach: on the sim every CPU allocation counts then
    applied, report, out = profiled_run(model, "lora-switch", False, cap_gb)
    assert applied["status"] == "applied", applied
    decisions = {d["name"]: d for d in report["decisions"]}
    b_bytes = decisions["adapters_resident"]["inputs"]["bytes"]
    assert b_bytes == 4 * a_bytes, (b_bytes, a_bytes)
    # Note [Adapters under a saved profile]: B's bytes come out of the saved recommendation.
    profile = decisions["resident_budget_profile"]["inputs"]
    assert profile["adapter_bytes"] == b_bytes, profile
    assert profile["budget_bytes"] == profile["profile_budget_bytes"] - b_bytes, profile
    assert report["plan"]["resident_budget_bytes"] <= profile["budget_bytes"], report["plan"]
    assert 0 < report["run"]["peak_vram_gb"] <= cap_gb, (report["run"], applied)
    assert 0 < applied["run_peak_vram_gb"] <= cap_gb, applied
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def run_on(model, device):
    with torch.no_grad():
        return model(**{k: v.to(device) for k, v in inputs().items()}).sample


@needs_cuda
@pytest.mark.parametrize("safe", [False, True])
def test_on_cuda_adapters_before_and_after_attach_fuse_and_unfuse_match_the_resident_model(safe):
    # The adapters' matrices live on the card while the base weights stream from the host: the
    # fuse computes each delta on the card and writes it into the host copy (HostData).
    model = flux()
    reference = copy.deepcopy(model).cuda()
    a, b = lora_state_dict(model, 1), lora_state_dict(model, 2)
    for m in (model, reference):
        m.load_lora_adapter(dict(a), prefix="transformer", adapter_name="a")  # before the attach
    offload = attach(model, **dict(STREAM_ALL, execution_device="cuda"))

    def same():
        torch.testing.assert_close(run_on(model, "cuda"), run_on(reference, "cuda"),
                                   rtol=1e-4, atol=1e-5)

    same()
    for m in (model, reference):
        m.load_lora_adapter(dict(b), prefix="transformer", adapter_name="b")  # after the attach
        m.set_adapters(["a", "b"], [1.0, 0.5])
    same()
    assert offload.report()["python"]["adapters_added"]  # the second adapter, placed
    allocated = torch.cuda.memory_allocated()
    for m in (model, reference):
        m.fuse_lora(safe_fusing=safe)
    same()
    # The fused values went to the host copies: the streamed model holds no fused weight on the
    # card (the reference, resident, changed its own weights in place).
    assert torch.cuda.memory_allocated() - allocated < model_bytes(model) / 4
    assert all(not w.is_cuda for w in streamed_lora_bases(model))
    for m in (model, reference):
        m.unfuse_lora()
    same()
    for m in (model, reference):
        m.unload_lora()
    same()
