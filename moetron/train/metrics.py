"""A run's metrics: log lines, the JSON-lines metrics file, TensorBoard, the progress bar.

`MetricsLogger` is what the trainer calls once per step with
the step's metrics dict: it writes the JSON-lines metrics file (strict JSON: a NaN or inf,
e.g. the loss of a skipped step, is written as null), TensorBoard scalars (when
`tensorboard_dir` is set), prints a log line every `log_every` steps above the bar, and
advances the bar; `write(line)` prints any other message without tearing the bar.

TensorBoard goes through `torch.utils.tensorboard`, which needs the optional `tensorboard`
package (`pip install tensorboard`); asking for it without the package fails at once with a
message that says so, never silently.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, TextIO

from moetron.progress import ProgressBar

__all__ = ["MetricsLogger", "format_metrics", "json_safe", "require_tensorboard", "scalar_items"]


def format_metrics(m: dict, steps: int) -> str:
    """One log line for a step's metrics (`step` counts from 0; printed from 1)."""
    parts = [f"step {m['step'] + 1:>4}/{steps}", f"loss {m['loss']:.4f}", f"lm {m['lm_loss']:.4f}"]
    if m.get("mtp_loss") is not None:
        parts.append(f"mtp {m['mtp_loss']:.4f}")
    parts += [f"gnorm {m['grad_norm']:.2f}", f"lr {m['lr']:.2e}", f"{m['tokens_per_s']:.0f} tok/s"]
    if m.get("mfu") is not None:
        parts.append(f"mfu {m['mfu'] * 100:.1f}%")
    if m.get("max_over_mean_load"):
        parts.append(f"load max/mean {m['max_over_mean_load']:.2f}")
    if m.get("dropped_fraction"):
        parts.append(f"dropped {m['dropped_fraction'] * 100:.1f}%")
    if m.get("skipped"):
        parts.append("SKIPPED")
    return " | ".join(parts)


def json_safe(value):
    """`value` with NaN/inf floats as None (null), nested dicts and lists included: strict JSON,
    which `json.dumps` alone would not write (it emits bare NaN / Infinity tokens)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def scalar_items(metrics: dict, prefix: str = ""):
    """`(tag, float)` pairs of every finite-or-not number in `metrics`, nested dicts as `a/b`.

    `None`, strings, booleans and lists are skipped; `step` is the x-axis, not a scalar.
    """
    for key, value in metrics.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalar_items(value, tag + "/")
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, (int, float)) and not (prefix == "" and key == "step"):
            yield tag, float(value)
        elif hasattr(value, "numel") and value.numel() == 1:  # a 0-d tensor
            yield tag, float(value)


def require_tensorboard():
    """`torch.utils.tensorboard.SummaryWriter`, or an ImportError that names the package to install."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard's own message is vaguer)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError("train.tensorboard_dir needs the 'tensorboard' package, which is not installed: "
                          "pip install tensorboard (or pip install 'moetron[tensorboard]'), "
                          f"or leave train.tensorboard_dir unset ({exc})") from exc
    return SummaryWriter


class MetricsLogger:
    """Per-step metrics out of the trainer: log lines, progress bar, JSON lines, TensorBoard.

    Construct it on every rank with `enabled=is_main` (disabled loggers do nothing, so the
    trainer needs no rank checks), call `log_step(metrics)` once per step, and `close()` (or
    use it as a context manager). With `start_step > 0` (a resumed run) the metrics file is
    appended to, not truncated. Errors about the metrics file or TensorBoard are raised by the
    constructor, before any training time is spent.
    """

    def __init__(self, total_steps: int, *, start_step: int = 0, log_every: int = 1,
                 metrics_file: str | os.PathLike | None = None, tensorboard_dir: str | os.PathLike | None = None,
                 log: Callable[[str], None] = print, enabled: bool = True, progress: bool | None = None,
                 stream: TextIO | None = None,
                 format: Callable[[dict, int], str] = format_metrics):
        if log_every < 1:
            raise ValueError(f"log_every={log_every} must be >= 1")
        self.total_steps, self.log_every, self.enabled = total_steps, log_every, enabled
        self.log, self.format = log, format
        self._file = self._writer = None
        self.bar = ProgressBar(total_steps, initial=start_step, unit="steps", stream=stream,
                               enabled=False if not enabled else progress)
        if not enabled:
            return
        if tensorboard_dir:
            SummaryWriter = require_tensorboard()
            self._writer = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=start_step or None)
        if metrics_file:
            path = Path(metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if start_step else "w")

    def log_step(self, metrics: dict) -> None:
        """Record one step's metrics (a dict with at least `step`, as the trainer makes)."""
        if not self.enabled:
            return
        step = int(metrics["step"])
        if self._file is not None:
            self._file.write(json.dumps(json_safe(metrics), allow_nan=False) + "\n")
            self._file.flush()
        if self._writer is not None:
            for tag, value in scalar_items(metrics):
                self._writer.add_scalar(tag, value, global_step=step)
        if step % self.log_every == 0 or step == self.total_steps - 1:
            self.bar.write(self.format(metrics, self.total_steps), log=self.log)
        loss = metrics.get("loss")
        self.bar.update(step + 1, postfix=f"loss {loss:.4f}" if isinstance(loss, (int, float)) else None)

    def write(self, line: str) -> None:
        """Any other message (a checkpoint saved, a warning): printed above the bar, on the main rank only."""
        if self.enabled:
            self.bar.write(line, log=self.log)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.bar.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
