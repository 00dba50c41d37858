"""The eager sigmoid router's selection in plain torch ops (TopKRouter's eager path), for kernel tests on
any device; no Triton import here, so a GPU test importing it gets the compiled kernels."""

import torch


def sigmoid_selection(scores, bias, K, groups, topk_groups, normalize, scale, grad_w):
    """(idx, weights, counts, d scores) of the eager selection from `scores`, d scores through autograd."""
    s = scores.clone().requires_grad_()
    choice = s.detach() + (bias if bias is not None else 0.0)
    T, E = choice.shape
    if groups > 1:
        grouped = choice.view(T, groups, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best = group_score.topk(topk_groups, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, -1)
    idx = torch.topk(choice, K, dim=-1).indices
    w = s.gather(1, idx)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * scale
    (w * grad_w).sum().backward()
    return idx, w.detach(), torch.bincount(idx.reshape(-1), minlength=E), s.grad
