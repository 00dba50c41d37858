"""MoELayer: router → dispatch → experts → combine (+ shared experts), usable on its own.

    from moetron import MoELayer, MoEConfig
    layer = MoELayer(MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2))
    y = layer(x)            # x [..., 64] -> y [..., 64]

The four stages are separate methods (DESIGN principle 5) so a pipeline schedule
can run them one at a time; `forward` simply chains them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetron.dispatch.base import LocalDispatcher, TokenDispatcher
from moetron.dispatch.routing import Routing
from moetron.model.mlp import MLP
from moetron.moe.config import MoEConfig
from moetron.moe.experts import GroupedExperts
from moetron.moe.router import TopKRouter


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig, dispatcher: TokenDispatcher | None = None):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.ffn_hidden_size,
                                      config.expert_backend, config.init_std)
        self.shared_experts = (MLP(config.hidden_size, config.shared_expert_ffn_size, config.init_std)
                               if config.shared_expert_ffn_size else None)
        self.shared_expert_gate = (nn.Linear(config.hidden_size, 1, bias=False)
                                   if config.shared_expert_gate else None)
        self.dispatcher = dispatcher or LocalDispatcher(config.num_experts, pad_to_capacity=config.pad_to_capacity)
        self.register_buffer("pending_counts", torch.zeros(config.num_experts, dtype=torch.float32),
                             persistent=False)
        self.last_losses: dict[str, torch.Tensor] = {}
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_dropped_fraction: torch.Tensor | None = None

    # --- the four schedulable stages -------------------------------------------------
    def route(self, x_TH: torch.Tensor, seq_len: int | None = None) -> Routing:
        routing, losses, selected_counts = self.router(x_TH, seq_len)
        self.last_losses = losses.values
        self.last_tokens_per_expert = routing.tokens_per_expert.detach()
        total = max(routing.num_tokens * routing.top_k, 1)
        self.last_dropped_fraction = 1.0 - routing.tokens_per_expert.sum().float() / total
        if self.training:
            self.pending_counts += selected_counts.float()
        return routing

    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return self.dispatcher.dispatch(x_TH, routing)

    def compute_experts(self, x_NH: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        return self.experts(x_NH, rows_per_expert)

    def combine(self, y_NH: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.dispatcher.combine(y_NH, handle)

    def shared(self, x_TH: torch.Tensor) -> torch.Tensor:
        out = self.shared_experts(x_TH)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x_TH)) * out
        return out

    # ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.config.hidden_size:
            raise ValueError(f"MoELayer expects x[..., {self.config.hidden_size}], got shape {tuple(shape)}")
        x_TH = x.reshape(-1, shape[-1])
        seq_len = shape[-2] if x.dim() >= 3 else None
        routing = self.route(x_TH, seq_len)
        x_NH, rows_per_expert, handle = self.dispatch(x_TH, routing)
        out_TH = self.combine(self.compute_experts(x_NH, rows_per_expert), handle)
        if self.shared_experts is not None:
            out_TH = out_TH + self.shared(x_TH)
        return out_TH.view(shape)

    # --- balancing and statistics -----------------------------------------------------
    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        """Detached values of this layer's balancing losses from the last forward."""
        return dict(self.last_losses)

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> torch.Tensor | None:
        """Aux-loss-free balancing step, once per global batch: `bias += rate * sign(mean - count)`.

        Counts are the top-k selections since the last call, summed over `group`
        (the data-parallel group) when given. Returns the counts used.
        """
        counts = self.pending_counts.clone()
        self.pending_counts.zero_()
        self.router.reset_global_counts()
        if self.router.expert_bias is None:
            return counts
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        self.router.expert_bias += self.config.bias_update_rate * torch.sign(counts.mean() - counts)
        return counts

    def stats(self) -> dict[str, float]:
        """Load of the last forward: max and mean tokens per expert, and the dropped fraction."""
        if self.last_tokens_per_expert is None:
            return {}
        counts = self.last_tokens_per_expert.float()
        mean = counts.mean().item()
        return {"max_load": counts.max().item(), "mean_load": mean,
                "max_over_mean": counts.max().item() / mean if mean else 0.0,
                "dropped_fraction": float(self.last_dropped_fraction)}
