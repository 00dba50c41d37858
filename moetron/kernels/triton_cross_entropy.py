"""Summed token cross-entropy as one Triton kernel each way, for bf16/fp16/fp32 CUDA logits.

torch's path (`ops.functional._cross_entropy_ref`) casts the logits to fp32, keeps the [N, V]
log-probabilities, and in the backward writes their fp32 gradient, then the logits' (a cast): on the
H100 proxy's [8192, 32768] bf16 logits ~4 ms of device time a step and ~3 GB of temporaries.
Here the forward reads each row once (an online max and sum of exp in fp32) and keeps one
log-sum-exp a row; the backward writes `(softmax - onehot) * grad` once, rounded to the logits'
dtype, reading the loss's gradient from the device (no host sync). Rows labelled `ignore_index`
give loss 0 and gradient 0. A label outside [0, V) gives a NaN loss (the trainer stops on a
non-finite loss) where torch's kernel raises a device-side assert: checking on the host would
sync every step.

On CPU tensors this module runs only under the interpreter: set `TRITON_INTERPRET=1` before it is
imported (tests do).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from moetron.kernels import availability
from moetron.kernels.cross_entropy_cpu import CrossEntropyFunction
from moetron.kernels.triton_rmsnorm import _round

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: triton.jit decides at decoration
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK_V = 4096  # a row wider than this is walked in blocks


@triton.jit
def _forward_kernel(x_ptr, y_ptr, loss_ptr, lse_ptr, V, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V
    label = tl.load(y_ptr + row)
    # online log-sum-exp; a finite start keeps a block of -inf logits (a masked vocabulary) from NaN
    m = tl.max(tl.full([BLOCK_V], -1e38, tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = (label >= 0) & (label < V)
    picked = tl.load(x_row + tl.where(valid, label, 0)).to(tl.float32)
    loss = tl.where(valid, lse - picked, float("nan"))
    tl.store(loss_ptr + row, tl.where(label == ignore_index, 0.0, loss))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward_kernel(g_ptr, x_ptr, y_ptr, lse_ptr, dx_ptr, V, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, dx_row = x_ptr + row * V, dx_ptr + row * V
    DX_TY: tl.constexpr = dx_ptr.dtype.element_ty
    label = tl.load(y_ptr + row)
    g = tl.load(g_ptr).to(tl.float32)
    g = tl.where(label == ignore_index, 0.0, g)
    lse = tl.load(lse_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        x = tl.load(x_row + offs, mask=m, other=0).to(tl.float32)
        dx = (tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)) * g
        tl.store(dx_row + offs, _round(dx, DX_TY), mask=m)


def applies(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """CUDA logits [..., V] (CPU under the interpreter) in a dtype the kernels handle, and int64 labels
    of the same leading shape and device."""
    on_device = logits.device.type == "cuda" or (INTERPRET and logits.device.type == "cpu")
    return (on_device and logits.dtype in _DTYPES and logits.dim() >= 1 and logits.shape[-1] > 0
            and labels.dtype == torch.int64 and labels.device == logits.device
            and labels.shape == logits.shape[:-1])


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton cross-entropy kernels run CUDA tensors; for CPU tensors set "
                           "TRITON_INTERPRET=1 before moetron.kernels.triton_cross_entropy is imported")
    if logits.dim() != 2 or not logits.is_contiguous() or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be a contiguous bf16/fp16/fp32 [N, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if labels.shape != logits.shape[:1] or labels.dtype != torch.int64 or not labels.is_contiguous():
        raise ValueError(f"labels must be a contiguous int64 [N={logits.shape[0]}] tensor, got {labels.dtype} "
                         f"{tuple(labels.shape)}")


def _block(V: int) -> tuple[int, int]:
    block = max(16, min(_MAX_BLOCK_V, triton.next_power_of_2(V)))
    return block, min(16, max(4, block // 256))  # ~8 fp32 values a thread


def forward(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 loss of every row of `logits [N, V]` (0 where ignored) and its log-sum-exp."""
    _check(logits, labels)
    N, V = logits.shape
    losses = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        block, warps = _block(V)
        with availability.interpreted_launch(INTERPRET):
            _forward_kernel[(N,)](logits, labels, losses, lse, V, ignore_index, BLOCK_V=block, num_warps=warps)
    return losses, lse


def backward(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
             ignore_index: int) -> torch.Tensor:
    """The logits' gradient for `grad`, the summed loss's (one value), in the logits' dtype."""
    _check(logits, labels)
    if grad.numel() != 1 or lse.shape != labels.shape:
        raise ValueError(f"grad must hold one value and lse be [N={logits.shape[0]}], got {tuple(grad.shape)} "
                         f"and {tuple(lse.shape)}")
    N, V = logits.shape
    dx = torch.empty_like(logits)
    if N:
        block, warps = _block(V)
        g = grad.reshape(1).to(device=logits.device)
        with availability.interpreted_launch(INTERPRET):
            _backward_kernel[(N,)](g, logits, labels, lse, dx, V, ignore_index, BLOCK_V=block, num_warps=warps)
    return dx


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The summed loss through these kernels (autograd: the backward kernel), with the C++ path's Function."""
    return CrossEntropyFunction.apply(logits, labels, ignore_index, sys.modules[__name__])
