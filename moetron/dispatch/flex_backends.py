"""Backends of the flex dispatcher: torch (the reference), DeepEP, and NVSHMEM symmetric memory.

Every backend implements the same raw operations (no autograd; `flex.py` wraps them in autograd
functions and the DeepEP-style public API):

    layout(topk_idx)                         -> num_tokens_per_rank, num_tokens_per_expert,
                                                is_token_in_rank
    dispatch(payloads, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
             num_tokens_per_expert, async_op) -> DispatchResult
    dispatch_cached(payloads, handle, async_op) -> (received payloads, Event)
    combine(payloads, handle, async_op)      -> (payloads summed per source token, Event)
    low_latency_dispatch / low_latency_combine (see low_latency.py)

A *payload* is a tensor with one row per token (`x [T,H]`, FP8 `q [T,H]` plus its `scales
[T,H/128]`, gate weights `[T,k]`, ...). Dispatch sends row t once to every rank in
`is_token_in_rank[t]`; combine sends each received row back and sums the rows of one source token.

Ranks own `num_experts / R` consecutive experts each (rank r: experts `r*L ... r*L+L-1`).
Received rows are grouped by source rank, in source token order (torch and NVSHMEM backends).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moetron import backends
from moetron.dispatch.fp8_dispatch import FP8_DTYPE, as_wire, from_wire
from moetron.parallel.state import Group


# ---- events ---------------------------------------------------------------------------------


class Event:
    """Completion of an issued communication, DeepEP `EventOverlap`-style.

    With `async_finish=True` a dispatch/combine returns as soon as its transfers are issued; the
    returned tensors are allocated but NOT yet valid. Call `wait()` (or its alias
    `current_stream_wait()`) right before reading them: it waits for the transfers (on GPU: makes
    the current stream wait, without blocking the host) and then runs the local post-processing
    that fills the outputs (unpacking, summing per token, FP8 dequantization). Reading an output
    before that gives garbage; passing an unwaited dispatch handle to combine raises. `with
    event:` waits on exit. An event from a synchronous call is already complete.
    """

    def __init__(self, works: Sequence[Any] = (), finishers: Sequence[Callable[[], None]] = (),
                 native: Any = None):
        self._works = [w for w in works if w is not None]
        self._finishers = list(finishers)
        self._native = native  # a backend's own event (deep_ep EventOverlap)
        self._done = not self._works and not self._finishers and native is None

    @property
    def done(self) -> bool:
        """True once the outputs may be read (after `wait()`, or for synchronous calls)."""
        return self._done

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the transfers have arrived (now, if they already have)."""
        if self._done:
            with torch.no_grad():
                fn()
        else:
            self._finishers.append(fn)

    def wait(self) -> None:
        if self._done:
            return
        if self._native is not None and getattr(self._native, "event", None) is not None:
            self._native.current_stream_wait()
        for work in self._works:
            work.wait()
        with torch.no_grad():  # finishers fill outputs in place; they are not autograd ops
            for fn in self._finishers:
                fn()
        self._works, self._finishers, self._done = [], [], True

    current_stream_wait = wait

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


def completed() -> Event:
    return Event()


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

    def __init__(self, group, num_experts: int, **options):
        if options:
            raise TypeError(f"backend 'torch' takes no options, got {sorted(options)}")
        self.group, self.size, self.rank = resolve_group(group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.size

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
        E, L, R = self.num_experts, self.num_local_experts, self.size
        valid = topk_idx >= 0
        safe = topk_idx.clamp_min(0)
        per_expert = torch.zeros(E, dtype=torch.int32, device=topk_idx.device)
        per_expert.index_add_(0, safe.reshape(-1), valid.reshape(-1).to(torch.int32))
        hits = torch.zeros(topk_idx.shape[0], R, dtype=torch.int32, device=topk_idx.device)
        hits.scatter_add_(1, torch.div(safe, L, rounding_mode="floor"), valid.to(torch.int32))
        in_rank = hits > 0
        return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank

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
        from moetron.dispatch import low_latency
        return low_latency.low_latency_dispatch(self, *args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        from moetron.dispatch import low_latency
        return low_latency.low_latency_combine(self, *args, **kwargs)


# ---- NVSHMEM (torch symmetric memory) backend ------------------------------------------------


def _require_nvshmem() -> None:
    def unavailable(reason: str):
        return RuntimeError(f"backend 'nvshmem' was requested but is unavailable: {reason}. "
                            f"Run `moetron env` to see what this machine supports.")
    if not torch.cuda.is_available():
        raise unavailable("no CUDA device (torch symmetric-memory all_to_all_vdev runs on GPU only)")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise unavailable(f"this torch has no symmetric memory module ({e})") from None
    if not symm_mem.is_nvshmem_available():
        raise unavailable("this torch build has no NVSHMEM (libnvshmem_host.so.3 not found)")
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        raise unavailable("this torch has no torch.ops.symm_mem.all_to_all_vdev")


class NvshmemBackend(TorchBackend):
    """The torch backend with its all-to-all done by NVSHMEM (`torch.ops.symm_mem.all_to_all_vdev`).

    Symmetric buffers must have the same size on every rank, so they are allocated for
    `max_tokens_per_rank` tokens (each may go to every rank); a larger dispatch raises. Each
    transfer is ordered on the current CUDA stream, so `async_finish` only defers the local
    post-processing. Untested in CI (needs GPUs with NVSHMEM).
    """

    name = "nvshmem"

    def __init__(self, group, num_experts: int, max_tokens_per_rank: int = 8192):
        _require_nvshmem()
        super().__init__(group, num_experts)
        import torch.distributed._symmetric_memory as symm_mem

        if self.size > 1 and self.group is None:
            raise ValueError("backend 'nvshmem' needs a torch.distributed process group")
        symm_mem.set_backend("NVSHMEM")
        self._symm_mem = symm_mem
        self.max_rows = self.size * max_tokens_per_rank
        self._buffers: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _buffers_for(self, dtype, row_shape, rows, device):
        key = (dtype, tuple(row_shape), device)
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].shape[0] < rows:  # collective: every rank reaches it alike
            sm, name = self._symm_mem, self.group.group_name
            inp = sm.empty((rows, *row_shape), dtype=dtype, device=device)
            out = sm.empty((rows, *row_shape), dtype=dtype, device=device)
            in_splits = sm.empty(self.size, dtype=torch.int64, device=device)
            out_splits_offsets = sm.empty((2, self.size), dtype=torch.int64, device=device)
            for t in (inp, out, in_splits, out_splits_offsets):
                sm.rendezvous(t, name)
            bufs = self._buffers[key] = (inp, out, in_splits, out_splits_offsets)
        return bufs

    def exchange(self, send, send_splits, recv_splits, async_op):
        if self.size == 1:
            return send, None
        wire = as_wire(send.contiguous())
        if send_splits is None:  # equal blocks: same shape on every rank, size the buffer to fit
            send_splits = recv_splits = [wire.shape[0] // self.size] * self.size
            capacity = max(self.max_rows, wire.shape[0])
        else:
            capacity = self.max_rows
        if wire.shape[0] > capacity or sum(recv_splits) > capacity:
            raise ValueError(f"nvshmem backend: {max(wire.shape[0], sum(recv_splits))} rows exceed the "
                             f"symmetric buffer ({capacity} rows); raise max_tokens_per_rank")
        inp, out, in_splits, out_splits_offsets = self._buffers_for(wire.dtype, wire.shape[1:], capacity,
                                                                    wire.device)
        inp[: wire.shape[0]].copy_(wire)
        in_splits.copy_(torch.tensor(send_splits, dtype=torch.int64), non_blocking=True)
        torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, self.group.group_name)
        recv = out[: sum(recv_splits)].clone()
        return from_wire(recv, send.dtype), None


def _converted(t: torch.Tensor | None, dtype: torch.dtype | None, event: Event) -> torch.Tensor | None:
    """`t` in `dtype`, converted only once `event` says t is valid (a no-op when dtypes agree)."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    event.then(lambda: out.copy_(t))
    return out


# ---- DeepEP backend --------------------------------------------------------------------------


@dataclass
class DeepEPHandle:
    native: tuple  # deep_ep's own handle
    num_tokens: int
    num_recv_tokens: int


class DeepEPBackend:
    """deep_ep.Buffer (intranode NVLink / internode RDMA kernels; low-latency IBGDA kernels).

    Follows DeepEP's `Buffer` API (`get_dispatch_layout`, `dispatch`, `combine`,
    `low_latency_dispatch`, `low_latency_combine`) as Megatron-Core's fused_a2a uses it.
    DeepEP's limits apply: activations in bfloat16 (or an FP8 `(q, scales)` pair with
    hidden % 128 == 0), gate weights in fp32, and a cached dispatch cannot carry gate weights
    (so the gradient of `combined_topk_weights` is not supported here). Untested in CI (needs
    CUDA GPUs with DeepEP installed).
    """

    name = "deepep"

    def __init__(self, group, num_experts: int, num_sms: int | None = None, hidden_bytes: int = 0):
        backends.require("deep_ep")
        import deep_ep

        self.deep_ep = deep_ep
        self.group, self.size, self.rank = resolve_group(group)
        if self.group is None:
            raise ValueError("backend 'deepep' needs a torch.distributed process group")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.size
        if num_sms is not None:
            deep_ep.Buffer.set_num_sms(num_sms)
        self._hidden_bytes = hidden_bytes
        # Newer DeepEP builds choose the top-k index dtype (deep_ep.topk_idx_t); older ones take int64.
        self._topk_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self._buffer = None
        self._ll_buffer = None

    def _normal_buffer(self, hidden_bytes: int):
        Buffer, R = self.deep_ep.Buffer, self.size
        self._hidden_bytes = hidden_bytes = max(hidden_bytes, self._hidden_bytes)
        nvl = rdma = 0
        for config in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, R))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, R))
        b = self._buffer
        if b is None or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
            self._buffer = Buffer(self.group, nvl, rdma)
        return self._buffer

    @staticmethod
    def _native_x(payloads):
        if len(payloads) == 2 and payloads[0].dtype == FP8_DTYPE:
            return tuple(payloads)
        if len(payloads) == 1 and payloads[0].dtype == torch.bfloat16:
            return payloads[0]
        raise ValueError("DeepEP dispatches bfloat16 activations or an FP8 (q, scales) pair only; got "
                         f"{[tuple(p.shape) for p in payloads]} of {[p.dtype for p in payloads]}. "
                         "Use bfloat16 activations or the torch backend")

    @staticmethod
    def _hidden_bytes_of(x) -> int:
        q = x[0] if isinstance(x, tuple) else x
        return q.shape[1] * max(q.element_size(), 2)

    def layout(self, topk_idx):
        buffer = self._normal_buffer(self._hidden_bytes)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(self._topk(topk_idx), self.num_experts)
        return per_rank, per_expert, in_rank

    def _topk(self, topk_idx):
        return None if topk_idx is None else topk_idx.to(self._topk_dtype)

    def _per_rdma_rank(self, buffer, is_token_in_rank):
        rdma_ranks = buffer.runtime.get_num_rdma_ranks()
        if rdma_ranks <= 1:
            return None
        T = is_token_in_rank.shape[0]
        return is_token_in_rank.view(T, rdma_ranks, self.size // rdma_ranks).any(-1).sum(0, dtype=torch.int32)

    def dispatch(self, payloads, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, async_op: bool) -> DispatchResult:
        x = self._native_x(payloads)
        buffer = self._normal_buffer(self._hidden_bytes_of(x))
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            x, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=self._per_rdma_rank(buffer, is_token_in_rank),
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=self._topk(topk_idx),
            topk_weights=None if topk_weights is None else topk_weights.float(), async_finish=async_op)
        received = list(recv_x) if isinstance(recv_x, tuple) else [recv_x]
        T = is_token_in_rank.shape[0]
        wrapped = DeepEPHandle(handle, T, received[0].shape[0])
        ours = Event(native=event) if async_op else completed()
        recv_idx = _converted(recv_idx, torch.int64, ours)  # our contract: int64 ids, weights' dtype
        recv_w = _converted(recv_w, None if topk_weights is None else topk_weights.dtype, ours)
        return DispatchResult(received, recv_idx, recv_w, list(counts), wrapped, ours)

    def dispatch_cached(self, payloads, handle: DeepEPHandle, async_op: bool):
        if len(payloads) == 2 and payloads[0].dtype != FP8_DTYPE:
            raise NotImplementedError("DeepEP's cached dispatch cannot carry gate weights: the gradient of "
                                      "combined_topk_weights is unsupported on backend 'deepep'")
        x = self._native_x(payloads)
        buffer = self._normal_buffer(self._hidden_bytes_of(x))
        recv_x, _, _, _, _, event = buffer.dispatch(x, handle=handle.native, async_finish=async_op)
        received = list(recv_x) if isinstance(recv_x, tuple) else [recv_x]
        return received, Event(native=event) if async_op else completed()

    def combine(self, payloads, handle: DeepEPHandle, async_op: bool):
        x = payloads[0]
        if x.dtype != torch.bfloat16:
            raise ValueError(f"DeepEP combines bfloat16 rows only, got {x.dtype}")
        weights = payloads[1].float() if len(payloads) > 1 else None
        buffer = self._normal_buffer(self._hidden_bytes_of(x))
        combined, combined_w, event = buffer.combine(x, handle.native, topk_weights=weights,
                                                     async_finish=async_op)
        ours = Event(native=event) if async_op else completed()
        outputs = [combined] + ([_converted(combined_w, payloads[1].dtype, ours)] if weights is not None else [])
        return outputs, ours

    # --- low-latency mode ---------------------------------------------------------------
    def _low_latency_buffer(self, max_tokens: int, hidden: int, num_experts: int):
        Buffer = self.deep_ep.Buffer
        rdma = Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, self.size, num_experts)
        b = self._ll_buffer
        if b is None or b.num_rdma_bytes < rdma:
            self._ll_buffer = Buffer(self.group, 0, rdma, low_latency_mode=True,
                                     num_qps_per_rank=num_experts // self.size)
        return self._ll_buffer

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                             use_fp8=False, round_scale=False, async_finish=False,
                             return_recv_hook=False):
        buffer = self._low_latency_buffer(num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        kwargs = {}
        if round_scale:
            if "round_scale" not in inspect.signature(buffer.low_latency_dispatch).parameters:
                raise ValueError("this DeepEP version has no power-of-two scales (round_scale)")
            kwargs["round_scale"] = True
        recv_x, count, handle, event, hook = buffer.low_latency_dispatch(
            x, self._topk(topk_idx), num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
            async_finish=async_finish, return_recv_hook=return_recv_hook, **kwargs)
        return recv_x, count, handle, Event(native=event) if async_finish else completed(), hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, async_finish=False,
                            return_recv_hook=False):
        buffer = self._ll_buffer
        if buffer is None:
            raise RuntimeError("low_latency_combine before any low_latency_dispatch")
        combined, event, hook = buffer.low_latency_combine(
            x, self._topk(topk_idx), topk_weights.float(), handle, async_finish=async_finish,
            return_recv_hook=return_recv_hook)
        return combined, Event(native=event) if async_finish else completed(), hook


# ---- selection -------------------------------------------------------------------------------

BACKENDS = {"torch": TorchBackend, "deepep": DeepEPBackend, "nvshmem": NvshmemBackend}


def make_backend(name: str, group, num_experts: int, **options):
    """Build the named backend; an unavailable one raises a RuntimeError saying what is missing."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown flex dispatcher backend {name!r}; choose one of {sorted(BACKENDS)}") from None
    return cls(group, num_experts, **options)
