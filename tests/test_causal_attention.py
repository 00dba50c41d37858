"""moetron's C++ causal attention (moetron/kernels/attention_cpu.py, csrc/causal_attention_cpu.cpp):
output, log-sum-exp and the three gradients against a float64 reference (GQA, sequences that are not
a multiple of the kernel's blocks, head dims up to 128, v's head dim apart from q's (MLA), the model's
strided layouts); helper tasks and
intra-op threads give the bits of one thread; `core_attention` takes it only under the C++ fusion and where it applies; the
C++ checks name what is wrong."""

import pytest
import torch

from moetron.kernels import attention_cpu
from moetron.ops import set_fusion
from moetron.ops.attention_core import core_attention

pytestmark = pytest.mark.usefixtures("one_thread", "cpp_kernels")  # conftest.py


def _qkv(B, H, KV, S, D, seed=0, Dv=None):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    # [B, S, heads, D] memory seen as [B, heads, S, D], as the model's projections hand them over
    q, k, v = (torch.randn(B, S, h, d, generator=g).transpose(1, 2).requires_grad_()
               for h, d in ((H, D), (KV, D), (KV, Dv)))
    return q, k, v, torch.randn(B, S, H, Dv, generator=g).transpose(1, 2)


def _reference(q, k, v, scale):
    """float64 softmax attention with each kv head repeated for its query heads, and the log-sum-exp."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) * scale
    S = q.shape[2]
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _close(got, want, what, rel=2e-6):
    scale = want.abs().max()
    assert scale > 0.1, f"{what}: compared on near-zero values"
    err = (got.double() - want).abs().max()
    assert err <= rel * scale, f"{what}: max error {err:.3g} against {scale:.3g}"


@pytest.mark.parametrize("shape", [(8, 4, 2, 128, 16), (2, 4, 4, 37, 32), (3, 6, 2, 64, 64), (1, 2, 1, 5, 16),
                                   (2, 8, 1, 1, 32), (1, 4, 2, 61, 48), (1, 2, 1, 30, 128), (2, 2, 1, 19, 8),
                                   # MLA: q/k 24 (nope 16 + rope 8), v 16, as the DeepSeek-V3 proxy; and the other way
                                   (8, 4, 4, 128, 24, 16), (2, 4, 2, 37, 16, 40), (1, 2, 2, 33, 120, 128)])
def test_matches_float64_attention(shape):
    q, k, v, dout = _qkv(*shape[:5], Dv=shape[5] if len(shape) > 5 else None)
    scale = shape[-1] ** -0.5
    out = attention_cpu.CausalAttention.apply(q, k, v, scale)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, lse = _reference(qd, kd, vd, scale)
    want = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    _close(out, ref, "output")
    assert out.transpose(1, 2).is_contiguous()  # o_proj reads [B, S, heads * d] without a copy
    for got, w, name in zip(grads, want, ("dq", "dk", "dv")):
        assert got.shape == w.shape
        if name in ("dq", "dk") and shape[3] == 1:  # one key: its probability is 1 whatever q and k are
            assert got.abs().max() < 1e-6  # dout . v - dout . out, summed in two orders
        else:
            _close(got, w, name, rel=4e-6)


def test_the_log_sum_exp_it_saves_and_the_causal_mask():
    q, k, v, _ = _qkv(2, 4, 2, 24, 16, seed=1)
    out, lse = q.new_empty(2, 24, 4, 16).transpose(1, 2), q.new_empty(2, 4, 24)
    attention_cpu.ops().causal_forward(q.detach(), k.detach(), v.detach(), 0.25, out, lse)
    ref, ref_lse = _reference(q.detach(), k.detach(), v.detach(), 0.25)
    _close(lse, ref_lse, "log-sum-exp")
    _close(out, ref, "output")
    # the first query sees only the first key: its output is that key's value row
    assert torch.allclose(out[:, :, 0], v.detach().repeat_interleave(2, dim=1)[:, :, 0], atol=1e-6)


def test_helper_tasks_and_intra_op_threads_give_the_bits_of_one_thread(monkeypatch):
    q, k, v, dout = _qkv(4, 4, 2, 33, 16, seed=2)

    def run():
        out = attention_cpu.CausalAttention.apply(q, k, v, 0.3)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    one = run()
    asked = []
    monkeypatch.setattr(attention_cpu, "helper_threads", lambda: asked.append(1) or 2)
    with_helpers = run()
    assert asked == [1, 1]  # forward and backward each hand tasks to two helpers
    monkeypatch.undo()
    torch.set_num_threads(2)
    try:
        two_threads = run()
    finally:
        torch.set_num_threads(1)
    for got in (with_helpers, two_threads):
        assert all(torch.equal(a, b) for a, b in zip(one, got))
    out, lse = q.new_empty(4, 33, 4, 16).transpose(1, 2), q.new_empty(4, 4, 33)
    with pytest.raises(RuntimeError, match="helpers must be >= 0, got -1"):
        attention_cpu.ops().causal_forward(q.detach(), k.detach(), v.detach(), 0.3, out, lse, -1)


def test_core_attention_takes_it_under_the_cpp_fusion_only():
    q, k, v, _ = _qkv(2, 4, 2, 16, 16)
    assert attention_cpu.applies(q, k, v)
    assert core_attention(q, k, v, 0.25).grad_fn.name() != "CausalAttentionBackward"
    set_fusion("cpp")  # conftest.py restores "none"
    assert core_attention(q, k, v, 0.25).grad_fn.name() == "CausalAttentionBackward"
    assert core_attention(q, k, v, 0.25, backend="eager").grad_fn.name() != "CausalAttentionBackward"
    for args in ((q.double(), k.double(), v.double()),  # fp64: torch's SDPA
                 (q[..., :12], k[..., :12], v[..., :12]),  # head dim 12 is not a multiple of 8
                 (q, k, v[..., :12]),  # nor v's
                 (q[..., :8], k, v),  # q and k of two head dims
                 (q, k[..., :8, :], v[..., :8, :])):  # fewer keys than queries
        assert not attention_cpu.applies(*args)
    assert attention_cpu.applies(q, k, v[..., :8])  # MLA: v's heads narrower than q's and k's
    mla = core_attention(q, k, v[..., :8], 0.25)
    assert mla.grad_fn.name() == "CausalAttentionBackward" and mla.shape == (2, 4, 16, 8)
    assert [d for d in range(1, 200) if attention_cpu.head_dim_runs(d)] == list(range(8, 129, 8))
    wide = _qkv(1, 2, 1, 4, 144)[:3]
    assert not attention_cpu.applies(*wide) and attention_cpu.applies(*(t[..., :128] for t in wide))
    long = [torch.empty(1, 2049, 2, 64).transpose(1, 2) for _ in range(3)]  # keys past L2: torch's kernel
    assert not attention_cpu.applies(*long) and attention_cpu.applies(*(t[:, :, :2048] for t in long))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not attention_cpu.applies(q, k, v)


def test_the_kernel_checks_its_arguments():
    q, k, v, _ = _qkv(2, 4, 2, 8, 16)
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = q.new_empty(2, 4, 8, 16), q.new_empty(2, 4, 8)
    kernel = attention_cpu.ops().causal_forward
    with pytest.raises(RuntimeError, match="q/k head dim 12 is not a multiple of 8 up to 128"):
        kernel(q[..., :12], k[..., :12], v, 1.0, out, lse)
    with pytest.raises(RuntimeError, match="v head dim 4 is not a multiple of 8 up to 128"):
        kernel(q, k, v[..., :4], 1.0, out[..., :4], lse)
    with pytest.raises(RuntimeError, match=r"k must be \[2, 2, 8, 16\]"):  # q and k share a head dim
        kernel(q, k[..., :8], v, 1.0, out, lse)
    with pytest.raises(RuntimeError, match=r"out must be \[2, 4, 8, 8\]"):  # out has v's head dim
        kernel(q, k, v[..., :8], 1.0, out, lse)
    with pytest.raises(RuntimeError, match="heads are not a multiple"):
        kernel(q[:, :3], k, v, 1.0, out[:, :3], lse[:, :3])
    with pytest.raises(RuntimeError, match="lse must be a contiguous float32 tensor of 64 elements"):
        kernel(q, k, v, 1.0, out, lse[..., :4])
    with pytest.raises(RuntimeError, match="v must be a float32 CPU tensor"):
        kernel(q, k, v.double(), 1.0, out, lse)
    with pytest.raises(RuntimeError, match="with a contiguous last dim"):
        kernel(q, k, v, 1.0, out.transpose(2, 3), lse)
