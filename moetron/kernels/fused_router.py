"""The softmax top-k router's selection as one C++ pass each way, for fp32 CPU logits.

`moetron.moe.router.TopKRouter` takes it under `set_fusion("cpp")` (the trainer's `train.fusion=auto`
on a CPU) for the routers it covers: softmax scores before the top-k, no expert bias or groups, no
capacity, the Switch balancing loss or none, no z-loss (`applies`). What it replaces is ~25 small
eager ops forward and ~15 backward per MoE layer: softmax (twice: scores and balancing
probabilities), top-k, gather, normalisation, two expert counts and the Switch loss.
The probabilities are ATen's softmax, so the experts chosen are the eager router's (ties go to the
lower expert id); weights and gradients agree with the eager router within a few ulp (sums in
another order; moetron/csrc/router_cpu.cpp, bounds in tests/test_fused_router.py).

DeepSeek-V3's sigmoid router (`TopKSigmoid`: an expert bias that only chooses, group-limited selection,
normalised and scaled weights) takes the same route from ATen's sigmoid on: its expert bias, group
scores, top-k, gather, normalisation, scaling and counts, ~12 ops forward and ~8 backward, in one pass
each way; the balancing losses, capacity drops and the sigmoid's own backward stay torch's.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moetron.kernels import cpp_build


def ops():
    """`torch.ops.moetron_router`, building the C++ library on first use (raises `CppBuildError`)."""
    return cpp_build.load_router_ops()


def forward(logits: torch.Tensor, k: int, normalize: bool, scale: float):
    """logits [T, E] -> (probs [T, E], idx [T, k] int64, weights [T, k], counts [E] int64, prob_sums [E])."""
    return ops().topk_softmax_forward(logits, k, normalize, scale)


def backward(grad_weights, probs, idx, normalize: bool, scale: float, aux):
    """d logits [T, E] from d weights [T, k] and, when given, the balancing loss's d probs [E]."""
    return ops().topk_softmax_backward(grad_weights, probs, idx, normalize, scale, aux)


class TopKSoftmax(torch.autograd.Function):
    """logits [T, E] fp32 -> (weights [T, k], topk_idx [T, k], counts [E] int64, prob_sums [E]).

    `aux_grad(counts) -> [E]` (or None): the balancing loss's gradient w.r.t. each token's
    probabilities, asked for in backward (it reads the aux-loss scale then, as `inject_aux_loss` does).
    `kernels`: the module whose `forward` and `backward` run it: this one (C++), or
    moetron.kernels.triton_router. Only `weights` is differentiable.
    """

    @staticmethod
    def forward(ctx, logits, k: int, normalize: bool, scale: float, aux_grad, kernels):
        probs, idx, weights, counts, prob_sums = kernels.forward(logits, k, normalize, scale)
        ctx.save_for_backward(probs, idx, counts)
        ctx.normalize, ctx.scale, ctx.aux_grad, ctx.kernels = normalize, scale, aux_grad, kernels
        ctx.mark_non_differentiable(idx, counts, prob_sums)
        return weights, idx, counts, prob_sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_weights, *unused):
        probs, idx, counts = ctx.saved_tensors
        if grad_weights is None:
            grad_weights = probs.new_zeros(idx.shape)
        aux = None if ctx.aux_grad is None else ctx.aux_grad(counts)
        grad = ctx.kernels.backward(grad_weights, probs, idx, ctx.normalize, ctx.scale, aux)
        return grad, None, None, None, None, None


def sigmoid_forward(scores: torch.Tensor, bias, k: int, groups: int, topk_groups: int, normalize: bool,
                    scale: float):
    """scores [T, E] -> (weights [T, k], idx [T, k] int64, counts [E] int64): the sigmoid router's selection."""
    return ops().topk_sigmoid_forward(scores, bias, k, groups, topk_groups, normalize, scale)


def sigmoid_backward(grad_weights, scores, idx, normalize: bool, scale: float):
    """d scores [T, E] (zero off the chosen experts) from d weights [T, k]."""
    return ops().topk_sigmoid_backward(grad_weights, scores, idx, normalize, scale)


class TopKSigmoid(torch.autograd.Function):
    """scores [T, E] fp32 (torch.sigmoid of the logits) -> (weights [T, k], topk_idx [T, k], counts [E] int64).

    `bias` [E] (or None) only chooses; `groups` > 1: each token keeps its `topk_groups` best groups of
    E / groups experts (scored by their two largest biased scores) before the top-k. Only `weights` is
    differentiable; its backward hands torch's sigmoid backward d scores (zero off the chosen experts).
    `kernels`: the module whose `sigmoid_forward` and `sigmoid_backward` run it: this one (C++), or
    moetron.kernels.triton_router.
    """

    @staticmethod
    def forward(ctx, scores, bias, k: int, groups: int, topk_groups: int, normalize: bool, scale: float, kernels):
        weights, idx, counts = kernels.sigmoid_forward(scores, bias, k, groups, topk_groups, normalize, scale)
        ctx.save_for_backward(scores, idx)
        ctx.normalize, ctx.scale, ctx.kernels = normalize, scale, kernels
        ctx.mark_non_differentiable(idx, counts)
        return weights, idx, counts

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_weights, *unused):
        scores, idx = ctx.saved_tensors
        if grad_weights is None:
            return (None,) * 8
        grad = ctx.kernels.sigmoid_backward(grad_weights, scores, idx, ctx.normalize, ctx.scale)
        return grad, None, None, None, None, None, None, None


def applies(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these logits (contiguous fp32 [T, E] on a CPU)."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous())
