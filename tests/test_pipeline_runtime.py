"""The pipeline runtime against the same model in one process.

Every rank builds the same tiny model (same seed), runs the single-process reference on the
concatenated batch (loss, then every gradient), and runs the schedule on its own stages. Each
micro-batch has the same number of non-ignored labels, so the mean of per-micro-batch losses
is the concatenated batch's loss. Two optimizer steps per case: the second step only matches
if every copy of a shared parameter (embedding on E/MTP/tied-head stages, every stage under
DualPipe) received the summed gradient in the first.
"""

import copy

import pytest
import torch

from dist_utils import run_distributed
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.moe.layer import MoELayer
from moetron.pipeline import LayoutError, ScheduleError, build_schedule, parse_layout
from moetron.pipeline.p2p import plan_messages
from moetron.pipeline.runtime import run_schedule, sync_shared_parameters
from moetron.pipeline.split_backward import backward_input
from moetron.pipeline.schedules import SCHEDULES
from moetron.pipeline.stage import MicroBatch, PipelineStageModule, build_stage_modules, even_layout

QWEN = dict(family="qwen3_moe", vocab_size=53, hidden_size=32, num_layers=3, num_attention_heads=4,
            num_kv_heads=2, head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=8,
            top_k=2, mlp_only_layers=[1], init_std=0.1,
            aux_loss_type="seq_aux_loss", aux_loss_coeff=0.05)  # aux gradients through the pipeline
DEEPSEEK = dict(family="deepseek_v3", vocab_size=61, hidden_size=32, num_layers=3, num_attention_heads=4,
                intermediate_size=48, moe_intermediate_size=16, num_experts=8, top_k=2, first_k_dense_replace=1,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=16,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_mtp_layers=1,
                init_std=0.1)
MODELS = {"qwen": QWEN, "qwen_tied": {**QWEN, "tie_word_embeddings": True}, "deepseek": DEEPSEEK,
          "deepseek_mtp2": {**DEEPSEEK, "num_mtp_layers": 2}}
B, S, LR, STEPS = 2, 6, 0.5, 2


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# name: (model, schedule, microbatches, vpp, layout or None for even, run_schedule options)
CASES_PP2 = {
    "qwen_1f1b": ("qwen", "1f1b", 4, None, None, {}),
    "qwen_tied_zb1p_odd_m": ("qwen_tied", "zb1p", 3, None, "Et|ttL", {"overlap_p2p_comm": False}),
    "deepseek_interleaved_mtp_apart": ("deepseek", "interleaved", 4, 2, "Et|t|tm|L", {}),
    "qwen_interleaved_empty_stage": ("qwen", "interleaved", 2, 2, "Ett||t|L", {}),
    "deepseek_dualpipev_moe_pieces": ("deepseek", "dualpipev", 4, None, "E|tt|t|mL", {"fb_overlap": "moe"}),
    "deepseek_dualpipev_back_to_back": ("deepseek_mtp2", "dualpipev", 6, None, "Et|t|tm|mL",
                                        {"overlap_p2p_comm": False}),
    "deepseek_dualpipe_layer_pieces": ("deepseek", "dualpipe", 4, None, "Et|ttmL", {"fb_overlap": "layer"}),
    "deepseek_1f1b_paired_moe_pieces": ("deepseek", "1f1b", 4, None, "Ett|tmL", {"fb_overlap": "moe"}),
}
CASES_PP4 = {
    "deepseek_1f1b_custom": ("deepseek", "1f1b", 5, None, "Et|t|tm|L", {}),
    "qwen_zb1p": ("qwen", "zb1p", 6, None, None, {}),
    "deepseek_dualpipev": ("deepseek", "dualpipev", 8, None, "E|t||t|t|m||L", {"fb_overlap": "moe"}),
    "qwen_tied_dualpipe": ("qwen_tied", "dualpipe", 8, None, "Et|t|t|L", {}),
    "deepseek_interleaved": ("deepseek_mtp2", "interleaved", 4, 2, "Et|t||t|m||m|L", {}),
}


def make_data(cfg, microbatches, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (microbatches * B, S + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[:, 2] = -100  # the same count of ignored labels in every micro-batch
    return inputs, labels


def build_model(name):
    torch.manual_seed(0)
    return MoETransformer(ModelConfig(**MODELS[name]))


def assert_close(got, want, rtol, msg):
    """|got - want| <= rtol * (|want| + max|want|) elementwise."""
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    atol = rtol * want.abs().max().item()
    excess = ((got - want).abs() - rtol * want.abs() - atol).max().item()
    assert excess <= 0, f"{msg}: worst excess {excess:.3g} over atol {atol:.3g}"


def sgd(params, grads):
    with torch.no_grad():
        for name, p in params.items():
            p -= LR * grads[name]


def check_case(name, case, rank, world):
    """Run STEPS steps of pipeline and reference; return the parameter names this rank checked."""
    model_name, sched_name, m, vpp, text, options = case
    model = build_model(model_name)
    cfg = model.config
    ref = copy.deepcopy(model)
    inputs, labels = make_data(cfg, m, seed=len(name))
    microbatches = [MicroBatch(inputs[i * B:(i + 1) * B], labels[i * B:(i + 1) * B]) for i in range(m)]
    schedule = build_schedule(sched_name, pp=world, microbatches=m, vpp=vpp)
    text = text or even_layout(cfg.num_layers, schedule.num_stages, cfg.num_mtp_layers)
    layout = parse_layout(text, num_layers=cfg.num_layers, mtp_layers=cfg.num_mtp_layers, pp=world,
                          vpp=schedule.num_stages // world)
    chunks = build_stage_modules(model, layout, schedule, rank)
    params = {}
    for chunk in chunks:
        for pname, p in chunk.named_parameters():
            params.setdefault(pname, p)
    if name == "qwen_tied_zb1p_odd_m" and rank == world - 1:  # a stale copy of the tied embedding
        with torch.no_grad():
            params["embed_tokens.weight"].add_(1.0)
        sync_shared_parameters(schedule, chunks)
    elif name == "qwen_tied_zb1p_odd_m":
        sync_shared_parameters(schedule, chunks)
    for step in range(STEPS):
        with torch.no_grad():
            per_mb = [ref(mb.input_ids, labels=mb.labels) for mb in microbatches]
        ref.zero_grad(set_to_none=True)
        for layer in [*ref.moe_layers(), *model.moe_layers()]:
            layer.pending_counts.zero_()
        out = ref(inputs, labels=labels)
        out.total_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        ref_counts = {n: m.pending_counts for n, m in ref.named_modules() if isinstance(m, MoELayer)}
        model.zero_grad(set_to_none=True)
        result = run_schedule(schedule, chunks, microbatches, **options)
        where = f"{name} step {step} rank {rank}"
        for chunk in chunks:  # routing counts for the bias update: each token once, copies summed
            for n, m in chunk.named_modules():
                if isinstance(m, MoELayer):
                    assert torch.equal(m.pending_counts, ref_counts[n]), (where, n)
        assert abs(result.loss.item() - out.total_loss.item()) <= 1e-6 * abs(out.total_loss.item()), (
            where, result.loss.item(), out.total_loss.item())
        assert abs(result.lm_loss.item() - out.loss.item()) <= 1e-6 * out.loss.item(), where
        if cfg.num_mtp_layers:
            assert abs(result.mtp_loss.item() - out.mtp_loss.item()) <= 1e-6 * out.mtp_loss.item(), where
        want = torch.stack([o.total_loss for o in per_mb])
        assert torch.allclose(result.losses, want, rtol=1e-6, atol=0), (where, result.losses, want)
        for pname, p in params.items():
            assert p.grad is not None, f"{where}: {pname} got no gradient"
            assert_close(p.grad, ref_grads[pname], 1e-5, f"{where}: grad of {pname}")
        sgd(params, {n: p.grad for n, p in params.items()})
        sgd(dict(ref.named_parameters()), ref_grads)
    return sorted(params), [n for n, p in ref.named_parameters() if p.requires_grad], result.timeline


def _run_cases(rank, world, cases):
    torch.manual_seed(1234 + rank)  # ranks must not rely on a shared global RNG state
    return {name: check_case(name, case, rank, world) for name, case in cases.items()}


def _check_coverage(results, cases):
    for name in cases:
        checked = set().union(*(set(r[name][0]) for r in results))
        assert checked == set(results[0][name][1]), f"{name}: parameters nobody checked: " \
            f"{set(results[0][name][1]) - checked}"


def test_pp2_schedules_match_one_process():
    results = run_distributed(_run_cases, 2, CASES_PP2, timeout=240)
    _check_coverage(results, CASES_PP2)
    # the overlapped pairs really ran as pairs (1F1B's made by pairing each backward with a forward)
    for name in ("deepseek_dualpipev_moe_pieces", "deepseek_1f1b_paired_moe_pieces"):
        assert any(t.startswith("FB(") for t in results[0][name][2]), name


def test_pp4_schedules_match_one_process():
    results = run_distributed(_run_cases, 4, CASES_PP4, timeout=300)
    _check_coverage(results, CASES_PP4)


# ------------------------------------------------------------------ in one process


@pytest.mark.parametrize("sched,vpp,text", [("1f1b", None, "Etttm L"), ("interleaved", 3, "Et|t|tmL"),
                                            ("interleaved", 5, "E|ttt|m||L"), ("zb1p", None, "EtttmL")])
def test_one_rank_schedules_match_the_model(sched, vpp, text):
    """pp=1: every transfer is local (interleaved: stage to stage on the same rank)."""
    cfg = ModelConfig(**DEEPSEEK)
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    inputs, labels = make_data(cfg, 3, seed=7)
    out = model(inputs, labels=labels)
    out.total_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    schedule = build_schedule(sched, pp=1, microbatches=3, vpp=vpp)
    layout = parse_layout(text, num_layers=3, mtp_layers=1, pp=1, vpp=schedule.num_stages)
    result = run_schedule(schedule, build_stage_modules(model, layout, schedule, 0),
                          [(inputs[i * B:(i + 1) * B], labels[i * B:(i + 1) * B]) for i in range(3)])
    assert abs(result.loss.item() - out.total_loss.item()) <= 1e-6 * out.total_loss.item()
    for n, p in model.named_parameters():
        assert_close(p.grad, ref[n], 1e-5, n)


@pytest.mark.parametrize("split", [None, "layer", "moe"])
def test_split_backward_equals_full_backward(split):
    """B computes input gradients without touching weights; W then gives the same weight grads."""
    cfg = ModelConfig(**{**DEEPSEEK, "num_mtp_layers": 2, "tie_word_embeddings": True})
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    layout = parse_layout("Et|tt|mmL", num_layers=3, mtp_layers=2, pp=3)
    inputs, labels = make_data(cfg, 1, seed=3)
    batch = MicroBatch(inputs, labels)
    g = torch.Generator().manual_seed(9)
    for index in (1, 2):
        stage = PipelineStageModule(model, layout, index)
        x = [torch.randn(shape, generator=g) for shape, _ in stage.input_spec(batch)]
        cot = [torch.randn(shape, generator=g) for shape, _ in stage.output_spec(batch)]
        got = {}
        for split_bw in (False, True):
            model.zero_grad(set_to_none=True)
            state = tuple(t.clone().requires_grad_() for t in x)
            record = []
            for i, (_, fn) in enumerate(stage.pieces(batch, split=split)):
                if i:
                    state = tuple(t.detach().requires_grad_() if t.requires_grad else t for t in state)
                out = fn(state)
                record.append((state, out))
                state = out
            grads = cot if index == 1 else [torch.tensor(0.7)] + [None] * (len(state) - 1)
            works = []
            for ins, outs in reversed(record):
                pairs = [(o, gr) for o, gr in zip(outs, grads) if gr is not None and o.requires_grad]
                if split_bw:
                    grads, work = backward_input([o for o, _ in pairs], [gr for _, gr in pairs], ins)
                    works.append(work)
                else:
                    torch.autograd.backward([o for o, _ in pairs], [gr for _, gr in pairs])
                    grads = [t.grad for t in ins]
            if split_bw:
                assert all(p.grad is None for p in stage.parameters()), "the input pass touched weights"
                for work in works:
                    work.run()
            got[split_bw] = (grads, {n: p.grad.clone() for n, p in stage.named_parameters()})
        (dx_full, dw_full), (dx_split, dw_split) = got[False], got[True]
        for a, b in zip(dx_split, dx_full):
            assert_close(a, b, 1e-6, f"stage {index} input grad")
        assert dw_split.keys() == dw_full.keys()
        for n in dw_full:
            assert_close(dw_split[n], dw_full[n], 1e-6, f"stage {index} {n}")


@pytest.mark.parametrize("outlive", [None, False])
def test_weight_pass_runs_after_the_outputs_are_freed(monkeypatch, outlive):
    """The weight pass runs after the stage's outputs are gone, from a custom autograd Function on the
    input path (moetron's RMSNorm). torch 2.11 frees such a node with the outputs, so backward_input
    keeps them there (forced here with outlive=False; None: what this torch does)."""
    from moetron.ops.functional import _RMSNormFunction
    from moetron.pipeline import split_backward

    if outlive is not None:
        monkeypatch.setattr(split_backward, "_function_nodes_outlive_outputs", lambda: outlive)
    g = torch.Generator().manual_seed(11)
    x, w1, dy = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(4, 8, generator=g)
    w2 = 1 + 0.1 * torch.randn(8, generator=g)

    def run(split):
        a, b, xi = w1.clone().requires_grad_(), w2.clone().requires_grad_(), x.clone().requires_grad_()
        y = _RMSNormFunction.apply(xi @ a, b, 1e-6) * 2
        if not split:
            y.backward(dy)
            return xi.grad, a.grad, b.grad
        (gx,), work = backward_input([y], [dy], [xi])
        assert a.grad is None and b.grad is None
        del y  # what a pipeline stage does with its outputs once their gradients are in
        work.run()
        return gx, a.grad, b.grad

    for got, want in zip(run(True), run(False)):
        assert got is not None and got.abs().max() > 0 and torch.equal(got, want)


def test_p2p_plan_never_sends_before_producing():
    """Walking each rank's list as the runtime does, every op before a needed receive is a
    receive or an already produced send, and both ends see each pair's messages in one order."""
    for name, pp, m, vpp in [("1f1b", 3, 5, None), ("interleaved", 2, 5, 3), ("zb1p", 4, 6, None),
                             ("dualpipev", 3, 6, None), ("dualpipe", 4, 8, None)]:
        schedule = build_schedule(name, pp=pp, microbatches=m, vpp=vpp)
        plan = plan_messages(schedule)
        assert len({msg.key for msg in plan}) == len(plan)
        for rank in range(pp):
            ops = [msg for msg in plan if rank in (msg.src, msg.dst)]
            produced = set()
            for action in schedule.rank_actions[rank]:
                for part in action.parts():
                    mb, s = part.microbatch, part.stage
                    need = {"F": ("act", mb, s), "B": ("grad", mb, s)}.get(part.kind)
                    idx = next((i for i, msg in enumerate(ops) if msg.key == need and msg.dst == rank), None)
                    if idx is not None:
                        blocked = [msg for msg in ops[:idx] if msg.src == rank and msg.key not in produced]
                        assert not blocked, (name, rank, action, blocked)
                for part in action.parts():
                    mb, s = part.microbatch, part.stage
                    produced.add(("act", mb, s + 1) if part.kind == "F" else ("grad", mb, s - 1))
            for peer in range(pp):
                mine = [msg for msg in ops if peer in (msg.src, msg.dst)]
                theirs = [msg for msg in plan if {msg.src, msg.dst} == {rank, peer}]
                assert mine == theirs or peer == rank


def test_bad_sizes_and_layouts_fail_clearly():
    for name, pp, m, message in [("dualpipev", 2, 3, "microbatches >= 2\\*pp"),
                                 ("dualpipev", 2, 2, "microbatches >= 2\\*pp"), ("dualpipe", 3, 6, "even pp"),
                                 ("interleaved", 4, 2, "microbatches=2 must be >= pp=4")]:
        with pytest.raises(ScheduleError, match=message):
            build_schedule(name, pp=pp, microbatches=m)
    cfg = ModelConfig(**DEEPSEEK)
    model = MoETransformer(cfg)
    with pytest.raises(LayoutError, match="not a multiple of pp=2"):
        parse_layout("Et|t|tmL", num_layers=3, mtp_layers=1, pp=2)
    v = build_schedule("dualpipev", pp=2, microbatches=4)
    layout = parse_layout("Et|ttmL", num_layers=3, mtp_layers=1, pp=2)
    with pytest.raises(LayoutError, match="runs 4 .*2 per rank, placed as a V"):
        build_stage_modules(model, layout, v, 0)
    one = build_schedule("1f1b", pp=1, microbatches=2)
    chunks = build_stage_modules(model, parse_layout("EtttmL", num_layers=3, mtp_layers=1, pp=1), one, 0)
    inputs, labels = make_data(cfg, 3, seed=1)
    with pytest.raises(ScheduleError, match="built for 2 micro-batches, got 3"):
        run_schedule(one, chunks, [(inputs[i:i + 1], labels[i:i + 1]) for i in range(3)])
    with pytest.raises(ScheduleError, match="pipeline group has 1 ranks"):
        run_schedule(v, chunks, [(inputs[i:i + 1], labels[i:i + 1]) for i in range(4)])
    with pytest.raises(ValueError, match="fb_overlap"):
        run_schedule(one, chunks, [(inputs[i:i + 1], labels[i:i + 1]) for i in range(2)], fb_overlap="yes")


def test_every_schedule_is_covered():
    names = {case[1] for case in {**CASES_PP2, **CASES_PP4}.values()}
    assert names == set(SCHEDULES)
