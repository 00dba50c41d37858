"""The Triton RoPE kernels (`train.fusion=triton`, the GPU default through `auto`), run under
TRITON_INTERPRET=1, against the eager reference (`_rope_ref` forward, `_RopeFunction`'s backward):
the same bits in bf16, fp16 and fp32 (each product and the sum rounded as torch's ops round them),
on contiguous and transposed (Qwen3's q/k) inputs, one cos/sin for the batch or one per sequence;
the output and gradient keep x's strides. tests/test_cuda.py runs the compiled kernels on a GPU."""

import pytest
import torch

from triton_utils import interpreted_kernels, load_triton_interpreted
from moetron import ops
from moetron.ops.functional import _rope_eager, _rope_ref

pytestmark = pytest.mark.usefixtures("one_thread")

k = interpreted_kernels("moetron.kernels.triton_rope")  # the kernels, or a skip saying why


def _inputs(B, H, S, D, dtype, transposed, batch_cos, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # [B, S, H, D] seen as [B, H, S, D], as attention.py's q/k after the norm
        x = torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(B, H, S, D, generator=g).to(dtype)
    angles = torch.rand(B if batch_cos else 1, S, D // 2, generator=g, dtype=torch.float64) * 6.3
    angles = torch.cat((angles, angles), dim=-1)  # halves layout: each frequency twice
    return x, angles.cos().to(dtype), angles.sin().to(dtype), torch.randn(B, H, S, D, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, H, S, D, transposed, batch_cos", [(2, 4, 5, 16, True, False), (1, 3, 7, 64, False, True),
                                                                (2, 40, 3, 128, True, True)])  # 40 heads: two programs
def test_forward_and_backward_have_the_references_bits(k, dtype, B, H, S, D, transposed, batch_cos):
    x, cos, sin, dy = _inputs(B, H, S, D, dtype, transposed, batch_cos, seed=H)
    results = []
    for fn in (k.RopeFunction.apply, lambda x, c, s: _rope_eager(x, c, s, False)):
        xi = x.detach().clone().requires_grad_() if not transposed else \
            x.detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_()
        out = fn(xi, cos, sin)
        out.backward(dy)
        results.append((out.detach(), xi.grad))
    (out, dx), (want, want_dx) = results
    assert torch.equal(out, _rope_ref(x, cos, sin, False)) and torch.equal(out, want)
    assert torch.equal(dx, want_dx)
    assert out.stride() == x.stride() and dx.stride() == x.stride()  # no copy on the way to the norm


def test_refused_inputs_go_eager_and_bad_ones_are_named(k):
    x, cos, sin, _ = _inputs(1, 2, 3, 8, torch.float32, False, False)
    assert k.applies(x, cos, sin)
    assert not k.applies(x[..., :7], cos[..., :7], sin[..., :7])  # odd head dim
    assert not k.applies(x, cos.double(), sin.double())  # dtype apart from x's
    assert not k.applies(x[:, :, ::2], cos[:, ::2], sin[:, ::2])  # x with gaps
    assert not k.applies(x, cos.requires_grad_(), sin)
    with pytest.raises(ValueError, match=r"RoPE \(triton\) takes x \[B, H, S, D\]"):
        k.RopeFunction.apply(x[..., :7], cos[..., :7], sin[..., :7])


def test_apply_rope_goes_through_it_under_triton_fusion(k, monkeypatch):
    calls = []
    monkeypatch.setattr(k.RopeFunction, "apply", lambda x, c, s, inter=False: calls.append(1) or _rope_ref(x, c, s, inter))
    x, cos, sin, _ = _inputs(1, 2, 3, 8, torch.float32, True, False)
    ops.set_fusion("triton")
    try:
        out = ops.apply_rope(x, cos, sin)
        interleaved = ops.apply_rope(x, cos, sin, interleaved=True)  # the DeepSeek layout too
        bf16 = ops.apply_rope(x, cos.bfloat16(), sin.bfloat16())  # cos/sin of another dtype than x's: eager
    finally:
        ops.set_fusion("none")
    assert calls == [1, 1] and torch.equal(out, _rope_ref(x, cos, sin, False))
    assert torch.equal(interleaved, _rope_ref(x, cos, sin, True))
    assert bf16.dtype == torch.float32


def test_a_qwen3_model_under_triton_fusion_trains_as_eager(k, monkeypatch):
    """Its norms, RoPE and loss through the interpreted Triton kernels (RMSNorm, RoPE, cross-entropy; the
    router and SwiGLU stay eager on CPU tensors): the eager model's loss and gradients within fp32 noise."""
    from moetron.config import ModelConfig
    from moetron.model.model import MoETransformer

    (ce, _), (norm, _) = (load_triton_interpreted(f"moetron.kernels.triton_{n}") for n in ("cross_entropy", "rmsnorm"))
    calls = []

    def counted(real, label):
        return lambda *a: (calls.append(label), real(*a))[1]

    for owner, name, label in ((k.RopeFunction, "apply", "rope"), (ce, "cross_entropy", "cross_entropy"),
                               (norm.RMSNormFunction, "apply", "rms_norm")):
        monkeypatch.setattr(owner, name, counted(getattr(owner, name), label))

    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=2,
                      num_kv_heads=1, head_dim=16, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                      top_k=2)
    model = MoETransformer(cfg)
    ids = torch.randint(0, 64, (2, 12))
    labels = ids.clone()
    labels[:, 0] = -100
    runs = {}
    for mode in ("triton", "none"):
        ops.set_fusion(mode)
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels)
        out.loss.backward()
        runs[mode] = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                      type(out.loss.grad_fn).__name__)
    (loss, grads, fn), (want, want_grads, _) = runs["triton"], runs["none"]
    assert fn.startswith("Div") and loss.dtype == torch.float32  # the summed loss over the token count
    # per layer 2 norms and q, k norm + RoPE; the final norm; the loss
    assert sorted(set(calls)) == ["cross_entropy", "rms_norm", "rope"] and len(calls) == 2 * 6 + 2
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interleaved_pairs_of_mla_slices_have_the_references_bits(k, dtype):
    """DeepSeek-V3's RoPE: q's rotary 8 of 24 per head (a strided slice) and the shared key [B, 1, S, 8] (a
    slice of kv_a's output), the pairs (x[2i], x[2i+1]) rotated and written in halves layout: the eager
    reference's output and gradient bit for bit."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 5, 4, 24, generator=g).to(dtype).transpose(1, 2)[..., 16:]
    kr = torch.randn(2, 5, 40, generator=g).to(dtype)[..., 32:].view(2, 1, 5, 8)
    angles = torch.rand(1, 5, 4, generator=g, dtype=torch.float64) * 6.3
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    for x in (q, kr):
        assert k.applies(x, cos, sin, interleaved=True) and not k.applies(x, cos, sin)  # a slice: interleaved only
        dy = torch.randn(x.shape, generator=g).to(dtype)
        results = []
        for fn in (lambda t: k.RopeFunction.apply(t, cos, sin, True), lambda t: _rope_ref(t, cos, sin, True)):
            xi = x.detach().clone().requires_grad_()
            out = fn(xi)
            out.backward(dy)
            results.append((out.detach(), xi.grad))
        (out, dx), (want, want_dx) = results
        assert torch.equal(out, want) and torch.equal(dx, want_dx)
        assert not torch.equal(out, _rope_ref(x, cos, sin, False))  # the pairs really are interleaved

