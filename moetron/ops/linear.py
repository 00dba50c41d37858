"""`linear(x, weight)`: `F.linear` whose weight gradient may run beside the backward pass;
`project_many`: several projections of one input as one autograd node.

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

from moetron.kernels.weight_grads import defer_weight_grad, defer_weight_grads, weight_grads_active


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


class _ConcatLinear(torch.autograd.Function):
    """F.linear(x, w_i) for each w_i as one autograd node: one GEMM per weight each way, with no copies;
    the input gradient adds the products in place (addmm), the weight gradients are F.linear's own."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        x_2d = x.reshape(-1, x.shape[-1])
        grads_2d = [g.reshape(-1, g.shape[-1]) for g in grads]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grads_2d[0].mm(weights[0])
            for g, w in zip(grads_2d[1:], weights[1:]):
                grad_x.addmm_(g, w)
            grad_x = grad_x.view(x.shape)
        grad_ws = [None] * len(weights)  # `_stackable` takes weights that all need a gradient, or none
        if ctx.needs_input_grad[1] and not defer_weight_grads(weights, lambda: [g.t().mm(x_2d) for g in grads_2d]):
            grad_ws = [g.t().mm(x_2d) for g in grads_2d]
        return (grad_x, *grad_ws)


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
    if _plain(layer):
        return linear(x, layer.weight)
    return layer(x)


def _plain(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear and layer.bias is None and not (layer._forward_hooks or layer._forward_pre_hooks)


def project_many(layers: list[nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`project(layer, x)` for each layer. On a CPU, plain bias-free layers with plain weights of one
    dtype run as one autograd node (q/k/v: a third of the nodes; each output and weight gradient is
    F.linear's own GEMM, the input gradient adds the products in place: ulp-level differences from
    autograd's sum, no others, tested); otherwise one `project` each. They ran as one GEMM on the
    stacked weights until 2026-11-28: its copies (the weights' cat each way, the outputs' split, the
    gradients' cat: ~7 ms a mid-size step) bought nothing on an AVX-512 CPU (docs/performance.md)."""
    weights = _stackable(layers, x)
    if weights is not None:
        return _ConcatLinear.apply(x, *weights)
    return tuple(project(layer, x) for layer in layers)


def _stackable(layers: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor] | None:
    """The weights `project_many` stacks: plain layers' plain weights of x's dtype, on a CPU."""
    weights = [layer.weight for layer in layers if _plain(layer)]
    if (len(weights) == len(layers) > 1 and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
            and all(type(w) in _PLAIN and w.device == x.device and w.dtype == x.dtype for w in weights)
            and len({w.requires_grad for w in weights}) == 1):
        return weights
    return None
