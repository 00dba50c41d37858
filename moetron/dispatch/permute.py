"""Permute tokens into expert-major order and back (the torch reference implementation).

`permute` gathers one row per kept (token, expert) slot, grouped by expert, so the
experts can run as one grouped GEMM; `unpermute` scatter-adds the expert outputs
back to their tokens, weighted by the gate. Rows of one expert keep token order,
which makes the result deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PermuteState:
    """What unpermute needs to route rows back: filled by permute, consumed by unpermute."""

    token_idx: torch.Tensor  # [N] source token of each kept row, expert-major
    slot_idx: torch.Tensor  # [N] flat index into topk [T*k] of each kept row
    num_tokens: int
    rows_per_expert: torch.Tensor  # [E] rows each expert receives (padding included)
    padded_pos: torch.Tensor | None = None  # [N] row of each kept slot in the padded buffer


def _sort_slots(topk_idx: torch.Tensor, num_experts: int, has_drops: bool):
    flat = topk_idx.reshape(-1)
    key = flat.masked_fill(flat < 0, num_experts) if has_drops else flat
    order = torch.argsort(key, stable=True)
    if has_drops:
        order = order[: int((flat >= 0).sum())]  # dropped slots sort last
    return order


def permute(
    x_TH: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    *,
    pad_multiple: int = 1,
    pad_to: int | None = None,
) -> tuple[torch.Tensor, PermuteState]:
    """Gather rows of `x_TH` by routing. Returns `(x_NH, state)`.

    `pad_multiple` pads each expert's rows with zeros to a multiple (FP8 grouped
    GEMMs need 16); `pad_to` pads every expert to exactly that many rows (capacity
    padding). Dropless routing (no -1) never synchronises with the host.
    """
    T, K = topk_idx_TK.shape
    has_drops = bool((topk_idx_TK < 0).any()) if topk_idx_TK.numel() else False
    order = _sort_slots(topk_idx_TK, num_experts, has_drops)
    token_idx = torch.div(order, K, rounding_mode="floor")
    counts = torch.bincount(topk_idx_TK.reshape(-1)[order], minlength=num_experts)
    x_NH = x_TH.index_select(0, token_idx)
    if pad_multiple == 1 and pad_to is None:
        return x_NH, PermuteState(token_idx, order, T, counts)

    if pad_to is not None:
        if bool((counts > pad_to).any()):
            raise ValueError(f"pad_to={pad_to} is smaller than the largest expert load {int(counts.max())}")
        padded_counts = torch.full_like(counts, pad_to)
    else:
        padded_counts = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    expert_of_row = topk_idx_TK.reshape(-1)[order]
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[expert_of_row]
    padded_pos = padded_starts[expert_of_row] + rank_in_expert
    padded = x_NH.new_zeros(int(padded_counts.sum()), x_NH.shape[-1])
    padded = padded.index_copy(0, padded_pos, x_NH)
    return padded, PermuteState(token_idx, order, T, padded_counts, padded_pos)


def unpermute(
    y_NH: torch.Tensor,
    state: PermuteState,
    topk_weights_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scatter-add expert outputs back to tokens, multiplied by their gate weights."""
    if state.padded_pos is not None:
        y_NH = y_NH.index_select(0, state.padded_pos)
    if topk_weights_TK is not None:
        w_N = topk_weights_TK.reshape(-1).index_select(0, state.slot_idx)
        y_NH = y_NH * w_N.to(y_NH.dtype).unsqueeze(-1)
    out = y_NH.new_zeros(state.num_tokens, y_NH.shape[-1])
    return out.index_add(0, state.token_idx, y_NH)
