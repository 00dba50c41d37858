"""moetron's `deepep` flex backend against the CPU fake of DeepEP (tests/fakes/deep_ep, DeepEP 2.1.0 at
dd758caf) on 2 and 4 gloo ranks, compared with the `torch` backend.

Bitwise where the math is the same: layout, normal dispatch (rows, local ids, weights, counts, cached,
async), combine (fp32 sums over destination ranks in rank order, rounded once to bf16), FP8 dispatch of
(q, scales) pairs, the whole FlexTokenDispatcher (etp 1 and 2) with its gradients, and the low-latency
rows and counts compared order-independently (DeepEP packs blocks in arrival order). Tolerances: the
low-latency combine sums k weighted bf16 rows in fp32 in both backends (fake: in slot order), equal
within 1 bf16 ulp (2^-8 relative); low-latency FP8 (DeepEP's x*(448/amax) cast) within the E4M3
bound of the bf16 rows. Also: one shared Buffer for a 4-layer model, and every DeepEP limit refused
by moetron before the fake's own host assert could fire.
"""

from __future__ import annotations

import gc
import re
import sys

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_flex_dispatcher import assert_fp8_close, draw_routing

import fakes
from moetron.dispatch import flex_deepep
from moetron.dispatch.flex import FlexBuffer, FlexTokenDispatcher
from moetron.dispatch.fp8_dispatch import dequantize_rows
from moetron.dispatch.routing import Routing
from moetron.parallel.state import Group

E, K = 8, 3


def install_fake():
    if fakes.FAKES_DIR not in sys.path:
        sys.path.insert(0, fakes.FAKES_DIR)
    import deep_ep
    assert deep_ep.MOETRON_CPU_FAKE
    return deep_ep


def bf16_inputs(seed, rank, T, H, allowed):
    idx, w = draw_routing(seed, rank, T, allowed)
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return idx, w, x


def sorted_rows(rows):
    """Rows in a canonical order (lexicographic on their first two columns): order-independent compare."""
    if rows.shape[0] == 0:
        return rows
    order = torch.argsort(rows[:, 1].float(), stable=True)
    rows = rows[order]
    return rows[torch.argsort(rows[:, 0].float(), stable=True)]


def check_normal(me, R, deep_ep):
    H = 16
    group = dist.group.WORLD
    ref, dep = FlexBuffer(group, E), FlexBuffer(group, E, backend="deepep")
    idx, w, x = bf16_inputs(1, me, 7 + me, H, list(range(E)))
    lay_r, lay_d = ref.get_dispatch_layout(idx)[:3], dep.get_dispatch_layout(idx)[:3]
    assert all(torch.equal(a, b) for a, b in zip(lay_r, lay_d))
    assert not deep_ep.live_buffers(), "the layout built a Buffer for hidden 0"
    args = (idx, w, lay_r[0], lay_r[2], lay_r[1])
    xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    wr, wd = w.clone().requires_grad_(), w.clone().requires_grad_()
    out_r = ref.dispatch(xr, idx, wr, *args[2:])
    out_d = dep.dispatch(xd, idx, wd, *args[2:], async_finish=True)
    if out_d[0].shape[0]:
        assert torch.isnan(out_d[0]).all(), "async outputs must be poisoned until the event is waited"
    out_d[5].wait()
    for a, b in zip(out_r[:3], out_d[:3]):
        assert torch.equal(a, b)
    assert out_r[3] == out_d[3] and out_d[0].dtype == torch.bfloat16 and out_d[1].dtype == torch.int64
    # backward of dispatch = combine (x and gate weights), bitwise
    g = torch.randn(out_r[0].shape, generator=torch.Generator().manual_seed(me)).to(torch.bfloat16)
    gw = torch.randn(out_r[2].shape, generator=torch.Generator().manual_seed(me + 9))
    ((out_r[0].float() * g.float()).sum() + (out_r[2] * gw).sum()).backward()
    ((out_d[0].float() * g.float()).sum() + (out_d[2] * gw).sum()).backward()
    assert torch.equal(xr.grad, xd.grad), (xr.grad - xd.grad).abs().max()
    assert torch.equal(wr.grad, wd.grad), (wr.grad, wd.grad)
    # combine with weights, cached dispatch, async combine
    y = (out_r[0].float() * 1.5 + 0.25).to(torch.bfloat16)
    c_r = ref.combine(y, out_r[4], out_r[2].detach())
    c_d = dep.combine(y, out_d[4], out_d[2].detach(), async_finish=True)
    assert torch.isnan(c_d[0]).any() == (c_d[0].shape[0] > 0)
    c_d[2].wait()
    assert torch.equal(c_r[0], c_d[0]) and torch.equal(c_r[1], c_d[1])
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + me)).to(torch.bfloat16)
    assert torch.equal(ref.dispatch(x2, handle=out_r[4])[0], dep.dispatch(x2, handle=out_d[4])[0])
    # FP8 dispatch: (q, scales) pairs move bit for bit
    H8 = 256
    idx8, w8, x8 = bf16_inputs(2, me, 5, H8, list(range(E)))
    r8, d8 = FlexBuffer(group, E, fp8=True), FlexBuffer(group, E, backend="deepep", fp8=True)
    lay = r8.get_dispatch_layout(idx8)[:3]
    a = r8.dispatch(x8, idx8, w8, lay[0], lay[2], lay[1])
    b = d8.dispatch(x8, idx8, w8, lay[0], lay[2], lay[1], async_finish=True)
    b[5].wait()
    assert torch.equal(a[0], b[0]) and a[0].dtype == torch.bfloat16


def expert_layer(x_NH, rows, w1, w2):
    from moetron.moe.grouped_gemm import grouped_linear
    return grouped_linear(torch.nn.functional.silu(grouped_linear(x_NH, w1, rows)), w2, rows)


def check_token_dispatcher(me, R, etp):
    H, F = 16, 8
    L = E // (R // etp)
    idx, w, x = bf16_inputs(3 + etp, me, 6, H, list(range(E)))
    g = torch.Generator().manual_seed(11)
    w1 = (torch.randn(L, F, H, generator=g) * 0.3).to(torch.bfloat16)
    w2 = (torch.randn(L, H, F, generator=g) * 0.3).to(torch.bfloat16)
    results = []
    for backend in ("torch", "deepep"):
        disp = FlexTokenDispatcher(dist.group.WORLD, E, etp=etp, backend=backend, top_k=K)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        l1, l2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        x_NH, rows, handle = disp.dispatch(xx, Routing(idx, ww, torch.bincount(idx[idx >= 0], minlength=E), E))
        out = disp.combine(expert_layer(x_NH, rows, l1, l2), handle)
        out.float().sum().backward()
        results.append([out, xx.grad, ww.grad, l1.grad, l2.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def check_low_latency(me, R, deep_ep):
    H, M = 2048, 8
    group = dist.group.WORLD
    ref, dep = FlexBuffer(group, E), FlexBuffer(group, E, backend="deepep")
    idx, w, x = bf16_inputs(5, me, 6, H, list(range(E)))
    x[:, 0], x[:, 1] = me, torch.arange(x.shape[0])  # each row names its source rank and token
    L = E // R
    with torch.no_grad():
        r_x, r_count, r_handle, _, _ = ref.low_latency_dispatch(x, idx, M, E)
        d_x, d_count, d_handle, d_event, _ = dep.low_latency_dispatch(x, idx, M, E, async_finish=True)
        assert (d_count == -7777).all(), "the count is poisoned until the event is waited"
        d_event.wait()
        assert torch.equal(r_count, d_count)
        for j in range(L):
            c = int(r_count[j])
            assert torch.equal(sorted_rows(r_x[j, :c]), sorted_rows(d_x[j, :c]))
        scale = (torch.arange(me * L, (me + 1) * L) + 1).to(torch.bfloat16).view(L, 1, 1)
        r_out = ref.low_latency_combine(r_x * scale, idx, w, r_handle)[0]
        d_out, _, hook = dep.low_latency_combine(d_x * scale, idx, w, d_handle, return_recv_hook=True)
        assert torch.isnan(d_out).all() == (d_out.shape[0] > 0)
        hook()
        err = (r_out.float() - d_out.float()).abs()
        assert bool((err <= 2.0 ** -8 * r_out.float().abs()).all())
        # FP8: column-major scales as DeepEP returns them, dequantized within the E4M3 bound
        for backend in (ref, dep):
            (q, s), count, *_ = backend.low_latency_dispatch(x, idx, M, E, use_fp8=True, round_scale=True)
            assert s.shape == (L, R * M, H // 128) and s.stride(1) == 1, "scales are column-major"
            for j in range(L):
                c = int(count[j])
                assert_fp8_close(sorted_rows(dequantize_rows(q[j, :c], s[j, :c], torch.float32)),
                                 sorted_rows(r_x[j, :c]).float(), power_of_two=True)


def check_limits(me, R, deep_ep):
    group = dist.group.WORLD
    fired = len(deep_ep.host_asserts)
    dep = FlexBuffer(group, E, backend="deepep")
    idx, w, x = bf16_inputs(6, me, 4, 16, list(range(E)))
    lay = dep.get_dispatch_layout(idx)[:3]
    cases = [
        ("top_k\\*etp = 34 exceeds", lambda: FlexTokenDispatcher(group, E, etp=2, backend="deepep", top_k=17)),
        ("top-k columns = 33 exceeds DeepEP's 32", lambda: dep.get_dispatch_layout(torch.zeros(2, 33, dtype=torch.long))),
        ("needs topk_weights", lambda: dep.dispatch(x, idx, None, lay[0], lay[2], lay[1])),
        ("not a multiple of 16", lambda: dep.dispatch(x[:, :12].contiguous(), idx, w, lay[0], lay[2], lay[1])),
        ("bfloat16 activations", lambda: dep.dispatch(x.float(), idx, w, lay[0], lay[2], lay[1])),
    ]
    H, M = 2048, 8
    xl = torch.randn(4, H).to(torch.bfloat16)
    ll = lambda xx=xl, ii=idx, m=M, **kw: dep.low_latency_dispatch(xx, ii, m, E, **kw)  # noqa: E731
    cases += [
        ("hidden = 1024 is not one", lambda: ll(xx=xl[:, :1024].contiguous())),
        ("top-k columns = 12 exceeds DeepEP's 11", lambda: ll(ii=torch.zeros(4, 12, dtype=torch.long))),
        ("NVSHMEM_QP_DEPTH >= 1202", lambda: ll(m=600)),
        ("not both", lambda: ll(async_finish=True, return_recv_hook=True)),
        ("takes bfloat16", lambda: ll(xx=xl.float())),
        ("5 tokens exceed", lambda: ll(xx=torch.zeros(5, H, dtype=torch.bfloat16), ii=torch.zeros(5, 2, dtype=torch.long), m=4)),
    ]
    if R == 2:
        cases.append(("not a multiple of 4", lambda: ll(m=7)))
    for message, call in cases:
        try:
            with torch.no_grad():
                call()
        except ValueError as e:
            assert re.search(f"flex_backend=deepep.*{message}", str(e)), (message, str(e))
        else:
            raise AssertionError(f"not refused: {message}")
    assert len(deep_ep.host_asserts) == fired, f"the fake's assert fired: {deep_ep.host_asserts[fired:]}"
    with torch.no_grad():  # sized once: a larger M later is a clear error
        ll()
        with pytest.raises(ValueError, match="sized once for num_max_dispatch_tokens_per_rank=8"):
            ll(m=16)


def check_one_shared_buffer(me, R, deep_ep):
    from moetron.moe.config import MoEConfig
    from moetron.moe.layer import MoELayer
    from moetron.parallel.config import ParallelConfig
    from moetron.parallel.state import ParallelState

    flex_deepep.release_buffers()
    gc.collect()
    assert not deep_ep.live_buffers()
    ps = ParallelState.build(ParallelConfig(ep=R))
    cfg = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=E, top_k=2)
    layers = torch.nn.ModuleList(MoELayer(cfg, "flex", parallel_state=ps, flex_backend="deepep")
                                 for _ in range(4)).to(torch.bfloat16)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(me)).to(torch.bfloat16).requires_grad_()
    h = x
    for layer in layers:
        h = h + layer(h)
    h.float().sum().backward()
    live = deep_ep.live_buffers()
    assert len(live) == 1, f"{len(live)} DeepEP Buffers for 4 MoE layers"
    hint = deep_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(64, R)
    assert live[0].num_nvl_bytes >= hint and not live[0].low_latency_mode
    # a larger row grows the one Buffer (the old one released first)
    big = FlexBuffer(ps.tp_ep, E, backend="deepep")
    idx, w, xb = bf16_inputs(8, me, 3, 512, list(range(E)))
    lay = big.get_dispatch_layout(idx)[:3]
    big.dispatch(xb, idx, w, lay[0], lay[2], lay[1])
    gc.collect()
    old_bytes = live[0].num_nvl_bytes
    del live
    gc.collect()
    now = deep_ep.live_buffers()
    assert len(now) == 1 and now[0].num_nvl_bytes > old_bytes, ([b.num_nvl_bytes for b in now], old_bytes)


def run_all(rank, world_size):
    torch.manual_seed(0)
    deep_ep = install_fake()
    try:
        check_normal(rank, world_size, deep_ep)
        check_token_dispatcher(rank, world_size, etp=1)
        check_token_dispatcher(rank, world_size, etp=2)
        check_low_latency(rank, world_size, deep_ep)
        flex_deepep.release_buffers()
        check_limits(rank, world_size, deep_ep)
        check_one_shared_buffer(rank, world_size, deep_ep)
    finally:
        flex_deepep.release_buffers()
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_deepep_backend_equals_torch_backend_on_the_fake(world_size):
    assert run_distributed(run_all, world_size, timeout=240) == [True] * world_size


@pytest.fixture
def fake_deep_ep():
    deep_ep = install_fake()
    yield deep_ep
    fakes._purge("deep_ep")
    sys.path.remove(fakes.FAKES_DIR)


def test_unsupported_group_sizes_are_refused_before_deepep(fake_deep_ep):
    for size in (1, 3, 6, 12):
        group = Group("tp_ep", tuple(range(size)), 0, None)
        with pytest.raises(ValueError, match=f"flex_backend=deepep: the dispatch group .TP x EP. has {size} ranks"):
            FlexBuffer(group, 24, backend="deepep")
    with pytest.raises(ValueError, match="experts per rank"):
        FlexBuffer(Group("tp_ep", (0, 1), 0, None), 4096, backend="deepep")
    assert not fake_deep_ep.host_asserts
