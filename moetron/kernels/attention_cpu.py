"""Causal attention as one C++ pass each way (fp32 CPU, head dims that are multiples of 8 up to 128).

torch's CPU flash kernel calls a GEMM per block of 32 queries and makes a softmax pass over a scores
buffer. At a small model's shapes (default recipe: head dim 16, 128 positions) those calls cost more
than the arithmetic; `moetron/csrc/causal_attention_cpu.cpp` runs stripes of 24 queries through one
register-tiled micro-GEMM: 0.4-0.7x torch's time up to positions x head dim = 2^17 floats. Each
stripe reads all of its kv head's keys, so past that (keys beyond L2) torch's key-blocked kernel
catches up, and those shapes keep SDPA (docs/performance.md). GQA is native (each kv head's query
heads in turn, no repeated k/v), and v's head dim may differ from q's and k's (MLA: DeepSeek-V3's
attention, which SDPA's CPU flash kernel does not take; its fallback is a batched matmul and a masked
softmax, several times slower). Each (sequence, kv head) is a task of its own, on torch's intra-op
threads or, for a small model with a helper (kernels/threads.py), taken one by one by the caller and
a helper task, so a helper that another process keeps off its core costs nothing; any split gives the
bits of one thread.
Sums run in another order than torch's kernel: within a few ulp of it (tests/test_causal_attention.py).
`ops.attention_core` routes here under `set_fusion("cpp")` (the trainer's CPU default).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moetron.kernels import cpp_build
from moetron.kernels.threads import helper_threads

HEAD_DIM_STEP, HEAD_DIM_MAX = 8, 128  # the kernel's register tile: 16 wide, 8 for the last columns
MAX_KEY_FLOATS = 2**17  # positions x head dim: a kv head's transposed keys within a 512 KiB L2


def ops():
    """`torch.ops.moetron_attention`, building the C++ library on first use (raises `CppBuildError`)."""
    return cpp_build.load_attention_ops()


def head_dim_runs(d: int) -> bool:
    """Whether the kernel runs head dim d (its register tile is 16 floats wide, 8 at the end)."""
    return 0 < d <= HEAD_DIM_MAX and d % HEAD_DIM_STEP == 0


def shape_runs(seq: int, d: int, dv: int) -> bool:
    """Whether the kernel runs `seq` positions with q/k head dim d and v head dim dv (the shapes of
    `applies`, for callers that have a config rather than tensors: the activation-memory formula)."""
    return head_dim_runs(d) and head_dim_runs(dv) and seq * max(d, dv) <= MAX_KEY_FLOATS


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q and k [B, h or h_kv, S, d], v [B, h_kv, S, dv] (as many keys as queries, h a multiple of h_kv),
    fp32 CPU outside autocast, d and dv multiples of HEAD_DIM_STEP up to HEAD_DIM_MAX, S * max(d, dv) <=
    MAX_KEY_FLOATS, each with a unit stride on its last dim."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and q.dim() == k.dim() == v.dim() == 4
            and q.shape[0] == k.shape[0] == v.shape[0] and q.shape[2] == k.shape[2] == v.shape[2]
            and q.shape[3] == k.shape[3] and shape_runs(q.shape[2], q.shape[3], v.shape[3])
            and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)


def _bshd(B: int, S: int, heads: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [B, heads, S, d] tensor laid out as [B, S, heads, d] (what o_proj reads without a copy)."""
    return like.new_empty(B, S, heads, d).transpose(1, 2)


class CausalAttention(torch.autograd.Function):
    """softmax(q k^T * scale + causal mask) v -> [B, h, S, dv]; saves q, k, v, the output and the
    log-sum-exp per row for the backward (which recomputes the probabilities)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        B, H, S, _ = q.shape
        out, lse = _bshd(B, S, H, v.shape[3], q), q.new_empty(B, H, S)
        ops().causal_forward(q, k, v, scale, out, lse, helper_threads())
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        B, H, S, D = q.shape
        dq, dk, dv = _bshd(B, S, H, D, q), _bshd(B, S, k.shape[1], D, k), _bshd(B, S, k.shape[1], v.shape[3], v)
        ops().causal_backward(grad, q, k, v, out, lse, ctx.scale, dq, dk, dv, helper_threads())
        return dq, dk, dv, None
