"""Process groups, autograd collectives, and the parallel layout configuration."""

from moetron.parallel.config import ParallelConfig, validate_for_model
from moetron.parallel.state import ParallelState, init_from_env

__all__ = ["ParallelConfig", "ParallelState", "init_from_env", "validate_for_model"]
