"""Triton kernels of the fused permute / unpermute (impl "triton").

Same contract and same bits as the deterministic torch reference in
`moetron.dispatch.permute_reference` (selected in `moetron.dispatch.permute`):

* `gather_rows`    one program per output row: copy a token's row, or zeros for padding.
* `reduce_slots`   one program per token: sum its k rows in slot order, in fp32 (fp64 for fp64),
                   times the gate weight, rounded once. No atomics, so it is deterministic.
* `unpermute_backward` one program per row: grad_y = g[t] * w[s] and grad_w[s] = dot(g[t], y[r])
                   in `DOT_LANES` lanes folded pairwise (a fixed order, unlike `tl.sum`).

Launches pass `enable_fp_fusion=False` so that `acc + a * b` is never contracted into an FMA.
fp32 -> bf16 rounding is done by hand (round to nearest even on the bits) because the Triton
interpreter truncates; the result is the same on the GPU. On CPU tensors this module runs only
under the interpreter: set `TRITON_INTERPRET=1` before it is imported.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetron.kernels import availability
from moetron.kernels.numerics import DOT_LANES, acc_dtype

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: triton.jit decides at decoration
_MAX_BLOCK_H = 1024
_NUM_WARPS = 4
_LOG2_LANES = DOT_LANES.bit_length() - 1
assert 1 << _LOG2_LANES == DOT_LANES


@triton.jit
def _store_rounded(ptrs, acc, mask, OUT_BF16: tl.constexpr):
    """Store fp32/fp64 `acc` rounded to the output dtype (bf16 outputs come as an int16 view)."""
    if OUT_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(acc != acc, 0x7FC0, rounded)  # NaN stays a quiet NaN, as in c10
        tl.store(ptrs, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, acc.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _gather_rows_kernel(x_ptr, slot_ptr, out_ptr, H, topk, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.load(slot_ptr + r)
    valid = s >= 0
    t = tl.where(valid, s, 0) // topk
    # a padding row loads nothing; one compare, because the interpreter mishandles `mask & scalar`
    h_valid = tl.where(valid, H, 0)
    cols = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + cols
        m = offs < H
        v = tl.load(x_ptr + t * H + offs, mask=offs < h_valid, other=0)
        tl.store(out_ptr + r * H + offs, v, mask=m)


@triton.jit
def _reduce_slots_kernel(y_ptr, row_ptr, w_ptr, out_ptr, H, topk, HAS_W: tl.constexpr, ACC: tl.constexpr,
                         OUT_BF16: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + cols
        m = offs < H
        acc = tl.zeros([BLOCK_H], dtype=ACC)
        for k in range(0, topk):
            r = tl.load(row_ptr + t * topk + k)
            valid = r >= 0
            v = tl.load(y_ptr + tl.where(valid, r, 0) * H + offs, mask=offs < tl.where(valid, H, 0),
                        other=0).to(ACC)
            if HAS_W:
                w = tl.load(w_ptr + t * topk + k).to(ACC)
                v = v * tl.where(valid, w, 0)
            acc = acc + v
        _store_rounded(out_ptr + t * H + offs, acc, m, OUT_BF16)


@triton.jit
def _unpermute_backward_kernel(g_ptr, y_ptr, slot_ptr, w_ptr, gy_ptr, gw_ptr, H, topk,
                               NEED_GY: tl.constexpr, NEED_GW: tl.constexpr, ACC: tl.constexpr,
                               OUT_BF16: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    s = tl.load(slot_ptr + r)
    valid = s >= 0
    s0 = tl.where(valid, s, 0)
    t = s0 // topk
    w = tl.load(w_ptr + s0, mask=valid, other=0).to(ACC)
    h_valid = tl.where(valid, H, 0)
    lanes = tl.zeros([LANES], dtype=ACC)
    cols = tl.arange(0, LANES)
    for h0 in range(0, H, LANES):
        offs = h0 + cols
        m = offs < H
        g = tl.load(g_ptr + t * H + offs, mask=offs < h_valid, other=0).to(ACC)
        if NEED_GY:
            _store_rounded(gy_ptr + r * H + offs, g * w, m, OUT_BF16)
        if NEED_GW:
            yv = tl.load(y_ptr + r * H + offs, mask=offs < h_valid, other=0).to(ACC)
            lanes = lanes + g * yv
    if NEED_GW:
        # fold: lane j += lane j + width/2, down to two lanes, then their (commutative) sum
        for _ in tl.static_range(LOG2_LANES - 1):
            lanes = tl.sum(tl.reshape(lanes, (2, lanes.shape[0] // 2)), axis=0)
        tl.store(gw_ptr + s0, tl.sum(lanes, axis=0), mask=valid)


def _launching():
    return availability.interpreted_launch(INTERPRET)


def _check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cuda" and not INTERPRET:
            raise RuntimeError("the Triton permute kernels run CUDA tensors; for CPU tensors set "
                               "TRITON_INTERPRET=1 before moetron.kernels.triton_permute is imported")


def _out_arg(out: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (out.view(torch.int16), True) if out.dtype == torch.bfloat16 else (out, False)


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if acc_dtype(dtype) == torch.float64 else tl.float32


def _block_h(H: int) -> int:
    return max(16, min(_MAX_BLOCK_H, triton.next_power_of_2(max(H, 1))))


def gather_rows(x_TH: torch.Tensor, slot_of_row: torch.Tensor, topk: int) -> torch.Tensor:
    _check_device(x_TH, slot_of_row)
    x_TH, slot_of_row = x_TH.contiguous(), slot_of_row.contiguous()
    R, H = slot_of_row.numel(), x_TH.shape[1]
    out = torch.empty(R, H, dtype=x_TH.dtype, device=x_TH.device)
    if R and H:
        with _launching():
            _gather_rows_kernel[(R,)](x_TH, slot_of_row, out, H, max(topk, 1), BLOCK_H=_block_h(H),
                                      num_warps=_NUM_WARPS)
    return out


def reduce_slots(y_RH: torch.Tensor, row_of_slot: torch.Tensor, weights_TK: torch.Tensor | None,
                 num_tokens: int, topk: int) -> torch.Tensor:
    _check_device(y_RH, row_of_slot)
    y_RH, row_of_slot = y_RH.contiguous(), row_of_slot.contiguous()
    H = y_RH.shape[1]
    out = torch.empty(num_tokens, H, dtype=y_RH.dtype, device=y_RH.device)
    if num_tokens and H:
        out_arg, out_bf16 = _out_arg(out)
        w = weights_TK.contiguous() if weights_TK is not None else row_of_slot  # unused when HAS_W=False
        with _launching():
            _reduce_slots_kernel[(num_tokens,)](y_RH, row_of_slot, w, out_arg, H, topk,
                                                HAS_W=weights_TK is not None, ACC=_tl_acc(y_RH.dtype),
                                                OUT_BF16=out_bf16, BLOCK_H=_block_h(H), num_warps=_NUM_WARPS,
                                                enable_fp_fusion=False)
    return out


def unpermute_backward(grad_TH: torch.Tensor, y_RH: torch.Tensor | None, slot_of_row: torch.Tensor,
                       weights_TK: torch.Tensor, topk: int, need_grad_y: bool, need_grad_w: bool):
    _check_device(grad_TH, slot_of_row, weights_TK)
    grad_TH, slot_of_row, weights_TK = grad_TH.contiguous(), slot_of_row.contiguous(), weights_TK.contiguous()
    R, H = slot_of_row.numel(), grad_TH.shape[1]
    grad_y = torch.empty(R, H, dtype=grad_TH.dtype, device=grad_TH.device) if need_grad_y else None
    grad_w_acc = (torch.zeros(weights_TK.numel(), dtype=acc_dtype(grad_TH.dtype), device=grad_TH.device)
                  if need_grad_w else None)
    if R and (need_grad_y or need_grad_w):
        gy_arg, out_bf16 = _out_arg(grad_y) if need_grad_y else (grad_TH, False)
        y_arg = y_RH.contiguous() if need_grad_w else grad_TH
        with _launching():
            _unpermute_backward_kernel[(R,)](grad_TH, y_arg, slot_of_row, weights_TK, gy_arg,
                                             grad_w_acc if need_grad_w else grad_TH, H, max(topk, 1),
                                             NEED_GY=need_grad_y, NEED_GW=need_grad_w, ACC=_tl_acc(grad_TH.dtype),
                                             OUT_BF16=out_bf16, LANES=DOT_LANES, LOG2_LANES=_LOG2_LANES,
                                             num_warps=_NUM_WARPS, enable_fp_fusion=False)
    grad_w = grad_w_acc.to(weights_TK.dtype).view(weights_TK.shape) if need_grad_w else None
    return grad_y, grad_w
