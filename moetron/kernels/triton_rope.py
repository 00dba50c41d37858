"""RoPE (halves layout, or DeepSeek's interleaved pairs) as one Triton kernel each way, for bf16/fp16/fp32 CUDA
tensors.

`ops.apply_rope` takes it under `set_fusion("triton")` (`train.fusion=auto` on a GPU) where the
eager `_RopeFunction` ran ~5 launches forward and ~5 back for every q and k (about 2.5 ms of the H100
proxy's device time a step, with its host behind). Each product and the sum are rounded to the
tensor's dtype as torch's ops round them, so bf16 and fp16 give the reference's bits (a bf16 or fp16
product is exact in fp32); in fp32 a GPU may fuse the multiply-add (within 1 ulp).

x is [B, H, S, D] with any strides (Qwen3's q/k come as a transposed view of [B, S, H, D]); the output
and the gradient keep x's strides, so the gradient reaches the norm before it without a copy.
`interleaved` (DeepSeek-V3's MLA): the pairs (x[2i], x[2i+1]) rotate, written in halves layout, as
`functional._rope_ref`'s interleaved branch, bit for bit; x may then be a strided slice (MLA's rotary
part of q, or of kv_a's output), and a slice's output and gradient are laid out [B, H, S, D].
cos/sin are [B or 1, S, D] (each frequency twice), without grad. On CPU tensors this module runs only
under the interpreter: set `TRITON_INTERPRET=1` before it is imported (tests do).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from moetron.kernels import availability
from moetron.kernels.triton_rmsnorm import _round

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: triton.jit decides at decoration
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_ELEMENTS = 2048  # heads x head dim a program holds


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, S, H, D, sb, sh, ss, sd, ob, oh, o_s, od, cb, cs, cd,
                 BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Forward: out = x*cos + rotate_half(x)*sin. Backward (x is the gradient): out = g*cos + the
    transpose of rotate_half applied to g*sin. Each product and the sum rounded to the dtype.
    INTERLEAVED: halves-layout element d of the rotated row is the pair element at src(d) = 2d (first
    half) or 2(d - D/2) + 1 of the input row: the forward reads there, the backward writes there."""
    bs = tl.program_id(0).to(tl.int64)
    b, s = bs // S, bs % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = D // 2
    first = d < half
    partner = tl.where(first, d + half, d - half)
    src, src_partner = d, partner
    if INTERLEAVED:
        src = tl.where(first, 2 * d, 2 * (d - half) + 1)
        src_partner = tl.where(first, 2 * d + 1, 2 * (d - half))
    TY: tl.constexpr = x_ptr.dtype.element_ty
    row = b * sb + s * ss + heads[:, None].to(tl.int64) * sh
    out_row = b * ob + s * o_s + heads[:, None].to(tl.int64) * oh
    m = (heads[:, None] < H) & (d[None, :] < D)
    if BACKWARD:  # the gradient comes in halves layout; the input's gradient goes to the pairs
        x = tl.load(x_ptr + row + d[None, :] * sd, mask=m, other=0).to(tl.float32)
        xp = tl.load(x_ptr + row + partner[None, :] * sd, mask=m, other=0).to(tl.float32)
        dest = src
    else:
        x = tl.load(x_ptr + row + src[None, :] * sd, mask=m, other=0).to(tl.float32)
        xp = tl.load(x_ptr + row + src_partner[None, :] * sd, mask=m, other=0).to(tl.float32)
        dest = d
    c_row = b * cb + s * cs
    c = tl.load(cos_ptr + c_row + d * cd, mask=d < D, other=0).to(tl.float32)
    if BACKWARD:  # the partner's own sine: rotate_half's transpose moves g*sin, then negates its first half
        sp = tl.load(sin_ptr + c_row + partner * cd, mask=d < D, other=0).to(tl.float32)
        sign = tl.where(first, 1.0, -1.0)
    else:
        sp = tl.load(sin_ptr + c_row + d * cd, mask=d < D, other=0).to(tl.float32)
        sign = tl.where(first, -1.0, 1.0)
    a = _round(x * c[None, :], TY).to(tl.float32)
    r = _round(xp * sp[None, :], TY).to(tl.float32) * sign[None, :]  # negation is exact
    tl.store(out_ptr + out_row + dest[None, :] * od, _round(a + r, TY), mask=m)


def applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> bool:
    """x [B, H, S, D] on CUDA (CPU under the interpreter) with an even D, cos/sin [B or 1, S, D] of x's
    dtype and device, one layout, without grad; x dense (a permuted view is fine) unless `interleaved`
    (any strides: its output is laid out anew)."""
    on_device = x.device.type == "cuda" or (INTERPRET and x.device.type == "cpu")
    if not (on_device and x.dim() == 4 and x.dtype in _DTYPES and x.shape[-1] % 2 == 0):
        return False
    B, _, S, D = x.shape
    return all(t.dim() == 3 and t.shape[0] in (1, B) and tuple(t.shape[1:]) == (S, D) and t.dtype == x.dtype
               and t.device == x.device and not t.requires_grad for t in (cos, sin)) \
        and cos.stride() == sin.stride() and (interleaved or _dense(x))


def _dense(x: torch.Tensor) -> bool:
    """No two elements share memory and none is skipped (a permuted contiguous tensor): `empty_like`
    then keeps x's strides (a size-1 dimension's stride is never used)."""
    expected = 1
    for d in sorted(range(x.dim()), key=x.stride):
        if x.shape[d] != 1 and x.stride(d) != expected:
            return False
        expected *= x.shape[d]
    return True


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
            interleaved: bool = False) -> torch.Tensor:
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton RoPE kernels run CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
                           "before moetron.kernels.triton_rope is imported")
    if not applies(x, cos, sin, interleaved):
        raise ValueError(f"RoPE (triton) takes x [B, H, S, D] (even D, dense) and cos/sin [B or 1, S, D] of its "
                         f"dtype and layout, without grad; got x {x.dtype} {tuple(x.shape)} strides {x.stride()}, cos "
                         f"{cos.dtype} {tuple(cos.shape)}, sin {sin.dtype} {tuple(sin.shape)}")
    B, H, S, D = x.shape
    out = torch.empty_like(x) if _dense(x) else torch.empty(x.shape, dtype=x.dtype, device=x.device)  # see _dense
    if out.numel():
        block_d = triton.next_power_of_2(D)
        block_h = min(triton.next_power_of_2(H), max(1, _BLOCK_ELEMENTS // block_d))
        cb = cos.stride(0) if cos.shape[0] > 1 else 0
        with availability.interpreted_launch(INTERPRET):
            _rope_kernel[(B * S, triton.cdiv(H, block_h))](
                x, cos, sin, out, S, H, D, *x.stride(), *out.stride(), cb, cos.stride(1), cos.stride(2),
                BACKWARD=backward, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out


class RopeFunction(torch.autograd.Function):
    """`_rope_ref(x, cos, sin, interleaved)` with cos/sin [B or 1, S, D] (no grad)."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _launch(x, cos, sin, backward=False, interleaved=interleaved)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad = grad if _dense(grad) else grad.contiguous()
        return _launch(grad, cos, sin, backward=True, interleaved=ctx.interleaved), None, None, None
