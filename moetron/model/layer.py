"""DecoderLayer: pre-norm attention and MLP/MoE blocks with residuals.

The attention half and the MLP half are separate calls (`attention_block`,
`mlp_block`) so pipeline schedules can run them apart; an MoE MLP further exposes
route / dispatch / experts / combine through `self.mlp`.

Activation recomputation (moetron/ops/recompute.py): `self.recompute` is the layer's plan, from
`ModelConfig.recompute_modules` and `recompute_every_n_layers`. A fully recomputed layer runs as
one checkpoint (or one per block when a pipeline calls the blocks apart); otherwise each block
applies the selective options, pushed into the current submodules at every call.
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.config import ModelConfig
from moetron.ops import recompute
from moetron.model.attention import GroupedQueryAttention, MultiLatentAttention
from moetron.ops.mlp import MLP
from moetron.ops.recompute import RecomputableRMSNorm, RecomputePlan
from moetron.moe.layer import MoELayer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RecomputableRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiLatentAttention(cfg) if cfg.attention_type == "mla" else GroupedQueryAttention(cfg)
        self.post_attention_layernorm = RecomputableRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = MoELayer(cfg.moe_config()) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size,
                                                                       cfg.init_std)
        method = cfg.recompute_method if layer_idx < cfg.num_layers else None  # decoder layers, not MTP
        self.recompute = RecomputePlan.for_layer(cfg.recompute_modules, cfg.recompute_every_n_layers, layer_idx,
                                                 method, cfg.recompute_num_layers)

    def attention_block(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        plan = recompute.configure_layer(self)
        if plan.full:  # called apart from forward (a pipeline piece): checkpoint the block
            return recompute.checkpoint(self._attention_block, h, *rope)
        with recompute.saved_outputs("layernorm" in plan.modules):
            return self._attention_block(h, *rope)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        plan = recompute.configure_layer(self)
        if plan.full:
            return recompute.checkpoint(self._mlp_block, h, early_stop=False)
        with recompute.saved_outputs("layernorm" in plan.modules):
            return self._mlp_block(h)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        plan = recompute.configure_layer(self)
        if plan.full:
            return recompute.checkpoint(self._forward, h, *rope, early_stop=False)
        with recompute.saved_outputs("layernorm" in plan.modules):
            return self._forward(h, *rope)

    # --- the computation itself -------------------------------------------------------
    def _forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._mlp_block(self._attention_block(h, cos, sin))

    def _attention_block(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return h + self.self_attn(self.input_layernorm(h), (cos, sin))

    def _mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoELayer) and "moe" in self.recompute.modules:
            # The whole MoE block; early_stop=False so every rank re-runs every collective of it
            # (EP ranks may save different tensors after their last collective).
            return h + recompute.checkpoint(self.mlp, x, early_stop=False)
        return h + self.mlp(x)
