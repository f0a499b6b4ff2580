"""Tiny models for the tests (random weights, CPU, fp32)."""

import textwrap

import torch
from torch import nn


class TinyNet(nn.Module):
    """Embedding -> Linear blocks -> Conv2d head: one of each intercepted op family."""

    def __init__(self, vocab=64, dim=32, blocks=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.conv = nn.Conv2d(1, 4, kernel_size=3, padding=1)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        h = self.norm(h) * self.scale
        return self.conv(h.unsqueeze(1))


def import_sdnq_oracle():
    """The ``sdnq`` package (0.2.8, python/requirements-test.txt), the oracle of the SDNQ tests, or
    a skip saying why. A ``sdnq`` without the package's entry point is the repository's own
    ``sdnq/`` source folder, imported as a namespace package because the package is missing from
    the path (pytest run as ``python -m pytest`` from the root puts the root first)."""
    import pytest

    sdnq = pytest.importorskip(
        "sdnq", reason="the sdnq package (pip install sdnq==0.2.8, python/requirements-test.txt) "
        "is the oracle of these tests"
    )
    if not hasattr(sdnq, "sdnq_post_load_quant"):
        pytest.skip(
            f"'import sdnq' found {list(getattr(sdnq, '__path__', []))}, not the sdnq package: "
            "install sdnq==0.2.8 (python/requirements-test.txt)", allow_module_level=True
        )
    return sdnq


def tiny_inputs(batch=2, seq=8, vocab=64):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def clone_model(model):
    import copy

    return copy.deepcopy(model)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def quantizable_flux():
    """A one-block FluxTransformer2DModel (float32, eval) whose Linears mostly qualify for
    quantize= (dimensions of 128 and 512); x_embedder and proj_out, under 16384 weights, stay
    dense. Imports diffusers, which the tests that call it require."""
    import diffusers

    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=64,
        num_attention_heads=2, joint_attention_dim=128, pooled_projection_dim=128,
        axes_dims_rope=[16, 24, 24],
    ).eval()


def tiny_flux_inputs(seed=2, dtype=torch.float32):
    """Inputs of the tiny FluxTransformer2DModel the loader tests write (in_channels=4,
    joint_attention_dim=32): 16 image and 8 text tokens."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 16, 4, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(dtype),
        pooled_projections=torch.randn(1, 32, generator=g).to(dtype),
        timestep=torch.tensor([0.5]).to(dtype),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
    )


# The start of a child process that measures its own peak RSS: status_kb(field) reads
# /proc/self/status, and `before` is the RSS after VmHWM (the peak) was reset to it.
RSS_PREAMBLE = textwrap.dedent(
    """
    import sys, torch, ddo, diffusers
    torch.set_num_threads(1)

    def status_kb(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    before = status_kb("VmRSS")
    """
)
