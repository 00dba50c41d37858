"""Router conventions (docs/router_conventions.md): each row of the table has its test here.

The references are written from the formulas, not from moetron: DeepSeek-V3's balance loss
(report eqs. 17-20) in float64 Python loops, Megatron-Core 0.16's rules (moe_utils.py: group score,
capacity, the sequence-wise loss) as short functions written here, and transformers' DeepSeek-V3
router and Switch loss called directly. Every check also shows that the other convention gives a
different answer on the same input, so none of them can pass by accident.
"""

import dataclasses
import math
from fractions import Fraction

import pytest
import torch

from moetron import MoEConfig, MoELayer
from moetron.config import ModelConfig
from moetron.moe import balancing
from moetron.moe.router import TopKRouter, capacity
from moetron.recipes.catalog import get_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# DeepSeek-V3's routing at its real setting (REFERENCE §1): sigmoid, 256 experts, 8 groups keep 4, k=8, x2.5.
DSV3 = dict(score_func="sigmoid", num_experts=256, num_groups=8, topk_groups=4, top_k=8, norm_topk_prob=True,
            scaling_factor=2.5, expert_bias=True)
H, B, S = 32, 2, 48  # two sequences of 48 tokens, batch-major ([B, S] like MoELayer's x)


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def top(values, k):
    """Indices of the k largest values (a plain sort)."""
    return sorted(range(len(values)), key=lambda i: -values[i])[:k]


def ref_select(scores, bias, k, n_group=None, keep=None, group_top=2):
    """DeepSeek-V3 selection for one token: c = s + b, groups scored by the sum of their
    `group_top` best c, the best `keep` groups eligible, top-k of c among them."""
    c = [s + b for s, b in zip(scores, bias)]
    eligible = list(range(len(c)))
    if n_group is not None:
        size = len(c) // n_group
        score = [sum(sorted(c[g * size:(g + 1) * size], reverse=True)[:group_top]) for g in range(n_group)]
        best = top(score, keep)
        eligible = [e for e in eligible if e // size in best]
    return sorted(eligible, key=lambda e: -c[e])[:k]


def ref_balance_loss(logits_TE, chosen, k, alpha, seq_len):
    """L_Bal = alpha * sum_i f_i P_i per sequence of `seq_len` tokens, averaged over sequences:
    f_i = E/(K T) sum_t 1[i chosen for t], P_i = 1/T sum_t s'_{i,t}, s' = s / sum_j s_j.
    `logits_TE` float64 (may require grad: P carries the gradient, f is a count)."""
    T, E = logits_TE.shape
    s = torch.sigmoid(logits_TE)
    s_norm = s / s.sum(-1, keepdim=True)
    losses = []
    for start in range(0, T, seq_len):
        f = [0.0] * E
        for t in range(start, start + seq_len):
            for i in chosen[t]:
                f[i] += E / (k * seq_len)
        P = s_norm[start:start + seq_len].mean(0)
        losses.append(alpha * sum(f[i] * P[i] for i in range(E)))
    return sum(losses) / len(losses)


def paper_chosen(logits_TE, k):
    """The paper's indicator: top-k of the affinities s = sigmoid(u.e), no bias, no group limit."""
    return [top([sigmoid(v) for v in row], k) for row in logits_TE.tolist()]


def megatron_seq_aux_loss(logits_SBE, k, coeff):
    """Megatron-Core's sequence_load_balancing_loss_func with compute_routing_scores_for_aux_loss,
    written from their definitions: tokens sequence-major [S, B], top-k of the normalised scores."""
    S_, B_, E = logits_SBE.shape
    scores = torch.sigmoid(logits_SBE.reshape(-1, E))
    scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    routing_map = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)
    cost = routing_map.view(S_, B_, E).sum(0) / (S_ * k / E)
    return (cost * scores.view(S_, B_, E).mean(0)).sum(1).mean() * coeff


def make_router(seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    router = TopKRouter(MoEConfig(hidden_size=H, ffn_hidden_size=8, **{**DSV3, **kw}))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) / math.sqrt(H))
        router.expert_bias.copy_(torch.randn(router.config.num_experts, generator=gen) * 0.1)
    x = torch.randn(B * S, H, generator=gen)
    return router, x


# ---- row 1: which experts the balancing losses count ----------------------------------------------------


@pytest.mark.parametrize("counts", ["paper", "selected"])
@pytest.mark.parametrize("loss", ["seq_aux_loss", "aux_loss", "global_aux_loss"])
def test_balance_loss_counts_paper_or_selected(loss, counts):
    """Value and router-weight gradient of each balancing loss on DeepSeek-V3 routing (bias and
    groups on) against the formula, counting the paper's top-k of s or the selected experts."""
    alpha = 0.3
    assert balancing.aux_loss_scale() == 1.0
    router, x = make_router(seed=len(loss), aux_loss_type=loss, aux_loss_coeff=alpha, aux_loss_counts=counts)
    plain, _ = make_router(seed=len(loss))  # same weights and bias, no balancing loss
    r = torch.randn(B * S, DSV3["top_k"], generator=torch.Generator().manual_seed(9))
    seq_len = S if loss == "seq_aux_loss" else B * S  # aux / global: the micro-batch is one group

    routing, losses, _ = router(x, seq_len=S)
    (routing.topk_weights * r).sum().backward()
    routing_plain, _, _ = plain(x, seq_len=S)
    (routing_plain.topk_weights * r).sum().backward()
    assert torch.equal(routing.topk_idx, routing_plain.topk_idx)  # the loss never changes the routing

    W = router.weight.detach().double().requires_grad_()
    logits = x.double() @ W.T
    selected = routing.topk_idx.tolist()
    bias = router.expert_bias.tolist()  # the selection is DeepSeek-V3's (biased, 4 of 8 groups)
    assert [sorted(c) for c in selected] == [sorted(ref_select([sigmoid(v) for v in row], bias, 8, 8, 4))
                                             for row in logits.tolist()]
    paper = paper_chosen(logits.detach(), DSV3["top_k"])
    want = ref_balance_loss(logits, paper if counts == "paper" else selected, DSV3["top_k"], alpha, seq_len)
    other = ref_balance_loss(logits, selected if counts == "paper" else paper, DSV3["top_k"], alpha, seq_len)
    got = losses.values[loss].item()
    assert got == pytest.approx(want.item(), rel=1e-6, abs=1e-9)
    assert abs(other.item() - want.item()) > 1e-3 * want.item()  # the two conventions differ here

    (ref_grad,) = torch.autograd.grad(want, W)
    injected = router.weight.grad - plain.weight.grad
    scale, routed = ref_grad.abs().max().item(), plain.weight.grad.abs().max().item()
    assert scale > 1e-4
    err = (injected.double() - ref_grad).abs().max().item()  # fp32 cancellation against the routed gradient
    assert err <= 1e-5 * scale + 1e-6 * routed, f"injected gradient misses the formula's by {err:.3g}"


def test_paper_seq_loss_equals_megatron_and_default_is_selected():
    """With aux_loss_counts='paper' the sequence-wise loss equals Megatron-Core's (tokens sequence-
    major there, batch-major here); the default ('selected') is bit-identical to naming it."""
    router, x = make_router(seed=3, aux_loss_type="seq_aux_loss", aux_loss_coeff=1e-4, aux_loss_counts="paper")
    _, losses, _ = router(x, seq_len=S)
    logits_SBE = (x @ router.weight.detach().T).view(B, S, -1).transpose(0, 1)
    want = megatron_seq_aux_loss(logits_SBE.double(), DSV3["top_k"], 1e-4)
    assert losses.values["seq_aux_loss"].item() == pytest.approx(want.item(), rel=1e-6)

    default, _ = make_router(seed=3, aux_loss_type="seq_aux_loss", aux_loss_coeff=1e-4)
    named, _ = make_router(seed=3, aux_loss_type="seq_aux_loss", aux_loss_coeff=1e-4, aux_loss_counts="selected")
    assert default.config.aux_loss_counts == "selected"
    a, b = default(x, seq_len=S)[1].values["seq_aux_loss"], named(x, seq_len=S)[1].values["seq_aux_loss"]
    assert torch.equal(a, b) and a.item() != pytest.approx(want.item(), rel=1e-4)


def test_deepseek_recipes_count_as_the_paper_and_bad_values_name_the_field():
    for name in ("deepseek-v3-tiny", "deepseek-v3-671b"):
        model = get_recipe(name).model
        assert model.aux_loss_type == "seq_aux_loss" and model.moe_config().aux_loss_counts == "paper", name
    base = dict(family="qwen3_moe", vocab_size=32, hidden_size=16, num_layers=2, num_attention_heads=2,
                intermediate_size=32, moe_intermediate_size=8, num_experts=4, top_k=2)
    assert ModelConfig(**base, aux_loss_counts="paper").moe_config().aux_loss_counts == "paper"
    with pytest.raises(ValueError, match=r"aux_loss_counts='topk'.*'selected', 'paper'"):
        ModelConfig(**base, aux_loss_counts="topk")
    with pytest.raises(ValueError, match=r"MoEConfig\.bias_update_counts='after'"):
        MoEConfig(hidden_size=H, ffn_hidden_size=8, **DSV3, bias_update_counts="after")
    # qwen3_moe has no expert bias: its knobs are errors naming the recipe field and the fix
    with pytest.raises(ValueError, match=r"ModelConfig\.bias_update_counts='kept'.*only the deepseek_v3.*aux_loss_coeff"):
        ModelConfig(**base, bias_update_counts="kept")
    with pytest.raises(ValueError, match=r"ModelConfig\.bias_update_rate=0\.01.*leave it at 0\.001"):
        ModelConfig(**base, bias_update_rate=0.01)
    with pytest.raises(ValueError, match=r"MoEConfig\.bias_update_counts='kept'.*expert_bias=True"):
        MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2, bias_update_counts="kept")
    with pytest.raises(ValueError, match=r"MoEConfig\.bias_update_rate=0\.01.*expert_bias=True"):
        MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2, bias_update_rate=0.01)
    ds = get_recipe("deepseek-v3-tiny").model
    assert dataclasses.replace(ds, bias_update_rate=0.01).moe_config().bias_update_rate == 0.01


# ---- row 2: the group score ------------------------------------------------------------------------------


def test_group_score_is_the_top2_sum_like_transformers():
    """deepseek-v3-tiny's setting (8 experts, 4 groups keep 2, k=2): moetron selects and weighs like
    transformers' DeepseekV3TopkRouter (top-2 group sum); Megatron's top-(k // keep) = top-1 differs."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    kw = dict(num_experts=8, num_groups=4, topk_groups=2, top_k=2)
    router, x = make_router(seed=5, **kw)
    hf = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                               topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5))
    with torch.no_grad():
        hf.weight.copy_(router.weight)
        hf.e_score_correction_bias.copy_(router.expert_bias)
    routing, _, _ = router(x)
    _, hf_weights, hf_idx = hf(x)
    ours = [dict(zip(i, w)) for i, w in zip(routing.topk_idx.tolist(), routing.topk_weights.tolist())]
    theirs = [dict(zip(i, w)) for i, w in zip(hf_idx.tolist(), hf_weights.tolist())]
    assert [sorted(o) for o in ours] == [sorted(t) for t in theirs]
    assert all(o[e] == pytest.approx(t[e], rel=1e-6) for o, t in zip(ours, theirs) for e in o)
    bias = router.expert_bias.tolist()
    scores = torch.sigmoid(x @ router.weight.detach().T).tolist()
    megatron = [sorted(ref_select(s, bias, 2, 4, 2, group_top=2 // 2)) for s in scores]
    assert megatron != [sorted(o) for o in ours]


# ---- rows 3 and 4: capacity rounding and the "position" drop policy ---------------------------------------


def test_capacity_is_the_exact_ceil():
    """ceil(T*k*cf/E) in exact arithmetic: 110 for T=100, E=8, k=8, cf=1.1 (Megatron's float product: 111)."""
    assert capacity(100, 8, 8, 1.1) == math.ceil(Fraction(100 * 8, 8) * Fraction("1.1")) == 110
    assert math.ceil((100 * 8 / 8) * 1.1) == 111  # Megatron's get_capacity(num_tokens=T*k, E, cf)
    router, x = make_router(seed=1, num_experts=8, num_groups=None, topk_groups=None, top_k=8, capacity_factor=1.1)
    routing, _, _ = router(torch.randn(100, H, generator=torch.Generator().manual_seed(2)))
    assert routing.capacity == 110


def test_position_policy_keeps_each_experts_first_tokens():
    router, x = make_router(seed=4, num_experts=16, num_groups=4, topk_groups=2, top_k=4, capacity_factor=0.5,
                            drop_policy="position")
    routing, _, _ = router(x)
    bias = router.expert_bias.tolist()
    chosen = [ref_select(s, bias, 4, 4, 2) for s in torch.sigmoid(x @ router.weight.detach().T).tolist()]
    cap = math.ceil(Fraction(B * S * 4, 16) * Fraction("0.5"))
    users = {e: [t for t, c in enumerate(chosen) if e in c] for e in range(16)}
    assert any(len(u) > cap for u in users.values())  # something is dropped
    kept = routing.topk_idx.tolist()
    for e, u in users.items():
        assert [t for t in range(B * S) if e in kept[t]] == u[:cap], f"expert {e}"


# ---- row 5: what the expert-bias update counts ------------------------------------------------------------


def test_bias_update_counts_selected_or_kept():
    """`selected` (default): the top-k selections before capacity drops; `kept` (Megatron): the
    slots left after them, which for either drop policy is min(selected, capacity) per expert."""
    rate, E = 0.01, 16
    bias0 = torch.randn(E, generator=torch.Generator().manual_seed(6)) * 0.1
    updated = {}
    for counts in ("selected", "kept"):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=8, **{**DSV3, "num_experts": E, "num_groups": 4,
                                   "topk_groups": 2, "top_k": 4}, capacity_factor=0.5, bias_update_rate=rate,
                                   bias_update_counts=counts))
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            layer.router.weight.copy_(torch.randn(E, H, generator=gen) / math.sqrt(H))
            layer.router.expert_bias.copy_(bias0)
        x = torch.randn(B, S, H, generator=gen)
        layer(x)
        scores = torch.sigmoid(x.reshape(-1, H) @ layer.router.weight.detach().T).tolist()
        selected = [0] * E
        for s in scores:
            for e in ref_select(s, bias0.tolist(), 4, 4, 2):
                selected[e] += 1
        cap = math.ceil(Fraction(B * S * 4, E) * Fraction("0.5"))
        want = selected if counts == "selected" else [min(c, cap) for c in selected]
        assert layer.pending_counts.tolist() == want
        assert layer.update_expert_bias().tolist() == want
        mean = sum(want) / E
        step = torch.tensor([rate * ((mean > c) - (mean < c)) for c in want])
        assert torch.equal(layer.router.expert_bias, bias0 + step)
        updated[counts] = layer.router.expert_bias.clone()
    assert MoEConfig(hidden_size=H, ffn_hidden_size=8, **DSV3).bias_update_counts == "selected"
    assert not torch.equal(updated["selected"], updated["kept"])  # the drops change the update here


# ---- other differences ------------------------------------------------------------------------------------


def test_sigmoid_weights_follow_norm_topk_prob_even_for_k1():
    """moetron and transformers renormalise sigmoid weights iff norm_topk_prob (k=1 gives 1.0 x scale);
    Megatron renormalises always for k > 1 and never for k = 1 (get it with norm_topk_prob=False)."""
    kw = dict(num_experts=8, num_groups=None, topk_groups=None, top_k=1, expert_bias=False)
    for norm in (True, False):
        cfg = MoEConfig(hidden_size=H, ffn_hidden_size=8, **{**DSV3, **kw, "norm_topk_prob": norm})
        router = TopKRouter(cfg)
        x = torch.randn(20, H, generator=torch.Generator().manual_seed(8))
        routing, _, _ = router(x)
        logits = (x.double() @ router.weight.detach().double().T).tolist()
        for t, (e,) in enumerate(routing.topk_idx.tolist()):
            want = 2.5 if norm else 2.5 * sigmoid(logits[t][e])
            assert routing.topk_weights[t, 0].item() == pytest.approx(want, rel=1e-6)


def test_switch_loss_scale_against_transformers():
    """moetron's (and Megatron's) Switch loss is E/k * sum f P (1 when balanced); transformers'
    load_balancing_loss_func is E * sum f P, k times larger, pooled over the layers it is given."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    E, k = 16, 4
    router = TopKRouter(MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=k,
                                  aux_loss_type="aux_loss", aux_loss_coeff=1.0))
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(10))
    _, losses, _ = router(x)
    theirs = load_balancing_loss_func((x @ router.weight.detach().T,), E, k)
    assert losses.values["aux_loss"].item() * k == pytest.approx(theirs.item(), rel=1e-6)
