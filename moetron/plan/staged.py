"""The pipeline makespan with every stage's own costs (pipeline/simulator.py charges one cost to all).

The runtime's action lists (pipeline/schedules.py; under fb_overlap paired by pipeline/overlap.py as the
runtime pairs them) are walked in dependency order; each action is charged its stage's forward, backward
and weight-gradient time, an F&B pair max(compute, all-to-all) plus the SMs the overlapped all-to-all
takes from the compute, and a hop between ranks the P2P time. Design notes: docs/planning.md.
"""

from __future__ import annotations

from moetron.pipeline.overlap import pair_forward_backward
from moetron.pipeline.schedules import Action, build_schedule, run_in_order
from moetron.plan.cost import OVERLAP_SM_SHARE, StageTime


def staged_run(schedule: str, pp: int, microbatches: int, vpp: int | None, costs: dict[int, StageTime],
               p2p: float, fb_overlap: bool) -> tuple[float, float]:
    """(makespan, EP time hidden by F&B pairs summed over the ranks) for `costs` keyed by stage index."""
    sched = build_schedule(schedule, pp=pp, microbatches=microbatches, vpp=vpp)
    if fb_overlap and schedule != "dualpipev":
        sched = pair_forward_backward(sched)
    hidden = 0.0

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
        comm = t.ep_fwd + back.ep_fwd
        comp = full - comm
        paired = max(comp, comm) + min(comp, comm) * OVERLAP_SM_SHARE
        hidden += full - paired
        return paired

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
