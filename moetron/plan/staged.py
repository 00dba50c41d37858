"""The pipeline makespan with every stage's own costs (pipeline/simulator.py charges one cost to all).

The runtime's action lists (pipeline/schedules.py; under fb_overlap paired by pipeline/overlap.py as the
runtime pairs them) are walked in dependency order; each action is charged its stage's forward, backward
and weight-gradient time, and a hop between ranks the P2P time. An F&B pair: under DualPipeV
max(compute, all-to-all) (DeepSeek-V3 report, section 3.2.1: DualPipe's pairs hide the all-to-all fully,
the weight gradients filling the gaps); under 1F1B / interleaved layer by layer in Megatron-Core's
combined-1F1B order (cost.py `pair_time`); both plus the SMs the overlapped all-to-all takes from the
compute. Design notes: docs/planning.md.
"""

from __future__ import annotations

from itertools import zip_longest

from moetron.pipeline.overlap import pair_forward_backward
from moetron.pipeline.schedules import Action, build_schedule, run_in_order
from moetron.plan.cost import OVERLAP_SM_SHARE, StageTime, pair_time


def staged_run(schedule: str, pp: int, microbatches: int, vpp: int | None, costs: dict[int, StageTime],
               p2p: float, fb_overlap: bool) -> tuple[float, float]:
    """(makespan, EP time hidden by F&B pairs summed over the ranks) for `costs` keyed by stage index."""
    sched = build_schedule(schedule, pp=pp, microbatches=microbatches, vpp=vpp)
    if fb_overlap and schedule != "dualpipev":
        sched = pair_forward_backward(sched)
    hidden = 0.0
    pairs: dict[tuple[int, int], float] = {}

    def cost(a: Action) -> float:
        nonlocal hidden
        t = costs[a.stage]
        if a.kind == "F":
            return t.F
        if a.kind == "W":
            return t.W
        if a.kind == "B":
            return t.B if a.split_backward else t.B + t.W
        back = costs[a.backward_stage]
        full = t.F + back.B + back.W
        if not fb_overlap:
            return full
        key = (a.stage, a.backward_stage)
        if key not in pairs:
            pairs[key] = full - _paired_saving(t, back, schedule == "dualpipev")
        hidden += full - pairs[key]
        return pairs[key]

    clock = [0.0] * sched.pp
    finish: dict[tuple[str, int, int], float] = {}

    def visit(rank: int, action: Action, deps) -> None:
        ready = max([clock[rank]] + [finish[k] + (p2p if r != rank else 0.0) for r, k in deps])
        end = ready + cost(action)
        for part in action.parts():
            finish[(part.kind, part.microbatch, part.stage)] = end
        clock[rank] = end

    run_in_order(sched, visit)
    return max(clock), hidden


def _paired_saving(f: StageTime, b: StageTime, whole: bool) -> float:
    """Seconds an F&B pair of forward `f` and backward `b` saves against running them back to back.
    whole: the pair hides max(compute, all-to-all) (DualPipe). Otherwise the layers pair one by one, the
    forward's in order with the backward's in reverse (cost.py `pair_time`); layers without a partner and
    the rest of the stage (embedding, loss head) run alone."""
    full = f.F + b.B + b.W
    comm = f.ep_fwd + b.ep_fwd
    if whole or not (f.pieces or b.pieces):
        comp = full - comm
        return full - (max(comp, comm) + min(comp, comm) * OVERLAP_SM_SHARE)
    saved = 0.0
    for fl, bl in zip_longest(f.pieces, reversed(b.pieces)):
        span, overlapped = pair_time(fl, bl)
        alone = pair_time(fl, None)[0] + pair_time(None, bl)[0]
        saved += alone - span - overlapped * OVERLAP_SM_SHARE
    return saved
