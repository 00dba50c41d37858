"""Which optional accelerators are present, and why not when they are missing.

Backends are chosen by capability (DESIGN principle 4). Nothing here imports an
optional package at module load: each probe imports lazily when asked. A CPU test double of a
GPU library (tests/fakes) declares itself with `MOETRON_CPU_FAKE`; a probe reports it as such.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str


def _has_module(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def cpu_fake(module: str) -> str | None:
    """What an already-imported CPU fake of `module` declares it follows (tests/fakes), else None.
    Only `sys.modules` is consulted: a real library is never imported here."""
    return getattr(sys.modules.get(module), "MOETRON_CPU_FAKE", None)


def _cuda_reason() -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device"


def _probe(name: str, module: str | None, needs_cuda: bool, what: str) -> BackendStatus:
    if module is not None and not _has_module(module):
        return BackendStatus(name, False, f"python package '{module}' is not installed ({what})")
    if needs_cuda and _cuda_reason():
        fake = cpu_fake(module) if module is not None else None
        if fake:
            return BackendStatus(name, True, f"{what}: a CPU fake of {fake} (tests/fakes), not the GPU library")
        return BackendStatus(name, False, f"{_cuda_reason()} ({what} runs on GPU only)")
    return BackendStatus(name, True, what)


def _nvshmem_status() -> BackendStatus:
    """The flex dispatcher's nvshmem backend uses torch's symmetric-memory all-to-all-v."""
    what = "NVSHMEM all-to-all through torch symmetric memory"
    if _cuda_reason():
        return BackendStatus("nvshmem", False, f"{_cuda_reason()} ({what} runs on GPU only)")
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        ok = bool(symm_mem.is_nvshmem_available())
    except (ImportError, AttributeError, RuntimeError) as exc:
        return BackendStatus("nvshmem", False, f"this torch build has no NVSHMEM support ({exc})")
    return BackendStatus("nvshmem", ok, what if ok else "this torch build has no NVSHMEM support")


def backend_status() -> list[BackendStatus]:
    """Every optional backend moetron knows, with availability and a reason."""
    grouped_mm = hasattr(torch, "_grouped_mm")
    return [
        BackendStatus("torch", True, f"torch {torch.__version__}: reference paths, CPU and GPU"),
        BackendStatus("torch_grouped_mm", grouped_mm,
                      "torch._grouped_mm grouped GEMM" if grouped_mm else "this torch has no torch._grouped_mm"),
        _probe("grouped_gemm", "grouped_gemm", True, "grouped_gemm package expert GEMMs"),
        _probe("flash_attn", "flash_attn", True, "flash-attn attention core"),
        _probe("transformer_engine", "transformer_engine", True, "Transformer Engine (FP8 linears, attention)"),
        _probe("deep_ep", "deep_ep", True, "DeepEP dispatch/combine"),
        _nvshmem_status(),
        _probe("triton", "triton", False, "Triton kernels (TRITON_INTERPRET=1 on CPU)"),
        BackendStatus("gloo", torch.distributed.is_available() and torch.distributed.is_gloo_available(),
                      "CPU collectives"),
        BackendStatus("nccl", torch.distributed.is_available() and torch.distributed.is_nccl_available()
                      and torch.cuda.is_available(), "GPU collectives"),
    ]


def require(name: str) -> None:
    """Raise a clear error if the named backend cannot run here (never fall back silently)."""
    for status in backend_status():
        if status.name == name:
            if not status.available:
                raise RuntimeError(f"backend '{name}' was requested but is unavailable: {status.reason}. "
                                   f"Run `moetron env` to see what this machine supports.")
            return
    raise ValueError(f"unknown backend '{name}'; known: {[s.name for s in backend_status()]}")
