"""The weighted SwiGLU: the torch reference against fp64 math, the fused C++ and Triton kernels
against the reference, and the MoE layer with the weights applied in the experts.

Stated bounds of the fused kernels against the reference (exp is a polynomial within 2 ulp of
expf; the probs gradient sums in SIMD-lane order), elementwise |fused - ref| <= rtol*|ref| + atol:

    fp32   output, d_gate_up: rtol 2e-6, atol 1e-7 * max|ref|     d_probs: 1e-5 of max|ref|
    bf16   output, d_gate_up: rtol 2**-7 (one bf16 ulp after one rounding instead of two)
    fp64   rtol 1e-12 (std::exp)

The C++ kernel is built with the permute kernels (cached per machine); its tests skip only when
no compiler or ninja is present. The Triton tests run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from triton_utils import load_triton_interpreted
from moetron import MoEConfig, MoELayer
from moetron.kernels import cpp_build
from moetron.kernels import fused_swiglu as fs
from moetron.ops.functional import weighted_swiglu

pytestmark = pytest.mark.usefixtures("one_thread")


_TRITON_SKIP = load_triton_interpreted("moetron.kernels.triton_swiglu")[1]


def require(impl):
    if impl == "cpp":
        ok, reason = cpp_build.cpp_status(build=True)
        if not ok:
            if reason.startswith(("no C++ compiler", "ninja is not installed")):
                pytest.skip(reason)
            pytest.fail(f"the C++ kernels failed to build: {reason}")
    elif impl == "triton" and _TRITON_SKIP:
        pytest.skip(_TRITON_SKIP)


def _inputs(N, F, dtype, seed=0, probs=True):
    g = torch.Generator().manual_seed(seed)
    gate_up = (4 * torch.randn(N, 2 * F, generator=g, dtype=torch.float64))
    gate_up[0, :4] = torch.tensor([-100.0, -60.0, 30.0, 100.0])  # the exp clamp and saturation
    gate_up = gate_up.to(dtype).requires_grad_()
    p = torch.rand(N, generator=g).requires_grad_() if probs else None
    dy = torch.randn(N, F, generator=g, dtype=torch.float64).to(dtype)
    return gate_up, p, dy


def _run(fn, gate_up, p, dy):
    gate_up.grad = None
    if p is not None:
        p.grad = None
    out = fn(gate_up, p)
    out.backward(dy)
    return out.detach(), gate_up.grad.clone(), None if p is None else p.grad.clone()


def _close(got, want, rtol, atol_frac=0.0, what=""):
    got, want = got.double(), want.double()
    atol = atol_frac * want.abs().max().item()
    excess = ((got - want).abs() - rtol * want.abs() - atol).max().item()
    assert excess <= 0, f"{what}: exceeds the bound by {excess:.3g}"


def test_reference_matches_fp64_math():
    gate_up, p, dy = _inputs(64, 24, torch.float32, seed=1)
    out, d_gu, d_p = _run(fs.weighted_swiglu_reference, gate_up, p, dy)
    g64, u64 = gate_up.detach().double().chunk(2, dim=-1)
    s = torch.sigmoid(g64)
    w = p.detach().double()[:, None]
    _close(out, g64 * s * u64 * w, 1e-6, 1e-7, "output")
    da = dy.double() * w
    _close(d_gu[:, :24], da * u64 * s * (1 + g64 * (1 - s)), 1e-5, 1e-6, "d gate")
    _close(d_gu[:, 24:], da * g64 * s, 1e-5, 1e-6, "d up")
    _close(d_p, (dy.double() * g64 * s * u64).sum(-1), 1e-5, 1e-6, "d probs")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(100) = inf, as on GPU
@pytest.mark.parametrize("impl", ["cpp", "triton"])
@pytest.mark.parametrize("with_probs", [True, False])
def test_fused_fp32_within_bound_of_reference(impl, with_probs):
    require(impl)
    N, F = (257, 100) if impl == "cpp" else (33, 40)  # F not a multiple of the vector width
    gate_up, p, dy = _inputs(N, F, torch.float32, probs=with_probs)
    want = _run(fs.weighted_swiglu_reference, gate_up, p, dy)
    got = _run(lambda gu, pr: weighted_swiglu(gu, pr, impl=impl), gate_up, p, dy)
    _close(got[0], want[0], 2e-6, 1e-7, "output")
    _close(got[1], want[1], 2e-6, 1e-7, "d gate_up")
    if with_probs:
        _close(got[2], want[2], 0.0, 1e-5, "d probs")
    assert not torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_cpp_other_dtypes(dtype):
    require("cpp")
    gate_up, p, dy = _inputs(65, 48, dtype, seed=2)
    want = _run(fs.weighted_swiglu_reference, gate_up, p, dy)
    got = _run(lambda gu, pr: weighted_swiglu(gu, pr, impl="cpp"), gate_up, p, dy)
    rtol, atol = (2 ** -7, 1e-3) if dtype == torch.bfloat16 else (1e-12, 1e-14)
    for a, b, what in zip(got[:2], want[:2], ("output", "d gate_up")):
        _close(a, b, rtol, atol, what)
    # d probs: the reference rounds every product to bf16 before summing, the kernel sums in fp32:
    # compare with the fp64 sum of the same inputs (the kernel is the closer of the two).
    g64, u64 = gate_up.detach().double().chunk(2, dim=-1)
    exact = (dy.double() * g64 * torch.sigmoid(g64) * u64).sum(-1)
    _close(got[2], exact, 0.0, 1e-2 if dtype == torch.bfloat16 else 1e-7, "d probs")  # fp32, as the probs
    assert (got[2].double() - exact).abs().max() <= (want[2].double() - exact).abs().max()


def test_cpp_multithreaded_rows_equal_one_thread():
    require("cpp")
    gate_up, p, dy = _inputs(512, 64, torch.float32, seed=3)
    one = _run(lambda gu, pr: weighted_swiglu(gu, pr, impl="cpp"), gate_up, p, dy)
    torch.set_num_threads(2)
    try:
        two = _run(lambda gu, pr: weighted_swiglu(gu, pr, impl="cpp"), gate_up, p, dy)
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_zero_rows_and_bad_arguments():
    require("cpp")
    empty = torch.zeros(0, 8, requires_grad=True)
    out = weighted_swiglu(empty, torch.zeros(0), impl="cpp")
    assert out.shape == (0, 4)
    with pytest.raises(ValueError, match="gate_up must be"):
        weighted_swiglu(torch.zeros(3, 5), impl="cpp")
    with pytest.raises(ValueError, match="probs must be float32"):
        weighted_swiglu(torch.zeros(3, 4), torch.zeros(3, dtype=torch.float64), impl="torch")
    with pytest.raises(ValueError, match="unknown"):
        weighted_swiglu(torch.zeros(3, 4), impl="fast")
    ok, reason = fs.impl_status("meta")[1][1:]
    assert not ok and "CPU tensors only" in reason


@pytest.mark.parametrize("impl", [None, "cpp"])
def test_layer_weights_in_experts_match_weights_at_combine(impl):
    """The layer's output and every gradient (router included) against the old order, where the
    combine multiplies [N, H] rows by the weights: equal up to fp32 rounding (measured ~2e-7)."""
    if impl:
        require(impl)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=3, norm_topk_prob=True,
                               aux_loss_type="aux_loss", aux_loss_coeff=0.01))
    layer.experts.activation_impl = impl
    x = torch.randn(2, 40, 32, requires_grad=True)
    dy = torch.randn(2, 40, 32)

    def grads(fn):
        for q in (x, *layer.parameters()):
            q.grad = None
        y = fn()
        y.backward(dy)
        return [y.detach()] + [q.grad.clone() for q in (x, *layer.parameters())]

    def weights_at_combine():
        x_TH = x.reshape(-1, 32)
        routing = layer.route(x_TH, 40)
        x_NH, rows, handle = layer.dispatch(x_TH, routing)
        return layer.combine(layer.compute_experts(x_NH, rows), handle).view_as(x)

    new, old = grads(lambda: layer(x)), grads(weights_at_combine)
    assert old[2].abs().max() > 0  # the router's gradient flows through the weights
    for a, b in zip(new, old):
        _close(a, b, 0.0, 2e-6, "moe layer")
