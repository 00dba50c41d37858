"""The gated SwiGLU MLP: dense layers and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moetron.ops import recompute
from moetron.ops import swiglu
from moetron.ops.linear import project, project_many


class MLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, with Hugging Face's parameter names.

    `checkpointed` (set by the decoder layer from the recompute options `mlp` / `shared_experts`)
    runs every call under an activation checkpoint. It is applied in `__call__`, so subclasses that
    replace `forward` (the tensor-parallel MLP) are checkpointed the same way.
    """

    checkpointed = False

    def __init__(self, hidden_size: int, ffn_hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, std=init_std)

    def __call__(self, *args, **kwargs):
        if self.checkpointed:
            return recompute.checkpoint(super().__call__, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, swiglu(*project_many([self.gate_proj, self.up_proj], x)))
