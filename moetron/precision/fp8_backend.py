"""Which FP8 backend runs a recipe here, chosen by capability and said out loud.

`choose_fp8_backend(recipe, caps)` is pure (tests inject `FP8Capabilities`); `probe_capabilities()`
reads this machine: the GPU's compute capability, torch's CUDA version, whether Transformer Engine
is usable (installed with a GPU, or its CPU fake from tests/fakes, which declares the device it
emulates). TE's own rules: FP8 needs sm >= 8.9; block scaling sm >= 9.0 and CUDA >= 12.9; MXFP8
sm 10.x/11.x. Design notes: docs/fp8.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from moetron import backends


@dataclass(frozen=True)
class FP8Capabilities:
    te: str | None  # how Transformer Engine is present ("transformer_engine 2.x", "CPU fake of ..."), or None
    te_missing: str  # why not, when te is None
    sm: tuple[int, int] | None  # the GPU's compute capability (TE's: the one its fake emulates), None on CPU
    cuda: tuple[int, int] | None  # torch's CUDA version (TE fake: the one it emulates)
    scaled_mm: bool  # torch._scaled_mm exists


def _version(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    parts = text.split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def probe_capabilities() -> FP8Capabilities:
    scaled_mm = hasattr(torch, "_scaled_mm")
    fake = backends.cpu_fake("transformer_engine")
    if fake:
        device = sys.modules["transformer_engine"].MOETRON_FAKE_DEVICE
        return FP8Capabilities(f"CPU fake of {fake}", "", tuple(device["capability"]), tuple(device["cuda"]),
                               scaled_mm)
    status = next(s for s in backends.backend_status() if s.name == "transformer_engine")
    cuda = torch.cuda.is_available()
    sm = tuple(torch.cuda.get_device_capability()) if cuda else None
    return FP8Capabilities("transformer_engine" if status.available else None, status.reason, sm,
                           _version(torch.version.cuda) if cuda else None, scaled_mm)


def te_unsupported(scaling: str, caps: FP8Capabilities) -> str | None:
    """Why Transformer Engine cannot run `scaling` with `caps` (None: it can)."""
    if caps.te is None:
        return f"Transformer Engine is unavailable ({caps.te_missing}); pip install transformer-engine[pytorch]"
    sm, cuda = caps.sm, caps.cuda or (0, 0)
    if sm is None:
        return "Transformer Engine runs on CUDA devices only"
    if sm < (8, 9):
        return f"FP8 needs compute capability >= 8.9; this GPU is sm{sm[0]}{sm[1]}"
    if sm < (9, 0) and cuda < (12, 1):
        return f"FP8 on Ada needs CUDA >= 12.1; torch has CUDA {cuda[0]}.{cuda[1]}"
    if scaling == "blockwise" and not (sm >= (9, 0) and cuda >= (12, 9)):
        return (f"TE's FP8 block scaling needs sm >= 9.0 and CUDA >= 12.9; this is sm{sm[0]}{sm[1]} with "
                f"CUDA {cuda[0]}.{cuda[1]}")
    if scaling == "mxfp8" and not (10, 0) <= sm < (12, 0):
        return f"TE's MXFP8 needs compute capability 10.x or 11.x (Blackwell); this GPU is sm{sm[0]}{sm[1]}"
    return None


def choose_fp8_backend(recipe, caps: FP8Capabilities) -> tuple[str, str]:
    """`(backend, reason)` for `recipe` (an FP8Recipe): "te", a GEMM backend ("torch", "emulate"),
    or "auto" (per GEMM: torch._scaled_mm where the scales and shapes allow, else emulated).
    A named backend that cannot run raises an error that names the fix."""
    scaling, requested = recipe.scaling, recipe.backend
    if requested == "te":
        why = te_unsupported(scaling, caps)
        if why:
            raise RuntimeError(f"train.fp8_backend=te with train.fp8={scaling}: {why}. Use "
                               f"train.fp8_backend=auto (picks what runs) or emulate")
        return "te", f"Transformer Engine ({caps.te}), as requested"
    if requested == "torch":
        if not caps.scaled_mm:
            raise RuntimeError("train.fp8_backend=torch: this torch build has no torch._scaled_mm; use "
                               "train.fp8_backend=emulate or auto")
        return "torch", "torch._scaled_mm, as requested"
    if requested == "emulate":
        return "emulate", "emulated FP8 (quantize, dequantize, fp32 GEMM), as requested"
    why_not_te = te_unsupported(scaling, caps)
    if why_not_te is None:
        return "te", f"Transformer Engine ({caps.te}) runs {scaling} on sm{caps.sm[0]}{caps.sm[1]}"
    tensorwise = scaling in ("tensorwise", "delayed")
    gpu_ok = caps.sm is None or caps.sm >= (8, 9)
    if tensorwise and caps.scaled_mm and gpu_ok:
        return "auto", f"torch._scaled_mm where shapes allow, else emulated (not Transformer Engine: {why_not_te})"
    return "emulate", (f"emulated FP8 ({scaling} scales are not tensorwise, so torch._scaled_mm cannot run them; "
                       f"not Transformer Engine: {why_not_te})" if not tensorwise else
                       f"emulated FP8 (no torch._scaled_mm for this device; not Transformer Engine: {why_not_te})")


__all__ = ["FP8Capabilities", "choose_fp8_backend", "probe_capabilities", "te_unsupported"]
