"""Triton kernels of the fused RMSNorm, forward and backward, for bf16/fp16/fp32 inputs.

They reproduce `moetron.ops.functional._rms_norm_ref` (the order transformers uses): normalise in
fp32, round to x's dtype, then scale by the weight in the promoted dtype.

* forward   one program per row: `rstd = 1/sqrt(mean(x^2) + eps)`, `out = weight * round_x(x * rstd)`.
* backward  one program per row (up to a 32 MiB buffer; past it, at least 4 per SM looping over rows):
            `grad_x` per row, and the weight gradient summed in fp32 into the program's own row of a
            [programs, D] buffer, which torch then sums: deterministic, no atomics.

A row wider than `_MAX_BLOCK_D` is walked in blocks, twice (the reduction, then the normalisation).
On CPU tensors this module runs only under the interpreter: set `TRITON_INTERPRET=1` before it is
imported (tests do).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from moetron.kernels import availability

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: triton.jit decides at decoration
MAX_D = 65536  # the widest row `applies` accepts: the weight-gradient buffer is [programs, D] fp32
_MAX_BLOCK_D = 8192  # widest block held in registers; wider rows loop over blocks
_PROGRAMS_PER_SM = 4  # backward grid past the buffer limit: enough programs to fill the GPU
_DEFAULT_SMS = 128  # SM count assumed off CUDA (the interpreter)
_DW_BUFFER_BYTES = 32 << 20  # the weight-gradient partial sums: one row per program while they fit
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The interpreter casts fp32 to bf16 by truncation; a GPU rounds to nearest even (cvt.rn.bf16.f32).
_BF16_BY_HAND = tl.constexpr(INTERPRET)


@triton.jit
def _rstd(sum_sq, D, eps):
    # Each step correctly rounded (plain `/` and tl.sqrt are approximate on a GPU).
    return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, D.to(tl.float32)) + eps))


@triton.jit
def _round(v, TY: tl.constexpr):
    """fp32 `v` rounded to nearest even in TY, as a GPU's cast does; by hand for bf16 when interpreted."""
    if _BF16_BY_HAND and TY == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)  # now exact in bf16: truncation keeps it
    return v.to(TY)


@triton.jit
def _scaled(x, w, rstd, X_TY: tl.constexpr):
    # weight * (x * rstd rounded to x's dtype), in fp32; the caller rounds once to the output dtype.
    return w * _round(x * rstd, X_TY).to(tl.float32)


@triton.jit
def _load_block(x_ptr, g_ptr, w_ptr, base, offs, m):
    """One block of a row of x and of its gradient, and the weight's block, in fp32."""
    x = tl.load(x_ptr + base + offs, mask=m, other=0).to(tl.float32)
    g = tl.load(g_ptr + base + offs, mask=m, other=0).to(tl.float32)
    return x, g, tl.load(w_ptr + offs, mask=m, other=0).to(tl.float32)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, D, eps, BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * D, out_ptr + row * D
    X_TY: tl.constexpr = x_ptr.dtype.element_ty
    OUT_TY: tl.constexpr = out_ptr.dtype.element_ty
    if ONE_BLOCK:  # the row stays in registers: one read of x
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        x = tl.load(x_row + offs, mask=m, other=0).to(tl.float32)
        rstd = _rstd(tl.sum(x * x, axis=0), D, eps)
        w = tl.load(w_ptr + offs, mask=m, other=0).to(tl.float32)
        tl.store(out_row + offs, _round(_scaled(x, w, rstd, X_TY), OUT_TY), mask=m)
    else:
        sum_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_row + offs, mask=offs < D, other=0).to(tl.float32)
            sum_sq += x * x
        rstd = _rstd(tl.sum(sum_sq, axis=0), D, eps)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = offs < D
            x = tl.load(x_row + offs, mask=m, other=0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=m, other=0).to(tl.float32)
            tl.store(out_row + offs, _round(_scaled(x, w, rstd, X_TY), OUT_TY), mask=m)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _backward_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, N, D, NEED_DW: tl.constexpr,
                     BLOCK_D: tl.constexpr, ONE_BLOCK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64)  # an int64 start makes `row` int64: no overflow in row * D
    dw_row = dw_ptr + first * D  # this program's fp32 partial sums of the weight gradient
    X_TY: tl.constexpr = x_ptr.dtype.element_ty
    DX_TY: tl.constexpr = dx_ptr.dtype.element_ty
    if ONE_BLOCK:  # weight and weight-gradient partial sums stay in registers across rows
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        w = tl.load(w_ptr + offs, mask=m, other=0).to(tl.float32)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        for row in range(first, N, tl.num_programs(0)):
            base = row * D
            rstd = tl.load(rstd_ptr + row)
            x = tl.load(x_ptr + base + offs, mask=m, other=0).to(tl.float32)
            g = tl.load(g_ptr + base + offs, mask=m, other=0).to(tl.float32)
            xhat, gy = x * rstd, g * w
            c = tl.sum(gy * xhat, axis=0) / D
            tl.store(dx_ptr + base + offs, _round(rstd * (gy - xhat * c), DX_TY), mask=m)
            if NEED_DW:
                dw += g * _round(xhat, X_TY).to(tl.float32)
        if NEED_DW:
            tl.store(dw_row + offs, dw, mask=m)
    else:  # two passes per row; the partial sums are read-modify-written in place (zeroed by the host)
        for row in range(first, N, tl.num_programs(0)):
            base = row * D
            rstd = tl.load(rstd_ptr + row)
            dot = tl.zeros([BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs = d0 + tl.arange(0, BLOCK_D)
                m = offs < D
                x, g, w = _load_block(x_ptr, g_ptr, w_ptr, base, offs, m)
                dot += g * w * (x * rstd)
            c = tl.sum(dot, axis=0) / D
            for d0 in range(0, D, BLOCK_D):
                offs = d0 + tl.arange(0, BLOCK_D)
                m = offs < D
                x, g, w = _load_block(x_ptr, g_ptr, w_ptr, base, offs, m)
                xhat, gy = x * rstd, g * w
                tl.store(dx_ptr + base + offs, _round(rstd * (gy - xhat * c), DX_TY), mask=m)
                if NEED_DW:
                    acc = tl.load(dw_row + offs, mask=m, other=0)
                    tl.store(dw_row + offs, acc + g * _round(xhat, X_TY).to(tl.float32), mask=m)


def _check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t is not None and t.device.type != "cuda" and not INTERPRET:
            raise RuntimeError("the Triton RMSNorm kernels run CUDA tensors; for CPU tensors set "
                               "TRITON_INTERPRET=1 before moetron.kernels.triton_rmsnorm is imported")


def _check_shapes(x2d: torch.Tensor, weight: torch.Tensor) -> None:
    if x2d.dim() != 2 or not x2d.is_contiguous():
        raise ValueError(f"x must be a contiguous [N, D] tensor, got shape {tuple(x2d.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x2d.shape[1]:
        raise ValueError(f"weight must be 1-D of size D={x2d.shape[1]}, got shape {tuple(weight.shape)}")
    if x2d.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"x and weight must be bf16, fp16 or fp32, got {x2d.dtype} and {weight.dtype}")


def _block(D: int) -> tuple[int, bool]:
    block = max(16, min(_MAX_BLOCK_D, triton.next_power_of_2(max(D, 1))))
    return block, D <= block


def _num_warps(block: int, per_thread: int) -> int:
    """Warps that leave each thread `per_thread` fp32 values of a block. Compiled for sm_90 with
    ptxas, the backward (x, g, weight, grad-weight sums live at once) needs 8 to stay within
    registers without spilling (at 8192: 32 warps, 64 registers); the forward takes 16."""
    return min(32, max(4, block // (32 * per_thread)))


def _num_programs(N: int, D: int, device: torch.device) -> int:
    """One program per row while the [programs, D] partial sums fit `_DW_BUFFER_BYTES` (a row loop is a
    chain of dependent loads: at D=64 a loop of ~250 rows took longer than the eager ops), else at
    least `_PROGRAMS_PER_SM` per SM, each looping over its rows."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _DEFAULT_SMS
    return max(1, min(N, max(_PROGRAMS_PER_SM * sms, _DW_BUFFER_BYTES // (4 * max(D, 1)))))


def _launching():
    return availability.interpreted_launch(INTERPRET)


def forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rms_norm_ref(x2d, weight, eps)` and the fp32 1/rms of every row, which the backward reuses."""
    _check_device(x2d, weight)
    _check_shapes(x2d, weight)
    N, D = x2d.shape
    weight = weight.contiguous()
    out = torch.empty(N, D, dtype=torch.result_type(weight, x2d), device=x2d.device)
    rstd = torch.empty(N, dtype=torch.float32, device=x2d.device)
    if N and D:
        block, one = _block(D)
        with _launching():
            _forward_kernel[(N,)](x2d, weight, out, rstd, D, float(eps), BLOCK_D=block, ONE_BLOCK=one,
                                  num_warps=_num_warps(block, 16))
    return out, rstd


def backward(grad_out: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             need_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grad_x in x's dtype, and the weight gradient (summed in fp32) in weight's dtype or None."""
    _check_device(grad_out, x2d, weight, rstd)
    _check_shapes(x2d, weight)
    N, D = x2d.shape
    grad_out, weight = grad_out.contiguous(), weight.contiguous()
    grad_x = torch.empty_like(x2d)
    if not (N and D):
        return grad_x, torch.zeros_like(weight) if need_weight_grad else None
    block, one = _block(D)
    programs = _num_programs(N, D, x2d.device)
    partial = None
    if need_weight_grad:  # every program has a row (programs <= N); the multi-block kernel adds in place
        partial = (torch.empty if one else torch.zeros)(programs, D, dtype=torch.float32, device=x2d.device)
    with _launching():
        _backward_kernel[(programs,)](grad_out, x2d, weight, rstd, grad_x, partial if need_weight_grad else grad_x,
                                      N, D, NEED_DW=need_weight_grad, BLOCK_D=block, ONE_BLOCK=one,
                                      num_warps=_num_warps(block, 8))
    return grad_x, partial.sum(0).to(weight.dtype) if need_weight_grad else None


class RMSNormFunction(torch.autograd.Function):
    """`_rms_norm_ref(x, weight, eps)` for x of shape [..., D]; saves x, the weight and the 1/rms."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x2d = x.reshape(-1, x.shape[-1])
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        out, rstd = forward(x2d, weight, eps)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.x_shape = x.shape
        return out.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x2d, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = backward(grad.reshape(x2d.shape), x2d, weight, rstd, ctx.needs_input_grad[1])
        return grad_x.view(ctx.x_shape) if ctx.needs_input_grad[0] else None, grad_w, None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these kernels take (x, weight): same CUDA device (CPU under the interpreter), float
    dtypes they handle, a 1-D weight of x's last size, and a row no wider than MAX_D."""
    on_device = x.device == weight.device and (x.device.type == "cuda" or (INTERPRET and x.device.type == "cpu"))
    return (on_device and x.dtype in _DTYPES and weight.dtype in _DTYPES and x.dim() >= 1
            and weight.dim() == 1 and 0 < x.shape[-1] <= MAX_D and weight.shape[0] == x.shape[-1])
