"""Training and in-place writes under offload, on the sim device.

Streamed weights are inference-only (Note [Training under offload] in torch/src/attach_plan.cpp):
a streamed weight that requires grad while the host froze others is refused by the first op that
reads it with autograd enabled, naming it; adapters trained on a frozen, streamed base get the
gradients the resident model gives.
An in-place write to a streamed weight reaches the next forward (Note [Weights changed in place]
in torch/src/intercept_common.h)."""

import pytest
import torch
from torch import nn

import ddo
from conftest import STREAM_ALL


class LoraLinear(nn.Module):
    """A base Linear plus a low-rank adapter, as PEFT builds one."""

    def __init__(self, dim, rank=4):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)  # nonzero, so every gradient is too

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoraNet(nn.Module):
    def __init__(self, dim=32, blocks=3):
        super().__init__()
        self.blocks = nn.ModuleList(LoraLinear(dim) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def lora_pair():
    model = LoraNet()
    reference = LoraNet()
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        for b in m.blocks:
            b.base.requires_grad_(False)
    return model, reference


ADAPTERS_RESIDENT = dict(STREAM_ALL, always_resident_modules_pattern=[r".*\.lora_[ab]$"])


def test_adapters_the_plan_would_stream_are_refused_when_autograd_runs_naming_them():
    # A frozen base and trainable adapters, in training mode, that the plan streams (these are
    # not PEFT's lora_A / lora_B, which the planner keeps resident): attaching and running
    # inference is fine; a step with autograd enabled would train them and is refused.
    model, reference = lora_pair()
    model.train()
    offload = ddo.enable_offload(model, **STREAM_ALL)
    assert ddo._C.is_managed(model.blocks[0].lora_a.weight)
    assert offload.report()["run"]["weights_trainable"] == 6  # lora_a and lora_b of 3 blocks
    x = torch.randn(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    with pytest.raises(RuntimeError) as err:
        model(x).sum().backward()
    text = str(err.value)
    assert "autograd" in text and "blocks.0.lora_a.weight" in text, text
    assert "always_resident_modules_pattern" in text and "torch.no_grad()" in text, text
    offload.remove()
    # Nothing trained: the model is what it was, its adapters still train.
    for (k, v), (_, r) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(v, r) and not ddo._C.is_managed(v), k
    assert all(p.requires_grad for b in model.blocks for p in b.lora_a.parameters())


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_untouched_model_is_frozen_for_inference_and_warns_once_under_autograd(mode):
    # Every parameter requires grad and modules start in training mode by default: nothing says
    # "train", so the streamed weights are frozen while attached and remove() restores them.
    model = getattr(LoraNet(), mode)()
    offload = ddo.enable_offload(model, **STREAM_ALL)
    managed = [p for p in model.parameters() if ddo._C.is_managed(p)]
    assert managed and not any(p.requires_grad for p in managed)
    assert offload.report()["run"]["weights_frozen"] == len(managed)
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x)  # no autograd: no warning
    with pytest.warns(UserWarning, match="frozen at attach") as caught:
        model(x)
        model(x)
    assert sum("frozen at attach" in str(w.message) for w in caught) == 1
    offload.remove()
    assert all(p.requires_grad for p in model.parameters())


def test_adapters_on_a_frozen_streamed_base_get_the_resident_gradients():
    model, reference = lora_pair()
    model.train()
    reference.train()
    offload = ddo.enable_offload(model, **ADAPTERS_RESIDENT)
    bases = [b.base.weight for b in model.blocks]
    assert all(ddo._C.is_managed(w) for w in bases)  # else the test would not test streaming
    assert not any(ddo._C.is_managed(b.lora_a.weight) for b in model.blocks)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        x = torch.randn(4, 32, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        for m, o, inp in ((model, opt, x), (reference, ref_opt, x_ref)):
            o.zero_grad()
            m(inp).square().sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if q.requires_grad:
                assert p.grad is not None, name
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        # Gradients also reach the input through the streamed base weights.
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
    assert offload.report()["run"]["intercepted_ops"] > 0
    offload.remove()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def streamed_pair():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).eval()
    reference = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).eval()
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize("write", ["mul_", "copy_", "load_state_dict", "init", "detached"])
@torch.no_grad()
def test_in_place_writes_reach_the_next_forward(write):
    model, reference = streamed_pair()
    offload = ddo.enable_offload(model, **STREAM_ALL)
    x = torch.randn(8, 32)
    for _ in range(3):  # the trace is learned and later units are prefetched across steps
        torch.testing.assert_close(model(x), reference(x))
    before = reference(x)
    for m in (model, reference):
        torch.manual_seed(1)
        if write == "mul_":
            m[1].weight.mul_(2.0)
        elif write == "copy_":
            m[2].weight.copy_(torch.linspace(-1, 1, 32 * 32).reshape(32, 32))
        elif write == "load_state_dict":
            m.load_state_dict({k: v * 0.5 for k, v in reference.state_dict().items()})
        elif write == "init":
            nn.init.uniform_(m[0].weight)
        else:
            m[3].weight.detach().add_(1.0)
    assert not torch.allclose(reference(x), before)  # else a stale copy would pass
    for _ in range(2):
        torch.testing.assert_close(model(x), reference(x))
    assert offload.report()["run"]["weights_changed_in_place"] > 0
    offload.remove()
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(p, q), name


@torch.no_grad()
def test_a_write_through_one_of_two_parameters_sharing_storage_is_seen():
    model, reference = streamed_pair()
    shared = nn.Parameter(model[0].weight.detach())  # a second Parameter object, same storage
    model[3].weight = shared
    reference[3].weight = nn.Parameter(reference[0].weight.detach())
    offload = ddo.enable_offload(model, **STREAM_ALL)
    x = torch.randn(8, 32)
    for _ in range(3):
        torch.testing.assert_close(model(x), reference(x))
    model[3].weight.mul_(3.0)
    reference[3].weight.mul_(3.0)
    torch.testing.assert_close(model(x), reference(x))
    offload.remove()
