"""AllGatherDispatcher: every rank of the TP×EP group sees every token, keeps its experts' slots.

    dispatch: all-gather tokens, topk ids and gate weights over the group
              -> mask slots of other ranks' experts to -1 -> permute (local experts)
    combine:  unpermute with the gate weights into the gathered token space
              -> reduce-scatter over the group: each rank gets its tokens back, summed
                 over every EP rank's experts and every ETP rank's partial outputs.

Megatron-Core's default dispatcher. No counts are exchanged and the dispatcher itself
never reads device values on the host, at the price of moving every token to every rank:
the right choice for small groups or high top-k, the all-to-all one for large EP.
Every rank of the group must route the same number of tokens (all-gather shapes).
Backward is the adjoint of each step: comm.all_gather reduce-scatters gradients (the
gathered copies feed different experts on each rank) and comm.reduce_scatter all-gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetron.dispatch.base import rank_and_size, round_up
from moetron.dispatch.permute import PermuteState, permute, unpermute
from moetron.dispatch.routing import Routing
from moetron.parallel import comm


@dataclass
class AllGatherHandle:
    state: PermuteState  # gathered tokens -> rows of the local experts
    topk_weights: torch.Tensor  # [group*T, k] gathered gate weights (differentiable)


class AllGatherDispatcher:
    """Dispatch by all-gather over `group` (the TP×EP group) to the experts in `local_experts`.

    `local_experts` is the range of global expert ids this rank holds
    (`GroupedExperts.local_experts`); ETP ranks of one EP rank hold the same range.
    """

    def __init__(self, group, num_experts: int, local_experts: range, *, pad_multiple: int = 1,
                 pad_to_capacity: bool = False):
        if not (0 <= local_experts.start <= local_experts.stop <= num_experts and local_experts.step == 1):
            raise ValueError(f"local_experts={local_experts} is not a contiguous block of 0..{num_experts - 1}")
        self.group = group
        _, self.group_size = rank_and_size(group)
        self.num_experts = num_experts
        self.local_experts = local_experts
        self.pad_multiple = pad_multiple
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TH: torch.Tensor, routing: Routing):
        x_all = comm.all_gather(x_TH, self.group)
        idx_all = comm.all_gather(routing.topk_idx, self.group)
        weights_all = comm.all_gather(routing.topk_weights, self.group)
        start, stop = self.local_experts.start, self.local_experts.stop
        is_local = (idx_all >= start) & (idx_all < stop)
        local_idx = torch.where(is_local, idx_all - start, torch.full_like(idx_all, -1))
        pad_to = None
        if self.pad_to_capacity and routing.capacity is not None:
            # each of the group's ranks sends at most `capacity` rows to an expert
            pad_to = round_up(self.group_size * routing.capacity, self.pad_multiple)
        x_NH, state = permute(x_all, local_idx, len(self.local_experts),
                              pad_multiple=self.pad_multiple, pad_to=pad_to)
        return x_NH, state.rows_per_expert, AllGatherHandle(state, weights_all)

    def combine(self, y_NH: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        out_all = unpermute(y_NH, handle.state, handle.topk_weights)
        return comm.reduce_scatter(out_all, self.group)
