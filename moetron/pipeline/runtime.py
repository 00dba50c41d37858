"""The pipeline executor: runs a schedule's per-rank action lists with real stage modules.

    schedule = build_schedule("dualpipev", pp=2, microbatches=8)
    layout = parse_layout("Et|tt|tt|mL", num_layers=5, mtp_layers=1, pp=2, vpp=2)
    chunks = build_stage_modules(model, layout, schedule, rank)
    result = run_schedule(schedule, chunks, microbatches, group=ps.pp)
    result.loss            # mean over micro-batches, on every rank

Each rank walks its actions: F (forward, send), B (backward; input gradients only under a split
backward, split_backward.py), W (weight gradients), FB (one micro-batch's forward beside another's
backward, as chains of pieces taking turns). Loss convention, F&B overlap and shared-parameter
reduction: docs/pipeline.md.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from moetron.moe import balancing
from moetron.moe.layer import MoELayer
from moetron.moe.pieces import CommPiece
from moetron.pipeline.overlap import pair_forward_backward
from moetron.pipeline.split_backward import WeightGradients, backward_input
from moetron.pipeline.p2p import Message, PipelineP2P, ProcessGroupInfo, sum_over_ranks
from moetron.pipeline.schedules import Action, PipelineSchedule, ScheduleError
from moetron.pipeline.stage import (
    MicroBatch,
    PipelineStageModule,
    check_layout_fits,
    parameter_key,
    shared_parameter_ranks,
)

FB_OVERLAP = ("off", "layer", "moe")
Tensors = tuple[torch.Tensor, ...]


@dataclass
class PipelineResult:
    """Per-micro-batch losses (NaN where this rank saw none and losses were not gathered)."""

    losses: torch.Tensor  # [M] total loss (LM + weighted MTP) of each micro-batch
    lm_losses: torch.Tensor  # [M]
    mtp_losses: torch.Tensor | None  # [M], None without MTP
    timeline: list[str] = field(default_factory=list)  # the actions this rank ran, in order

    @property
    def loss(self) -> torch.Tensor:
        return self.losses.mean()

    @property
    def lm_loss(self) -> torch.Tensor:
        return self.lm_losses.mean()

    @property
    def mtp_loss(self) -> torch.Tensor | None:
        return None if self.mtp_losses is None else self.mtp_losses.mean()


# ------------------------------------------------------------------ executor


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad or t.is_floating_point())


class _Executor:
    def __init__(self, schedule, modules, batches, info, loss_scale, overlap_p2p_comm, fb_overlap):
        self.schedule = schedule
        self.modules = modules
        self.batches = batches
        self.rank = info.rank
        self.loss_scale = loss_scale
        self.overlap = overlap_p2p_comm
        self.piecewise = fb_overlap != "off" and any(
            a.kind == "FB" for a in schedule.rank_actions[info.rank])
        self.split = fb_overlap
        self.last = schedule.num_stages - 1
        # (inputs, outputs, None) per piece, or (None, None, Transfer) per communication piece
        self.saved: dict[tuple[int, int], list[tuple]] = {}
        self.weight_work: dict[tuple[int, int], list[WeightGradients]] = {}
        self.local: dict[tuple, Tensors] = {}
        self.losses: dict[int, Tensors] = {}
        self.p2p = PipelineP2P(schedule, info, self._spec, modules[0].device) if info.size > 1 else None

    # --- where tensors come from and go to --------------------------------------------
    def _module(self, stage: int, mb: int) -> PipelineStageModule:
        return self.modules[self.schedule.chunk_of(stage, mb)]

    def _spec(self, m: Message):
        module, batch = self._module(m.stage, m.microbatch), self.batches[m.microbatch]
        return module.input_spec(batch) if m.kind == "act" else module.output_spec(batch)

    def _needs(self, action: Action) -> list[tuple[tuple, int]]:
        keys = []
        for part in action.parts():
            mb, s = part.microbatch, part.stage
            if part.kind == "F" and s > 0:
                keys.append((("act", mb, s), self.schedule.rank_of(s - 1, mb)))
            elif part.kind == "B" and s < self.last:
                keys.append((("grad", mb, s), self.schedule.rank_of(s + 1, mb)))
        return keys

    def _take(self, key: tuple, src: int) -> Tensors:
        if src == self.rank:
            return self.local.pop(key)
        return tuple(self.p2p.recv(key))

    def _give(self, key: tuple, tensors: Tensors) -> None:
        dst = self.schedule.rank_of(key[2], key[1])
        if dst == self.rank:
            self.local[key] = tensors
        else:
            self.p2p.send(key, tensors)

    # --- one action ---------------------------------------------------------------------
    def run(self, action: Action, following: Action | None) -> None:
        got = {key: self._take(key, src) for key, src in self._needs(action)}
        if self.overlap and following is not None and self.p2p is not None:
            self.p2p.prefetch(k for k, src in self._needs(following) if src != self.rank)
        if action.kind == "W":
            for work in self.weight_work.pop((action.microbatch, action.stage)):
                work.run()
            return
        parts = action.parts()
        steps, sends = [], [None] * len(parts)
        for i, part in enumerate(parts):
            mb, s = part.microbatch, part.stage
            if part.kind == "F":
                inputs = tuple(_leaf(t) for t in got.get(("act", mb, s), ()))
                steps.append(self._forward(part, inputs, sends, i))
            else:
                grads = got.get(("grad", mb, s))
                steps.append(self._backward(part, grads, part.split_backward, sends, i))
        if len(steps) == 2 and self.piecewise:
            _alternate(steps)
        else:
            for step in steps:
                collections.deque(step, maxlen=0)
        for item in sends:  # in part order, the order the P2P plan expects
            if item is not None:
                self._give(*item)

    def _forward(self, part: Action, inputs: Tensors, sends: list, slot: int) -> Iterator[None]:
        mb, s = part.microbatch, part.stage
        module, batch = self.modules[part.chunk], self.batches[mb]
        if module.index != s:
            raise ScheduleError(f"rank {self.rank} chunk {part.chunk} holds stage {module.index}, "
                                f"the schedule runs {part} there")
        if self.piecewise:
            pieces = module.pieces(batch, split=self.split)
        else:
            pieces = [("stage", lambda state: module(state, batch))]
        # A chain with communication pieces yields only after issuing one (the other chain runs
        # while the rows travel); a chain without yields after every piece (plain alternation).
        overlapped = any(isinstance(fn, CommPiece) for _, fn in pieces)
        record, state = [], inputs
        for i, (_, fn) in enumerate(pieces):
            if isinstance(fn, CommPiece):
                transfer = fn.start(state)
                yield
                state = transfer.wait()
                record.append((None, None, transfer))
                continue
            if i:
                state = tuple(_leaf(t) if t.requires_grad else t for t in state)
            with torch.enable_grad():
                out = tuple(fn(state))
            record.append((state, out, None))
            state = out
            if not overlapped:
                yield
        self.saved[(mb, s)] = record
        if s == self.last:
            self.losses[mb] = tuple(t.detach() for t in state)
        else:
            sends[slot] = (("act", mb, s + 1), tuple(t.detach() for t in state))

    def _backward(self, part: Action, grads: Tensors | None, split: bool, sends: list,
                  slot: int) -> Iterator[None]:
        mb, s = part.microbatch, part.stage
        record = self.saved.pop((mb, s))
        if s == self.last:
            loss = record[-1][1][0]
            grads = (torch.full_like(loss, self.loss_scale),) + (None,) * (len(record[-1][1]) - 1)
        overlapped = any(transfer is not None for _, _, transfer in record)
        weight_work = []
        for inputs, outputs, transfer in reversed(record):
            if transfer is not None:  # the reverse all-to-all of the gradient, outside autograd
                pending = transfer.start_backward(grads)
                yield
                grads = pending.wait()
                continue
            pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
            if not pairs:
                grads = (None,) * len(inputs)
            elif split:
                grads, work = backward_input([o for o, _ in pairs], [g for _, g in pairs], inputs)
                weight_work.append(work)
            else:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                grads = tuple(x.grad if x.requires_grad else None for x in inputs)
            if not overlapped:
                yield
        if split:
            self.weight_work[(mb, s)] = weight_work
        if s > 0:
            first_inputs = record[0][0]
            sends[slot] = (("grad", mb, s - 1), tuple(
                torch.zeros_like(x) if g is None else g for x, g in zip(first_inputs, grads)))


def _alternate(steps: list[Iterator[None]]) -> None:
    """Run generators taking turns: a chain runs until it yields (after each piece, or, with
    communication pieces, after issuing an all-to-all), then the other one."""
    live = list(steps)
    while live:
        for step in list(live):
            if next(step, StopIteration) is StopIteration:
                live.remove(step)


# ------------------------------------------------------------------ entry points


def run_schedule(schedule: PipelineSchedule, stage_modules: Sequence[PipelineStageModule],
                 microbatches: Sequence, *, group=None, overlap_p2p_comm: bool = True,
                 fb_overlap: str = "off", loss_scale: float | None = None,
                 aux_loss_scale: float | None = None, reduce_shared_grads: bool = True,
                 gather_losses: bool = True, data_parallel=None) -> PipelineResult:
    """Run one training step's forward and backward passes of `schedule` on this rank.

    `stage_modules` are this rank's stages by chunk (`build_stage_modules`); `microbatches`
    all of the step's micro-batches (every rank gets the same list; each stage reads what it
    needs). `group` is the pipeline group (a moetron Group, a ProcessGroup, or None for the
    world / one process). Gradients accumulate into the parameters' `.grad`, scaled by
    `loss_scale` (default 1/microbatches); balancing aux losses by `aux_loss_scale` (default
    `loss_scale`; the trainer passes the step's scale, which also accounts for context
    parallel). With `gather_losses` every rank returns every micro-batch's loss (one small
    all-reduce over the group). `fb_overlap` ("off", "layer",
    "moe") is how the forward and backward of an FB pair share the time (module docstring);
    when on, 1F1B and interleaved schedules are paired first (`pair_forward_backward`).
    `data_parallel` (a DataParallel over these stages): every action runs under its no_sync(),
    except each chunk's last gradient-producing action (B, or W under a split backward), which
    runs under `final_gradients(that chunk's parameters)`, so the chunk's buckets launch while
    that backward runs; parameters held by several PP ranks wait for finish_grad_sync.
    """
    info = ProcessGroupInfo.of(group)
    if info.size != schedule.pp:
        raise ScheduleError(f"{schedule.name}: built for pp={schedule.pp} but the pipeline group "
                            f"has {info.size} ranks")
    if fb_overlap not in FB_OVERLAP:
        raise ValueError(f"fb_overlap={fb_overlap!r}: choose one of {FB_OVERLAP}")
    if fb_overlap != "off":  # 1F1B / interleaved: each backward beside the next forward
        schedule = pair_forward_backward(schedule)
    if len(microbatches) != schedule.microbatches:
        raise ScheduleError(f"{schedule.name}: built for {schedule.microbatches} micro-batches, "
                            f"got {len(microbatches)}")
    expected = schedule.stages_of_rank(info.rank)
    held = [m.index for m in stage_modules]
    if held != expected:
        raise ScheduleError(f"{schedule.name}: rank {info.rank} must hold stages {expected} (by chunk), "
                            f"got stage modules for {held}")
    check_layout_fits(stage_modules[0].layout, schedule)
    batches = [MicroBatch.of(b) for b in microbatches]
    shared_moe = _shared_moe_layers(schedule, stage_modules) if reduce_shared_grads and info.size > 1 else {}
    counts_before = {name: layer.pending_counts.clone() for name, (_, layer) in shared_moe.items()}
    scale = 1.0 / schedule.microbatches if loss_scale is None else float(loss_scale)
    previous_aux = balancing.aux_loss_scale()
    balancing.set_aux_loss_scale(scale if aux_loss_scale is None else float(aux_loss_scale))
    executor = _Executor(schedule, list(stage_modules), batches, info, scale, overlap_p2p_comm, fb_overlap)
    actions = schedule.rank_actions[info.rank]
    final = {} if data_parallel is None else final_gradient_params(schedule, actions, stage_modules)
    try:
        for i, action in enumerate(actions):
            if data_parallel is None:
                sync = contextlib.nullcontext()
            elif i in final:
                sync = data_parallel.final_gradients(final[i])
            else:
                sync = data_parallel.no_sync()
            with sync:
                executor.run(action, actions[i + 1] if i + 1 < len(actions) else None)
        if executor.p2p is not None:
            executor.p2p.close()
    finally:
        balancing.set_aux_loss_scale(previous_aux)
    if executor.saved or executor.weight_work or executor.local:
        raise RuntimeError(f"rank {info.rank}: the schedule left work undone: "
                           f"{sorted(executor.saved)[:3]} {sorted(executor.weight_work)[:3]}")
    if reduce_shared_grads:
        reduce_shared_gradients(schedule, stage_modules, group=group)
        _reduce_expert_counts(shared_moe, counts_before, info)
    result = _losses(executor.losses, schedule.microbatches, stage_modules[0], info, gather_losses)
    result.timeline = [str(a) for a in actions]
    return result


def final_gradient_params(schedule: PipelineSchedule, actions: Sequence[Action],
                          stage_modules: Sequence[PipelineStageModule]) -> dict[int, list[torch.nn.Parameter]]:
    """Action index -> the parameters whose last gradient of the step that action produces.

    A chunk's last gradient comes with its last full backward (B) or, under a split backward,
    its last W; a parameter several chunks of this rank use (an embedding on a V's two ends) is
    final after the later one. Parameters held by several PP ranks are left out: they are
    summed over those ranks after the schedule.
    """
    last: dict[int, int] = {}
    for i, action in enumerate(actions):
        for part in action.parts():
            if part.kind == "W" or (part.kind == "B" and not part.split_backward):
                last[part.chunk] = i
    first = stage_modules[0]
    shared = shared_parameter_ranks(first.layout, schedule, first.tied)
    at: dict[int, tuple[int, torch.nn.Parameter]] = {}
    for chunk, module in enumerate(stage_modules):
        for name, p in module.named_parameters():
            if p.requires_grad and parameter_key(name) not in shared and chunk in last:
                at[id(p)] = (max(at.get(id(p), (-1, p))[0], last[chunk]), p)
    out: dict[int, list[torch.nn.Parameter]] = {}
    for index, p in at.values():
        out.setdefault(index, []).append(p)
    return out


def _losses(local: dict[int, Tensors], m: int, module: PipelineStageModule, info, gather: bool):
    has_mtp = module.layout.mtp_layers > 0
    cols = 3 if has_mtp else 2
    table = torch.zeros(m, cols, dtype=torch.float64, device=module.device)
    seen = torch.zeros(m, dtype=torch.float64, device=module.device)
    for mb, values in local.items():
        table[mb] = torch.stack([v.double() for v in values[:cols]])
        seen[mb] = 1
    if gather and info.size > 1:
        both = torch.cat([table, seen[:, None]], dim=1)
        torch.distributed.all_reduce(both, group=info.handle)
        table, seen = both[:, :cols], both[:, cols]
    table[seen == 0] = math.nan
    table = table.float()
    return PipelineResult(table[:, 0], table[:, 1], table[:, 2] if has_mtp else None)


def reduce_shared_gradients(schedule: PipelineSchedule, stage_modules: Sequence[PipelineStageModule],
                            group=None) -> None:
    """Sum the gradients of parameters held on several PP ranks over their holders.

    Which ranks hold what comes from the layout and the schedule, so every rank agrees
    without talking; each set of holders is reduced with one flattened P2P sum, sets in
    sorted order.
    """
    info = ProcessGroupInfo.of(group)
    if info.size == 1:
        return
    first = stage_modules[0]
    holders = shared_parameter_ranks(first.layout, schedule, first.tied)
    params: dict[str, torch.nn.Parameter] = {}
    for module in stage_modules:
        for name, p in module.named_parameters():
            if p.requires_grad:
                params.setdefault(name, p)
    by_ranks: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for name in sorted(params):
        ranks = holders.get(parameter_key(name))
        if ranks is not None:
            by_ranks.setdefault(ranks, []).append(params[name])
    for ranks in sorted(by_ranks):
        ps = by_ranks[ranks]
        grads = [_grad_of(p) for p in ps]
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(ps, grads)])
        sum_over_ranks(flat, ranks, info)
        offset = 0
        for p, g in zip(ps, grads):
            chunk = flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            if g is None:
                p.grad = chunk.clone()
            else:
                g.copy_(chunk)


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    """Where p's gradient accumulates: DataParallel's `main_grad` view (which also holds it when
    .grad is low precision and was folded in), else `.grad`."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _shared_moe_layers(schedule, stage_modules) -> dict[str, tuple[tuple[int, ...], MoELayer]]:
    """MoE layers held on several ranks (DualPipe), with their holders."""
    first = stage_modules[0]
    holders = shared_parameter_ranks(first.layout, schedule, first.tied)
    found: dict[str, tuple[tuple[int, ...], MoELayer]] = {}
    for module in stage_modules:
        for name, layer in module.named_modules():
            ranks = holders.get(parameter_key(name))
            if isinstance(layer, MoELayer) and ranks is not None:
                found.setdefault(name, (ranks, layer))
    return found


def _reduce_expert_counts(shared_moe, counts_before, info) -> None:
    """Add up, over a layer's holders, the routing counts this run added (aux-loss-free bias
    updates then see every token of the step, and the copies' biases stay equal)."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name in sorted(shared_moe):
        by_ranks.setdefault(shared_moe[name][0], []).append(name)
    for ranks in sorted(by_ranks):
        names = by_ranks[ranks]
        delta = torch.cat([shared_moe[n][1].pending_counts - counts_before[n] for n in names])
        sum_over_ranks(delta, ranks, info)
        for n, part in zip(names, delta.split([counts_before[n].numel() for n in names])):
            shared_moe[n][1].pending_counts.copy_(counts_before[n] + part)


def sync_shared_parameters(schedule: PipelineSchedule, stage_modules: Sequence[PipelineStageModule],
                           group=None) -> None:
    """Make every copy of a shared parameter equal to the lowest holder's (call once at start)."""
    info = ProcessGroupInfo.of(group)
    if info.size == 1:
        return
    first = stage_modules[0]
    holders = shared_parameter_ranks(first.layout, schedule, first.tied)
    params = {}
    for module in stage_modules:
        for name, p in module.named_parameters():
            params.setdefault(name, p)
    by_ranks: dict[tuple[int, ...], list] = {}
    for name in sorted(params):
        ranks = holders.get(parameter_key(name))
        if ranks is not None:
            by_ranks.setdefault(ranks, []).append(params[name])
    with torch.no_grad():
        for ranks in sorted(by_ranks):
            ps = by_ranks[ranks]
            flat = torch.cat([p.reshape(-1) for p in ps])
            if info.rank != ranks[0]:
                flat.zero_()
            sum_over_ranks(flat, ranks, info)
            offset = 0
            for p in ps:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
