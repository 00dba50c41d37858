"""RMSNorm and halves-layout RoPE as one C++ pass each way, for fp32/fp64 CPU tensors.

`moetron.ops` routes to these under `set_fusion("cpp")` (the trainer's `train.fusion=auto` on a
CPU). A small model's step is mostly per-op cost: the eager RMSNorm is ~10 ops each way, RoPE ~6,
each costing more than its arithmetic. RoPE here equals the torch reference bit for bit; RMSNorm
sums its squares in 8 fixed lanes, within a few ulp of it (moetron/csrc/rmsnorm_rope_cpu.cpp;
the bounds are in tests/test_norm_rope_cpp.py). Qwen3's q/k norm followed by RoPE is one op each way
(`RMSNormRopeFunction`), with the bits of the two apart.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moetron.kernels import cpp_build

DTYPES = (torch.float32, torch.float64)


def ops():
    """`torch.ops.moetron_norm`, building the C++ library on first use (raises `CppBuildError`)."""
    return cpp_build.load_norm_ops()


class RMSNormFunction(torch.autograd.Function):
    """x [..., H] (unit stride on H, any layout of the rest) and weight [H] of one dtype in DTYPES;
    saves x, weight and the 1/rms per row. Each row gets the same bits in any layout."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = ops().rms_forward(x, weight.contiguous(), eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = ops().rms_backward(grad, x, weight.contiguous(), rstd, ctx.needs_input_grad[1])
        return grad_x, grad_w, None


class RopeFunction(torch.autograd.Function):
    """x [B, heads, S, d] (unit stride on d), cos/sin [B or 1, 1, S, d] without grad; the output
    is laid out like x. `interleaved`: DeepSeek's pairs (x[2i], x[2i+1]) rotate, written in halves
    layout (`functional._rope_ref`'s interleaved branch, bit for bit)."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return ops().rope(x, cos, sin, False, interleaved)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return ops().rope(grad, cos, sin, True, ctx.interleaved), None, None, None


class RMSNormRopeFunction(torch.autograd.Function):
    """x [B, S, heads, d] contiguous, weight [d], cos/sin [B or 1, S, d] without grad: RoPE of the
    RMSNorm (Qwen3's q/k norms) as one op each way, the same bits as the two apart; returns the
    [B, heads, S, d] view the attention takes."""

    @staticmethod
    def forward(ctx, x, weight, eps, cos, sin):
        cos, sin, weight = cos.contiguous(), sin.contiguous(), weight.contiguous()
        y, rstd = ops().rms_rope_forward(x, weight, eps, cos, sin)
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        return y.transpose(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, rstd, cos, sin = ctx.saved_tensors
        grad_x, grad_w = ops().rms_rope_backward(grad, x, weight, rstd, cos, sin, ctx.needs_input_grad[1])
        return grad_x, grad_w, None, None, None


def rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Any layout with unit stride on H (tensor parallel hands over [S, B, H]-strided views): a row
    must get the same bits in every layout, or layouts stop training alike."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in DTYPES and x.dim() >= 1
            and x.stride(-1) == 1 and weight.dim() == 1 and x.shape[-1] == weight.numel())


def rope_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `RopeFunction` takes x with cos/sin [B or 1, S, d] (before their head dimension is added)."""
    return (x.device.type == "cpu" and x.dim() == 4 and x.dtype == cos.dtype == sin.dtype and x.dtype in DTYPES
            and cos.shape == sin.shape
            and x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and cos.dim() == 3
            and cos.shape[0] in (1, x.shape[0]) and tuple(cos.shape[1:]) == tuple(x.shape[2:]))


def rms_norm_rope_applies(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `RMSNormRopeFunction` takes x [B, S, heads, d] (contiguous) with cos/sin [B or 1, S, d]."""
    return (x.dim() == 4 and x.is_contiguous() and rms_norm_applies(x, weight)
            and rope_applies(x.transpose(1, 2), cos, sin))
