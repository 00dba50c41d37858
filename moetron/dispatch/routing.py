"""Routing: the one representation of a routing decision, from router to combine.

Shape suffixes, used in tensor names across moetron's hot code (written once, here):
    T tokens    H hidden size    K top-k (slots per token)    E experts (global; local where noted)
    N routed rows (one per kept (token, expert) slot, grouped by expert; padded where asked)
    F expert ffn size    S sequence    B batch    R ranks / received rows    G groups
e.g. `x_TH [T,H]`, `topk_idx_TK [T,K]`, `x_NH [N,H]`, `w1_EFH [E,F,H]`.
"""

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
    dropless: bool = False  # promised: no -1 slots (lets permute skip its check, a host sync)

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_idx.shape[1]

    @classmethod
    def from_topk(cls, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                  capacity: int | None = None, dropless: bool = False,
                  counts: torch.Tensor | None = None) -> "Routing":
        """Build a Routing from indices (-1 = dropped) and weights, counting tokens per expert.
        `dropless=True` promises that `topk_idx` holds no -1 (the router knows; checking would sync);
        then `counts` may be the router's own `count_per_expert(topk_idx)`, and no weight needs masking
        (on a GPU each op skipped is a launch the host no longer waits for)."""
        if counts is None or not dropless:
            counts = count_per_expert(topk_idx, num_experts)
        weights = topk_weights.float()
        if not dropless:
            weights = weights.masked_fill(topk_idx < 0, 0.0)
        return cls(topk_idx, weights, counts, num_experts, capacity, dropless)


def count_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 `[E]` count of each expert id in `topk_idx`, -1 ignored, without a host sync
    (`torch.bincount` and boolean indexing both read a size on the host)."""
    flat = topk_idx.reshape(-1)
    kept = (flat >= 0).to(torch.int64)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.clamp_min(0), kept)
