"""`linear(x, weight)`: `F.linear` whose weight gradient may run beside the backward pass.

Inside `weight_grads_beside` (the trainer of a small one-process model, kernels/threads.py) the weight
gradient's GEMM goes to the helper thread while the backward pass goes on with the input gradient;
anywhere else this is `F.linear`. The bits are the same either way (tested): the forward and the input
gradient are `F.linear`'s own GEMMs, and the weight gradient is the product autograd computes.
Pass only a weight that nothing else in the step differentiates (not a tied embedding): its gradient
reaches `.grad` outside autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from moetron.kernels.weight_grads import defer_weight_grad, weight_grads_active


_PLAIN = (torch.Tensor, nn.Parameter)  # tensor subclasses (DTensor, FP8) keep F.linear's own dispatch


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_2d.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1] and not defer_weight_grad(weight, lambda: grad_2d.t().mm(x_2d)):
            grad_w = grad_2d.t().mm(x_2d)
        return grad_x, grad_w


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias); see the module docstring."""
    if (weight_grads_active() and type(weight) in _PLAIN and weight.is_leaf and weight.requires_grad  # no DTensor
            and torch.is_grad_enabled()
            and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")):  # autocast: F.linear's casts
        return _Linear.apply(x, weight)
    return F.linear(x, weight)


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, a plain bias-free `nn.Linear` through `linear` (FP8 and tensor-parallel layers,
    biases and hooks keep their own forward)."""
    if type(layer) is nn.Linear and layer.bias is None and not (layer._forward_hooks or layer._forward_pre_hooks):
        return linear(x, layer.weight)
    return layer(x)
