"""Context parallel against one process holding the whole sequence.

The reference is the same model (same weights) run in one process on the whole batch. Under CP each
rank runs its two load-balanced chunks; the CP-reduced losses must equal the reference's, and the
gradients summed over the CP ranks (each rank's loss is its share) must equal the reference's.
Layouts are checked against positions written out by hand; attention against an explicit float64
softmax. Two spawns: cp=2 (world 2), and cp=4 plus cp2 x tp2 with sequence parallel (world 4).
"""

import copy

import pytest
import torch

from dist_utils import run_distributed
from moetron.config import ModelConfig
from moetron.ops.attention_core import core_attention
from moetron.model.model import MoETransformer
from moetron.model.rope import RotaryEmbedding
from moetron.moe import balancing
from moetron.parallel import ParallelConfig, ParallelState
from moetron.model.parallelize import ContextParallelModel, context_parallelize, tensor_parallelize, unshard_tensors
from moetron.parallel.context_parallel import (attend_local_chunks, chunk_ids, gather_from_cp, local_positions,
                                               merge_cp_shards, split_batch, split_for_cp)
from moetron.parallel.state import Group

V, B, S = 96, 2, 16  # S divisible by 2*cp for cp = 1, 2, 4
MTP_HOOK = hasattr(MoETransformer, "shift_labels")  # MoETransformer._mtp_loss shifts through it

QWEN = dict(family="qwen3_moe", vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4,
            num_kv_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2,
            mlp_only_layers=[0], aux_loss_type="none", z_loss_coeff=0.01)
DEEPSEEK = dict(family="deepseek_v3", vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense_replace=1,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_mtp_layers=0,
                aux_loss_type="none", rope_interleave=True)
DEEPSEEK_MTP = {**DEEPSEEK, "num_mtp_layers": 2}


def rel_err(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :3] = -100  # ignored positions, all on CP rank 0's first chunk
    labels[1, 9] = -100
    return ids, labels


def fake_cp_state(cp, rank=0):
    """A ParallelState whose cp group has `cp` ranks, without processes (nothing here communicates)."""
    sizes = ParallelConfig(cp=cp).resolve(cp)
    groups = {name: Group(name, (0,), 0, None) for name in ("tp", "dp", "pp", "ep", "etp", "edp", "tp_ep", "mp",
                                                             "tp_ep_pp")}
    for name in ("cp", "dp_cp", "tp_cp", "world"):
        groups[name] = Group(name, tuple(range(cp)), rank, None)
    return ParallelState(sizes, rank, groups)


# ---- in one process ------------------------------------------------------------------------------


def test_load_balanced_layout_by_hand():
    assert chunk_ids(1, 0) == (0, 1)
    assert [chunk_ids(2, r) for r in range(2)] == [(0, 3), (1, 2)]
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert local_positions(12, 1, 0).tolist() == list(range(12))
    # every rank's causal work (keys its two chunks attend to) is the same
    for cp in (2, 4, 8):
        assert len({sum(c + 1 for c in chunk_ids(cp, r)) for r in range(cp)}) == 1

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, S, 5, generator=gen)
    for cp in (1, 2, 4):
        shards = [split_for_cp(x, cp, r, dim=1) for r in range(cp)]
        for r, shard in enumerate(shards):
            assert torch.equal(shard, x[:, local_positions(S, cp, r)])
        assert torch.equal(merge_cp_shards(shards, dim=1), x)
        xt = x.transpose(1, 2)  # the sequence on another dim
        assert torch.equal(merge_cp_shards([split_for_cp(xt, cp, r, dim=2) for r in range(cp)], dim=2), xt)

    ids, labels = batch()
    group = Group("cp", (0, 1, 2, 3), 2, None)
    local = split_batch(group, ids, labels)
    assert torch.equal(local["input_ids"], ids[:, [4, 5, 10, 11]])
    assert torch.equal(local["labels"], labels[:, [4, 5, 10, 11]])
    assert local["position_ids"].tolist() == [[4, 5, 10, 11]]
    pos = torch.arange(S).flip(0).expand(B, S)  # given positions are split, not replaced
    assert torch.equal(split_batch(group, ids, position_ids=pos)["position_ids"], pos[:, [4, 5, 10, 11]])
    assert split_batch(group, ids)["labels"] is None


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match=r"2\*cp = 4 does not divide the sequence length 10"):
        local_positions(10, 2, 0)
    with pytest.raises(ValueError, match="2\\*cp = 8 does not divide"):
        split_batch(Group("cp", (0, 1, 2, 3), 0, None), torch.zeros(1, 12, dtype=torch.long))
    with pytest.raises(ValueError, match="labels has 8 positions"):
        split_batch(Group("cp", (0, 1), 0, None), torch.zeros(1, 16, dtype=torch.long),
                    torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        chunk_ids(2, 2)
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="6 queries but only 4 keys"):
        core_attention(q, q[:, :, :4], q[:, :, :4], 0.5)


def reference_attention(q, k, v, scale):
    """float64, one query at a time: query i of Sq sees keys 0..Sk-Sq+i (queries are the last Sq)."""
    Sq, Sk = q.shape[-2], k.shape[-2]
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    rows = []
    for i in range(Sq):
        n = Sk - Sq + i + 1
        scores = (q[:, :, i:i + 1].double() @ k[:, :, :n].transpose(-1, -2)) * scale
        rows.append(torch.softmax(scores, -1) @ v[:, :, :n])
    return torch.cat(rows, dim=2)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_core_attention_bottom_right_causal(backend):
    gen = torch.Generator().manual_seed(2)
    for Sq, Sk, h, h_kv, dqk, dv in ((3, 7, 4, 2, 6, 5), (5, 5, 2, 2, 4, 4), (1, 6, 4, 1, 8, 3)):
        q = torch.randn(2, h, Sq, dqk, generator=gen)
        k = torch.randn(2, h_kv, Sk, dqk, generator=gen)
        v = torch.randn(2, h_kv, Sk, dv, generator=gen)
        got = core_attention(q, k, v, 0.4, backend)
        assert rel_err(got.double(), reference_attention(q, k, v, 0.4)) < 1e-5, (backend, Sq, Sk)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_local_chunks_attend_like_rows_of_full_attention(backend):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, S, 6, generator=gen)
    k = torch.randn(2, 2, S, 6, generator=gen)
    v = torch.randn(2, 2, S, 5, generator=gen)
    full = core_attention(q, k, v, 0.3, backend)
    for cp in (1, 2, 4):
        for r in range(cp):
            got = attend_local_chunks(split_for_cp(q, cp, r, dim=2), k, v, 0.3, backend, cp, r)
            assert rel_err(got, split_for_cp(full, cp, r, dim=2)) < 1e-6, (cp, r)


def test_context_parallelize_errors_and_single_rank():
    model = MoETransformer(ModelConfig(**QWEN))
    assert context_parallelize(model, fake_cp_state(1)) is model and type(model) is MoETransformer
    context_parallelize(model, fake_cp_state(2))
    assert isinstance(model, ContextParallelModel) and isinstance(model, MoETransformer)
    assert all(layer.self_attn.cp_group.size == 2 for layer in model.layers)
    with pytest.raises(ValueError, match="already context-parallel"):
        context_parallelize(model, fake_cp_state(2))
    with pytest.raises(ValueError, match="this rank holds 5 positions"):
        model(torch.zeros(1, 5, dtype=torch.long))
    if not MTP_HOOK:
        mtp = MoETransformer(ModelConfig(**DEEPSEEK_MTP))
        with pytest.raises(NotImplementedError, match="multi-token prediction.*shift_labels"):
            context_parallelize(mtp, fake_cp_state(2))
        assert type(mtp) is MoETransformer  # untouched


# ---- spawned -------------------------------------------------------------------------------------


def check_gather(cp):
    """gather_from_cp round trip and its backward (each rank's consumer differs: reduce-scatter)."""
    gen = torch.Generator().manual_seed(4)  # same on every rank: the whole tensors
    x = torch.randn(B, S, 3, 5, generator=gen)
    w = [torch.randn(B, S, 3, 5, generator=gen) for _ in range(cp.size)]  # rank r's cotangent
    local = split_for_cp(x, cp.size, cp.rank, dim=1).requires_grad_()
    full = gather_from_cp(local, cp, dim=1)
    assert torch.equal(full.detach(), x)
    (full * w[cp.rank]).sum().backward()
    assert rel_err(local.grad, split_for_cp(sum(w), cp.size, cp.rank, dim=1)) < 1e-6
    ids = torch.randint(0, V, (B, S), generator=gen)
    assert torch.equal(gather_from_cp(split_for_cp(ids, cp.size, cp.rank), cp), ids)


def sum_over(t, group):
    t = t.clone()
    torch.distributed.all_reduce(t, group=group.handle)
    return t


def check_attention_modules(cp):
    """Each attention module under CP: its output rows, input and parameter gradients."""
    for cfg_dict in (QWEN, DEEPSEEK, {**DEEPSEEK, "q_lora_rank": None, "attention_backend": "eager"}):
        cfg = ModelConfig(**cfg_dict)
        torch.manual_seed(0)
        ref = MoETransformer(cfg).layers[1].self_attn
        attn = copy.deepcopy(ref)
        attn.cp_group = cp
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(B, S, cfg.hidden_size, generator=gen, requires_grad=True)
        cot = torch.randn(B, S, cfg.hidden_size, generator=gen)
        rotary = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        want = ref(x, rotary(torch.arange(S).unsqueeze(0), x.dtype))
        (want * cot).sum().backward()

        x_local = split_for_cp(x.detach(), cp.size, cp.rank).requires_grad_()
        pos = split_for_cp(torch.arange(S).unsqueeze(0), cp.size, cp.rank)
        got = attn(x_local, rotary(pos, x.dtype))
        (got * split_for_cp(cot, cp.size, cp.rank)).sum().backward()
        assert rel_err(got.detach(), split_for_cp(want.detach(), cp.size, cp.rank)) < 1e-5, cfg.family
        assert rel_err(x_local.grad, split_for_cp(x.grad, cp.size, cp.rank)) < 1e-5, cfg.family
        for (n, p), q in zip(ref.named_parameters(), attn.parameters()):
            assert rel_err(sum_over(q.grad, cp), p.grad) < 1e-5, (cfg.family, n)


def run_model_case(ps, name, cfg_dict, tp_first=False):
    """Whole model: CP-reduced losses, logits rows, every gradient summed over CP, expert bias."""
    cfg = ModelConfig(**cfg_dict)
    cp, tp = ps.cp, ps.tp
    torch.manual_seed(0)
    ref = MoETransformer(cfg)
    with torch.no_grad():  # larger router weights, so routing (and the z-loss) matter
        for m in ref.moe_layers():
            m.router.weight.mul_(20)
    model = copy.deepcopy(ref)
    ids, labels = batch()
    want = ref(ids, labels=labels)
    want.total_loss.backward()

    if tp_first:
        tensor_parallelize(model, ps)
    context_parallelize(model, ps)
    local = split_batch(cp, ids, labels)
    del local["position_ids"]  # the CP model defaults to this rank's global positions
    balancing.set_aux_loss_scale(1.0 / cp.size)  # z-loss: a per-token mean on each rank
    try:
        got = model(**local)
        got.total_loss.backward()
    finally:
        balancing.set_aux_loss_scale(1.0)

    for what in ("loss", "total_loss", "mtp_loss"):
        w, g = getattr(want, what), getattr(got, what)
        if w is None:
            assert g is None, (name, what)
            continue
        assert abs(g.item() - w.item()) <= 1e-6 * abs(w.item()), (name, what, g.item(), w.item())
    assert got.num_tokens == want.num_tokens, name
    v_local = V // tp.size
    want_logits = want.logits.detach()[..., tp.rank * v_local:(tp.rank + 1) * v_local]
    assert rel_err(got.logits.detach(), split_for_cp(want_logits, cp.size, cp.rank)) < 1e-5, name
    if "z_loss" in want.aux_losses:  # each rank's local mean; their mean over CP is the global one
        z = sum_over(got.aux_losses["z_loss"], cp) / cp.size
        assert rel_err(z, want.aux_losses["z_loss"]) < 1e-5, name

    grads = {n: sum_over(p.grad, cp) for n, p in model.named_parameters()}
    full = unshard_tensors(model, ps, grads) if tp_first else grads
    worst = (0.0, "")
    for pname, p in ref.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, (name, pname)
        worst = max(worst, (rel_err(full[pname], p.grad), pname))
    assert worst[0] < 1e-5, f"{name}: gradient of {worst[1]} off by {worst[0]:.3g} (relative)"

    if cfg.family == "deepseek_v3":  # aux-loss-free bias: counts summed over CP are the global ones
        ref.update_expert_bias()
        for m in model.moe_layers():
            m.update_expert_bias(None if tp_first else cp)  # None: every rank of the stage
        for a, b in zip(ref.moe_layers(), model.moe_layers()):
            assert torch.equal(a.router.expert_bias, b.router.expert_bias), name
            assert b.router.expert_bias.abs().sum() > 0
    return worst


def _worker(rank, world_size, cases, with_modules):
    import time

    timings = {}
    if with_modules:
        ps = ParallelState.build(ParallelConfig(cp=world_size))
        t0 = time.perf_counter()
        check_gather(ps.cp)
        check_attention_modules(ps.cp)
        timings["gather+attention"] = time.perf_counter() - t0
    states = {}
    for name, (cfg, tp, cp) in cases.items():
        if (tp, cp) not in states:  # every rank builds the same groups in the same order
            states[tp, cp] = ParallelState.build(ParallelConfig(tp=tp, cp=cp, sp=tp > 1))
        t0 = time.perf_counter()
        run_model_case(states[tp, cp], name, cfg, tp_first=tp > 1)
        timings[name] = time.perf_counter() - t0
    return timings


def _model_cases(cp, tp=1, deepseek=DEEPSEEK):
    suffix = f"cp{cp}" + (f"_tp{tp}_sp" if tp > 1 else "")
    return {f"qwen_{suffix}": (QWEN, tp, cp), f"deepseek_{suffix}": (deepseek, tp, cp)}


def test_cp2_matches_single_process():
    cases = _model_cases(2)
    cases["qwen_kv1_eager_cp2"] = ({**QWEN, "num_kv_heads": 1, "attention_backend": "eager"}, 1, 2)
    if MTP_HOOK:
        cases["deepseek_mtp_cp2"] = (DEEPSEEK_MTP, 1, 2)
    out = run_distributed(_worker, 2, cases, True, timeout=300)
    assert set(cases) <= set(out[0])


def test_cp4_and_cp2_tp2_match_single_process():
    cases = {**_model_cases(4), **_model_cases(2, tp=2, deepseek=DEEPSEEK_MTP if MTP_HOOK else DEEPSEEK)}
    out = run_distributed(_worker, 4, cases, False, timeout=300)
    assert set(cases) <= set(out[0])
