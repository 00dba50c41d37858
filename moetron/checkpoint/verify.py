"""What is read back is what was written: meta.json's schema and seal, every file's CRC-32, finite values.

A checkpoint's meta.json records the CRC-32 of every file and of every tensor's bytes as written
(`write_safetensors(digest=...)`) and its own CRC-32 (`meta_crc32`, over the rest in canonical
form), so a flipped bit or a truncation anywhere is refused with the file, and where possible the
tensor, named; a hand-edited step number is refused too. The schema check names the key at fault.

    verify_checkpoint(folder)          # collective: the files are shared out over the ranks
    moetron checkpoint verify DIR      # a checkpoint folder or a save_dir (every step-* in it)

Design notes: docs/checkpoints.md (`moetron/checkpoint/verify.py`).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
import zlib
from pathlib import Path

import torch

from moetron.checkpoint.commit import _world, agree
from moetron.checkpoint.slices import DTYPES, CheckpointError, parse_header

FORMAT = "moetron-sharded"
VERSION = 2  # 2: checksums and meta_crc32; 1 (older moetron): neither, loaded unverified with a warning
META = "meta.json"
STEP_NAME = re.compile(r"^step-(\d{8})$")
KINDS = ("model", "optimizer", "fp8", "rng")
_BLOCK = 8 << 20


# ---- meta.json ---------------------------------------------------------------------------------


def _canonical(meta: dict) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != "meta_crc32"}, sort_keys=True,
                      separators=(",", ":")).encode()


def seal_meta(meta: dict) -> str:
    """meta.json's text with its own CRC-32 (`meta_crc32`) added."""
    return json.dumps({**meta, "meta_crc32": zlib.crc32(_canonical(meta))}, indent=1)


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def validate_meta(meta, path: str | os.PathLike) -> dict:
    """`meta` (parsed meta.json) checked against the schema; a CheckpointError names the key at fault."""

    def fail(key: str, want: str, got) -> None:
        raise CheckpointError(f"{path}: key {key!r} {want}, found {_short(got)} (meta.json is damaged or was "
                              "edited; resume an intact checkpoint with train.resume_from=step-N)")

    if not isinstance(meta, dict):
        fail("(top level)", "must be a JSON object", meta)
    for key, check, want in (("format", lambda v: v == FORMAT, f"must be {FORMAT!r}"),
                             ("version", lambda v: v in (1, VERSION), f"must be 1 or {VERSION}"),
                             ("step", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
                             ("files", lambda v: isinstance(v, dict), "must be an object"),
                             ("tensors", lambda v: isinstance(v, dict), "must be an object")):
        if key not in meta:
            fail(key, "is missing", None)
        if not check(meta[key]):
            fail(key, want, meta[key])
    for kind, names in meta["files"].items():
        if kind not in KINDS:
            fail(f"files.{kind}", f"is not one of {', '.join(KINDS)}", kind)
        if not isinstance(names, list) or not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..")
                                                  for n in names):
            fail(f"files.{kind}", "must be a list of file names", names)
    if "model" not in meta["files"]:
        fail("files.model", "is missing", None)
    for name, info in meta["tensors"].items():
        if not isinstance(info, dict):
            fail(f"tensors.{name}", "must be an object", info)
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            fail(f"tensors.{name}.shape", "must be a list of integers >= 0", shape)
        if info.get("dtype") not in DTYPES:
            fail(f"tensors.{name}.dtype", f"must be one of {', '.join(DTYPES)}", info.get("dtype"))
    _validate_optimizer(meta.get("optimizer"), fail)
    for key in ("layout", "model_config", "recipe", "train_state"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            fail(key, "must be an object or null", meta[key])
    folder = Path(path).parent
    match = STEP_NAME.match(folder.name)
    if match and int(match.group(1)) != meta["step"]:
        fail("step", f"must be {int(match.group(1))} (the folder is {folder.name})", meta["step"])
    if meta["version"] >= 2:
        _validate_checksums(meta, fail)
        seal = meta.get("meta_crc32")
        if not _is_int(seal):
            fail("meta_crc32", "must be an integer", seal)
        if zlib.crc32(_canonical(meta)) != seal:
            raise CheckpointError(f"{path}: its content does not match its checksum (meta_crc32): meta.json is "
                                  "damaged or was edited; resume an intact checkpoint with train.resume_from=step-N")
    return meta


def _validate_optimizer(opt, fail) -> None:
    if opt is None:
        return
    if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list):
        fail("optimizer.param_groups", "must be a list", None if not isinstance(opt, dict) else opt.get("param_groups"))
    for i, g in enumerate(opt["param_groups"]):
        where = f"optimizer.param_groups.{i}"
        if not isinstance(g, dict):
            fail(where, "must be an object", g)
        for k in ("lr", "eps", "weight_decay"):
            if not _is_num(g.get(k)):
                fail(f"{where}.{k}", "must be a finite number", g.get(k))
        if not (isinstance(g.get("betas"), list) and len(g["betas"]) == 2 and all(map(_is_num, g["betas"]))):
            fail(f"{where}.betas", "must be a list of two numbers", g.get("betas"))
        if not (_is_int(g.get("step")) and g["step"] >= 0):
            fail(f"{where}.step", "must be an integer >= 0", g.get("step"))
        if not (isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])):
            fail(f"{where}.params", "must be a list of names", g.get("params"))
    steps = opt.get("param_steps", {})
    if not isinstance(steps, dict) or not all(_is_int(v) and v >= 0 for v in steps.values()):
        fail("optimizer.param_steps", "must map names to integers >= 0", steps)


def _validate_checksums(meta: dict, fail) -> None:
    sums = meta.get("checksums")
    if not isinstance(sums, dict):
        fail("checksums", "must be an object", sums)
    for kind, names in meta["files"].items():
        for name in names:
            if name not in sums:
                fail(f"checksums.{name}", f"is missing (files.{kind} lists {name})", None)
    for name, s in sums.items():
        if not (isinstance(s, dict) and _is_int(s.get("bytes")) and _is_int(s.get("crc32"))
                and isinstance(s.get("tensors", {}), dict)):
            fail(f"checksums.{name}", "must be an object with integer bytes and crc32", s)


def read_meta(folder: str | os.PathLike) -> dict:
    """`folder/meta.json`, parsed and validated."""
    path = Path(folder) / META
    if not path.exists():
        raise FileNotFoundError(f"{folder}: not a complete checkpoint ({META} is missing)")
    try:
        meta = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); meta.json is damaged") from None
    return validate_meta(meta, path)


# ---- the files ---------------------------------------------------------------------------------


def listed_files(meta: dict) -> list[str]:
    return sorted({n for names in meta["files"].values() for n in names} | set(meta.get("checksums", {})))


def _crc_range(f, start: int, end: int) -> int:
    crc, pos = 0, start
    f.seek(start)
    while pos < end:
        block = f.read(min(_BLOCK, end - pos))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        pos += len(block)
    return crc


def check_file(folder: Path, name: str, want: dict) -> str | None:
    """None when `folder/name` has the recorded size and CRC-32, else what is wrong (naming tensors)."""
    path = folder / name
    if not path.exists():
        return f"{path}: missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"{path}: {size} bytes, {want['bytes']} were written (truncated or appended to)"
    with open(path, "rb") as f:
        if _crc_range(f, 0, size) == want["crc32"]:
            return None
        bad = []
        try:
            tensors, _ = parse_header(path)
        except CheckpointError as exc:
            return f"{exc} (checksum mismatch)"
        for key, info in tensors.items():
            if key in want.get("tensors", {}) and _crc_range(f, info.begin, info.end) != want["tensors"][key]:
                bad.append(key)
    where = f"in tensor(s) {', '.join(bad[:5])}" if bad else "in its header"
    return f"{path}: checksum mismatch {where}: the file is corrupt"


def verify_checkpoint(folder: str | os.PathLike, *, collective: bool = True) -> dict:
    """Validate meta.json and check every file's CRC-32; returns the meta. Under torch.distributed
    (with `collective`) the files are shared out over the ranks and every rank raises on a problem."""
    folder = Path(folder)
    rank, world = _world() if collective else (0, 1)
    error, meta = None, None
    try:
        meta = read_meta(folder)
    except (CheckpointError, FileNotFoundError) as exc:
        error = str(exc)
    problems = []
    if meta is not None and meta["version"] < 2:
        if rank == 0:
            warnings.warn(f"{folder}: saved by an older moetron without checksums; its data is not verified")
    elif meta is not None:
        names = listed_files(meta)
        for name in names[rank::world]:
            problem = check_file(folder, name, meta["checksums"][name])
            if problem:
                problems.append(problem)
        error = "\n".join(problems) or None
    if world > 1:
        agree(error, f"{folder}: checkpoint refused")
    elif error:
        raise CheckpointError(f"{folder}: checkpoint refused:\n{error}")
    return meta


# ---- finite values -------------------------------------------------------------------------------


def nonfinite(named) -> list[str]:
    """Labels of the floating tensors among `(label, tensor)` pairs that hold a NaN or inf (one sync)."""
    labels, flags = [], []
    for label, t in named:
        if t.is_floating_point() and t.numel():
            labels.append(label)
            flags.append(torch.isfinite(t.detach().float() if t.element_size() == 1 else t.detach()).all())
    if not flags:
        return []
    ok = torch.stack(flags).tolist()
    return [label for label, good in zip(labels, ok) if not good]


# ---- `moetron checkpoint verify DIR` ---------------------------------------------------------------


def verify_command(path: str | os.PathLike, out=print) -> int:
    """Verify a checkpoint folder, or every step-* folder of a save_dir; 0 when all are intact, else 1."""
    path = Path(path)
    if (path / META).exists():
        folders = [path]
    elif path.is_dir():
        folders = sorted(p for p in path.iterdir() if p.is_dir() and STEP_NAME.match(p.name))
    else:
        raise FileNotFoundError(f"{path}: no such folder")
    if not folders:
        raise FileNotFoundError(f"{path}: neither a checkpoint (no {META}) nor a save_dir (no step-* folders)")
    bad = 0
    for folder in folders:
        try:
            meta = verify_checkpoint(folder, collective=False)
            checked = f"{len(listed_files(meta))} files, checksums match" if meta["version"] >= 2 else \
                "no checksums (older moetron): meta.json valid, data NOT verified"
            out(f"ok      {folder} (step {meta['step']}): {checked}")
        except (CheckpointError, FileNotFoundError) as exc:
            bad += 1
            out(f"REFUSED {folder}: {exc}")
    return 1 if bad else 0


def finite_or_raise(t: torch.Tensor, name: str, source, allow: bool = False) -> torch.Tensor:
    """`t`, or a CheckpointError naming tensor `name` of `source` when it holds a NaN or inf (unless `allow`)."""
    if not allow and t.is_floating_point() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
        raise CheckpointError(f"{source}: tensor {name!r} holds NaN or inf values; refusing to convert it "
                              "(--allow-nonfinite converts it anyway)")
    return t
