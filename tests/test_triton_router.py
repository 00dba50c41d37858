"""The Triton softmax top-k router (`train.fusion=triton`, the GPU default through `auto`) under
TRITON_INTERPRET=1, against the eager router's math in torch (autograd for the gradients): the same
experts (torch.topk's order: NaN first, ties to the lower expert) and counts, weights, probability
sums and the logits' gradient (with and without the balancing loss's) within a few ulp; against the
C++ kernel's contract too; and TopKRouter taking it under `triton` for the routers it covers."""

import pytest
import torch

from triton_utils import interpreted_kernels
from moetron import MoEConfig, ops
from moetron.moe import balancing, router as router_module
from moetron.moe.router import TopKRouter

pytestmark = pytest.mark.usefixtures("one_thread")
k = interpreted_kernels("moetron.kernels.triton_router")  # the kernels, or a skip saying why


def _eager(logits, K, normalize, scale, grad_w, aux):
    """The eager router's selection (moetron.moe.router.TopKRouter.forward's ops) and its gradient."""
    x = logits.clone().requires_grad_()
    probs = torch.softmax(x, dim=-1)
    idx = torch.topk(probs.detach(), K, dim=-1).indices
    w = probs.gather(1, idx)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * scale
    loss = (w * grad_w).sum() + ((probs * aux).sum() if aux is not None else 0)
    loss.backward()
    counts = torch.bincount(idx.reshape(-1), minlength=logits.shape[1])
    return idx, w.detach(), counts, probs.detach().sum(0), x.grad


def _fused(kernels, logits, K, normalize, scale, grad_w, aux):
    from moetron.kernels.fused_router import TopKSoftmax

    x = logits.clone().requires_grad_()
    w, idx, counts, psum = TopKSoftmax.apply(x, K, normalize, scale, None if aux is None else (lambda c: aux), kernels)
    (w * grad_w).sum().backward()
    return idx, w.detach(), counts, psum, x.grad


CASES = [  # (T, E, K, normalize, scale)
    (50, 8, 2, True, 1.0),      # qwen3-moe-tiny's router
    (120, 16, 4, False, 2.5),   # unnormalised, scaled
    (33, 6, 6, True, 1.0),      # every expert
    (40, 60, 8, True, 1.0),     # E not a power of two
]


@pytest.mark.parametrize("T,E,K,normalize,scale", CASES)
@pytest.mark.parametrize("with_aux", [False, True])
def test_agrees_with_the_eager_router(k, T, E, K, normalize, scale, with_aux):
    g = torch.Generator().manual_seed(T + E)
    logits = torch.randn(T, E, generator=g) * 2
    grad_w = torch.randn(T, K, generator=g)
    aux = torch.rand(E, generator=g) * 0.1 if with_aux else None
    want = _eager(logits, K, normalize, scale, grad_w, aux)
    got = _fused(k, logits, K, normalize, scale, grad_w, aux)
    assert torch.equal(got[0], want[0]) and got[0].dtype == torch.int64
    assert torch.equal(got[2], want[2]) and got[2].dtype == torch.int64
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[3], want[3], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-6 * want[4].abs().max().item())
    assert want[4].abs().max() > 1e-3  # not compared on zeros


def test_ties_go_to_the_lower_expert_and_nan_ranks_first(k):
    """Exact ties (which torch.topk orders as it likes: [1, 3] on this CPU for the first row) go to the
    lower expert, the C++ kernel's rule; a NaN row stays NaN."""
    from moetron.kernels import cpp_build, fused_router

    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0],   # a three-way tie for first place
                           [2.0, 0.5, 2.0, 0.5, 0.5],
                           [0.0, float("nan"), 3.0, 0.0, 0.0]])  # softmax makes the whole row NaN
    got = _fused(k, logits, 2, False, 1.0, torch.ones(3, 2), None)
    assert got[0].tolist() == [[1, 2], [0, 2], [0, 1]]
    assert torch.isnan(got[1][2]).all() and not torch.isnan(got[1][:2]).any()
    if cpp_build.cpp_status(build=True)[0]:
        cpp = _fused(fused_router, logits, 2, False, 1.0, torch.ones(3, 2), None)
        assert torch.equal(got[0], cpp[0]) and torch.equal(got[2], cpp[2])


def test_no_tokens(k):
    idx, w, counts, psum = k.forward(torch.zeros(0, 8), 2, True, 1.0)[1:]
    assert w.shape == (0, 2) and idx.shape == (0, 2)
    assert torch.equal(counts, torch.zeros(8, dtype=torch.int64)) and torch.equal(psum, torch.zeros(8))


def test_bad_inputs_are_named(k):
    assert not k.applies(torch.randn(4, 8, dtype=torch.float64))
    assert not k.applies(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        k.forward(torch.randn(4, 8), 9, True, 1.0)
    with pytest.raises(ValueError, match="contiguous fp32"):
        k.forward(torch.randn(4, 8, dtype=torch.float64), 2, True, 1.0)


def test_the_router_takes_it_under_triton(k, monkeypatch):
    """TopKRouter's forward through the Triton kernel, its Switch loss and gradients, equal the eager run's
    within a few ulp (aux-loss scale 0.5, as under gradient accumulation)."""
    monkeypatch.setattr(router_module, "_triton", [k])
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=24, ffn_hidden_size=32, num_experts=8, top_k=2, init_std=0.3,
                    aux_loss_type="aux_loss", aux_loss_coeff=0.05, norm_topk_prob=True)
    router = TopKRouter(cfg)
    g = torch.Generator().manual_seed(1)
    x0, grad_w = torch.randn(40, 24, generator=g), torch.randn(40, 2, generator=g)
    from test_fused_router import _run  # the C++ router's test's run under a fusion mode

    balancing.set_aux_loss_scale(0.5)
    try:
        results = {mode: _run(router, x0, grad_w, mode) for mode in ("none", "triton")}
    finally:
        ops.set_fusion("none")
        balancing.set_aux_loss_scale(1.0)
    ref, out = results["none"], results["triton"]
    assert out[5] and not ref[5]
    assert torch.equal(out[0].topk_idx, ref[0].topk_idx) and torch.equal(out[2], ref[2])
    torch.testing.assert_close(out[0].topk_weights, ref[0].topk_weights, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(out[1].values["aux_loss"], ref[1].values["aux_loss"], rtol=2e-6, atol=0)
    for got, want in zip(out[3:5], ref[3:5]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
