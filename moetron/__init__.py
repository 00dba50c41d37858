"""moetron: Mixture-of-Experts training, readable and correct in every parallel layout."""

from moetron.moe.config import MoEConfig
from moetron.moe.layer import MoELayer

__version__ = "0.1.0"
__all__ = ["MoEConfig", "MoELayer", "__version__"]
