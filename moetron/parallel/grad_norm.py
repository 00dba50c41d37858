"""The global gradient norm's pieces: which copies count, fp32 sums of squares, their all-reduce.

Shared by DataParallel.clip_grad_norm_ (replicated gradients) and the distributed optimizer
(sharded ones), so both count a parameter held on several ranks exactly once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetron.parallel.state import Group, ParallelState


def counts_in_norm(param: nn.Parameter, ps: ParallelState, expert: bool = False) -> bool:
    """Whether this rank's copy of `param` counts in the global gradient norm.

    Once over pipeline ranks when several hold it (`pipeline_duplicate` marks the other copies:
    the shared embedding, and every stage under DualPipe - experts included). Then an expert
    parameter counts everywhere (each EP/ETP rank holds its own slice); a dense one on one TP
    rank unless it is TP-sharded.
    """
    if getattr(param, "pipeline_duplicate", False):
        return False
    return expert or bool(getattr(param, "tensor_model_parallel", False)) or ps.tp.rank == 0


DOT_MIN = 1 << 16  # elements from which one BLAS dot beats the norm kernel by more than a Python call costs


def sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """fp32 sum of squares of every element of `tensors` (0 for none).

    Large contiguous fp32 CPU tensors go through one BLAS dot each: torch's CPU norm kernel, which
    `_foreach_norm` loops over there, reads ~8 GB/s on this project's 2-core machines, the dot ~13
    (50M gradients: 25-28 -> 15-17 ms). The rest, and every tensor elsewhere (one kernel for all of them
    on a GPU), through `_foreach_norm`. Both sum in fp32; the result differs from torch's norm in the
    last bits.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    dots, rest = [], []
    for t in tensors:
        if t.numel() >= DOT_MIN and t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
            flat = t.view(-1)
            dots.append(torch.dot(flat, flat))
        else:
            rest.append(t.float() if t.dtype != torch.float32 else t)
    if rest:
        dots.append(torch.stack(torch._foreach_norm(rest)).pow(2).sum())
    return torch.stack(dots).sum() if len(dots) > 1 else dots[0]


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Clip `grads` by their global `norm` as torch's `clip_grads_with_norm_` does (the same coefficient,
    the same multiply), but only when the coefficient is < 1: torch multiplies by 1.0 too, a pass over
    every gradient that spares it a device sync, which the trainer makes anyway to read the norm."""
    coef = max_norm / (norm + 1e-6)
    if bool(coef < 1.0):
        torch._foreach_mul_(grads, coef)  # fp32, as torch's (whatever the gradients' dtype)


def all_reduce_sum(t: torch.Tensor, group: Group) -> None:
    if group.size > 1:
        dist.all_reduce(t, group=group.handle)
