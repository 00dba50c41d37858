"""Issue 15: `parallel.zero_stage` 1, 2 and 3 train like one process and resume each other's checkpoints.

One 2-rank spawn (dp=2, gloo) runs the trainer for 3 steps of tiny DeepSeek-V3 per stage and must match
the same recipe in one process (tests/test_train_layouts.py's comparison: losses, LM loss and gradient
norm per step within 1e-5 relative, every final weight within 1e-5). The ZeRO-2 run measures its
gradient memory: the persistent gradients are the shard (half the full buffer that ZeRO-1 allocates
for the same model and buckets), and the bucket buffers alive at once during backward stay below the
full size. Checkpoints: 2 steps under ZeRO-2 or ZeRO-3, then step 3 resumed under ZeRO-1 (2 ranks) and
under one process (here); both must equal the 3-step one-process run.
"""

import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor

from dist_utils import run_distributed
from moetron.checkpoint.save_dir import mark_latest
from moetron.parallel.config import ParallelConfig
from moetron.parallel.data_parallel import PAD_ALIGN
from moetron.parallel.zero import ShardedGradBuffer, ShardedGradDataParallel
from moetron.recipes import get_recipe
from moetron.train import trainer
from moetron.train.preflight import estimate_memory
from test_train_layouts import STEPS, _final_state, _metrics, _recipe, _reference, compare_metrics, compare_states

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

NAME = "deepseek-v3-tiny"
ACCUM = ["train.grad_accum=2"]  # per rank; the one-process reference accumulates 4
SMALL_BUCKET = ["parallel.bucket_size=3000"]  # about ten buckets
CASES = [  # ZeRO-1 alone: tests/test_train_layouts.py (dp2_distopt); here it resumes the others
    ("zero2", ["parallel.zero_stage=2", *SMALL_BUCKET]),
    ("zero2_no_overlap", ["parallel.zero_stage=2", "parallel.overlap_grad_reduce=false"]),
    ("zero3", ["parallel.zero_stage=3"]),
]
ZERO1 = ["parallel.zero_stage=1"]
# (id, steps 1-2 under, step 3 resumed under); the ZeRO-2/3 checkpoints also resume in one process
RESUMES = [("zero2", ["parallel.zero_stage=2", *SMALL_BUCKET], ZERO1), ("zero3", ["parallel.zero_stage=3"], ZERO1),
           ("zero1_to_zero3", ZERO1, ["parallel.zero_stage=3"])]


def _memory(run):
    """What the run's data parallel keeps: ZeRO-2's buffers, or ZeRO-3's gradient shards."""
    ddp = run.ddp
    if isinstance(ddp, ShardedGradDataParallel):
        return {"kind": "zero2", "grad_bytes": ddp.grad_bytes, "peak_transient": ddp.peak_transient_bytes,
                "full_grad_data": any(b.grad_data is not None for b in ddp.buffers),
                "sharded": all(isinstance(b, ShardedGradBuffer) for b in ddp.buffers),
                "buffer_numel": sum(b.numel for b in ddp.buffers), "buckets": len(ddp.buckets),
                "param_numel": sum(p.numel() for _, p in ddp.named_parameters())}
    if type(ddp).__name__ == "FullyShardedDataParallel":
        params = [p for _, p in ddp.named_parameters()]
        return {"kind": "zero3", "grad_bytes": ddp.grad_bytes, "dtensors": all(isinstance(p, DTensor) for p in params),
                "param_numel": sum(p.numel() for p in params),
                "local_numel": sum(p.to_local().numel() for p in params)}
    return {"kind": type(run.optimizer).__name__,
            "grad_bytes": sum(b.grad_data.numel() * 4 for b in ddp.buffers),
            "buffer_numel": sum(b.numel for b in ddp.buffers)}


def _train_all(rank, world, root):
    built, build_run = [], trainer.build_run

    def recording(recipe, log=print):
        run = build_run(recipe, log)
        built.append(run)
        return run

    trainer.build_run = recording  # in this worker process only
    out = {}
    for cid, extra in CASES:
        out[cid] = _metrics(trainer.train(_recipe(NAME, ACCUM + extra + [f"train.save_dir={root}/{cid}"]),
                                          log=lambda s: None))
        out[cid + "_memory"] = _memory(built[-1])
    for cid, extra, under in RESUMES:
        folder = f"train.save_dir={root}/resume-{cid}"
        first = trainer.train(_recipe(NAME, ACCUM + extra + [folder, f"train.steps={STEPS - 1}"]), log=lambda s: None)
        out[f"resume-{cid}-kinds"] = [type(built[-1].optimizer).__name__]
        last = trainer.train(_recipe(NAME, ACCUM + under + [folder, "train.resume=true"]), log=lambda s: None)
        out[f"resume-{cid}-kinds"].append(type(built[-1].optimizer).__name__)
        out[f"resume-{cid}"] = _metrics(first) + _metrics(last)
    return out


def test_zero_stages_train_like_one_process_and_resume_across_stages(tmp_path):
    results = run_distributed(_train_all, 2, str(tmp_path), init=False, timeout=600)
    want_metrics, want_state = _reference(NAME, ["train.grad_accum=4"], str(tmp_path))
    report = []
    for cid, extra in CASES:
        err = max(compare_metrics(results[r][cid], want_metrics, f"{cid} rank {r}") for r in range(2))
        recipe = _recipe(NAME, ACCUM + extra + [f"train.save_dir={tmp_path}/{cid}"])
        param_err = compare_states(_final_state(recipe), want_state, cid)
        report.append(f"{cid:18s} metrics {err:.1e}  parameters {param_err:.1e}")

    # ZeRO-2's gradient memory: the shard of the fp32 buffer ZeRO-1 allocates in full (buffer_numel: the
    # same buckets, padded), and at most a few bucket buffers at once during backward
    for r in range(2):
        m = results[r]["zero2_memory"]
        full = 4 * m["buffer_numel"]
        assert m["kind"] == "zero2" and m["sharded"] and not m["full_grad_data"], m
        assert 2 * m["grad_bytes"] == full and m["buffer_numel"] >= m["param_numel"], m
        assert m["grad_bytes"] <= 4 * (m["param_numel"] / 2 + m["buckets"] * PAD_ALIGN), m
        assert m["buckets"] >= 5 and 0 < m["peak_transient"] < full / 2, m
        report.append(f"zero2 rank {r}: gradients kept {m['grad_bytes']} B (ZeRO-1: {full} B), "
                      f"peak bucket buffers {m['peak_transient']} B")
    for r in range(2):
        m = results[r]["zero3_memory"]
        assert m["kind"] == "zero3" and m["dtensors"], m
        assert m["local_numel"] <= m["param_numel"] / 2 + 64 and m["grad_bytes"] == 4 * m["local_numel"], m
        report.append(f"zero3 rank {r}: parameters {m['local_numel']} of {m['param_numel']}, "
                      f"gradients {m['grad_bytes']} B")

    kinds = {"zero2": ["DistributedOptimizer"] * 2, "zero3": ["ShardedAdamW", "DistributedOptimizer"],
             "zero1_to_zero3": ["DistributedOptimizer", "ShardedAdamW"]}
    for cid, _, under in RESUMES:
        assert results[0][f"resume-{cid}-kinds"] == kinds[cid], "parallel.zero_stage did not pick the optimizer"
        err = max(compare_metrics(results[r][f"resume-{cid}"], want_metrics, f"resume {cid} rank {r}")
                  for r in range(2))
        root = tmp_path / f"resume-{cid}"
        param_err = compare_states(_final_state(_recipe(NAME, [f"train.save_dir={root}"])), want_state, cid)
        report.append(f"{cid:14s} -> {under[0]:22s} metrics {err:.1e}  parameters {param_err:.1e}")
        if cid not in ("zero2", "zero3"):
            continue
        # the same step-2 checkpoint, resumed in one process
        one = tmp_path / f"resume-{cid}-one"
        shutil.copytree(root / f"step-{STEPS - 1:08d}", one / f"step-{STEPS - 1:08d}")
        mark_latest(one, f"step-{STEPS - 1:08d}")
        recipe = _recipe(NAME, ["train.grad_accum=4", f"train.save_dir={one}", "train.resume=true"])
        last = _metrics(trainer.train(recipe, log=lambda s: None))
        err = compare_metrics(results[0][f"resume-{cid}"][:STEPS - 1] + last, want_metrics, f"resume {cid} one process")
        param_err = compare_states(_final_state(recipe), want_state, f"{cid} -> one process")
        report.append(f"{cid:14s} -> {'one process':22s} metrics {err:.1e}  parameters {param_err:.1e}")
    print("\n" + "\n".join(report))


@pytest.mark.parametrize("fields,match", [
    (dict(zero_stage=2, distributed_optimizer=False), "set parallel.distributed_optimizer=true, or drop"),
    (dict(zero_stage=1, distributed_optimizer=False), "set parallel.distributed_optimizer=true, or drop"),
    (dict(zero_stage=4), "zero_stage=4 is unknown"),
    (dict(zero_stage=0), "zero_stage=0 is unknown"),
    (dict(zero_stage=3, tp=2), "data parallel only, not with parallel.tp=2.*parallel.zero_stage=2"),
    (dict(zero_stage=3, pp=2), "not with parallel.pp=2"),
    (dict(zero_stage=3, ep=2), "not with parallel.ep=2"),
    (dict(zero_stage=3, cp=2), "not with parallel.cp=2"),
    (dict(zero_stage=3, bucket_size=1000), "parallel.bucket_size with parallel.zero_stage=3"),
    (dict(zero_stage=3, overlap_param_gather=True), "parallel.overlap_param_gather with parallel.zero_stage=3"),
    (dict(zero_stage=3, overlap_grad_reduce=False), "overlap_grad_reduce=false with parallel.zero_stage=3"),
])
def test_refused_zero_layouts(fields, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**fields)


def test_zero_stage_resolves_with_distributed_optimizer():
    assert ParallelConfig().zero == 1
    assert ParallelConfig(distributed_optimizer=False).zero == 0
    assert ParallelConfig(zero_stage=2).zero == 2
    assert ParallelConfig(zero_stage=3).zero == 3


def _shard_one_process():
    """ZeRO-2 in one process (a group of one): the shard is the whole buffer and equals ZeRO-1's sums."""
    from moetron.optim import DistributedOptimizer
    from moetron.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    out = []
    for kind in (DataParallel, ShardedGradDataParallel):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        ddp = kind(model, use_distributed_optimizer=True, bucket_size=100)
        opt = DistributedOptimizer(ddp, lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            opt.zero_grad()
            for _ in range(3):
                with ddp.no_sync():
                    model(torch.randn(5, 8, generator=gen)).square().mean().backward()
            model(torch.randn(5, 8, generator=gen)).square().mean().backward()
            opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def test_zero2_in_one_process_equals_zero1():
    zero1, zero2 = _shard_one_process()
    assert (zero1 - zero2).abs().max() <= 1e-6 * zero1.abs().max()
    assert zero1.abs().max() > 0.1


PIPELINED = [
    ("pp2_dp2_1f1b", ["parallel.pp=2", "parallel.schedule=1f1b"]),
    ("pp2_dp2_interleaved", ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.vpp=2",
                             "parallel.layout=Et|t|m|L"]),
    ("pp2_dp2_zb1p", ["parallel.pp=2", "parallel.schedule=zb1p"]),
    ("pp2_dp2_dualpipev", ["parallel.pp=2", "parallel.schedule=dualpipev", "parallel.layout=Et|t|m|L"]),
    ("ep2_dp4_overlap_param_gather", ["parallel.ep=2", "parallel.overlap_param_gather=true",
                                      "parallel.overlap_param_gather_with_optimizer_step=true"]),
]


def _train_pipelined(rank, world, root):
    return [_metrics(trainer.train(_recipe(NAME, ["train.grad_accum=4", "parallel.zero_stage=2", *SMALL_BUCKET, *extra,
                                                  f"train.save_dir={root}/{cid}"]), log=lambda s: None))
            for cid, extra in PIPELINED]


@pytest.mark.slow
def test_zero2_under_pipeline_schedules_and_expert_parallel(tmp_path):
    """ZeRO-2 with pp=2 x dp=2 under every schedule family and with ep=2 (4 ranks) matches one process."""
    results = run_distributed(_train_pipelined, 4, str(tmp_path), init=False, timeout=900)
    report = []
    for i, (cid, extra) in enumerate(PIPELINED):
        recipe = _recipe(NAME, ["train.grad_accum=4", *extra, f"train.save_dir={tmp_path}/{cid}"])
        dp = recipe.parallel.resolve(4).dp
        want_metrics, want_state = _reference(NAME, [f"train.grad_accum={4 * dp}"], str(tmp_path))
        if recipe.parallel.pp > 1:  # the pipeline reports no balancing loss
            want_metrics = [{k: v for k, v in w.items() if k in ("loss", "lm_loss", "grad_norm")} for w in want_metrics]
        err = max(compare_metrics(results[r][i], want_metrics, f"{cid} rank {r}") for r in range(4))
        param_err = compare_states(_final_state(recipe), want_state, cid)
        report.append(f"{cid:30s} metrics {err:.1e}  parameters {param_err:.1e}")
    print("\n" + "\n".join(report))


def test_startup_memory_estimate_follows_the_zero_stage():
    """The run header's per-rank estimate (and the memory check) shards what each stage shards."""
    recipe = get_recipe("qwen3-moe-tiny")
    est = {}
    for stage in (1, 2, 3):
        recipe.parallel.zero_stage = stage
        est[stage] = estimate_memory(recipe, world_size=2)
    assert est[2]["gradients"] == pytest.approx(est[1]["gradients"] / 2)
    assert est[2]["parameters"] == est[1]["parameters"]
    assert est[3]["parameters"] == pytest.approx(est[1]["parameters"] / 2)  # fp32 recipe: fp32 shards
    assert est[1]["optimizer"] == est[2]["optimizer"] == est[3]["optimizer"]
