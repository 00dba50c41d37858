"""DeepSeek-V3's GPU kernels compiled on a CUDA device: the Triton sigmoid router's selection and the
interleaved RoPE of MLA's strided slices, against the eager references. Skipped without one; the
interpreted tests (tests/test_triton_sigmoid_router.py, tests/test_triton_rope.py) run everywhere, and
`benchmarks/gpu_session.sh` runs this file with tests/test_cuda.py. Nothing here imports a kernel module
interpreted, so the kernels are the compiled ones."""

import pytest
import torch

from moetron.ops.functional import _rope_ref
from router_reference import sigmoid_selection as _eager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("T", [16384, 4099])
def test_compiled_on_a_gpu_it_agrees_with_the_eager_selection(T):
    """DeepSeek-V3's shape (256 experts, 8 groups, the best 4, top-8) compiled on a GPU."""
    from moetron.kernels import triton_router

    g = torch.Generator(device="cuda").manual_seed(T)
    # distinct scores a row (a random order of E steps): no exact ties, whose order torch.topk leaves open
    scores = torch.sigmoid((torch.rand(T, 256, device="cuda", generator=g).argsort(-1).float() - 128) * 0.01)
    bias = (torch.rand(256, device="cuda", generator=g).argsort().float() - 128) * 1e-4
    grad_w = torch.randn(T, 8, device="cuda", generator=g)
    idx_ref, w_ref, counts_ref, ds_ref = _eager(scores, bias, 8, 8, 4, True, 2.5, grad_w)
    w, idx, counts = triton_router.sigmoid_forward(scores, bias, 8, 8, 4, True, 2.5)
    assert torch.equal(idx, idx_ref) and torch.equal(counts, counts_ref)
    torch.testing.assert_close(w, w_ref, rtol=5e-7, atol=0)
    ds = triton_router.sigmoid_backward(grad_w, scores, idx, True, 2.5)
    torch.testing.assert_close(ds, ds_ref, rtol=1e-6, atol=1e-6 * ds_ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_interleaved_rope_of_mla_matches_the_reference(dtype):
    """Compiled on a GPU, DeepSeek-V3's q rotary slice ([4, 2048, 16, 192] seen as [B, H, S, D], its last 64):
    bf16 the reference's bits, fp32 within 1 ulp (the GPU may fuse the multiply-add)."""
    from moetron.kernels import triton_rope

    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4, 2048, 16, 192, device="cuda", generator=g).to(dtype)
    angles = torch.rand(1, 2048, 32, device="cuda", generator=g, dtype=torch.float64) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dy = torch.randn(4, 16, 2048, 64, device="cuda", generator=g).to(dtype)
    results = []
    for fn in (lambda t: triton_rope.RopeFunction.apply(t, cos, sin, True), lambda t: _rope_ref(t, cos, sin, True)):
        leaf = base.clone().requires_grad_()
        out = fn(leaf.transpose(1, 2)[..., 128:])  # the strided slice itself, as MLA passes it
        out.backward(dy)
        results.append((out.detach(), leaf.grad))
    (out, dx), (want, want_dx) = results
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2.4e-7, atol=1e-6)
        torch.testing.assert_close(dx, want_dx, rtol=2.4e-7, atol=1e-6)
    else:
        assert torch.equal(out, want) and torch.equal(dx, want_dx)
