"""Tiny models for the tests (random weights, CPU, fp32)."""

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


def tiny_inputs(batch=2, seq=8, vocab=64):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def clone_model(model):
    import copy

    return copy.deepcopy(model)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
