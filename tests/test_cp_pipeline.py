"""Pipeline parallel with context or tensor parallel in the trainer: cp2 x pp2 and tp2(+sp) x pp2
train exactly like one process.

World 4, one spawn: each case runs the trainer for 3 optimizer steps with parallel.cp=2 and
parallel.pp=2 (every micro-batch split into each CP rank's two load-balanced chunks before the
pipeline; P2P tensors of the local length; the loss stage's LM and MTP losses CP-reduced, MTP
labels shifted across chunk borders) and must match the same recipe in one process on the same
global batch: loss, LM loss and MTP loss at every step within 1e-5 relative on every rank, and after the
last step every parameter and buffer within max|a - b| / max|b| < 1e-5, read back from the
checkpoints of both runs into one-process models. Both attention kinds are covered (DeepSeek-V3
MLA with an MTP layer, Qwen3-MoE GQA with the router z-loss) and five schedules (1F1B, DualPipeV
with overlapped forward/backward pieces, interleaved, zero-bubble zb1p with split backward,
DualPipe with the Switch aux loss).
`train.grad_clip=1e-4` keeps AdamW from amplifying fp32 rounding (tests/test_train_layouts.py
explains why). Balancing aux losses are off except in the DualPipe case (tests/test_cp_aux_loss.py
covers them under CP).
"""

import math

import torch

from dist_utils import run_distributed
from moetron.model.model import MoETransformer
from moetron.recipes import apply_overrides, get_recipe
from moetron.checkpoint.training import latest_checkpoint, load_checkpoint
from moetron.train.trainer import train

STEPS = 3
TOL = 1e-5
BASE = ["model.num_layers=2", "train.seq_len=16", "train.micro_batch_size=2", f"train.steps={STEPS}",
        "train.warmup_steps=1", "train.grad_clip=1e-4", "train.log_every=100", "model.aux_loss_type=none"]
CP_PP = ["parallel.cp=2", "parallel.pp=2"]
# (recipe, overrides): dp = 1, so the one-process reference accumulates the same grad_accum.
CASES = [
    ("deepseek-v3-tiny", ["train.grad_accum=2"]),  # 1F1B, MLA, MTP on the last stage
    # 1F1B, GQA, router z-loss (exact under CP: a per-token mean whose gradient the trainer scales
    # by 1/cp; the pipeline must keep that scale)
    ("qwen3-moe-tiny", ["train.grad_accum=2", "model.z_loss_coeff=1e-1"]),
    # MTP on another stage than the loss (its labels shift across chunk borders there), the
    # embedding shared by three stages on both ranks, pieces of two micro-batches interleaved
    ("deepseek-v3-tiny", ["parallel.schedule=dualpipev", "parallel.layout=Et|t|m|L", "train.grad_accum=4",
                          "parallel.fb_overlap=moe"]),
    ("qwen3-moe-tiny", ["parallel.schedule=interleaved", "parallel.vpp=2", "train.grad_accum=2"]),
    # split backward: input gradients (through the CP exchanges) in B, weight gradients in W
    ("deepseek-v3-tiny", ["parallel.schedule=zb1p", "train.grad_accum=2"]),
    # DualPipe: every stage (experts included) on two ranks, each copy counted once in the norm
    # that clipping uses; with the Switch aux loss, exact under CP through the router's cp_group
    ("qwen3-moe-tiny", ["parallel.schedule=dualpipe", "train.grad_accum=4", "model.aux_loss_type=aux_loss"]),
]
# tp2 x pp2 with sequence parallel (stages pass S/tp rows; the MTP embedding is sequence-sharded too)
TP_PP = ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"]
TP_CASES = [
    ("deepseek-v3-tiny", ["train.grad_accum=2"]),
    # split backward: weight-gradient regions (with the TP all-reduce of sequence-parallel norm
    # grads) must run in the same order on both TP ranks
    ("qwen3-moe-tiny", ["parallel.schedule=zb1p", "train.grad_accum=2"]),
    ("deepseek-v3-tiny", ["parallel.schedule=dualpipev", "train.grad_accum=4"]),
]


def _recipe(name, extra):
    return apply_overrides(get_recipe(name), BASE + list(extra))


def _metrics(history):
    return [(h["loss"], h["lm_loss"]) + ((h["mtp_loss"],) if "mtp_loss" in h else ()) for h in history]


def _train_cases(rank, world, cases):
    return [_metrics(train(_recipe(name, extra), log=lambda s: None)) for name, extra in cases]


def _final_state(recipe):
    """The run's weights after its last step, from its checkpoint, in a one-process model."""
    model = MoETransformer(recipe.model)
    folder = latest_checkpoint(recipe.train.save_dir)
    assert folder is not None and folder.name == f"step-{STEPS:08d}", recipe.train.save_dir
    load_checkpoint(folder, model, load_rng=False)  # raises on a missing or unexpected name
    return model.state_dict()


def _rel(a, b):
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def test_cp_times_pp_trains_like_one_process(tmp_path):
    cases = [(name, layout + extra + [f"train.save_dir={tmp_path}/pp-{i}"])
             for i, (name, layout, extra) in enumerate([(n, CP_PP, e) for n, e in CASES] +
                                                       [(n, TP_PP, e) for n, e in TP_CASES])]
    results = run_distributed(_train_cases, 4, cases, init=False, timeout=300)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    report = []
    try:
        for i, (name, extra) in enumerate(cases):
            same = [x for x in extra if not x.startswith(("parallel.", "train.save_dir"))]
            ref = _recipe(name, same + [f"train.save_dir={tmp_path}/ref-{i}"])
            want = _metrics(train(ref, log=lambda s: None))
            assert len(want) == STEPS and len(want[0]) == (3 if name.startswith("deepseek") else 2)
            loss_err = 0.0
            for rank in range(4):
                got = results[rank][i]
                assert len(got) == STEPS and all(len(g) == len(w) for g, w in zip(got, want)), (name, extra)
                for step, (g, w) in enumerate(zip(got, want)):
                    for a, b in zip(g, w):
                        err = abs(a - b) / abs(b)
                        assert err < TOL, f"{name} {extra} rank {rank} step {step}: {g} vs {w}"
                        loss_err = max(loss_err, err)
            got_state, want_state = _final_state(_recipe(name, extra)), _final_state(ref)
            torch.manual_seed(ref.train.seed)  # the weights both runs started from (as build_run)
            initial = MoETransformer(ref.model).state_dict()
            assert sorted(got_state) == sorted(want_state) == sorted(initial)
            moved = [_rel(want_state[k], t) for k, t in initial.items() if t.dim() >= 2]
            assert min(moved) > 100 * TOL, f"{name}: weights moved too little for the comparison to mean much"
            param_err = 0.0
            for key, b in want_state.items():
                err = _rel(got_state[key], b)
                assert err < TOL, f"{name} {extra} {key}: max|a-b| / max|b| = {err:.3g}"
                param_err = max(param_err, err)
            report.append(f"{name:18s} {' '.join(x for x in extra if 'save_dir' not in x):80s} "
                          f"loss {loss_err:.1e} parameters {param_err:.1e}")
    finally:
        torch.set_num_threads(saved)
    print("\n" + "\n".join(report))


WORLD8 = [
    ("deepseek-v3-tiny", ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "parallel.pp=2", "train.grad_accum=2"]),
    ("qwen3-moe-tiny", ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.ep=2", "train.grad_accum=2"]),
]


def test_tp_cp_pp_on_eight_ranks_trains_like_one_process():
    """tp2 x cp2 x pp2 (DeepSeek-V3 with sequence parallel and MTP; Qwen3-MoE with ep2 folded over
    the tp x cp ranks): the losses of every step on every rank equal one process's."""
    results = run_distributed(_train_cases, 8, WORLD8, init=False, timeout=300)
    for i, (name, extra) in enumerate(WORLD8):
        want = _metrics(train(_recipe(name, [x for x in extra if not x.startswith("parallel.")]), log=lambda s: None))
        for rank in range(8):
            for step, (g, w) in enumerate(zip(results[rank][i], want)):
                assert all(abs(a - b) / abs(b) < TOL for a, b in zip(g, w)), f"{name} rank {rank} step {step}: {g} vs {w}"
