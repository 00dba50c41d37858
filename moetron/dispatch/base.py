"""The dispatcher protocol, the single-process dispatcher, and what all dispatchers share.

Design notes: docs/dispatch.md (`moetron/dispatch/base.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moetron.dispatch.permute import PermuteState, permute, unpermute
from moetron.dispatch.routing import Routing
from moetron.parallel import comm
from moetron.parallel.state import Group


class TokenDispatcher(Protocol):
    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return `(expert_input [N,H], rows_per_local_expert [E_local], handle)`."""

    def combine(self, y_NH: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return the gate-weighted sum of expert outputs per source token `[T,H]`."""


@dataclass(frozen=True)
class RowExchange:
    """The communication step of a phased dispatcher: an uneven all-to-all of rows over `group`.

    Rank r sends `input_splits[s]` rows to rank s and receives `output_splits[s]` from it
    (host lists; None: equal blocks). Calling it is the synchronous autograd all-to-all;
    `start` issues it asynchronously outside autograd and `reversed` is its adjoint, which a
    pipeline executor uses for the gradient.
    """

    group: Any
    output_splits: Sequence[int] | None
    input_splits: Sequence[int] | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_to_all(x, self.group, self.output_splits, self.input_splits)

    def start(self, x: torch.Tensor) -> comm.PendingAllToAll:
        return comm.start_all_to_all(x, self.group, self.output_splits, self.input_splits)

    def reversed(self) -> RowExchange:
        return RowExchange(self.group, self.input_splits, self.output_splits)


class PhasedDispatcher(TokenDispatcher, Protocol):
    """A dispatcher whose only communication of tokens is one all-to-all each way.

    `dispatch(x, r)` equals `dispatch_postprocess(exchange(x_send), plan)` with
    `x_send, exchange, plan = dispatch_preprocess(x, r)`; `combine(y, handle)` equals
    `combine_postprocess(exchange(y_send), handle)` with
    `y_send, exchange = combine_preprocess(y, handle)`.
    """

    def dispatch_preprocess(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, RowExchange, Any]:
        ...

    def dispatch_postprocess(self, x_NH: torch.Tensor, plan: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        ...

    def combine_preprocess(self, y_NH: torch.Tensor, handle: Any) -> tuple[torch.Tensor, RowExchange]:
        ...

    def combine_postprocess(self, y_NH: torch.Tensor, handle: Any) -> torch.Tensor:
        ...


def is_phased(dispatcher: Any) -> bool:
    """Whether `dispatcher` exposes the PhasedDispatcher phases."""
    return all(callable(getattr(dispatcher, name, None)) for name in
               ("dispatch_preprocess", "dispatch_postprocess", "combine_preprocess", "combine_postprocess"))


def rank_and_size(group: Group | dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's index in `group` and the group's size; `None` is a group of one."""
    if group is None:
        return 0, 1
    if isinstance(group, Group):
        return group.rank, group.size
    if isinstance(group, dist.ProcessGroup):
        return dist.get_rank(group), dist.get_world_size(group)
    raise TypeError(f"expected a moetron Group, a ProcessGroup or None, got {type(group).__name__}")


def local_expert_range(num_experts: int, ep_group: Group | dist.ProcessGroup | None) -> range:
    """Global ids of the experts this EP rank holds: a contiguous block of `num_experts / ep`."""
    ep_rank, ep = rank_and_size(ep_group)
    if num_experts % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={num_experts}: choose an expert-parallel "
                         f"size that divides the number of experts")
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class LocalDispatcher:
    """All experts live in this process: dispatch is a permute, combine an unpermute."""

    def __init__(self, num_experts: int, pad_multiple: int = 1, pad_to_capacity: bool = False):
        self.num_experts = num_experts
        self.pad_multiple = pad_multiple
        self.pad_to_capacity = pad_to_capacity

    def dispatch(self, x_TH: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, Any]:
        x_NH, state = permute(x_TH, routing.topk_idx, self.num_experts,
                              pad_multiple=self.pad_multiple,
                              pad_to=routing.capacity if self.pad_to_capacity else None,
                              dropless=routing.dropless, counts=routing.tokens_per_expert)
        return x_NH, state.rows_per_expert, (state, routing.topk_weights)

    def combine(self, y_NH: torch.Tensor, handle: tuple[PermuteState, torch.Tensor]) -> torch.Tensor:
        state, weights = handle
        return unpermute(y_NH, state, weights)


# ---- events: completion of an issued communication ----------------------------------------


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
