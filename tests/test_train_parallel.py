"""The trainer under torchrun-style launches: every layout trains exactly like one process.

Each layout's run sees the same global batch as the single-process run (data-parallel rank r
takes global micro-batches r, r+D, ...; one process accumulates all of them), so per-step
losses and gradient norms must agree up to summation order for 5 steps, and so must the
per-MoE-layer load metrics (`moe_load`): every rank reports the global step's numbers, pipeline
ranks included for the layers they do not hold.
"""

import math

import pytest

from dist_utils import run_distributed
from moetron.recipes import apply_overrides, get_recipe
from moetron.train.trainer import train

BASE = ["model.num_layers=3", "train.seq_len=32", "train.micro_batch_size=2", "train.steps=5",
        "train.warmup_steps=1", "train.log_every=100"]


def _recipe(name, extra):
    return apply_overrides(get_recipe(name), BASE + extra)


def _run_layouts(rank, world, layouts):
    out = []
    for name, extra in layouts:
        history = train(_recipe(name, extra), log=lambda s: None)
        out.append(_summary(history))
    return out


def _summary(history):
    return [((h["loss"], h["lm_loss"], h["grad_norm"]), h["moe_load"]) for h in history]


def _reference(name, extra, grad_accum):
    """The same recipe in one process: no layout, every data-parallel micro-batch accumulated."""
    same = [x for x in extra if not x.startswith(("parallel.", "train.grad_accum"))]
    history = train(_recipe(name, same + [f"train.grad_accum={grad_accum}"]), log=lambda s: None)
    return _summary(history)


def _check(got, want, what):
    assert len(got) == len(want), what
    for step, ((g, g_load), (w, w_load)) in enumerate(zip(got, want)):
        for label, a, b, tol in zip(("loss", "lm_loss", "grad_norm"), g, w, (1e-5, 1e-5, 1e-4)):
            assert math.isclose(a, b, rel_tol=tol), f"{what} step {step} {label}: {a} vs {b}"
        # Routing is the same, so the counts are: the ratios agree up to float formatting.
        assert g_load.keys() == w_load.keys() and len(w_load) >= 2, f"{what} step {step}: {g_load} vs {w_load}"
        for layer, stats in w_load.items():
            for key, b in stats.items():
                a = g_load[layer][key]
                assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), f"{what} step {step} {layer} {key}: {a} vs {b}"


# (recipe, overrides, data-parallel size): grad_accum is per data-parallel rank.
WORLD2 = [
    ("deepseek-v3-tiny", ["parallel.ep=2", "train.grad_accum=2"], 2),
    ("deepseek-v3-tiny", ["parallel.pp=2", "train.grad_accum=2"], 1),
    ("qwen3-moe-tiny", ["parallel.tp=2", "parallel.sp=true", "train.grad_accum=2"], 1),
    ("deepseek-v3-tiny", ["parallel.cp=2", "train.grad_accum=2", "model.aux_loss_type=none"], 1),
    ("deepseek-v3-tiny", ["parallel.pp=2", "parallel.schedule=dualpipev", "train.grad_accum=4",
                          "parallel.layout=Et|t|tm|L"], 1),
]
WORLD4 = [
    ("deepseek-v3-tiny", ["parallel.ep=2", "parallel.pp=2", "train.grad_accum=2"], 2),  # plain 1F1B
    # ep2 x pp2 with DualPipeV's overlapped forward/backward pairs interleaved at MoE-stage granularity
    ("deepseek-v3-tiny", ["parallel.ep=2", "parallel.pp=2", "parallel.schedule=dualpipev", "train.grad_accum=4",
                          "parallel.fb_overlap=moe", "parallel.layout=Et|t|tm|L"], 2),
]


@pytest.mark.parametrize("world,layouts", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_layouts_train_like_one_process(world, layouts):
    results = run_distributed(_run_layouts, world, [(n, e) for n, e, _ in layouts], init=False, timeout=300)
    for i, (name, extra, dp) in enumerate(layouts):
        accum = int(next(x for x in extra if x.startswith("train.grad_accum")).split("=")[1])
        want = _reference(name, extra, accum * dp)
        for rank in range(world):
            _check(results[rank][i], want, f"{name} {extra} rank {rank}")


def test_one_process_refuses_a_parallel_layout():
    with pytest.raises(ValueError, match="torchrun"):
        train(_recipe("qwen3-moe-tiny", ["parallel.ep=2"]), log=lambda s: None)
