"""Triton kernels of the fused weighted SwiGLU (impl "triton" of moetron.kernels.fused_swiglu).

* forward   one program per (row, block of F): `silu(g) * u * w[row]`, in fp32 (fp64 for fp64).
* backward  one program per row: `d_gate_up [N, 2F]` in one pass, and `d_w[row] = sum_f dout * act`.

On CPU tensors this module runs only under the interpreter: set `TRITON_INTERPRET=1` before it is
imported (tests do).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetron.kernels import availability

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: triton.jit decides at decoration
_MAX_BLOCK_F = 1024


@triton.jit
def _forward_kernel(gu_ptr, w_ptr, out_ptr, F, HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK_F: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = offs < F
    g = tl.load(gu_ptr + n * 2 * F + offs, mask=m, other=0).to(ACC)
    u = tl.load(gu_ptr + n * 2 * F + F + offs, mask=m, other=0).to(ACC)
    y = g / (1.0 + tl.exp(-g)) * u
    if HAS_W:
        y = y * tl.load(w_ptr + n).to(ACC)
    tl.store(out_ptr + n * F + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _backward_kernel(grad_ptr, gu_ptr, w_ptr, d_ptr, dw_ptr, F, HAS_W: tl.constexpr, NEED_DW: tl.constexpr,
                     ACC: tl.constexpr, BLOCK_F: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    w = 1.0
    if HAS_W:
        w = tl.load(w_ptr + n).to(ACC)
    dot = tl.zeros([BLOCK_F], dtype=ACC)
    for f0 in range(0, F, BLOCK_F):
        offs = f0 + tl.arange(0, BLOCK_F)
        m = offs < F
        g = tl.load(gu_ptr + n * 2 * F + offs, mask=m, other=0).to(ACC)
        u = tl.load(gu_ptr + n * 2 * F + F + offs, mask=m, other=0).to(ACC)
        go = tl.load(grad_ptr + n * F + offs, mask=m, other=0).to(ACC)
        s = 1.0 / (1.0 + tl.exp(-g))
        silu = g * s
        da = go * w
        dg = da * u * (s * (1.0 + g * (1.0 - s)))
        tl.store(d_ptr + n * 2 * F + offs, dg.to(d_ptr.dtype.element_ty), mask=m)
        tl.store(d_ptr + n * 2 * F + F + offs, (da * silu).to(d_ptr.dtype.element_ty), mask=m)
        if NEED_DW:
            dot += go * (silu * u)
    if NEED_DW:
        tl.store(dw_ptr + n, tl.sum(dot, axis=0).to(dw_ptr.dtype.element_ty))


def _check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t is not None and t.device.type != "cuda" and not INTERPRET:
            raise RuntimeError("the Triton SwiGLU kernels run CUDA tensors; for CPU tensors set "
                               "TRITON_INTERPRET=1 before moetron.kernels.triton_swiglu is imported")


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block(F: int) -> int:
    return max(16, min(_MAX_BLOCK_F, triton.next_power_of_2(max(F, 1))))


def _launching():
    return availability.interpreted_launch(INTERPRET)


def forward(gate_up: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    _check_device(gate_up, probs)
    N, F = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(N, F, dtype=gate_up.dtype, device=gate_up.device)
    if N and F:
        block = _block(F)
        with _launching():
            _forward_kernel[(N, triton.cdiv(F, block))](gate_up, probs if probs is not None else gate_up, out, F,
                                                        HAS_W=probs is not None, ACC=_acc(gate_up.dtype),
                                                        BLOCK_F=block)
    return out


def backward(grad: torch.Tensor, gate_up: torch.Tensor, probs: torch.Tensor | None, need_probs_grad: bool):
    _check_device(grad, gate_up, probs)
    N, F = gate_up.shape[0], gate_up.shape[1] // 2
    d_gate_up = torch.empty_like(gate_up)
    d_probs = torch.empty(N, dtype=torch.float32, device=gate_up.device) if need_probs_grad else None
    if N and F:
        with _launching():
            _backward_kernel[(N,)](grad, gate_up, probs if probs is not None else gate_up, d_gate_up,
                                   d_probs if need_probs_grad else gate_up, F, HAS_W=probs is not None,
                                   NEED_DW=need_probs_grad, ACC=_acc(gate_up.dtype), BLOCK_F=_block(F))
    return d_gate_up, d_probs
