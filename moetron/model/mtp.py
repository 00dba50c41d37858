"""Multi-token prediction (DeepSeek-V3): module k predicts the token k+1 ahead.

Module k combines the previous depth's hidden state with the embedding of the
token k positions ahead, `h = eh_proj([enorm(emb(t[i+k])); hnorm(h_prev)])`, runs
one decoder layer and predicts `t[i+k+1]` through the shared output head after
its own final norm. The embedding-first concatenation is the order of the
released checkpoints' `eh_proj`.
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.config import ModelConfig
from moetron.model.layer import DecoderLayer
from moetron.ops.norm import RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        self.depth = depth  # 1-based: predicts depth+1 tokens ahead
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        nn.init.normal_(self.eh_proj.weight, std=cfg.init_std)
        self.layer = DecoderLayer(cfg, cfg.num_layers + depth - 1)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h_prev: torch.Tensor, future_emb: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(hidden for the next depth, normed hidden for the output head)`."""
        h = self.eh_proj(torch.cat((self.enorm(future_emb), self.hnorm(h_prev)), dim=-1))
        h = self.layer(h, rope)
        return h, self.final_norm(h)


def shift_left(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """`t[:, i+k]` at position i; the last k positions are `fill`."""
    if k == 0:
        return t
    return torch.cat((t[:, k:], t.new_full((t.shape[0], k), fill)), dim=1)
