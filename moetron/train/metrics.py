"""A run's metrics: log lines, the JSON-lines metrics file, TensorBoard, Weights & Biases, the bar.

`MetricsLogger` is what the trainer calls once per step with
the step's metrics dict: it writes the JSON-lines metrics file (strict JSON: a NaN or inf,
e.g. the loss of a skipped step, is written as null), TensorBoard scalars (when
`tensorboard_dir` is set), prints a log line every `log_every` steps above the bar, and
advances the bar; `write(line)` prints any other message without tearing the bar.

TensorBoard goes through `torch.utils.tensorboard`, which needs the optional `tensorboard`
package (`pip install tensorboard`); asking for it without the package fails at once with a
message that says so, never silently. Weights & Biases (`train.wandb_project`) likewise needs
`pip install wandb`; `WANDB_MODE=offline` logs without a network (`wandb sync` uploads later).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from moetron.progress import ProgressBar, is_tty

__all__ = ["MetricsLogger", "aux_loss", "collapse", "describe_run", "format_eval", "format_metrics", "json_safe",
           "require_tensorboard", "require_wandb", "scalar_items"]


RED, RESET = "\x1b[31m", "\x1b[0m"


def aux_loss(m: dict) -> float | None:
    """The step's load-balancing losses summed (aux_loss, seq_aux_loss, global_aux_loss), or None."""
    values = [v for k, v in m.items() if k.endswith("aux_loss") and isinstance(v, (int, float))]
    return sum(values) if values else None


def collapse(m: dict, threshold: float) -> str | None:
    """Why the step's routing looks collapsed (an expert got no token, or max/mean load above
    `threshold`), or None."""
    reasons = []
    if m.get("idle_experts"):
        reasons.append(f"{m['idle_experts']} expert(s) got no token")
    if m.get("max_over_mean_load") and m["max_over_mean_load"] > threshold:
        reasons.append(f"load max/mean {m['max_over_mean_load']:.2f} > {threshold:g}")
    return "COLLAPSE: " + ", ".join(reasons) if reasons else None


def format_metrics(m: dict, steps: int, *, collapse_threshold: float = 3.0, color: bool = False) -> str:
    """One log line for a step's metrics (`step` counts from 0 in the trainer; printed, like the
    metrics file, as the number of steps done: 1..steps). `loss` is the LM loss (+ weighted MTP),
    `aux` the balancing losses, which are not part of it (their gradient enters in the router)."""
    parts = [f"step {m['step'] + 1:>4}/{steps}", f"loss {m['loss']:.4f}", f"lm {m['lm_loss']:.4f}"]
    if m.get("mtp_loss") is not None:
        parts.append(f"mtp {m['mtp_loss']:.4f}")
    aux = aux_loss(m)
    if aux is not None:
        parts.append(f"aux {aux:.4f}")
    if m.get("val_loss") is not None:
        parts.append(f"val {m['val_loss']:.4f}")
    parts += [f"gnorm {m['grad_norm']:.2f}", f"lr {m['lr']:.2e}", f"{m['tokens_per_s']:.0f} tok/s"]
    if m.get("mfu") is not None:
        parts.append(f"mfu {m['mfu'] * 100:.1f}%")
    if m.get("max_over_mean_load"):
        parts.append(f"load max/mean {m['max_over_mean_load']:.2f}")
    if m.get("dropped_fraction"):
        parts.append(f"dropped {m['dropped_fraction'] * 100:.1f}%")
    if m.get("skipped"):
        parts.append("SKIPPED")
    flag = collapse(m, collapse_threshold)
    if flag:
        parts.append(f"{RED}{flag}{RESET}" if color else flag)
    return " | ".join(parts)


def format_eval(step: int, steps: int, val_loss: float) -> str:
    """The validation line (`step` counts from 0, printed from 1 like the step lines)."""
    return f"eval {step + 1:>4}/{steps} | val loss {val_loss:.4f} | ppl {math.exp(min(val_loss, 50)):.2f}"


def describe_run(recipe, *, world_size: int, dp: int, total_params: int, active_params: int, device: str,
                 memory: dict | None = None) -> list[str]:
    """The run's header: model size, layout, the batch in words, precision and memory."""
    t, p = recipe.train, recipe.parallel
    lines = [f"recipe {recipe.name}: {total_params / 1e6:.2f}M parameters ({active_params / 1e6:.2f}M active), "
             f"{t.steps} steps on {world_size} process(es) ({device})"]
    dims = " ".join(f"{k}={getattr(p, k)}" for k in ("tp", "cp", "ep", "etp", "pp") if getattr(p, k) > 1)
    if p.pp > 1:
        dims += f" (schedule {p.schedule}{f', vpp={p.vpp}' if p.vpp > 1 else ''})"
    if p.cp > 1:
        dims += f" (cp_comm_type {p.cp_comm_type}{f' {p.hierarchical_cp}' if p.hierarchical_cp else ''})"
    lines.append(f"layout: {dims or 'no model parallelism'}, {dp} data-parallel replica(s) (dp={dp})"
                 + (f", dispatcher {p.dispatcher}" if p.ep > 1 else "")
                 + (f", ZeRO-{p.zero}" if dp > 1 and p.zero else ""))
    tokens = dp * t.grad_accum * t.micro_batch_size * t.seq_len
    lines.append(f"batch: {tokens:,} tokens per step = {dp} replica(s) x {t.grad_accum} micro-batch(es) "
                 f"(train.grad_accum) x {t.micro_batch_size} sequence(s) (train.micro_batch_size) x {t.seq_len} "
                 "tokens (train.seq_len)")
    precision = f"{t.dtype} parameters"
    if t.dtype == "bf16":
        precision += " (fp32 gradients, master weights and moments)"
    if t.fp8:
        where = ("emulated on the CPU: FP8 numerics, not FP8 speed" if device == "cpu"
                 else f"backend {t.fp8_backend}")
        precision += f"; FP8 {t.fp8} for linear layers and experts ({where})"
    if t.fusion == "compile":
        precision += "; fused elementwise kernels (torch.compile'd during the first steps)"
    lines.append(f"precision: {precision}")
    if memory:
        parts = ", ".join(f"{k} {_size(v)}" for k, v in memory.items())
        lines.append(f"memory: ~{_size(sum(memory.values()))} per rank estimated ({parts})")
    return lines


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


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


def require_wandb():
    """The `wandb` module, or an ImportError that names the package to install."""
    try:
        import wandb
    except ImportError as exc:
        raise ImportError("train.wandb_project needs the 'wandb' package, which is not installed: pip install "
                          f"wandb, or leave train.wandb_project unset ({exc})") from exc
    return wandb


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
    """Per-step metrics out of the trainer: log lines, progress bar, JSON lines, TensorBoard, W&B.

    Construct it on every rank with `enabled=is_main` (disabled loggers do nothing, so the
    trainer needs no rank checks), call `log_step(metrics)` once per step, and `close()` (or
    use it as a context manager). Steps are written as the trainer's `step + 1` (the number of
    steps done, as the console and the checkpoints count). With `start_step > 0` (a resumed run)
    the metrics file is appended to, not truncated. Errors about the metrics file, TensorBoard or
    wandb are raised by the constructor, before any training time is spent.
    """

    def __init__(self, total_steps: int, *, start_step: int = 0, log_every: int = 1,
                 metrics_file: str | os.PathLike | None = None, tensorboard_dir: str | os.PathLike | None = None,
                 log: Callable[[str], None] = print, enabled: bool = True, progress: bool | None = None,
                 stream: TextIO | None = None, format: Callable[..., str] = format_metrics,
                 wandb_project: str | None = None, wandb_config: dict | None = None,
                 collapse_threshold: float = 3.0, color: bool | None = None):
        if log_every < 1:
            raise ValueError(f"log_every={log_every} must be >= 1")
        self.total_steps, self.log_every, self.enabled = total_steps, log_every, enabled
        self.log, self.format = log, format
        self.collapse_threshold = collapse_threshold
        self.color = is_tty(sys.stdout) if color is None else color
        self._file = self._writer = self._wandb = None
        self.bar = ProgressBar(total_steps, initial=start_step, unit="steps", stream=stream,
                               enabled=False if not enabled else progress)
        if not enabled:
            return
        if tensorboard_dir:
            SummaryWriter = require_tensorboard()
            self._writer = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=(start_step + 1) if start_step else None)
        if wandb_project:
            wandb = require_wandb()
            self._wandb = wandb.init(project=wandb_project, config=json_safe(wandb_config or {}),
                                     resume="allow" if start_step else None)
        if metrics_file:
            path = Path(metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if start_step else "w")

    def _record(self, row: dict) -> None:
        """`row` (its `step` already counted from 1) to the file, TensorBoard and wandb."""
        if self._file is not None:
            self._file.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
            self._file.flush()
        scalars = dict(scalar_items(row))
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, global_step=row["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=row["step"])

    def log_step(self, metrics: dict) -> None:
        """Record one step's metrics (a dict with at least `step`, counted from 0, as the trainer makes)."""
        if not self.enabled:
            return
        step = int(metrics["step"])
        self._record({**metrics, "step": step + 1})
        if step % self.log_every == 0 or step == self.total_steps - 1:
            if self.format is format_metrics:
                line = format_metrics(metrics, self.total_steps, collapse_threshold=self.collapse_threshold,
                                      color=self.color)
            else:
                line = self.format(metrics, self.total_steps)
            self.bar.write(line, log=self.log)
        loss = metrics.get("loss")
        self.bar.update(step + 1, postfix=f"loss {loss:.4f}" if isinstance(loss, (int, float)) else None)

    def log_eval(self, step: int, val_loss: float) -> None:
        """A validation loss after step `step` (from 0): a line, and `val_loss` in every log."""
        if self.enabled:
            self._record({"step": step + 1, "val_loss": val_loss})
            self.bar.write(format_eval(step, self.total_steps, val_loss), log=self.log)

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
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self.bar.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
