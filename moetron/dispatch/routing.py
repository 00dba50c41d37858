"""Routing: the one representation of a routing decision, from router to combine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """Which experts each token goes to, and with what weight.

    `topk_idx [T,k]` int64 holds global expert ids, -1 where the slot was dropped
    (capacity); `topk_weights [T,k]` fp32 are the gate weights (0 where dropped);
    `tokens_per_expert [E]` int64 counts the kept slots, on the tokens' device so no
    host sync is needed. Dispatchers, experts and combine consume exactly this.
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_experts: int
    capacity: int | None = None  # slots per expert when a capacity factor is set

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_idx.shape[1]

    @classmethod
    def from_topk(cls, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                  capacity: int | None = None) -> "Routing":
        """Build a Routing from indices (-1 = dropped) and weights, counting tokens per expert."""
        kept = topk_idx[topk_idx >= 0]
        counts = torch.bincount(kept, minlength=num_experts)
        weights = topk_weights.float().masked_fill(topk_idx < 0, 0.0)
        return cls(topk_idx, weights, counts, num_experts, capacity)
