"""AllToAllDispatcher: each token row travels only to the EP rank that holds its expert.

    dispatch: permute (expert-major over all E experts)
              -> exchange counts (all-to-all over EP, all-gather over ETP; one host sync)
              -> all-to-all of rows over EP (uneven splits)
              -> all-gather over ETP (uneven)                       [ETP only]
              -> regroup (ETP rank, source rank, local expert) -> (local expert, ...)
    combine:  the same steps mirrored; the ETP step becomes a reduce-scatter that also sums
              the experts' partial outputs; the final unpermute sums each token's rows.

The gate weight of every row travels with it (`probs_send` [N] fp32, the same exchanges as the
rows), so the experts apply it inside their SwiGLU (moe/layer.py: probs_on_experts); without
received probs (`dispatch_postprocess(x, plan)`) the final unpermute applies the weights instead.

Design notes: docs/dispatch.md (`moetron/dispatch/alltoall.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetron.dispatch.base import RowExchange, local_expert_range, rank_and_size, round_up
from moetron.dispatch.permute import PermuteState, permute, row_weights, unpermute
from moetron.dispatch.routing import Routing
from moetron.parallel import comm


@dataclass
class AllToAllPlan:
    """What dispatch-preprocess decided and dispatch-postprocess needs to place the received rows."""

    token_state: PermuteState  # tokens -> expert-major rows (all E experts), on the source rank
    topk_weights: torch.Tensor  # [T,k] gate weights of the source tokens
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    received: list[int] | None  # rows per (ETP rank, EP source, local expert); None: fixed shape
    etp_rows: list[int] | None  # rows each ETP rank received over EP (None without ETP)
    capacity_slots: int = 0  # pad_to_capacity: rows per (block, local expert)
    probs_send: torch.Tensor | None = None  # [N] gate weight of each sent row (0 on padding)


@dataclass
class AllToAllHandle:
    """What combine needs to send the expert outputs back the way the rows came."""

    token_state: PermuteState  # tokens -> expert-major rows (all E experts), on the source rank
    topk_weights: torch.Tensor  # [T,k] gate weights of the source tokens
    send_splits: list[int]  # rows sent to each EP rank
    recv_splits: list[int]  # rows received from each EP rank
    etp_rows: list[int] | None  # rows each ETP rank received over EP (None without ETP)
    regroup_state: PermuteState | None  # received order -> local-expert-major (None: fixed shape)
    capacity_blocks: int = 0  # pad_to_capacity: number of (ETP rank, EP rank) blocks per expert
    probs_N: torch.Tensor | None = None  # [N] gate weight of each expert row, when the probs travelled


def gather_uneven(x: torch.Tensor, group, rows_per_rank: list[int]) -> torch.Tensor:
    """All-gather row blocks of different sizes (an all-to-all that sends x to everyone)."""
    rank, size = rank_and_size(group)
    send = x.repeat(size, *([1] * (x.dim() - 1)))
    return comm.all_to_all(send, group, rows_per_rank, [rows_per_rank[rank]] * size)


def reduce_scatter_uneven(x: torch.Tensor, group, rows_per_rank: list[int]) -> torch.Tensor:
    """Sum the group's copies of `x` and keep this rank's block of `rows_per_rank[rank]` rows."""
    rank, size = rank_and_size(group)
    mine = rows_per_rank[rank]
    received = comm.all_to_all(x, group, [mine] * size, rows_per_rank)
    return received.view(size, mine, *x.shape[1:]).sum(0)


class AllToAllDispatcher:
    """Dispatch over the EP group with uneven all-to-all; optional ETP over `etp_group`.

    Token counts may differ between ranks. With `pad_to_capacity`, every rank must route
    the same number of tokens (so that all ranks compute the same capacity).
    """

    sends_probs = True  # the plan's `probs_send` may travel with the rows (moe/pieces.py)

    def __init__(self, ep_group, num_experts: int, etp_group=None, *, pad_multiple: int = 1,
                 pad_to_capacity: bool = False):
        self.local_experts = local_expert_range(num_experts, ep_group)
        self.ep_group, self.etp_group = ep_group, etp_group
        _, self.ep = rank_and_size(ep_group)
        self.etp_rank, self.etp = rank_and_size(etp_group)
        self.num_experts = num_experts
        self.num_local_experts = len(self.local_experts)
        self.pad_multiple = pad_multiple
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TH: torch.Tensor, routing: Routing):
        x_NH, exchange, plan = self.dispatch_preprocess(x_TH, routing)
        probs = None if plan.probs_send is None else exchange(plan.probs_send)
        return self.dispatch_postprocess(exchange(x_NH), plan, probs)

    def combine(self, y_NH: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        y_NH, exchange = self.combine_preprocess(y_NH, handle)
        return self.combine_postprocess(exchange(y_NH), handle)

    # --- dispatch phases -----------------------------------------------------------------
    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: Routing
                            ) -> tuple[torch.Tensor, RowExchange, AllToAllPlan]:
        """Permute into send order and agree on the split sizes (the one host sync)."""
        if self.pad_to_capacity and routing.capacity is not None:
            return self._preprocess_padded(x_TH, routing)
        x_NH, token_state = permute(x_TH, routing.topk_idx, self.num_experts, dropless=routing.dropless,
                                    counts=routing.tokens_per_expert)
        counts = self._exchange_counts(token_state.rows_per_expert)  # the one host sync
        El = self.num_local_experts
        mine, received = counts[:self.num_experts], counts[self.num_experts:]
        send_splits = [sum(mine[r * El:(r + 1) * El]) for r in range(self.ep)]
        per_etp = len(received) // self.etp  # counts of one ETP rank: ep * El
        etp_rows = [sum(received[t * per_etp:(t + 1) * per_etp]) for t in range(self.etp)]
        mine_start = self.etp_rank * per_etp  # this rank's own EP receipts within `received`
        recv_splits = [sum(received[mine_start + s * El:mine_start + (s + 1) * El]) for s in range(self.ep)]
        plan = AllToAllPlan(token_state, routing.topk_weights, send_splits, recv_splits, received,
                            etp_rows if self.etp > 1 else None,
                            probs_send=row_weights(token_state, routing.topk_weights))
        return x_NH, RowExchange(self.ep_group, recv_splits, send_splits), plan

    def dispatch_postprocess(self, x_NH: torch.Tensor, plan: AllToAllPlan, probs_recv: torch.Tensor | None = None):
        """Rows received over EP -> the ETP group's rows, local-expert-major; and the handle.
        `probs_recv`: the plan's `probs_send` after the same exchange (then `handle.probs_N`)."""
        if plan.received is None:
            return self._postprocess_padded(x_NH, plan, probs_recv)
        El = self.num_local_experts
        if plan.etp_rows is not None:
            x_NH = gather_uneven(x_NH, self.etp_group, plan.etp_rows)
            if probs_recv is not None:
                probs_recv = gather_uneven(probs_recv, self.etp_group, plan.etp_rows)
        # rows are ordered (ETP rank, EP source rank, local expert); sort them expert-major
        expert_of_row = torch.arange(El, device=x_NH.device).repeat(self.etp * self.ep)
        expert_of_row = expert_of_row.repeat_interleave(
            torch.tensor(plan.received, device=x_NH.device), output_size=x_NH.shape[0])
        x_NH, regroup_state = permute(x_NH, expert_of_row.unsqueeze(1), El, pad_multiple=self.pad_multiple,
                                       dropless=True)
        handle = AllToAllHandle(plan.token_state, plan.topk_weights, plan.send_splits, plan.recv_splits,
                                plan.etp_rows, regroup_state,
                                probs_N=None if probs_recv is None else row_weights(regroup_state, probs_recv))
        return x_NH, regroup_state.rows_per_expert, handle

    def _exchange_counts(self, rows_per_expert: torch.Tensor) -> list[int]:
        """This rank's rows per global expert, then the rows each (ETP rank, EP rank) sends to
        each local expert, as one host list: [E] + [etp, ep, E_local] flattened."""
        El = self.num_local_experts
        received = comm.all_to_all(rows_per_expert.view(self.ep, El), self.ep_group)
        if self.etp > 1:
            received = comm.all_gather(received.unsqueeze(0), self.etp_group).reshape(-1)
        return torch.cat([rows_per_expert, received.reshape(-1)]).tolist()

    def _preprocess_padded(self, x_TH: torch.Tensor, routing: Routing):
        """Every expert gets exactly `slots` rows from every rank: fixed shapes, no host sync."""
        slots = round_up(routing.capacity, self.pad_multiple)
        x_NH, token_state = permute(x_TH, routing.topk_idx, self.num_experts, pad_to=slots)
        splits = [self.num_local_experts * slots] * self.ep
        etp_rows = [splits[0] * self.ep] * self.etp if self.etp > 1 else None
        plan = AllToAllPlan(token_state, routing.topk_weights, splits, splits, None, etp_rows, slots,
                            probs_send=row_weights(token_state, routing.topk_weights))
        return x_NH, RowExchange(self.ep_group, splits, splits), plan

    def _postprocess_padded(self, x_NH: torch.Tensor, plan: AllToAllPlan, probs_recv: torch.Tensor | None):
        El, blocks, slots = self.num_local_experts, self.ep * self.etp, plan.capacity_slots
        if self.etp > 1:
            x_NH = comm.all_gather(x_NH, self.etp_group)
            if probs_recv is not None:
                probs_recv = comm.all_gather(probs_recv, self.etp_group)
        # (block, local expert, slot) -> (local expert, block, slot)
        H = x_NH.shape[-1]
        x_NH = x_NH.view(blocks, El, slots, H).transpose(0, 1).reshape(-1, H)
        if probs_recv is not None:
            probs_recv = probs_recv.view(blocks, El, slots).transpose(0, 1).reshape(-1)
        rows = torch.full((El,), blocks * slots, dtype=torch.long, device=x_NH.device)
        handle = AllToAllHandle(plan.token_state, plan.topk_weights, plan.send_splits, plan.recv_splits,
                                plan.etp_rows, None, capacity_blocks=blocks, probs_N=probs_recv)
        return x_NH, rows, handle

    # --- combine phases ------------------------------------------------------------------
    def combine_preprocess(self, y_NH: torch.Tensor, handle: AllToAllHandle
                           ) -> tuple[torch.Tensor, RowExchange]:
        """Expert outputs back in received order, ETP partial sums reduced: ready to send."""
        if handle.regroup_state is not None:
            y_NH = unpermute(y_NH, handle.regroup_state)  # back to the received order
        else:
            H, blocks = y_NH.shape[-1], handle.capacity_blocks
            y_NH = y_NH.view(self.num_local_experts, blocks, -1, H).transpose(0, 1).reshape(-1, H)
        if handle.etp_rows is not None:
            y_NH = reduce_scatter_uneven(y_NH, self.etp_group, handle.etp_rows)  # sums ETP partials
        return y_NH, RowExchange(self.ep_group, handle.send_splits, handle.recv_splits)

    def combine_postprocess(self, y_NH: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """Rows back on their source rank -> one row per token (gate-weighted here unless the
        experts applied the weights: then `handle.topk_weights` is None)."""
        return unpermute(y_NH, handle.token_state, handle.topk_weights)
