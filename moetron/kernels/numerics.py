"""Numerics shared by the permute kernels (torch reference, C++ and Triton) so they agree bit for bit."""

from __future__ import annotations

import torch

DOT_LANES = 256  # lanes of the gate-weight gradient's dot product (csrc/permute_cpu.cpp's kLanes too)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation type of the fused kernels: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32
