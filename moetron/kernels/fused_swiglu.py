"""Weighted SwiGLU on `gate_up [N, 2F]` (gate columns first): `silu(gate) * up * probs[:, None]`.

The MoE experts apply the routing weights here, on the [N, F] activation before the down
projection (Megatron-Core's `weighted_swiglu` since v0.13), instead of on [N, H] rows at the
combine. Implementations (`impl`):

* "torch"   the reference expression (`weighted_swiglu_reference`), any device.
* "cpp"     one fused pass each way on CPU tensors (moetron/csrc/swiglu_cpu.cpp, compiled on first
            use with the permute kernels): no split, no cat, no [N, F] temporaries.
* "triton"  the same on CUDA tensors (moetron/kernels/triton_swiglu.py; CPU tensors under
            TRITON_INTERPRET=1, for tests).
* "auto"    the fused kernel the device has (Triton on CUDA, C++ on CPU), else the reference with a
            one-time notice. None: by device without compiling: Triton on CUDA, the reference on CPU.

The fused kernels agree with the reference within a few ulp (exp differs; the probs gradient
sums in another order): the bounds are in tests/test_fused_swiglu.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moetron.kernels import availability, cpp_build

IMPLS = ("auto", "torch", "cpp", "triton")
_noticed = False


def weighted_swiglu_reference(gate_up: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) * up`, times `probs [N]` (fp32) when given, rounded to gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    if probs is None:
        return act
    return (act * probs.unsqueeze(-1)).to(act.dtype)


def _triton_status(device: torch.device) -> tuple[bool, str]:
    return availability.triton_status(device, "moetron.kernels.triton_swiglu", availability.triton_installed())


_cpp_status = availability.cpp_status


def impl_status(device: torch.device | str = "cpu", build: bool = False) -> list[tuple[str, bool, str]]:
    """`(impl, available, reason)` for tensors on `device`; `build=True` compiles the C++ kernel to know."""
    device = torch.device(device)
    return [("torch", True, "torch reference, any device"), ("cpp", *_cpp_status(device, build)),
            ("triton", *_triton_status(device))]


def resolve(impl: str | None, device: torch.device) -> str:
    """The concrete implementation for tensors on `device`: never "auto", never an unavailable one."""
    global _noticed
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"swiglu impl {impl!r} is unknown; choose one of {IMPLS} (or None: by device)")
    if impl is None:
        return "triton" if device.type == "cuda" and _triton_status(device)[0] else "torch"
    if impl == "auto":
        if device.type == "cuda" and _triton_status(device)[0]:
            return "triton"
        reason = _triton_status(device)[1]
        if device.type == "cpu":
            ok, reason = _cpp_status(device, build=True)
            if ok:
                return "cpp"
        if not _noticed:
            _noticed = True
            warnings.warn(f"moetron: no fused SwiGLU kernel here ({reason}); using the torch reference",
                          RuntimeWarning, stacklevel=3)
        return "torch"
    if impl != "torch":
        ok, reason = _cpp_status(device, build=True) if impl == "cpp" else _triton_status(device)
        if not ok:
            raise RuntimeError(f"swiglu impl {impl!r} was requested but is unavailable: {reason}")
    return impl


class _CppKernels:
    def __init__(self):
        self.ops = cpp_build.load_swiglu_ops()

    def forward(self, gate_up, probs):
        return self.ops.forward(gate_up, probs)

    def backward(self, grad, gate_up, probs, need_probs_grad):
        return self.ops.backward(grad, gate_up, probs, need_probs_grad)


class _TritonKernels:
    def __init__(self):
        from moetron.kernels import triton_swiglu

        self.forward, self.backward = triton_swiglu.forward, triton_swiglu.backward


_kernels: dict[str, object] = {}


def kernels_for(impl: str):
    if impl not in _kernels:
        _kernels[impl] = {"cpp": _CppKernels, "triton": _TritonKernels}[impl]()
    return _kernels[impl]


class _FusedSwiGLU(torch.autograd.Function):
    """Saves only `gate_up` (and probs); backward writes `d_gate_up [N, 2F]` in one pass."""

    @staticmethod
    def forward(ctx, gate_up, probs, kernels):
        ctx.kernels = kernels
        ctx.save_for_backward(gate_up, probs)
        return kernels.forward(gate_up, probs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        gate_up, probs = ctx.saved_tensors
        need_probs = probs is not None and ctx.needs_input_grad[1]
        d_gate_up, d_probs = ctx.kernels.backward(grad.contiguous(), gate_up, probs, need_probs)
        return d_gate_up, (d_probs if need_probs else None), None


def check_args(gate_up: torch.Tensor, probs: torch.Tensor | None) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"weighted_swiglu: gate_up must be [rows, 2*ffn], got shape {tuple(gate_up.shape)}")
    if probs is not None and (probs.shape != gate_up.shape[:1] or probs.dtype != torch.float32):
        raise ValueError(f"weighted_swiglu: probs must be float32 [rows={gate_up.shape[0]}], got "
                         f"{probs.dtype} {tuple(probs.shape)}")


def fused_swiglu(gate_up: torch.Tensor, probs: torch.Tensor | None, impl: str) -> torch.Tensor:
    """The fused kernel `impl` ("cpp" or "triton", resolved) with autograd."""
    check_args(gate_up, probs)
    return _FusedSwiGLU.apply(gate_up.contiguous(), None if probs is None else probs.contiguous(),
                              kernels_for(impl))
