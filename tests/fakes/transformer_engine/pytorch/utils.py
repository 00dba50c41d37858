"""transformer_engine/pytorch/utils.py (fake): the FP8 GEMM shape rule, the device query, `divide`."""

import math
from typing import List, Tuple

import torch

import transformer_engine


def get_device_compute_capability() -> Tuple[int, int]:
    """The compute capability the fake pretends to have (MOETRON_FAKE_DEVICE)."""
    return tuple(transformer_engine.MOETRON_FAKE_DEVICE["capability"])


def check_dim_for_fp8_exec(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and tensor.size(0) % 8 == 0 and tensor.size(1) % 16 == 0


def assert_dim_for_fp8_exec(*tensors: List[torch.Tensor]) -> None:
    for tensor in tensors:
        if math.prod(tensor.shape[:-1]) % 8 != 0 or tensor.shape[-1] % 16 != 0:
            raise ValueError(
                "FP8 execution requires the product of all dimensions except the last to be"
                " divisible by 8 and the last dimension to be divisible by 16, but got tensor"
                f" with dims={list(tensor.size())} (product of leading dims ="
                f" {math.prod(tensor.shape[:-1])}, last dim = {tensor.shape[-1]})"
            )


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Ensure that numerator is divisible by the denominator."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """Ensure that numerator is divisible by the denominator and return the division value."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator
