"""The dispatcher protocol, the single-process dispatcher, and what all dispatchers share.

A dispatcher moves routed tokens to the ranks that hold their experts and back.
`dispatch` returns expert-major rows for the local experts with their counts, plus
a handle; `combine` takes the expert outputs and the handle and returns one
gate-weighted row per source token. Parallel dispatchers (all-gather, all-to-all,
flex) implement the same two calls.

Under expert-tensor parallelism the experts return partial sums (each ETP rank
holds a slice of the ffn dimension); the parallel dispatchers' `combine` adds
them up, so the expert module itself never communicates.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from moetron.dispatch.permute import PermuteState, permute, unpermute
from moetron.dispatch.routing import Routing
from moetron.parallel.state import Group


class TokenDispatcher(Protocol):
    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return `(expert_input [N,H], rows_per_local_expert [E_local], handle)`."""

    def combine(self, y_NH: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return the gate-weighted sum of expert outputs per source token `[T,H]`."""


def rank_and_size(group: Group | dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's index in `group` and the group's size; `None` is a group of one."""
    if group is None:
        return 0, 1
    if isinstance(group, Group):
        return group.rank, group.size
    if isinstance(group, dist.ProcessGroup):
        return dist.get_rank(group), dist.get_world_size(group)
    raise TypeError(f"expected a moetron Group, a ProcessGroup or None, got {type(group).__name__}")


def local_expert_range(num_experts: int, ep_group: Group | dist.ProcessGroup | None) -> range:
    """Global ids of the experts this EP rank holds: a contiguous block of `num_experts / ep`."""
    ep_rank, ep = rank_and_size(ep_group)
    if num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={num_experts}: choose an expert-parallel "
                         f"size that divides the number of experts")
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


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
