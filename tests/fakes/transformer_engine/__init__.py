"""CPU fake of NVIDIA/TransformerEngine 2.20.0.dev0 (commit d0067d0d), the PyTorch API moetron uses:
`transformer_engine.common.recipe` (Format, DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
MXFP8BlockScaling), `transformer_engine.pytorch` (Linear, tensor parallel with Userbuffers comm+GEMM overlap
(`initialize_ub` / `destroy_ub`, module/base.py), GroupedLinear, DotProductAttention, autocast,
fp8_autocast, the support checks) with their signatures and host-side checks, FP8 numerics emulated
in torch. `MOETRON_FAKE_DEVICE` is the (compute capability, CUDA version) it pretends to run on; the
support checks read it, as TE's read the GPU (tests change it to probe moetron's choices).
"""

MOETRON_CPU_FAKE = "NVIDIA/TransformerEngine 2.20.0.dev0 @d0067d0d"
MOETRON_FAKE_DEVICE = {"capability": (10, 0), "cuda": (12, 9)}
__version__ = "2.20.0.dev0"

from transformer_engine import common, pytorch  # noqa: E402,F401
