"""Reading and writing safetensors checkpoint folders safely.

Reading validates every header against its file before any tensor is touched, so a
truncated file or a header that lies about sizes fails with the file and key named.
Writing goes to a temporary folder that is renamed only when everything is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetron.checkpoint.commit import storage_error
from moetron.checkpoint.slices import CheckpointError, parse_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def read_header(path: Path) -> dict:
    """Parse and validate a safetensors header; returns {key: (dtype, shape)}.

    The validation (truncation, sizes, offsets, overlaps) lives in `slices.parse_header`.
    """
    tensors, _ = parse_header(Path(path))
    return {key: (info.dtype, list(info.shape)) for key, info in tensors.items()}


class CheckpointReader:
    """All tensors of a Hugging Face folder (one file, or shards with an index), read lazily."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index, single = self.folder / INDEX_NAME, self.folder / SINGLE_NAME
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
        elif single.exists():
            weight_map = None
        else:
            raise CheckpointError(f"{self.folder}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
        self.file_of: dict[str, Path] = {}
        self.meta: dict[str, tuple[str, list[int]]] = {}
        for name in files:
            path = self.folder / name
            if not path.exists():
                key = next(k for k, v in weight_map.items() if v == name)
                raise CheckpointError(f"{index}: key {key!r} points at missing shard {name}")
            for key, meta in read_header(path).items():
                self.file_of[key], self.meta[key] = path, meta
        if weight_map:
            for key, name in weight_map.items():
                if self.file_of.get(key) != self.folder / name:
                    raise CheckpointError(f"{index}: key {key!r} is listed in {name} but not stored there")
        self._handles: dict[Path, object] = {}

    def keys(self) -> set[str]:
        return set(self.file_of)

    def shape(self, key: str) -> list[int]:
        return self.meta[key][1]

    def get(self, key: str) -> torch.Tensor:
        path = self.file_of.get(key)
        if path is None:
            raise CheckpointError(f"{self.folder}: key {key!r} is not in the checkpoint")
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(key)


@contextmanager
def atomic_folder(dst: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder beside `dst`; rename it to `dst` only if the block succeeds."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; pass overwrite=True or choose another path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise storage_error(exc, dst.parent, f"writing {dst.name}", "Nothing was written.") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ShardWriter:
    """Writes tensors into shards of at most `max_shard_bytes`, then the index."""

    def __init__(self, folder: Path, max_shard_bytes: int):
        self.folder, self.max_shard_bytes = folder, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[dict[str, torch.Tensor]] = []
        self.written: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        name = f"shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.written.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.written:
            self._flush()
        if len(self.written) == 1:
            os.replace(self.folder / self.written[0][0], self.folder / SINGLE_NAME)
            return
        n = len(self.written)
        weight_map = {}
        for i, (name, keys) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / name, self.folder / final)
            weight_map.update({k: final for k in keys})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
