"""FlexBuffer (DeepEP-style dispatch/combine) and FlexTokenDispatcher on gloo.

The checks follow DeepEP's own tests (REFERENCE §2): every rank sends rows that carry its rank,
so each received row names its source; counts must equal all-reduced layout counts; combine of a
dispatch divided by the number of destination ranks returns the input. On top of that every
result is compared with an independent reference that each rank computes from the routing of
all ranks (drawn from shared seeds): which rows arrive in which order, their local expert ids,
gradients, the low-latency buffers, and a whole expert layer run in one process.

One spawn per world size runs all distributed checks; the backends that need GPUs (deepep,
nvshmem) can only be checked here for their "unavailable" error.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch.testing import assert_close

from moetron.dispatch.base import LocalDispatcher
from moetron.dispatch.flex import FlexBuffer, FlexTokenDispatcher
from moetron.dispatch.fp8_dispatch import FP8_E4M3_MAX, dequantize_rows, quantize_rows
from moetron.dispatch.routing import Routing
from moetron.moe.grouped_gemm import grouped_linear

E, K = 8, 3
TOKENS = {2: [7, 0], 4: [6, 0, 9, 4]}  # a rank that sends nothing


# ---- shared inputs and the reference ------------------------------------------------------------


def draw_routing(seed, rank, T, allowed_experts, dtype=torch.float32):
    """topk_idx with distinct experts per token, ~20% dropped slots and a fully dropped token."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    experts = torch.tensor(allowed_experts)
    idx = torch.stack([experts[torch.randperm(len(experts), generator=g)[:K]] for _ in range(T)]) \
        if T else torch.zeros(0, K, dtype=torch.int64)
    drop = torch.rand(T, K, generator=g) < 0.2
    if T > 2:
        drop[1] = True
    idx = idx.masked_fill(drop, -1)
    w = torch.rand(T, K, generator=g, dtype=torch.float64).to(dtype).masked_fill(idx < 0, 0)
    return idx, w


def draw_x(seed, rank, T, H, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 1000 + 500 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    x[:, 0] = rank  # every row names its source rank
    return x


def expected_receive(me, R, idxs):
    """[(src, token, local ids)] of the rows rank `me` receives, in the contract's order."""
    L = E // R
    rows = []
    for src in range(R):
        for t, experts in enumerate(idxs[src].tolist()):
            local = [e - me * L if e >= 0 and e // L == me else -1 for e in experts]
            if any(j >= 0 for j in local):
                rows.append((src, t, local))
    return rows


def setup(seed, R, H, allowed, dtype=torch.float32):
    idxs, ws, xs = [], [], []
    for r in range(R):
        i, w = draw_routing(seed, r, TOKENS[R][r], allowed, dtype)
        idxs.append(i)
        ws.append(w)
        xs.append(draw_x(seed, r, TOKENS[R][r], H, dtype))
    return idxs, ws, xs


# ---- distributed checks -------------------------------------------------------------------------


def check_contract(flex, me, R, seed, allowed):
    H = 16
    idxs, ws, xs = setup(seed, R, H, allowed)
    idx, w, x = idxs[me], ws[me], xs[me]
    L = E // R
    per_rank, per_expert, in_rank, _ = flex.get_dispatch_layout(idx, E)

    # layout against loops over the routing
    ref_in_rank = torch.zeros(len(idx), R, dtype=torch.bool)
    ref_per_expert = torch.zeros(E, dtype=torch.int64)
    for t, experts in enumerate(idx.tolist()):
        for e in experts:
            if e >= 0:
                ref_in_rank[t, e // L] = True
                ref_per_expert[e] += 1
    assert torch.equal(in_rank, ref_in_rank)
    assert per_expert.tolist() == ref_per_expert.tolist()
    assert per_rank.tolist() == ref_in_rank.sum(0).tolist()

    recv_x, recv_idx, recv_w, counts, handle, event = flex.dispatch(
        x, idx, w, per_rank, in_rank, per_expert)
    assert event.done

    # counts equal all-reduced layout counts
    total_rank, total_expert = per_rank.long().clone(), per_expert.long().clone()
    dist.all_reduce(total_rank)
    dist.all_reduce(total_expert)
    assert recv_x.shape[0] == int(total_rank[me])
    assert counts == total_expert[me * L:(me + 1) * L].tolist()
    assert counts == [int((recv_idx == j).sum()) for j in range(L)]

    # every row arrives intact from its source, with exact local ids and masked weights
    rows = expected_receive(me, R, idxs)
    assert recv_x[:, 0].tolist() == [float(src) for src, _, _ in rows]  # DeepEP's rank check
    ref_x = torch.stack([xs[s][t] for s, t, _ in rows]) if rows else x.new_zeros(0, H)
    assert torch.equal(recv_x, ref_x)
    assert recv_idx.tolist() == [local for _, _, local in rows]
    ref_w = torch.stack([torch.where(torch.tensor(loc) >= 0, ws[s][t], 0.0) for s, t, loc in rows]) \
        if rows else w.new_zeros(0, K)
    assert torch.equal(recv_w, ref_w)

    # combine of a dispatch / number of destination ranks returns the input
    combined, combined_w, _ = flex.combine(recv_x, handle, recv_w)
    ndest = in_rank.sum(1, keepdim=True)
    assert_close(combined[ndest[:, 0] > 0] / ndest[ndest[:, 0] > 0], x[ndest[:, 0] > 0], rtol=1e-6, atol=0)
    assert torch.equal(combined[ndest[:, 0] == 0], torch.zeros_like(x[ndest[:, 0] == 0]))
    assert_close(combined_w, w, rtol=1e-6, atol=0)

    # a cached handle reuses the layout and delivers what a fresh dispatch does
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + me))
    cached, none_idx, _, none_counts, _, _ = flex.dispatch(x2, handle=handle)
    fresh = flex.dispatch(x2, idx, w, per_rank, in_rank, per_expert)[0]
    assert none_idx is None and none_counts is None and torch.equal(cached, fresh)

    # async: nothing may be used before wait; then the same results
    a_x, a_idx, a_w, a_counts, a_handle, a_event = flex.dispatch(
        x, idx, w, per_rank, in_rank, per_expert, async_finish=True)
    assert not a_event.done
    with pytest.raises(RuntimeError, match="not waited"):
        flex.combine(a_x, a_handle)
    a_event.wait()
    assert torch.equal(a_x, recv_x) and torch.equal(a_idx, recv_idx) and torch.equal(a_w, recv_w)
    assert a_counts == counts
    c_x, c_w, c_event = flex.combine(a_x, a_handle, a_w, async_finish=True)
    c_event.wait()
    assert torch.equal(c_x, combined) and torch.equal(c_w, combined_w)
    a_cached, *_, ev = flex.dispatch(x2, handle=handle, async_finish=True)
    ev.wait()
    assert torch.equal(a_cached, cached)

    # expert_alignment rounds the per-expert counts up (DeepEP)
    aligned = flex.dispatch(x, idx, w, per_rank, in_rank, per_expert, expert_alignment=4)[3]
    assert aligned == [-(-c // 4) * 4 for c in counts]
    return recv_x, recv_idx, recv_w, counts


def check_backward(flex, me, R, seed, async_finish):
    """fp64 gradients of dispatch (x and gate weights) and combine vs the index reference."""
    H = 8
    idxs, ws, xs = setup(seed, R, H, list(range(E)), torch.float64)
    rows_of = [expected_receive(d, R, idxs) for d in range(R)]

    def grads_for(d, shape_cols):
        g = torch.Generator().manual_seed(seed * 7 + d * 31 + shape_cols)
        return torch.randn(len(rows_of[d]), shape_cols, generator=g, dtype=torch.float64)

    x = xs[me].clone().requires_grad_()
    w = ws[me].clone().requires_grad_()
    idx = idxs[me]
    layout = flex.get_dispatch_layout(idx)[:3]
    recv_x, recv_idx, recv_w, _, handle, event = flex.dispatch(
        x, idx, w, layout[0], layout[2], layout[1], async_finish=async_finish)
    event.wait()
    ((recv_x * grads_for(me, H)).sum() + (recv_w * grads_for(me, K)).sum()).backward()
    ref_gx, ref_gw = torch.zeros_like(x), torch.zeros_like(w)
    for d in range(R):
        gx, gw = grads_for(d, H), grads_for(d, K)
        for row, (src, t, local) in enumerate(rows_of[d]):
            if src == me:
                ref_gx[t] += gx[row]
                ref_gw[t] += torch.where(torch.tensor(local) >= 0, gw[row], 0.0)
    assert_close(x.grad, ref_gx, rtol=1e-12, atol=1e-12)
    assert_close(w.grad, ref_gw, rtol=1e-12, atol=1e-12)

    # combine: each received row gets its source token's gradient
    y = recv_x.detach().clone().requires_grad_()
    yw = recv_w.detach().clone().requires_grad_()
    out, out_w, ev = flex.combine(y, handle, yw, async_finish=async_finish)
    ev.wait()
    gc = [torch.randn(TOKENS[R][r], H, generator=torch.Generator().manual_seed(seed + 99 + r),
                      dtype=torch.float64) for r in range(R)]
    gcw = [torch.randn(TOKENS[R][r], K, generator=torch.Generator().manual_seed(seed + 77 + r),
                       dtype=torch.float64) for r in range(R)]
    ((out * gc[me]).sum() + (out_w * gcw[me]).sum()).backward()
    rows = rows_of[me]
    ref_gy = torch.stack([gc[s][t] for s, t, _ in rows]) if rows else y.new_zeros(0, H)
    ref_gyw = torch.stack([gcw[s][t] for s, t, _ in rows]) if rows else yw.new_zeros(0, K)
    assert_close(y.grad, ref_gy, rtol=0, atol=0)
    assert_close(yw.grad, ref_gyw, rtol=0, atol=0)


def check_low_latency(flex, me, R, seed, normal):
    recv_x, recv_idx, _, counts = normal
    H, L, M = 16, E // R, 10
    idxs, ws, xs = setup(seed, R, H, list(range(E)))
    idx, w, x = idxs[me], ws[me], xs[me]
    with torch.no_grad():
        ll_x, ll_count, handle, event, hook = flex.low_latency_dispatch(x, idx, M, E)
        assert ll_x.shape == (L, R * M, H) and ll_count.dtype == torch.int32
        assert ll_count.tolist() == counts
        for j in range(L):  # the valid rows in any (arrival) order: rows past the count are undefined
            c = counts[j]
            assert torch.equal(in_source_order(ll_x[j, :c], handle, j), recv_x[(recv_idx == j).any(1)])
        # experts: expert e scales by (e + 1); combine weights by the gate
        scale = torch.arange(me * L, (me + 1) * L, dtype=x.dtype) + 1
        y = ll_x * scale.view(L, 1, 1)
        combined, _, _ = flex.low_latency_combine(y, idx, w, handle)
        ref = (torch.where(idx >= 0, w * (idx + 1), 0.0).unsqueeze(-1) * x.unsqueeze(1)).sum(1)
        assert_close(combined, ref, rtol=1e-6, atol=1e-6)

        # async event and receive hook give the same buffers
        a_x, a_count, a_handle, a_event, _ = flex.low_latency_dispatch(x, idx, M, E, async_finish=True)
        a_event.wait()
        h_x, h_count, _, _, recv_hook = flex.low_latency_dispatch(x, idx, M, E, return_recv_hook=True)
        recv_hook()
        assert torch.equal(a_x, ll_x) and torch.equal(h_x, ll_x)
        assert torch.equal(a_count, ll_count) and torch.equal(h_count, ll_count)
        a_comb, a_ev, _ = flex.low_latency_combine(y, idx, w, a_handle, async_finish=True)
        a_ev.wait()
        assert torch.equal(a_comb, combined)

        # FP8 with power-of-two scales: dequantized rows within the E4M3 bound of the originals
        (q, s), f_count, f_handle, _, _ = flex.low_latency_dispatch(x, idx, M, E, use_fp8=True, round_scale=True)
        assert torch.equal(f_count, ll_count) and s.stride(1) == 1  # scales column-major, as DeepEP's
        for j in range(L):
            c = counts[j]
            deq = in_source_order(dequantize_rows(q[j, :c], s[j, :c], x.dtype), f_handle, j)
            assert_fp8_close(deq, in_source_order(ll_x[j, :c], handle, j), power_of_two=True)
    with pytest.raises(RuntimeError, match="no backward"):
        flex.low_latency_dispatch(x.clone().requires_grad_(), idx, M, E)


def in_source_order(rows, handle, j):
    """Expert j's valid low-latency rows in (source rank, token) order, whatever order they arrived in
    (the torch backend's handle names each packed row's source slot)."""
    return rows[torch.argsort(handle.src_slot[j, :rows.shape[0]])]


def assert_fp8_close(deq, ref, power_of_two):
    """|deq - ref| <= 2^-4 |ref| + 2^-10 * scale, with the scale recomputed from ref's 1×128 blocks."""
    H = ref.shape[-1]
    nb = -(-H // 128)
    padded = torch.nn.functional.pad(ref.float(), (0, nb * 128 - H))
    scale = (padded.view(*ref.shape[:-1], nb, 128).abs().amax(-1) / FP8_E4M3_MAX).clamp_min(1e-12)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.repeat_interleave(128, -1)[..., :H]
    bound = 2.0 ** -4 * ref.float().abs() + 2.0 ** -10 * scale + 1e-30
    err = (deq.float() - ref.float()).abs()
    assert bool((err <= bound).all()), f"FP8 error {float((err - bound).max())} above the E4M3 bound"
    return err


def check_fp8_dispatch(group, me, R, seed):
    H = 160  # one full 1×128 block and a partial one
    idxs, ws, xs = setup(seed, R, H, list(range(E)))
    idx, w, x = idxs[me], ws[me], xs[me]
    plain = FlexBuffer(group, E)
    layout = plain.get_dispatch_layout(idx)[:3]
    args = (idx, w, layout[0], layout[2], layout[1])
    xp = x.clone().requires_grad_()
    ref_x = plain.dispatch(xp, *args)[0]
    g = torch.randn(ref_x.shape, generator=torch.Generator().manual_seed(seed + me))
    (ref_x * g).sum().backward()
    for pow2 in (False, True):
        fp8 = FlexBuffer(group, E, fp8=True, fp8_power_of_two=pow2)
        xf = x.clone().requires_grad_()
        recv, _, recv_w, _, handle, event = fp8.dispatch(xf, *args, async_finish=True)
        event.wait()
        assert recv.dtype == x.dtype
        err = assert_fp8_close(recv, ref_x.detach(), pow2)
        assert err.max() > 0  # it really went through FP8
        (recv * g).sum().backward()  # straight through, combined in the activation dtype
        assert torch.equal(xf.grad, xp.grad)
        cached = fp8.dispatch(x, handle=handle)[0]
        assert torch.equal(cached, recv.detach())
    # a DeepEP-style pre-quantized (q, scales) pair arrives as a pair
    q, s = quantize_rows(x, power_of_two=True)
    (rq, rs), *_ = plain.dispatch((q, s), *args)
    assert torch.equal(dequantize_rows(rq, rs, x.dtype), recv.detach())


def expert_layer(x_NH, rows, w1, w2):
    return grouped_linear(torch.nn.functional.silu(grouped_linear(x_NH, w1, rows)), w2, rows)


def check_token_dispatcher(group, me, R, seed, etp, allowed):
    """FlexTokenDispatcher + local experts == one process running all ranks' tokens."""
    H, F = 8, 12
    ep, etp_rank, ep_rank = R // etp, me % etp, me // etp
    L = E // ep
    idxs, ws, xs = setup(seed, R, H, allowed, torch.float64)
    g = torch.Generator().manual_seed(seed + 5)
    w1 = torch.randn(E, F, H, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, H, F, generator=g, dtype=torch.float64)
    grads = [torch.randn(TOKENS[R][r], H, generator=g, dtype=torch.float64) for r in range(R)]

    # distributed: this rank holds experts of its EP rank, ffn slice of its ETP rank
    ffn = slice(etp_rank * F // etp, (etp_rank + 1) * F // etp)
    experts = slice(ep_rank * L, (ep_rank + 1) * L)
    l1 = w1[experts, ffn].clone().requires_grad_()
    l2 = w2[experts][:, :, ffn].clone().requires_grad_()
    x = xs[me].clone().requires_grad_()
    tw = ws[me].clone().requires_grad_()
    routing = Routing(idxs[me], tw, torch.bincount(idxs[me][idxs[me] >= 0], minlength=E), E)
    disp = FlexTokenDispatcher(group, E, etp=etp)
    pending = disp.dispatch_start(x, routing)
    x_NH, rows, handle = disp.dispatch_finish(pending)
    assert rows.shape == (L,)
    out = disp.combine(expert_layer(x_NH, rows, l1, l2), handle)
    (out * grads[me]).sum().backward()

    # reference: every token and every expert in one process
    rx = torch.cat(xs).requires_grad_()
    rw = torch.cat(ws).requires_grad_()
    ridx = torch.cat(idxs)
    r1, r2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    local = LocalDispatcher(E)
    ref_routing = Routing(ridx, rw, torch.bincount(ridx[ridx >= 0], minlength=E), E)
    r_NH, r_rows, r_handle = local.dispatch(rx, ref_routing)
    ref_out = local.combine(expert_layer(r_NH, r_rows, r1, r2), r_handle)
    (ref_out * torch.cat(grads)).sum().backward()

    start = sum(TOKENS[R][:me])
    mine = slice(start, start + TOKENS[R][me])
    tol = dict(rtol=1e-10, atol=1e-12)
    assert_close(out, ref_out[mine].detach(), **tol)
    assert_close(x.grad, rx.grad[mine], **tol)
    assert_close(tw.grad, rw.grad[mine], **tol)
    assert_close(l1.grad, r1.grad[experts, ffn], **tol)
    assert_close(l2.grad, r2.grad[experts][:, :, ffn], **tol)


def run_all(rank, world_size):
    group = dist.group.WORLD
    flex = FlexBuffer(group, E)
    assert flex.local_experts == range(rank * E // world_size, (rank + 1) * E // world_size)
    normal = check_contract(flex, rank, world_size, seed=1, allowed=list(range(E)))
    # skewed: the last rank's experts are never chosen, so it receives nothing
    L = E // world_size
    check_contract(flex, rank, world_size, seed=2, allowed=list(range(E - L)))
    check_backward(flex, rank, world_size, seed=3, async_finish=False)
    check_backward(flex, rank, world_size, seed=4, async_finish=True)
    check_low_latency(flex, rank, world_size, seed=1, normal=normal)
    check_fp8_dispatch(group, rank, world_size, seed=5)
    check_token_dispatcher(group, rank, world_size, seed=6, etp=1, allowed=list(range(E)))
    check_token_dispatcher(group, rank, world_size, seed=7, etp=2, allowed=list(range(E - L)))
    with pytest.raises(ValueError, match="does not divide num_experts"):
        FlexBuffer(group, E + 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_flex_dispatcher_distributed(world_size):
    run_distributed(run_all, world_size, timeout=180)


# ---- single process -----------------------------------------------------------------------------


def test_group_of_one_is_the_identity():
    flex = FlexBuffer(None, E)
    idx, w = draw_routing(9, 0, 7, list(range(E)))
    x = draw_x(9, 0, 7, 16)
    per_rank, per_expert, in_rank, _ = flex.get_dispatch_layout(idx)
    recv_x, recv_idx, recv_w, counts, handle, _ = flex.dispatch(x, idx, w, per_rank, in_rank, per_expert)
    kept = (idx >= 0).any(1)
    assert torch.equal(recv_x, x[kept]) and torch.equal(recv_idx, idx[kept]) and torch.equal(recv_w, w[kept])
    assert counts == torch.bincount(idx[idx >= 0], minlength=E).tolist()
    combined, _, _ = flex.combine(recv_x, handle)
    assert torch.equal(combined, x * kept.unsqueeze(1))
    with torch.no_grad():
        ll_x, ll_count, ll_handle, _, _ = flex.low_latency_dispatch(x, idx, 8)
        assert ll_count.tolist() == counts
        for e in range(E):
            assert torch.equal(in_source_order(ll_x[e, :counts[e]], ll_handle, e), x[(idx == e).any(1)])
        ll_out, _, _ = flex.low_latency_combine(ll_x * 2, idx, w, ll_handle)
    assert_close(ll_out, 2 * w.sum(1, keepdim=True) * x)


def test_fp8_rows_round_trip_and_power_of_two_scales():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    x[1, 128:256] = 0  # an all-zero block
    for pow2 in (False, True):
        q, s = quantize_rows(x, power_of_two=pow2)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3) and s.dtype == torch.float32
        assert_fp8_close(dequantize_rows(q, s, torch.float32), x, pow2)
        assert float(q.float().abs().max()) <= FP8_E4M3_MAX
    log2 = torch.log2(s)
    assert torch.equal(log2, log2.round()), "power-of-two scales must be exact powers of two"
    amax_scale = x.abs().view(5, -1)[:, :256].reshape(5, 2, 128).amax(-1) / FP8_E4M3_MAX
    nonzero = amax_scale > 0
    assert bool((s[:, :2][nonzero] >= amax_scale[nonzero]).all())
    assert bool((s[:, :2][nonzero] < 2 * amax_scale[nonzero]).all())


def test_unavailable_and_unknown_backends_fail_clearly():
    with pytest.raises(RuntimeError, match="deep_ep"):
        FlexBuffer(None, E, backend="deepep")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="nvshmem.*unavailable: no CUDA"):
            FlexBuffer(None, E, backend="nvshmem")
    with pytest.raises(ValueError, match="unknown flex dispatcher backend"):
        FlexBuffer(None, E, backend="hybridep")
    with pytest.raises(ValueError, match="expert ids in"):
        FlexBuffer(None, E).get_dispatch_layout(torch.tensor([[0, E]]))
