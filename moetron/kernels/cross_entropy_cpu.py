"""Summed token cross-entropy as one C++ pass each way (fp32 CPU logits).

torch's `cross_entropy` is `log_softmax` then `nll_loss`: it keeps the [N, V] log-probabilities for
the backward, which writes their gradient and then the logits'. `moetron/csrc/cross_entropy_cpu.cpp`
keeps one log-sum-exp a row and writes the logits' gradient, `softmax - onehot`, in one pass
(the default recipe's [1024, 256] logits: ~1.8 ms a step on one thread through torch). Its exp is
within 2 ulp of expf: the loss and gradient agree with torch's within a few ulp
(tests/test_cross_entropy_cpu.py). `ops.cross_entropy` routes here under `set_fusion("cpp")` (the
trainer's CPU default).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moetron.kernels import cpp_build


def ops():
    """`torch.ops.moetron_ce`, building the C++ library on first use (raises `CppBuildError`)."""
    return cpp_build.load_cross_entropy_ops()


def applies(logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """fp32 CPU logits [..., V] outside autocast, int64 labels of the same leading shape."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() >= 1
            and not torch.is_autocast_enabled("cpu") and labels.dtype == torch.int64
            and labels.device.type == "cpu" and labels.shape == logits.shape[:-1])


class CrossEntropyFunction(torch.autograd.Function):
    """sum over the rows not labelled `ignore_index` of `logsumexp(logits[n]) - logits[n, labels[n]]`.

    `kernels` computes it: this module's `ops()` (C++) or moetron.kernels.triton_cross_entropy, each
    with `forward(x, y, ignore_index) -> (losses, lse)` and `backward(grad, x, y, lse, ignore_index)`."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, kernels) -> torch.Tensor:
        x, y = logits.reshape(-1, logits.shape[-1]).contiguous(), labels.reshape(-1).contiguous()
        losses, lse = kernels.forward(x, y, ignore_index)
        ctx.save_for_backward(x, y, lse)
        ctx.shape, ctx.ignore_index, ctx.kernels = logits.shape, ignore_index, kernels
        return losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, y, lse = ctx.saved_tensors
        dx = ctx.kernels.backward(grad, x, y, lse, ctx.ignore_index)
        return dx.view(ctx.shape), None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The summed loss through the C++ kernels (autograd: one C++ pass back)."""
    return CrossEntropyFunction.apply(logits, labels, ignore_index, ops())
