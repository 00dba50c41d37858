"""Optimizers: ZeRO-1 distributed AdamW over the data-parallel groups."""

from moetron.optim.distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
