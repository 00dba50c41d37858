"""F&B pairs for 1F1B and interleaved schedules (`pair_forward_backward`): each backward paired
with the next forward, so the MoE pieces of one micro-batch (moe/pieces.py) overlap the other's.
How the pair's all-to-alls travel while compute runs: docs/pipeline.md."""

from __future__ import annotations

import dataclasses
import functools

import torch

from moetron.pipeline.schedules import Action, PipelineSchedule, validate_schedule

Tensors = tuple[torch.Tensor, ...]


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
