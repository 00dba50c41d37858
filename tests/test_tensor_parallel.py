"""Tensor and sequence parallel against one process holding the whole model.

Every rank holds the same batch. The reference is the unsharded MoETransformer (same weights,
same batch) in one process; the sharded model's loss, MTP loss and balancing losses must equal it,
and every gradient, gathered back to full shape, must equal the reference's. The shard layout is
checked against shapes written out here by hand (not derived from the code under test). Two spawns
(tp=2 and tp=4) run every case.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.parallel import ParallelConfig, ParallelState
from moetron.model.parallelize import TensorParallelMoETransformer, tensor_parallelize, unshard_tensors
from moetron.parallel.state import Group
from moetron.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, all_gather_linear,
                                              linear_reduce_scatter)
from moetron.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

V, B, S = 96, 2, 8  # V is no other dimension of the models, so a [.., V] tensor is full logits

QWEN = dict(family="qwen3_moe", vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4,
            num_kv_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=4, top_k=2,
            mlp_only_layers=[0], aux_loss_type="aux_loss", aux_loss_coeff=0.05, z_loss_coeff=0.01)
DEEPSEEK = dict(family="deepseek_v3", vocab_size=V, hidden_size=32, num_layers=2, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense_replace=1,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_mtp_layers=1,
                aux_loss_type="seq_aux_loss", aux_loss_coeff=0.05)

# name: (config, sequence parallel, overlap chunks, MoE dispatcher (None: MoELayer's default))
CASES_TP2 = {
    "qwen_kv_split": (QWEN, False, 1, None),
    "qwen_kv_split_sp": (QWEN, True, 1, None),
    "qwen_kv_replicated_sp_overlap": ({**QWEN, "num_kv_heads": 1}, True, 3, None),
    "qwen_tied_capacity_sp_allgather": ({**QWEN, "tie_word_embeddings": True, "capacity_factor": 1.0,
                                         "attention_bias": True}, True, 1, "allgather"),
    "deepseek_qlora": (DEEPSEEK, False, 1, None),
    "deepseek_qlora_sp_overlap": (DEEPSEEK, True, 2, None),
    "deepseek_no_qlora_sp_flex": ({**DEEPSEEK, "q_lora_rank": None}, True, 1, "flex"),
}
CASES_TP4 = {
    "qwen_kv_replicated": (QWEN, False, 1, None),  # 2 kv heads over 4 ranks
    "qwen_kv_replicated_sp_overlap": (QWEN, True, 2, None),
    "deepseek_qlora_sp": (DEEPSEEK, True, 1, None),
    "deepseek_no_qlora_flex": ({**DEEPSEEK, "q_lora_rank": None}, False, 1, "flex"),
}


def rel_err(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :3] = -100  # ignored positions
    return ids, labels


def with_sp(ps, sp):
    """The same groups, with sequence parallel on or off."""
    return ParallelState(dataclasses.replace(ps.sizes, sp=sp), ps.rank, ps.groups)


class FullVocabWatch(TorchDispatchMode):
    """Records every op output whose last dim is the full vocabulary."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.ops = 0

    @classmethod
    def _should_skip_dynamo(cls):  # keeps torch from importing dynamo (seconds) for this mode
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == V:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def expected_local_shapes(cfg: ModelConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """This rank's parameter shapes for layer 1 (MoE) and the embedding, written out by hand."""
    H = cfg.hidden_size
    shapes = {"embed_tokens.weight": (V // tp, H)}
    a = "layers.1.self_attn."
    if cfg.family == "qwen3_moe":
        d, kv = cfg.head_dim, cfg.num_kv_heads
        shapes[a + "q_proj.weight"] = (cfg.num_attention_heads * d // tp, H)
        shapes[a + "k_proj.weight"] = (kv * d // tp if kv % tp == 0 else kv * d, H)  # replicated: whole
        shapes[a + "o_proj.weight"] = (H, cfg.num_attention_heads * d // tp)
        shapes["layers.0.mlp.gate_proj.weight"] = (cfg.intermediate_size // tp, H)
        shapes["layers.0.mlp.down_proj.weight"] = (H, cfg.intermediate_size // tp)
    else:
        h = cfg.num_attention_heads // tp
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            shapes[a + "q_b_proj.weight"] = (h * qk, cfg.q_lora_rank)
            shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, H)
        else:
            shapes[a + "q_proj.weight"] = (h * qk, H)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
        shapes[a + "kv_b_proj.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (H, h * cfg.v_head_dim)
        shapes["layers.1.mlp.shared_experts.gate_proj.weight"] = (cfg.moe_intermediate_size // tp, H)
    F_ = cfg.moe_intermediate_size
    shapes["layers.1.mlp.experts.gate_up_proj"] = (cfg.num_experts, 2 * F_ // tp, H)
    shapes["layers.1.mlp.experts.down_proj"] = (cfg.num_experts, H, F_ // tp)
    shapes["layers.1.mlp.router.weight"] = (cfg.num_experts, H)
    return shapes


def run_model_case(ps, name, cfg_dict, sp, chunks, dispatcher, watch=False):
    """Sharded vs single-process: losses, aux losses, logits shard, every gradient, expert bias."""
    cfg = ModelConfig(**cfg_dict)
    torch.manual_seed(0)
    ref = MoETransformer(cfg)
    with torch.no_grad():  # larger router weights, so routing and the balancing losses matter
        for m in ref.moe_layers():
            m.router.weight.mul_(20)
    model = copy.deepcopy(ref)
    ids, labels = batch()
    want = ref(ids, labels=labels)
    want.total_loss.backward()
    if cfg.capacity_factor is not None:  # the capacity case must really drop tokens
        assert max(st["dropped_fraction"] for st in ref.load_stats().values()) > 0, name

    ps = with_sp(ps, sp)
    tp = ps.tp.size
    tensor_parallelize(model, ps, overlap_chunks=chunks, moe_dispatcher=dispatcher)
    assert isinstance(model, TensorParallelMoETransformer)
    local = dict(model.named_parameters())
    for pname, shape in expected_local_shapes(cfg, tp).items():
        assert tuple(local[pname].shape) == shape, (name, pname, tuple(local[pname].shape), shape)

    mode = FullVocabWatch() if watch else None
    if mode:
        with mode:
            got = model(ids, labels=labels)
            forward_ops = mode.ops
            got.total_loss.backward()
        assert forward_ops > 100 and mode.ops > 2 * forward_ops, "the watch must see forward and backward"
        assert not mode.seen, f"{name}: full-vocabulary tensors on one rank: {mode.seen[:5]}"
    else:
        got = model(ids, labels=labels)
        got.total_loss.backward()

    assert got.logits.shape == (B, S, V // tp), (name, got.logits.shape)
    r = ps.tp.rank
    assert rel_err(got.logits.detach(), want.logits.detach()[..., r * V // tp:(r + 1) * V // tp]) < 1e-5, name
    assert got.num_tokens == want.num_tokens
    for what in ("loss", "total_loss", "mtp_loss"):
        w, g = getattr(want, what), getattr(got, what)
        if w is None:
            assert g is None
            continue
        assert abs(g.item() - w.item()) <= 1e-6 * abs(w.item()), (name, what, g.item(), w.item())
    assert sorted(got.aux_losses) == sorted(want.aux_losses) and want.aux_losses, name
    for k in want.aux_losses:
        assert rel_err(got.aux_losses[k], want.aux_losses[k]) < 1e-5, (name, k)

    grads = {n: p.grad for n, p in model.named_parameters()}
    full = unshard_tensors(model, ps, grads)
    ref_params = dict(ref.named_parameters())
    assert sorted(full) == sorted(ref_params), name
    worst = (0.0, "")
    for pname, p in ref_params.items():
        assert p.grad is not None and p.grad.abs().max() > 0, (name, pname)
        worst = max(worst, (rel_err(full[pname], p.grad), pname))
    assert worst[0] < 1e-5, f"{name}: gradient of {worst[1]} off by {worst[0]:.3g} (relative)"
    weights = unshard_tensors(model, ps)  # round trip of the shards themselves
    assert all(torch.equal(weights[n], p.detach()) for n, p in ref_params.items()), name

    if cfg.family == "deepseek_v3":  # aux-loss-free bias update sees the same counts' signs
        ref.update_expert_bias()
        model.update_expert_bias()
        for a, b in zip(ref.moe_layers(), model.moe_layers()):
            assert torch.equal(a.router.expert_bias, b.router.expert_bias), name
            assert b.router.expert_bias.abs().sum() > 0
    return got.total_loss.detach(), {n: g.clone() for n, g in grads.items()}, worst


def check_overlap_primitives(ps):
    """Chunked all-gather->GEMM and GEMM->reduce-scatter equal the plain collectives + GEMM."""
    tp = ps.tp
    gen = torch.Generator().manual_seed(10 + tp.rank)
    for s_local, chunks in ((7, 3), (8, 2), (5, 8)):  # uneven chunks, more chunks than rows
        x = torch.randn(B, s_local, 12, generator=gen)
        w1, b1 = torch.randn(10, 12, generator=gen), torch.randn(10, generator=gen)
        w2 = torch.randn(6, 12, generator=gen)
        w3 = torch.randn(12, 10, generator=gen)
        cot = torch.randn(B, s_local, 12, generator=gen)
        results = []
        for c in (1, chunks):
            leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, w3)]
            xx, ww1, bb1, ww2, ww3 = leaves
            h1, h2 = all_gather_linear(xx, [ww1, ww2], [bb1, None], tp, -2, c)
            assert h1.shape == (B, tp.size * s_local, 10) and h2.shape == (B, tp.size * s_local, 6)
            y = linear_reduce_scatter(torch.tanh(h1), ww3, tp, -2, c) + h2.sum() * 0.01
            assert y.shape == (B, s_local, 12)
            (y * cot).sum().backward()
            results.append([y.detach()] + [t.grad for t in leaves])
        for plain, chunked in zip(*results):
            assert rel_err(chunked, plain) < 1e-6

    # freshly built layers: column -> row equals the two full linears on the gathered weights
    for sp, chunks in ((False, 1), (True, 1), (True, 2)):
        block = torch.nn.Sequential(
            ColumnParallelLinear(12, 8, tp, bias=True, sequence_parallel=sp, overlap_chunks=chunks),
            RowParallelLinear(8, 12, tp, bias=True, sequence_parallel=sp, overlap_chunks=chunks))
        with torch.no_grad():
            block[1].bias.copy_(torch.arange(12.0))  # replicated: the same on every rank
        assert block[0].weight.shape == (8 // tp.size, 12) and block[1].weight.shape == (12, 8 // tp.size)
        full = unshard_tensors(block, with_sp(ps, sp))
        x_full = torch.randn(B, 4 * tp.size, 12, generator=torch.Generator().manual_seed(5))
        want = F.linear(F.linear(x_full, full["0.weight"], full["0.bias"]), full["1.weight"], full["1.bias"])
        x = x_full.chunk(tp.size, dim=1)[tp.rank] if sp else x_full
        got = block(x)
        assert rel_err(got.detach(), want.chunk(tp.size, dim=1)[tp.rank] if sp else want) < 1e-6


def check_vocab_parallel_pieces(ps):
    tp = ps.tp
    gen = torch.Generator().manual_seed(3)  # same on every rank: the full tensors
    n_local = V // tp.size
    mine = slice(tp.rank * n_local, (tp.rank + 1) * n_local)
    logits = torch.randn(3, 2 * tp.size + 1, V, generator=gen) * 4
    labels = torch.randint(0, V, logits.shape[:2], generator=gen)
    labels[0, 0], labels[1, 2] = -100, -100  # ignored
    labels[2, :-1] = torch.tensor([r * n_local + o for r in range(tp.size) for o in (0, n_local - 1)])  # edges
    full = logits.clone().requires_grad_()
    want = {r: F.cross_entropy(full.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction=r)
            for r in ("sum", "mean", "none")}
    want["sum"].backward()
    for reduction in ("sum", "mean", "none"):
        shard = logits[..., mine].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(shard, labels, tp, reduction=reduction)
        w = want[reduction].view(labels.shape) if reduction == "none" else want[reduction]
        assert rel_err(got.detach(), w.detach()) < 1e-6, reduction
        if reduction == "sum":
            got.backward()
            assert rel_err(shard.grad, full.grad[..., mine]) < 1e-6
            assert (shard.grad[0, 0] == 0).all()  # ignored token: no gradient

    emb_full = torch.nn.Embedding(V, 6, _weight=torch.randn(V, 6, generator=gen))  # the same on every rank
    for sp in (False, True):
        emb = VocabParallelEmbedding.from_embedding(emb_full, tp, sequence_parallel=sp)
        assert emb.weight.shape == (n_local, 6)
        ids = torch.randint(0, V, (2, 4 * tp.size), generator=gen)
        want_e = F.embedding(ids, emb_full.weight.detach())
        got_e = emb(ids)
        if sp:
            want_e = want_e.chunk(tp.size, dim=1)[tp.rank]
        assert torch.equal(got_e.detach(), want_e)
    emb = VocabParallelEmbedding.from_embedding(emb_full, tp, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length divisible by tp"):
        emb(torch.zeros(2, 4 * tp.size + 1, dtype=torch.long))


def _worker(rank, world_size, cases, watch_cases, overlap_pairs):
    import time

    ps = ParallelState.build(ParallelConfig(tp=world_size))
    timings = {}
    t0 = time.perf_counter()
    check_overlap_primitives(with_sp(ps, True))
    check_vocab_parallel_pieces(ps)
    timings["primitives"] = time.perf_counter() - t0
    results = {}
    for name, (cfg, sp, chunks, dispatcher) in cases.items():
        t0 = time.perf_counter()
        results[name] = run_model_case(ps, name, cfg, sp, chunks, dispatcher, watch=name in watch_cases)
        timings[name] = time.perf_counter() - t0
    for name in overlap_pairs:  # the same case through the plain (unchunked) collectives
        cfg, sp, chunks, dispatcher = cases[name]
        assert sp and chunks > 1
        loss, grads, _ = run_model_case(ps, name + "_plain", cfg, sp, 1, dispatcher)
        loss_c, grads_c, _ = results[name]
        assert abs(loss_c.item() - loss.item()) <= 1e-7 * abs(loss.item()), name
        for n in grads:
            assert rel_err(grads_c[n], grads[n]) < 1e-6, (name, n)
    return timings, {n: r[2] for n, r in results.items()}


def test_tp2_matches_single_process():
    out = run_distributed(_worker, 2, CASES_TP2, {"qwen_kv_split", "deepseek_qlora_sp_overlap"},
                          ["qwen_kv_replicated_sp_overlap", "deepseek_qlora_sp_overlap"], timeout=300)
    assert set(out[0][1]) == set(CASES_TP2)


def test_tp4_matches_single_process():
    out = run_distributed(_worker, 4, CASES_TP4, {"qwen_kv_replicated_sp_overlap"}, [], timeout=300)
    assert set(out[0][1]) == set(CASES_TP4)


def fake_state(tp, sp=False):
    sizes = ParallelConfig(tp=tp, sp=sp).resolve(tp)
    groups = {name: Group(name, (0,), 0, None) for name in ("cp", "dp", "pp", "ep", "edp")}
    for name in ("tp", "etp", "tp_ep", "tp_cp", "mp", "tp_ep_pp", "dp_cp", "world"):
        groups[name] = Group(name, tuple(range(tp)), 0, None)
    return ParallelState(sizes, 0, groups)


@pytest.mark.parametrize("overrides, tp, message", [
    ({}, 3, "tp=3 does not divide num_attention_heads=4"),
    ({"num_attention_heads": 6, "num_kv_heads": 3}, 2, "kv heads are split over tp"),
    ({"vocab_size": 95}, 2, "does not divide vocab_size=95"),
    ({"intermediate_size": 50}, 4, "does not divide ffn_hidden_size=50"),
])
def test_invalid_layouts_fail_before_sharding(overrides, tp, message):
    cfg = ModelConfig(**{**QWEN, "head_dim": 8, **overrides})
    model = MoETransformer(cfg)
    before = {n: p.shape for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        tensor_parallelize(model, fake_state(tp))
    assert {n: p.shape for n, p in model.named_parameters()} == before  # untouched
    assert type(model) is MoETransformer


def test_shared_expert_size_must_split():
    cfg = ModelConfig(**{**DEEPSEEK, "moe_intermediate_size": 6, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="shared experts' ffn size 6"):
        tensor_parallelize(MoETransformer(cfg), fake_state(4))


def test_tp1_is_the_model_itself():
    model = MoETransformer(ModelConfig(**QWEN))
    assert tensor_parallelize(model, ParallelState.single(ParallelConfig(sp=True))) is model
    assert type(model) is MoETransformer
