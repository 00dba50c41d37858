"""Point-to-point transfers between pipeline stages, in an order that cannot deadlock.

Design notes: docs/pipeline.md (`moetron/pipeline/p2p.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetron.pipeline.schedules import PipelineSchedule, run_in_order

Spec = Sequence[tuple[torch.Size, torch.dtype]]


@dataclass(frozen=True)
class Message:
    """`kind` "act": forward activations into `stage`; "grad": gradients of `stage`'s outputs."""

    kind: str
    microbatch: int
    stage: int  # the stage that consumes the tensors
    src: int
    dst: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.kind, self.microbatch, self.stage)


@functools.lru_cache(maxsize=32)
def plan_messages(schedule: PipelineSchedule) -> tuple[Message, ...]:
    """Every cross-rank message of `schedule`, in the one order all ranks issue them in."""
    last = schedule.num_stages - 1
    order: list[Message] = []

    def visit(rank, action, deps) -> None:
        for part in action.parts():
            mb, s = part.microbatch, part.stage
            if part.kind == "F" and s < last:
                kind, stage = "act", s + 1
            elif part.kind == "B" and s > 0:
                kind, stage = "grad", s - 1
            else:
                continue
            dst = schedule.rank_of(stage, mb)
            if dst != rank:
                order.append(Message(kind, mb, stage, rank, dst))

    run_in_order(schedule, visit)
    return tuple(order)


@dataclass
class ProcessGroupInfo:
    """The pipeline group as this process sees it: handle (None = world), ranks, own index."""

    handle: dist.ProcessGroup | None
    ranks: tuple[int, ...]  # global rank of each group rank
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def of(cls, group) -> ProcessGroupInfo:
        """From a moetron Group, a ProcessGroup, or None (the world; one process when
        torch.distributed is not initialised)."""
        if group is None:
            if not dist.is_initialized():
                return cls(None, (0,), 0)
            return cls(None, tuple(range(dist.get_world_size())), dist.get_rank())
        if hasattr(group, "ranks") and hasattr(group, "handle"):  # moetron.parallel.state.Group
            return cls(group.handle, tuple(group.ranks), group.rank)
        if isinstance(group, dist.ProcessGroup):
            ranks = tuple(dist.get_process_group_ranks(group))
            return cls(group, ranks, dist.get_rank(group))
        raise TypeError(f"expected a moetron Group, a ProcessGroup or None, got {type(group).__name__}")


_warmed: set[int] = set()


def _warm_up(info: ProcessGroupInfo, device: torch.device) -> None:
    """NCCL: the first batched P2P on a group must involve every rank, so run one collective."""
    if info.size == 1 or id(info.handle) in _warmed:
        return
    if dist.get_backend(info.handle) == "nccl":
        dist.all_reduce(torch.zeros(1, device=device), group=info.handle)
    _warmed.add(id(info.handle))


def _batch(ops: list[dist.P2POp]) -> list[list]:
    """Issue `ops` as one batch; the works to wait for, per op."""
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):
        return [[w] for w in works]
    return [list(works)] * len(ops)  # a coalesced backend returns one work for the batch


class PipelineP2P:
    """One rank's side of a schedule's messages; see the module docstring for the order.

    `spec(message)` gives the shapes and dtypes a receive needs (the runtime asks the stage
    module that consumes it). Tensors given to `send` must not be modified afterwards.
    """

    def __init__(self, schedule: PipelineSchedule, group: ProcessGroupInfo,
                 spec: Callable[[Message], Spec], device: torch.device):
        self.group = group
        self.rank = group.rank
        self.ops = [m for m in plan_messages(schedule) if self.rank in (m.src, m.dst)]
        self.position = {m.key: i for i, m in enumerate(self.ops)}
        self.spec = spec
        self.device = device
        self.next = 0
        self.outbox: dict[tuple, Sequence[torch.Tensor]] = {}
        self.posted: dict[tuple, tuple[list[torch.Tensor], list]] = {}
        self.in_flight: list[tuple[list, Sequence[torch.Tensor]]] = []
        _warm_up(group, device)

    def _issue(self, upto: int, strict: bool) -> None:
        ops: list[dist.P2POp] = []
        entries: list[tuple[str, Message, Sequence[torch.Tensor]]] = []
        while self.next <= upto and self.next < len(self.ops):
            m = self.ops[self.next]
            if m.src == self.rank:
                if m.key not in self.outbox:
                    if strict:
                        raise RuntimeError(f"pipeline P2P on rank {self.rank}: {m} must be sent "
                                           "before a later message, but was not produced yet")
                    break
                tensors = self.outbox.pop(m.key)
                peer = self.group.ranks[m.dst]
                ops += [dist.P2POp(dist.isend, t, peer, self.group.handle) for t in tensors]
            else:
                tensors = [torch.empty(shape, dtype=dtype, device=self.device)
                           for shape, dtype in self.spec(m)]
                peer = self.group.ranks[m.src]
                ops += [dist.P2POp(dist.irecv, t, peer, self.group.handle) for t in tensors]
            entries.append(("send" if m.src == self.rank else "recv", m, tensors))
            self.next += 1
        if not ops:
            return
        works = iter(_batch(ops))
        for kind, m, tensors in entries:
            mine = [w for _ in tensors for w in next(works)]
            if kind == "send":
                self.in_flight.append((mine, tensors))
            else:
                self.posted[m.key] = (list(tensors), mine)

    def send(self, key: tuple, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the tensors of message `key` and issue everything up to it."""
        self.outbox[key] = [t.contiguous() for t in tensors]
        self._issue(self.position[key], strict=True)
        self.in_flight = [(w, t) for w, t in self.in_flight if not all(x.is_completed() for x in w)]

    def recv(self, key: tuple) -> list[torch.Tensor]:
        """The tensors of message `key`, waiting for them (posting the receive if needed)."""
        self._issue(self.position[key], strict=True)
        tensors, works = self.posted.pop(key)
        for w in works:
            w.wait()
        return tensors

    def prefetch(self, keys: Iterable[tuple]) -> None:
        """Post the receives of `keys` now, as far as the order allows without blocking."""
        wanted = [self.position[k] for k in keys if k in self.position]
        if wanted:
            self._issue(max(wanted), strict=False)

    def close(self) -> None:
        """Wait for every send; fail if a message was never sent or received."""
        for works, _ in self.in_flight:
            for w in works:
                w.wait()
        self.in_flight.clear()
        if self.next != len(self.ops) or self.posted or self.outbox:
            left = [str(m) for m in self.ops[self.next:]] + [str(k) for k in self.posted]
            raise RuntimeError(f"pipeline P2P on rank {self.rank} ended with messages left: {left[:4]}")


def sum_over_ranks(t: torch.Tensor, ranks: Sequence[int], group: ProcessGroupInfo) -> None:
    """In-place sum of `t` over the group ranks `ranks` (this rank among them) by P2P.

    The first rank adds the others' tensors in rank order and sends the sum back, so every
    holder ends with bit-identical values; no process group has to be created for the subset.
    """
    ranks = sorted(ranks)
    if len(ranks) < 2:
        return
    leader, me = ranks[0], group.rank
    if me == leader:
        parts = [torch.empty_like(t) for _ in ranks[1:]]
        works = _batch([dist.P2POp(dist.irecv, p, group.ranks[r], group.handle)
                        for p, r in zip(parts, ranks[1:])])
        for ws in works:
            for w in ws:
                w.wait()
        for p in parts:
            t.add_(p)
        works = _batch([dist.P2POp(dist.isend, t, group.ranks[r], group.handle) for r in ranks[1:]])
    else:
        works = _batch([dist.P2POp(dist.isend, t.clone(), group.ranks[leader], group.handle)])
        for ws in works:
            for w in ws:
                w.wait()
        works = _batch([dist.P2POp(dist.irecv, t, group.ranks[leader], group.handle)])
    for ws in works:
        for w in ws:
            w.wait()
