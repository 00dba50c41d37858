"""MoELayer against a dense per-expert reference built from the layer's own parameters.

The reference routes each token with a Python loop, runs every expert densely as
`(silu(x Wg^T) * (x Wu^T)) Wd^T` (gate rows are the first F rows of gate_up_proj[e]),
and sums the chosen experts' outputs with their weights; autograd through it gives
the reference gradients. Nothing in it calls moetron.
"""

import importlib.util
import math
from fractions import Fraction

import pytest
import torch

from moetron import MoEConfig, MoELayer
from moetron.dispatch.base import LocalDispatcher
from moetron.dispatch.permute import permute, unpermute
from moetron.moe.grouped_gemm import resolve_backend

H = 16


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- independent reference --------------------------------------------------------------------------


def assert_close(got, want, rtol, atol=None, msg=""):
    """|got - want| <= atol + rtol * |want| elementwise; atol defaults to rtol * max|want|."""
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    if atol is None:
        atol = rtol * want.abs().max().item()
    err = (got - want).abs() - rtol * want.abs()
    assert bool((err <= atol).all()), f"{msg}: worst excess {err.max().item():.3g} over atol {atol:.3g}"


def ref_select(choice, k, num_groups=None, topk_groups=None):
    E = len(choice)
    eligible = list(range(E))
    if num_groups is not None:
        size = E // num_groups
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(num_groups)]
        best = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
        eligible = [e for e in range(E) if e // size in best]
    return sorted(eligible, key=lambda e: -choice[e])[:k]


def ref_gates(x_TH, w_router, cfg, bias=None):
    """Dense [T,E] gate weights (0 for unchosen or dropped experts), differentiable."""
    logits = x_TH @ w_router.T
    T, E = logits.shape
    if cfg.score_func == "sigmoid":
        scores = 1 / (1 + torch.exp(-logits))
    else:
        ex = torch.exp(logits - logits.max(-1, keepdim=True).values)
        scores = ex / ex.sum(-1, keepdim=True)
    mask = torch.zeros(T, E, dtype=torch.bool)
    for t, row in enumerate(scores.detach().double().tolist()):
        choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(row)]
        if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
            choice = [v + (float(bias[e]) if bias is not None else 0.0) for e, v in enumerate(logits[t].tolist())]
        for e in ref_select(choice, cfg.top_k, cfg.num_groups, cfg.topk_groups):
            mask[t, e] = True
    if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
        ex = torch.exp(logits - logits.max(-1, keepdim=True).values) * mask
        gates = ex / ex.sum(-1, keepdim=True)
    else:
        gates = scores * mask
        if cfg.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True)
    gates = gates * cfg.scaling_factor
    if cfg.capacity_factor is not None:
        cap = math.ceil(Fraction(T * cfg.top_k, E) * Fraction(str(cfg.capacity_factor)))
        values = gates.detach().tolist()
        mask = mask.clone()  # the pre-drop mask is saved for backward
        for e in range(E):
            users = [t for t in range(T) if mask[t, e]]
            if cfg.drop_policy == "probs":
                users.sort(key=lambda t: -values[t][e])
            for t in users[cap:]:
                mask[t, e] = False
        gates = gates * mask
    return gates, mask


def swiglu_mlp(x, w_gate, w_up, w_down):
    g = x @ w_gate.T
    return ((g / (1 + torch.exp(-g))) * (x @ w_up.T)) @ w_down.T


def ref_layer(x, P, cfg, bias=None):
    x_TH = x.reshape(-1, x.shape[-1])
    gates, _ = ref_gates(x_TH, P["router.weight"], cfg, bias)
    F_ = cfg.ffn_hidden_size
    out = torch.zeros_like(x_TH)
    for e in range(cfg.num_experts):
        gu = P["experts.gate_up_proj"][e]
        y_e = swiglu_mlp(x_TH, gu[:F_], gu[F_:], P["experts.down_proj"][e])
        out = out + gates[:, e:e + 1] * y_e
    if cfg.shared_expert_ffn_size:
        shared = swiglu_mlp(x_TH, P["shared_experts.gate_proj.weight"], P["shared_experts.up_proj.weight"],
                            P["shared_experts.down_proj.weight"])
        if cfg.shared_expert_gate:
            shared = shared / (1 + torch.exp(-(x_TH @ P["shared_expert_gate.weight"].T)))
        out = out + shared
    return out.reshape(x.shape)


# ---- helpers ----------------------------------------------------------------------------------------


def build(cfg, seed=0, bias_std=0.0, dispatcher=None):
    torch.manual_seed(seed)
    layer = MoELayer(cfg, dispatcher=dispatcher)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            std = 2.0 / math.sqrt(cfg.hidden_size) if name == "router.weight" else 0.3
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        if cfg.expert_bias and bias_std:
            layer.router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * bias_std)
    return layer, gen


def run_layer(layer, x, r):
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    (y * r).sum().backward()
    return y.detach(), xg.grad, {n: p.grad for n, p in layer.named_parameters()}


def run_reference(layer, x, r):
    P = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    xg = x.clone().requires_grad_()
    bias = layer.router.expert_bias.tolist() if layer.router.expert_bias is not None else None
    y = ref_layer(xg, P, layer.config, bias)
    (y * r).sum().backward()
    return y.detach(), xg.grad, {n: p.grad for n, p in P.items()}


def check_against_reference(layer, x, gen, rtol=1e-5):
    r = torch.randn(x.shape, generator=gen)
    y, gx, grads = run_layer(layer, x, r)
    y_ref, gx_ref, grads_ref = run_reference(layer, x, r)
    assert y.shape == x.shape
    assert_close(y, y_ref, rtol, msg="output")
    assert_close(gx, gx_ref, rtol, msg="grad x")
    for name in grads_ref:
        assert grads[name] is not None, name
        assert_close(grads[name], grads_ref[name], rtol, msg=f"grad {name}")
    return y, grads


def config(**kw):
    base = dict(hidden_size=H, ffn_hidden_size=12, num_experts=8, top_k=2)
    base.update(kw)
    return MoEConfig(**base)


LAYER_CASES = {
    "softmax_top2": dict(),
    "softmax_norm_shared_gate": dict(top_k=3, norm_topk_prob=True, shared_expert_ffn_size=12,
                                     shared_expert_gate=True),
    "softmax_after_topk_shared": dict(top_k=3, softmax_before_topk=False, shared_expert_ffn_size=8),
    "deepseek_like": dict(score_func="sigmoid", num_experts=16, num_groups=4, topk_groups=2, top_k=4,
                          norm_topk_prob=True, scaling_factor=2.5, expert_bias=True, shared_expert_ffn_size=12),
    "capacity_probs": dict(norm_topk_prob=True, capacity_factor=0.75, drop_policy="probs"),
    "capacity_position": dict(score_func="sigmoid", capacity_factor=0.75, drop_policy="position"),
}
SHAPES = {"BSH": (3, 5, H), "TH": (15, H), "4d": (2, 2, 4, H)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_matches_dense_reference(name, shape):
    cfg = config(**LAYER_CASES[name])
    layer, gen = build(cfg, seed=len(name), bias_std=0.1)
    expected = {"router.weight", "experts.gate_up_proj", "experts.down_proj"}
    if cfg.shared_expert_ffn_size:
        expected |= {f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
    if cfg.shared_expert_gate:
        expected.add("shared_expert_gate.weight")
    assert {n for n, _ in layer.named_parameters()} == expected
    x = torch.randn(SHAPES[shape], generator=gen)
    check_against_reference(layer, x, gen)
    if cfg.capacity_factor is not None:
        assert layer.stats()["dropped_fraction"] > 0  # the capacity cases really drop


@pytest.mark.parametrize("backend", ["torch_grouped_mm", "cpp"])
@pytest.mark.parametrize("name", ["softmax_norm_shared_gate", "deepseek_like", "capacity_probs"])
def test_backends_agree(name, backend):
    cfg_kw = LAYER_CASES[name]
    mm, gen = build(config(expert_backend=backend, **cfg_kw), seed=3, bias_std=0.1)
    loop, _ = build(config(expert_backend="loop", **cfg_kw), seed=3, bias_std=0.1)
    loop.load_state_dict(mm.state_dict())
    x = torch.randn(4, 6, H, generator=gen)
    r = torch.randn(4, 6, H, generator=gen)
    y_mm, gx_mm, g_mm = run_layer(mm, x, r)
    y_loop, gx_loop, g_loop = run_layer(loop, x, r)
    assert_close(y_mm, y_loop, 1e-5, msg="output")
    assert_close(gx_mm, gx_loop, 1e-5, msg="grad x")
    for n in g_loop:
        assert_close(g_mm[n], g_loop[n], 1e-5, msg=n)


@pytest.mark.parametrize("hidden, ffn", [(6, 4), (8, 6)])
def test_unaligned_sizes(hidden, ffn):
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=4, top_k=2)
    layer, gen = build(cfg)
    x = torch.randn(3, 5, hidden, generator=gen)
    # torch._grouped_mm needs 16-byte rows: auto takes the C++ grouped GEMM (no such need) or the loop
    assert resolve_backend("auto", x, layer.experts.gate_up_proj) in ("cpp", "loop")
    check_against_reference(layer, x, gen)

    strict, _ = build(MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=4, top_k=2,
                                expert_backend="torch_grouped_mm"))
    with pytest.raises(ValueError, match=r"torch_grouped_mm needs row sizes that are multiples of 16 bytes"):
        strict(x)


@pytest.mark.parametrize("backend", ["torch_grouped_mm", "cpp", "loop"])
def test_experts_without_tokens_get_zero_gradients(backend):
    cfg = config(num_experts=6, top_k=2, expert_bias=True, norm_topk_prob=True, expert_backend=backend)
    layer, gen = build(cfg, seed=2)
    empty = [0, 2, 5]  # first, middle and last expert: every offset edge
    with torch.no_grad():
        for e in empty:
            layer.router.expert_bias[e] = -10.0  # softmax scores are < 1: never chosen
    x = torch.randn(4, 5, H, generator=gen)
    _, grads = check_against_reference(layer, x, gen)
    assert layer.last_tokens_per_expert[empty].tolist() == [0, 0, 0]
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        g = grads[name]
        assert torch.isfinite(g).all()
        for e in range(6):
            assert bool((g[e] == 0).all()) == (e in empty), (name, e)


def test_zero_tokens():
    # An EP rank may receive no rows at all; every weight must still get a (zero) gradient. (Regression:
    # grouped_linear's zero-row return, `x_NH.new_zeros(...) + 0 * w.sum()`, cuts the graph to x_NH, so
    # chaining two of them left gate_up_proj.grad None.)
    for backend in ("torch_grouped_mm", "cpp", "loop"):
        layer, _ = build(config(expert_backend=backend, shared_expert_ffn_size=8))
        x = torch.randn(0, H, requires_grad=True)
        y = layer(x)
        assert y.shape == (0, H)
        y.sum().backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None, f"{backend}: {name}.grad is None"
            assert bool((p.grad == 0).all()), f"{backend}: {name}"


def test_stats():
    layer, gen = build(config(capacity_factor=0.75, drop_policy="position", norm_topk_prob=True), seed=4)
    assert layer.stats() == {}
    x = torch.randn(3, 8, H, generator=gen)
    layer(x)
    _, mask = ref_gates(x.reshape(-1, H), layer.router.weight.detach(), layer.config)
    counts = mask.sum(0).tolist()
    stats = layer.stats()
    mean = sum(counts) / 8
    assert layer.last_tokens_per_expert.tolist() == counts
    assert stats["max_load"] == max(counts)
    assert stats["mean_load"] == pytest.approx(mean)
    assert stats["max_over_mean"] == pytest.approx(max(counts) / mean)
    assert stats["dropped_fraction"] == pytest.approx(1 - sum(counts) / (24 * 2))
    assert stats["dropped_fraction"] > 0

    dropless, gen = build(config(), seed=4)
    x = torch.randn(5, 7, H, generator=gen)
    dropless(x)
    _, mask = ref_gates(x.reshape(-1, H), dropless.router.weight.detach(), dropless.config)
    counts = mask.sum(0).tolist()
    assert dropless.stats()["max_load"] == max(counts)
    assert dropless.stats()["mean_load"] == pytest.approx(35 * 2 / 8)
    assert dropless.stats()["dropped_fraction"] == 0.0


@pytest.mark.parametrize("backend", ["torch_grouped_mm", "cpp", "loop"])
@pytest.mark.parametrize("cap", [None, 0.75])
def test_pad_multiple_matches_unpadded(backend, cap):
    cfg = config(expert_backend=backend, norm_topk_prob=True, capacity_factor=cap, shared_expert_ffn_size=8)
    plain, gen = build(cfg, seed=6)
    padded, _ = build(cfg, seed=6, dispatcher=LocalDispatcher(cfg.num_experts, pad_multiple=16))
    padded.load_state_dict(plain.state_dict())
    x = torch.randn(3, 7, H, generator=gen)
    r = torch.randn(3, 7, H, generator=gen)

    x_TH = x.reshape(-1, H)
    routing = padded.route(x_TH)
    x_NH, rows, _ = padded.dispatch(x_TH, routing)
    kept = routing.tokens_per_expert.tolist()
    assert all(n % 16 == 0 and n >= k and n - k < 16 for n, k in zip(rows.tolist(), kept))
    assert x_NH.shape[0] == sum(rows.tolist())
    start = 0
    for e, n in enumerate(rows.tolist()):
        assert bool((x_NH[start + kept[e]:start + n] == 0).all())
        start += n

    y_a, gx_a, g_a = run_layer(plain, x, r)
    y_b, gx_b, g_b = run_layer(padded, x, r)
    assert_close(y_b, y_a, 1e-6, msg="output")
    assert_close(gx_b, gx_a, 1e-5, msg="grad x")
    for n in g_a:
        assert_close(g_b[n], g_a[n], 1e-5, msg=n)


@pytest.mark.parametrize("pad", [dict(), dict(pad_multiple=16), dict(pad_multiple=3), dict(pad_to=9)])
def test_permute_unpermute_reference(pad):
    gen = torch.Generator().manual_seed(8)
    T_, K_, E_ = 12, 3, 5
    x = torch.randn(T_, H, generator=gen)
    idx = torch.stack([torch.randperm(E_, generator=gen)[:K_] for _ in range(T_)])
    drop = torch.rand(T_, K_, generator=gen) < 0.2
    idx = idx.masked_fill(drop, -1)
    w = torch.rand(T_, K_, generator=gen) + 0.1
    x_NH, state = permute(x, idx, E_, **pad)
    rows = state.rows_per_expert.tolist()
    assert len(rows) == E_ and x_NH.shape == (sum(rows), H)
    expert_of_row = [e for e, n in enumerate(rows) for _ in range(n)]
    # reference layout: each expert's tokens in token order, then zero padding
    start = 0
    for e, n in enumerate(rows):
        tokens = [t for t in range(T_) if e in idx[t].tolist()]
        if "pad_to" in pad:
            assert n == pad["pad_to"]
        elif "pad_multiple" in pad:
            assert n % pad["pad_multiple"] == 0 and len(tokens) <= n < len(tokens) + pad["pad_multiple"]
        else:
            assert n == len(tokens)
        assert torch.equal(x_NH[start:start + len(tokens)], x[tokens])
        assert bool((x_NH[start + len(tokens):start + n] == 0).all())
        start += n
    # a per-expert map, then a weighted unpermute
    scale = torch.tensor([e + 1.0 for e in expert_of_row]).unsqueeze(-1)
    out = unpermute(x_NH * scale, state, w)
    want = torch.zeros(T_, H)
    for t in range(T_):
        for k in range(K_):
            e = int(idx[t, k])
            if e >= 0:
                want[t] += float(w[t, k]) * (e + 1) * x[t]
    assert_close(out, want, 1e-6)


def test_pad_to_smaller_than_load_is_an_error():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    with pytest.raises(ValueError, match="pad_to=2"):
        permute(torch.randn(3, H), idx, 3, pad_to=2)


def test_wrong_hidden_size_is_an_error():
    layer, _ = build(config())
    with pytest.raises(ValueError, match=r"x\[\.\.\., 16\]"):
        layer(torch.randn(4, H + 1))


@pytest.mark.skipif(importlib.util.find_spec("grouped_gemm") is not None and torch.cuda.is_available(),
                    reason="grouped_gemm is available here")
def test_unavailable_grouped_gemm_backend_is_a_clear_error():
    layer, gen = build(config(expert_backend="grouped_gemm"))
    with pytest.raises(RuntimeError, match="grouped_gemm"):
        layer(torch.randn(2, 3, H, generator=gen))


def test_transformer_engine_expert_backend_is_not_offered_yet():
    # Transformer Engine's grouped linear is not wired into the grouped-GEMM seam yet: the config
    # must refuse it up front rather than fail at the first forward.
    with pytest.raises(ValueError, match="expert_backend"):
        config(expert_backend="te")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpp_grouped_gemm_matches_per_expert_matmuls(threads):
    """The C++ CPU grouped GEMM (expert_backend="cpp") hands pieces of experts to threads: rows (forward,
    input grad) and output rows (weight grad); every mode equals per-expert matmuls (fp32, 1e-6
    relative), experts without rows included."""
    from moetron.kernels import cpp_build

    ops = cpp_build.load_grouped_gemm_ops()
    gen = torch.Generator().manual_seed(threads)
    # empty first, middle and last experts; whole experts and 128-row pieces (modes 0, 1) and 128-output-row
    # pieces (mode 2, O=300) in some thread counts, split points inside experts
    rows = torch.tensor([0, 300, 3, 0, 700, 1, 0])
    N, K, O = int(rows.sum()), 24, 300
    x, dy = torch.randn(N, K, generator=gen), torch.randn(N, O, generator=gen)
    w = torch.randn(len(rows), O, K, generator=gen)
    offsets = rows.cumsum(0)
    blocks = list(zip(torch.cat([offsets.new_zeros(1), offsets[:-1]]).tolist(), offsets.tolist()))
    want = (torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(blocks)]),
            torch.cat([dy[a:b] @ w[e] for e, (a, b) in enumerate(blocks)]),
            torch.stack([dy[a:b].T @ x[a:b] for a, b in blocks]))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.grouped_mm(x, w, offsets, 0), ops.grouped_mm(dy, w, offsets, 1), ops.grouped_mm(dy, x, offsets, 2)
    finally:
        torch.set_num_threads(before)
    for mode, (g, r) in enumerate(zip(got, want)):
        assert g.shape == r.shape and r.abs().max() > 1, mode
        assert_close(g, r, 1e-6, msg=f"mode {mode}")
    assert bool((got[2][[0, 3, 6]] == 0).all())
    with pytest.raises(RuntimeError, match="offsets end at"):
        ops.grouped_mm(x[1:], w, offsets, 0)


def test_wide_grouped_gemm_takes_a_helper_with_the_same_bits(monkeypatch):
    """A one-thread run gives the experts' grouped GEMM a helper task (moetron/kernels/threads.py): the same
    output and gradients to the bit, the kernel really gets the helper, and the thread count is untouched."""
    from moetron.kernels import cpp_build, threads
    from moetron.moe.grouped_gemm import grouped_linear

    if not cpp_build.cpp_status(build=True)[0]:
        pytest.skip("no C++ compiler")
    ops = cpp_build.load_grouped_gemm_ops()
    seen = []

    class Spy:  # the real kernel, recording the helpers it was given
        def grouped_mm(self, *args):
            seen.append(args[4])
            return ops.grouped_mm(*args)

    monkeypatch.setattr(cpp_build, "load_grouped_gemm_ops", lambda: Spy())
    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([300, 0, 17, 500, 211, 256, 700, 64])
    x = torch.randn(int(rows.sum()), 64, generator=gen)
    w = torch.randn(8, 128, 64, generator=gen)
    dy = torch.randn(int(rows.sum()), 128, generator=gen)
    results = {}
    before = torch.get_num_threads()
    try:
        for intra, wide in ((1, 1), (1, 2), (1, 3), (2, 2)):
            torch.set_num_threads(intra)
            threads.set_wide_threads(wide)
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = grouped_linear(xg, wg, rows, backend="cpp")
            y.backward(dy)
            results[intra, wide] = (y.detach(), xg.grad, wg.grad)
            assert torch.get_num_threads() == intra
    finally:
        threads.set_wide_threads(1)
        torch.set_num_threads(before)
    assert seen == [0] * 3 + [1] * 3 + [2] * 3 + [0] * 3  # forward, input grad, weight grad
    for got in list(results.values())[1:]:
        for a, b in zip(results[1, 1], got):
            assert a.abs().max() > 1 and torch.equal(a, b)
    with pytest.raises(ValueError, match="wide-op threads"):
        threads.set_wide_threads(0)
    with pytest.raises(RuntimeError, match="helpers must be >= 0"):
        ops.grouped_mm(x, w, rows.cumsum(0), 0, -1)


def test_grouped_gemm_bits_do_not_depend_on_its_threads():
    """Skewed routings (experts of 0-2 rows beside experts of hundreds): one thread, one thread and a
    helper, and two intra-op threads cut the rows into the same pieces, so each mode gives the same
    bits (MKL's result for a row can depend on how many rows its call has)."""
    from moetron.kernels import cpp_build

    if not cpp_build.cpp_status(build=True)[0]:
        pytest.skip("no C++ compiler")
    ops = cpp_build.load_grouped_gemm_ops()
    gen = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        for _ in range(25):
            rows = torch.multinomial(torch.rand(16, generator=gen) ** 3, 2048, replacement=True,
                                     generator=gen).bincount(minlength=16)
            offsets = rows.cumsum(0).to(torch.int32)
            x, dy = torch.randn(2048, 64, generator=gen), torch.randn(2048, 128, generator=gen)
            w = torch.randn(16, 128, 64, generator=gen)
            for mode, (a, b) in enumerate(((x, w), (dy, w), (dy, x))):
                torch.set_num_threads(1)
                one, helped = ops.grouped_mm(a, b, offsets, mode, 0), ops.grouped_mm(a, b, offsets, mode, 1)
                torch.set_num_threads(2)
                two = ops.grouped_mm(a, b, offsets, mode, 0)
                assert torch.equal(one, helped) and torch.equal(one, two), (mode, rows.tolist())
    finally:
        torch.set_num_threads(before)
