"""The C++ softmax top-k router (`train.fusion=cpp`, the CPU default through `auto`) against the eager
TopKRouter it replaces: the same experts and counts, weights, the Switch loss and the gradients of the
input and the router weight within a few ulp; routers it does not cover stay eager."""

import pytest
import torch

from moetron import MoEConfig, ops
from moetron.moe import balancing
from moetron.moe.router import TopKRouter

pytestmark = pytest.mark.usefixtures("one_thread", "cpp_kernels")  # conftest.py


@pytest.fixture
def aux_scale():
    yield balancing.set_aux_loss_scale
    balancing.set_aux_loss_scale(1.0)
    ops.set_fusion("none")


def _router(E, K, seed=0, **fields):
    torch.manual_seed(seed)
    cfg = MoEConfig(hidden_size=24, ffn_hidden_size=32, num_experts=E, top_k=K, init_std=0.3, **fields)
    return TopKRouter(cfg)


def _run(router, x, grad_w, mode, kernel="TopKSoftmax"):
    """Routing, loss values, the gradients of x and the router weight under fusion `mode`, and whether
    the fused `kernel` (its autograd Function's name) made the weights."""
    ops.set_fusion(mode)
    x = x.clone().requires_grad_()
    router.weight.grad = None
    routing, losses, counts = router(x)
    fused = type(routing.topk_weights.grad_fn).__name__.startswith(kernel)
    (routing.topk_weights * grad_w).sum().backward()
    return routing, losses, counts, x.grad, router.weight.grad.clone(), fused


@pytest.mark.parametrize("E,K,T,fields", [
    (8, 2, 50, dict(norm_topk_prob=True)),                     # qwen3-moe-tiny's router
    (16, 4, 300, dict(norm_topk_prob=False, scaling_factor=2.5)),  # several 64-row blocks
    (8, 1, 64, dict(norm_topk_prob=False)),  # (normalised, k=1 weights are 1: a gradient of pure rounding)
    (6, 6, 33, dict(norm_topk_prob=True)),                     # every expert
])
def test_fused_router_agrees_with_the_eager_one(E, K, T, fields, aux_scale):
    aux_scale(0.5)  # as under gradient accumulation: the Switch loss's gradient is scaled
    router = _router(E, K, aux_loss_type="aux_loss", aux_loss_coeff=0.05, **fields)
    g = torch.Generator().manual_seed(1)
    x, grad_w = torch.randn(T, 24, generator=g), torch.randn(T, K, generator=g)
    ref = _run(router, x, grad_w, "none")
    out = _run(router, x, grad_w, "cpp")
    assert out[5] and not ref[5]  # the C++ pass ran, and only under cpp
    r_ref, r_out = ref[0], out[0]
    assert torch.equal(r_out.topk_idx, r_ref.topk_idx)
    assert torch.equal(r_out.tokens_per_expert, r_ref.tokens_per_expert) and torch.equal(out[2], ref[2])
    assert r_out.dropless and r_out.topk_weights.dtype == torch.float32
    torch.testing.assert_close(r_out.topk_weights, r_ref.topk_weights, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(out[1].values["aux_loss"], ref[1].values["aux_loss"], rtol=2e-6, atol=0)
    for got, want in zip(out[3:5], ref[3:5]):  # d x, d router weight
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_without_balancing_the_gradient_is_the_weights_alone(aux_scale):
    router = _router(8, 2, aux_loss_type="aux_loss", aux_loss_coeff=0.05, norm_topk_prob=True)
    g = torch.Generator().manual_seed(2)
    x, grad_w = torch.randn(40, 24, generator=g), torch.randn(40, 2, generator=g)
    router.eval()  # no balancing loss out of training: no aux value, no aux gradient
    ref, out = _run(router, x, grad_w, "none"), _run(router, x, grad_w, "cpp")
    assert out[5] and out[1].values == {} == ref[1].values
    torch.testing.assert_close(out[3], ref[3], rtol=1e-5, atol=1e-6 * ref[3].abs().max().item())


@pytest.mark.parametrize("E", [1, 3, 8, 15])
def test_below_16_experts_the_kernel_computes_the_softmax_within_a_few_ulp(E):
    """ATen's CPU softmax leaves its vectorised path below 16 classes (~6x slower at [1024, 8]): the kernel
    computes those rows itself; from 16 on the probabilities are ATen's, bit for bit."""
    from moetron.kernels import fused_router

    g = torch.Generator().manual_seed(E)
    x = torch.randn(500, E, generator=g) * 4
    probs = fused_router.ops().topk_softmax_forward(x, 1, True, 1.0)[0]
    torch.testing.assert_close(probs, torch.softmax(x, -1), rtol=4 * 2**-23, atol=0)  # measured <= 2 * 2**-23
    exact = torch.softmax(x.double(), -1)  # and no further from float64 than ATen's own fp32 softmax
    assert (probs.double() - exact).abs().max() <= 1.5 * (torch.softmax(x, -1).double() - exact).abs().max() + 1e-9
    edge = torch.tensor([[0.0, float("nan"), 1.0], [float("inf"), 0.0, 0.0], [float("-inf"), 0.0, 1.0],
                         [-100.0, -200.0, 0.0], [5.0, 5.0, 5.0]])[:, :E] if E >= 3 else None
    if edge is not None:
        got, ref = fused_router.ops().topk_softmax_forward(edge, 1, True, 1.0)[0], torch.softmax(edge, -1)
        assert got[:2].isnan().all() and ref[:2].isnan().all()  # a NaN or +inf logit: the row is NaN
        assert got[2, 0] == 0 and got[3, 1] == 0 and got[3, 0] > 0  # exp(-inf) = 0; tiny ones not rounded up
        torch.testing.assert_close(got[2:], ref[2:], rtol=3e-7, atol=0)
    x16 = torch.randn(64, 16, generator=g)
    assert torch.equal(fused_router.ops().topk_softmax_forward(x16, 2, True, 1.0)[0], torch.softmax(x16, -1))


def test_ties_go_to_the_lower_expert():
    from moetron.kernels import fused_router

    logits = torch.full((3, 6), 0.25)
    logits[1, 4] = 2.0
    logits[2, 3] = float("nan")
    _, idx, _, counts, _ = fused_router.ops().topk_softmax_forward(logits, 2, True, 1.0)
    assert idx[0].tolist() == [0, 1] and idx[1].tolist() == [4, 0]
    assert idx[2].tolist() == [0, 1]  # a NaN logit makes its whole softmax row NaN: all tie
    assert counts.sum().item() == 6


@pytest.mark.parametrize("fields", [dict(expert_bias=True), dict(z_loss_coeff=1e-3), dict(score_func="sigmoid"),
                                    dict(capacity_factor=1.0), dict(softmax_before_topk=False),
                                    dict(aux_loss_type="seq_aux_loss", aux_loss_coeff=0.01)])
def test_routers_it_does_not_cover_stay_eager(fields, aux_scale):
    """The softmax pass leaves these routers alone (a sigmoid router takes its own: test_fused_sigmoid_router.py)."""
    router = _router(8, 2, **fields)
    x = torch.randn(32, 24)
    assert not _run(router, x, torch.randn(32, 2), "cpp")[5]


def test_bad_arguments_are_errors_naming_the_fix():
    from moetron.kernels import fused_router

    with pytest.raises(RuntimeError, match="top_k=9 must be in"):
        fused_router.ops().topk_softmax_forward(torch.randn(4, 8), 9, True, 1.0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        fused_router.ops().topk_softmax_forward(torch.randn(4, 8).double(), 2, True, 1.0)
