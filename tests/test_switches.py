"""Issue 15: Megatron-Core's performance switches as recipe fields, each training like one process.

One 4-rank spawn runs the trainer for 3 steps per case and must match the same recipe in one process
(tests/test_train_layouts.py's comparison: per-step losses and gradient norm within 1e-5 relative,
every final weight within 1e-5):
- `parallel.overlap_grad_reduce` under pp=2 x dp=2 with 1f1b, interleaved, zb1p and dualpipev. The
  trainer's DataParallel is traced: in every step and on every rank the first bucket launches before
  the last gradient of the step arrives, and every bucket except the pipeline-shared ones (the
  embedding that the MTP stage also holds, summed over PP after the schedule) launches during the
  schedule, none of them in finish_grad_sync.
- tp2 x dp2 with sequence parallel, `tp_comm_overlap`, `overlap_param_gather`,
  `overlap_param_gather_with_optimizer_step` and a small `bucket_size`;
- dp4 with `train.global_batch_size` and `train.batch_size_rampup` (the same recipe in one process).
"""

import pytest

from dist_utils import run_distributed
from moetron.parallel import data_parallel as dp_module
from moetron.parallel.config import ParallelConfig
from moetron.train import trainer
from test_train_layouts import _final_state, _metrics, _recipe, _reference, compare_metrics, compare_states

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

NAME = "deepseek-v3-tiny"  # MTP: the embedding is held by the first and the last stage
SMALL_BUCKET = ["parallel.bucket_size=3000"]  # about ten buckets per rank
PIPELINE = [
    ("1f1b", ["parallel.schedule=1f1b"]),
    ("interleaved", ["parallel.schedule=interleaved", "parallel.vpp=2", "parallel.layout=Et|t|m|L"]),
    ("zb1p", ["parallel.schedule=zb1p"]),
    ("dualpipev", ["parallel.schedule=dualpipev", "parallel.layout=Et|t|m|L"]),
]
CASES = [(f"pp2_dp2_{sid}", ["parallel.pp=2", "train.grad_accum=4", *SMALL_BUCKET, *extra], True)
         for sid, extra in PIPELINE]
CASES.append(("tp2_dp2_sp_overlaps", ["parallel.tp=2", "parallel.sp=true", "parallel.tp_comm_overlap=true",
                                      "parallel.overlap_param_gather=true",
                                      "parallel.overlap_param_gather_with_optimizer_step=true",
                                      "train.grad_accum=2", *SMALL_BUCKET], False))
# dp4 x micro_batch_size 2: steps of 8, 16, 16 sequences (1, 2, 2 micro-batches per rank); one process
# runs the same recipe (4, 8, 8 micro-batches)
CASES.append(("dp4_global_batch_rampup", ["train.global_batch_size=16", "train.batch_size_rampup=[8,8,8]"], False))


def _traced_train(recipe):
    """Train; per step, this rank's DataParallel events: ("grad",), ("launch", late), ("finish",)."""
    steps, cls = [], dp_module.DataParallel
    originals = {k: getattr(cls, k) for k in ("zero_grad", "_launch", "_grad_ready", "finish_grad_sync")}

    def zero_grad(self):
        steps.append([])
        originals["zero_grad"](self)

    def launch(self, bucket):
        steps[-1].append(("launch", bucket.slots[0].late))
        originals["_launch"](self, bucket)

    def grad_ready(self, slot):
        steps[-1].append(("grad",))
        originals["_grad_ready"](self, slot)

    def finish(self):
        steps[-1].append(("finish",))
        originals["finish_grad_sync"](self)

    for key, fn in (("zero_grad", zero_grad), ("_launch", launch), ("_grad_ready", grad_ready),
                    ("finish_grad_sync", finish)):
        setattr(cls, key, fn)
    try:
        history = trainer.train(recipe, log=lambda s: None)
    finally:
        for key, fn in originals.items():
            setattr(cls, key, fn)
    return history, steps


def _run_cases(rank, world, root):
    out = []
    for cid, extra, _ in CASES:
        history, steps = _traced_train(_recipe(NAME, extra + [f"train.save_dir={root}/{cid}"]))
        out.append((_metrics(history), steps))
    return out


def _check_overlap(steps, what):
    """First launch before the last gradient; every non-shared bucket launched before finish."""
    assert len(steps) == 3, what
    for i, events in enumerate(steps):
        kinds = [e[0] for e in events]
        first_launch = kinds.index("launch")
        last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
        finish = kinds.index("finish")
        assert first_launch < last_grad, f"{what} step {i}: no bucket launched before the last gradient"
        early = [e for e in events[:finish] if e[0] == "launch"]
        late = [e for e in events[finish:] if e[0] == "launch"]
        assert early and not any(e[1] for e in early), f"{what} step {i}: {early}"
        assert all(e[1] for e in late), f"{what} step {i}: buckets left to finish_grad_sync: {late}"


def test_switches_train_like_one_process(tmp_path):
    results = run_distributed(_run_cases, 4, str(tmp_path), init=False, timeout=600)
    report = []
    for i, (cid, extra, pipelined) in enumerate(CASES):
        recipe = _recipe(NAME, extra + [f"train.save_dir={tmp_path}/{cid}"])
        dp = recipe.parallel.resolve(4).dp
        same = [x for x in extra if not x.startswith(("parallel.", "train.grad_accum"))]
        if recipe.train.global_batch_size is None:  # else the same global batch is the recipe's own
            same.append(f"train.grad_accum={dp * recipe.train.grad_accum}")
        want_metrics, want_state = _reference(NAME, same, str(tmp_path))
        # The pipeline reports no balancing loss (the stages' routers do not add theirs up).
        want_metrics = [{k: v for k, v in w.items() if k in ("loss", "lm_loss", "grad_norm") or not pipelined}
                        for w in want_metrics]
        loss_err = max(compare_metrics(results[r][i][0], want_metrics, f"{cid} rank {r}") for r in range(4))
        param_err = compare_states(_final_state(recipe), want_state, cid)
        if pipelined:
            for r in range(4):
                _check_overlap(results[r][i][1], f"{cid} rank {r}")
        report.append(f"{cid:24s} metrics {loss_err:.1e}  parameters {param_err:.1e}")
    print("\n" + "\n".join(report))


@pytest.mark.parametrize("fields,match", [
    (dict(pp=2, vpp=2), "only the interleaved schedule runs virtual stages"),
    (dict(fb_overlap="moe"), "set parallel.pp >= 2, or parallel.fb_overlap=off"),
    (dict(tp=2, tp_comm_overlap=True), "needs sequence parallel"),
    (dict(overlap_param_gather=True, distributed_optimizer=False), "needs parallel.distributed_optimizer=true"),
    (dict(overlap_param_gather_with_optimizer_step=True), "needs parallel.overlap_param_gather=true"),
    (dict(bucket_size=0), "bucket_size=0 must be a positive"),
])
def test_ignored_switches_are_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**fields)


def test_global_batch_size_and_rampup_sizes():
    """grad_accum from the global batch and the layout; Megatron's ramp-up, step by step; errors."""
    from moetron.train.setup import microbatches_at, resolve_batch_size

    def resolved(extra, world=4):
        return resolve_batch_size(_recipe(NAME, extra), world).train

    t = resolved(["train.global_batch_size=32", "parallel.tp=2"])  # dp2 x mbs2: 8 micro-batches
    assert t.grad_accum == 8 and [microbatches_at(t, 2, s) for s in (0, 5)] == [8, 8]
    # start 8, increment 8 over 48 samples: 3 increments of 16 samples each; consumed 0, 8, 16 (one
    # increment: 16), 32 (two: 24), 56 > 48: full
    t = resolved(["train.global_batch_size=32", "train.batch_size_rampup=[8,8,48]"], world=1)
    assert [microbatches_at(t, 1, s) * 2 for s in range(6)] == [8, 8, 16, 24, 32, 32]
    for extra, match in [(["train.global_batch_size=20"], "20 is not a multiple of dp x train.micro_batch_size = 4 x 2"),
                         (["train.global_batch_size=16", "train.grad_accum=3"], "disagree"),
                         (["train.global_batch_size=16", "train.batch_size_rampup=[4,4,8]"], "4 is not a multiple"),
                         (["train.global_batch_size=16", "train.batch_size_rampup=[8,8,8]", "parallel.pp=2"],
                          "parallel.pp > 1 is not supported")]:
        with pytest.raises(ValueError, match=match):
            resolved(extra)
    with pytest.raises(ValueError, match="whole increments"):
        _recipe(NAME, ["train.global_batch_size=16", "train.batch_size_rampup=[8,3,8]"])
    with pytest.raises(ValueError, match="needs train.global_batch_size"):
        _recipe(NAME, ["train.batch_size_rampup=[8,8,8]"])


@pytest.mark.parametrize("probe,overrides,match", [
    ("flash_attn", ["train.dtype=bf16", "model.attention_backend=flash_attn"], "pip install flash-attn"),
    ("grouped_gemm", ["train.dtype=bf16", "model.expert_backend=grouped_gemm"], "pip install grouped_gemm"),
    ("deep_ep", ["parallel.dispatcher=flex", "parallel.flex_backend=deepep"], "github.com/deepseek-ai/DeepEP"),
    ("transformer_engine", ["train.fp8=tensorwise", "train.fp8_backend=te"], "pip install transformer_engine"),
])
def test_missing_backend_is_a_one_line_cli_error(probe, overrides, match, capsys):
    """`moetron train` names the field and the install command, exit 2, no traceback."""
    from moetron import backends
    from moetron.cli import main

    if next(s for s in backends.backend_status() if s.name == probe).available:
        pytest.skip(f"{probe} runs here")
    assert main(["train", "--recipe", NAME] + [a for o in overrides for a in ("--set", o)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moetron train: error: ") and "\n" not in err and "Traceback" not in err, err
    assert match in err and overrides[-1] in err, err
