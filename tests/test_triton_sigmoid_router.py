"""DeepSeek-V3's sigmoid router as Triton kernels (`train.fusion=triton`, the GPU default through `auto`)
under TRITON_INTERPRET=1: against the eager router's ops in torch (autograd for the gradient) the same
experts (torch.topk's order) and counts with an expert bias and group limits, weights and d scores
within a few ulp; against the C++ kernel's contract; and TopKRouter taking it under `triton`."""

import pytest
import torch

from router_reference import sigmoid_selection as _eager
from triton_utils import interpreted_kernels
from moetron import ops
from moetron.moe import router as router_module

pytestmark = pytest.mark.usefixtures("one_thread")
k = interpreted_kernels("moetron.kernels.triton_router")  # the kernels, or a skip saying why

CASES = [  # E, K, groups, topk_groups, bias, normalize, scale
    (8, 2, 4, 2, True, True, 2.5),  # deepseek-v3-tiny's router
    (256, 8, 8, 4, True, True, 2.5),  # DeepSeek-V3's: 8 groups of 32, the best 4, top-8
    (16, 4, 1, 1, False, True, 1.0),
    (6, 3, 6, 4, True, False, 1.0),  # groups of one
    (12, 6, 4, 2, False, True, 1.5),  # every kept expert
    (20, 3, 5, 3, True, True, 1.0),  # neither E nor the groups a power of two
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}k{c[1]}g{c[2]}/{c[3]}")
def test_it_agrees_with_the_eager_selection_and_the_cpp_kernel(k, case):
    E, K, groups, topk_groups, has_bias, normalize, scale = case
    g = torch.Generator().manual_seed(E + K)
    T = 37
    scores = torch.sigmoid(torch.randn(T, E, generator=g) * 2)
    bias = 0.1 * torch.randn(E, generator=g) if has_bias else None
    grad_w = torch.randn(T, K, generator=g)
    idx_ref, w_ref, counts_ref, ds_ref = _eager(scores, bias, K, groups, topk_groups, normalize, scale, grad_w)
    w, idx, counts = k.sigmoid_forward(scores, bias, K, groups, topk_groups, normalize, scale)
    assert torch.equal(idx, idx_ref) and torch.equal(counts, counts_ref)
    torch.testing.assert_close(w, w_ref, rtol=5e-7, atol=0)
    ds = k.sigmoid_backward(grad_w, scores, idx, normalize, scale)
    assert ds_ref.abs().max() > 0.1
    torch.testing.assert_close(ds, ds_ref, rtol=1e-6, atol=1e-6 * ds_ref.abs().max().item())
    from moetron.kernels import fused_router  # the C++ kernel's contract: the same choice and counts

    w_cpp, idx_cpp, counts_cpp = fused_router.sigmoid_forward(scores, bias, K, groups, topk_groups, normalize, scale)
    assert torch.equal(idx, idx_cpp) and torch.equal(counts, counts_cpp)
    torch.testing.assert_close(w, w_cpp, rtol=5e-7, atol=0)


def test_ties_nan_and_bad_arguments(k):
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.1, float("nan"), 0.9, 0.3], [0.3, 0.2, 0.25, 0.24]])
    _, idx, counts = k.sigmoid_forward(scores, None, 2, 1, 1, False, 1.0)
    assert idx.tolist() == [[0, 1], [1, 2], [0, 2]] and counts.tolist() == [2, 2, 2, 0]
    _, idx, _ = k.sigmoid_forward(scores[2:], None, 2, 2, 1, True, 1.0)  # group {0, 1}: 0.5 > 0.49
    assert idx.tolist() == [[0, 1]]
    _, idx, _ = k.sigmoid_forward(scores[2:], torch.tensor([0.0, 0.0, 0.1, 0.0]), 2, 2, 1, True, 1.0)
    assert idx.tolist() == [[2, 3]]
    with pytest.raises(ValueError, match="3 groups of E=4 experts"):
        k.sigmoid_forward(scores, None, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="expert bias must be fp32"):
        k.sigmoid_forward(scores, torch.zeros(3), 2, 1, 1, True, 1.0)


def test_the_router_takes_it_under_triton(k, monkeypatch):
    """TopKRouter under `triton`: the Triton selection ran, with the eager run's experts, counts, weights and
    (within a few ulp) the gradients of the input and the router weight."""
    from test_fused_sigmoid_router import _router, _run  # the C++ sigmoid router's test's run

    monkeypatch.setattr(router_module, "_triton", [k])
    router = _router(8, 2, expert_bias=True, num_groups=4, topk_groups=2, norm_topk_prob=True, scaling_factor=2.5)
    g = torch.Generator().manual_seed(4)
    x, grad_w = torch.randn(40, 24, generator=g), torch.randn(40, 2, generator=g)
    try:
        ref, out = (_run(router, x, grad_w, mode) for mode in ("none", "triton"))
    finally:
        ops.set_fusion("none")
    assert out[5] and not ref[5]
    assert torch.equal(out[0].topk_idx, ref[0].topk_idx) and torch.equal(out[2], ref[2])
    torch.testing.assert_close(out[0].topk_weights, ref[0].topk_weights, rtol=5e-7, atol=0)
    for got, want in zip(out[3:5], ref[3:5]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())

