"""The MoE layer as schedulable pieces (DESIGN principle 5): dispatch | experts | combine, and with
a phased dispatcher (all-to-all) the two EP all-to-alls as `CommPiece`s that a pipeline executor
issues asynchronously and waits for only when the next piece needs the rows, so they hide behind
another micro-batch's compute. The pipeline only chains pieces (docs/pipeline.md).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moetron.dispatch.base import RowExchange, is_phased
from moetron.ops import recompute
from moetron.parallel.comm import PendingAllToAll

__all__ = ["CommPiece", "PendingGradients", "Piece", "Tensors", "Transfer", "moe_pieces"]

Tensors = tuple[torch.Tensor, ...]
Piece = tuple[str, Callable[[Tensors], Tensors]]


def _entries(entry: int | tuple[int, ...]) -> tuple[int, ...]:
    return (entry,) if isinstance(entry, int) else tuple(entry)


class CommPiece:
    """A piece that all-to-alls state entry `entry` (or entries: the rows and their gate weights,
    with the same splits); `exchange()` gives the splits, known only once the previous piece ran
    (the count exchange)."""

    def __init__(self, entry: int | tuple[int, ...], exchange: Callable[[], RowExchange]):
        self.entry = entry
        self.exchange = exchange

    def __call__(self, state: Tensors) -> Tensors:
        """Synchronous, through autograd (comm.all_to_all)."""
        exchange, entries = self.exchange(), _entries(self.entry)
        return tuple(exchange(t) if i in entries else t.view_as(t) for i, t in enumerate(state))

    def start(self, state: Tensors) -> Transfer:
        """Issue the all-to-all without waiting."""
        return Transfer(self.entry, self.exchange(), state)


class Transfer:
    """One run of a CommPiece: the forward all-to-all(s) in flight, then the backward ones."""

    def __init__(self, entry: int | tuple[int, ...], exchange: RowExchange, state: Tensors):
        self.entry, self.exchange = entry, exchange
        entries = _entries(entry)
        self.requires_grad = {e: state[e].requires_grad for e in entries}
        self._state: Tensors | None = state
        self._pending: dict[int, PendingAllToAll] | None = {e: exchange.start(state[e]) for e in entries}
        self._received: dict[int, tuple] = {}  # (shape, dtype, device) of each received entry

    def wait(self) -> Tensors:
        """The piece's output: the received entries (fresh leaves) with the other entries."""
        state, out = self._state, {}
        for e, pending in self._pending.items():
            out[e] = rows = pending.wait().requires_grad_(self.requires_grad[e])
            self._received[e] = (rows.shape, rows.dtype, rows.device)
        self._pending = self._state = None
        return tuple(out.get(i, t) for i, t in enumerate(state))

    def start_backward(self, grads: Sequence[torch.Tensor | None]) -> PendingGradients:
        """Issue the reverse all-to-all of each entry's gradient (zeros where none arrived: the
        other ranks wait for our rows)."""
        grads, pending = list(grads), {}
        for e, needs in self.requires_grad.items():
            if not needs:
                grads[e] = None
                continue
            g = grads[e]
            if g is None:
                shape, dtype, device = self._received[e]
                g = torch.zeros(shape, dtype=dtype, device=device)
            pending[e] = self.exchange.reversed().start(g)
        return PendingGradients(tuple(grads), pending)


class PendingGradients:
    """The input gradients of a CommPiece, some of them still travelling."""

    def __init__(self, grads: Tensors, pending: dict[int, PendingAllToAll] | None = None):
        self._grads, self._pending = grads, pending or {}

    def wait(self) -> Tensors:
        done = {e: p.wait() for e, p in self._pending.items()}
        return tuple(done.get(i, g) for i, g in enumerate(self._grads))


def moe_pieces(norm: Callable, moe, index: int) -> list[Piece]:
    """dispatch | experts (+ shared experts) | combine (+ residual) for the MoE layer `moe` that
    follows the residual stream's `norm` (the decoder layer's post-attention norm); with a phased
    dispatcher (all-to-all) also the two all-to-alls as communication pieces.

    Tensors of the dispatcher's handle that carry gradients (gate weights, or dispatched
    weights on flex) cross piece boundaries as tuple entries and are put back into the
    handle, so each piece's backward stays inside its own piece.
    """
    if is_phased(moe.dispatcher):
        return _phased_moe_pieces(norm, moe, index)
    ctx: dict[str, Any] = {}

    def dispatch(state: Tensors) -> Tensors:
        h = state[0]
        x = norm(h)
        x_TH = x.reshape(-1, x.shape[-1])
        routing = moe.route(x_TH, x.shape[-2])
        x_NH, rows, handle = moe.dispatch(x_TH, routing)
        probs, handle = moe.probs_for_experts(handle)  # the routing weights go into the experts
        ctx["rows"], ctx["handle"] = rows, handle
        ctx["slots"] = slots = _grad_tensors(handle)
        probs_in = () if probs is None else (probs,)
        ctx["probs"] = len(probs_in)
        shared_in = (x_TH,) if moe.shared_experts is not None else ()
        return (h.view_as(h), x_NH, *probs_in, *slots, *shared_in)

    def experts(state: Tensors) -> Tensors:
        p, n = ctx["probs"], len(ctx["slots"])
        h, x_NH, probs = state[0], state[1], state[2:2 + p]
        slots, shared_in = state[2 + p:2 + p + n], state[2 + p + n:]
        y_NH = moe.compute_experts(x_NH, ctx["rows"], *probs)
        extra = (moe.shared(shared_in[0]),) if shared_in else ()
        return (h.view_as(h), y_NH, *(t.view_as(t) for t in slots), *extra)

    return [(f"dispatch{index}", dispatch), (f"experts{index}", experts),
            (f"combine{index}", _combine_piece(ctx, moe.combine))]


def _combine_piece(ctx: dict[str, Any], combine_rows: Callable) -> Callable[[Tensors], Tensors]:
    """The last MoE piece: put the gate-weight slots back into the handle, combine the rows
    (`combine_rows(rows, handle)`), add the shared-expert output and the residual."""
    def combine(state: Tensors) -> Tensors:
        n = len(ctx["slots"])
        h, y, slots, extra = state[0], state[1], state[2:2 + n], state[2 + n:]
        handle = _replace_tensors(ctx["handle"], dict(zip(map(id, ctx["slots"]), slots)))
        out = combine_rows(y, handle)
        if extra:
            out = out + extra[0]
        ctx.clear()
        return (h + out.view(h.shape),)

    return combine


def _phased_moe_pieces(norm: Callable, moe, index: int) -> list[Piece]:
    """dispatch | dispatch_a2a | experts | combine_a2a | combine, the all-to-alls as CommPieces
    on state entry 1 (rows), which the pipeline executor runs asynchronously.

    The state is `(h, rows, *row gate weights, *gate-weight slots, *shared-expert input or
    output)`: when the experts apply the routing weights, each sent row's weight (`probs_send`)
    travels beside it as entry 2 through the same all-to-all, and the combine sums unweighted
    rows; otherwise the source rank's gate weights are a slot and the combine weights the rows.
    The plan and handle (host splits, permutation indices) travel in the closures.
    """
    dispatcher = moe.dispatcher
    ctx: dict[str, Any] = {}
    with_probs = moe.experts.takes_probs and getattr(dispatcher, "sends_probs", False)
    a2a_entries = (1, 2) if with_probs else 1  # rows, and their gate weights

    def dispatch(state: Tensors) -> Tensors:  # norm, route, permute, count exchange
        h = state[0]
        x = norm(h)
        x_TH = x.reshape(-1, x.shape[-1])
        routing = moe.route(x_TH, x.shape[-2])
        with recompute.saved_outputs("layernorm" in moe.recompute_modules):  # as MoELayer.dispatch
            x_send, ctx["dispatch_a2a"], plan = dispatcher.dispatch_preprocess(x_TH, routing)
        probs_in = ()
        if with_probs:  # the weights travel with the rows; the combine sums unweighted rows
            probs_in = (plan.probs_send,)
            plan = dataclasses.replace(plan, topk_weights=None, probs_send=None)
        elif getattr(plan, "probs_send", None) is not None:
            plan = dataclasses.replace(plan, probs_send=None)
        ctx["plan"] = plan
        ctx["slots"] = slots = _grad_tensors(plan)
        shared_in = (x_TH,) if moe.shared_experts is not None else ()
        return (h.view_as(h), x_send, *probs_in, *slots, *shared_in)

    def experts(state: Tensors) -> Tensors:  # postprocess, experts, shared, combine-preprocess
        p, n = int(with_probs), len(ctx["slots"])
        h, x_recv, probs_recv = state[0], state[1], state[2:2 + p]
        slots, shared_in = state[2 + p:2 + p + n], state[2 + p + n:]
        x_NH, rows, ctx["handle"] = dispatcher.dispatch_postprocess(x_recv, ctx.pop("plan"), *probs_recv)
        probs_N = ctx["handle"].probs_N if with_probs else None
        y_NH = moe.compute_experts(x_NH, rows, probs_N)
        y_send, ctx["combine_a2a"] = dispatcher.combine_preprocess(y_NH, ctx["handle"])
        extra = (moe.shared(shared_in[0]),) if shared_in else ()
        return (h.view_as(h), y_send, *(t.view_as(t) for t in slots), *extra)

    return [(f"dispatch{index}", dispatch),
            (f"dispatch_a2a{index}", CommPiece(a2a_entries, lambda: ctx.pop("dispatch_a2a"))),
            (f"experts{index}", experts),
            (f"combine_a2a{index}", CommPiece(1, lambda: ctx.pop("combine_a2a"))),
            (f"combine{index}", _combine_piece(ctx, dispatcher.combine_postprocess))]


def _children(obj: Any):
    if isinstance(obj, (tuple, list)):
        return list(enumerate(obj))
    if isinstance(obj, dict):
        return list(obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return []


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad inside tuples, lists, dicts and dataclasses of `obj`."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    found: list[torch.Tensor] = []
    for _, child in _children(obj):
        for t in _grad_tensors(child):
            if all(t is not u for u in found):
                found.append(t)
    return found


def _replace_tensors(obj: Any, new: dict[int, torch.Tensor]) -> Any:
    """A copy of `obj` with tensors replaced by `new[id(tensor)]` (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)
    if isinstance(obj, tuple):
        return type(obj)(*(_replace_tensors(c, new) for c in obj)) if hasattr(obj, "_fields") \
            else tuple(_replace_tensors(c, new) for c in obj)
    if isinstance(obj, list):
        return [_replace_tensors(c, new) for c in obj]
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, new) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        clone = copy.copy(obj)
        for name, child in _children(obj):
            object.__setattr__(clone, name, _replace_tensors(child, new))
        return clone
    return obj
