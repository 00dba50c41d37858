"""Low-latency dispatch and combine on torch collectives: fixed shapes, no host synchronisation.

Design notes: docs/dispatch.md (`moetron/dispatch/low_latency.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetron.dispatch.base import Event
from moetron.dispatch.fp8_dispatch import as_wire, dequantize_rows, quantize_rows

__all__ = ["LowLatencyHandle", "low_latency_dispatch", "low_latency_combine", "dequantize_rows"]


@dataclass
class LowLatencyHandle:
    src_slot: torch.Tensor  # [L, R*M] int64: source (rank * M + token) of each packed row
    recv_count: torch.Tensor  # [L] int32 valid rows per local expert (device)
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int  # T on this (source) rank


def _check_no_grad(*tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("the low-latency mode has no backward: call it under torch.no_grad() "
                           "(inference / CUDA graphs) or use FlexBuffer.dispatch/combine to train")


def _finish(works, finisher, async_finish: bool, return_recv_hook: bool):
    event = Event(works, [finisher])
    if not (async_finish or return_recv_hook):
        event.wait()
    return event, (event.wait if return_recv_hook else None)


def low_latency_dispatch(backend, x: torch.Tensor, topk_idx: torch.Tensor,
                         num_max_dispatch_tokens_per_rank: int, num_experts: int, *,
                         use_fp8: bool = False, round_scale: bool = False,
                         async_finish: bool = False, return_recv_hook: bool = False):
    """Returns `(recv_x, recv_count, handle, event, hook)` like DeepEP's `low_latency_dispatch`."""
    _check_no_grad(x)
    R, M, E = backend.size, num_max_dispatch_tokens_per_rank, num_experts
    L = E // R
    T, H = x.shape
    if T > M:
        raise ValueError(f"low_latency_dispatch: {T} tokens exceed num_max_dispatch_tokens_per_rank={M}")
    if topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows for {T} tokens")
    device = x.device
    token = torch.arange(T, device=device)

    # Which (expert, slot) pairs are wanted: slot = token index; dropped choices go to a dummy row E.
    dest = torch.where(topk_idx >= 0, topk_idx, E)
    wanted = torch.zeros((E + 1) * M, dtype=torch.uint8, device=device)
    wanted.index_fill_(0, (dest * M + token.unsqueeze(1)).reshape(-1), 1)
    wanted = wanted[: E * M].view(E * M, 1)  # [R, L, M] rank-major: block r goes to rank r

    # One row per (destination rank, token), whatever number of its experts the token chose there.
    rows = list(quantize_rows(x, power_of_two=round_scale)) if use_fp8 else [x]
    sends = []
    for r in rows:
        send = r.new_zeros((R, M, *r.shape[1:]))
        send[:, :T] = r.unsqueeze(0)
        sends.append(as_wire(send).reshape(R * M, -1))
    works, received = [], []
    for send in sends + [wanted]:
        recv, work = backend.exchange(send, None, None, async_finish or return_recv_hook)
        received.append(recv)  # rows of source rank s first
        works.append(work)

    # Outputs are allocated now and filled on arrival (fixed shapes, on the device).
    outs = [r.new_empty((L, R * M, *r.shape[1:])) for r in rows]
    if use_fp8:  # scales [L, R*M, nb] stored column-major, as DeepEP returns them (TMA layout)
        outs[1] = rows[1].new_empty((L, rows[1].shape[1], R * M)).transpose(1, 2)
    recv_count = torch.empty(L, dtype=torch.int32, device=device)
    src_slot = torch.empty(L, R * M, dtype=torch.int64, device=device)

    def pack():
        v = received[-1].view(R, L, M).transpose(0, 1).reshape(L, R * M)  # [L, (source, token)]
        order = torch.argsort((v == 0).to(torch.int32), dim=1, stable=True)  # wanted rows first
        count = v.sum(1, dtype=torch.int32)
        keep = torch.arange(R * M, device=device).unsqueeze(0) < count.unsqueeze(1)
        for out, recv in zip(outs, received):
            gathered = recv.index_select(0, order.reshape(-1)).view(L, R * M, -1)
            gathered = gathered.masked_fill(~keep.unsqueeze(-1), 0)
            out.copy_(gathered.view(out.dtype).view(out.shape))  # uint8 wire bytes -> float8
        recv_count.copy_(count)
        src_slot.copy_(order)

    event, hook = _finish(works, pack, async_finish, return_recv_hook)
    handle = LowLatencyHandle(src_slot, recv_count, M, H, E, T)
    recv_x = tuple(outs) if use_fp8 else outs[0]
    return recv_x, recv_count, handle, event, hook


def low_latency_combine(backend, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: LowLatencyHandle, *, async_finish: bool = False,
                        return_recv_hook: bool = False, out: torch.Tensor | None = None):
    """Weighted combine of expert outputs `x [L, R*M, H]`; returns `(combined_x [T,H], event, hook)`.

    `topk_idx`/`topk_weights` are the source tokens' own (as passed to the dispatch);
    combined_x[t] = sum_k topk_weights[t,k] * output of expert topk_idx[t,k] for token t.
    """
    _check_no_grad(x, topk_weights)
    R, M, E, H, T = backend.size, handle.num_max_dispatch_tokens_per_rank, handle.num_experts, \
        handle.hidden, handle.num_tokens
    L = E // R
    if x.shape != (L, R * M, H):
        raise ValueError(f"low_latency_combine expects x of shape {(L, R * M, H)}, got {tuple(x.shape)}")
    if topk_idx.shape[0] != T or topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} / topk_weights {tuple(topk_weights.shape)} "
                         f"do not match the {T} tokens of the dispatch")
    # Packed row (j, p) came from slot (source s, token t) = src_slot[j, p]; it goes back to row
    # (s, j, t) of the send buffer [R, L, M, H]. src_slot is a permutation per expert, so every
    # row is written; rows past recv_count land in slots the source never reads.
    src = torch.div(handle.src_slot, M, rounding_mode="floor")
    j = torch.arange(L, device=x.device).unsqueeze(1)
    dest = (src * L + j) * M + handle.src_slot % M
    # dest is a permutation: gather by its inverse (index_select is several times faster than
    # the equivalent index_copy_ on the CPU)
    dest = dest.reshape(-1)
    source_of = torch.empty_like(dest).scatter_(0, dest, torch.arange(dest.numel(), device=x.device))
    send = x.reshape(E * M, H).index_select(0, source_of)
    recv, work = backend.exchange(send, None, None, async_finish or return_recv_hook)
    combined = out if out is not None else x.new_empty((T, H))

    def weighted_sum():
        per_expert = recv.view(E * M, H)  # slot (e, t): output of expert e for my token t
        token = torch.arange(T, device=x.device).unsqueeze(1)
        slots = (topk_idx.clamp_min(0) * M + token).reshape(-1)
        y = per_expert.index_select(0, slots).view(T, topk_idx.shape[1], H).float()
        chosen = (topk_idx >= 0).unsqueeze(-1)
        y = torch.where(chosen, y * topk_weights.float().unsqueeze(-1), 0.0)  # never read unset slots
        combined.copy_(y.sum(1))

    event, hook = _finish([work], weighted_sum, async_finish, return_recv_hook)
    return combined, event, hook

