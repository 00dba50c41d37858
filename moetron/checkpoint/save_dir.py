"""A run's save_dir: never overwritten silently, resumed from its newest intact checkpoint, cleaned after a crash.

    folder = resume_point(save_dir, resume=t.resume, overwrite=t.overwrite, resume_from=t.resume_from, log=say)

- A save_dir that holds `step-*` folders (with or without `latest`) is resumed when
  `train.resume=true`, moved aside to `SAVE_DIR.old-TIME` when `train.overwrite=true` (never deleted),
  and refused otherwise, naming the folder and both switches.
- The newest checkpoint is verified (`verify.verify_checkpoint`); a refused one names the newest
  intact earlier one, which is resumed only when asked (`train.resume_from=step-N`); newer folders
  are then moved into `SAVE_DIR/superseded-TIME/`, never deleted.
- Debris of a crashed save (`.step-N.partial-*`, `.step-N.old-*`, `.latest.tmp`) is removed, or for
  `.old` restored when its step folder is missing, by rank 0 with one log line.
Design notes: docs/checkpoints.md (`moetron/checkpoint/save_dir.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from moetron.checkpoint.commit import _world, broadcast_object, fsync_dir, replace_durably
from moetron.checkpoint.slices import CheckpointError
from moetron.checkpoint.verify import META, STEP_NAME, verify_checkpoint

LATEST = "latest"
DEBRIS = re.compile(r"^\.(step-\d{8})\.(partial|old)-.+$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_folders(root: str | os.PathLike) -> list[Path]:
    """The `step-NNNNNNNN` folders of `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_NAME.match(p.name))


def mark_latest(root: str | os.PathLike, folder_name: str) -> None:
    replace_durably(Path(root) / LATEST, folder_name)


def recover_save_dir(root: str | os.PathLike) -> str | None:
    """Remove or restore what a crashed save left in `root` (rank 0); a one-line summary, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    removed, restored = [], []
    for entry in sorted(root.iterdir()):
        if entry.name == f".{LATEST}.tmp":
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
            continue
        match = DEBRIS.match(entry.name)
        if not match or not entry.is_dir():
            continue
        name, kind = match.groups()
        inner = entry / name
        if kind == "old" and not (root / name).exists() and (inner / META).exists():
            os.replace(inner, root / name)  # the crash came between moving the old copy aside and the new one in
            restored.append(name)
        else:
            removed.append(entry.name)
        shutil.rmtree(entry, ignore_errors=True)
    fixed = _repair_latest(root)
    if not (removed or restored or fixed):
        return None
    fsync_dir(root)
    parts = []
    if removed:
        parts.append(f"removed {len(removed)} leftover(s) of an interrupted save ({', '.join(removed[:3])}"
                     + (" ..." if len(removed) > 3 else "") + ")")
    if restored:
        parts.append(f"restored {', '.join(restored)} from the copy the interrupted save had moved aside")
    if fixed:
        parts.append(fixed)
    return f"{root}: " + "; ".join(parts)


def _repair_latest(root: Path) -> str | None:
    """`latest` pointing at a missing folder: point it at the newest step folder (or remove it)."""
    marker = root / LATEST
    if not marker.exists():
        return None
    target = marker.read_text().strip()
    if STEP_NAME.match(target) and (root / target).is_dir():
        return None
    steps = step_folders(root)
    if steps:
        mark_latest(root, steps[-1].name)
        return f"latest named {target!r}, which is missing; it now names {steps[-1].name}"
    marker.unlink()
    return f"removed latest, which named the missing {target!r}"


def move_aside(path: Path, tag: str = "old") -> Path:
    """Rename `path` to `PATH.TAG-YYYYmmdd-HHMMSS` (never deletes); returns the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = path.with_name(f"{path.name}.{tag}-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.{tag}-{stamp}-{n}")
    os.replace(path, dest)
    fsync_dir(path.parent)
    return dest


def normalize_step(text: str, root: Path) -> str:
    match = re.fullmatch(r"(?:step-)?(\d+)", str(text).strip().rstrip("/").rsplit("/", 1)[-1])
    if not match:
        raise ValueError(f"train.resume_from={text!r}: name a checkpoint folder of {root} as step-N "
                         f"(e.g. step-{4:08d})")
    return step_name(int(match.group(1)))


def _decide(root: Path, resume: bool, overwrite: bool, resume_from: str | None, log) -> list[str]:
    """Rank 0: recover debris, then the checkpoint names to try, newest first ([] = start fresh)."""
    if not root.exists():
        return []
    note = recover_save_dir(root)
    if note:
        log(note)
    steps = step_folders(root)
    if not steps:
        return []
    newest = steps[-1].name
    if overwrite:
        moved = move_aside(root)
        log(f"train.overwrite=true: moved the earlier run in {root} ({len(steps)} checkpoint(s), newest {newest}) "
            f"aside to {moved}")
        return []
    if not resume:
        raise FileExistsError(f"train.save_dir={root} holds checkpoints of an earlier run ({len(steps)}, newest "
                              f"{newest}); set train.resume=true to continue it, or train.overwrite=true to move "
                              f"it aside (to {root.name}.old-TIME) and start over")
    if resume_from is not None:
        name = normalize_step(resume_from, root)
        if not (root / name).is_dir():
            raise FileNotFoundError(f"train.resume_from={resume_from}: {root / name} does not exist; the checkpoints "
                                    f"there are {', '.join(p.name for p in steps)}")
        return [name]
    return [p.name for p in reversed(steps)]


def resume_point(root: str | os.PathLike | None, *, resume: bool, overwrite: bool = False,
                 resume_from: str | None = None, log=print) -> Path | None:
    """The verified checkpoint folder to resume, or None to start fresh (see the module doc). Collective."""
    if root is None:
        return None
    root = Path(root)
    rank, _ = _world()
    decision = None
    if rank == 0:
        try:
            decision = ("ok", _decide(root, resume, overwrite, resume_from, log))
        except (CheckpointError, ValueError, OSError) as exc:
            decision = (type(exc).__name__, str(exc))
    decision = broadcast_object(decision)
    if decision[0] != "ok":
        kinds = {"FileExistsError": FileExistsError, "FileNotFoundError": FileNotFoundError,
                 "ValueError": ValueError}
        raise kinds.get(decision[0], CheckpointError)(decision[1])
    names = decision[1]
    if not names:
        return None
    try:
        verify_checkpoint(root / names[0])
    except CheckpointError as exc:
        intact = None
        for name in names[1:]:
            try:
                verify_checkpoint(root / name)
                intact = name
                break
            except CheckpointError:
                continue
        hint = (f"the newest intact checkpoint is {root / intact}: resume it with train.resume_from={intact} "
                "(newer folders are then moved aside, not deleted)") if intact else \
            "no earlier checkpoint there is intact"
        raise CheckpointError(f"{exc}\n{hint}") from None
    if rank == 0:
        newer = [p for p in step_folders(root) if p.name > names[0]]
        if newer:
            aside = root / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for p in newer:
                os.replace(p, aside / p.name)
            fsync_dir(root)
            log(f"train.resume_from={names[0]}: moved the newer checkpoint(s) {', '.join(p.name for p in newer)} "
                f"aside to {aside}")
        if not (root / LATEST).exists() or (root / LATEST).read_text().strip() != names[0]:
            mark_latest(root, names[0])
    broadcast_object(None)  # the others wait until rank 0 has moved things
    return root / names[0]


def trim_metrics(path: str | os.PathLike | None, start_step: int) -> None:
    """Drop the rows after step `start_step` (an interrupted run's) from a JSON-lines metrics file,
    so the resumed run appends without repeating them. Rows count steps done (`"step": 1` is the
    first step's, as `train/metrics.py` writes them)."""
    if not path or not Path(path).exists():
        return
    path = Path(path)
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            step = None  # a torn last line of a killed run
            dropped += 1
            continue
        if isinstance(step, int) and step > start_step:
            dropped += 1
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        replace_durably(path, "".join(kept))


def prepare_metrics_file(path: str | os.PathLike | None, start_step: int, overwrite: bool) -> None:
    """Rank 0, before the metrics logger opens it: a resumed run drops the rows it will write again;
    `train.overwrite=true` moves an earlier run's non-empty file aside (never deletes it)."""
    if not path or not Path(path).exists():
        return
    if start_step:
        trim_metrics(path, start_step)
    elif overwrite and Path(path).stat().st_size:
        move_aside(Path(path))
