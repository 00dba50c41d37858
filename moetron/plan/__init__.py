"""`moetron plan`: the parallel-layout planner (docs/planning.md)."""

from moetron.plan.candidate import Candidate
from moetron.plan.gpus import GPUS, GPU
from moetron.plan.search import Evaluation, Planner, PlanInputs, Pruned

__all__ = ["Candidate", "Evaluation", "GPU", "GPUS", "Planner", "PlanInputs", "Pruned"]
