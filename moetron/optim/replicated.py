"""Replicated AdamW: every data-parallel rank keeps the whole optimizer, over all-reduced gradients.

    ddp = DataParallel(model, ps)                 # all-reduce mode (use_distributed_optimizer=False)
    opt = ReplicatedAdamW(ddp, lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    opt.zero_grad()
    ... forward / backward (micro-batches with ddp.no_sync()) ...
    grad_norm = opt.step()        # finish the all-reduce, clip by the global norm, AdamW

Design notes: docs/parallel.md (`moetron/optim/replicated.py`).
"""

from __future__ import annotations

import math

import torch

from moetron.optim.adamw import AdamW
from moetron.parallel.data_parallel import DataParallel


class ReplicatedAdamW(AdamW):
    """torch.optim.AdamW over the parameters of an all-reduce `DataParallel`, clipping globally.

    Two param groups like `DistributedOptimizer`'s default: the >= 2-D parameters with
    `weight_decay` and (with no_decay_1d) the 1-D ones (norms, biases) without.
    max_grad_norm: clip by the global norm (None: only report it).
    """

    def __init__(self, ddp: DataParallel, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, no_decay_1d: bool = True,
                 max_grad_norm: float | None = None):
        if not isinstance(ddp, DataParallel) or ddp.use_distributed_optimizer:
            raise ValueError("ReplicatedAdamW needs DataParallel(..., use_distributed_optimizer=False): it "
                             "updates every parameter on every rank from all-reduced gradients; use "
                             "DistributedOptimizer with use_distributed_optimizer=True")
        split = [s.name for s in ddp.slots if s.main_grad_only]
        if split:
            raise ValueError(f"ReplicatedAdamW: parameters {split[:3]} keep gradients in another dtype than their "
                             "own (DataParallel grad_dtype), which torch's AdamW cannot read from .grad; use "
                             "DistributedOptimizer, which keeps fp32 master weights")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0 (or None for no clipping)")
        params = [p for _, p in ddp.named_parameters()]
        if no_decay_1d:
            groups = [{"params": [p for p in params if p.dim() >= 2]},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        else:
            groups = [{"params": params}]
        super().__init__(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.ddp, self.max_grad_norm = ddp, max_grad_norm
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero DataParallel's gradient buffers (set_to_none is accepted for torch, ignored)."""
        self.ddp.zero_grad()

    @torch.no_grad()
    def step(self, closure=None) -> float:
        """Finish the gradient all-reduce, clip by the global norm, update; returns the norm.

        Collective over the world (the norm is summed over the model-parallel shards).
        """
        if closure is not None:
            raise ValueError("ReplicatedAdamW.step() takes no closure: run forward/backward first")
        norm = float(self.ddp.clip_grad_norm_(self.max_grad_norm))  # finishes the grad sync too
        self.last_grad_norm = norm
        self.last_step_skipped = not math.isfinite(norm)
        if not self.last_step_skipped:
            super().step()
        return norm
