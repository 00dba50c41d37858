"""What the trainer does when a step goes wrong: a NaN/inf loss, and a rank that hangs.

NaN is injected by poisoning one forward's loss (`total_loss * nan`), which makes that
micro-batch's gradients NaN too, exactly like a real overflow; in the two-rank run only rank 1
is poisoned, so the step's decision must be shared by both ranks. The hang is a rank that
blocks before a collective: the other must fail after `train.collective_timeout_s` with an
error that names the collective and the step, instead of waiting forever.
"""

import contextlib
import io
import json
import logging
import math
import os
import signal
import time

import pytest

from dist_utils import run_distributed
from moetron.cli import main
from moetron.model.model import MoETransformer
from moetron.parallel.state import collective_failures
from moetron.recipes import apply_overrides, get_recipe
from moetron.train import trainer
from moetron.train.setup import build_run
from moetron.train.trainer import train

BASE = ["model.num_layers=2", "train.seq_len=16", "train.micro_batch_size=2", "train.steps=4",
        "train.warmup_steps=1", "train.log_every=100"]


def _poison_forward(monkeypatch, calls: set[int]):
    """Make the forwards numbered in `calls` (from 0, this process) return a NaN loss."""
    original = MoETransformer.forward
    count = [0]

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if count[0] in calls:
            out.total_loss = out.total_loss * float("nan")
        count[0] += 1
        return out

    monkeypatch.setattr(MoETransformer, "forward", forward)


def test_nonfinite_loss_stops_or_skips_in_one_process(monkeypatch, tmp_path):
    recipe = apply_overrides(get_recipe("deepseek-v3-tiny"), BASE + ["train.grad_accum=2"])
    _poison_forward(monkeypatch, {3})  # step 1, second micro-batch
    with pytest.raises(FloatingPointError, match=r"step 2/4 .*rank 0.*loss is not finite on rank\(s\) 0.*on_nonfinite"):
        train(recipe, log=lambda s: None)

    runs, bias_updates = [], []
    update_expert_bias = MoETransformer.update_expert_bias

    def keep_run(recipe, log):
        runs.append(build_run(recipe, log))
        return runs[-1]

    def count_bias_updates(self, group=None):
        bias_updates.append(1)
        return update_expert_bias(self, group)

    monkeypatch.setattr(trainer, "build_run", keep_run)
    monkeypatch.setattr(MoETransformer, "update_expert_bias", count_bias_updates)
    _poison_forward(monkeypatch, {3})
    lines = []
    metrics = tmp_path / "m.jsonl"
    skip = apply_overrides(recipe, ["train.on_nonfinite=skip", f"train.metrics_file={metrics}"])
    history = train(skip, log=lines.append)
    assert [h["skipped"] for h in history] == [False, True, False, False]
    assert [h["skipped_steps"] for h in history] == [0, 1, 1, 1]
    assert math.isnan(history[1]["loss"]) and math.isnan(history[1]["grad_norm"])
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in history[2:])  # no NaN update
    assert any("step 2/4 skipped" in line and "rank(s) 0" in line for line in lines), lines
    # Three updates: the optimizer's step count, and the expert bias (aux-loss-free balancing).
    steps = {int(s["step"]) for s in runs[0].optimizer.state.values()}
    assert steps == {3} and len(bias_updates) == 3
    row = json.loads(metrics.read_text().splitlines()[1])  # strict JSON: NaN is written as null
    assert row["loss"] is None and row["skipped"] is True and row["skipped_steps"] == 1

    # A run that keeps diverging stops after train.max_skipped_steps skips in a row; the count of
    # skipped steps survives a resume and ends up in the command's summary line.
    monkeypatch.undo()  # the poisons below replace, not wrap, the one above
    _poison_forward(monkeypatch, set(range(2, 100)))  # every forward from step 1 (second micro-batch 0) on
    diverged = apply_overrides(skip, ["train.max_skipped_steps=2", "train.steps=6"])
    with pytest.raises(FloatingPointError, match=r"step 4/6: 3 steps in a row were skipped .*max_skipped_steps=2"):
        train(diverged, log=lambda s: None)
    monkeypatch.undo()
    _poison_forward(monkeypatch, {3})
    saved = [f"train.save_dir={tmp_path / 'ckpt'}", "train.save_every=1"]
    train(apply_overrides(skip, saved + ["train.steps=2"]), log=lambda s: None)
    monkeypatch.undo()
    args = ["train", "--recipe", "deepseek-v3-tiny"] + [a for o in BASE + ["train.grad_accum=2",
            "train.on_nonfinite=skip", "train.resume=true", "train.steps=3"] + saved for a in ("--set", o)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    assert "over 1 steps (1 skipped)" in out.getvalue(), out.getvalue()

    with pytest.raises(ValueError, match="on_nonfinite"):
        apply_overrides(recipe, ["train.on_nonfinite=ignore"])
    with pytest.raises(ValueError, match="collective_timeout_s"):
        apply_overrides(recipe, ["train.collective_timeout_s=0"])


def _two_rank_failures(rank, world, flag_file):
    from _pytest.monkeypatch import MonkeyPatch

    out = {}
    ep2 = apply_overrides(get_recipe("deepseek-v3-tiny"), BASE + ["parallel.ep=2"])
    for mode in ("stop", "skip"):
        with MonkeyPatch.context() as mp:
            if rank == 1:
                _poison_forward(mp, {1})  # step 1 (one micro-batch per step)
            try:
                history = train(apply_overrides(ep2, [f"train.on_nonfinite={mode}"]), log=lambda s: None)
                out[mode] = [(h["skipped"], h["skipped_steps"], h["loss"]) for h in history]
            except FloatingPointError as exc:
                out[mode] = str(exc)

    # A stop signal that reaches rank 1 only: during step 1's forward (before the step's loss check,
    # where the ranks agree on it) both stop after step 1; during its update, after step 2.
    for where in ("forward", "update"):
        with MonkeyPatch.context() as mp:
            if rank == 1:
                target, name = (MoETransformer, "forward") if where == "forward" else (trainer, "_optimizer_step")
                original, count = getattr(target, name), [0]

                def hook(*args, _original=original, _count=count, **kwargs):
                    _count[0] += 1
                    if _count[0] == 2:
                        os.kill(os.getpid(), signal.SIGINT)
                    return _original(*args, **kwargs)

                mp.setattr(target, name, hook)
            out[f"signal in the {where}"] = [h["step"] for h in train(ep2, log=lambda s: None)]

    # Rank 1 blocks before step 1's forward, until rank 0 has given up (or 120 s pass); rank 0 logs
    # every second that it still waits.
    hang = apply_overrides(ep2, ["train.collective_timeout_s=3", "train.collective_wait_log_s=1"])
    waits = _Records()
    logging.getLogger("moetron.parallel.state").addHandler(waits)
    with MonkeyPatch.context() as mp:
        original, count = MoETransformer.forward, [0]

        def forward(self, *args, **kwargs):
            count[0] += 1
            if rank == 1 and count[0] == 2:
                deadline = time.monotonic() + 120
                while not os.path.exists(flag_file) and time.monotonic() < deadline:
                    time.sleep(0.05)
            return original(self, *args, **kwargs)

        mp.setattr(MoETransformer, "forward", forward)
        start = time.monotonic()
        try:
            train(hang, log=lambda s: None)
            out["hang"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["hang"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        if rank == 0:
            open(flag_file, "w").close()
    out["waits"] = waits.lines
    return out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_two_ranks_agree_on_nonfinite_and_on_a_stop_signal_and_a_hung_rank_times_out(tmp_path):
    results = run_distributed(_two_rank_failures, 2, str(tmp_path / "rank0-gave-up"), init=False, timeout=240)
    for rank, out in enumerate(results):
        # stop: both ranks raise, both naming rank 1 (where the loss was NaN) and the step.
        assert isinstance(out["stop"], str), out["stop"]
        assert "step 2/4" in out["stop"] and f"rank {rank}:" in out["stop"], out["stop"]
        assert "loss is not finite on rank(s) 1." in out["stop"], out["stop"]
        # skip: both ranks skip step 1 and go on with finite losses.
        assert [s[:2] for s in out["skip"]] == [(False, 0), (True, 1), (False, 1), (False, 1)]
        assert all(math.isfinite(s[2]) for i, s in enumerate(out["skip"]) if i != 1)
        assert out["signal in the forward"] == [0, 1] and out["signal in the update"] == [0, 1, 2], out
    finite = [[s[2] for s in out["skip"] if not s[0]] for out in results]
    assert finite[0] == finite[1]  # the data-parallel mean: the same on both ranks
    name, message, elapsed = results[0]["hang"]
    assert name == "CollectiveError", message
    assert "rank 0: the collective" in message and "over a group of 2 ranks" in message, message
    assert "in the forward/backward pass of step 2/4" in message, message
    assert "train.collective_timeout_s=3" in message, message
    assert 2.5 < elapsed < 60, elapsed  # it waited for the timeout, then gave up
    waits = [w for w in results[0]["waits"] if "forward/backward pass of step 2/4" in w]
    assert waits and all(w.startswith("rank 0: still waiting after") for w in waits), results[0]["waits"]


def test_a_long_wait_is_logged_once_per_interval(caplog):
    with caplog.at_level(logging.WARNING, logger="moetron.parallel.state"):
        with collective_failures("in the test block", rank=3, wait_log_s=0.3):
            time.sleep(1.05)
        time.sleep(0.5)  # nothing more once the block has ended
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(line.startswith("rank 3: still waiting after") for line in lines), lines
    assert "in the test block" in lines[0]
