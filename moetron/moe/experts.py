"""GroupedExperts: all routed experts as 3-D weights, computed through one grouped GEMM."""

from __future__ import annotations

import torch
from torch import nn

from moetron.moe.grouped_gemm import grouped_linear
from moetron.ops import swiglu


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as `gate_up_proj [E,2F,H]` (gate rows first) and `down_proj [E,H,F]`.

    The layout is transformers 5's fused one, so checkpoints map without reshuffling.
    Input rows arrive expert-major with `rows_per_expert [E]`, as `permute` produces.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 backend: str = "auto", init_std: float = 0.02):
        super().__init__()
        self.num_experts, self.ffn_hidden_size, self.backend = num_experts, ffn_hidden_size, backend
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        nn.init.normal_(self.gate_up_proj, std=init_std)
        nn.init.normal_(self.down_proj, std=init_std)

    def forward(self, x_NH: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up = grouped_linear(x_NH, self.gate_up_proj, rows_per_expert, self.backend)
        gate, up = gate_up.split(self.ffn_hidden_size, dim=-1)
        return grouped_linear(swiglu(gate, up), self.down_proj, rows_per_expert, self.backend)
