"""The Triton RMSNorm kernels (under TRITON_INTERPRET=1) against an fp64 evaluation of the same
rounding sequence as `_rms_norm_ref` (normalise, round to x's dtype, scale) and against the
reference itself.

Stated bounds; "exact" is the fp64 evaluation, errors per row relative to the row's max |exact|
(the weight gradient: relative to its max), u the unit roundoff of a dtype (bf16 2**-8, fp16 2**-11):

    fp32 x and weight   output, grad_x, grad_weight within 1e-5 of exact, and of the torch reference
    bf16 / fp16 x       norm-relative error at most 2x the reference's own (+1e-6); elementwise
                        |kernel - exact| <= 2 * (u_x + u_out) * |exact| + 1e-5 * max|exact|, i.e. one
                        ulp of each rounding (a y = x * rstd within fp32 noise of a tie may round the
                        other way), and the reference's output dtypes

Inputs: rows scaled from 1e-3 to 10, so that eps (1e-5) matters for some rows.
"""

from __future__ import annotations

import pytest
import torch

from triton_utils import interpreted_kernels
from moetron.ops.functional import _rms_norm_ref

pytestmark = pytest.mark.usefixtures("one_thread")
EPS = 1e-5
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_U = {BF16: 2.0 ** -8, FP16: 2.0 ** -11, FP32: 2.0 ** -24}


k = interpreted_kernels("moetron.kernels.triton_rmsnorm")  # the kernels, or a skip saying why


def _inputs(shape, x_dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    scale = 10 ** (4 * torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) - 3)
    x = (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(x_dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(D, generator=g, dtype=torch.float64)).to(w_dtype).requires_grad_()
    dy = torch.randn(*shape, generator=g, dtype=torch.float64).to(torch.result_type(w, x))
    return x, w, dy


def _run(fn, x, w, dy):
    x.grad = w.grad = None
    out = fn(x, w, EPS)
    out.backward(dy)
    return out.detach(), x.grad.clone(), w.grad.clone()


def _exact(x, w, dy):
    """`_rms_norm_ref`'s forward and its gradient in fp64, rounding y = x * rstd to x's dtype as it does."""
    x64, w64, g64 = x.detach().double(), w.detach().double(), dy.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    xhat = x64 * rstd
    y_r = xhat.to(x.dtype).double()
    gy = g64 * w64
    grad_x = rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))
    return w64 * y_r, grad_x, (g64 * y_r).reshape(-1, x.shape[-1]).sum(0)


def _close(got, want, rtol, atol_frac, what):
    got, want = got.double(), want.double()
    atol = atol_frac * want.abs().amax(-1, keepdim=True)  # per row
    excess = ((got - want).abs() - rtol * want.abs() - atol).max().item()
    assert excess <= 0, f"{what}: exceeds the bound by {excess:.3g}"


def _norm_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shape, sliced", [((1, 40), False), ((37, 100), False), ((2, 5, 64), False),
                                           ((7, 40), True)])
def test_fp32_matches_fp64_and_reference(k, shape, sliced):
    x, w, dy = _inputs(shape, FP32, FP32)
    if sliced:  # rows with a stride wider than D: the autograd function copies them
        wide = _inputs((shape[0], 2 * shape[1]), FP32, FP32, seed=1)[0]
        x = wide.detach()[:, : shape[1]].requires_grad_()
        assert not x.is_contiguous()
    got = _run(k.RMSNormFunction.apply, x, w, dy)
    ref = _run(_rms_norm_ref, x, w, dy)
    for a, b, e, what in zip(got, ref, _exact(x, w, dy), ("output", "grad_x", "grad_weight")):
        assert a.dtype == FP32 and a.shape == b.shape and a.abs().max() > 0
        _close(a, e, 0.0, 1e-5, what)
        _close(a, b, 0.0, 1e-5, what + " vs reference")


def test_forward_rstd_and_no_weight_grad(k):
    x, w, dy = _inputs((37, 100), FP32, FP32, seed=2)
    out, rstd = k.forward(x.detach(), w.detach(), EPS)
    want = torch.rsqrt(x.detach().double().pow(2).mean(-1) + EPS)
    assert rstd.dtype == FP32 and rstd.shape == (37,)
    _close(rstd, want, 1e-6, 0.0, "rstd")
    grad_x, grad_w = k.backward(dy, x.detach(), w.detach(), rstd, need_weight_grad=False)
    assert grad_w is None
    _close(grad_x, _exact(x, w, dy)[1], 0.0, 1e-5, "grad_x")
    x.grad = None  # through autograd, with a weight that needs no gradient
    k.RMSNormFunction.apply(x, w.detach(), EPS).backward(dy)
    assert torch.equal(x.grad, grad_x)


@pytest.mark.parametrize("x_dtype, w_dtype", [(BF16, BF16), (BF16, FP32), (FP16, FP16), (FP32, BF16)])
def test_low_precision_against_reference(k, x_dtype, w_dtype):
    x, w, dy = _inputs((37, 100), x_dtype, w_dtype, seed=3)
    got = _run(k.RMSNormFunction.apply, x, w, dy)
    ref = _run(_rms_norm_ref, x, w, dy)
    u_x = _U[x_dtype]
    for a, b, e, what in zip(got, ref, _exact(x, w, dy), ("output", "grad_x", "grad_weight")):
        assert a.dtype == b.dtype and a.shape == b.shape and a.abs().max() > 0, what
        assert _norm_err(a, e) <= 2 * _norm_err(b, e) + 1e-6, f"{what}: {_norm_err(a, e):.3g} vs {_norm_err(b, e):.3g}"
        _close(a, e, 2 * (u_x + _U[a.dtype]), 1e-5, what)


@pytest.mark.parametrize("x_dtype, w_dtype", [(FP32, FP32), (BF16, BF16)])
def test_wide_rows_loop_over_blocks_and_rows(k, monkeypatch, x_dtype, w_dtype):
    """D wider than the block (shrunk to 32) and fewer backward programs (4) than rows: the same
    results as one block per row and one program per row."""
    x, w, dy = _inputs((11, 100), x_dtype, w_dtype, seed=4)
    one_block = _run(k.RMSNormFunction.apply, x, w, dy)
    monkeypatch.setattr(k, "_MAX_BLOCK_D", 32)
    monkeypatch.setattr(k, "_DEFAULT_SMS", 1)
    monkeypatch.setattr(k, "_DW_BUFFER_BYTES", 4 * 100 * 3)  # partial sums of 3 rows: 4 programs (one per SM x 4)
    assert k._block(100) == (32, False) and k._num_programs(11, 100, x.device) == 4
    looped = _run(k.RMSNormFunction.apply, x, w, dy)
    exact = _exact(x, w, dy)
    rtol = 2 * (_U[x_dtype] + _U[w_dtype]) if x_dtype != FP32 else 0.0
    for a, b, e, what in zip(looped, one_block, exact, ("output", "grad_x", "grad_weight")):
        assert a.dtype == b.dtype and a.abs().max() > 0
        _close(a, e, rtol, 1e-5, what)
        _close(a, b, rtol, 1e-5, what + " vs one block")
    # the multi-block kernel without the weight gradient
    grad_x, grad_w = k.backward(dy, x.detach(), w.detach(), k.forward(x.detach(), w.detach(), EPS)[1], False)
    assert grad_w is None and torch.equal(grad_x, looped[1])


def test_zero_rows(k):
    for shape in ((0, 40), (2, 0, 40)):
        x = torch.zeros(shape, requires_grad=True)
        w = torch.ones(40, requires_grad=True)
        out = k.RMSNormFunction.apply(x, w, EPS)
        assert out.shape == shape
        out.sum().backward()
        assert x.grad.shape == shape and torch.equal(w.grad, torch.zeros(40))
    out, rstd = k.forward(torch.zeros(0, 8, dtype=BF16), torch.ones(8, dtype=FP32), EPS)
    assert out.dtype == FP32 and out.shape == (0, 8) and rstd.shape == (0,)


def test_applies_and_bad_arguments(k):
    x, w = torch.randn(3, 40), torch.randn(40)
    assert k.applies(x, w) and k.applies(x.to(BF16), w) and k.applies(x.view(3, 1, 40).to(FP16), w.to(BF16))
    assert not k.applies(x, torch.randn(41))  # wrong size
    assert not k.applies(x, torch.randn(1, 40))  # not 1-D
    assert not k.applies(x.double(), w) and not k.applies(x, w.double())
    assert not k.applies(x.to(torch.int32), w)
    assert not k.applies(torch.randn(2, k.MAX_D + 1), torch.randn(k.MAX_D + 1))
    assert k.applies(torch.randn(1, k.MAX_D), torch.randn(k.MAX_D))
    assert not k.applies(x.to("meta"), w.to("meta"))
    assert not k.applies(torch.randn(3, 0), torch.randn(0))
    with pytest.raises(ValueError, match="weight must be 1-D of size D=40"):
        k.forward(x, torch.randn(41), EPS)
    with pytest.raises(ValueError, match=r"contiguous \[N, D\]"):
        k.forward(torch.randn(40, 3).t(), torch.randn(40), EPS)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        k.forward(x.double(), w.double(), EPS)


def test_fusion_triton_sends_rms_norm_to_the_kernel(k):
    """`train.fusion=triton` (auto's choice on a GPU): `ops.rms_norm` runs the kernel (here interpreted)."""
    from moetron import ops

    x, w, _ = _inputs((6, 40), BF16, BF16, seed=7)
    ops.set_fusion("triton")  # the conftest fixture puts "none" back after the test
    got = ops.rms_norm(x, w, EPS)
    assert got.grad_fn is not None and "RMSNormFunction" in type(got.grad_fn).__name__
    assert torch.equal(got, k.RMSNormFunction.apply(x, w, EPS))
