"""Stop and resume: SIGINT / SIGTERM (Ctrl-C, a pre-emption) end the run at the next step
boundary, after saving a checkpoint when `train.save_dir` is set, with the command that resumes
it; `train.keep_last` prunes older checkpoints.

A signal only sets a flag; the trainer checks it after each step. Under torch.distributed the
ranks agree on it in the all-reduce that checks the step's losses, before the update, so every rank
stops after the same step (a signal that reaches only some ranks, as torchrun forwards it, stops them
all); a signal that comes after that all-reduce stops the run after the next step. A second signal
while the first is pending raises KeyboardInterrupt at once. The run then ends normally: the
command exits 0 after saving (the state is safe; the resume command is printed).
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import sys
import threading
from pathlib import Path

from moetron.checkpoint.training import latest_checkpoint

__all__ = ["StopSignal", "prune_checkpoints", "resume_command"]

_STEP_DIR = re.compile(r"^step-(\d{8})$")


class StopSignal:
    """Context manager: while active, SIGINT and SIGTERM set `requested` instead of killing."""

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():  # signals go to the main thread only
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def prune_checkpoints(save_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete `step-NNNNNNNN` folders; never the one
    `latest` names. Returns what was deleted."""
    root = Path(save_dir)
    if keep_last < 1 or not root.is_dir():
        return []
    newest = latest_checkpoint(root)
    steps = sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / "meta.json").exists()),
                   key=lambda p: p.name)
    removed = []
    for folder in steps[:-keep_last]:
        if newest is not None and folder.resolve() == newest.resolve():
            continue
        shutil.rmtree(folder)
        removed.append(folder)
    return removed


def resume_command(save_dir: str | Path) -> str:
    """The command line of this process with `train.resume=true` and `train.save_dir` added."""
    argv = list(sys.argv)
    prog = "moetron" if argv and Path(argv[0]).name in ("moetron", "__main__.py", "cli.py") else None
    if prog is None or "train" not in argv:
        return f"moetron train ... --set train.save_dir={shlex.quote(str(save_dir))} --set train.resume=true"
    args = argv[argv.index("train") + 1:]
    cleaned = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--set" and i + 1 < len(args) and args[i + 1].startswith(("train.resume=",)):
            skip = True
            continue
        cleaned.append(a)
    cleaned += ["--set", "train.resume=true"]
    if not any(a.startswith("train.save_dir=") for a in cleaned):
        cleaned += ["--set", f"train.save_dir={save_dir}"]
    return "moetron train " + " ".join(shlex.quote(a) for a in cleaned)
