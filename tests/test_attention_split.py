"""The wide-op helper (moetron/kernels/threads.py) and the attention core that uses it
(moetron/kernels/sdpa_cpu.py): half of the batch on a helper thread gives torch's SDPA bit for bit,
forward and backward; the caller runs a half itself when the helper does not take it; errors reach
the caller; a forked child gets a helper of its own."""

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from moetron.kernels import sdpa_cpu, threads
from moetron.ops.attention_core import core_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture
def wide():
    threads.set_wide_threads(2)
    yield
    threads.set_wide_threads(1)


def _qkv(B, H, KV, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    # [B, S, heads, D] memory seen as [B, heads, S, D], as the model's projections hand them over
    q, k, v = (torch.randn(B, S, h, D, generator=g).transpose(1, 2).requires_grad_() for h in (H, KV, KV))
    return q, k, v, torch.randn(B, S, H, D, generator=g).transpose(1, 2)


@pytest.mark.parametrize("shape", [(8, 4, 2, 128, 16), (3, 4, 4, 33, 8), (2, 8, 2, 64, 32)])
def test_split_attention_is_torch_sdpa_bit_for_bit(wide, monkeypatch, shape):
    sides = []
    run = threads.run_beside
    monkeypatch.setattr(sdpa_cpu, "run_beside", lambda a, b: sides.append(1) or run(a, b))
    q, k, v, dout = _qkv(*shape)
    out = core_attention(q, k, v, 0.3)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=shape[1] != shape[2])
    want = torch.autograd.grad(ref, (q, k, v), dout)
    assert sides == [1, 1]  # the forward and the backward each ran two halves
    assert torch.equal(out, ref) and out.stride() == ref.stride()  # o_proj reads it without a copy
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_split_attention_applies_only_with_a_helper_to_fp32_causal_batches(wide):
    q, k, v, _ = _qkv(2, 4, 2, 16, 8)
    assert sdpa_cpu.applies(q, k, v)
    assert not sdpa_cpu.applies(q[:1], k[:1], v[:1])  # one sequence: nothing to split
    assert not sdpa_cpu.applies(q.double(), k.double(), v.double())
    assert not sdpa_cpu.applies(q, k[..., :8, :], v[..., :8, :])  # fewer keys than queries
    assert not sdpa_cpu.applies(q, k, v[..., :4])  # MLA's shorter v heads: SDPA's own choice
    with torch.autocast("cpu", dtype=torch.bfloat16):  # SDPA would run in bf16 there
        assert not sdpa_cpu.applies(q, k, v)
    threads.set_wide_threads(1)
    assert not sdpa_cpu.applies(q, k, v)


def test_the_caller_runs_the_side_half_when_the_helper_does_not(monkeypatch):
    ran = []
    monkeypatch.setattr(threads._helper, "submit", lambda task: None)  # a helper that never gets a core
    assert threads.run_beside(lambda: ran.append("main") or 1, lambda: ran.append("side") or 2) == (1, 2)
    assert ran == ["main", "side"]


def test_the_helper_runs_the_side_half_in_the_callers_grad_mode_and_hands_back_its_error():
    names, modes = [], []

    def side():
        names.append(threading.current_thread().name)
        modes.append(torch.is_grad_enabled())
        return 2

    started = threading.Event()
    with torch.no_grad():  # the main half waits until the helper has taken the side half
        assert threads.run_beside(lambda: started.wait(5) and 1, lambda: started.set() or side()) == (1, 2)
    assert names == ["moetron-wide-op"] and modes == [False]
    failing = threading.Event()

    def fails():
        failing.set()  # the helper has taken it: the caller must wait for it and raise its error
        raise ValueError("from the helper")

    with pytest.raises(ValueError, match="from the helper"):
        threads.run_beside(lambda: failing.wait(5), fails)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_helper_of_its_own():
    threads.run_beside(lambda: 1, lambda: 2)  # the parent's helper exists
    pid = os.fork()
    if pid == 0:  # the child: its helper must start, or the main half would never see the side half taken
        ok = False
        try:
            started = threading.Event()
            ok = threads.run_beside(lambda: started.wait(5), lambda: started.set() or 2) == (True, 2)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
