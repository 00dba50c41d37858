"""Backends of the flex dispatcher: torch (the reference), DeepEP, and NVSHMEM symmetric memory.

Design notes: docs/dispatch.md (`moetron/dispatch/flex_backends.py`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moetron.dispatch.fp8_dispatch import as_wire, from_wire
from moetron.parallel.state import Group
from moetron.dispatch import low_latency
from moetron.dispatch.base import Event


# ---- groups ---------------------------------------------------------------------------------


def resolve_group(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """(process group handle, size, this rank's index) of a moetron Group or a ProcessGroup."""
    if isinstance(group, Group):
        return group.handle, group.size, group.rank
    if isinstance(group, dist.ProcessGroup):
        return group, dist.get_world_size(group), dist.get_rank(group)
    if group is None:
        return None, 1, 0
    raise TypeError(f"expected a moetron Group, a ProcessGroup or None, got {type(group).__name__}")


class GroupRef:
    """A process group held weakly, with its size and this rank's index.

    A dispatcher must not keep a ProcessGroup alive after `dist.destroy_process_group()`: a gloo
    group that lives on until interpreter exit aborts the process there about half the time
    (`terminate called without an active exception`), see docs/dispatch.md.
    """

    def __init__(self, group) -> None:
        handle, self.size, self.rank = resolve_group(group)
        self._ref = None if handle is None else weakref.ref(handle)

    @property
    def handle(self) -> dist.ProcessGroup | None:
        if self._ref is None:
            return None
        handle = self._ref()
        if handle is None:
            raise RuntimeError("the flex dispatcher's process group was destroyed (dist.destroy_process_group); "
                               "build a new dispatcher on a live group")
        return handle


def layout_of(topk_idx: torch.Tensor, num_experts: int, size: int):
    """DeepEP's dispatch layout: (tokens per rank [R] int32, tokens per expert [E] int32,
    is_token_in_rank [T,R] bool) of `topk_idx` for `size` ranks owning `num_experts / size` each."""
    L = num_experts // size
    valid = topk_idx >= 0
    safe = topk_idx.clamp_min(0)
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
    per_expert.index_add_(0, safe.reshape(-1), valid.reshape(-1).to(torch.int32))
    hits = torch.zeros(topk_idx.shape[0], size, dtype=torch.int32, device=topk_idx.device)
    hits.scatter_add_(1, torch.div(safe, L, rounding_mode="floor"), valid.to(torch.int32))
    in_rank = hits > 0
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a float tensor's bits as the signed integer type of the same width."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


# ---- torch reference backend ----------------------------------------------------------------


@dataclass
class TorchHandle:
    """Layout of one dispatch, reused by cached dispatches and by combine."""

    send_token_idx: torch.Tensor  # [S] source token of each sent row, destination-rank-major
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    num_tokens: int  # T on this (source) rank
    is_token_in_rank: torch.Tensor


@dataclass
class DispatchResult:
    payloads: list[torch.Tensor]
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert_list: list[int]
    handle: Any
    event: Event
    extra: dict = field(default_factory=dict)


class TorchBackend:
    """Uneven all-to-all over torch.distributed (gloo or NCCL). Always available; the reference.

    Normal mode needs split sizes on the host, so a fresh dispatch exchanges counts and reads
    them once (one device-to-host sync on GPU, as in DeepEP's normal kernels); a cached-handle
    dispatch and combine never sync.
    """

    name = "torch"
    max_topk_columns: int | None = None  # no limit

    def __init__(self, group, num_experts: int, **options):
        if options:
            raise TypeError(f"backend 'torch' takes no options, got {sorted(options)}")
        self.group_ref = GroupRef(group)
        self.size, self.rank = self.group_ref.size, self.group_ref.rank
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.size

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.group_ref.handle

    def reserve(self, hidden: int, dtype: torch.dtype) -> None:
        """Backends with preallocated buffers size them for rows of `hidden` values of `dtype`."""

    # --- the one communication primitive (NVSHMEM overrides it) ---------------------------
    def exchange(self, send: torch.Tensor, send_splits: list[int] | None,
                 recv_splits: list[int] | None, async_op: bool) -> tuple[torch.Tensor, Any]:
        """All-to-all of row blocks: block s of `send` goes to rank s. None splits: equal blocks."""
        if self.size == 1:
            return send, None
        wire = as_wire(send.contiguous())
        rows = wire.shape[0] if recv_splits is None else sum(recv_splits)
        recv = wire.new_empty((rows, *wire.shape[1:]))
        work = dist.all_to_all_single(recv, wire, recv_splits, send_splits, group=self.group,
                                      async_op=async_op)
        return from_wire(recv, send.dtype), work

    # --- layout -------------------------------------------------------------------------
    def layout(self, topk_idx: torch.Tensor):
        return layout_of(topk_idx, self.num_experts, self.size)

    # --- dispatch -----------------------------------------------------------------------
    def dispatch(self, payloads, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, async_op: bool) -> DispatchResult:
        R, L = self.size, self.num_local_experts
        T = is_token_in_rank.shape[0]
        # Counts: [R, 1 + L] = rows for rank r, then rows for each of r's experts.
        counts = torch.cat([num_tokens_per_rank.reshape(R, 1), num_tokens_per_expert.reshape(R, L)], 1)
        counts = counts.to(torch.int64)
        recv_counts, _ = self.exchange(counts, None, None, async_op=False)
        host = torch.cat([counts[:, 0], recv_counts.reshape(-1)]).tolist()  # the one host sync
        send_splits = host[:R]
        recv_table = [host[R + r * (L + 1): R + (r + 1) * (L + 1)] for r in range(R)]
        recv_splits = [row[0] for row in recv_table]
        per_local_expert = [sum(row[1 + j] for row in recv_table) for j in range(L)]
        # Sent rows, destination-major in token order: the first S (destination, token) pairs
        # of is_token_in_rank^T (a stable sort instead of nonzero, which would sync again).
        S = sum(send_splits)
        flat = is_token_in_rank.t().reshape(-1)
        pairs = torch.argsort((~flat).to(torch.uint8), stable=True)[:S]
        dst, tok = torch.div(pairs, T, rounding_mode="floor"), pairs % T
        if is_token_in_rank.device.type == "cpu" and int(flat.sum()) != S:
            raise ValueError(f"num_tokens_per_rank sums to {S} but is_token_in_rank has {int(flat.sum())} "
                             f"entries: pass the layout of get_dispatch_layout")

        works, finishers = [], []
        received = []
        for p in payloads:
            recv, work = self.exchange(p.index_select(0, tok), send_splits, recv_splits, async_op)
            received.append(recv)
            works.append(work)

        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            k = topk_idx.shape[1]
            sel = topk_idx.index_select(0, tok)
            local = sel - dst.unsqueeze(1) * L
            mine = (sel >= 0) & (local >= 0) & (local < L)
            cols = [torch.where(mine, local, -1)]
            if topk_weights is not None:
                w = topk_weights.index_select(0, tok)
                cols.append(_as_int(torch.where(mine, w, torch.zeros_like(w))).to(torch.int64))
            recv_meta, work = self.exchange(torch.cat(cols, 1), send_splits, recv_splits, async_op)
            works.append(work)
            n = sum(recv_splits)
            recv_topk_idx = torch.empty(n, k, dtype=torch.int64, device=topk_idx.device)
            if topk_weights is not None:
                recv_topk_weights = torch.empty(n, k, dtype=topk_weights.dtype, device=topk_idx.device)
                int_dtype = _as_int(topk_weights[:0]).dtype

            def unpack_meta():
                recv_topk_idx.copy_(recv_meta[:, :k])
                if recv_topk_weights is not None:
                    recv_topk_weights.copy_(recv_meta[:, k:].to(int_dtype).view(recv_topk_weights.dtype))
            finishers.append(unpack_meta)

        event = Event(works, finishers)
        if not async_op:
            event.wait()
        handle = TorchHandle(tok, send_splits, recv_splits, T, is_token_in_rank)
        return DispatchResult(received, recv_topk_idx, recv_topk_weights, per_local_expert, handle, event)

    def dispatch_cached(self, payloads, handle: TorchHandle, async_op: bool):
        received, works = [], []
        for p in payloads:
            if p.shape[0] != handle.num_tokens:
                raise ValueError(f"cached dispatch: payload has {p.shape[0]} rows but the handle was "
                                 f"made for {handle.num_tokens} tokens")
            recv, work = self.exchange(p.index_select(0, handle.send_token_idx), handle.send_splits,
                                       handle.recv_splits, async_op)
            received.append(recv)
            works.append(work)
        event = Event(works)
        if not async_op:
            event.wait()
        return received, event

    # --- combine ------------------------------------------------------------------------
    def combine(self, payloads, handle: TorchHandle, async_op: bool):
        n = sum(handle.recv_splits)
        outputs, works, finishers = [], [], []
        for p in payloads:
            if p.shape[0] != n:
                raise ValueError(f"combine: got {p.shape[0]} rows but the dispatch delivered {n}")
            back, work = self.exchange(p, handle.recv_splits, handle.send_splits, async_op)
            out = p.new_empty((handle.num_tokens, *p.shape[1:]))
            outputs.append(out)
            works.append(work)

            def sum_per_token(back=back, out=out):
                acc = torch.zeros(out.shape, dtype=_accumulation_dtype(out.dtype), device=out.device)
                acc.index_add_(0, handle.send_token_idx, back.to(acc.dtype))
                out.copy_(acc)
            finishers.append(sum_per_token)
        event = Event(works, finishers)
        if not async_op:
            event.wait()
        return outputs, event

    # --- low-latency mode ---------------------------------------------------------------
    def low_latency_dispatch(self, *args, **kwargs):
        return low_latency.low_latency_dispatch(self, *args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return low_latency.low_latency_combine(self, *args, **kwargs)
