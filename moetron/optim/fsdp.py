"""AdamW over FSDP2's sharded (DTensor) parameters: ZeRO-3's optimizer.

    opt = ShardedAdamW(fsdp, lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    grad_norm = opt.step()        # the global norm over the shards, clip, torch's AdamW on each shard

Design notes: docs/zero.md.
"""

from __future__ import annotations

import math

import torch

from moetron.optim.adamw import AdamW
from moetron.parallel.fsdp import FullyShardedDataParallel


class ShardedAdamW(AdamW):
    """torch.optim.AdamW (the fused kernel, as the one-process trainer) on DTensor shards.

    Two param groups like `DistributedOptimizer`'s default: the >= 2-D parameters with
    `weight_decay` and (with no_decay_1d) the 1-D ones (norms, biases) without.
    """

    def __init__(self, fsdp: FullyShardedDataParallel, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, no_decay_1d: bool = True,
                 max_grad_norm: float | None = None):
        if not isinstance(fsdp, FullyShardedDataParallel):
            raise ValueError("ShardedAdamW needs a FullyShardedDataParallel (ZeRO-3) model")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm!r} must be > 0 (or None for no clipping)")
        params = [p for _, p in fsdp.named_parameters()]
        if no_decay_1d:
            groups = [{"params": [p for p in params if p.dim() >= 2]},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        else:
            groups = [{"params": params}]
        super().__init__(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=True)
        self.ddp, self.max_grad_norm = fsdp, max_grad_norm
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad()

    @torch.no_grad()
    def step(self, closure=None) -> float:
        """Global gradient norm (a DTensor reduction over the shards), clip, update; returns the norm."""
        if closure is not None:
            raise ValueError("ShardedAdamW.step() takes no closure: run forward/backward first")
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.last_grad_norm = norm
        self.last_step_skipped = not math.isfinite(norm)
        if self.last_step_skipped:
            return norm
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total, foreach=True)
        super().step()
        return norm
