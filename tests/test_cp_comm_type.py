"""`parallel.cp_comm_type` (issue 15): context parallel by p2p ring, Ulysses a2a and hierarchical a2a+p2p.

- The attention op (`exchange_attention`) against whole-sequence attention in one process: each rank's
  output rows and its q/k/v gradient rows (the ring sends K/V gradients home, a2a returns them), for
  GQA (kv heads dividing the a2a group, fewer kv heads than ranks: replicated, one kv head), MLA-like
  per-head K/V with another value size, cp=2 and cp=4 (a2a+p2p as 2 x 2), the ring's blocks whole and
  one query row at a time (`cp_ring.SCORE_BUDGET`); the attention modules of
  both families with `cp_comm` set (MLA with the core and up-projection recomputed).
- The trainer, 3 steps of the tiny recipes (Qwen3-MoE GQA and DeepSeek-V3 MLA with MTP) with cp=2 and
  p2p / a2a (world 2), and cp=4 as a2a+p2p [2, 2] (world 4), against one process: per-step losses,
  gradient norm and every final weight within 1e-5 (tests/test_train_layouts.py's comparison). Slow:
  cp2 x pp2 (zb1p's split backward, DualPipeV's overlapped pieces, recompute) and cp2 x tp2.
- Errors for the combinations that cannot work, and the hierarchical sub-groups by hand.
"""

import copy

import pytest
import torch

from dist_utils import run_distributed
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.model.parallelize import context_parallelize
from moetron.model.rope import RotaryEmbedding
from moetron.ops.attention_core import core_attention
from moetron.parallel import ParallelConfig, ParallelState, cp_ring, validate_for_model
from moetron.parallel.context_parallel import CPComm, exchange_attention, local_positions, split_for_cp
from moetron.parallel.state import Group, named_rank_groups
from moetron.train.trainer import train
from test_context_parallel import DEEPSEEK, QWEN, fake_cp_state, rel_err, sum_over
from test_train_layouts import _final_state, _metrics, _recipe, _reference, compare_metrics, compare_states

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

B, S = 2, 16
# (heads, kv heads, qk dim, v dim): GQA, kv heads fewer than the a2a group at cp=4, MQA, per-head K/V (MLA)
SHAPES = ((4, 2, 6, 6), (8, 2, 6, 6), (4, 1, 6, 6), (4, 4, 6, 5))
LAYOUTS = [  # (name, ParallelConfig fields); world 4: cp=2 runs two CP groups (dp=2)
    ("p2p_cp2", dict(cp=2, cp_comm_type="p2p")),
    ("a2a_cp2", dict(cp=2, cp_comm_type="a2a")),
    ("p2p_cp4", dict(cp=4, cp_comm_type="p2p")),
    ("a2a_cp4", dict(cp=4, cp_comm_type="a2a")),
    ("a2a+p2p_cp4", dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_cp=[2, 2])),
]


def check_op(comm, backend):
    """exchange_attention vs core_attention on the whole sequence: output rows, q/k/v gradient rows."""
    cp = comm.group
    worst = 0.0
    for h, hk, dqk, dv in SHAPES:
        if hk < comm.a2a_size() and comm.a2a_size() % hk:
            continue
        gen = torch.Generator().manual_seed(h * 100 + hk * 10 + dv)  # the same on every rank
        q = torch.randn(B, h, S, dqk, generator=gen, requires_grad=True)
        k = torch.randn(B, hk, S, dqk, generator=gen, requires_grad=True)
        v = torch.randn(B, hk, S, dv, generator=gen, requires_grad=True)
        cot = torch.randn(B, h, S, dv, generator=gen)
        want = core_attention(q, k, v, 0.35, "eager")
        (want * cot).sum().backward()
        local = [split_for_cp(t.detach(), cp.size, cp.rank, dim=2).requires_grad_() for t in (q, k, v)]
        got = exchange_attention(*local, 0.35, backend, comm)
        (got * split_for_cp(cot, cp.size, cp.rank, dim=2)).sum().backward()
        for a, b, what in ((got, want, "out"), *((t.grad, r.grad, n) for t, r, n in zip(local, (q, k, v), "qkv"))):
            err = rel_err(a.detach(), split_for_cp(b.detach(), cp.size, cp.rank, dim=2))
            assert err < 1e-5, (comm.kind, cp.size, backend, (h, hk, dqk, dv), what, err)
            worst = max(worst, err)
    return worst


def check_modules(ps, comm):
    """Both attention modules with `cp_comm`: output rows, input gradient rows, parameter gradients."""
    cases = [(QWEN, frozenset()), (DEEPSEEK, frozenset({"core_attn", "mla_up_proj"}))]
    for cfg_dict, recompute in cases:
        cfg = ModelConfig(**cfg_dict)
        torch.manual_seed(0)
        ref = MoETransformer(cfg).layers[1].self_attn
        attn = copy.deepcopy(ref)
        attn.cp_group, attn.cp_comm, attn.recompute_modules = ps.cp, comm, recompute
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(B, S, cfg.hidden_size, generator=gen, requires_grad=True)
        cot = torch.randn(B, S, cfg.hidden_size, generator=gen)
        rotary = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        want = ref(x, rotary(torch.arange(S).unsqueeze(0), x.dtype))
        (want * cot).sum().backward()
        cp = ps.cp
        x_local = split_for_cp(x.detach(), cp.size, cp.rank).requires_grad_()
        got = attn(x_local, rotary(split_for_cp(torch.arange(S).unsqueeze(0), cp.size, cp.rank), x.dtype))
        (got * split_for_cp(cot, cp.size, cp.rank)).sum().backward()
        assert rel_err(got.detach(), split_for_cp(want.detach(), cp.size, cp.rank)) < 1e-5, (comm.kind, cfg.family)
        assert rel_err(x_local.grad, split_for_cp(x.grad, cp.size, cp.rank)) < 1e-5, (comm.kind, cfg.family)
        for (n, p), q in zip(ref.named_parameters(), attn.parameters()):
            assert rel_err(sum_over(q.grad, cp), p.grad) < 1e-5, (comm.kind, cfg.family, n)


def _op_worker(rank, world):
    report = {}
    for name, fields in LAYOUTS:  # every rank builds the same groups in the same order
        ps = ParallelState.build(ParallelConfig(**fields))
        comm = CPComm.build(fields["cp_comm_type"], ps)
        report[name] = check_op(comm, "sdpa")
        cp_ring.SCORE_BUDGET, budget = 1, cp_ring.SCORE_BUDGET  # the ring's blocks one query row at a time
        try:
            report[name] = max(report[name], check_op(comm, "eager"))
        finally:
            cp_ring.SCORE_BUDGET = budget
        check_modules(ps, comm)
    return report


def test_attention_op_matches_whole_sequence_attention():
    out = run_distributed(_op_worker, 4, timeout=300)
    assert set(out[0]) == {name for name, _ in LAYOUTS}


# ---- the trainer ---------------------------------------------------------------------------------

FAMILIES = ("qwen3-moe-tiny", "deepseek-v3-tiny")
TRAIN2 = [(f"{fam}-cp2-{kind}", fam, ["parallel.cp=2", f"parallel.cp_comm_type={kind}"])
          for kind in ("p2p", "a2a") for fam in FAMILIES]
TRAIN4 = [(f"{fam}-cp4-a2a+p2p", fam, ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p",
                                       "parallel.hierarchical_cp=[2,2]"]) for fam in FAMILIES]
# with other layouts (slow): split backward (zb1p) and DualPipeV's overlapped pieces, recompute, TP
COMPOSED = [
    ("deepseek-cp2-pp2-p2p-zb1p", "deepseek-v3-tiny", ["parallel.cp=2", "parallel.pp=2", "parallel.cp_comm_type=p2p",
                                                        "parallel.schedule=zb1p", "train.grad_accum=2"]),
    ("qwen-cp2-pp2-a2a-dualpipev", "qwen3-moe-tiny", ["parallel.cp=2", "parallel.pp=2", "parallel.cp_comm_type=a2a",
                                                       "parallel.schedule=dualpipev", "parallel.fb_overlap=moe",
                                                       "train.grad_accum=4"]),
    ("deepseek-cp2-pp2-p2p-dualpipev-recompute", "deepseek-v3-tiny",
     ["parallel.cp=2", "parallel.pp=2", "parallel.cp_comm_type=p2p", "parallel.schedule=dualpipev",
      "parallel.layout=Et|t|m|L", "parallel.fb_overlap=moe", "train.grad_accum=4",
      'model.recompute_modules=["core_attn","mla_up_proj"]']),
    ("qwen-cp2-tp2-a2a", "qwen3-moe-tiny", ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm_type=a2a"]),
    ("deepseek-cp2-tp2-sp-p2p", "deepseek-v3-tiny", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
                                                      "parallel.cp_comm_type=p2p"]),
]


def _train_worker(rank, world, cases, root):
    return [_metrics(train(_recipe(fam, extra + [f"train.save_dir={root}/{cid}"]), log=lambda s: None))
            for cid, fam, extra in cases]


def _check_cases(world, cases, root):
    results = run_distributed(_train_worker, world, cases, root, init=False, timeout=600)
    report = []
    for i, (cid, fam, extra) in enumerate(cases):
        recipe = _recipe(fam, extra + [f"train.save_dir={root}/{cid}"])
        sizes = recipe.parallel.resolve(world)
        same = [x for x in extra if not x.startswith(("parallel.", "train.grad_accum"))]
        want_metrics, want_state = _reference(fam, same + [f"train.grad_accum={sizes.dp * recipe.train.grad_accum}"],
                                              root)
        if sizes.pp > 1:  # the pipeline reports no balancing loss (as tests/test_switches.py)
            want_metrics = [{k: v for k, v in w.items() if k in ("loss", "lm_loss", "grad_norm")} for w in want_metrics]
        loss_err = max(compare_metrics(results[r][i], want_metrics, f"{cid} rank {r}") for r in range(world))
        param_err = compare_states(_final_state(recipe), want_state, cid)
        report.append(f"{cid:42s} metrics {loss_err:.1e}  parameters {param_err:.1e}")
    print("\n" + "\n".join(report))


@pytest.mark.parametrize("world,cases", [(2, TRAIN2), (4, TRAIN4)], ids=["cp2", "cp4_a2a+p2p"])
def test_trains_like_one_process(world, cases, tmp_path):
    _check_cases(world, cases, str(tmp_path))


@pytest.mark.slow
def test_composes_with_pipeline_recompute_and_tp(tmp_path):
    _check_cases(4, COMPOSED, str(tmp_path))


# ---- errors and groups ---------------------------------------------------------------------------


@pytest.mark.parametrize("fields,match", [
    (dict(cp=2, cp_comm_type="ring"), "cp_comm_type='ring' is unknown"),
    (dict(cp_comm_type="p2p"), "with parallel.cp=1"),
    (dict(cp=4, cp_comm_type="a2a+p2p"), r"needs parallel.hierarchical_cp=\[a2a, p2p\]"),
    (dict(cp=4, cp_comm_type="p2p", hierarchical_cp=[2, 2]), "only used by parallel.cp_comm_type=a2a\\+p2p"),
    (dict(cp=4, hierarchical_cp=[2, 2]), "only used by parallel.cp_comm_type=a2a\\+p2p"),
    (dict(cp=8, cp_comm_type="a2a+p2p", hierarchical_cp=[2, 2]), r"2 x 2 = 4 is not parallel.cp=8"),
    (dict(cp=8, cp_comm_type="a2a+p2p", hierarchical_cp=[2, 2, 2]), "must be two sizes"),
    (dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_cp=[0, 4]), "must be two sizes"),
])
def test_invalid_combinations_are_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**fields)


def test_head_limits():
    """a2a splits heads (per TP rank); kv heads divide the group or are replicated when they divide it."""
    ok = [(dict(cp=4, cp_comm_type="a2a"), 8, 2), (dict(cp=2, cp_comm_type="a2a"), 4, 2),
          (dict(cp=4, cp_comm_type="a2a"), 4, 1), (dict(cp=8, cp_comm_type="p2p"), 4, 1),
          (dict(cp=6, cp_comm_type="a2a+p2p", hierarchical_cp=[2, 3]), 4, 2),
          (dict(tp=2, cp=2, cp_comm_type="a2a"), 4, 1)]  # tp 2 x kv 1: each tp rank holds the kv head
    for fields, heads, kv in ok:
        validate_for_model(ParallelConfig(**fields), num_attention_heads=heads, num_kv_heads=kv)
    bad = [(dict(cp=4, cp_comm_type="a2a"), 6, 6, "holds 6 query heads"),
           (dict(cp=4, cp_comm_type="a2a"), 12, 3, "holds 12 query heads and 3 kv heads"),
           (dict(tp=2, cp=4, cp_comm_type="a2a"), 4, 4, "holds 2 query heads"),
           (dict(cp=6, cp_comm_type="a2a+p2p", hierarchical_cp=[3, 2]), 4, 4, "over 3 ranks")]
    for fields, heads, kv, match in bad:
        with pytest.raises(ValueError, match=match):
            validate_for_model(ParallelConfig(**fields), num_attention_heads=heads, num_kv_heads=kv)
    # at build time, against the modules (MLA: one K/V per query head; the ring needs torch's block math)
    with pytest.raises(ValueError, match="splits the attention heads.*holds 4 query heads"):
        context_parallelize(MoETransformer(ModelConfig(**DEEPSEEK)), fake_cp_state(8), "a2a")
    with pytest.raises(ValueError, match="attention_backend=flash_attn cannot take effect"):
        context_parallelize(MoETransformer(ModelConfig(**QWEN, attention_backend="flash_attn")),
                            fake_cp_state(2), "p2p")
    with pytest.raises(ValueError, match="cp_comm_type='ring' is unknown"):
        context_parallelize(MoETransformer(ModelConfig(**QWEN)), fake_cp_state(2), "ring")
    model = context_parallelize(MoETransformer(ModelConfig(**QWEN, attention_backend="flash_attn")),
                                fake_cp_state(2), "a2a")  # a2a runs any backend on the whole sequence
    assert {layer.self_attn.cp_comm.kind for layer in model.layers} == {"a2a"}


def test_hierarchical_groups_and_ring_layout():
    """a2a groups are consecutive CP ranks, rings the CP ranks with the same a2a rank; the a2a group's
    positions are the ring's two-chunk layout (what the ring is balanced for)."""
    sizes = ParallelConfig(tp=2, cp=4, cp_comm_type="a2a+p2p", hierarchical_cp=[2, 2]).resolve(8)
    groups = named_rank_groups(sizes)
    assert groups["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["cp_a2a"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["cp_p2p"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert "cp_a2a" not in named_rank_groups(ParallelConfig(cp=4).resolve(8))
    for a, n in ((2, 2), (2, 4), (4, 2)):
        for g in range(n):
            union = sorted(sum((local_positions(64, a * n, g * a + r).tolist() for r in range(a)), []))
            assert union == local_positions(64, n, g).tolist(), (a, n, g)
    with pytest.raises(KeyError, match="cp_a2a"):  # a state built without hierarchical_cp
        CPComm.build("a2a+p2p", fake_cp_state(4))
    ring = CPComm.build("p2p", fake_cp_state(4, rank=1))
    assert ring.ring.ranks == (0, 1, 2, 3) and ring.a2a is None and isinstance(ring.group, Group)
