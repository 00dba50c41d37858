"""Load-balancing losses, aux-loss gradient injection and aux-loss-free bias updates.

The references are the formulas of REFERENCE §3 / DeepSeek-V3 written out with loops over
experts and sequences; the top-k counts come from a per-token Python selection.
"""

import math

import pytest
import torch

from moetron import MoEConfig, MoELayer
from moetron.moe import balancing

H = 16
E = 8
K = 2


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# ---- independent references ------------------------------------------------------------------------


def assert_close(got, want, rtol, atol, msg=""):
    """|got - want| <= atol + rtol * |want| elementwise (torch.testing's version imports slowly)."""
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    err = (got - want).abs() - rtol * want.abs()
    assert bool((err <= atol).all()), f"{msg}: worst excess {err.max().item():.3g} over atol {atol:.3g}"


def ref_selected(logits, score_func, k, bias=None):
    """Per token, the k experts with the highest (biased) score; a plain Python loop."""
    chosen = []
    for row in logits.detach().double().tolist():
        if score_func == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            scores = [math.exp(v - m) for v in row]
            scores = [s / sum(scores) for s in scores]
        if bias is not None:
            scores = [s + float(b) for s, b in zip(scores, bias)]
        chosen.append(sorted(range(len(row)), key=lambda e: -scores[e])[:k])
    return chosen


def ref_probs(logits, score_func):
    """Rows that sum to one: softmax, or sigmoid scores divided by their sum."""
    if score_func == "softmax":
        ex = torch.exp(logits - logits.max(-1, keepdim=True).values)
    else:
        ex = 1 / (1 + torch.exp(-logits))
    return ex / ex.sum(-1, keepdim=True)


def ref_switch(probs, chosen, k, num_tokens=None, extra_counts=None):
    """E/k * sum_e f_e * P_e, f_e = count_e / T, P_e = mean prob of expert e."""
    T, n_exp = probs.shape
    tokens = num_tokens or T
    total = 0
    for e in range(n_exp):
        count = sum(e in c for c in chosen) + (extra_counts[e] if extra_counts else 0)
        total = total + (count / tokens) * (probs[:, e].sum() / T)
    return total * n_exp / k


def ref_seq(probs, chosen, k, seq_len):
    """The Switch loss of each sequence of `seq_len` tokens, averaged over sequences."""
    T = probs.shape[0]
    per_seq = [ref_switch(probs[s:s + seq_len], chosen[s:s + seq_len], k) for s in range(0, T, seq_len)]
    return sum(per_seq) / len(per_seq)


def ref_z(logits):
    """Mean over tokens of log(sum_e exp(logit))^2."""
    total = 0
    for row in logits:
        m = row.max()
        total = total + (m + torch.log(torch.exp(row - m).sum())) ** 2
    return total / logits.shape[0]


# ---- the loss functions -----------------------------------------------------------------------------


def _random_routing(gen, T, n_exp=E, k=K):
    logits = torch.randn(T, n_exp, generator=gen) * 1.5
    idx = torch.stack([torch.randperm(n_exp, generator=gen)[:k] for _ in range(T)])
    return logits, idx


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_balance_probs_rows(score_func):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(10, E, generator=gen)
    got = balancing.balance_probs(logits, score_func)
    assert_close(got, ref_probs(logits.double(), score_func).float(), rtol=1e-6, atol=1e-7)


def test_switch_aux_loss_formula():
    gen = torch.Generator().manual_seed(1)
    logits, idx = _random_routing(gen, 20)
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    chosen = idx.tolist()
    want = ref_switch(probs.double(), chosen, K)
    assert balancing.switch_aux_loss(probs, counts, K).item() == pytest.approx(want.item(), rel=1e-6)
    # counts from a larger (global) batch of 50 tokens
    extra = torch.randint(0, 9, (E,), generator=gen)
    want = ref_switch(probs.double(), chosen, K, num_tokens=50, extra_counts=extra.tolist())
    got = balancing.switch_aux_loss(probs, counts + extra, K, num_tokens=50)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_seq_aux_loss_formula():
    gen = torch.Generator().manual_seed(2)
    seq_len = 6
    logits, idx = _random_routing(gen, 4 * seq_len, k=3)
    probs = ref_probs(logits, "sigmoid").float()
    want = ref_seq(probs.double(), idx.tolist(), 3, seq_len)
    got = balancing.seq_aux_loss(probs, idx, seq_len)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # differs from the batch-wide Switch loss on this input, so the check is discriminating
    assert got.item() != pytest.approx(ref_switch(probs.double(), idx.tolist(), 3).item(), rel=1e-3)
    with pytest.raises(ValueError, match="sequences of 5"):
        balancing.seq_aux_loss(probs, idx, 5)


def test_shares_of_split_sequences_add_up_to_the_loss_and_its_gradient():
    """Context parallel in one process: each sequence's tokens split in 2 parts (as CP chunks);
    each part's share from its own prob sums and the whole counts. The shares add up to the
    float64 reference loss, and the gradient of their sum equals the reference's gradient."""
    gen = torch.Generator().manual_seed(4)
    seq_len, n_seq = 8, 3
    logits, idx = _random_routing(gen, n_seq * seq_len, k=3)
    logits = logits.double().requires_grad_()
    probs = ref_probs(logits, "sigmoid")
    chosen = idx.tolist()
    parts = [torch.tensor([s * seq_len + i for s in range(n_seq) for i in range(seq_len) if (i // 2) % 2 == p])
             for p in (0, 1)]  # interleaved pairs of positions: not the contiguous halves
    T = n_seq * seq_len
    counts_E = torch.bincount(idx.reshape(-1), minlength=E).double()
    counts_BE = balancing.seq_counts(idx, E, seq_len).double()
    for what, want in (("switch", ref_switch(probs, chosen, 3)), ("seq", ref_seq(probs, chosen, 3, seq_len))):
        shares = []
        for part in parts:
            if what == "switch":
                shares.append(balancing.switch_aux_from_sums(probs[part].sum(0), counts_E, 3, T))
            else:
                sums_BE = probs[part].view(n_seq, seq_len // 2, E).sum(1)
                shares.append(balancing.seq_aux_from_sums(sums_BE, counts_BE, 3, seq_len))
        got = sum(shares)
        assert got.item() == pytest.approx(want.item(), rel=1e-12), what
        want_grad, = torch.autograd.grad(want, logits, retain_graph=True)
        got_grad, = torch.autograd.grad(got, logits, retain_graph=True)
        assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14, msg=what)
        # one part alone is not the loss (so the sum above is a real check)
        assert shares[0].item() != pytest.approx(want.item(), rel=0.1), what
    # global_aux_loss: counts of a larger batch (count_tokens) than the micro-batch the probs sum over
    extra = torch.randint(0, 9, (E,), generator=gen)
    want = ref_switch(probs, chosen, 3, num_tokens=50, extra_counts=extra.tolist())
    got = sum(balancing.switch_aux_from_sums(probs[p].sum(0), counts_E + extra, 3, T, 50) for p in parts)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)


def test_z_loss_formula():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, E, generator=gen) * 3
    assert balancing.z_loss(logits).item() == pytest.approx(ref_z(logits.double()).item(), rel=1e-6)


# ---- gradient injection through the layer ----------------------------------------------------------


@pytest.fixture
def aux_scale():
    balancing.set_aux_loss_scale(1.0)  # a trainer step run in this process before may have left another
    yield balancing.set_aux_loss_scale
    balancing.set_aux_loss_scale(1.0)


def _layers(seed, **loss_kw):
    """Two layers with identical weights: `off` without balancing losses, `on` with `loss_kw`."""
    base = dict(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K)
    if loss_kw.get("score_func") == "sigmoid":
        base.update(score_func="sigmoid", norm_topk_prob=True)
    loss_kw = {k: v for k, v in loss_kw.items() if k != "score_func"}
    torch.manual_seed(seed)
    off = MoELayer(MoEConfig(**base))
    on = MoELayer(MoEConfig(**base, **loss_kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        off.router.weight.copy_(torch.randn(E, H, generator=gen) * 0.5)
        off.experts.gate_up_proj.copy_(torch.randn(off.experts.gate_up_proj.shape, generator=gen) * 0.1)
        off.experts.down_proj.copy_(torch.randn(off.experts.down_proj.shape, generator=gen) * 0.1)
    on.load_state_dict(off.state_dict())
    return off, on, gen


def _grads(layer, x, r):
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    y = layer(xg)
    (y * r).sum().backward()
    return y.detach(), layer.router.weight.grad.clone(), xg.grad.clone()


def _reference_loss(kind, score_func, x_TH, W, coeff, seq_len):
    logits = x_TH @ W.T
    chosen = ref_selected(logits, score_func, K)
    if kind == "z_loss":
        return coeff * ref_z(logits)
    probs = ref_probs(logits, score_func)
    if kind == "seq_aux_loss":
        return coeff * ref_seq(probs, chosen, K, seq_len)
    return coeff * ref_switch(probs, chosen, K)


INJECT_CASES = {
    "switch_softmax_BSH": ("aux_loss", "softmax", (3, 8)),
    "switch_softmax_TH": ("aux_loss", "softmax", (24,)),
    "switch_sigmoid": ("aux_loss", "sigmoid", (3, 8)),
    "seq_softmax_BSH": ("seq_aux_loss", "softmax", (3, 8)),
    "seq_sigmoid_4d": ("seq_aux_loss", "sigmoid", (2, 2, 6)),
    "seq_softmax_TH": ("seq_aux_loss", "softmax", (20,)),  # 2-D input: one sequence
    "z_softmax": ("z_loss", "softmax", (3, 8)),
    "z_sigmoid": ("z_loss", "sigmoid", (24,)),
}


@pytest.mark.parametrize("name", list(INJECT_CASES))
def test_aux_loss_gradient_injection(name, aux_scale):
    kind, score_func, lead = INJECT_CASES[name]
    coeff = 0.3
    kw = dict(z_loss_coeff=coeff) if kind == "z_loss" else dict(aux_loss_type=kind, aux_loss_coeff=coeff)
    off, on, gen = _layers(len(name), score_func=score_func, **kw)
    x = torch.randn(*lead, H, generator=gen)
    r = torch.randn(*lead, H, generator=gen)

    y_off, gw_off, gx_off = _grads(off, x, r)
    y_on, gw_on, gx_on = _grads(on, x, r)
    assert torch.equal(y_on, y_off)  # the forward is untouched
    assert off.aux_losses == {}

    x_TH = x.reshape(-1, H).double().requires_grad_()
    W = on.router.weight.detach().double().requires_grad_()
    seq_len = lead[-1] if len(lead) >= 2 else x_TH.shape[0]
    ref = _reference_loss(kind, score_func, x_TH, W, coeff, seq_len)
    ref_gw, ref_gx = torch.autograd.grad(ref, (W, x_TH))
    assert set(on.aux_losses) == {kind}
    assert on.aux_losses[kind].item() == pytest.approx(ref.item(), rel=1e-5)
    assert not on.aux_losses[kind].requires_grad

    scale = ref_gw.abs().max().item()
    assert scale > 1e-3  # the injected gradient is not negligible
    assert_close(gw_on - gw_off, ref_gw.float(), rtol=1e-5, atol=1e-5 * scale, msg="router weight")
    # x also carries the (larger) expert-path gradient, so allow for its cancellation error
    x_scale = max(ref_gx.abs().max().item(), gx_off.abs().max().item())
    assert_close((gx_on - gx_off).reshape(-1, H), ref_gx.float(), rtol=1e-5, atol=1e-5 * x_scale, msg="x")

    aux_scale(0.5)
    y_half, gw_half, _ = _grads(on, x, r)
    assert torch.equal(y_half, y_off)
    assert_close(gw_half - gw_off, 0.5 * ref_gw.float(), rtol=1e-5, atol=1e-5 * scale, msg="scale 0.5")


def test_aux_and_z_loss_together(aux_scale):
    coeff_aux, coeff_z = 0.2, 0.05
    off, on, gen = _layers(5, aux_loss_type="aux_loss", aux_loss_coeff=coeff_aux, z_loss_coeff=coeff_z)
    x = torch.randn(4, 6, H, generator=gen)
    r = torch.randn(4, 6, H, generator=gen)
    y_off, gw_off, _ = _grads(off, x, r)
    y_on, gw_on, _ = _grads(on, x, r)
    assert torch.equal(y_on, y_off)
    x_TH = x.reshape(-1, H).double()
    W = on.router.weight.detach().double().requires_grad_()
    aux = _reference_loss("aux_loss", "softmax", x_TH, W, coeff_aux, 6)
    z = _reference_loss("z_loss", "softmax", x_TH, W, coeff_z, 6)
    (ref_gw,) = torch.autograd.grad(aux + z, W)
    assert set(on.aux_losses) == {"aux_loss", "z_loss"}
    assert on.aux_losses["aux_loss"].item() == pytest.approx(aux.item(), rel=1e-5)
    assert on.aux_losses["z_loss"].item() == pytest.approx(z.item(), rel=1e-5)
    scale = ref_gw.abs().max().item()
    assert_close(gw_on - gw_off, ref_gw.float(), rtol=1e-5, atol=1e-5 * scale)


def test_expert_gradients_unchanged_by_aux_loss():
    off, on, gen = _layers(9, aux_loss_type="aux_loss", aux_loss_coeff=0.5, z_loss_coeff=0.1)
    x = torch.randn(2, 10, H, generator=gen)
    r = torch.randn(2, 10, H, generator=gen)
    _grads(off, x, r)
    _grads(on, x, r)
    assert torch.equal(on.experts.gate_up_proj.grad, off.experts.gate_up_proj.grad)
    assert torch.equal(on.experts.down_proj.grad, off.experts.down_proj.grad)


def test_no_losses_in_eval_or_no_grad():
    off, on, gen = _layers(4, aux_loss_type="seq_aux_loss", aux_loss_coeff=0.5, z_loss_coeff=0.1)
    x = torch.randn(3, 8, H, generator=gen)
    r = torch.randn(3, 8, H, generator=gen)
    on(x)
    assert set(on.aux_losses) == {"seq_aux_loss", "z_loss"}
    # eval: no losses and the gradients equal the loss-free layer's
    off.eval()
    on.eval()
    y_off, gw_off, gx_off = _grads(off, x, r)
    y_on, gw_on, gx_on = _grads(on, x, r)
    assert on.aux_losses == {}
    assert torch.equal(y_on, y_off) and torch.equal(gw_on, gw_off) and torch.equal(gx_on, gx_off)
    # training mode under no_grad: no losses either
    on.train()
    on(x)
    assert on.aux_losses
    with torch.no_grad():
        y = on(x)
    assert on.aux_losses == {}
    assert torch.equal(y, y_off)


def test_global_aux_loss_accumulates_counts_until_reset():
    coeff = 0.4
    _, on, gen = _layers(6, aux_loss_type="global_aux_loss", aux_loss_coeff=coeff)
    W = on.router.weight.detach().double()
    xs = [torch.randn(10, H, generator=gen), torch.randn(2, 7, H, generator=gen), torch.randn(9, H, generator=gen)]
    seen_chosen, seen_tokens = [], 0
    for i, x in enumerate(xs):
        if i == 2:
            on.update_expert_bias()  # a new global batch
            seen_chosen, seen_tokens = [], 0
        on(x)
        x_TH = x.reshape(-1, H).double()
        logits = x_TH @ W.T
        chosen = ref_selected(logits, "softmax", K)
        seen_chosen += chosen
        seen_tokens += x_TH.shape[0]
        extra = [sum(e in c for c in seen_chosen) - sum(e in c for c in chosen) for e in range(E)]
        want = coeff * ref_switch(ref_probs(logits, "softmax"), chosen, K, num_tokens=seen_tokens, extra_counts=extra)
        assert on.aux_losses["global_aux_loss"].item() == pytest.approx(want.item(), rel=1e-5), i


def test_global_aux_loss_keeps_its_token_count_on_the_device(monkeypatch):
    """The running token count stays a tensor (on a GPU, reading it waited for the forward so far in
    every MoE layer), and the loss has the bits a host count gives."""
    _, on, gen = _layers(7, aux_loss_type="global_aux_loss", aux_loss_coeff=0.3)
    x = torch.randn(2, 9, H, generator=gen)
    on(x)  # a first micro-batch: the counts run on
    reads = []
    for method in ("__float__", "__int__", "__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda t, *a, _real=real, **k: reads.append(1) or _real(t, *a, **k))
    logits = on.router.weight.detach() @ x.reshape(-1, H).T
    counts, tokens = on.router.global_counts(torch.ones(E), 18)
    assert not reads and isinstance(tokens, torch.Tensor) and tokens.dim() == 0
    monkeypatch.undo()
    probs = torch.softmax(logits.T, dim=-1)
    assert float(tokens) == 36.0
    assert torch.equal(balancing.switch_aux_loss(probs, counts, K, tokens),
                       balancing.switch_aux_loss(probs, counts, K, float(tokens)))
    assert torch.equal(balancing.switch_aux_from_sums(probs.sum(0), counts, K, 18, tokens),
                       balancing.switch_aux_from_sums(probs.sum(0), counts, K, 18, float(tokens)))


# ---- aux-loss-free balancing ------------------------------------------------------------------------


def test_update_expert_bias_follows_sign_rule():
    rate = 0.01
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K, score_func="sigmoid",
                    norm_topk_prob=True, expert_bias=True, bias_update_rate=rate)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(E, H, generator=gen) * 0.5)
        layer.router.expert_bias.copy_(torch.randn(E, generator=gen) * 0.05)
    bias0 = layer.router.expert_bias.clone()
    counts = [0] * E
    for shape in [(2, 6, H), (12, H), (1, 2, 5, H)]:
        x = torch.randn(*shape, generator=gen)
        layer(x)
        for c in ref_selected(x.reshape(-1, H) @ layer.router.weight.detach().T, "sigmoid", K, bias0.tolist()):
            for e in c:
                counts[e] += 1
    layer.eval()
    layer(torch.randn(30, H, generator=gen))  # eval forwards are not counted
    layer.train()
    assert layer.pending_counts.tolist() == counts
    assert len(set(counts)) > 1

    returned = layer.update_expert_bias()
    assert returned.tolist() == counts
    mean = sum(counts) / E
    step = torch.tensor([rate * ((mean > c) - (mean < c)) for c in counts], dtype=torch.float32)
    assert torch.equal(layer.router.expert_bias, bias0 + step)
    assert not torch.equal(layer.router.expert_bias, bias0)
    assert layer.pending_counts.tolist() == [0.0] * E  # counters reset

    bias1 = layer.router.expert_bias.clone()
    assert layer.update_expert_bias().tolist() == [0.0] * E
    assert torch.equal(layer.router.expert_bias, bias1)  # nothing counted, nothing changes


def test_update_expert_bias_is_noop_without_bias():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K))
    gen = torch.Generator().manual_seed(1)
    layer(torch.randn(3, 4, H, generator=gen))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.update_expert_bias()
    assert layer.router.expert_bias is None
    after = layer.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert layer.pending_counts.tolist() == [0.0] * E
