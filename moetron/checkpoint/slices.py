"""Regions of tensors in safetensors files: read exactly a box, write files as a stream.

Design notes: docs/checkpoints.md (`moetron/checkpoint/slices.py`).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint file or key is missing, corrupt or inconsistent."""


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


# ---- box arithmetic -------------------------------------------------------------------------


def numel(sizes: Sequence[int]) -> int:
    return math.prod(sizes)


def full_box(shape: Sequence[int]) -> Box:
    return (0,) * len(shape), tuple(shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes in the same coordinates, or None."""
    offs, sizes = [], []
    for (ao, as_), bo, bs in zip(zip(*a), *b):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def relative(box: Box, origin: Sequence[int]) -> tuple[slice, ...]:
    """Slices selecting `box` inside a tensor whose element [0, ...] sits at `origin`."""
    return tuple(slice(o - b, o - b + s) for o, s, b in zip(box[0], box[1], origin))


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[int, Box]]:
    """Split the row-major element range [lo, hi) of a tensor of `shape` into boxes.

    Returns `(flat start, box)` pairs in order; each box is itself contiguous in row-major order
    (a fixed index prefix, a range in one dim, full extent after it), so the elements of a flat
    slice `[start, start + numel)` are exactly that box. At most 2 * ndim - 1 boxes.
    """
    if not 0 <= lo <= hi <= numel(shape):
        raise ValueError(f"flat range [{lo}, {hi}) outside a tensor of shape {tuple(shape)}")
    if not shape:
        return [(0, ((), ()))] if hi > lo else []
    out: list[tuple[int, Box]] = []
    nd = len(shape)

    def rec(dim: int, prefix: tuple[int, ...], base: int, a: int, b: int) -> None:
        # elements [a, b) of the sub-tensor at index `prefix` (dims dim.. free), whose flat start is base
        if dim == nd - 1:
            out.append((base + a, (prefix + (a,), (1,) * dim + (b - a,))))
            return
        inner = numel(shape[dim + 1:])
        first_full, last_full = -(-a // inner), b // inner  # whole rows [first_full, last_full)
        if first_full > last_full:  # inside one row
            r = a // inner
            rec(dim + 1, prefix + (r,), base + r * inner, a - r * inner, b - r * inner)
            return
        if a < first_full * inner:
            r = a // inner
            rec(dim + 1, prefix + (r,), base + r * inner, a - r * inner, inner)
        if last_full > first_full:
            offs = prefix + (first_full,) + (0,) * (nd - dim - 1)
            sizes = (1,) * dim + (last_full - first_full,) + tuple(shape[dim + 1:])
            out.append((base + first_full * inner, (offs, sizes)))
        if b > last_full * inner:
            rec(dim + 1, prefix + (last_full,), base + last_full * inner, 0, b - last_full * inner)

    if hi > lo:
        rec(0, (), 0, lo, hi)
    return out


def split_rows(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Cut a box along its first dimension of size > 1 into boxes of at most ~max_bytes."""
    offs, sizes = box
    total = numel(sizes) * itemsize
    dim = next((d for d, s in enumerate(sizes) if s > 1), None)
    if total <= max_bytes or dim is None:
        return [box]
    per_row = total // sizes[dim]
    rows = max(1, max_bytes // max(per_row, 1))
    out = []
    for start in range(0, sizes[dim], rows):
        n = min(rows, sizes[dim] - start)
        o = list(offs)
        s = list(sizes)
        o[dim] += start
        s[dim] = n
        out.append((tuple(o), tuple(s)))
    return out


def view_box(base: torch.Tensor, part: torch.Tensor) -> Box | None:
    """The box of contiguous `base` that the view `part` selects (leading dims of size 1 may be
    dropped in `part`), or None when `part` is not such a view. Works on meta tensors."""
    shape, strides = tuple(base.shape), base.stride()
    k = base.dim() - part.dim()
    if k < 0 or part.numel() == 0:
        return None
    rem, idx = part.storage_offset() - base.storage_offset(), []
    for s, st in zip(shape, strides):
        idx.append(rem // st if st else 0)
        rem -= idx[-1] * st
    if rem:
        return None
    sizes = (1,) * k + tuple(part.shape)
    for d in range(k, base.dim()):
        if sizes[d] > 1 and part.stride(d - k) != strides[d]:
            return None
        if idx[d] + sizes[d] > shape[d]:
            return None
    return tuple(idx), sizes


# ---- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class SafetensorsFile:
    """One safetensors file, header validated, read box by box with positional reads."""

    def __init__(self, path: str | os.PathLike):
        self._fd: int | None = None
        self.path = Path(path)
        self.tensors, self.metadata = parse_header(self.path)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: key {key!r} is not in this file") from None

    def read(self, key: str, offsets: Sequence[int] | None = None, sizes: Sequence[int] | None = None
             ) -> torch.Tensor:
        """The box `[offsets : offsets + sizes]` of tensor `key` (default: all of it), a new tensor."""
        info = self.info(key)
        shape = info.shape
        if offsets is None:
            offsets, sizes = full_box(shape)
        offsets, sizes = tuple(offsets), tuple(sizes)
        if len(offsets) != len(shape) or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CheckpointError(f"{self.path}: box {offsets}+{sizes} is outside key {key!r} of shape {list(shape)}")
        out = torch.empty(sizes, dtype=info.torch_dtype)
        if out.numel() == 0:
            return out
        item = out.element_size()
        dst = out.reshape(-1).view(torch.uint8).numpy()
        strides = [numel(shape[d + 1:]) for d in range(len(shape))]
        j = len(shape)
        while j > 0 and sizes[j - 1] == shape[j - 1]:
            j -= 1
        if j <= 1:  # one contiguous run
            start = sum(o * s for o, s in zip(offsets, strides))
            self._pread(dst, info.begin + start * item, key)
            return out
        k = j - 1  # dims after k are full, dim k is partial: runs of sizes[k] * stride[k] elements
        run = sizes[k] * strides[k]
        starts = torch.tensor([offsets[k] * strides[k] + sum(o * s for o, s in zip(offsets[:k], strides[:k]))])
        for d in range(k - 1, -1, -1):
            starts = (torch.arange(sizes[d]) * strides[d])[:, None] + starts[None, :]
            starts = starts.reshape(-1)
        starts = starts.tolist()
        span = (starts[-1] + run - starts[0]) * item
        if run * item < 4096 and span <= 4 * out.numel() * item:  # many tiny runs: one read, then pick
            buf = torch.empty(span, dtype=torch.uint8)
            self._pread(buf.numpy(), info.begin + starts[0] * item, key)
            base = starts[0]
            rows = torch.tensor(starts) - base
            index = (rows[:, None] + torch.arange(run)[None, :]).reshape(-1)
            picked = buf.view(info.torch_dtype)[index]
            out.copy_(picked.view(sizes))
            return out
        nbytes = run * item
        for i, s in enumerate(starts):
            self._pread(dst[i * nbytes:(i + 1) * nbytes], info.begin + s * item, key)
        return out

    def _pread(self, buf, offset: int, key: str) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        view, done = memoryview(buf), 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path}: key {key!r}: file ended while reading (truncated?)")
            done += n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()


def parse_header(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: file is truncated ({size} bytes; no safetensors header)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: header claims {header_len} bytes but the file has {size}")
            text = f.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: key {key!r} has a malformed header entry {info!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: key {key!r} has unsupported dtype {dtype}")
        nbytes = numel(shape) * DTYPES[dtype].itemsize
        if any(d < 0 for d in shape) or end - begin != nbytes:
            raise CheckpointError(f"{path}: key {key!r} header says shape {shape} {dtype} ({nbytes} bytes) "
                                  f"but spans {end - begin} bytes")
        if begin < 0 or end > data_size:
            raise CheckpointError(f"{path}: key {key!r} ends at byte {end} but the file holds only "
                                  f"{data_size} data bytes (truncated?)")
        tensors[key] = TensorInfo(dtype, tuple(shape), data_start + begin, data_start + end)
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items() if t.end > t.begin)
    for (b0, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: keys {k0!r} and {k1!r} overlap in the file (header is corrupt)")
    meta = header.get("__metadata__") or {}
    return tensors, meta if isinstance(meta, dict) else {}


# ---- writing ---------------------------------------------------------------------------------

Produced = torch.Tensor | Iterable[torch.Tensor]


@dataclass
class Entry:
    """One tensor of a file to write: `produce()` returns it, or its row-chunks in order."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Produced]

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


def write_safetensors(path: str | os.PathLike, entries: Sequence[Entry], metadata: dict | None = None,
                      on_bytes: Callable[[int, bool], None] | None = None, fsync: bool = True,
                      digest: dict | None = None) -> int:
    """Write `entries` as one safetensors file, producing each tensor only when its turn comes.

    `on_bytes(n, tensor_done)` is called after every chunk (progress). Returns the data bytes.
    `digest`, when given, receives the CRC-32 of the whole file and of each tensor's bytes as
    written (`{"bytes", "crc32", "tensors": {key: crc32}}`), recorded in a checkpoint's meta.json.
    A produced tensor whose dtype or total size differs from its entry is an error (the file is
    left incomplete; callers write into a temporary folder). An OS error names the file.
    """
    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}}
    if not header["__metadata__"]:
        del header["__metadata__"]
    offset = 0
    for e in entries:
        if e.key in header:
            raise ValueError(f"{path}: key {e.key!r} appears twice")
        header[e.key] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    crc = [zlib.crc32(head), {}]
    try:
        with open(path, "wb") as f:
            f.write(head)
            for e in entries:
                written = _write_entry(f, e, path, on_bytes, crc)
                if written != e.nbytes:
                    raise RuntimeError(f"{path}: key {e.key!r} planned as {list(e.shape)} ({e.nbytes} bytes), "
                                       f"produced {written} bytes")
                if on_bytes is not None:
                    on_bytes(0, True)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except OSError as exc:
        if exc.filename is None:  # f.write() errors name no file
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    if digest is not None:
        digest.update(bytes=len(head) + offset, crc32=crc[0], tensors=crc[1])
    return offset


def _write_entry(f, e: Entry, path, on_bytes, crc: list) -> int:
    """Write one entry's chunks; returns the bytes produced. (A function of its own so that no
    chunk outlives it: the next entry's data is produced only after this one's is released.)
    `crc`: [the file's running CRC-32, {key: CRC-32}], updated."""
    produced = e.produce()
    chunks = [produced] if isinstance(produced, torch.Tensor) else produced
    del produced
    written = 0
    key_crc = 0
    for chunk in chunks:
        if chunk.dtype != e.dtype:
            raise RuntimeError(f"{path}: key {e.key!r} planned as {e.dtype}, produced {chunk.dtype}")
        data = chunk.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()  # GPU tensors too
        del chunk
        n = data.nbytes
        written += n
        if written > e.nbytes:
            break
        if n:
            view = memoryview(data)
            f.write(view)
            crc[0] = zlib.crc32(view, crc[0])
            key_crc = zlib.crc32(view, key_crc)
        del data
        if on_bytes is not None:
            on_bytes(n, False)
    crc[1][e.key] = key_crc
    return written
