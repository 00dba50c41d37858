"""Issue 15: FP8 under tensor parallelism, and the FP8 parameter all-gather (`train.fp8_param_gather`).

FP8 x TP: the trainer runs 3 steps of the tiny Qwen3-MoE and DeepSeek-V3 recipes with tp=2 for every emulated
FP8 recipe (each recipe of each family by default, alternating sequence parallel; sp on and off for all under
`slow`), and each run must match the same recipe trained in one process (tests/test_train_layouts.py's recipe:
grad_clip 1e-4, 3 steps). TP ranks reduce every per-tensor (per-expert) amax over the ranks that hold the
other parts of the tensor (docs/fp8.md, "Tensor parallel"), so every GEMM operand gets the one-process scale:
the first forward is bitwise equal for tensorwise, delayed and mxfp8 on an AVX2 CPU (mxfp8's 32-blocks tile
the shards here; on an AVX-512 one ~1e-7 off). What is left is the fp32 summation order of the TP reductions
(1e-7, as in the fp32 layouts), which an FP8 rounding can turn into one quantum of an element, and the next
steps carry on. Blockwise scales are per 128-block of the local shard (TE
does the same): a 32-wide shard is a block of its own, so its roundings differ from one process by design.
Tolerances (relative; per step: losses, then gradient norm and balancing loss; final >= 2-D weights as
max|a-b| / max|b|), and what was measured when written (worst over both families, sp on and off):

    recipe      first loss  losses   norms    weights   measured: losses / norms / weights
    tensorwise  1e-5        1e-4     5e-3     5e-2      2e-7 / 6e-7 / 4e-4; on an AVX-512 CPU (2026-11-28) Qwen3's
                                                        third step 7.5e-6 / 7.6e-4 / 1.8e-2: one quantum
    mxfp8       1e-5        1e-5     1e-5     3e-3      9e-8 / 3e-7 / 6e-7
    delayed     1e-5        1e-3     2e-2     5e-2      9e-8 / 2e-7 / 6e-5 (with a multi-threaded reference,
                                                        whose fp32 sums round otherwise: 8e-5 / 4e-3 / 2e-2)
    blockwise   2e-3        5e-3     5e-2     2.5e-1    1e-3 / 2e-2 / 1e-1
Weights are the final >= 2-D ones; the 1-D ones (norms, the routers' expert bias, which a routing flipped by
one FP8 quantum moves by its whole update rate) are covered by the losses.

Negative control: the same tp=2 tensorwise run with the amax reductions switched off (each rank's shard its
own scale, what TE's current scaling does) misses the first-loss tolerance (measured 1.5e-4). Transformer
Engine (its CPU fake) under tp=2 with sequence parallel, delayed scaling: its amaxes reduce over Megatron's
TP x DP x CP group, and it matches one-process TE within the tensorwise tolerances (measured 2e-7).

FP8 parameter all-gather: dp=2 ZeRO-1 runs with and without `train.fp8_param_gather` must report identical
losses and gradient norms for tensorwise and blockwise (the gathered FP8 weight is bit for bit what the
forward would quantize) and for delayed with one micro-batch per step; the final FP8 weights are the FP8
values of the run without it (exactly for tensorwise/blockwise), the other weights equal; the all-gather's
bytes, counted by wrapping it, shrink to the FP8 payload (measured: 0.35x on the 2-layer Qwen3 tiny, fp32).
Under tp2 x dp2 (slow) the same holds with the scales also reduced over TP. Layouts where it cannot act are
errors.
"""

import importlib

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from moetron.config import TrainConfig
from moetron.model.model import MoETransformer
from moetron.parallel import data_parallel as dp_module
from moetron.parallel.state import Group, ParallelState
from moetron.parallel.tensor_parallel import ColumnParallelLinear
from moetron.precision import apply_fp8, fp8_modules, get_fp8_recipe
from moetron.precision.fp8 import quantize_operand
from moetron.precision.fp8_param_gather import enable_fp8_param_gather
from moetron.train.trainer import train
from test_train_layouts import METRICS, _final_state, _metrics, _recipe, _reference

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

FAMILIES = ("qwen3-moe-tiny", "deepseek-v3-tiny")
TP_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
# recipe: first-step loss, losses, gradient norm and balancing loss, final >= 2-D weights (module docstring)
TOLS = {"tensorwise": (1e-5, 1e-4, 5e-3, 5e-2), "mxfp8": (1e-5, 1e-5, 1e-5, 3e-3),
        "delayed": (1e-5, 1e-3, 2e-2, 5e-2), "blockwise": (2e-3, 5e-3, 5e-2, 2.5e-1)}
ALL_TP_CASES = [(name, fp8, sp) for name in FAMILIES for fp8 in TP_RECIPES for sp in (False, True)]
TP_CASES = [(name, fp8, (i + j) % 2 == 1) for j, name in enumerate(FAMILIES) for i, fp8 in enumerate(TP_RECIPES)]
NO_REDUCTION = ("qwen3-moe-tiny", "tensorwise", False)  # the negative control


def _rel(a, b):
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else float((a != b).any())


def _check_metrics(got, want, tols, what):
    """Largest relative error of the losses and of the other metrics; asserts the recipe's tolerances."""
    first, losses, norms = tols[:3]
    assert len(got) == len(want) == 3, what
    worst = [0.0, 0.0]
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"{what} step {step}: {sorted(g)} vs {sorted(w)}"
        for k in w:
            err = abs(g[k] - w[k]) / abs(w[k])
            is_loss = k in ("loss", "lm_loss")
            tol = first if is_loss and step == 0 else losses if is_loss else norms
            assert err < tol, f"{what} step {step} {k}: {g[k]} vs {w[k]} (relative {err:.3g} >= {tol})"
            worst[0 if is_loss else 1] = max(worst[0 if is_loss else 1], err)
    return worst


def _check_weights(got, want, tol, what):
    assert sorted(got) == sorted(want), what
    worst = 0.0
    for k, w in want.items():
        if w.dim() < 2:  # norms, biases, the routers' expert bias: covered by the losses
            continue
        err = _rel(got[k].float(), w.float())
        assert err < tol, f"{what} {k}: max|a-b|/max|b| = {err:.3g} >= {tol}"
        worst = max(worst, err)
    return worst


def _tp_extra(fp8, sp, root, name, tag=""):
    return [f"train.fp8={fp8}", "parallel.tp=2", f"parallel.sp={str(sp).lower()}",
            f"train.save_dir={root}/tp-{name}-{fp8}-{sp}{tag}"]


def _tp_worker(rank, world, root, cases):
    modules = importlib.import_module("moetron.precision.fp8_modules")  # the package exports a function so named
    out = [_metrics(train(_recipe(name, _tp_extra(fp8, sp, root, name)), log=lambda s: None))
           for name, fp8, sp in cases]
    modules.set_fp8_reductions = lambda *args, **kwargs: None  # negative control: per-shard scales
    name, fp8, sp = NO_REDUCTION
    out.append(_metrics(train(_recipe(name, _tp_extra(fp8, sp, root, name, "-control")), log=lambda s: None)))
    return out


def _check_tp(cases, tmp_path):
    results = run_distributed(_tp_worker, 2, str(tmp_path), cases, init=False, timeout=900)
    report = []
    for i, (name, fp8, sp) in enumerate(cases):
        want_metrics, want_state = _reference(name, [f"train.fp8={fp8}"], str(tmp_path))
        what = f"{name} {fp8} tp2 sp={sp}"
        errs = [_check_metrics(results[r][i], want_metrics, TOLS[fp8], f"{what} rank {r}") for r in range(2)]
        w = _check_weights(_final_state(_recipe(name, _tp_extra(fp8, sp, tmp_path, name))), want_state,
                           TOLS[fp8][3], what)
        report.append(f"{what:40s} losses {max(e[0] for e in errs):.1e}  norms {max(e[1] for e in errs):.1e}  "
                      f"weights {w:.1e}")
    name, fp8, _ = NO_REDUCTION
    want = _reference(name, [f"train.fp8={fp8}"], str(tmp_path))[0][0]["loss"]
    control = abs(results[0][-1][0]["loss"] - want) / want
    assert control > TOLS[fp8][0], f"per-shard scales pass the tolerance ({control:.2g}): it has no power"
    report.append(f"negative control (per-shard scales): first loss off by {control:.1e}")
    print("\n" + "\n".join(report))


def test_fp8_under_tensor_parallel_trains_like_one_process(tmp_path):
    _check_tp(TP_CASES, tmp_path)


@pytest.mark.slow
def test_fp8_under_tensor_parallel_every_recipe_sp_on_and_off(tmp_path):
    _check_tp(ALL_TP_CASES, tmp_path)


# ---- FP8 parameter all-gather --------------------------------------------------------------------

PG_RECIPES = ("tensorwise", "delayed", "blockwise")
PG_NAME = "qwen3-moe-tiny"


def _pg_extra(fp8, gather, root):
    return [f"train.fp8={fp8}", f"train.fp8_param_gather={str(gather).lower()}",
            f"train.save_dir={root}/pg-{fp8}-{gather}"]


def _pg_worker(rank, world, root, extra=(), recipes=PG_RECIPES):
    sent, original = [0], dp_module._all_gather

    def counting(out, t, handle):
        sent[0] += t.numel() * t.element_size()
        return original(out, t, handle)

    dp_module._all_gather = counting  # this worker only
    out = {}
    for fp8 in recipes:
        for gather in (False, True):
            sent[0] = 0
            metrics = _metrics(train(_recipe(PG_NAME, _pg_extra(fp8, gather, root) + list(extra)), log=lambda s: None))
            out[fp8, gather] = metrics, sent[0]
    if not extra:  # small buckets, gathers waited module by module and launched bucket by bucket in the step
        overlap = ["parallel.bucket_size=3000", "parallel.overlap_param_gather=true",
                   "parallel.overlap_param_gather_with_optimizer_step=true", f"train.save_dir={root}/pg-overlap"]
        for gather in (False, True):
            out["overlap", gather] = _metrics(train(_recipe(PG_NAME, _pg_extra("tensorwise", gather, root)[:2] + overlap[:-1]
                                                            + [f"{overlap[-1]}-{gather}"]), log=lambda s: None))
    return out


def _fp8_weight_names(recipe):
    model = apply_fp8(MoETransformer(recipe.model), get_fp8_recipe(recipe.train.fp8))
    names = []
    for prefix, m in fp8_modules(model).items():
        names += [f"{prefix}.{n}" for n in (("gate_up_proj", "down_proj") if hasattr(m, "gate_up_proj") else ("weight",))]
    return names


def test_fp8_param_gather_matches_and_sends_fp8(tmp_path):
    results = run_distributed(_pg_worker, 2, str(tmp_path), init=False, timeout=600)
    report = []
    for fp8 in PG_RECIPES:
        recipe = _recipe(PG_NAME, _pg_extra(fp8, True, tmp_path))
        for r in range(2):
            (plain, plain_bytes), (fp8_run, fp8_bytes) = results[r][fp8, False], results[r][fp8, True]
            assert plain == fp8_run, f"{fp8} rank {r}: metrics differ with fp8_param_gather\n{plain}\n{fp8_run}"
            assert fp8_bytes < 0.4 * plain_bytes, f"{fp8} rank {r}: {fp8_bytes} bytes vs {plain_bytes}"
        assert set(METRICS) & set(plain[0])
        want = _final_state(_recipe(PG_NAME, _pg_extra(fp8, False, tmp_path)))
        got = _final_state(recipe)
        fp8_names = set(_fp8_weight_names(recipe))
        assert len(fp8_names) > 10
        for name, w in want.items():
            if name not in fp8_names:
                assert torch.equal(got[name], w), f"{fp8} {name}: a high-precision weight differs"
            elif fp8 == "delayed":  # its scale came from the amax history: within the E4M3 rounding
                assert ((got[name] - w).abs() <= w.abs() / 16 + 1e-3 * w.abs().max()).all(), f"{fp8} {name}"
            else:  # exactly the FP8 value the forward of the other run would use
                q = quantize_operand(w, "weight", get_fp8_recipe(fp8), None).dequantize()
                assert torch.equal(got[name], q), f"{fp8} {name}: not the FP8 weight"
        if fp8 == "tensorwise":
            for r in range(2):
                assert results[r]["overlap", True] == results[r]["overlap", False], f"rank {r}: overlapped gathers"
        report.append(f"{fp8:10s} all-gather bytes per rank over 3 steps: {plain_bytes} -> {fp8_bytes} "
                      f"({fp8_bytes / plain_bytes:.2f}x)")
    print("\n" + "\n".join(report))


@pytest.mark.slow
def test_fp8_param_gather_under_tensor_parallel(tmp_path):
    """tp2 x dp2: the gather's amaxes also reduce over TP (the forward's one-process scale)."""
    results = run_distributed(_pg_worker, 4, str(tmp_path), ["parallel.tp=2"], ("tensorwise", "blockwise"),
                              init=False, timeout=600)
    for r in range(4):
        for fp8 in ("tensorwise", "blockwise"):
            (plain, plain_bytes), (got, fp8_bytes) = results[r][fp8, False], results[r][fp8, True]
            assert plain == got, f"tp2 dp2 {fp8} rank {r}: metrics differ with fp8_param_gather"
            assert fp8_bytes < 0.5 * plain_bytes, f"tp2 dp2 {fp8} rank {r}: {fp8_bytes} vs {plain_bytes} bytes"


def test_fp8_param_gather_refuses_where_it_cannot_act():
    with pytest.raises(ValueError, match="needs train.fp8=tensorwise, delayed or blockwise"):
        TrainConfig(fp8_param_gather=True)
    with pytest.raises(ValueError, match="mxfp8 weights need a second"):
        TrainConfig(fp8="mxfp8", fp8_param_gather=True)
    from moetron.train.setup import build_run
    with pytest.raises(ValueError, match="runs in one process.*train.fp8_param_gather=false"):
        build_run(_recipe(PG_NAME, ["train.fp8=tensorwise", "train.fp8_param_gather=true"]))
    model = apply_fp8(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), "tensorwise")
    with pytest.raises(ValueError, match="needs parallel.distributed_optimizer=true"):
        enable_fp8_param_gather(dp_module.DataParallel(model, ParallelState.single()))
    with pytest.raises(ValueError, match="data-parallel size 1"):
        enable_fp8_param_gather(dp_module.DataParallel(model, ParallelState.single(), use_distributed_optimizer=True))
    plain = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no FP8 weights"):
        enable_fp8_param_gather(dp_module.DataParallel(plain, ParallelState.single(), use_distributed_optimizer=True))


def test_fp8_with_chunked_tp_overlap_is_an_error():
    """The chunked AG->GEMM / GEMM->RS overlap runs high-precision GEMMs: FP8 there would be a no-op."""
    tp = Group("tp", (0, 1), 0, None)  # two ranks on paper: from_linear only slices
    layer = ColumnParallelLinear.from_linear(nn.Linear(16, 32), tp, sequence_parallel=True, overlap_chunks=2)
    with pytest.raises(ValueError, match="parallel.tp_comm_overlap=false"):
        apply_fp8(nn.ModuleDict({"proj": layer}), "tensorwise")


# ---- Transformer Engine (its CPU fake) under TP -------------------------------------------------

TE_EXTRA = ["train.fp8=delayed", "train.fp8_backend=te"]


def _te_worker(rank, world, root):
    import fakes

    fakes.install("transformer_engine")
    import torch.distributed as dist
    import transformer_engine.pytorch as te

    te.FP8GlobalStateManager.reset()
    out = _metrics(train(_recipe(PG_NAME, TE_EXTRA + ["parallel.tp=2", "parallel.sp=true",
                                                      f"train.save_dir={root}/te-tp"]), log=lambda s: None))
    groups = {dist.get_world_size(g) for _, g in te.FP8GlobalStateManager.autocast_log}
    return out, groups


def test_te_delayed_fp8_under_tensor_parallel_matches_one_process(tmp_path):
    """TE runs this rank's local GEMMs; its delayed amaxes reduce over Megatron's amax reduction group
    (TP x DP x CP: here both ranks), so the scales, and the training, are those of one process."""
    import fakes

    with fakes.installed("transformer_engine"):
        import transformer_engine.pytorch as te

        te.FP8GlobalStateManager.reset()
        want = _metrics(train(_recipe(PG_NAME, TE_EXTRA + [f"train.save_dir={tmp_path}/te-one"]), log=lambda s: None))
        te.FP8GlobalStateManager.reset()
    results = run_distributed(_te_worker, 2, str(tmp_path), init=False, timeout=300)
    for r, (got, groups) in enumerate(results):
        assert groups == {2}, f"rank {r}: TE reduced amaxes over groups of sizes {groups}, not TP x DP x CP"
        errs = _check_metrics(got, want, TOLS["tensorwise"], f"TE delayed tp2 sp rank {r}")
    print(f"\nTE delayed tp2 sp: losses {errs[0]:.1e}  norms {errs[1]:.1e}")
