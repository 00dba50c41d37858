"""RMSNorm with a learned scale (Hugging Face parameter name `weight`)."""

from __future__ import annotations

import torch
from torch import nn

from moetron.ops import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
