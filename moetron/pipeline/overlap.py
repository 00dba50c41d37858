"""Forward-backward overlap: EP all-to-alls as asynchronous pipeline pieces, and F&B pairs for
1F1B (`pair_forward_backward`).

With a phased dispatcher (moetron/dispatch/base.py `PhasedDispatcher`, e.g. all-to-all), a MoE
layer runs as the pieces (stage.py `_moe_pieces`)

    dispatch (norm, route, permute, count exchange) | dispatch_a2a | experts (ETP gather,
    regroup, experts, shared experts, un-regroup, ETP reduce-scatter) | combine_a2a | combine
    (unpermute with the gate weights, residual)

The two all-to-alls are `CommPiece`s: no parameters, linear, acting on one entry of the state
tuple (the other entries pass through). The executor (runtime.py) runs them outside autograd:

- forward: `CommPiece.start` issues the all-to-all (`async_op=True`) and returns a `Transfer`;
  the executor yields, so the other micro-batch of an FB pair runs its pieces while the rows
  travel, and calls `Transfer.wait` only when the next piece needs the rows. The received rows
  are a fresh leaf (they carry no graph).
- backward: `Transfer.start_backward` issues the reverse all-to-all of that entry's gradient
  (no autograd, no weight gradient, so nothing for a split backward's W to do); the executor
  yields again and hands the waited gradient to the previous piece's backward.

Turns: a chain with communication pieces yields only after issuing one, so while its rows
travel the other chain runs until it issues its own all-to-all (or ends): each all-to-all hides
behind a stretch of the other micro-batch's compute (Megatron's combined-1F1B pattern).

Called directly (`fn(state)`, by code that loops over `stage.pieces(...)`), a CommPiece is the
ordinary synchronous autograd all-to-all, so the pieces compute the same with or without the
executor.

Ordering: a process group's collectives must start in the same order on all of its ranks. The
EP ranks of a pipeline stage run the same action list and the same pieces, so they issue the
same sequence; the transfers of the two micro-batches of an FB pair may be in flight together.
Still synchronous: the count exchange of dispatch-preprocess (the split sizes must reach the
host before rows can move: one device-to-host sync per dispatch, skipped with pad_to_capacity),
the ETP all-gather / reduce-scatter inside the experts piece, and other dispatchers' pieces.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from moetron.dispatch.base import RowExchange
from moetron.parallel.comm import PendingAllToAll
from moetron.pipeline.schedules import Action, PipelineSchedule, validate_schedule

Tensors = tuple[torch.Tensor, ...]


class CommPiece:
    """A piece that all-to-alls state entry `entry`; `exchange()` gives the splits, known only
    once the previous piece ran (the count exchange)."""

    def __init__(self, entry: int, exchange: Callable[[], RowExchange]):
        self.entry = entry
        self.exchange = exchange

    def __call__(self, state: Tensors) -> Tensors:
        """Synchronous, through autograd (comm.all_to_all)."""
        e = self.entry
        return (*(t.view_as(t) for t in state[:e]), self.exchange()(state[e]),
                *(t.view_as(t) for t in state[e + 1:]))

    def start(self, state: Tensors) -> Transfer:
        """Issue the all-to-all without waiting."""
        return Transfer(self.entry, self.exchange(), state)


class Transfer:
    """One run of a CommPiece: the forward all-to-all in flight, then its backward."""

    def __init__(self, entry: int, exchange: RowExchange, state: Tensors):
        self.entry, self.exchange = entry, exchange
        self.requires_grad = state[entry].requires_grad
        self._state: Tensors | None = state
        self._pending: PendingAllToAll | None = exchange.start(state[entry])
        self._received: tuple | None = None  # (shape, dtype, device) of the received rows

    def wait(self) -> Tensors:
        """The piece's output: the received rows (a fresh leaf) with the other entries."""
        rows = self._pending.wait().requires_grad_(self.requires_grad)
        self._received = (rows.shape, rows.dtype, rows.device)
        e, state = self.entry, self._state
        self._pending = self._state = None
        return (*state[:e], rows, *state[e + 1:])

    def start_backward(self, grads: Sequence[torch.Tensor | None]) -> PendingGradients:
        """Issue the reverse all-to-all of the entry's gradient (zeros where none arrived: the
        other ranks wait for our rows)."""
        e, grads = self.entry, tuple(grads)
        if not self.requires_grad:
            return PendingGradients(grads[:e] + (None,) + grads[e + 1:])
        g = grads[e]
        if g is None:
            shape, dtype, device = self._received
            g = torch.zeros(shape, dtype=dtype, device=device)
        return PendingGradients(grads, e, self.exchange.reversed().start(g))


class PendingGradients:
    """The input gradients of a CommPiece, one of them still travelling."""

    def __init__(self, grads: Tensors, entry: int | None = None, pending: PendingAllToAll | None = None):
        self._grads, self._entry, self._pending = grads, entry, pending

    def wait(self) -> Tensors:
        if self._pending is None:
            return self._grads
        e, g = self._entry, self._grads
        return g[:e] + (self._pending.wait(),) + g[e + 1:]


# ------------------------------------------------------------------ F&B pairs for 1F1B


@functools.lru_cache(maxsize=32)
def pair_forward_backward(schedule: PipelineSchedule) -> PipelineSchedule:
    """`schedule` with each full backward that is directly followed by a forward on the same
    rank merged with it into an FB action (Megatron's combined 1F1B), so 1F1B and interleaved
    1F1B overlap like DualPipe's F&B pairs; no virtual stages needed.

    In 1F1B's steady state `F(i+w) B(i) F(i+w+1) B(i+1) ...` becomes `F(i+w) FB(F(i+w+1), B(i))
    ...`: each backward runs beside the next forward, which starts at most one action earlier
    than before (one more micro-batch's activations live for a while). Split backwards (ZB1P)
    and schedules that already have FB actions (DualPipe, DualPipeV) are left as they are.
    """
    if any(a.kind == "FB" or (a.kind == "B" and a.split_backward)
           for actions in schedule.rank_actions for a in actions):
        return schedule
    ranks = []
    for actions in schedule.rank_actions:
        merged, i = [], 0
        while i < len(actions):
            a = actions[i]
            if a.kind == "B" and i + 1 < len(actions) and actions[i + 1].kind == "F":
                f = actions[i + 1]
                merged.append(Action("FB", f.microbatch, f.stage, f.chunk, backward_microbatch=a.microbatch,
                                     backward_stage=a.stage, backward_chunk=a.chunk))
                i += 2
            else:
                merged.append(a)
                i += 1
        ranks.append(tuple(merged))
    paired = dataclasses.replace(schedule, rank_actions=tuple(ranks))
    validate_schedule(paired)
    return paired
