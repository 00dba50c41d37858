"""Optimizers over DataParallel: ZeRO-1 distributed AdamW, or AdamW replicated on every rank."""

from moetron.optim.distributed import DistributedOptimizer
from moetron.optim.replicated import ReplicatedAdamW

__all__ = ["DistributedOptimizer", "ReplicatedAdamW"]
