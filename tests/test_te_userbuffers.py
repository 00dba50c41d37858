"""Issue 15: `parallel.tp_comm_overlap` on Transformer Engine's userbuffers, against TE's CPU fake
(tests/fakes/transformer_engine/pytorch/module/base.py: TE's `initialize_ub` / `get_ub` / `destroy_ub`
and te.Linear's `ub_*` switches with their host checks, the exchanges as torch rings over gloo).

- The fake itself against torch (2 ranks, fp32, no autocast): column-parallel te.Linear with
  `ub_overlap_ag` + bulk dgrad/wgrad and row-parallel with `ub_overlap_rs` + AG dgrad give the
  one-process `F.linear` output and gradients (within 1e-6 relative: fp32 sums in another order),
  and the exchanges went through the named communicators (ub_log).
- The fake refuses what TE refuses: a test per copied check.
- moetron: tp=2 + sequence parallel + tp_comm_overlap with train.fp8=delayed on TE runs its TP linears
  as TE modules on userbuffers (qkv / proj / fc1 / fc2 exchanges counted) and trains 3 steps like
  one-process TE within test_fp8_tp's tensorwise tolerances (delayed amaxes reduce over TP x DP x CP,
  so the scales are one process's; what is left is fp32 summation order). Measured when written
  (both families, both ranks): losses <= 1.8e-7, gradient norms <= 3.1e-7.
"""

import types

import pytest
import torch
import torch.nn.functional as F

import fakes
from dist_utils import run_distributed
from moetron.parallel.state import Group
from moetron.precision.te_modules import setup_te_userbuffers, te_userbuffers_problem
from moetron.train.trainer import train
from test_fp8_tp import TOLS, _check_metrics
from test_train_layouts import _metrics, _recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TOKENS, HIDDEN, FFN = 16, 32, 48  # seq x batch rows of the userbuffers; hidden; a projection's other width


@pytest.fixture()
def te():
    with fakes.installed("transformer_engine"):
        import transformer_engine.pytorch as te

        yield te
        te.module.base.destroy_ub()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- the fake against torch, and TE's checks that need a process group (2 ranks) -------------------


def _fake_worker(rank, world):
    fakes.install("transformer_engine")
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.module import base

    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)  # [seq, batch, hidden]: the whole sequence, 16 rows
    w1 = torch.randn(FFN, HIDDEN, generator=g) / 4
    w2 = torch.randn(HIDDEN, FFN, generator=g) / 4
    dy = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
    # one-process reference: y = (x w1^T) w2^T
    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
    F.linear(F.linear(xr, w1r), w2r).backward(dy)

    base.initialize_ub([TOKENS, HIDDEN], world, quantization_modes=[te.UserBufferQuantizationMode.NONE],
                       dtype=torch.float32)
    tp = dist.new_group([0, 1])
    fc1 = te.Linear(HIDDEN, FFN, bias=False, sequence_parallel=True, tp_group=tp, parallel_mode="column",
                    ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True, ub_name="fc1", device="cpu")
    fc2 = te.Linear(FFN, HIDDEN, bias=False, sequence_parallel=True, tp_group=tp, parallel_mode="row",
                    ub_overlap_rs=True, ub_overlap_ag=True, ub_name="fc2", device="cpu")
    f = FFN // world
    with torch.no_grad():
        fc1.weight.copy_(w1[rank * f:(rank + 1) * f])
        fc2.weight.copy_(w2[:, rank * f:(rank + 1) * f])
    s = x.shape[0] // world
    x_local = x[rank * s:(rank + 1) * s].clone().requires_grad_()
    base.ub_log.clear()
    y = fc2(fc1(x_local))
    y.backward(dy[rank * s:(rank + 1) * s])
    errs = (rel(y, F.linear(F.linear(x, w1), w2)[rank * s:(rank + 1) * s]),
            rel(x_local.grad, xr.grad[rank * s:(rank + 1) * s]),
            rel(fc1.weight.grad, w1r.grad[rank * f:(rank + 1) * f]),
            rel(fc2.weight.grad, w2r.grad[:, rank * f:(rank + 1) * f]))
    log = sorted(set(base.ub_log))

    # TE's checks that need torch.distributed
    refusals = {}

    def refused(key, fn, exc):
        try:
            fn()
        except exc as e:
            refusals[key] = str(e)

    refused("twice", lambda: base.initialize_ub([TOKENS, HIDDEN], world), RuntimeError)
    refused("unknown name", lambda: base.get_ub("q_fprop", False), KeyError)
    refused("fp8 not registered", lambda: base.get_ub("qkv_fprop", True), KeyError)
    short = x_local[:-1].detach()  # a token fewer than the buffer holds
    refused("rows", lambda: fc1(short), RuntimeError)
    bad_name = te.Linear(HIDDEN, FFN, bias=False, sequence_parallel=True, tp_group=tp, parallel_mode="column",
                         ub_overlap_ag=True, ub_name="q", device="cpu")
    refused("bad ub_name", lambda: bad_name(x_local.detach()), KeyError)
    base.destroy_ub()
    refused("not initialized", lambda: base.get_ub("qkv_fprop", False), RuntimeError)
    refused("pipeline AG", lambda: base.initialize_ub([TOKENS, HIDDEN], world, ub_cfgs={
        "qkv_fprop": {"method": "pipeline"}}), ValueError)
    base.destroy_ub()
    refused("bootstrap", lambda: base.initialize_ub([TOKENS, HIDDEN], world, bootstrap_backend="ucc"), ValueError)
    base.destroy_ub()
    refused("3-D buffer", lambda: base.initialize_ub([TOKENS, 2, HIDDEN], world), RuntimeError)
    base.destroy_ub()
    base.initialize_ub([TOKENS, HIDDEN], world, quantization_modes=[te.UserBufferQuantizationMode.NONE])  # bf16
    refused("dtype", lambda: fc2(torch.randn(2 * s, 2, f)), RuntimeError)  # fp32 GEMM output, bf16 RS buffer
    base.destroy_ub()
    base.initialize_ub([TOKENS, HIDDEN], world, quantization_modes=[te.UserBufferQuantizationMode.FP8],
                       dtype=torch.float32)
    from transformer_engine.common import recipe as te_r
    for key, rcp in (("blockwise", te_r.Float8BlockScaling()), ("mxfp8 rows", te_r.MXFP8BlockScaling())):
        wide = te.Linear(HIDDEN, FFN, bias=False, sequence_parallel=True, tp_group=tp, parallel_mode="column",
                         ub_overlap_ag=True, ub_name="fc1", device="cpu")
        with te.autocast(recipe=rcp):
            refused(key, lambda: wide(x_local.detach()), ValueError)
    comm = base.get_ub("fc1_fprop", True)
    refused("unquantized into fp8", lambda: base.fill_userbuffers_buffer_for_all_gather(comm, x_local.detach()),
            RuntimeError)
    base.destroy_ub()
    return errs, log, refusals


def test_fake_userbuffers_match_torch_and_keep_te_checks():
    results = run_distributed(_fake_worker, 2, timeout=120)
    for rank, (errs, log, refusals) in enumerate(results):
        assert max(errs) < 1e-6, f"rank {rank}: output / dx / dw1 / dw2 relative errors {errs}"
        assert log == [("fc1_fprop", "AG", False), ("fc1_wgrad", "RS", False), ("fc2_dgrad", "AG", False),
                       ("fc2_fprop", "RS", False)], log
        want = {"twice": "already initialized", "unknown name": "UB for q_fprop with use_fp8=False is not registered",
                "fp8 not registered": "use_fp8=True is not registered", "rows": "invalid tensor into a local chunk",
                "bad ub_name": "UB for q_fprop", "not initialized": "UB manager is not initialized",
                "pipeline AG": "`pipeline` overlap method is not supported for AllGather",
                "bootstrap": "Invalid torch.distributed backend 'ucc'", "3-D buffer": "must be 2-dimensional",
                "dtype": "dtypes are not compatible", "blockwise": "Unsupported quantizer for Userbuffers",
                "mxfp8 rows": "divisible by 128", "unquantized into fp8": "initialized with FP8 buffers"}
        for key, text in want.items():
            assert key in refusals, f"rank {rank}: TE's check {key!r} did not raise"
            assert text in refusals[key], (key, refusals[key])


# ---- TE's checks that need no process group ---------------------------------------------------------


def test_fake_refuses_before_initialize_ub_and_bad_arguments(te):
    from transformer_engine.pytorch.module import base

    with pytest.raises(AssertionError, match="initialize_ub\\(\\) must be called before layer construction"):
        te.Linear(HIDDEN, FFN, sequence_parallel=True, tp_size=2, parallel_mode="column", ub_overlap_ag=True,
                  ub_name="fc1", device="cpu")
    with pytest.raises(AssertionError, match="parallel_mode diagonal not supported"):
        te.Linear(HIDDEN, FFN, tp_size=2, parallel_mode="diagonal", device="cpu")
    with pytest.raises(ValueError, match="47 is not divisible by 2"):
        te.Linear(HIDDEN, 47, tp_size=2, parallel_mode="column", device="cpu")
    with pytest.raises(TypeError, match="quantization_modes must be a list"):
        base.initialize_ub([TOKENS, HIDDEN], 2, quantization_modes=base.UserBufferQuantizationMode.FP8)
    with pytest.raises(TypeError, match="list of UserBufferQuantizationMode"):
        base.initialize_ub([TOKENS, HIDDEN], 2, quantization_modes=["fp8"])
    with pytest.raises(ValueError, match="Number of ub_cfgs settings \\(2\\)"):
        base.initialize_ub([TOKENS, HIDDEN], 2, quantization_modes=[base.UserBufferQuantizationMode.FP8],
                           ub_cfgs=[{}, {}])
    with pytest.raises(RuntimeError, match="torch.distributed must be initialized"):
        base.initialize_ub([TOKENS, HIDDEN], 2, quantization_modes=[base.UserBufferQuantizationMode.FP8])
    with pytest.raises(RuntimeError, match="NVTE_WITH_CUBLASMP"):
        base.initialize_ub([TOKENS, HIDDEN], 2, with_cublasmp=True)
    # TE turns the ub switches off without sequence parallel (moetron's config refuses that layout)
    plain = te.Linear(HIDDEN, FFN, tp_size=2, parallel_mode="column", ub_overlap_ag=True, device="cpu")
    assert not plain.ub_overlap_ag_fprop


def test_moetron_checks_what_userbuffers_cannot_carry():
    assert te_userbuffers_problem("delayed", 32, 2, 64) is None
    assert "block-scaled" in te_userbuffers_problem("blockwise", 32, 2, 64)
    assert "% 8 == 0" in te_userbuffers_problem("tensorwise", 12, 2, 64)
    assert "divisible by 128" in te_userbuffers_problem("mxfp8", 32, 2, 64)
    assert "do not split" in te_userbuffers_problem("delayed", 33, 2, 64)
    ps = types.SimpleNamespace(tp=Group("tp", (0, 2), 0, None))  # tp not innermost: TE's domains are blocks
    with pytest.raises(ValueError, match="put tp first in parallel.order"):
        setup_te_userbuffers([], ps, 64, 32, torch.float32, "delayed")
    ps = types.SimpleNamespace(tp=Group("tp", (0, 1), 0, None))
    with pytest.raises(ValueError, match="train.seq_len / train.micro_batch_size"):
        setup_te_userbuffers([], ps, 64, 12, torch.float32, "delayed")


# ---- moetron trains on TE userbuffers like one-process TE (2 ranks) ---------------------------------

# deepseek-v3-tiny: MLA (its q_b_proj reads the q latent: TE's plain TP gather), a dense layer (fc1, fc2), shared
# experts (their fc1 reads the MoE layer's gathered input: local TE GEMMs); qwen3-moe-tiny: GQA (qkv)
FAMILIES = {"deepseek-v3-tiny": {"proj", "fc1", "fc2"}, "qwen3-moe-tiny": {"qkv", "proj"}}
TE_EXTRA = ["train.fp8=delayed", "train.fp8_backend=te"]
UB_EXTRA = ["parallel.tp=2", "parallel.sp=true", "parallel.tp_comm_overlap=true"]
EXCHANGES = {"qkv": (("fprop", "AG"), ("wgrad", "RS")), "fc1": (("fprop", "AG"), ("wgrad", "RS")),
             "proj": (("fprop", "RS"), ("dgrad", "AG")), "fc2": (("fprop", "RS"), ("dgrad", "AG"))}


def _train_worker(rank, world, root):
    fakes.install("transformer_engine")
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.module import base

    out = {}
    for name in FAMILIES:
        te.FP8GlobalStateManager.reset()
        base.ub_log.clear()
        lines = []
        got = _metrics(train(_recipe(name, TE_EXTRA + UB_EXTRA + [f"train.save_dir={root}/ub-{name}"]),
                             log=lines.append))
        out[name] = got, list(base.ub_log), lines
    return out


def test_tp_comm_overlap_on_te_userbuffers_trains_like_one_process(tmp_path):
    want = {}
    with fakes.installed("transformer_engine"):
        import transformer_engine.pytorch as te

        for name in FAMILIES:
            te.FP8GlobalStateManager.reset()
            want[name] = _metrics(train(_recipe(name, TE_EXTRA + [f"train.save_dir={tmp_path}/one-{name}"]),
                                        log=lambda s: None))
        te.FP8GlobalStateManager.reset()
    results = run_distributed(_train_worker, 2, str(tmp_path), init=False, timeout=300)
    for rank, out in enumerate(results):
        for name, kinds in FAMILIES.items():
            got, log, lines = out[name]
            assert log and all(fp8 for _, _, fp8 in log), log  # FP8 buffers throughout
            expect = {(f"{k}_{g}", op) for k in kinds for g, op in EXCHANGES[k]}
            assert {(n, op) for n, op, _ in log} == expect, (name, sorted(set(log)))
            per_step = len(log) / 3
            assert per_step >= 2 * len(expect), (name, len(log))  # every step, each exchange of both layers
            errs = _check_metrics(got, want[name], TOLS["tensorwise"], f"{name} TE userbuffers tp2 rank {rank}")
            if rank == 0:
                assert any("Transformer Engine userbuffers" in line for line in lines), lines
                assert any("q_b_proj" in line for line in lines) == (name == "deepseek-v3-tiny"), lines
            print(f"\n{name} TE userbuffers tp2 sp rank {rank}: losses {errs[0]:.1e}  norms {errs[1]:.1e}")
