"""Causal SDPA of a small model on the CPU, its batch split in two halves that run side by side.

torch's CPU flash kernel computes every (sequence, head) on its own, so two halves of the batch give
the same bits as one call, forward and backward (tests/test_attention_split.py). A small model trains
on one intra-op thread (moetron/train/host.py); its attention is ~15 % of a default-recipe step and
enough work per call for a second thread: `kernels.threads.run_beside` runs one half on the helper.
Used by `ops.attention_core` where torch's SDPA would take the flash kernel anyway.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moetron.kernels.threads import helper_threads, run_beside

_ops = torch.ops.aten
_HAS_FLASH_BACKWARD = hasattr(_ops, "_scaled_dot_product_flash_attention_for_cpu_backward")  # once, not per call


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4's spelling
        return torch.is_autocast_cpu_enabled()


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """A wide-op helper is set and torch's SDPA would run its CPU flash kernel on these: fp32 outside CPU
    autocast (which would run SDPA in bf16), as many keys as queries (causal), one head dim for q, k and
    v, at least two sequences."""
    return (helper_threads() > 0 and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
            and not _cpu_autocast()
            and q.dim() == 4 and q.shape[0] >= 2 and q.shape[2] == k.shape[2] == v.shape[2]
            and q.shape[3] == k.shape[3] == v.shape[3] and q.shape[1] % k.shape[1] == 0
            and _HAS_FLASH_BACKWARD)


class SplitCausalAttention(torch.autograd.Function):
    """q [B, h, S, d], k and v [B, h_kv, S, d] -> [B, h, S, d]: torch's CPU flash kernel on each half of
    the batch, the halves side by side; saves each half's output and log-sum-exp for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        halves = (slice(0, q.shape[0] // 2), slice(q.shape[0] // 2, None))

        def half(s):
            return lambda: _ops._scaled_dot_product_flash_attention_for_cpu(q[s], k[s], v[s], 0.0, True, scale=scale)

        (out1, lse1), (out2, lse2) = run_beside(half(halves[0]), half(halves[1]))
        ctx.scale, ctx.halves = scale, halves
        ctx.save_for_backward(q, k, v, out1, lse1, out2, lse2)
        # the halves' [b, S, h, d] memory, as one call lays its output out (o_proj reads it without a copy)
        return torch.cat([out1.transpose(1, 2), out2.transpose(1, 2)]).transpose(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out1, lse1, out2, lse2 = ctx.saved_tensors

        def half(s, out, lse):
            return lambda: _ops._scaled_dot_product_flash_attention_for_cpu_backward(
                grad[s], q[s], k[s], v[s], out, lse, 0.0, True, scale=ctx.scale)

        first, second = run_beside(half(ctx.halves[0], out1, lse1), half(ctx.halves[1], out2, lse2))
        return (*(torch.cat(pair) for pair in zip(first, second)), None)
