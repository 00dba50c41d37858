"""Permute tokens into expert-major order and back: the routing plan and the torch references.

Design notes: docs/dispatch.md (`moetron/dispatch/permute_reference.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetron.kernels.numerics import DOT_LANES, acc_dtype



@dataclass
class PermuteState:
    """What unpermute needs to route rows back: filled by permute, consumed by unpermute."""

    token_idx: torch.Tensor  # [N] source token of each kept row, expert-major
    slot_idx: torch.Tensor  # [N] flat index into topk [T*k] of each kept row
    num_tokens: int
    rows_per_expert: torch.Tensor  # [E] rows each expert receives (padding included)
    padded_pos: torch.Tensor | None = None  # [N] row of each kept slot in the padded buffer
    topk: int | None = None  # k
    row_of_slot: torch.Tensor | None = None  # [T*k] row of each slot in the output, -1 if dropped
    slot_of_row: torch.Tensor | None = None  # [R] slot of each output row, -1 for padding
    impl: str = "torch"  # the implementation permute used; unpermute uses it unless told otherwise
    deterministic: bool = False

    @property
    def num_rows(self) -> int:
        """Rows of the permuted buffer, padding included."""
        if self.slot_of_row is not None:
            return self.slot_of_row.numel()
        return self.token_idx.numel() if self.padded_pos is None else int(self.rows_per_expert.sum())


def _sort_slots(topk_idx: torch.Tensor, num_experts: int, has_drops: bool):
    flat = topk_idx.reshape(-1)
    key = flat.masked_fill(flat < 0, num_experts) if has_drops else flat
    order = torch.argsort(key, stable=True)
    if has_drops:
        order = order[: int((flat >= 0).sum())]  # dropped slots sort last
    return order


def check_permute_args(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int,
                       pad_multiple: int, pad_to: int | None) -> None:
    if x_TH.dim() != 2:
        raise ValueError(f"permute: x must be [tokens, hidden], got shape {tuple(x_TH.shape)}")
    if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"permute: topk_idx must be [tokens={x_TH.shape[0]}, k], got {tuple(topk_idx_TK.shape)}")
    if topk_idx_TK.dtype.is_floating_point or topk_idx_TK.dtype.is_complex or topk_idx_TK.dtype == torch.bool:
        raise ValueError(f"permute: topk_idx must be an integer tensor (int64), got {topk_idx_TK.dtype}")
    if num_experts < 0 or pad_multiple < 1 or (pad_to is not None and pad_to < 0):
        raise ValueError(f"permute: need num_experts >= 0, pad_multiple >= 1, pad_to >= 0 or None; got "
                         f"num_experts={num_experts}, pad_multiple={pad_multiple}, pad_to={pad_to}")


def routing_plan(topk_idx_TK: torch.Tensor, num_experts: int, pad_multiple: int = 1,
                 pad_to: int | None = None, dropless: bool | None = None,
                 counts: torch.Tensor | None = None) -> PermuteState:
    """Where every slot goes (torch ops, any device).

    `dropless=True` promises no -1 in `topk_idx_TK` (routing without capacity): then, without
    padding to a multiple, nothing here waits for the device. `None` checks (one host sync).
    `counts`: the router's int64 slots per expert, which a dropless plan then need not count again
    (on a GPU every op spared is a launch the host no longer makes).
    """
    T, K = topk_idx_TK.shape
    if dropless is None:
        has_drops = bool((topk_idx_TK < 0).any()) if topk_idx_TK.numel() else False
    else:
        has_drops = not dropless
    order = _sort_slots(topk_idx_TK, num_experts, has_drops)
    token_idx = torch.div(order, K, rounding_mode="floor")
    if counts is None or has_drops:
        # scatter_add, not bincount: bincount reads its input's maximum on the host
        counts = torch.zeros(num_experts, dtype=torch.int64, device=order.device).scatter_add_(
            0, topk_idx_TK.reshape(-1)[order], torch.ones_like(order))
    kept = torch.arange(order.numel(), device=order.device)
    if pad_multiple == 1 and pad_to is None and not has_drops:
        # every slot kept, rows in sorted order: slot_of_row is the sort, row_of_slot its inverse
        state = PermuteState(token_idx, order, T, counts, topk=K, slot_of_row=order)
        state.row_of_slot = torch.empty_like(order).index_copy_(0, order, kept)
        return state
    if pad_multiple == 1 and pad_to is None:
        state = PermuteState(token_idx, order, T, counts, topk=K)
        rows, num_rows = kept, order.numel()
    else:
        if pad_to is not None:
            if bool((counts > pad_to).any()):
                raise ValueError(f"pad_to={pad_to} is smaller than the largest expert load {int(counts.max())}")
            padded_counts = torch.full_like(counts, pad_to)
        else:
            padded_counts = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
        starts = torch.cumsum(counts, 0) - counts
        padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
        expert_of_row = topk_idx_TK.reshape(-1)[order]
        padded_pos = padded_starts[expert_of_row] + kept - starts[expert_of_row]
        state = PermuteState(token_idx, order, T, padded_counts, padded_pos, topk=K)
        rows, num_rows = padded_pos, int(padded_counts.sum())
    state.row_of_slot = torch.full((T * K,), -1, dtype=torch.int64, device=order.device).index_copy_(0, order, rows)
    state.slot_of_row = torch.full((num_rows,), -1, dtype=torch.int64, device=order.device).index_copy_(0, rows, order)
    return state


def permute_reference(x_TH: torch.Tensor, state: PermuteState) -> torch.Tensor:
    x_NH = x_TH.index_select(0, state.token_idx)
    if state.padded_pos is None:
        return x_NH
    padded = x_NH.new_zeros(state.num_rows, x_NH.shape[-1])
    return padded.index_copy(0, state.padded_pos, x_NH)


def unpermute_reference(y_NH, state, topk_weights_TK):
    if state.padded_pos is not None:
        y_NH = y_NH.index_select(0, state.padded_pos)
    if topk_weights_TK is not None:
        w_N = topk_weights_TK.reshape(-1).index_select(0, state.slot_idx)
        y_NH = y_NH * w_N.to(y_NH.dtype).unsqueeze(-1)
    out = y_NH.new_zeros(state.num_tokens, y_NH.shape[-1])
    return out.index_add(0, state.token_idx, y_NH)


# ---- the deterministic reference: the numerics every fused kernel reproduces bit for bit ----

def gather_rows_reference(x_TH: torch.Tensor, slot_of_row: torch.Tensor, topk: int) -> torch.Tensor:
    """`out[r] = x[slot_of_row[r] // k]`, zeros where `slot_of_row[r] < 0` (permute forward)."""
    R, H = slot_of_row.numel(), x_TH.shape[1]
    if x_TH.shape[0] == 0:
        return x_TH.new_zeros(R, H)
    valid = slot_of_row >= 0
    rows = x_TH.index_select(0, torch.where(valid, slot_of_row, 0) // max(topk, 1))
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=x_TH.dtype, device=x_TH.device))


def reduce_slots_reference(y_RH: torch.Tensor, row_of_slot: torch.Tensor, weights_TK: torch.Tensor | None,
                           num_tokens: int, topk: int) -> torch.Tensor:
    """`out[t] = sum_k w[t,k] * y[row_of_slot[t,k]]`, k in order, in the accumulation type, from +0."""
    acc_t = acc_dtype(y_RH.dtype)
    R, H = y_RH.shape
    y_acc = torch.cat([y_RH.to(acc_t), y_RH.new_zeros(1, H, dtype=acc_t)])  # row R: zeros for dropped slots
    rows_TK = row_of_slot.view(num_tokens, topk)
    acc = y_RH.new_zeros(num_tokens, H, dtype=acc_t)
    for k in range(topk):
        valid = rows_TK[:, k] >= 0
        term = y_acc.index_select(0, torch.where(valid, rows_TK[:, k], R))
        if weights_TK is not None:
            w = torch.where(valid, weights_TK.reshape(num_tokens, topk)[:, k].to(acc_t), 0)
            term = term * w.unsqueeze(-1)
        acc = acc + term
    return acc.to(y_RH.dtype)


def unpermute_backward_reference(grad_TH: torch.Tensor, y_RH: torch.Tensor | None, slot_of_row: torch.Tensor,
                                 weights_TK: torch.Tensor, topk: int, need_grad_y: bool, need_grad_w: bool):
    """`(grad_y, grad_w)` of the weighted unpermute; either is None when not needed.

    `grad_y[r] = g[t] * w[s]` rounded once; `grad_w[s] = dot(g[t], y[r])` accumulated in
    `DOT_LANES` lanes (element h in lane h % DOT_LANES, chunks in order) folded pairwise.
    """
    acc_t = acc_dtype(grad_TH.dtype)
    T, H = grad_TH.shape
    R = slot_of_row.numel()
    valid = slot_of_row >= 0
    slot = torch.where(valid, slot_of_row, 0)
    if T == 0:
        g_rows = grad_TH.new_zeros(R, H, dtype=acc_t)
    else:
        g_rows = grad_TH.to(acc_t).index_select(0, slot // max(topk, 1))
        g_rows = torch.where(valid.unsqueeze(-1), g_rows, 0)
    grad_y = grad_w = None
    if need_grad_y:
        w_flat = weights_TK.reshape(-1).to(acc_t)
        w_rows = w_flat.index_select(0, slot) if w_flat.numel() else g_rows.new_zeros(R)
        grad_y = (g_rows * torch.where(valid, w_rows, 0).unsqueeze(-1)).to(grad_TH.dtype)
    if need_grad_w:
        prod = g_rows * y_RH.to(acc_t)
        prod = F.pad(prod, (0, -H % DOT_LANES))
        lanes = prod.new_zeros(R, DOT_LANES)
        for c in range(prod.shape[1] // DOT_LANES):
            lanes = lanes + prod[:, c * DOT_LANES:(c + 1) * DOT_LANES]
        width = DOT_LANES
        while width > 1:
            width //= 2
            lanes = lanes[:, :width] + lanes[:, width:2 * width]
        grad_w = weights_TK.new_zeros(weights_TK.numel(), dtype=acc_t)
        grad_w = grad_w.index_copy(0, slot_of_row[valid], lanes[valid, 0])
        grad_w = grad_w.to(weights_TK.dtype).view(weights_TK.shape)
    return grad_y, grad_w
