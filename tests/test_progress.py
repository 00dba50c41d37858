"""The progress bar, the per-step MetricsLogger and its TensorBoard output."""

import io
import json
import random
import sys

import pytest

from moetron.progress import ProgressBar, format_duration
from moetron.train.metrics import (MetricsLogger, format_metrics, require_tensorboard,
                                    scalar_items)


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def _metrics(rng: random.Random, step: int) -> dict:
    return {"step": step, "loss": rng.uniform(1, 5), "lm_loss": rng.uniform(1, 5), "mtp_loss": rng.uniform(1, 5),
            "seq_aux_loss": rng.uniform(0, 0.1), "grad_norm": rng.uniform(0, 3), "lr": rng.uniform(1e-5, 1e-3),
            "tokens_per_s": rng.uniform(100, 1e4), "tflops": rng.uniform(0, 1), "max_over_mean_load": None,
            "dropped_fraction": None, "skipped": False, "skipped_steps": 0,
            "moe_load": {"layer1": {"max_over_mean": rng.uniform(1, 2), "dropped_fraction": 0.0}}}


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 75, 3599, 4000, float("inf"), -1)] == \
        ["0s", "59s", "1m15s", "59m59s", "1h06m", "?", "?"]


def test_bar_draws_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    plain = io.StringIO()
    bar = ProgressBar(10, stream=plain)
    for i in range(11):
        bar.update(i)
    bar.write("a log line")  # with no bar, write is a plain print
    bar.close()
    assert plain.getvalue() == "a log line\n"

    tty = FakeTTY()
    bar = ProgressBar(10, initial=2, stream=tty, min_interval=0, width=80)
    assert bar.enabled
    bar.update(5, postfix="loss 2.5000")
    text = bar.render()
    assert "50%" in text and "5/10 steps" in text and "ETA" in text and "loss 2.5000" in text and len(text) < 80
    half = (text.index("]") - 1) // 2
    assert text.startswith("[" + "#" * half + ".")
    bar.write("a log line")
    bar.update(10)
    bar.close()
    out = tty.getvalue()
    assert "\r\x1b[2K" in out and "\r\x1b[2Ka log line\n" in out  # the bar is cleared before the line
    assert out.endswith("\n") and "100%" in out.splitlines()[-1] and "10/10" in out.splitlines()[-1]
    monkeypatch.setenv("TERM", "dumb")
    assert not ProgressBar(10, stream=FakeTTY()).enabled


def test_bar_scales_counts_rate_and_eta():
    bar = ProgressBar(3e6, unit="MB", scale=1e6, stream=FakeTTY(), width=100)
    bar.update(1.5e6)
    text = bar.render(now=bar._start_t + 2.0)  # 1.5 MB in 2 s: 0.75 MB/s, 1.5 MB left
    assert "50%  1.5/3.0 MB  0.75 MB/s  ETA 2s" in text
    bar.update(3e6)
    assert "3.0/3.0 MB  0.75 MB/s  in 4s" in bar.render(now=bar._start_t + 4.0)


def test_narrow_terminal_still_fits():
    bar = ProgressBar(1000, stream=FakeTTY(), width=40)
    bar.update(123, postfix="a long postfix that cannot fit on a narrow terminal")
    assert len(bar.render()) <= 39


def test_metrics_logger_writes_json_lines_and_log_lines(tmp_path):
    rng = random.Random(0)
    rows = [_metrics(rng, s) for s in range(7)]
    lines, stream = [], io.StringIO()
    path = tmp_path / "sub" / "m.jsonl"
    with MetricsLogger(7, log_every=3, metrics_file=path, log=lines.append, stream=stream) as logger:
        assert not logger.bar.enabled  # not a terminal: plain log lines only
        for m in rows:
            logger.log_step(m)
    # The file counts steps as the console does: the number of steps done (1..7).
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{**r, "step": r["step"] + 1} for r in rows]
    assert lines == [format_metrics(rows[s], 7) for s in (0, 3, 6)]  # every 3rd step and the last
    assert lines[1].startswith("step    4/7 | loss ") and f"mtp {rows[3]['mtp_loss']:.4f}" in lines[1]
    assert stream.getvalue() == ""
    # A resumed run appends.
    with MetricsLogger(9, start_step=7, metrics_file=path, log=lines.append, stream=stream) as logger:
        logger.log_step(_metrics(rng, 7))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 9))


def test_a_skipped_step_is_strict_json_and_flagged(tmp_path):
    m = {**_metrics(random.Random(3), 4), "loss": float("nan"), "grad_norm": float("inf"), "skipped": True,
         "skipped_steps": 2, "max_over_mean_load": 1.75, "dropped_fraction": 0.125,
         "moe_load": {"layer1": {"max_over_mean": 1.75, "dropped_fraction": float("nan")}}}
    path, lines = tmp_path / "m.jsonl", []
    with MetricsLogger(9, start_step=4, metrics_file=path, log=lines.append, stream=io.StringIO()) as logger:
        logger.log_step(m)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row["loss"] is None and row["grad_norm"] is None and row["moe_load"]["layer1"]["dropped_fraction"] is None
    assert row["lm_loss"] == m["lm_loss"] and row["skipped_steps"] == 2
    assert lines[0].startswith("step    5/9 | loss nan |")
    assert lines[0].endswith("load max/mean 1.75 | dropped 12.5% | SKIPPED")


def test_metrics_logger_on_a_terminal_and_disabled(tmp_path):
    rng = random.Random(1)
    lines, tty = [], FakeTTY()
    logger = MetricsLogger(4, log=lines.append, stream=tty, format=lambda m, n: f"S{m['step']}")
    logger.bar.min_interval = 0
    for s in range(4):
        logger.log_step(_metrics(rng, s))
        if s == 1:
            logger.write("saved checkpoint")
    logger.close()
    assert lines == ["S0", "S1", "saved checkpoint", "S2", "S3"]
    last = tty.getvalue().rstrip("\n").split("\r\x1b[2K")[-1]
    assert "100%" in last and "4/4 steps" in last and "loss" in last
    # Ranks other than the first: nothing at all, no file, no output.
    quiet = MetricsLogger(4, metrics_file=tmp_path / "x.jsonl", tensorboard_dir=tmp_path / "tb",
                          log=lines.append, stream=tty, enabled=False)
    quiet.log_step(_metrics(rng, 0))
    quiet.write("not shown")
    quiet.close()
    assert lines == ["S0", "S1", "saved checkpoint", "S2", "S3"]
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "tb").exists()
    with pytest.raises(ValueError, match="log_every=0"):
        MetricsLogger(4, log_every=0)


def test_scalar_items_flatten_and_skip_non_numbers():
    import torch

    m = {"step": 3, "loss": 2.5, "lr": 1e-3, "note": "x", "none": None, "flag": True,
         "moe_load": {"layer0": {"max_over_mean": 1.5}, "layer1": {}}, "t": torch.tensor(0.25)}
    assert dict(scalar_items(m)) == {"loss": 2.5, "lr": 1e-3, "moe_load/layer0/max_over_mean": 1.5, "t": 0.25}


def test_missing_tensorboard_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with pytest.raises(ImportError, match=r"'tensorboard' package.*pip install tensorboard"):
        require_tensorboard()
    with pytest.raises(ImportError, match="train.tensorboard_dir"):
        MetricsLogger(3, tensorboard_dir=tmp_path / "tb", log=lambda s: None)


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional 'tensorboard' package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rng = random.Random(2)
    rows = [_metrics(rng, s) for s in range(5)]
    with MetricsLogger(5, tensorboard_dir=tmp_path / "tb", log=lambda s: None, stream=io.StringIO()) as logger:
        for m in rows:
            logger.log_step(m)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lm_loss", "mtp_loss", "grad_norm", "lr", "tokens_per_s", "moe_load/layer1/max_over_mean",
            "moe_load/layer1/dropped_fraction", "skipped_steps"} <= tags
    assert "step" not in tags and "max_over_mean_load" not in tags  # the x-axis, and a None
    for tag in ("loss", "lr", "moe_load/layer1/max_over_mean"):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = [(m["step"] + 1, m[tag] if "/" not in tag else m["moe_load"]["layer1"]["max_over_mean"]) for m in rows]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_step_line_shows_aux_loss_and_flags_collapse():
    m = {**_metrics(random.Random(5), 2), "aux_loss": 0.25, "seq_aux_loss": 0.5, "z_loss": 9.0}
    line = format_metrics(m, 10)
    assert "| aux 0.7500 |" in line and "COLLAPSE" not in line  # aux: the balancing losses, not z
    idle = {**m, "idle_experts": 3}
    assert format_metrics(idle, 10).endswith("| COLLAPSE: 3 expert(s) got no token")
    hot = {**m, "max_over_mean_load": 3.5}
    assert format_metrics(hot, 10, collapse_threshold=4.0).endswith("load max/mean 3.50")
    flagged = format_metrics(hot, 10, collapse_threshold=3.0, color=True)
    assert flagged.endswith("| \x1b[31mCOLLAPSE: load max/mean 3.50 > 3\x1b[0m")
    lines = []
    with MetricsLogger(10, log=lines.append, stream=io.StringIO(), color=True, collapse_threshold=3.0) as logger:
        logger.log_step(hot)
    assert lines == [flagged]


def test_run_header_names_the_batch_and_fp8():
    from moetron.recipes import apply_overrides, get_recipe
    from moetron.train.metrics import describe_run

    r = apply_overrides(get_recipe("qwen3-moe-tiny"), ["train.grad_accum=3", "train.fp8=blockwise", "parallel.ep=2"])
    lines = describe_run(r, world_size=4, dp=4, total_params=2_000_000, active_params=1_000_000, device="cpu",
                         memory={"parameters": 2e6, "activations": 3e9})
    assert lines[0].startswith("recipe qwen3-moe-tiny: 2.00M parameters (1.00M active), 150 steps on 4 process")
    assert lines[1].startswith("layout: ep=2, 4 data-parallel replica(s)")
    assert lines[2] == ("batch: 12,288 tokens per step = 4 replica(s) x 3 micro-batch(es) (train.grad_accum) x "
                        "8 sequence(s) (train.micro_batch_size) x 128 tokens (train.seq_len)")
    assert "FP8 blockwise" in lines[3] and "emulated on the CPU" in lines[3]
    assert lines[4] == "memory: ~3.0 GB per rank estimated (parameters 2.0 MB, activations 3.0 GB)"
