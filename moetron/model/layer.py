"""DecoderLayer: pre-norm attention and MLP/MoE blocks with residuals.

The attention half and the MLP half are separate calls (`attention_block`,
`mlp_block`) so pipeline schedules can run them apart; an MoE MLP further exposes
route / dispatch / experts / combine through `self.mlp`.
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.config import ModelConfig
from moetron.model.attention import GroupedQueryAttention, MultiLatentAttention
from moetron.model.mlp import MLP
from moetron.model.norm import RMSNorm
from moetron.moe.layer import MoELayer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiLatentAttention(cfg) if cfg.attention_type == "mla" else GroupedQueryAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = MoELayer(cfg.moe_config()) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size,
                                                                       cfg.init_std)

    def attention_block(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return h + self.self_attn(self.input_layernorm(h), rope)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.mlp_block(self.attention_block(h, rope))
