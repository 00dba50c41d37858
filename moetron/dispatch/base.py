"""The dispatcher protocol and the single-process dispatcher.

A dispatcher moves routed tokens to the ranks that hold their experts and back.
`dispatch` returns expert-major rows for the local experts with their counts, plus
a handle; `combine` takes the expert outputs and the handle and returns one
gate-weighted row per source token. Parallel dispatchers (all-gather, all-to-all,
flex) implement the same two calls.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from moetron.dispatch.permute import PermuteState, permute, unpermute
from moetron.dispatch.routing import Routing


class TokenDispatcher(Protocol):
    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return `(expert_input [N,H], rows_per_local_expert [E_local], handle)`."""

    def combine(self, y_NH: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return the gate-weighted sum of expert outputs per source token `[T,H]`."""


class LocalDispatcher:
    """All experts live in this process: dispatch is a permute, combine an unpermute."""

    def __init__(self, num_experts: int, pad_multiple: int = 1, pad_to_capacity: bool = False):
        self.num_experts = num_experts
        self.pad_multiple = pad_multiple
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        x_NH, state = permute(x_TH, routing.topk_idx, self.num_experts,
                              pad_multiple=self.pad_multiple,
                              pad_to=routing.capacity if self.pad_to_capacity else None)
        return x_NH, state.rows_per_expert, (state, routing.topk_weights)

    def combine(self, y_NH: torch.Tensor, handle: tuple[PermuteState, torch.Tensor]) -> torch.Tensor:
        state, weights = handle
        return unpermute(y_NH, state, weights)
