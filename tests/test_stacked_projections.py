"""`project_many` (moetron/ops/linear.py): several projections of one input as one autograd node.

Against one `project` per layer: the outputs and weight gradients are the same bits (each is F.linear's
own GEMM), the input gradient agrees to a few ulp (added up in place instead of by autograd); the same
bits with the weight gradients on the helper or not, over accumulating passes; and every layer it cannot
stack keeps its own forward."""

import pytest
import torch
from torch import nn

from moetron.kernels.weight_grads import weight_grads_beside
from moetron.ops.linear import _ConcatLinear, project, project_many

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _layers(hidden, outs, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(hidden, o, bias=False) for o in outs]


def _run(layers, x0, grads, fn, passes=1, beside=False):
    x = x0.clone().requires_grad_()
    for layer in layers:
        layer.weight.grad = None
    for _ in range(passes):
        with weight_grads_beside(beside):
            torch.autograd.backward(fn(layers, x), grads)
    return x.grad, [layer.weight.grad.clone() for layer in layers], fn(layers, x)


def _separate(layers, x):
    return tuple(project(layer, x) for layer in layers)


def _close(a, b, what):
    scale = b.abs().max()
    assert scale > 1e-3, f"{what}: compared on near-zero values"
    assert (a - b).abs().max() <= 1e-5 * scale, f"{what}: {(a - b).abs().max()} vs scale {scale}"


@pytest.mark.parametrize("hidden,outs", [(64, [64, 32, 32]), (48, [20, 7]), (96, [256, 256])])
def test_stacked_matches_one_projection_each(hidden, outs):
    layers = _layers(hidden, outs)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 33, hidden, generator=g)
    grads = [torch.randn(4, 33, o, generator=g) for o in outs]
    gx, gw, ys = _run(layers, x0, grads, project_many)
    rx, rw, rs = _run(layers, x0, grads, _separate)
    assert isinstance(ys[0].grad_fn, _ConcatLinear._backward_cls)
    for y, r in zip(ys, rs):
        assert y.shape == r.shape and y.is_contiguous()
        assert torch.equal(y, r)  # each output is F.linear's own GEMM
    _close(gx, rx, "input gradient")
    for a, b in zip(gw, rw):
        assert torch.equal(a, b) and a.abs().max() > 0.1


@pytest.mark.parametrize("passes", [1, 2])
def test_weight_gradients_beside_are_the_same_bits(passes):
    """On the helper thread (one GEMM for all weights, split by rows) as in the backward pass; two
    passes add to .grad that the stacked weights' earlier gradients share a buffer with."""
    layers = _layers(64, [64, 32, 32], seed=3)
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(2, 16, 64, generator=g)
    grads = [torch.randn(2, 16, o, generator=g) for o in (64, 32, 32)]
    on = _run(layers, x0, grads, project_many, passes, beside=True)
    off = _run(layers, x0, grads, project_many, passes, beside=False)
    assert torch.equal(on[0], off[0])
    for a, b in zip(on[1], off[1]):
        assert torch.equal(a, b) and a.abs().max() > 0.1


def test_a_frozen_weight_gets_no_gradient():
    layers = _layers(32, [16, 8])
    layers[1].weight.requires_grad_(False)  # mixed: not stacked, each its own projection
    x = torch.randn(3, 32, requires_grad=True)
    a, b = project_many(layers, x)
    (a.sum() + b.sum()).backward()
    assert layers[0].weight.grad is not None and layers[1].weight.grad is None
    for layer in layers:
        layer.weight.requires_grad_(False)  # all frozen: stacked, only the input gradient
    a, b = project_many(layers, x)
    assert isinstance(a.grad_fn, _ConcatLinear._backward_cls)
    x.grad = None
    (a.sum() + b.sum()).backward()
    assert x.grad.abs().max() > 0 and all(layer.weight.grad is None for layer in layers[1:])


def test_layers_it_cannot_stack_keep_their_own_forward():
    x = torch.randn(5, 16)
    biased = [nn.Linear(16, 8), nn.Linear(16, 4, bias=False)]
    hooked = _layers(16, [8, 4])
    seen = []
    hooked[0].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    for layers in (biased, hooked):
        outs = project_many(layers, x)
        assert all(not isinstance(o.grad_fn, _ConcatLinear._backward_cls) for o in outs)
        assert seen == ([] if layers is biased else [(5, 8)])  # the hook ran, once
        assert all(torch.equal(o, layer(x)) for o, layer in zip(outs, layers))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts inside F.linear: one call each
        outs = project_many(_layers(16, [8, 4]), x)
        assert all(o.dtype == torch.bfloat16 for o in outs)


def test_the_attention_and_mlp_use_it():
    from moetron.model.attention import GroupedQueryAttention
    from moetron.ops.mlp import MLP
    from moetron.recipes import get_recipe

    cfg = get_recipe("qwen3-moe-tiny").model
    attn = GroupedQueryAttention(cfg)
    q, k, v = attn.project_qkv(torch.randn(2, 8, cfg.hidden_size))
    assert isinstance(q.grad_fn, _ConcatLinear._backward_cls)
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (64, 32, 32)
    mlp = MLP(cfg.hidden_size, cfg.intermediate_size, 0.02)
    y = mlp(torch.randn(2, 8, cfg.hidden_size, requires_grad=True))
    ops = set()
    stack = [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node.name() not in ops:
            ops.add(node.name())
            stack.extend(n for n, _ in node.next_functions)
    assert any("ConcatLinear" in name for name in ops), ops
