"""The C++ RMSNorm and RoPE (`train.fusion=cpp`, the CPU default through `auto`) against the eager
reference bodies of moetron/ops/functional.py: RoPE bit for bit, RMSNorm within a few ulp, both
gradients checked numerically in float64."""

import pytest
import torch

from moetron import ops
from moetron.kernels import availability, cpp_build, norm_rope_cpu, threads
from moetron.ops import functional as fn

pytestmark = pytest.mark.usefixtures("one_thread", "cpp_kernels")  # conftest.py


@pytest.fixture
def fusion():
    yield ops.set_fusion
    ops.set_fusion("none")


def _q_like(B=3, S=20, heads=4, d=16, seed=0):
    """A [B, heads, S, d] transposed view, as the attention hands RoPE its queries."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, heads, d, generator=g).transpose(1, 2)


def _cos_sin(B, S, d, seed=1):
    g = torch.Generator().manual_seed(seed)
    angles = torch.randn(B, S, d // 2, generator=g) * 3
    angles = torch.cat((angles, angles), dim=-1)  # halves layout: each frequency twice
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("cos_batch", [1, 3])
def test_rope_equals_the_reference_bit_for_bit(cos_batch, interleaved, fusion):
    x = _q_like().requires_grad_()
    cos, sin = _cos_sin(cos_batch, 20, 16)
    grad = torch.randn(3, 4, 20, 16)
    ref = fn._rope_ref(x, cos, sin, interleaved)
    (ref_grad,) = torch.autograd.grad(ref, x, grad)
    fusion("cpp")
    out = ops.apply_rope(x, cos, sin, interleaved)
    assert out.grad_fn is not None and "Rope" in type(out.grad_fn).__name__  # the C++ path ran
    (out_grad,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(out, ref) and (interleaved or out.stride() == ref.stride())
    assert torch.equal(out_grad, ref_grad)
    # the gradient as the attention's backward hands it over: not contiguous
    (strided_grad,) = torch.autograd.grad(ops.apply_rope(x, cos, sin, interleaved), x,
                                          grad.transpose(1, 2).contiguous().transpose(1, 2))
    assert torch.equal(strided_grad, ref_grad)


def test_interleaved_rope_of_mla_slices_equals_the_reference_bit_for_bit(fusion):
    """DeepSeek-V3's rotary parts: q's last 8 of 24 per head (a strided slice of the projection) and the
    shared key [B, 1, S, 8] (a slice of kv_a's output), each pair (x[2i], x[2i+1]) rotated, halves out."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 17, 4, 24, generator=g).transpose(1, 2)[..., 16:].requires_grad_()
    k = torch.randn(2, 17, 40, generator=g)[..., 32:].view(2, 1, 17, 8).requires_grad_()
    cos, sin = _cos_sin(1, 17, 8)
    for x in (q, k):
        grad = torch.randn(x.shape, generator=g)
        ref = fn._rope_ref(x, cos, sin, True)
        fusion("cpp")
        out = ops.apply_rope(x, cos, sin, interleaved=True)
        fusion("none")
        assert "Rope" in type(out.grad_fn).__name__
        assert torch.equal(out, ref)
        assert torch.equal(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0])
    # the pairs really are interleaved: swapping a pair's order changes the result
    assert not torch.equal(fn._rope_ref(q, cos, sin, True), fn._rope_ref(q, cos, sin, False))


def test_rms_norm_within_a_few_ulp_of_the_reference(fusion):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 33, 64, generator=g) * 3).requires_grad_()
    w = (1 + 0.3 * torch.randn(64, generator=g)).requires_grad_()
    grad = torch.randn(6, 33, 64, generator=g)
    ref = fn._rms_norm_ref(x, w, 1e-6)
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, w), grad)
    fusion("cpp")
    out = ops.rms_norm(x, w, 1e-6)
    assert "RMSNorm" in type(out.grad_fn).__name__ and out.shape == x.shape
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    eps = torch.finfo(torch.float32).eps
    # rstd comes from a sum of squares in another order: a few ulp on every element.
    assert ((out - ref).abs() <= 4 * eps * ref.abs() + 1e-30).all()
    assert ((gx - ref_gx).abs() <= 64 * eps * ref_gx.abs().max()).all()
    assert ((gw - ref_gw).abs() <= 64 * eps * ref_gw.abs().max()).all()
    assert not torch.equal(gx, torch.zeros_like(gx))


@pytest.mark.parametrize("cos_batch", [1, 3])
def test_norm_then_rope_in_one_op_equals_the_two_ops_bit_for_bit(cos_batch, fusion):
    """Qwen3's q/k path: `rms_norm_rope` under cpp is one op each way with the bits of the C++ RMSNorm
    followed by the C++ RoPE (forward, input and weight gradients)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 20, 4, 16, generator=g) * 2).requires_grad_()
    w = (1 + 0.3 * torch.randn(16, generator=g)).requires_grad_()
    cos, sin = _cos_sin(cos_batch, 20, 16)
    grad = torch.randn(3, 4, 20, 16, generator=g)
    fusion("cpp")
    apart = ops.apply_rope(ops.rms_norm(x, w, 1e-6).transpose(1, 2), cos, sin)
    want = torch.autograd.grad(apart, (x, w), grad)
    out = ops.rms_norm_rope(x, w, 1e-6, cos, sin)
    assert "RMSNormRope" in type(out.grad_fn).__name__ and out.shape == (3, 4, 20, 16)
    assert torch.equal(out, apart) and out.stride() == apart.stride()
    got = torch.autograd.grad(out, (x, w), grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[1].abs().sum() > 0
    # the gradient as the attention hands it over: a [B, heads, S, d]-contiguous tensor
    (strided,) = torch.autograd.grad(ops.rms_norm_rope(x, w, 1e-6, cos, sin), x, grad.contiguous())
    assert torch.equal(strided, want[0])
    fusion("none")  # the eager bodies: the same function, within RMSNorm's few ulp
    torch.testing.assert_close(ops.rms_norm_rope(x, w, 1e-6, cos, sin), apart, rtol=1e-5, atol=1e-6)


def test_gradients_agree_with_finite_differences_in_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: norm_rope_cpu.RMSNormFunction.apply(a, b, 1e-5), (x, w))
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    cos, sin = (t.double().unsqueeze(1) for t in _cos_sin(2, 5, 8))
    assert torch.autograd.gradcheck(lambda a: norm_rope_cpu.RopeFunction.apply(a, cos, sin), (q,))


def test_weight_gradient_has_the_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1000, 48, generator=g)
    w, grad = torch.randn(48, generator=g), torch.randn(1000, 48, generator=g)
    kernels = norm_rope_cpu.ops()
    _, rstd = kernels.rms_forward(x, w, 1e-6)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(kernels.rms_backward(grad, x, w, rstd, True))
    torch.set_num_threads(1)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r, results[0]))


def test_other_dtypes_and_layouts_take_the_reference(fusion):
    fusion("cpp")
    x, w = torch.randn(4, 16).bfloat16(), torch.ones(16).bfloat16()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), fn._rms_norm_ref(x, w, 1e-6))
    q, (cos, sin) = _q_like(d=8), _cos_sin(1, 20, 8)
    qb = q.bfloat16().requires_grad_()
    half = ops.apply_rope(qb, cos.bfloat16(), sin.bfloat16(), interleaved=True)
    assert torch.equal(half, fn._rope_ref(qb, cos.bfloat16(), sin.bfloat16(), True))
    assert "Rope" not in type(half.grad_fn).__name__  # bf16: the reference's ops, not the C++ kernel


def test_auto_takes_cpp_on_a_cpu_and_says_why_not_when_it_cannot(monkeypatch):
    assert ops.resolve_fusion("auto", torch.device("cpu")) == ("cpp", None)
    if availability.triton_installed():  # the test extras install it
        assert ops.resolve_fusion("auto", torch.device("cuda")) == ("triton", None)  # Triton RMSNorm on a GPU
    assert ops.resolve_fusion("auto", torch.device("cuda"), fp8=True) == ("none", None)
    assert ops.resolve_fusion("compile", torch.device("cpu")) == ("compile", None)
    with pytest.raises(ValueError, match="train.fusion=triton runs CUDA tensors, but this run is on cpu"):
        ops.resolve_fusion("triton", torch.device("cpu"))
    assert ops.resolve_fusion("auto", torch.device("cpu"), fp8=True) == ("none", None)  # tests/test_fp8_tp.py
    assert ops.resolve_fusion("cpp", torch.device("cpu"), fp8=True) == ("cpp", None)  # by hand: as asked
    assert ops.resolve_fusion("auto", torch.device("cpu"), dtype=torch.bfloat16) == ("none", None)
    with pytest.raises(ValueError, match="train.fusion=cpp runs fp32 and fp64 tensors.*train.dtype=fp32"):
        ops.resolve_fusion("cpp", torch.device("cpu"), dtype=torch.bfloat16)  # it would never run: refused
    with pytest.raises(ValueError, match="train.fusion=cpp runs CPU tensors"):
        ops.resolve_fusion("cpp", torch.device("cuda"))

    monkeypatch.setattr(availability, "triton_installed", lambda: False)
    mode, notice = ops.resolve_fusion("auto", torch.device("cuda"))
    assert mode == "none" and "pip install triton" in notice
    with pytest.raises(ValueError, match="train.fusion=triton needs the triton package: pip install triton"):
        ops.resolve_fusion("triton", torch.device("cuda"))
    monkeypatch.undo()

    def no_compiler():
        raise cpp_build.CppBuildError("no C++ compiler: 'c++' is not on PATH (install g++ or set CXX)")

    monkeypatch.setattr(norm_rope_cpu, "ops", no_compiler)
    mode, notice = ops.resolve_fusion("auto", torch.device("cpu"))
    assert mode == "none" and "no C++ compiler" in notice
    with pytest.raises(ValueError, match="train.fusion=cpp: .*no C\\+\\+ compiler.*train.fusion=none"):
        ops.resolve_fusion("cpp", torch.device("cpu"))


def test_a_cpu_run_takes_them_and_leaves_the_callers_mode(monkeypatch):
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.trainer import train

    calls = []
    apply = norm_rope_cpu.RMSNormFunction.apply
    monkeypatch.setattr(norm_rope_cpu.RMSNormFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), ["model.num_layers=1", "train.steps=1",
                                                            "train.seq_len=16", "train.micro_batch_size=2"])
    assert recipe.train.fusion == "auto"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lines = []
    try:
        train(recipe, log=lines.append)
        # and gave the process back its mode and threads (one intra-op thread, two for the experts' GEMMs)
        assert (ops.fusion_mode(), torch.get_num_threads(), threads.wide_threads()) == ("none", 2, 1)
    finally:
        torch.set_num_threads(before)
    assert calls  # train.fusion=auto took the C++ kernels on the CPU
    assert any("2 for the experts' grouped GEMMs" in line for line in lines)


def test_a_row_gets_the_same_bits_in_any_layout(fusion):
    """Tensor parallel hands the norms [S, B, H]-strided views where one process has contiguous
    [B, S, H]: every output and gradient bit must agree, or the layouts stop training alike."""
    fusion("cpp")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 32, generator=g)
    w, grad = torch.randn(32, generator=g), torch.randn(3, 7, 32, generator=g)
    results = []
    for view in (lambda t: t, lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)):
        xi, wi = view(x).requires_grad_(), w.clone().requires_grad_()
        out = ops.rms_norm(xi, wi, 1e-6)
        assert "RMSNorm" in type(out.grad_fn).__name__ and out.stride() == xi.stride()
        results.append((out, *torch.autograd.grad(out, (xi, wi), view(grad))))
    assert all(torch.equal(a, b) for a, b in zip(*results))
