"""moetron: Mixture-of-Experts training, readable and correct in every parallel layout.

`MoEConfig` and `MoELayer` load on first use, so that `import moetron` does not import torch: the
command line (moetron/__main__.py) sets OpenMP's wait policy before torch loads its OpenMP runtime.
"""

__version__ = "0.1.0"
__all__ = ["MoEConfig", "MoELayer", "__version__"]


def __getattr__(name: str):
    if name == "MoEConfig":
        from moetron.moe.config import MoEConfig
        return MoEConfig
    if name == "MoELayer":
        from moetron.moe.layer import MoELayer
        return MoELayer
    raise AttributeError(f"module 'moetron' has no attribute {name!r}")
