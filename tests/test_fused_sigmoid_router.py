"""DeepSeek-V3's sigmoid router in C++ (`train.fusion=cpp`, the CPU default through `auto`) against the
eager TopKRouter: from ATen's sigmoid on, the same experts and counts, the weights bit for bit up to
top-3 and within 2 ulp beyond (an expert bias, group-limited selection, normalised or not, scaled), the
gradients of the input and the router weight within a few ulp; its balancing losses and capacity drops stay the eager ones on its output."""

import functools

import pytest
import torch

from moetron import MoEConfig, ops
from moetron.kernels import fused_router
from moetron.moe.router import TopKRouter
from test_fused_router import _run as _router_run

pytestmark = pytest.mark.usefixtures("one_thread", "cpp_kernels")  # conftest.py


@pytest.fixture(autouse=True)
def eager_after():
    yield
    ops.set_fusion("none")


_run = functools.partial(_router_run, kernel="TopKSigmoid")  # routing, losses, gradients, and whether it ran


def _router(E, K, seed=0, **fields):
    torch.manual_seed(seed)
    cfg = MoEConfig(hidden_size=24, ffn_hidden_size=32, num_experts=E, top_k=K, init_std=0.5, score_func="sigmoid",
                    **fields)
    router = TopKRouter(cfg)
    if router.expert_bias is not None:  # zero at init: a trained bias changes the choice, never the weights
        router.expert_bias.copy_(0.2 * torch.randn(E, generator=torch.Generator().manual_seed(seed + 1)))
    return router


CASES = {
    "deepseek-v3-tiny": (8, 2, dict(expert_bias=True, num_groups=4, topk_groups=2, norm_topk_prob=True,
                                    scaling_factor=2.5)),
    "deepseek-v3 (256 experts, 8 groups of 32, top 4 groups, top-8)": (
        256, 8, dict(expert_bias=True, num_groups=8, topk_groups=4, norm_topk_prob=True, scaling_factor=2.5)),
    "no groups, no bias": (16, 4, dict(norm_topk_prob=True)),
    "unnormalised, groups of one": (6, 3, dict(expert_bias=True, num_groups=6, topk_groups=4, norm_topk_prob=False)),
    "every kept expert": (12, 6, dict(num_groups=4, topk_groups=2, norm_topk_prob=True, scaling_factor=1.5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_it_agrees_with_the_eager_router(case):
    E, K, fields = CASES[case]
    router = _router(E, K, **fields)
    g = torch.Generator().manual_seed(2)
    x, grad_w = torch.randn(300, 24, generator=g), torch.randn(300, K, generator=g)
    ref = _run(router, x, grad_w, "none")
    out = _run(router, x, grad_w, "cpp")
    assert out[5] and not ref[5]  # the C++ pass ran, and only under cpp
    assert torch.equal(out[0].topk_idx, ref[0].topk_idx)
    assert torch.equal(out[0].tokens_per_expert, ref[0].tokens_per_expert) and torch.equal(out[2], ref[2])
    # the same gathers and products; torch sums a row's k weights in its own order (equal bits up to k=3)
    torch.testing.assert_close(out[0].topk_weights, ref[0].topk_weights, rtol=5e-7, atol=0)
    if K <= 3:
        assert torch.equal(out[0].topk_weights, ref[0].topk_weights)
    for got, want in zip(out[3:5], ref[3:5]):  # d x, d router weight
        assert want.abs().max() > 1e-3
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    if E // fields.get("num_groups", E) > 1:  # the group limit bites: some token's choice is not the plain top-k
        # (groups of one expert never bite where top_k <= topk_groups)
        bias = router.expert_bias if router.expert_bias is not None else 0.0
        plain = torch.topk(torch.sigmoid(x @ router.weight.detach().t()) + bias, K).indices
        assert not torch.equal(out[0].topk_idx.sort(-1).values, plain.sort(-1).values)


def test_balancing_losses_and_capacity_stay_eager_on_its_output():
    """The recipe's sequence-wise loss (DeepSeek's `paper` counts) and a capacity drop: values, the
    routing after the drop and the gradients as the eager router's."""
    router = _router(8, 2, expert_bias=True, num_groups=4, topk_groups=2, norm_topk_prob=True, scaling_factor=2.5,
                     aux_loss_type="seq_aux_loss", aux_loss_coeff=0.01, aux_loss_counts="paper", capacity_factor=1.0)
    g = torch.Generator().manual_seed(3)
    x, grad_w = torch.randn(64, 24, generator=g), torch.randn(64, 2, generator=g)
    ref = _run(router, x, grad_w, "none")
    out = _run(router, x, grad_w, "cpp")
    assert torch.equal(out[0].topk_idx, ref[0].topk_idx) and (out[0].topk_idx < 0).any()  # some slots dropped
    torch.testing.assert_close(out[1].values["seq_aux_loss"], ref[1].values["seq_aux_loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(out[0].topk_weights, ref[0].topk_weights, rtol=0, atol=0)
    for got, want in zip(out[3:5], ref[3:5]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_ties_and_nan():
    """NaN ranks first, then the larger score, then the lower expert (or group) id; a group's score is the
    sum of its two best."""
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.5],  # all tie: experts 0, 1
                           [0.1, 0.2, 0.9, 0.3],
                           [0.1, float("nan"), 0.9, 0.3]])
    w, idx, counts = fused_router.ops().topk_sigmoid_forward(scores, None, 2, 1, 1, False, 1.0)
    assert idx.tolist() == [[0, 1], [2, 3], [1, 2]] and counts.tolist() == [1, 2, 2, 1]
    assert torch.equal(w[1], torch.tensor([0.9, 0.3]))
    # two groups: {0, 1} scores 0.3 + 0.2 = 0.5 against {2, 3} 0.25 + 0.24 = 0.49, so expert 2 (0.25) is out
    two = torch.tensor([[0.3, 0.2, 0.25, 0.24]])
    _, idx, _ = fused_router.ops().topk_sigmoid_forward(two, None, 2, 2, 1, True, 1.0)
    assert idx.tolist() == [[0, 1]]
    bias = torch.tensor([0.0, 0.0, 0.1, 0.0])  # the bias lifts group {2, 3} and expert 2; weights stay unbiased
    w, idx, _ = fused_router.ops().topk_sigmoid_forward(two, bias, 2, 2, 1, False, 1.0)
    assert idx.tolist() == [[2, 3]] and torch.equal(w, torch.tensor([[0.25, 0.24]]))


def test_bad_arguments_are_errors_naming_the_fix():
    kernel = fused_router.ops().topk_sigmoid_forward
    scores = torch.rand(4, 8)
    with pytest.raises(RuntimeError, match="3 groups of E=8 experts"):
        kernel(scores, None, 2, 3, 1, True, 1.0)
    with pytest.raises(RuntimeError, match="top_k=5 do not fit"):
        kernel(scores, None, 5, 4, 2, True, 1.0)  # 2 groups of 2 experts kept: at most 4
    with pytest.raises(RuntimeError, match=r"expert bias must be a float32 CPU tensor \[E=8\]"):
        kernel(scores, torch.zeros(7), 2, 1, 1, True, 1.0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(scores.double(), None, 2, 1, 1, True, 1.0)
