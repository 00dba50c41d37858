"""The flex dispatcher's DeepEP backend: DeepEP's `Buffer` behind the same raw operations as the
torch backend (flex_backends.py). GPU only; proven on CPU against tests/fakes/deep_ep."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from moetron import backends
from moetron.dispatch.base import Event, completed
from moetron.dispatch.flex_backends import DispatchResult, resolve_group
from moetron.dispatch.fp8_dispatch import FP8_DTYPE


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
