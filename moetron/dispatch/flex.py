"""FlexBuffer: DeepEP's dispatch/combine API over one group (TP×EP as one), with backends.

    flex = FlexBuffer(group, num_experts, backend="torch")     # or "deepep", "nvshmem"
    num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        flex.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        flex.dispatch(x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                      num_tokens_per_expert)
    ...  # experts: rows of recv_x, gate weights recv_topk_weights for local ids recv_topk_idx
    combined_x, combined_topk_weights, event = flex.combine(expert_out, handle)

Design notes: docs/dispatch.md (`moetron/dispatch/flex.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moetron.dispatch.base import Event, completed
from moetron.dispatch.flex_backends import TorchBackend, resolve_group
from moetron.dispatch.flex_deepep import DeepEPBackend
from moetron.dispatch.flex_nvshmem import NvshmemBackend
from moetron.dispatch.fp8_dispatch import FP8_DTYPE, dequantize_rows, quantize_rows
from moetron.dispatch.permute import PermuteState, permute, unpermute
from moetron.dispatch.routing import Routing

__all__ = ["FlexBuffer", "FlexHandle", "FlexTokenDispatcher", "Event"]


# ---- selection -------------------------------------------------------------------------------

BACKENDS = {"torch": TorchBackend, "deepep": DeepEPBackend, "nvshmem": NvshmemBackend}


def make_backend(name: str, group, num_experts: int, **options):
    """Build the named backend; an unavailable one raises a RuntimeError saying what is missing."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown flex dispatcher backend {name!r}; choose one of {sorted(BACKENDS)}") from None
    return cls(group, num_experts, **options)


@dataclass
class FlexHandle:
    """A dispatch's layout; pass it to combine or to a cached dispatch."""

    native: Any  # the backend's handle
    num_tokens: int  # tokens on this rank (rows of combine's output)
    num_recv_tokens: int  # rows this rank received
    event: Event  # the dispatch's completion; must be done before the handle is used

    def check_ready(self, what: str) -> None:
        if not self.event.done:
            raise RuntimeError(f"{what}: the dispatch that made this handle ran with async_finish=True "
                               "and its event was not waited; call event.wait() before using its "
                               "results or its handle")


def _wait(event) -> None:
    if event is not None:
        event.wait()


class _Dispatch(torch.autograd.Function):
    """recv_x, recv_topk_weights = dispatch(x, topk_weights); backward: combine."""

    @staticmethod
    def forward(ctx, x, topk_weights, flex, layout, topk_idx, handle, async_op, out):
        backend = flex.backend
        payloads = list(quantize_rows(x, flex.fp8_power_of_two)) if flex.fp8 else [x]
        if handle is None:
            res = backend.dispatch(payloads, topk_idx, topk_weights, *layout, async_op)
            received, event, native = res.payloads, res.event, res.handle
            recv_topk_idx, recv_w = res.recv_topk_idx, res.recv_topk_weights
            out["counts"] = res.num_recv_tokens_per_expert_list
        else:
            received, event = backend.dispatch_cached(payloads, handle.native, async_op)
            native, recv_topk_idx, recv_w = handle.native, None, None
            out["counts"] = None
        if flex.fp8:
            recv_x = x.new_empty((received[0].shape[0], x.shape[1]))
            q, scales = received
            event.then(lambda: recv_x.copy_(dequantize_rows(q, scales, x.dtype)))
        else:
            recv_x = received[0]
        new_handle = FlexHandle(native, x.shape[0], recv_x.shape[0], event)
        out.update(recv_topk_idx=recv_topk_idx, handle=new_handle, event=event)
        ctx.backend, ctx.native, ctx.recv_topk_idx = backend, native, recv_topk_idx
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and grad_recv_w is not None
        if not want_x and not want_w:
            return (None,) * 8
        if grad_recv_x is None:  # weights only: combine still needs a row payload
            grad_recv_x = grad_recv_w.new_zeros(grad_recv_w.shape[0], 1)
        payloads = [grad_recv_x.contiguous()]
        if want_w:  # recv weights are masked to the local experts: so is their gradient
            payloads.append(grad_recv_w.masked_fill(ctx.recv_topk_idx < 0, 0))
        grads, _ = ctx.backend.combine(payloads, ctx.native, async_op=False)
        return (grads[0] if want_x else None), (grads[1] if want_w else None), *(None,) * 6


class _Combine(torch.autograd.Function):
    """combined_x, combined_w = combine(x, topk_weights); backward: a cached dispatch."""

    @staticmethod
    def forward(ctx, x, topk_weights, flex, handle, async_op, out):
        payloads = [x] + ([topk_weights] if topk_weights is not None else [])
        outputs, event = flex.backend.combine(payloads, handle.native, async_op)
        out["event"] = event
        ctx.backend, ctx.native = flex.backend, handle.native
        return outputs[0], (outputs[1] if topk_weights is not None else None)

    @staticmethod
    def backward(ctx, grad_x, grad_w):
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and grad_w is not None
        if not want_x and not want_w:
            return (None,) * 6
        if grad_x is None:
            grad_x = grad_w.new_zeros(grad_w.shape[0], 1)
        payloads = [grad_x.contiguous()] + ([grad_w.contiguous()] if want_w else [])
        grads, _ = ctx.backend.dispatch_cached(payloads, ctx.native, async_op=False)
        return (grads[0] if want_x else None), (grads[1] if want_w else None), None, None, None, None


class FlexBuffer:
    """DeepEP's `Buffer` API (layout, dispatch, combine, low latency) over `group` (a moetron Group or
    ProcessGroup) and any backend; `FlexTokenDispatcher` below is the MoE dispatcher built on it.

    backend: "torch" (uneven all-to-all; gloo/NCCL; always available), "deepep" (deep_ep.Buffer,
    CUDA), "nvshmem" (torch symmetric-memory all_to_all_vdev, CUDA). A named backend that cannot
    run here raises a RuntimeError saying why; nothing falls back silently. `backend_options`
    go to the backend (deepep: num_sms, hidden_bytes; nvshmem: max_tokens_per_rank).
    fp8 / fp8_power_of_two: FP8 dispatch of activation rows (see module doc).

    Host synchronisation (normal mode, as DeepEP's normal kernels): a fresh dispatch exchanges
    counts and reads them once on the host, because they decide the output shapes; with
    `async_finish` that small exchange is synchronous and only the row transfers overlap. Cached
    dispatches and combines never synchronise. The low-latency mode never does.
    """

    def __init__(self, group, num_experts: int, backend: str = "torch", *, fp8: bool = False,
                 fp8_power_of_two: bool = False, **backend_options):
        _, size, rank = resolve_group(group)
        if num_experts % size:
            raise ValueError(f"the dispatch group has {size} ranks, which does not divide "
                             f"num_experts={num_experts}: every rank must own the same number of experts")
        # The group itself lives in the backend, held weakly (flex_backends.GroupRef).
        self.num_ranks, self.rank = size, rank
        self.num_experts, self.num_local_experts = num_experts, num_experts // size
        self.fp8, self.fp8_power_of_two = fp8, fp8_power_of_two
        self.backend = make_backend(backend, group, num_experts, **backend_options)

    @property
    def local_experts(self) -> range:
        return range(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    # --- layout -------------------------------------------------------------------------
    def _check_topk(self, topk_idx: torch.Tensor, num_experts: int | None) -> None:
        if num_experts is not None and num_experts != self.num_experts:
            raise ValueError(f"num_experts={num_experts} but this dispatcher was built for {self.num_experts}")
        if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
            raise ValueError(f"topk_idx must be [num_tokens, k] int64, got {tuple(topk_idx.shape)} {topk_idx.dtype}")
        if not topk_idx.numel():
            return
        in_range = ((topk_idx >= -1) & (topk_idx < self.num_experts)).all()
        if topk_idx.is_cuda:  # checked on the device: no host sync
            torch._assert_async(in_range, f"topk_idx values must be in [-1, {self.num_experts})")
        elif not bool(in_range):
            lo, hi = torch.aminmax(topk_idx)
            raise ValueError(f"topk_idx values must be expert ids in [0, {self.num_experts}) or -1 "
                             f"(dropped); got min {int(lo)}, max {int(hi)}")

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int | None = None,
                            previous_event: Event | None = None, async_finish: bool = False):
        """Returns `(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [T,R] bool, event)`. Local; `async_finish` is accepted for API parity."""
        self._check_topk(topk_idx, num_experts)
        _wait(previous_event)
        per_rank, per_expert, in_rank = self.backend.layout(topk_idx)
        return per_rank, per_expert, in_rank, completed()

    # --- dispatch -----------------------------------------------------------------------
    def dispatch(self, x, topk_idx=None, topk_weights=None, num_tokens_per_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, handle: FlexHandle | None = None,
                 previous_event: Event | None = None, async_finish: bool = False,
                 expert_alignment: int = 1):
        """Returns `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)`. With `handle` (cached) only x travels; the other three are None.
        `num_recv_tokens_per_expert_list` is rounded up to `expert_alignment` (as DeepEP)."""
        _wait(previous_event)
        if handle is not None:
            handle.check_ready("dispatch")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=...) reuses the layout: pass no topk_idx/topk_weights")
            layout = None
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                raise ValueError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                                 "num_tokens_per_expert (from get_dispatch_layout)")
            if topk_idx is not None:
                self._check_topk(topk_idx, None)
                if topk_weights is not None and topk_weights.shape != topk_idx.shape:
                    raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_idx "
                                     f"{tuple(topk_idx.shape)}")
            elif topk_weights is not None:
                raise ValueError("topk_weights without topk_idx")
            layout = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
            T = is_token_in_rank.shape[0]
            if x_rows(x) != T:
                raise ValueError(f"x has {x_rows(x)} rows but the layout is for {T} tokens")

        if isinstance(x, tuple):  # DeepEP-style pre-quantized (q, scales): no autograd
            return self._dispatch_fp8_pair(x, topk_idx, topk_weights, layout, handle, async_finish,
                                           expert_alignment)
        out: dict = {}
        recv_x, recv_w = _Dispatch.apply(x, topk_weights, self, layout, topk_idx, handle, async_finish, out)
        return (recv_x, out["recv_topk_idx"], recv_w, _align(out["counts"], expert_alignment),
                out["handle"], out["event"])

    def _dispatch_fp8_pair(self, x, topk_idx, topk_weights, layout, handle, async_op, alignment):
        q, scales = x
        if q.dtype != FP8_DTYPE or scales.dtype != torch.float32:
            raise ValueError(f"an FP8 dispatch pair is (float8_e4m3fn rows, float32 scales); got "
                             f"({q.dtype}, {scales.dtype})")
        with torch.no_grad():
            if handle is None:
                res = self.backend.dispatch([q, scales], topk_idx, topk_weights, *layout, async_op)
                new = FlexHandle(res.handle, q.shape[0], res.payloads[0].shape[0], res.event)
                return (tuple(res.payloads), res.recv_topk_idx, res.recv_topk_weights,
                        _align(res.num_recv_tokens_per_expert_list, alignment), new, res.event)
            received, event = self.backend.dispatch_cached([q, scales], handle.native, async_op)
        new = FlexHandle(handle.native, q.shape[0], received[0].shape[0], event)
        return tuple(received), None, None, None, new, event

    # --- combine ------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: FlexHandle, topk_weights: torch.Tensor | None = None,
                previous_event: Event | None = None, async_finish: bool = False):
        """Returns `(combined_x [T,H], combined_topk_weights [T,k] or None, event)`: the unweighted
        sum over destination ranks of each source token's rows (and of its top-k weights)."""
        _wait(previous_event)
        handle.check_ready("combine")
        if x.shape[0] != handle.num_recv_tokens:
            raise ValueError(f"combine: x has {x.shape[0]} rows but the dispatch delivered "
                             f"{handle.num_recv_tokens}")
        out: dict = {}
        combined_x, combined_w = _Combine.apply(x, topk_weights, self, handle, async_finish, out)
        return combined_x, combined_w, out["event"]

    # --- low-latency mode ---------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int | None = None, *,
                             use_fp8: bool = False, round_scale: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Fixed-shape dispatch without host synchronisation (see low_latency.py).

        Returns `(recv_x [L, R*M, H] (or (q, scales) with use_fp8), recv_count [L] int32,
        handle, event, hook)`. `round_scale`: power-of-two FP8 scales. No autograd.
        """
        self._check_ll(topk_idx, num_experts)
        return self.backend.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, self.num_experts, use_fp8=use_fp8,
            round_scale=round_scale, async_finish=async_finish, return_recv_hook=return_recv_hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle, *, async_finish: bool = False, return_recv_hook: bool = False):
        """Weighted combine of `x [L, R*M, H]`; returns `(combined_x [T,H], event, hook)`."""
        return self.backend.low_latency_combine(x, topk_idx, topk_weights, handle,
                                                async_finish=async_finish, return_recv_hook=return_recv_hook)

    def _check_ll(self, topk_idx, num_experts) -> None:
        # No value checks here: reading topk_idx on the host would synchronise.
        if num_experts is not None and num_experts != self.num_experts:
            raise ValueError(f"num_experts={num_experts} but this dispatcher was built for {self.num_experts}")
        if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
            raise ValueError(f"topk_idx must be [num_tokens, k] int64, got {tuple(topk_idx.shape)} {topk_idx.dtype}")


def x_rows(x) -> int:
    return (x[0] if isinstance(x, tuple) else x).shape[0]


def _align(counts: list[int] | None, alignment: int) -> list[int] | None:
    if counts is None or alignment == 1:
        return counts
    return [-(-c // alignment) * alignment for c in counts]


# ---- the TokenDispatcher protocol on top of FlexBuffer ------------------------------------


@dataclass
class FlexTokenHandle:
    flex_handle: FlexHandle
    state: PermuteState  # received rows -> expert-major rows of the local experts
    recv_topk_weights: torch.Tensor  # [N, k'] gate weights of the received rows (0: not local)


@dataclass
class PendingDispatch:
    """An issued dispatch: `FlexTokenDispatcher.dispatch_finish` waits for it and permutes."""

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    handle: FlexHandle
    event: Event
    pad_to: int | None = None


class FlexTokenDispatcher:
    """moetron's TokenDispatcher (`dispatch(x, routing)`, `combine(y, handle)`) on FlexBuffer.

    `group` is TP×EP as one group whose rank is `etp_rank + etp * ep_rank` (ETP fastest, as
    ParallelState's `tp_ep`). EP rank e holds experts `e*L ... e*L+L-1` (L = num_experts / ep);
    with `etp > 1` each of its ETP ranks holds a slice of every such expert, so a token goes to
    all of them and the flex combine adds up their partial outputs. dispatch: flex dispatch ->
    expand each received row to its (row, local expert) slots -> permute expert-major.
    combine: gate-weight and sum per received row (unpermute) -> flex combine.
    To overlap shared experts with the transfer: `p = dispatch_start(x, routing)`, compute,
    then `dispatch_finish(p)`.
    """

    def __init__(self, group, num_experts: int, *, etp: int = 1, backend: str = "torch",
                 pad_multiple: int = 1, pad_to_capacity: bool = False, fp8: bool = False,
                 fp8_power_of_two: bool = False, top_k: int | None = None, **backend_options):
        _, size, rank = resolve_group(group)
        if etp < 1 or size % etp:
            raise ValueError(f"etp={etp} does not divide the dispatch group size {size}")
        ep = size // etp
        if num_experts % ep:
            raise ValueError(f"ep={ep} (group {size} / etp {etp}) does not divide num_experts={num_experts}")
        self.num_experts, self.etp, self.ep = num_experts, etp, ep
        self.num_local_experts = num_experts // ep
        self.pad_multiple, self.pad_to_capacity, self.group_size = pad_multiple, pad_to_capacity, size
        # One flex "expert" per (expert, ETP rank): group rank g owns ids g*L ... g*L+L-1.
        self.flex = FlexBuffer(group, num_experts * etp, backend, fp8=fp8,
                                   fp8_power_of_two=fp8_power_of_two, **backend_options)
        if top_k is not None:  # known when built (MoELayer): check the backend's limit now
            self._check_columns(top_k)

    def _check_columns(self, top_k: int) -> None:
        """Each token sends top_k*etp (expert, ETP rank) columns; some backends cap them."""
        limit = self.flex.backend.max_topk_columns
        if limit is not None and top_k * self.etp > limit:
            raise ValueError(f"flex_backend={self.flex.backend.name}: top_k*etp = {top_k * self.etp} exceeds "
                             f"the backend's {limit} top-k columns; lower etp or use the torch backend")

    def _flex_routing(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        idx, w = routing.topk_idx, routing.topk_weights
        if self.etp == 1:
            return idx, w
        L, etp = self.num_local_experts, self.etp
        tp = torch.arange(etp, device=idx.device)
        owner, local = torch.div(idx, L, rounding_mode="floor"), idx % L
        virtual = (owner.unsqueeze(-1) * etp + tp) * L + local.unsqueeze(-1)
        virtual = torch.where(idx.unsqueeze(-1) >= 0, virtual, -1).flatten(1)
        return virtual, w.unsqueeze(-1).expand(*w.shape, etp).flatten(1)

    def dispatch_start(self, x_TH: torch.Tensor, routing: Routing) -> PendingDispatch:
        if routing.num_experts != self.num_experts:
            raise ValueError(f"routing is over {routing.num_experts} experts, dispatcher over {self.num_experts}")
        self._check_columns(routing.topk_idx.shape[1])
        self.flex.backend.reserve(x_TH.shape[1], x_TH.dtype)  # before the layout: never a Buffer for hidden 0
        topk_idx, topk_weights = self._flex_routing(routing)
        per_rank, per_expert, in_rank, _ = self.flex.get_dispatch_layout(topk_idx)
        recv_x, recv_idx, recv_w, _, handle, event = self.flex.dispatch(
            x_TH, topk_idx, topk_weights, per_rank, in_rank, per_expert, async_finish=True)
        # Each source rank sends an expert at most `capacity` rows: pad every local expert to that.
        pad_to = self.group_size * routing.capacity if self.pad_to_capacity and routing.capacity else None
        return PendingDispatch(recv_x, recv_idx, recv_w, handle, event, pad_to)

    def dispatch_finish(self, pending: PendingDispatch) -> tuple[torch.Tensor, torch.Tensor, FlexTokenHandle]:
        pending.event.wait()
        x_NH, state = permute(pending.recv_x, pending.recv_topk_idx, self.num_local_experts,
                              pad_multiple=self.pad_multiple, pad_to=pending.pad_to)
        return x_NH, state.rows_per_expert, FlexTokenHandle(pending.handle, state, pending.recv_topk_weights)

    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, FlexTokenHandle]:
        return self.dispatch_finish(self.dispatch_start(x_TH, routing))

    def combine(self, y_NH: torch.Tensor, handle: FlexTokenHandle) -> torch.Tensor:
        rows = unpermute(y_NH, handle.state, handle.recv_topk_weights)  # [N, H] weighted, per received row
        out, _, _ = self.flex.combine(rows, handle.flex_handle)
        return out
