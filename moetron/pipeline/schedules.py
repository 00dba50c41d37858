"""Pipeline schedules as data: for each PP rank, the ordered actions it runs.

The runtime executor and the simulator both consume these lists, so a schedule is written
once. An action names the work (`F` forward, `B` backward, `W` weight gradient, `FB` forward
of one micro-batch overlapped with the backward of another), the micro-batch, the stage on the
micro-batch's path and the model chunk on this rank. Sends and receives are implied: a forward
of stage s needs the output of stage s-1 for the same micro-batch, a backward of stage s the
input gradient of stage s+1, wherever `PipelineSchedule.rank_of` places them.

Backwards are full (input and weight gradients) unless `split_backward` is set, in which case a
later `W` of the same (micro-batch, stage) computes the weight gradients (zero-bubble style).
The backward half of an `FB` is always full, as in DualPipe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SCHEDULES = ("1f1b", "interleaved", "zb1p", "dualpipe", "dualpipev")


class ScheduleError(ValueError):
    """A schedule that cannot run: unsupported sizes, or inconsistent action lists."""


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank; `stage` indexes the micro-batch's path, `chunk` the
    rank's model chunks (see `PipelineSchedule.stages_of_rank`)."""

    kind: str  # "F", "B", "W" or "FB"
    microbatch: int  # for FB: the forward half's
    stage: int
    chunk: int
    split_backward: bool = False  # B only: a later W does the weight gradients
    backward_microbatch: int | None = None  # FB only: the backward half
    backward_stage: int | None = None
    backward_chunk: int | None = None

    def parts(self) -> tuple[Action, ...]:
        """(forward, backward) for FB; (self,) otherwise."""
        if self.kind != "FB":
            return (self,)
        return (
            Action("F", self.microbatch, self.stage, self.chunk),
            Action("B", self.backward_microbatch, self.backward_stage, self.backward_chunk),
        )

    def __str__(self) -> str:
        if self.kind == "FB":
            f, b = self.parts()
            return f"FB({f},{b})"
        suffix = "i" if self.split_backward else ""
        return f"{self.kind}{suffix}{self.microbatch}@s{self.stage}"


def _fb(forward: Action, backward: Action) -> Action:
    return Action(
        "FB", forward.microbatch, forward.stage, forward.chunk,
        backward_microbatch=backward.microbatch,
        backward_stage=backward.stage,
        backward_chunk=backward.chunk,
    )


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-rank action lists plus where each stage lives (`rank_of`, `chunk_of`)."""

    name: str
    pp: int
    microbatches: int
    num_stages: int  # stages on one micro-batch's path
    chunks_per_rank: int
    rank_actions: tuple[tuple[Action, ...], ...]

    def rank_of(self, stage: int, microbatch: int) -> int:
        if self.name == "dualpipev":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        if self.name == "dualpipe" and self.direction(microbatch) == 1:
            return self.pp - 1 - stage
        return stage % self.pp

    def chunk_of(self, stage: int, microbatch: int) -> int:
        if self.name == "dualpipe":
            return self.direction(microbatch)
        return stage // self.pp

    def direction(self, microbatch: int) -> int:
        """DualPipe only: micro-batches of the first half enter at rank 0, the rest at the last."""
        return int(self.name == "dualpipe" and microbatch >= self.microbatches // 2)

    def stages_of_rank(self, rank: int) -> list[int]:
        """The model stage each chunk of `rank` holds, indexed by chunk."""
        if self.name == "dualpipe":
            return [rank, self.pp - 1 - rank]
        if self.name == "dualpipev":
            return [rank, 2 * self.pp - 1 - rank]
        return [c * self.pp + rank for c in range(self.chunks_per_rank)]

    @property
    def splits_backward(self) -> bool:
        return any(a.kind == "W" for actions in self.rank_actions for a in actions)

    def dependencies(self, part: Action) -> list[tuple[str, int, int]]:
        """Keys (kind, microbatch, stage) that must finish before `part` (an F, B or W) starts."""
        mb, s = part.microbatch, part.stage
        if part.kind == "F":
            return [("F", mb, s - 1)] if s > 0 else []
        if part.kind == "B":
            deps = [("F", mb, s)]
            return deps + ([("B", mb, s + 1)] if s < self.num_stages - 1 else [])
        if part.kind == "W":
            return [("B", mb, s)]
        raise ScheduleError(f"dependencies are per part; split {part} with parts() first")


# ---------------------------------------------------------------------------------- builders


def _check_counts(name: str, pp: int, microbatches: int) -> None:
    if pp < 1 or microbatches < 1:
        raise ScheduleError(f"{name}: pp={pp} and microbatches={microbatches} must be >= 1")


def _one_f_one_b(pp: int, m: int, zero_bubble: bool) -> list[list[Action]]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Zero bubble (ZB-H1): the backward is split and rank r delays its weight-gradient passes by
    r micro-batches, so B passes travel upstream sooner and the delayed W passes fill the
    cool-down bubbles; in-flight activations stay those of 1F1B.
    """
    ranks = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        actions = [Action("F", i, r, 0) for i in range(warmup)]
        next_w = 0

        def backward(j: int) -> None:
            nonlocal next_w
            actions.append(Action("B", j, r, 0, split_backward=zero_bubble))
            if zero_bubble and j - next_w >= r:
                actions.append(Action("W", next_w, r, 0))
                next_w += 1

        for j in range(m - warmup):
            actions.append(Action("F", warmup + j, r, 0))
            backward(j)
        for j in range(m - warmup, m):
            backward(j)
        actions.extend(Action("W", j, r, 0) for j in range(next_w, m) if zero_bubble)
        ranks.append(actions)
    return ranks


def _interleaved(pp: int, m: int, vpp: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: micro-batches go through chunks in groups of pp.

    The order of (micro-batch, chunk) work is: group g's micro-batches on chunk 0, then on
    chunk 1, ...; the last group absorbs the remainder when pp does not divide m (and the
    warm-up grows by that remainder times vpp-1). Backwards follow the same order with chunks
    reversed.
    """
    order, group = [], 0
    for start in range(0, m, pp):
        end = m if start + 2 * pp > m else start + pp
        order += [(mb, c) for c in range(vpp) for mb in range(start, end)]
        group = max(group, end - start)
        if end == m:
            break
    total = m * vpp
    ranks = []
    for r in range(pp):
        if m == pp:
            warmup = total
        else:
            # The last chunk's forward of a group's first micro-batch precedes its backward.
            warmup = min((pp - 1 - r) * 2 + (vpp - 1) * group, total)

        def forward(k: int) -> Action:
            mb, c = order[k]
            return Action("F", mb, c * pp + r, c)

        def backward(k: int) -> Action:
            mb, c = order[k]
            c = vpp - 1 - c
            return Action("B", mb, c * pp + r, c)

        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        ranks.append(actions)
    return ranks


class _RankProgram:
    """Builds one DualPipe(V) rank's list from the reference algorithm's step vocabulary.

    `f(p)`/`b(p)` take the next micro-batch of local phase p (0: this rank's early stage,
    1: its late stage); split backwards queue their weight pass, which `w()` pops in FIFO order.
    """

    def __init__(self, stage_mb) -> None:
        self.stage_mb = stage_mb  # (phase, count) -> (stage, chunk, microbatch)
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.pending_w: deque[Action] = deque()
        self.actions: list[Action] = []

    def _take(self, counter: list[int], phase: int) -> tuple[int, int, int]:
        out = self.stage_mb(phase, counter[phase])
        counter[phase] += 1
        return out

    def forward(self, phase: int) -> Action:
        stage, chunk, mb = self._take(self.next_f, phase)
        return Action("F", mb, stage, chunk)

    def backward(self, phase: int, split: bool = False) -> Action:
        stage, chunk, mb = self._take(self.next_b, phase)
        action = Action("B", mb, stage, chunk, split_backward=split)
        if split:
            self.pending_w.append(Action("W", mb, stage, chunk))
        return action

    def f(self, phase: int) -> None:
        self.actions.append(self.forward(phase))

    def b(self, phase: int, split: bool = False) -> None:
        self.actions.append(self.backward(phase, split))

    def w(self) -> None:
        self.actions.append(self.pending_w.popleft())

    def fb(self, forward_phase: int, backward_phase: int) -> None:
        self.actions.append(_fb(self.forward(forward_phase), self.backward(backward_phase)))


def _dualpipe_rank(
    prog: _RankProgram, half_ranks: int, half_rank: int, chunks: int
) -> list[Action]:
    """DualPipe's steps for a rank `half_rank` positions from the nearer pipeline end.

    `half_ranks` is the number of such positions (devices for DualPipeV, PP/2 for DualPipe)
    and `chunks` the micro-batches per phase.
    """
    for _ in range((half_ranks - half_rank - 1) * 2):  # 1: warm-up forwards of phase 0
        prog.f(0)
    for _ in range(half_rank + 1):  # 2: forward pairs
        prog.f(0)
        prog.f(1)
    for _ in range(half_ranks - half_rank - 1):  # 3: (backward, weight, forward), zero bubble
        prog.b(1, split=True)
        prog.w()
        prog.f(1)
    for i in range(chunks - 2 * half_ranks + half_rank + 1):  # 4: main loop of F&B pairs
        if i == 0 and half_rank == half_ranks - 1:
            prog.f(0)  # the turn of the V: this forward feeds the next one on this rank
            prog.b(1)
        else:
            prog.fb(0, 1)
        prog.fb(1, 0)
    for _ in range(half_ranks - half_rank - 1):  # 5: backward, then F&B
        prog.b(1)
        prog.fb(1, 0)
    split = False
    steps = half_rank + 1
    for i in range(steps):  # 6: backward pairs, the second half split
        split = split or (i == steps // 2 and half_rank % 2 == 1)
        prog.b(1, split)
        split = split or (i == steps // 2 and half_rank % 2 == 0)
        prog.b(0, split)
    for _ in range(half_ranks - half_rank - 1):  # 7: weight, then split backward
        prog.w()
        prog.b(0, split=True)
    while prog.pending_w:  # 8: drain weights
        prog.w()
    return prog.actions


def _dualpipev(devices: int, m: int) -> list[list[Action]]:
    ranks = []
    for r in range(devices):
        stages = (r, 2 * devices - 1 - r)
        prog = _RankProgram(lambda phase, i, stages=stages: (stages[phase], phase, i))
        ranks.append(_dualpipe_rank(prog, devices, r, m))
    return ranks


def _dualpipe(pp: int, m: int) -> list[list[Action]]:
    half = m // 2
    ranks = []
    for r in range(pp):
        second_half = r >= pp // 2

        def stage_mb(phase: int, i: int, r: int = r, second_half: bool = second_half):
            direction = phase ^ second_half
            stage = r if direction == 0 else pp - 1 - r
            return stage, direction, direction * half + i

        ranks.append(_dualpipe_rank(_RankProgram(stage_mb), pp // 2, min(r, pp - 1 - r), half))
    return ranks


def build_schedule(
    name: str, *, pp: int, microbatches: int, vpp: int | None = None
) -> PipelineSchedule:
    """The action lists of schedule `name` for `pp` ranks and `microbatches` micro-batches.

    `vpp` is the number of virtual stages per rank of the interleaved schedule (default 2);
    DualPipeV always has two chunks per rank and the other schedules one (or two copies of one
    stage for DualPipe's two directions).
    """
    m = microbatches
    _check_counts(name, pp, m)
    if name == "interleaved":
        v = 2 if vpp is None else vpp
        if v < 1:
            raise ScheduleError(f"interleaved: vpp={v} must be >= 1")
        if v > 1 and m < pp:
            raise ScheduleError(
                f"interleaved: microbatches={m} must be >= pp={pp} (micro-batches go through "
                "the virtual stages in groups of pp)"
            )
        actions, stages, chunks = _interleaved(pp, m, v), pp * v, v
    else:
        allowed_vpp = 2 if name == "dualpipev" else 1
        if vpp not in (None, 1, allowed_vpp):
            raise ScheduleError(
                f"{name}: vpp={vpp} is not supported; only the interleaved schedule takes vpp"
            )
        if name in ("1f1b", "zb1p"):
            actions, stages, chunks = _one_f_one_b(pp, m, name == "zb1p"), pp, 1
        elif name == "dualpipe":
            if pp % 2 or m % 2 or m < 2 * pp:
                raise ScheduleError(
                    f"dualpipe: needs an even pp and an even number of micro-batches >= 2*pp "
                    f"(half enter from each end); got pp={pp}, microbatches={m}"
                )
            actions, stages, chunks = _dualpipe(pp, m), pp, 2
        elif name == "dualpipev":
            if m < 2 * pp:  # odd counts too, as DeepSeek's DualPipeV (num_chunks >= 2 * num_ranks)
                raise ScheduleError(
                    f"dualpipev: needs microbatches >= 2*pp (pp = devices, each holding 2 of the "
                    f"2*pp stages; odd counts are fine); got pp={pp}, microbatches={m}"
                )
            actions, stages, chunks = _dualpipev(pp, m), 2 * pp, 2
        else:
            raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    schedule = PipelineSchedule(name, pp, m, stages, chunks, tuple(tuple(a) for a in actions))
    return schedule


# ---------------------------------------------------------------------------------- validation


def validate_schedule(schedule: PipelineSchedule) -> None:
    """Raise ScheduleError unless the lists are complete, well placed and can run to the end.

    Checks: every (micro-batch, stage) has exactly one F and one B, and one W exactly when its
    B is split; each action runs on the rank and chunk that hold its stage; and executing the
    lists in order, each action waiting for its inputs, never deadlocks.
    """
    s = schedule
    seen: dict[tuple[str, int, int], int] = {}
    split: dict[tuple[int, int], bool] = {}
    for rank, actions in enumerate(s.rank_actions):
        for action in actions:
            for part in action.parts():
                key = (part.kind, part.microbatch, part.stage)
                if not (0 <= part.microbatch < s.microbatches and 0 <= part.stage < s.num_stages):
                    raise ScheduleError(f"{s.name}: rank {rank} runs {part}, outside the pipeline")
                if key in seen:
                    raise ScheduleError(
                        f"{s.name}: {part} appears twice (ranks {seen[key]} and {rank})"
                    )
                seen[key] = rank
                mb, stage = part.microbatch, part.stage
                where = (s.rank_of(stage, mb), s.chunk_of(stage, mb))
                if where != (rank, part.chunk):
                    raise ScheduleError(
                        f"{s.name}: {part} runs on rank {rank} chunk {part.chunk}, but its stage "
                        f"lives on rank {where[0]} chunk {where[1]}"
                    )
                if part.kind == "B":
                    split[(part.microbatch, part.stage)] = part.split_backward
    for mb in range(s.microbatches):
        for stage in range(s.num_stages):
            for kind in ("F", "B"):
                if (kind, mb, stage) not in seen:
                    raise ScheduleError(
                        f"{s.name}: no {kind} for micro-batch {mb} at stage {stage}"
                    )
            if split[(mb, stage)] != (("W", mb, stage) in seen):
                raise ScheduleError(
                    f"{s.name}: micro-batch {mb} stage {stage} has a "
                    f"{'split' if split[(mb, stage)] else 'full'} backward and "
                    f"{'a' if ('W', mb, stage) in seen else 'no'} W"
                )
    run_in_order(s, lambda rank, action, ready: None)


def run_in_order(schedule: PipelineSchedule, visit) -> None:
    """Walk all ranks' lists in an order that respects dependencies.

    `visit(rank, action, deps)` is called once per action, after everything it depends on was
    visited; `deps` lists (rank, key) of those dependencies. Raises ScheduleError on deadlock.
    """
    done: set[tuple[str, int, int]] = set()
    heads = [0] * schedule.pp
    remaining = sum(len(a) for a in schedule.rank_actions)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule.rank_actions):
            while heads[rank] < len(actions):
                action = actions[heads[rank]]
                parts = action.parts()
                deps = [d for p in parts for d in schedule.dependencies(p)]
                if not all(d in done for d in deps):
                    break
                visit(rank, action, [(schedule.rank_of(d[2], d[1]), d) for d in deps])
                done.update((p.kind, p.microbatch, p.stage) for p in parts)
                heads[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {acts[heads[r]]}"
                for r, acts in enumerate(schedule.rank_actions)
                if heads[r] < len(acts)
            )
            raise ScheduleError(f"{schedule.name}: the action lists deadlock: {stuck}")
