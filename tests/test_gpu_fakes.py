"""moetron's Transformer Engine, flash-attn and grouped_gemm paths against the CPU fakes of those
libraries (tests/fakes: signatures, return types and host checks copied from each library's source),
each compared with moetron's torch path; the FP8 backend choice by capability; the errors moetron
raises before a library's own assert (fp32 into bf16-only kernels, TE's FP8 shape rule).

Tolerances: bf16 paths compare with the same math in fp32 rounded once to bf16 (grouped_gemm: equal
to the bf16 loop within 1 bf16 ulp, 2^-7 relative); attention within 1e-2 of max|out| (bf16) or 1e-6
(fp32, TE). TE FP8 vs moetron's emulated FP8: current scaling, block scaling (power-of-two scales,
as TE uses) and MXFP8 quantize with the same scales, so outputs agree up to a rare FP8 rounding flip
from TE's `x * (fmax/amax)` vs moetron's `x / (amax/fmax)`: within 1e-3 of max|y| (measured: bitwise);
delayed scaling differs by design (TE uses the scale of the previous step, 1.0 at first), so its
check is against the fp32 GEMM within the E4M3 error bound after one warm-up step.
"""

import dataclasses

import pytest
import torch
from torch import nn

import fakes
from moetron import backends
from moetron.config import Recipe, TrainConfig
from moetron.moe.grouped_gemm import grouped_linear
from moetron.ops.attention_core import core_attention
from moetron.precision import (FP8Capabilities, FP8GroupedExperts, FP8Linear, apply_fp8, choose_fp8_backend,
                               get_fp8_recipe)
from moetron.recipes import get_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def libs():
    fakes.install(*fakes.NAMES)
    yield
    fakes.uninstall(*fakes.NAMES)


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# ---- grouped_gemm ------------------------------------------------------------------------------


def test_grouped_gemm_matches_loop_and_refuses_fp32(libs):
    assert "CPU fake" in next(s.reason for s in backends.backend_status() if s.name == "grouped_gemm")
    gen = torch.Generator().manual_seed(0)
    rows = torch.tensor([5, 0, 11, 4])
    x = torch.randn(40, 20, generator=gen)[::2].to(torch.bfloat16)  # a strided (non-contiguous) view
    w = (torch.randn(4, 24, 20, generator=gen) * 0.2).to(torch.bfloat16)
    outs = {}
    for backend in ("grouped_gemm", "loop"):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_linear(xs[:, :], ws, rows, backend)
        y.sum().backward()  # an expanded (zero-stride) gradient
        outs[backend] = (y, xs.grad, ws.grad)
    for got, want, what in zip(outs["grouped_gemm"], outs["loop"], ("forward", "input grad", "weight grad")):
        assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 2 ** -7, what
    with pytest.raises(ValueError, match="grouped_gemm runs bf16 only"):
        grouped_linear(x.float(), w.float(), rows, "grouped_gemm")
    cfg = get_recipe("qwen3-moe-tiny")
    with pytest.raises(ValueError, match="expert_backend=grouped_gemm runs bf16 only"):
        dataclasses.replace(cfg, model=cfg.model.replace(expert_backend="grouped_gemm"))
    # the fake keeps the library's own checks: what moetron's checks stand in front of
    from grouped_gemm import ops
    with pytest.raises(RuntimeError, match="kBFloat16"):
        ops.gmm(x.float(), w.float(), rows, trans_b=True)
    with pytest.raises(RuntimeError, match="is_contiguous"):
        ops.gmm(x, w.transpose(1, 2), rows, trans_b=False)


# ---- attention -----------------------------------------------------------------------------------


ATTN_CASES = [  # (heads, kv heads, Sq, Sk, dqk, dv)
    (4, 4, 12, 12, 16, 16), (4, 2, 5, 12, 16, 16), (4, 4, 7, 7, 24, 12), (2, 1, 1, 9, 40, 40)]


def attn_inputs(case, dtype, gen):
    h, hkv, sq, sk, dqk, dv = case
    q = torch.randn(2, h, sq, dqk, generator=gen).to(dtype)
    k = torch.randn(2, hkv, sk, dqk, generator=gen).to(dtype)
    v = torch.randn(2, hkv, sk, dv, generator=gen).to(dtype)
    return q, k, v, dqk ** -0.5


@pytest.mark.parametrize("backend", ["flash_attn", "te"])
def test_attention_backends_match_eager(libs, backend):
    gen = torch.Generator().manual_seed(1)
    for case in ATTN_CASES:
        for dtype in ((torch.bfloat16,) if backend == "flash_attn" else (torch.bfloat16, torch.float32)):
            q, k, v, scale = attn_inputs(case, dtype, gen)
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = [t.float().clone().requires_grad_() for t in (q, k, v)]
            out = core_attention(*ins, scale, backend=backend)
            want = core_attention(*ref, scale, backend="eager")  # fp32, bottom-right causal
            cot = torch.randn(out.shape, generator=gen)
            (out.float() * cot).sum().backward()
            (want * cot).sum().backward()
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            assert out.dtype == dtype and out.shape == want.shape
            assert rel_err(out, want) <= tol, (backend, case, dtype)
            for a, b, what in zip(ins, ref, "qkv"):
                assert rel_err(a.grad, b.grad) <= 2 * tol, (backend, case, dtype, what)


def test_flash_attn_limits_are_moetron_errors(libs):
    gen = torch.Generator().manual_seed(2)
    q, k, v, scale = attn_inputs((2, 2, 4, 4, 16, 16), torch.float32, gen)
    with pytest.raises(ValueError, match="fp16/bf16 only.*train.dtype=bf16"):
        core_attention(q, k, v, scale, backend="flash_attn")
    q, k, v, scale = attn_inputs((2, 2, 4, 4, 264, 264), torch.bfloat16, gen)
    with pytest.raises(ValueError, match="head dims up to 256"):
        core_attention(q, k, v, scale, backend="flash_attn")
    cfg = get_recipe("qwen3-moe-tiny")
    with pytest.raises(ValueError, match="flash_attn runs fp16/bf16 only"):
        dataclasses.replace(cfg, model=cfg.model.replace(attention_backend="flash_attn"))
    bf16 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype="bf16"),
                               model=cfg.model.replace(attention_backend="flash_attn"))
    assert bf16.model.attention_backend == "flash_attn"  # the fix the message names works


# ---- Transformer Engine FP8 --------------------------------------------------------------------

RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")


def te_and_emulated(recipe, make, run):
    """Run `run(module)` on two copies made by `make()`: TE (fake) and moetron's emulation."""
    outs = []
    for backend in ("te", "emulate"):
        extra = {"power_of_two_scales": True} if recipe == "blockwise" else {}  # TE's block scaling default
        r = get_fp8_recipe(recipe, backend=backend, amax_history_len=4, **extra)
        torch.manual_seed(0)
        outs.append(run(make(r)))
    return outs


def test_te_linear_matches_emulation(libs):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, 64, generator=gen) * torch.exp(torch.randn(64, generator=gen))
    dy = torch.randn(3, 40, 48, generator=gen)

    def make(r):
        torch.manual_seed(0)
        return FP8Linear.from_linear(nn.Linear(64, 48), r)

    def run(lin):
        outs = []
        for step in range(2):
            xs = x.clone().requires_grad_()
            y = lin(xs)
            y.backward(dy)
            outs.append((y.detach(), xs.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
            lin.zero_grad()
        return lin, outs

    for recipe in RECIPES:
        (te_lin, te_outs), (em_lin, em_outs) = te_and_emulated(recipe, make, run)
        assert te_lin.fp8_backend == "te" and te_lin._te_module is not None, recipe
        assert em_lin.fp8_backend == "emulate"
        w = em_lin.weight.detach()
        for step, (got, want) in enumerate(zip(te_outs, em_outs)):
            exact = (x @ w.t() + em_lin.bias.detach(), dy.reshape(-1, 48) @ w)
            for g, e, what in zip(got, want, ("y", "dx", "dw", "db")):
                if recipe == "delayed":  # TE: previous step's scale; compare with the fp32 GEMM after warm-up
                    if step == 1 and what in ("y", "dx"):
                        ref = exact[0] if what == "y" else exact[1].view_as(g)
                        assert rel_err(g, ref) <= 0.1, (recipe, what)
                    continue
                assert rel_err(g, e) <= 1e-3, (recipe, step, what, rel_err(g, e))  # measured: 0 (bitwise)


def test_te_grouped_experts_match_emulation(libs):
    gen = torch.Generator().manual_seed(4)
    rows = torch.tensor([32, 0, 64, 32])  # padded to 32 per expert (the dispatcher does it for FP8)
    x = torch.randn(128, 32, generator=gen)
    dy = torch.randn(128, 32, generator=gen)
    from moetron.moe.experts import GroupedExperts

    def make(r):
        torch.manual_seed(0)
        return FP8GroupedExperts.from_experts(GroupedExperts(4, 32, 16), r)

    def run(experts):
        xs = x.clone().requires_grad_()
        y = experts(xs, rows)
        y.backward(dy)
        return experts, (y.detach(), xs.grad, experts.gate_up_proj.grad, experts.down_proj.grad)

    for recipe in ("tensorwise", "blockwise", "mxfp8"):
        (te_e, got), (_, want) = te_and_emulated(recipe, make, run)
        assert te_e.fp8_backend == "te" and te_e._te_module is not None
        for g, e, what in zip(got, want, ("y", "dx", "d gate_up", "d down")):
            assert rel_err(g, e) <= 1e-3, (recipe, what, rel_err(g, e))
    r = get_fp8_recipe("mxfp8", backend="te")
    with pytest.raises(ValueError, match="multiple of 32"):  # the fake keeps TE's per-GEMM alignment
        make(r)(x[:48], torch.tensor([16, 0, 32, 0]))


def test_te_fp8_shape_rule_pads_rows_and_refuses_features(libs):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 32, generator=gen)  # 15 rows: TE wants a multiple of 8; moetron pads
    outs = te_and_emulated("tensorwise", lambda r: FP8Linear.from_linear(nn.Linear(32, 16), r),
                           lambda lin: lin(x))
    assert outs[0].shape == (3, 5, 16) and rel_err(outs[0], outs[1]) <= 1e-3
    import transformer_engine.pytorch as te
    with pytest.raises(ValueError, match="divisible by 8"), te.autocast(recipe=te_recipe_of("tensorwise")):
        te.Linear(32, 16)(x)  # what the padding avoids
    with pytest.raises(ValueError, match=r"module 'proj'.*in_features % 16.*exclude"):
        apply_fp8(nn.ModuleDict({"proj": nn.Linear(20, 16)}), get_fp8_recipe("tensorwise", backend="te"))
    model = apply_fp8(nn.ModuleDict({"proj": nn.Linear(20, 16)}), "tensorwise")  # auto: TE cannot, GEMMs can
    assert model["proj"].fp8_backend == "auto"


def te_recipe_of(name):
    from moetron.precision.te_modules import te_recipe
    return te_recipe(get_fp8_recipe(name))


# ---- the FP8 backend choice ---------------------------------------------------------------------


def caps(sm, cuda=(12, 9), te="transformer_engine", scaled_mm=True):
    return FP8Capabilities(te, "python package 'transformer_engine' is not installed", sm, cuda, scaled_mm)


def test_fp8_backend_auto_chooses_by_capability(libs):
    choose = lambda name, c, backend="auto": choose_fp8_backend(get_fp8_recipe(name, backend=backend), c)  # noqa
    assert choose("delayed", caps((9, 0)))[0] == "te"
    assert choose("blockwise", caps((9, 0)))[0] == "te"
    backend, why = choose("blockwise", caps((9, 0), cuda=(12, 8)))
    assert backend == "emulate" and "CUDA >= 12.9" in why
    backend, why = choose("tensorwise", caps((8, 0)))
    assert backend == "emulate" and "8.9" in why
    backend, why = choose("tensorwise", caps((8, 9), cuda=(12, 4)))
    assert backend == "te"
    backend, why = choose("mxfp8", caps((9, 0)))
    assert backend == "emulate" and "MXFP8" in why
    assert choose("mxfp8", caps((10, 0)))[0] == "te" and choose("mxfp8", caps((12, 0)))[0] == "emulate"
    backend, why = choose("tensorwise", caps(None, None, te=None))  # CPU, no TE
    assert backend == "auto" and "torch._scaled_mm" in why and "not installed" in why
    with pytest.raises(RuntimeError, match="fp8_backend=te.*sm >= 9.0 and CUDA >= 12.9.*fp8_backend=auto"):
        choose("blockwise", caps((8, 9)), backend="te")
    # the probe reads TE's CPU fake and the device it declares
    import transformer_engine
    from moetron.precision import probe_capabilities
    probed = probe_capabilities()
    assert "CPU fake" in probed.te and probed.sm == transformer_engine.MOETRON_FAKE_DEVICE["capability"]
    old = dict(transformer_engine.MOETRON_FAKE_DEVICE)
    try:
        transformer_engine.MOETRON_FAKE_DEVICE.update(capability=(9, 0), cuda=(12, 8))
        lin = FP8Linear.from_linear(nn.Linear(32, 16), "blockwise")
        assert lin.fp8_backend == "emulate"  # auto saw TE could not run block scaling here
        with pytest.raises(RuntimeError, match="CUDA >= 12.9"):
            FP8Linear.from_linear(nn.Linear(32, 16), get_fp8_recipe("blockwise", backend="te"))
    finally:
        transformer_engine.MOETRON_FAKE_DEVICE.update(old)


def test_te_model_trains_like_emulation_and_config_switches(libs):
    cfg = dataclasses.replace(get_recipe("qwen3-moe-tiny").model, num_layers=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(6))
    from moetron.model.model import MoETransformer
    losses = {}
    for backend in ("te", "emulate"):
        torch.manual_seed(0)
        model = apply_fp8(MoETransformer(cfg), get_fp8_recipe("mxfp8", backend=backend))
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.total_loss.backward()
        losses[backend] = (out.loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        if backend == "te":
            assert any(getattr(m, "_te_module", None) is not None for m in model.modules())
    assert losses["te"][0] == pytest.approx(losses["emulate"][0], rel=1e-5)
    for g, e in zip(losses["te"][1], losses["emulate"][1]):
        assert rel_err(g, e) <= 1e-3
    # Megatron's first/last-layers-in-bf16 switch (and its errors)
    from moetron.train.setup import fp8_exclusions
    t = TrainConfig(fp8="mxfp8", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                    num_layers_at_end_in_bf16=2)
    assert fp8_exclusions(t, 6) == ["layers.0.*", "layers.4.*", "layers.5.*"]
    with pytest.raises(ValueError, match="needs train.fp8"):
        TrainConfig(first_last_layers_bf16=True)
    r = get_recipe("qwen3-moe-tiny")
    with pytest.raises(ValueError, match="exceeds model.num_layers"):
        Recipe(r.name, "", r.model, dataclasses.replace(t, num_layers_at_end_in_bf16=r.model.num_layers))


# ---- TE FP8 under pipeline parallel (2 gloo ranks) ------------------------------------------------

PP_BASE = ["model.num_layers=2", "train.seq_len=32", "train.micro_batch_size=2", "train.steps=2",
           "train.warmup_steps=1", "train.log_every=100", "train.grad_accum=2", "train.fp8=delayed",
           "train.fp8_backend=te"]


def _te_pipeline(rank, world):
    from moetron.recipes import apply_overrides
    from moetron.train.trainer import train

    fakes.install("transformer_engine")
    import transformer_engine.pytorch as te
    te.FP8GlobalStateManager.reset()
    recipe = apply_overrides(get_recipe("qwen3-moe-tiny"), PP_BASE + ["parallel.pp=2"])
    history = train(recipe, log=lambda s: None)
    groups = [g for _, g in te.FP8GlobalStateManager.autocast_log]
    # every region reduces over this stage's data/context-parallel group (size 1 here), never WORLD (None)
    assert groups and all(g is not None for g in groups), "an autocast region reduced over WORLD"
    import torch.distributed as dist
    assert {dist.get_world_size(g) for g in groups} == {1}
    return [h["loss"] for h in history]


def test_te_delayed_fp8_under_pipeline_parallel_matches_one_process(libs):
    """Before: a TE autocast with no amax_reduction_group around every module call all-reduced over
    WORLD, which pipeline stages (running different modules) never match: a hang."""
    from dist_utils import run_distributed
    from moetron.recipes import apply_overrides
    from moetron.train.trainer import train

    want = [h["loss"] for h in train(apply_overrides(get_recipe("qwen3-moe-tiny"), PP_BASE), log=lambda s: None)]
    got = run_distributed(_te_pipeline, 2, timeout=120)
    for losses in got:
        assert losses == pytest.approx(want, rel=1e-5), (losses, want)
