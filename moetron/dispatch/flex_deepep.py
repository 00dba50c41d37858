"""The flex dispatcher's DeepEP backend: DeepEP's `Buffer` behind the same raw operations as the
torch backend (flex_backends.py), one shared Buffer per process group, DeepEP's limits checked first.

Design notes: docs/dispatch.md (`moetron/dispatch/flex_deepep.py`). GPU only; proven on CPU against
the signature-faithful fake in tests/fakes/deep_ep (tests/test_deepep_fake.py).
"""

from __future__ import annotations

import inspect
import os
import weakref
from dataclasses import dataclass

import torch

from moetron import backends
from moetron.dispatch.base import Event, completed
from moetron.dispatch.flex_backends import DispatchResult, GroupRef, layout_of
from moetron.dispatch.fp8_dispatch import FP8_DTYPE

# DeepEP's limits (deep_ep/buffers/legacy.py and csrc/, DeepEP 2.1.0): moetron checks them before the call.
GROUP_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)  # Buffer.get_dispatch_config's table
MAX_TOPK_COLUMNS = 32  # normal kernels: num_topk <= 32
MAX_LOCAL_EXPERTS = 1024
NVL_PEERS = 8  # ranks per node; more ranks use RDMA (NVSHMEM)
LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # low-latency kernels are compiled for these
LL_MAX_TOPK = 11


def _fail(message: str) -> None:
    raise ValueError(f"flex_backend=deepep: {message}")


def check_group(size: int, num_experts: int) -> None:
    if size not in GROUP_SIZES:
        _fail(f"the dispatch group (TP x EP) has {size} ranks; DeepEP runs on {', '.join(map(str, GROUP_SIZES))} "
              f"ranks (its config table); change tp*ep or use the torch backend")
    if num_experts // size > MAX_LOCAL_EXPERTS:
        _fail(f"{num_experts // size} experts per rank (num_experts*etp / group) exceed DeepEP's "
              f"{MAX_LOCAL_EXPERTS}; use more ranks or the torch backend")


def check_topk_columns(columns: int, what: str = "top-k columns") -> None:
    if columns > MAX_TOPK_COLUMNS:
        _fail(f"{what} = {columns} exceeds DeepEP's {MAX_TOPK_COLUMNS} top-k columns; lower etp or use the "
              f"torch backend")


def check_hidden_bytes(hidden: int, element_size: int, what: str = "hidden") -> None:
    if hidden * element_size % 16:
        _fail(f"{what} = {hidden} is {hidden * element_size} bytes per row, not a multiple of 16 (DeepEP moves "
              f"rows in 16-byte vectors); pad the hidden size to a multiple of {16 // element_size}")


def qp_depth() -> int:
    return int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))


def check_low_latency(x: torch.Tensor, topk_idx: torch.Tensor, M: int, num_experts: int, size: int, *,
                      use_fp8: bool, async_finish: bool, return_recv_hook: bool) -> None:
    T, H = x.shape
    if x.dtype != torch.bfloat16:
        _fail(f"low_latency_dispatch takes bfloat16 activations, got {x.dtype}; cast x to bfloat16")
    if H not in LL_HIDDEN:
        _fail(f"low-latency hidden = {H} is not one DeepEP's kernels are built for ({', '.join(map(str, LL_HIDDEN))}); "
              f"use the normal dispatch or the torch backend")
    # DeepEP's FP8 cast also needs hidden % 512 == 0: every size above is a multiple of 512.
    if topk_idx.shape[1] > LL_MAX_TOPK:
        _fail(f"low-latency top-k columns = {topk_idx.shape[1]} exceeds DeepEP's {LL_MAX_TOPK}; use the normal "
              f"dispatch or the torch backend")
    if T > M:
        _fail(f"{T} tokens exceed num_max_dispatch_tokens_per_rank = {M}")
    if (M + 1) * 2 > qp_depth():
        _fail(f"num_max_dispatch_tokens_per_rank = {M} needs NVSHMEM_QP_DEPTH >= {(M + 1) * 2} (now {qp_depth()}, "
              f"so M <= {qp_depth() // 2 - 1}); lower M or set NVSHMEM_QP_DEPTH before the first dispatch")
    if size * M % 4:
        _fail(f"ranks * num_max_dispatch_tokens_per_rank = {size} * {M} is not a multiple of 4 (TMA); round M up")
    if async_finish and return_recv_hook:
        _fail("low-latency calls take async_finish or return_recv_hook, not both")
    if num_experts % size:
        _fail(f"num_experts = {num_experts} is not a multiple of the {size} ranks")


# ---- one set of Buffers per process group ------------------------------------------------------


class SharedBuffers:
    """The DeepEP Buffers of one process group, shared by every flex dispatcher on it.

    The normal Buffer is built at first use for the largest hidden size any dispatcher reserved (MoE
    layers reserve theirs when built, so a model gets one Buffer) and rebuilt larger only when a bigger
    row arrives (the old one is released first); across nodes that would re-initialise NVSHMEM, which
    DeepEP does not support, so it is refused. The low-latency Buffer is sized once.
    """

    def __init__(self, deep_ep, group) -> None:
        self.deep_ep, self.group_ref = deep_ep, weakref.ref(group)
        self.size = group.size()
        self.hidden_bytes = 0
        self.normal = None
        self.low_latency = None
        self.ll_shape: tuple[int, int, int] | None = None  # (max tokens per rank, hidden, num_experts)

    def reserve(self, hidden_bytes: int) -> None:
        self.hidden_bytes = max(self.hidden_bytes, hidden_bytes)

    def normal_buffer(self, hidden_bytes: int):
        Buffer, R = self.deep_ep.Buffer, self.size
        self.reserve(hidden_bytes)
        nvl = rdma = 0
        for config in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(self.hidden_bytes, R))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(self.hidden_bytes, R))
        b = self.normal
        if b is not None and b.num_nvl_bytes >= nvl and b.num_rdma_bytes >= rdma:
            return b
        if b is not None and R > NVL_PEERS:
            _fail(f"a dispatch of {hidden_bytes} bytes per row outgrows the shared DeepEP buffer; across nodes "
                  f"DeepEP cannot re-initialise NVSHMEM (DeepEP issue #76): reserve the largest row up front "
                  f"(backend option hidden_bytes={self.hidden_bytes})")
        if rdma and self.low_latency is not None:
            _fail("a normal internode Buffer and a low-latency Buffer would both initialise NVSHMEM in this "
                  "process; use one mode per process")
        self.normal = None  # release the old buffer before allocating the new one
        self.normal = Buffer(self.group_ref(), nvl, rdma)
        return self.normal

    def low_latency_buffer(self, M: int, hidden: int, num_experts: int, capacity: int | None):
        if self.low_latency is not None:
            M0, H0, E0 = self.ll_shape
            if M > M0 or hidden > H0 or num_experts != E0:
                _fail(f"the low-latency buffer was sized once for num_max_dispatch_tokens_per_rank={M0}, hidden="
                      f"{H0}, num_experts={E0}; this call needs {M}, {hidden}, {num_experts}. Build the first "
                      f"FlexBuffer with backend option max_dispatch_tokens_per_rank=<the model's largest M>")
            return self.low_latency
        if self.normal is not None and self.normal.num_rdma_bytes:
            _fail("a normal internode Buffer and a low-latency Buffer would both initialise NVSHMEM in this "
                  "process; use one mode per process")
        M0 = max(M, capacity or 0)
        rdma = self.deep_ep.Buffer.get_low_latency_rdma_size_hint(M0, hidden, self.size, num_experts)
        self.low_latency = self.deep_ep.Buffer(self.group_ref(), 0, rdma, low_latency_mode=True,
                                               num_qps_per_rank=num_experts // self.size)
        self.ll_shape = (M0, hidden, num_experts)
        return self.low_latency


_SHARED: dict[str, SharedBuffers] = {}


def shared_buffers(deep_ep, group) -> SharedBuffers:
    """This process's SharedBuffers for `group` (a new group of a reused name gets new buffers)."""
    entry = _SHARED.get(group.group_name)
    if entry is None or entry.group_ref() is not group:
        entry = _SHARED[group.group_name] = SharedBuffers(deep_ep, group)
    return entry


def release_buffers() -> None:
    """Drop every shared DeepEP Buffer of this process (e.g. before `dist.destroy_process_group()`)."""
    _SHARED.clear()


# ---- the backend -------------------------------------------------------------------------------


def _converted(t: torch.Tensor | None, dtype: torch.dtype | None, event: Event) -> torch.Tensor | None:
    """`t` in `dtype`, converted only once `event` says t is valid (a no-op when dtypes agree)."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    event.then(lambda: out.copy_(t))
    return out


@dataclass
class DeepEPHandle:
    native: tuple  # deep_ep's own handle
    num_tokens: int
    num_recv_tokens: int


class DeepEPBackend:
    """deep_ep.Buffer (intranode NVLink / internode RDMA kernels; low-latency IBGDA kernels).

    Options: `num_sms` (Buffer.set_num_sms), `hidden_bytes` (reserve the shared Buffer for rows of this
    size), `max_dispatch_tokens_per_rank` (size the low-latency Buffer for this M). Activations travel in
    bfloat16 (or as an FP8 `(q, scales)` pair), gate weights in fp32; a cached dispatch cannot carry
    gate weights, so the gradient of `combined_topk_weights` is not supported here.
    """

    name = "deepep"
    max_topk_columns = MAX_TOPK_COLUMNS

    def __init__(self, group, num_experts: int, num_sms: int | None = None, hidden_bytes: int = 0,
                 max_dispatch_tokens_per_rank: int | None = None):
        backends.require("deep_ep")
        import deep_ep

        self.deep_ep = deep_ep
        self.group_ref = GroupRef(group)
        self.size, self.rank = self.group_ref.size, self.group_ref.rank
        check_group(self.size, num_experts)
        if self.group_ref.handle is None:
            raise ValueError("flex_backend=deepep needs a torch.distributed process group")
        if num_sms is not None:
            deep_ep.Buffer.set_num_sms(num_sms)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.size
        self.ll_capacity = max_dispatch_tokens_per_rank
        self.buffers = shared_buffers(deep_ep, self.group_ref.handle)
        self.buffers.reserve(hidden_bytes)
        # Newer DeepEP builds choose the top-k index dtype (deep_ep.topk_idx_t); older ones take int64.
        self._topk_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)

    def reserve(self, hidden: int, dtype: torch.dtype) -> None:
        self.buffers.reserve(hidden * max(dtype.itemsize, 2))

    @staticmethod
    def _native_x(payloads):
        if len(payloads) == 2 and payloads[0].dtype == FP8_DTYPE:
            check_hidden_bytes(payloads[0].shape[1], 1)
            return tuple(payloads)
        if len(payloads) == 1 and payloads[0].dtype == torch.bfloat16:
            check_hidden_bytes(payloads[0].shape[1], 2)
            return payloads[0]
        _fail("DeepEP dispatches bfloat16 activations or an FP8 (q, scales) pair only; got "
              f"{[tuple(p.shape) for p in payloads]} of {[p.dtype for p in payloads]}. Use bfloat16 "
              "activations or the torch backend")

    @staticmethod
    def _hidden_bytes_of(x) -> int:
        q = x[0] if isinstance(x, tuple) else x
        return q.shape[1] * max(q.element_size(), 2)

    def layout(self, topk_idx):
        check_topk_columns(topk_idx.shape[1])
        if self.buffers.normal is None and not self.buffers.hidden_bytes:
            # No row size known yet: the layout is local math, so compute it here rather than build a
            # Buffer for hidden 0 that the first dispatch would throw away.
            return layout_of(topk_idx, self.num_experts, self.size)
        buffer = self.buffers.normal_buffer(0)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(self._topk(topk_idx), self.num_experts)
        return per_rank, per_expert, in_rank

    def _topk(self, topk_idx):
        return None if topk_idx is None else topk_idx.to(self._topk_dtype).contiguous()

    def _per_rdma_rank(self, buffer, is_token_in_rank):
        rdma_ranks = buffer.runtime.get_num_rdma_ranks()
        if rdma_ranks <= 1:
            return None
        T = is_token_in_rank.shape[0]
        return is_token_in_rank.view(T, rdma_ranks, self.size // rdma_ranks).any(-1).sum(0, dtype=torch.int32)

    def dispatch(self, payloads, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, async_op: bool) -> DispatchResult:
        x = self._native_x(payloads)
        if topk_idx is not None:
            check_topk_columns(topk_idx.shape[1])
            if topk_weights is None:
                _fail("a dispatch with topk_idx needs topk_weights too (DeepEP sends both or neither); pass "
                      "topk_weights")
        buffer = self.buffers.normal_buffer(self._hidden_bytes_of(x))
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            x, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=self._per_rdma_rank(buffer, is_token_in_rank),
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=self._topk(topk_idx),
            topk_weights=None if topk_weights is None else topk_weights.float().contiguous(), async_finish=async_op)
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
        buffer = self.buffers.normal_buffer(self._hidden_bytes_of(x))
        recv_x, _, _, _, _, event = buffer.dispatch(x, handle=handle.native, async_finish=async_op)
        received = list(recv_x) if isinstance(recv_x, tuple) else [recv_x]
        return received, Event(native=event) if async_op else completed()

    def combine(self, payloads, handle: DeepEPHandle, async_op: bool):
        x = payloads[0]
        if x.dtype != torch.bfloat16:
            _fail(f"DeepEP combines bfloat16 rows only, got {x.dtype}; use bfloat16 activations or the torch backend")
        check_hidden_bytes(x.shape[1], 2)
        weights = payloads[1].float().contiguous() if len(payloads) > 1 else None
        buffer = self.buffers.normal_buffer(self._hidden_bytes_of(x))
        combined, combined_w, event = buffer.combine(x.contiguous(), handle.native, topk_weights=weights,
                                                     async_finish=async_op)
        ours = Event(native=event) if async_op else completed()
        outputs = [combined] + ([_converted(combined_w, payloads[1].dtype, ours)] if weights is not None else [])
        return outputs, ours

    # --- low-latency mode ---------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                             use_fp8=False, round_scale=False, async_finish=False,
                             return_recv_hook=False):
        check_low_latency(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, self.size, use_fp8=use_fp8,
                          async_finish=async_finish, return_recv_hook=return_recv_hook)
        buffer = self.buffers.low_latency_buffer(num_max_dispatch_tokens_per_rank, x.shape[1], num_experts,
                                                 self.ll_capacity)
        kwargs = {}
        if round_scale:
            if "round_scale" not in inspect.signature(buffer.low_latency_dispatch).parameters:
                _fail("this DeepEP version has no power-of-two scales (round_scale); pass round_scale=False")
            kwargs["round_scale"] = True
        recv_x, count, handle, event, hook = buffer.low_latency_dispatch(
            x.contiguous(), self._topk(topk_idx), num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
            async_finish=async_finish, return_recv_hook=return_recv_hook, **kwargs)
        return recv_x, count, handle, Event(native=event) if async_finish else completed(), hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, async_finish=False,
                            return_recv_hook=False):
        buffer = self.buffers.low_latency
        if buffer is None:
            raise RuntimeError("low_latency_combine before any low_latency_dispatch")
        if x.dtype != torch.bfloat16:
            _fail(f"low_latency_combine takes bfloat16 expert outputs, got {x.dtype}")
        if async_finish and return_recv_hook:
            _fail("low-latency calls take async_finish or return_recv_hook, not both")
        combined, event, hook = buffer.low_latency_combine(
            x.contiguous(), self._topk(topk_idx), topk_weights.float().contiguous(), handle,
            async_finish=async_finish, return_recv_hook=return_recv_hook)
        return combined, Event(native=event) if async_finish else completed(), hook
