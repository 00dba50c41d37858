"""The C++ kernels' default-target loops (csrc/simd_math.h): a CPU without AVX2+FMA runs them, and
`MOETRON_NO_FMA=1` makes this one run them too. The SwiGLU, causal attention and cross-entropy
computed both ways in fresh processes each stay within their bounds of a float64 reference, and the
two ways really are different code (FMA rounds differently somewhere)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("cpp_kernels")  # conftest.py

SCRIPT = r"""
import sys
import torch
from moetron.kernels import attention_cpu, cpp_build, cross_entropy_cpu

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
gate_up, probs = torch.randn(300, 2 * 48, generator=g), torch.rand(300, generator=g)
q, k, v = (torch.randn(2, 37, h, 16, generator=g).transpose(1, 2) for h in (4, 2, 2))
dout = torch.randn(2, 4, 37, 16, generator=g)
out = {"gate_up": gate_up, "probs": probs, "q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(),
       "dout": dout}
out["swiglu"] = cpp_build.load_swiglu_ops().forward(gate_up, probs)
qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
o = attention_cpu.CausalAttention.apply(qq, kk, vv, 0.25)
o.backward(dout)
out.update(attention=o.detach().contiguous(), dq=qq.grad.contiguous(), dk=kk.grad.contiguous(), dv=vv.grad.contiguous())
logits, labels = (torch.randn(50, 77, generator=g) * 3).requires_grad_(), torch.randint(0, 77, (50,), generator=g)
loss = cross_entropy_cpu.cross_entropy(logits, labels, -100)
loss.backward()
out.update(logits=logits.detach(), labels=labels, ce=loss.detach(), dlogits=logits.grad)
torch.save(out, sys.argv[1])
"""


def _run(tmp_path, no_fma: bool) -> dict:
    env = dict(os.environ)
    env.pop("MOETRON_NO_FMA", None)
    if no_fma:
        env["MOETRON_NO_FMA"] = "1"
    path = tmp_path / f"no_fma_{no_fma}.pt"
    subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, check=True, timeout=300)
    return torch.load(path, weights_only=True)


def _close(got, want, rel, what):
    scale = want.abs().max()
    assert scale > 0.1, f"{what}: compared on near-zero values"
    assert (got.double() - want).abs().max() <= rel * scale, what


def _check(r: dict, how: str) -> None:
    gu, p = r["gate_up"].double(), r["probs"].double()
    gate, up = gu.chunk(2, dim=-1)
    _close(r["swiglu"], F.silu(gate) * up * p[:, None], 4e-6, f"swiglu ({how})")
    q, k, v = (r[n].double().requires_grad_() for n in ("q", "k", "v"))
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = (q @ kk.transpose(-1, -2)) * 0.25
    s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ vv
    ref.backward(r["dout"].double())
    _close(r["attention"], ref, 4e-6, f"attention ({how})")
    for name, want in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        _close(r[name], want, 8e-6, f"{name} ({how})")
    logits = r["logits"].double().requires_grad_()
    ce = F.cross_entropy(logits, r["labels"], reduction="sum")
    ce.backward()
    _close(r["ce"], ce.detach(), 1e-6, f"cross-entropy ({how})")
    _close(r["dlogits"], logits.grad, 4e-6, f"cross-entropy gradient ({how})")


def test_default_loops_and_fma_loops_are_both_within_bounds(tmp_path):
    plain, fma = _run(tmp_path, no_fma=True), _run(tmp_path, no_fma=False)
    _check(plain, "MOETRON_NO_FMA=1")
    _check(fma, "this CPU's loops")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2" in flags and " fma" in flags:  # then the two runs took different code
        assert any(not torch.equal(plain[n], fma[n]) for n in ("swiglu", "attention", "dq", "dk", "dv", "dlogits"))
