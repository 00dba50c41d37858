"""Issues #3 and #4: every parallel layout trains, step by step and weight by weight, like one process.

Each layout runs the trainer for 3 optimizer steps of tiny Qwen3-MoE and DeepSeek-V3 models
(both families, every layout) and must match the same recipe trained in one process: loss, LM
loss, gradient norm and balancing loss at every step within 1e-5 relative, and after the last step every
parameter and persistent buffer within max|a - b| / max|b| < 1e-5. The final weights are read
back from the checkpoint each run writes (`train.save_dir`; the format is layout-independent)
into a one-process model, so the whole model is compared, name by name, on both sides; the
comparison is shown to fail on a small perturbation, and the weights are checked to have moved
far beyond the tolerance.

Why `train.grad_clip=1e-4`. With the recipes' clip (1.0) AdamW's step is close to lr * sign(g)
for most elements, and an element whose gradient is about Adam's eps (1e-8) turns fp32 rounding
of that gradient into a step difference thousands of times larger: two ONE-process runs that
only sum the same gradients in another order (accumulation vs one batch) end 9e-5 apart, layouts
up to 3e-3, although their step-0 gradients agree to 1e-6. Clipping to a tiny global norm brings
the gradients to or below eps, where AdamW's step is proportional to the gradient and rounding
is not amplified (layouts then agree to a few 1e-6); the clip coefficient, computed from the
global norm over all shards, is exercised at every step.

Data-parallel rank r takes global micro-batches r, r + D, ... (`moetron.data.builtin`), so the
one-process reference accumulates D x grad_accum micro-batches. Every layout trains with its
recipe's balancing loss (Qwen3: the Switch `aux_loss`; DeepSeek-V3: `seq_aux_loss`, its coefficient
raised to 1e-2 so that a wrong balancing gradient shows in the weights), whose reported value is
compared per step too; under context parallelism the routers sum expert counts over CP, so these
losses are the whole sequences' ones. One process group per world size runs all its layouts.
"""

import math

import pytest
import torch

from dist_utils import run_distributed
from moetron.model.model import MoETransformer
from moetron.optim import ReplicatedAdamW
from moetron.parallel.config import ParallelConfig
from moetron.parallel.data_parallel import DataParallel
from moetron.recipes import apply_overrides, get_recipe
from moetron.train import evaluation, trainer
from moetron.checkpoint.training import latest_checkpoint, load_checkpoint
from moetron.data.builtin import TokenBatches
from moetron.train.trainer import train

STEPS = 3
TOL = 1e-5  # relative: losses and gradient norms per step, max|a - b| / max|b| per weight tensor
# grad_clip=1e-4: see the module docstring.
BASE = ["model.num_layers=2", "train.seq_len=16", "train.micro_batch_size=2", f"train.steps={STEPS}",
        "train.warmup_steps=1", "train.grad_clip=1e-4", "train.log_every=100", "model.aux_loss_coeff=1e-2"]
FAMILIES = ("qwen3-moe-tiny", "deepseek-v3-tiny")
AUX_LOSSES = {"qwen3-moe-tiny": "aux_loss", "deepseek-v3-tiny": "seq_aux_loss"}  # the recipes' own
METRICS = ("loss", "lm_loss", "grad_norm", *sorted(set(AUX_LOSSES.values())))  # compared per step

# (id, overrides[, first]): run for both families; grad_accum is per data-parallel rank (default
# 1). With `first`, steps 1-2 run with `first` added and save a checkpoint, and step 3 resumes
# from it without: a checkpoint of either optimizer resumes with the other.
WORLD2 = [
    ("tp2", ["parallel.tp=2"]),
    ("tp2_sp", ["parallel.tp=2", "parallel.sp=true"]),
    ("cp2", ["parallel.cp=2"]),
    ("dp2", ["parallel.distributed_optimizer=false", "train.grad_accum=2"]),
    ("dp2_distopt", ["train.grad_accum=2"]),
    ("ep2", ["parallel.ep=2"]),  # attention dp2, experts ep2
    ("cp2_ep2", ["parallel.cp=2", "parallel.ep=2"]),  # the EP group is the CP group
    ("dp2_resume", ["parallel.distributed_optimizer=false", "train.grad_accum=2"],
     ["parallel.distributed_optimizer=true"]),
]
WORLD4 = [
    ("tp2_dp2", ["parallel.tp=2"]),
    ("cp2_tp2", ["parallel.cp=2", "parallel.tp=2"]),
    ("ep4", ["parallel.ep=4"]),
    ("ep2_tp2_etp1", ["parallel.ep=2", "parallel.tp=2", "parallel.etp=1"]),
    ("ep2_tp2_etp2", ["parallel.ep=2", "parallel.tp=2", "parallel.etp=2"]),
    ("ep2_dp2", ["parallel.ep=2"]),  # attention dp4, experts ep2 x edp2
    ("ep2_tp2_etp1_resume", ["parallel.ep=2", "parallel.tp=2", "parallel.etp=1"],
     ["parallel.distributed_optimizer=false"]),
]


def _recipe(name, extra):
    return apply_overrides(get_recipe(name), BASE + list(extra))


def _cases(world, layouts, root):
    """(id, family, runs): the overrides of each train() call, the last one naming the final state."""
    out = []
    for name in FAMILIES:
        for lid, extra, *first in layouts:
            extra = extra + [f"train.save_dir={root}/w{world}-{name}-{lid}"]
            if first:  # two runs: the first stops (and saves) a step early, the second resumes
                runs = [extra + first[0] + [f"train.steps={STEPS - 1}"], extra + ["train.resume=true"]]
            else:
                runs = [extra]
            out.append((f"{name}-{lid}", name, runs))
    return out


def _metrics(history):
    """Per step, the METRICS the run reported (a balancing loss only where the model has it)."""
    return [{k: h[k] for k in METRICS if k in h} for h in history]


def _train_cases(rank, world, cases):
    """Every case's per-step metrics, and the optimizer class each train() call built."""
    built, build_run = [], trainer.build_run

    def recording(recipe, log=print):
        run = build_run(recipe, log)
        built.append(type(run.optimizer).__name__)
        return run

    trainer.build_run = recording  # in this worker process only
    metrics = [sum((_metrics(train(_recipe(name, extra), log=lambda s: None)) for extra in runs), [])
               for _, name, runs in cases]
    return metrics, built


def _final_state(recipe):
    """The run's weights after its last step, loaded from its checkpoint into a one-process model."""
    model = MoETransformer(recipe.model)
    folder = latest_checkpoint(recipe.train.save_dir)
    assert folder is not None and folder.name == f"step-{STEPS:08d}", recipe.train.save_dir
    load_checkpoint(folder, model, load_rng=False)  # raises on a missing or unexpected name
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _initial_params(recipe):
    """The run's parameters before its first step."""
    torch.manual_seed(recipe.train.seed)  # as moetron.train.setup.build_run
    return {n: p.detach().clone() for n, p in MoETransformer(recipe.model).named_parameters()}


def _rel(a, b):
    """max|a - b| / max|b|: the error relative to the tensor's scale."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def compare_states(got, want, what):
    """Same names and shapes, and every tensor within TOL; returns the largest error."""
    assert sorted(got) == sorted(want), f"{what}: tensor names differ: {sorted(set(got) ^ set(want))}"
    worst = 0.0
    for name in want:
        assert got[name].shape == want[name].shape, f"{what} {name}: shape {got[name].shape} vs {want[name].shape}"
        err = _rel(got[name], want[name])
        assert err < TOL, f"{what} {name}: max|a-b| / max|b| = {err:.3g} >= {TOL}"
        worst = max(worst, err)
    return worst


def compare_metrics(got, want, what):
    """Largest relative error of the METRICS (loss, lm_loss, grad_norm, balancing loss) over the
    steps; asserts < TOL."""
    assert len(got) == len(want) == STEPS, what
    worst = 0.0
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"{what} step {step}: reported {sorted(g)}, one process {sorted(w)}"
        for label in w:
            a, b = g[label], w[label]
            err = abs(a - b) / abs(b)
            assert err < TOL, f"{what} step {step} {label}: {a} vs {b} (relative error {err:.3g})"
            worst = max(worst, err)
    return worst


def _check_moved(final, initial, what):
    """The comparison has power: every weight matrix moved by more than 100 x TOL from the initial
    weights (and by less than 0.5, so `initial` really is where training started)."""
    moves = {n: _rel(final[n], t) for n, t in initial.items() if t.dim() >= 2}
    wrong = {n: f"{m:.1e}" for n, m in moves.items() if not 100 * TOL < m < 0.5}
    assert moves and not wrong, f"{what}: weights moved too little (or are not from this start): {wrong}"


_REFERENCES = {}


def _reference(name, extra, tmp_root):
    """(metrics, final state) of the recipe in one process, cached by overrides."""
    key = (name, tuple(extra))
    if key not in _REFERENCES:
        folder = f"{tmp_root}/ref-{len(_REFERENCES)}"
        recipe = _recipe(name, list(extra) + [f"train.save_dir={folder}"])
        metrics = _metrics(train(recipe, log=lambda s: None))
        final = _final_state(recipe)
        _check_moved(final, _initial_params(recipe), f"{name} {extra} (one process)")
        _REFERENCES[key] = metrics, final
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("world,layouts", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_layout_matches_one_process(world, layouts, tmp_root):
    cases = _cases(world, layouts, tmp_root)
    results = run_distributed(_train_cases, world, cases, init=False, timeout=600)
    recipes = [[_recipe(name, extra) for extra in runs] for _, name, runs in cases]
    want_kinds = ["DistributedOptimizer" if r.parallel.distributed_optimizer else "ReplicatedAdamW"
                  for runs in recipes for r in runs]
    assert results[0][1] == want_kinds, "parallel.distributed_optimizer did not pick the optimizer"
    report = []
    for i, ((case_id, name, overrides), runs) in enumerate(zip(cases, recipes)):
        recipe = runs[-1]  # the run that wrote the final checkpoint
        dp = recipe.parallel.resolve(world).dp
        layout = ("parallel.", "train.grad_accum", "train.save_dir", "train.resume")
        same = [x for x in overrides[-1] if not x.startswith(layout)]
        want_metrics, want_state = _reference(name, same + [f"train.grad_accum={dp * recipe.train.grad_accum}"],
                                              tmp_root)
        assert AUX_LOSSES[name] in want_metrics[0], f"{case_id}: trains without its balancing loss"
        loss_err = max(compare_metrics(results[r][0][i], want_metrics, f"{case_id} rank {r}") for r in range(world))
        param_err = compare_states(_final_state(recipe), want_state, case_id)
        report.append(f"{case_id:34s} metrics {loss_err:.1e}  parameters {param_err:.1e}")
    print("\n" + "\n".join(report))


class _ConcatenatedBatches(TokenBatches):
    """Micro-batch i of k*SMALL rows is the k built-in micro-batches i*k .. i*k+k-1 of SMALL rows.

    The built-in data draws each micro-batch from its own seed, so a larger micro-batch holds
    other sequences; this makes one large batch exactly the concatenation of the micro-batches
    that gradient accumulation sees (and is the built-in data itself when k = 1).
    """

    SMALL = 2

    def batch(self, step, index=0):
        k = self.batch_size // self.SMALL
        small = TokenBatches(self.tokens, self.seq_len, self.SMALL, self.seed)
        parts = [small.batch(step, index * k + j) for j in range(k)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


@pytest.mark.parametrize("name", FAMILIES)
def test_gradient_accumulation_matches_one_large_batch(name, tmp_path, monkeypatch):
    """4 micro-batches of 2 sequences accumulated == one batch of those 8 sequences.

    The per-micro-batch Switch aux loss is not additive over micro-batches, so both runs use
    DeepSeek's sequence-wise aux loss, which is a mean over sequences (and so additive).
    """
    monkeypatch.setattr(evaluation, "TokenBatches", _ConcatenatedBatches)  # the trainer builds its data there
    common = ["model.aux_loss_type=seq_aux_loss", "model.aux_loss_coeff=1e-2"]
    small, large = (_recipe(name, common + [f"train.grad_accum={a}", f"train.micro_batch_size={m}",
                                            f"train.save_dir={tmp_path}/{a}x{m}"]) for a, m in ((4, 2), (1, 8)))
    want = _metrics(train(small, log=lambda s: None))
    got = _metrics(train(large, log=lambda s: None))
    loss_err = compare_metrics(got, want, f"{name} one batch of 8")
    want_state = _final_state(small)
    _check_moved(want_state, _initial_params(small), name)
    param_err = compare_states(_final_state(large), want_state, f"{name} one batch of 8")
    print(f"\n{name} accumulation 4x2 vs 1x8: loss/grad-norm {loss_err:.1e}  parameters {param_err:.1e}")


def test_state_comparison_can_fail():
    """A 2e-5 relative change of one element, or a missing tensor, is caught."""
    gen = torch.Generator().manual_seed(0)
    want = {"a": torch.randn(64, 64, generator=gen), "b": torch.randn(7, generator=gen)}
    got = {k: v.clone() for k, v in want.items()}
    assert compare_states(got, want, "copy") == 0.0
    got["a"][2, 3] += 2 * TOL * want["a"].abs().max()
    with pytest.raises(AssertionError, match="a: max"):
        compare_states(got, want, "perturbed")
    with pytest.raises(AssertionError, match="names differ"):
        compare_states({"a": want["a"]}, want, "missing")


def test_distributed_optimizer_switch_is_checked():
    with pytest.raises(ValueError, match="distributed_optimizer='no' must be true or false"):
        ParallelConfig(distributed_optimizer="no")
    with pytest.raises(ValueError, match="expected true or false"):
        _recipe(FAMILIES[0], ["parallel.distributed_optimizer=maybe"])
    with pytest.raises(ValueError, match="use_distributed_optimizer=False"):
        ReplicatedAdamW(DataParallel(torch.nn.Linear(4, 4), use_distributed_optimizer=True))
