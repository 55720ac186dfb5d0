"""The dense MLP (a layer's, and DeepSeek-V3's shared experts): SwiGLU or GeLU."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Activation(nn.Module):
    """The MLP's nonlinearity, a module so selective recompute can checkpoint it."""

    def __init__(self, mlp: str):
        super().__init__()
        self.mlp = mlp

    def forward(self, gate, up=None):
        return F.silu(gate) * up if self.mlp == "swiglu" else F.gelu(gate)


class FeedForward(nn.Module):
    """A dense MLP: SwiGLU (w1 gate, w3 up, w2 down) or GeLU (w1 up, w2 down)."""

    def __init__(self, hidden: int, ffn: int, mlp: str):
        super().__init__()
        self.mlp = mlp
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        if mlp == "swiglu":
            self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.act = Activation(mlp)

    def forward(self, x):
        if self.mlp == "swiglu":
            return self.w2(self.act(self.w1(x), self.w3(x)))
        return self.w2(self.act(self.w1(x)))


def mlp_kind(cfg) -> str:
    return cfg.mlp.value
