"""Whether a fused kernel can run on a device, and why not: shared by every kernel family (permute,
SwiGLU) so `moetron env` and the implementation choice say the same thing."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch

from moetron.kernels import cpp_build


def triton_installed() -> bool:
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


def triton_status(device: torch.device, kernel_module: str, installed: bool) -> tuple[bool, str]:
    """`kernel_module` is the Triton kernel's module: whether it interprets was fixed at its import."""
    if not installed:
        return False, "python package 'triton' is not installed (pip install triton)"
    if device.type == "cuda":
        return True, "Triton GPU kernel"
    if device.type == "cpu":
        module = sys.modules.get(kernel_module)
        if module.INTERPRET if module is not None else os.environ.get("TRITON_INTERPRET") == "1":
            return True, "Triton kernel under the interpreter (TRITON_INTERPRET=1)"
        return False, f"Triton runs CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 before {kernel_module} is imported"
    return False, f"Triton does not run {device.type} tensors"


def cpp_status(device: torch.device, build: bool) -> tuple[bool, str]:
    if device.type != "cpu":
        return False, f"the C++ kernel runs CPU tensors only, got a {device.type} tensor"
    return cpp_build.cpp_status(build=build)


@contextlib.contextmanager
def interpreted_launch(interpret: bool):
    """Triton reads TRITON_INTERPRET again while it runs an interpreted kernel: keep it set meanwhile
    (`interpret`: whether the kernel's module was imported under the interpreter)."""
    if not interpret or os.environ.get("TRITON_INTERPRET") == "1":
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
