"""TopKRouter options, MoEConfig validation and capacity dropping, against per-token loop references.

Every reference here is written with plain Python loops over float64 values; none of
it calls moetron. The order of the k slots is not part of the contract, so slots are
compared as {expert: weight} maps.
"""

import math
from fractions import Fraction

import pytest
import torch

from moetron import MoEConfig, MoELayer
from moetron.moe.router import TopKRouter, capacity

H = 16
T = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- independent references ------------------------------------------------------------------------


def ref_select(choice, k, num_groups=None, topk_groups=None):
    """Experts chosen for one token from its selection scores (a list of floats)."""
    E = len(choice)
    eligible = list(range(E))
    if num_groups is not None:
        size = E // num_groups
        group_score = []
        for g in range(num_groups):
            members = sorted(choice[g * size:(g + 1) * size], reverse=True)
            group_score.append(sum(members[:2]))
        best = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
        eligible = [e for e in range(E) if e // size in best]
    return sorted(eligible, key=lambda e: -choice[e])[:k]


def ref_route(x, W, cfg, bias=None):
    """Per token: {expert: weight} of the chosen experts, computed in float64 Python."""
    logits = (x.double() @ W.double().T).tolist()
    out = []
    for row in logits:
        E = len(row)
        if cfg.score_func == "sigmoid":
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        elif cfg.softmax_before_topk:
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = list(row)
        choice = [scores[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        chosen = ref_select(choice, cfg.top_k, cfg.num_groups, cfg.topk_groups)
        if cfg.score_func == "softmax" and not cfg.softmax_before_topk:
            m = max(row[e] for e in chosen)
            ex = {e: math.exp(row[e] - m) for e in chosen}
            weights = {e: ex[e] / sum(ex.values()) for e in chosen}
        else:
            weights = {e: scores[e] for e in chosen}
            if cfg.norm_topk_prob:
                total = sum(weights.values())
                weights = {e: w / total for e, w in weights.items()}
        out.append({e: w * cfg.scaling_factor for e, w in weights.items()})
    return out


def ref_drop(routes, num_experts, cap, policy):
    """Apply capacity: per expert keep the `cap` highest-weight (probs) or earliest (position) tokens."""
    kept = [dict(r) for r in routes]
    for e in range(num_experts):
        users = [t for t, r in enumerate(routes) if e in r]
        if policy == "probs":
            users.sort(key=lambda t: -routes[t][e])
        for t in users[cap:]:
            del kept[t][e]
    return kept


def lib_routes(routing):
    """The library's Routing as per-token {expert: weight} maps (dropped slots left out)."""
    idx, w = routing.topk_idx.tolist(), routing.topk_weights.tolist()
    return [{e: wt for e, wt in zip(ri, rw) if e >= 0} for ri, rw in zip(idx, w)]


def assert_routes_equal(got, want, rel=1e-5):
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"token {t}: experts {sorted(g)} != reference {sorted(w)}"
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=rel, abs=1e-7), f"token {t} expert {e}"


def assert_close(got, want, rtol, atol, msg=""):
    """|got - want| <= atol + rtol * |want| elementwise (torch.testing's version imports slowly)."""
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    err = (got - want).abs() - rtol * want.abs()
    assert bool((err <= atol).all()), f"{msg}: worst excess {err.max().item():.3g} over atol {atol:.3g}"


def make_router(cfg, seed=0, bias_std=None):
    gen = torch.Generator().manual_seed(seed)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * (2.0 / math.sqrt(cfg.hidden_size)))
        if bias_std is not None:
            router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen) * bias_std)
    x = torch.randn(T, cfg.hidden_size, generator=gen)
    return router, x


def cfg_of(**kw):
    base = dict(hidden_size=H, ffn_hidden_size=8, num_experts=8, top_k=2)
    base.update(kw)
    return MoEConfig(**base)


# ---- router options ---------------------------------------------------------------------------------

ROUTER_CASES = {
    "softmax_before_raw": dict(),
    "softmax_before_norm": dict(top_k=3, norm_topk_prob=True),
    "softmax_after": dict(softmax_before_topk=False),
    "softmax_after_k3": dict(top_k=3, softmax_before_topk=False, norm_topk_prob=True),
    "softmax_scaled": dict(norm_topk_prob=True, scaling_factor=2.0),
    "softmax_scaled_raw": dict(top_k=3, scaling_factor=0.75),
    "sigmoid_raw": dict(score_func="sigmoid"),
    "sigmoid_norm_scaled": dict(score_func="sigmoid", top_k=4, norm_topk_prob=True, scaling_factor=2.5),
    "groups_softmax_3of1": dict(num_experts=12, num_groups=3, topk_groups=1, top_k=2),
    "groups_softmax_4of2": dict(num_experts=16, num_groups=4, topk_groups=2, top_k=3, norm_topk_prob=True),
    "groups_sigmoid_8of3": dict(score_func="sigmoid", num_experts=16, num_groups=8, topk_groups=3, top_k=3,
                                norm_topk_prob=True, scaling_factor=2.5),
    "groups_size1_8of4": dict(num_experts=8, num_groups=8, topk_groups=4, top_k=2),
    "groups_after_topk": dict(num_experts=12, num_groups=4, topk_groups=2, top_k=2, softmax_before_topk=False),
}


@pytest.mark.parametrize("name", list(ROUTER_CASES))
def test_router_matches_loop_reference(name):
    cfg = cfg_of(**ROUTER_CASES[name])
    router, x = make_router(cfg, seed=len(name))
    routing, losses, counts = router(x)
    want = ref_route(x, router.weight.detach(), cfg)
    assert_routes_equal(lib_routes(routing), want)
    assert routing.topk_idx.dtype == torch.int64 and routing.topk_weights.dtype == torch.float32
    assert routing.topk_idx.shape == (T, cfg.top_k)
    ref_counts = [sum(e in r for r in want) for e in range(cfg.num_experts)]
    assert routing.tokens_per_expert.tolist() == ref_counts
    assert counts.tolist() == ref_counts
    assert losses.values == {}
    size = cfg.num_experts // (cfg.num_groups or 1)
    if cfg.num_groups is not None and size > 1:  # the group limit must actually change some selections
        ungrouped = ref_route(x, router.weight.detach(), cfg_of(**{**ROUTER_CASES[name], "num_groups": None,
                                                                   "topk_groups": None}))
        assert any(sorted(a) != sorted(b) for a, b in zip(want, ungrouped))
        for r in lib_routes(routing):
            assert len({e // size for e in r}) <= cfg.topk_groups


@pytest.mark.parametrize("name, kw", [
    ("sigmoid_norm_scaled", dict(score_func="sigmoid", top_k=3, norm_topk_prob=True, scaling_factor=2.5)),
    ("sigmoid_raw", dict(score_func="sigmoid", top_k=2)),
    ("sigmoid_groups", dict(score_func="sigmoid", num_experts=16, num_groups=4, topk_groups=2, top_k=4,
                            norm_topk_prob=True, scaling_factor=2.5)),
    ("softmax_bias", dict(top_k=2, norm_topk_prob=False)),
    ("softmax_after_bias", dict(top_k=2, softmax_before_topk=False)),
])
def test_expert_bias_changes_selection_not_weights(name, kw):
    cfg = cfg_of(expert_bias=True, **kw)
    bias_std = 1.0 if not cfg.softmax_before_topk else 0.3
    router, x = make_router(cfg, seed=7, bias_std=bias_std)
    bias = router.expert_bias.tolist()
    assert any(abs(b) > 0.1 for b in bias)
    routing, _, _ = router(x)
    want = ref_route(x, router.weight.detach(), cfg, bias=bias)
    assert_routes_equal(lib_routes(routing), want)
    # The bias must have changed which experts some tokens use ...
    unbiased = ref_route(x, router.weight.detach(), cfg)
    assert any(sorted(a) != sorted(b) for a, b in zip(want, unbiased))
    # ... and the weights are the unbiased scores: for sigmoid without renormalisation,
    # each weight is exactly sigmoid(logit) of its expert.
    if cfg.score_func == "sigmoid" and not cfg.norm_topk_prob:
        logits = (x.double() @ router.weight.detach().double().T).tolist()
        for t, r in enumerate(lib_routes(routing)):
            for e, w in r.items():
                assert w == pytest.approx(1 / (1 + math.exp(-logits[t][e])), rel=1e-6)


def test_router_runs_in_fp32_for_low_precision_inputs():
    cfg = cfg_of(norm_topk_prob=True)
    router, x = make_router(cfg, seed=3)
    routing, _, _ = router(x.to(torch.bfloat16))
    assert routing.topk_weights.dtype == torch.float32
    want = ref_route(x.to(torch.bfloat16).float(), router.weight.detach(), cfg)
    assert_routes_equal(lib_routes(routing), want)


# ---- configuration validation -----------------------------------------------------------------------


@pytest.mark.parametrize("kw, field", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(ffn_hidden_size=-4), "ffn_hidden_size"),
    (dict(num_experts=8.0), "num_experts"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=9), "top_k"),
    (dict(score_func="tanh"), "score_func"),
    (dict(score_func="sigmoid", softmax_before_topk=False), "softmax_before_topk"),
    (dict(num_groups=4), "num_groups"),
    (dict(topk_groups=2), "num_groups"),
    (dict(num_groups=3, topk_groups=1), "num_groups"),
    (dict(num_groups=4, topk_groups=0), "topk_groups"),
    (dict(num_groups=4, topk_groups=5), "topk_groups"),
    (dict(num_groups=4, topk_groups=1, top_k=3), "top_k"),
    (dict(aux_loss_type="switch"), "aux_loss_type"),
    (dict(aux_loss_coeff=-0.1), "aux_loss_coeff"),
    (dict(aux_loss_counts="topk"), "aux_loss_counts"),
    (dict(bias_update_counts="after"), "bias_update_counts"),
    (dict(bias_update_counts="kept"), "bias_update_counts"),  # without an expert bias it could not act
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(drop_policy="random"), "drop_policy"),
    (dict(pad_to_capacity=True), "pad_to_capacity"),
    (dict(shared_expert_ffn_size=-1), "shared_expert_ffn_size"),
    (dict(shared_expert_gate=True), "shared_expert_gate"),
    (dict(expert_backend="cuda"), "expert_backend"),
])
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{field}="):
        cfg_of(**kw)


def test_config_negative_z_loss_coeff_names_z_loss_coeff():
    # BUG: moetron/moe/config.py reports this as `MoEConfig.aux_loss_coeff=0.0`.
    with pytest.raises(ValueError, match=r"MoEConfig\.z_loss_coeff=-0\.1"):
        cfg_of(z_loss_coeff=-0.1)


def test_config_zero_num_groups_is_a_validation_error():
    # BUG: moetron/moe/config.py raises ZeroDivisionError (`num_experts % 0`).
    with pytest.raises(ValueError, match=r"MoEConfig\.num_groups=0"):
        cfg_of(num_groups=0, topk_groups=1)


def test_config_valid_options_build():
    cfg = cfg_of(score_func="sigmoid", num_experts=16, num_groups=4, topk_groups=2, top_k=8, expert_bias=True,
                 aux_loss_type="seq_aux_loss", aux_loss_coeff=1e-3, z_loss_coeff=1e-3, capacity_factor=1.25,
                 drop_policy="position", pad_to_capacity=True, shared_expert_ffn_size=8, shared_expert_gate=True,
                 aux_loss_counts="paper", bias_update_counts="kept")
    assert cfg.top_k == 8 and cfg.num_groups == 4


# ---- capacity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, experts, k, factor", [
    (64, 8, 2, 1.0), (64, 8, 2, 1.25), (10, 4, 2, 1.5), (7, 8, 1, 1.0), (100, 16, 4, 0.5), (3, 8, 2, 0.1),
    (33, 4, 3, 2.0),
])
def test_capacity_formula(tokens, experts, k, factor):
    want = math.ceil(Fraction(tokens * k, experts) * Fraction(str(factor)))
    assert capacity(tokens, experts, k, factor) == want


def test_capacity_exact_for_decimal_factors():
    # BUG: capacity(50, 2, 2, 1.1) is ceil(50.0 * 1.1) = ceil(55.000000000000007) = 56 in floating point;
    # the documented ceil(T*k/E*capacity_factor) is 55.
    for tokens, experts, k, factor in [(50, 2, 2, 1.1), (25, 2, 2, 2.2), (50, 4, 4, 1.1)]:
        want = math.ceil(Fraction(tokens * k, experts) * Fraction(str(factor)))
        assert capacity(tokens, experts, k, factor) == want, (tokens, experts, k, factor)


DROP_CASES = {
    "softmax_norm": dict(top_k=2, norm_topk_prob=True),
    "softmax_raw_k3": dict(top_k=3),
    "sigmoid_groups_bias": dict(score_func="sigmoid", num_experts=16, num_groups=4, topk_groups=2, top_k=4,
                                norm_topk_prob=True, scaling_factor=2.5, expert_bias=True),
}


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("name", list(DROP_CASES))
@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_drops_exactly_the_expected_tokens(name, policy, factor):
    cfg = cfg_of(capacity_factor=factor, drop_policy=policy, **DROP_CASES[name])
    router, x = make_router(cfg, seed=11, bias_std=0.5 if cfg.expert_bias else None)
    bias = router.expert_bias.tolist() if cfg.expert_bias else None
    routing, _, counts = router(x)
    cap = math.ceil(Fraction(T * cfg.top_k, cfg.num_experts) * Fraction(str(factor)))
    assert routing.capacity == cap
    undropped = ref_route(x, router.weight.detach(), cfg, bias=bias)
    want = ref_drop(undropped, cfg.num_experts, cap, policy)
    n_dropped = sum(len(a) - len(b) for a, b in zip(undropped, want))
    assert n_dropped > 0  # the case must actually drop
    assert_routes_equal(lib_routes(routing), want)
    idx, w = routing.topk_idx, routing.topk_weights
    for t in range(T):
        assert int((idx[t] == -1).sum()) == cfg.top_k - len(want[t])
    assert bool((w[idx == -1] == 0).all())
    assert int((idx == -1).sum()) == n_dropped
    kept_counts = [sum(e in r for r in want) for e in range(cfg.num_experts)]
    assert routing.tokens_per_expert.tolist() == kept_counts
    assert max(kept_counts) <= cap
    # the third output counts the top-k selections before any drop
    assert counts.tolist() == [sum(e in r for r in undropped) for e in range(cfg.num_experts)]
    # the two policies must disagree on this input, so each check above is discriminating
    other = ref_drop(undropped, cfg.num_experts, cap, "position" if policy == "probs" else "probs")
    assert other != want


def test_capacity_large_factor_drops_nothing():
    cfg = cfg_of(capacity_factor=float(cfg_of().num_experts), norm_topk_prob=True)
    router, x = make_router(cfg, seed=5)
    routing, _, _ = router(x)
    assert bool((routing.topk_idx >= 0).all())
    assert_routes_equal(lib_routes(routing), ref_route(x, router.weight.detach(), cfg))


def _layer_pair(backend, factor, policy="probs"):
    kw = dict(hidden_size=H, ffn_hidden_size=16, num_experts=8, top_k=2, norm_topk_prob=True,
              capacity_factor=factor, drop_policy=policy, expert_backend=backend)
    torch.manual_seed(0)
    plain = MoELayer(MoEConfig(**kw))
    padded = MoELayer(MoEConfig(pad_to_capacity=True, **kw))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    padded.load_state_dict(plain.state_dict())
    x = torch.randn(4, 12, H, generator=gen)
    return plain, padded, x, gen


@pytest.mark.parametrize("backend", ["torch_grouped_mm", "loop"])
@pytest.mark.parametrize("factor", [0.75, 2.0])  # with drops, and with slack rows in every expert
def test_pad_to_capacity_pads_rows_and_keeps_output(backend, factor):
    plain, padded, x, gen = _layer_pair(backend, factor)
    T_ = x.shape[0] * x.shape[1]
    cap = math.ceil(Fraction(T_ * 2, 8) * Fraction(str(factor)))

    x_TH = x.reshape(-1, H)
    routing = padded.route(x_TH)
    x_NH, rows, _ = padded.dispatch(x_TH, routing)
    assert rows.tolist() == [cap] * 8
    assert x_NH.shape == (8 * cap, H)
    kept = routing.tokens_per_expert.tolist()
    assert sum(kept) < 8 * cap  # some rows really are padding
    for e in range(8):  # the padding rows are zero, the real rows are the routed tokens in token order
        block = x_NH[e * cap:(e + 1) * cap]
        assert bool((block[kept[e]:] == 0).all())
        tokens = [t for t in range(T_) if e in routing.topk_idx[t].tolist()]
        assert torch.equal(block[:kept[e]], x_TH[tokens])

    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    ya, yb = plain(xa), padded(xb)
    assert_close(yb, ya, rtol=1e-6, atol=1e-7)
    r = torch.randn(ya.shape, generator=gen)
    (ya * r).sum().backward()
    (yb * r).sum().backward()
    assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-7)
    for (name, pa), (_, pb) in zip(plain.named_parameters(), padded.named_parameters()):
        assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-7, msg=name)
