"""Committing a folder so that a crash, a full disk or a failing rank never leaves a result that looks complete.

Every rank writes into a temporary folder beside the target; rank 0 renames it into place only when
all ranks succeeded, and fsyncs what the rename depends on (files, meta.json, the folder entries), so a
power loss cannot show a renamed folder with missing data. OS errors (a full disk above all) become one
line that names the folder, the file, what was being saved and the free space.

`MOETRON_CHECKPOINT_FAULT=PHASE[@RANK]` kills this process (SIGKILL) when it reaches PHASE, for the
fault-injection tests: `mkdir`, `written`, `finished`, `moved-old`, `renamed`, `latest`.
Design notes: docs/checkpoints.md (`moetron/checkpoint/commit.py`).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from moetron.checkpoint.slices import CheckpointError

FAULT_ENV = "MOETRON_CHECKPOINT_FAULT"


class StorageError(OSError, CheckpointError):
    """An OS error (disk full, permission, I/O) while saving; the message is one line and says what was kept."""


# ---- collectives that work in one process too ----------------------------------------------


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_object(obj):
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    rank, world = _world()
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: str | None, what: str) -> None:
    """Raise on every rank if any rank reports an error (so no rank is left in a collective)."""
    errors = [e for e in all_gather_object(error) if e]
    if errors:
        raise CheckpointError(f"{what}:\n" + "\n".join(errors))


# ---- durability ------------------------------------------------------------------------------


def fault_point(phase: str) -> None:
    """Kill this process at `phase` when MOETRON_CHECKPOINT_FAULT asks for it (fault-injection tests)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, _, rank = spec.partition("@")
    if want == phase and (not rank or int(rank) == _world()[0]):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder `path` (renames, new files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder
    finally:
        os.close(fd)


def write_durably(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` and fsync it (meta.json, markers)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_durably(path: str | os.PathLike, text: str) -> None:
    """Atomically replace file `path` by one holding `text` (a temporary file, fsync, rename, fsync the folder)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write_durably(tmp, text)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def umask_mode() -> int:
    """The mode a new folder gets from the process umask (mkdtemp's own 0700 is too strict to share)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def make_temp_folder(parent: Path, prefix: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, umask_mode())
    return tmp


def free_space(path: str | os.PathLike) -> str:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return "free space unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if free >= scale:
            return f"{free / scale:.1f} {unit} free"
    return f"{free} bytes free"


def storage_error(exc: OSError, folder: str | os.PathLike, what: str, kept: str) -> StorageError:
    """One line: what failed where (folder, file), why, the free space, and what is left."""
    name = exc.filename or "?"
    reason = exc.strerror or str(exc)
    return StorageError(exc.errno, f"{what} to {folder} failed writing {name}: {reason} "
                                   f"({free_space(folder)} there). {kept}")


# ---- the commit protocol ---------------------------------------------------------------------


def commit_folder(final: str | os.PathLike, write: Callable[[Path], object],
                  finish: Callable[[Path, list], None], *, overwrite: bool = False,
                  after: Callable[[], None] | None = None, what: str | None = None) -> list:
    """Every rank runs `write(tmp)`; when all succeeded rank 0 runs `finish(tmp, reports)` and
    renames `tmp` to `final`, then `after()`. Returns every rank's report. Collective.

    `what` names the thing saved in errors (e.g. "saving the checkpoint of step 6")."""
    final = Path(final)
    what = what or f"saving {final.name}"
    kept = "Nothing was written; earlier checkpoints are untouched."
    rank, _ = _world()
    made = None
    if rank == 0:
        try:
            if final.exists() and not overwrite:
                raise FileExistsError(f"{final} already exists; choose another path or allow overwriting (--overwrite)")
            final.parent.mkdir(parents=True, exist_ok=True)
            made = str(make_temp_folder(final.parent, f".{final.name}.partial-"))
        except FileExistsError as exc:
            made = exc
        except OSError as exc:
            made = storage_error(exc, final.parent, what, kept)
    made = broadcast_object(made if isinstance(made, str) else f"!{type(made).__name__}: {made}")
    if made.startswith("!"):
        if rank == 0 and "FileExistsError" in made:
            raise FileExistsError(made[len("!FileExistsError: "):])
        raise CheckpointError(f"{final}: cannot create a temporary folder: {made[1:]}")
    tmp = Path(made)
    fault_point("mkdir")
    local_exc, report = None, None
    try:
        report = write(tmp)
    except OSError as exc:
        local_exc = storage_error(exc, final.parent, what, kept)
    except Exception as exc:  # reported to every rank below, then re-raised here
        local_exc = exc
    fault_point("written")
    results = all_gather_object(("ok", report) if local_exc is None else
                                ("error", f"rank {rank}: {type(local_exc).__name__}: {local_exc}"))
    failed = [msg for status, msg in results if status == "error"]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if local_exc is not None:
            raise local_exc
        raise CheckpointError(f"{final}: writing failed on another rank, nothing was saved:\n" + "\n".join(failed))
    reports = [r for _, r in results]
    status = None
    if rank == 0:
        try:
            try:
                finish(tmp, reports)
                fsync_dir(tmp)
                fault_point("finished")
                _replace(tmp, final)
                fault_point("renamed")
                if after is not None:
                    after()
            except OSError as exc:
                raise storage_error(exc, final.parent, what, kept) from exc
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            status = f"rank 0: {type(exc).__name__}: {exc}"
            broadcast_object(status)
            raise
    status = broadcast_object(status)
    if status:
        raise CheckpointError(f"{final}: finishing failed, nothing was saved: {status}")
    return reports


def _replace(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` is first moved into a hidden `.NAME.old-*` folder
    (restored by `recover_save_dir` if a crash comes before the new one is in place)."""
    old = None
    if final.exists():
        old = make_temp_folder(final.parent, f".{final.name}.old-")
        os.replace(final, old / final.name)
        fsync_dir(final.parent)
        fault_point("moved-old")
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
