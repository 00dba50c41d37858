"""Summed token cross-entropy of fp32 CPU logits as one C++ pass each way.

torch's `F.cross_entropy` is log_softmax then nll_loss: it writes a [tokens, vocab] log-probability
tensor, saves it, and reads it again each way, ~1 ms of a default-recipe step on one thread.
`moetron/csrc/cross_entropy_cpu.cpp` reads the logits twice each way and saves only them and the
labels (the same bytes as torch's saved log-probabilities). Within a few ulp of torch
(tests/test_cross_entropy_cpp.py). `ops.cross_entropy` routes here under `set_fusion("cpp")`.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moetron.kernels import cpp_build


def ops():
    """`torch.ops.moetron_loss`, building the C++ library on first use (raises `CppBuildError`)."""
    return cpp_build.load_loss_ops()


def applies(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """fp32 CPU logits [..., V] with int64 labels [...] of as many tokens, outside CPU autocast."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and labels.dtype == torch.int64
            and labels.device.type == "cpu" and logits.dim() >= 1 and logits.shape[-1] > 0
            and labels.numel() * logits.shape[-1] == logits.numel() and not torch.is_autocast_enabled("cpu"))


class CrossEntropyFunction(torch.autograd.Function):
    """logits [N, V] (contiguous), labels [N] -> the summed loss over rows whose label is not
    `ignore_index` (a 0-dim fp32 tensor); saves the logits and labels."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(logits, labels)
        return ops().cross_entropy_forward(logits, labels, ignore_index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        logits, labels = ctx.saved_tensors
        return ops().cross_entropy_backward(grad, logits, labels, ctx.ignore_index), None, None
