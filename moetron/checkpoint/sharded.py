"""A layout-independent sharded tensor store: every rank writes its slices, any layout reads them.

Design notes: docs/checkpoints.md (`moetron/checkpoint/sharded.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moetron.checkpoint.commit import _world, agree, all_gather_object, broadcast_object, commit_folder  # noqa: F401
from moetron.checkpoint.safetensors_io import CheckpointError
from moetron.checkpoint.verify import FORMAT, META, VERSION, read_meta  # noqa: F401
from moetron.moe.experts import GroupedExperts
from moetron.checkpoint.slices import (DTYPE_NAMES, DTYPES, Box, Entry, SafetensorsFile, flat_range_boxes, intersect,
                                   numel, relative, split_rows, write_safetensors)

DEFAULT_FILE_BYTES = 4 * 1024**3  # per output file; a rank's data goes into as many as needed
DEFAULT_CHUNK_BYTES = 512 * 1024**2  # boxes larger than this are stored as row-chunks


# ---- where a local shard sits in the full tensor ---------------------------------------------


@dataclass(frozen=True)
class Placement:
    """`global_shape` and pieces `(local offsets, global offsets, sizes)` covering the local tensor."""

    global_shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Placement:
        shape = tuple(shape)
        return cls(shape, (((0,) * len(shape), (0,) * len(shape), shape),))

    @property
    def local_numel(self) -> int:
        return sum(numel(s) for _, _, s in self.pieces)

    def to_global(self, local: Box) -> list[tuple[Box, Box]]:
        """`(part of the local box, the same elements as a global box)` for every piece it meets."""
        out = []
        for lo, go, sizes in self.pieces:
            part = intersect(local, (lo, sizes))
            if part is not None:
                out.append((part, (tuple(g + p - l for g, p, l in zip(go, part[0], lo)), part[1])))
        return out


@dataclass
class LocalTensor:
    name: str
    tensor: torch.Tensor
    placement: Placement


def placement_of(owner: nn.Module, leaf: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> Placement:
    """How `owner.<leaf>` (this rank's shard) sits in the full tensor."""
    shape = tuple(tensor.shape)
    if isinstance(owner, GroupedExperts) and leaf in ("gate_up_proj", "down_proj"):
        e0, n_e = owner.local_experts.start, owner.num_local_experts
        F, f, r, E = owner.ffn_hidden_size, owner.local_ffn_size, owner.etp_rank, owner.num_experts
        if leaf == "down_proj":
            H = shape[1]
            return Placement((E, H, F), (((0, 0, 0), (e0, 0, r * f), (n_e, H, f)),))
        H = shape[2]
        if f == F:
            return Placement((E, 2 * F, H), (((0, 0, 0), (e0, 0, 0), (n_e, 2 * F, H)),))
        return Placement((E, 2 * F, H), (((0, 0, 0), (e0, r * f, 0), (n_e, f, H)),
                                         ((0, f, 0), (e0, F + r * f, 0), (n_e, f, H))))
    if getattr(tensor, "tensor_model_parallel", False) and tp_size > 1:
        d = tensor.partition_dim
        gshape, goff = list(shape), [0] * len(shape)
        gshape[d] *= tp_size
        goff[d] = tp_rank * shape[d]
        return Placement(tuple(gshape), (((0,) * len(shape), tuple(goff), shape),))
    return Placement.whole(shape)


def local_tensors(modules: Iterable[nn.Module], parallel_state=None) -> dict[str, LocalTensor]:
    """This rank's parameters and persistent buffers under their model names, with placements.

    `modules`: the model, or this rank's pipeline stage modules (which use the model's names).
    """
    tp_rank, tp_size = (0, 1) if parallel_state is None else (parallel_state.tp.rank, parallel_state.tp.size)
    out: dict[str, LocalTensor] = {}
    for module in modules:
        owners = {}
        for sub in module.modules():
            for leaf, p in sub.named_parameters(recurse=False):
                owners.setdefault(id(p), (sub, leaf))
        for name, t in module.state_dict(keep_vars=True).items():
            if name in out:
                continue
            sub, leaf = owners.get(id(t), (None, ""))
            placement = placement_of(sub, leaf, t, tp_rank, tp_size) if sub is not None else Placement.whole(t.shape)
            out[name] = LocalTensor(name, t, placement)
    return out


# ---- keys ------------------------------------------------------------------------------------


def store_key(name: str, slot: str | None, offsets: Sequence[int], sizes: Sequence[int],
              shape: Sequence[int]) -> str:
    base = name if slot is None else f"{name}.{slot}"
    if tuple(sizes) == tuple(shape):
        return base
    return base + "@" + ",".join(str(o) for o in offsets)


def parse_key(key: str, kind: str) -> tuple[str, str | None, tuple[int, ...] | None]:
    """`(name, slot, offsets or None for a whole tensor)`."""
    base, at, offs = key.partition("@")
    offsets = tuple(int(o) for o in offs.split(",")) if at else None
    if kind == "model":
        return base, None, offsets
    name, _, slot = base.rpartition(".")
    return name, slot, offsets


# ---- who writes what -------------------------------------------------------------------------


@dataclass
class WritePlan:
    """This rank's share: whole local tensors (model) and flat ranges (optimizer) to write."""

    model: list[str]  # names of this rank's local tensors it writes
    optimizer: list[tuple[str, int, int]]  # (name, lo, hi) ranges of the flattened local tensor
    tensors: dict[str, dict]  # name -> {"shape": [...], "dtype": "F32"}, over all ranks


def plan_writes(local: dict[str, LocalTensor], optimizer_ranges: dict[str, tuple[int, int]] | None = None
                ) -> WritePlan:
    """Decide, identically on every rank, which rank stores each region (see the module doc).

    `optimizer_ranges`: name -> the [lo, hi) of the flattened local tensor this rank's optimizer
    owns (the whole tensor without ZeRO); None when no optimizer state is saved. Collective.
    """
    rank, _ = _world()
    mine = [(n, lt.placement.global_shape, lt.placement.pieces, DTYPE_NAMES[lt.tensor.dtype],
             None if optimizer_ranges is None else optimizer_ranges.get(n)) for n, lt in local.items()]
    everyone = all_gather_object(mine)
    by_name: dict[str, list] = {}
    for r, items in enumerate(everyone):
        for name, gshape, pieces, dtype, opt in items:
            by_name.setdefault(name, []).append((r, tuple(gshape), tuple(pieces), dtype, opt))
    tensors, model, ranges, problems = {}, [], [], []
    for i, name in enumerate(sorted(by_name)):
        holders = by_name[name]
        shapes = {h[1] for h in holders}
        if len(shapes) > 1:
            problems.append(f"{name}: ranks disagree on the full shape {sorted(shapes)}")
            continue
        gshape = shapes.pop()
        tensors[name] = {"shape": list(gshape), "dtype": holders[0][3]}
        placements: dict[tuple, list] = {}
        for h in holders:
            placements.setdefault(h[2], []).append(h)
        covered = sum(numel(s) for pieces in placements for _, _, s in pieces)
        if covered != numel(gshape):
            problems.append(f"{name}: the ranks' shards cover {covered} of {numel(gshape)} elements")
            continue
        for j, (pieces, group) in enumerate(sorted(placements.items(), key=lambda kv: kv[1][0][0])):
            writer = group[(i + j) % len(group)][0]
            if writer == rank:
                model.append(name)
            if optimizer_ranges is None:
                continue
            if all(h[4] is None for h in group):
                continue  # no optimizer state (a buffer, a frozen parameter)
            taken: list[tuple[int, int]] = []
            total = sum(numel(s) for _, _, s in pieces)
            for r, _, _, _, opt in sorted(group, key=lambda h: h[0]):
                if opt is None:
                    continue
                for a, b in _subtract(opt, taken):
                    if r == rank:
                        ranges.append((name, a, b))
                    taken.append((a, b))
            if sum(b - a for a, b in taken) != total:
                problems.append(f"{name}: the optimizer state held by ranks {[h[0] for h in group]} covers "
                                f"{sum(b - a for a, b in taken)} of {total} elements")
    if problems:
        raise CheckpointError("cannot save: the layout's shards do not tile the model (a bug):\n  "
                              + "\n  ".join(problems[:20]))
    return WritePlan(model, ranges, tensors)


def _subtract(interval: tuple[int, int], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    parts = [tuple(interval)]
    for a, b in taken:
        nxt = []
        for lo, hi in parts:
            if b <= lo or a >= hi:
                nxt.append((lo, hi))
                continue
            if lo < a:
                nxt.append((lo, a))
            if b < hi:
                nxt.append((b, hi))
        parts = nxt
    return [p for p in parts if p[1] > p[0]]


# ---- writing this rank's files ---------------------------------------------------------------


class RankWriter:
    """Collects this rank's entries of one kind and writes them as files of bounded size."""

    def __init__(self, folder: Path, kind: str, rank: int, world: int, *,
                 file_bytes: int = DEFAULT_FILE_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.folder, self.kind, self.rank, self.world = Path(folder), kind, rank, world
        self.file_bytes, self.chunk_bytes = file_bytes, chunk_bytes
        self.files: list[list[Entry]] = [[]]
        self.sizes = [0]
        self.digests: dict[str, dict] = {}  # file name -> CRC-32s as written (`write_safetensors`)

    def add_box(self, name: str, slot: str | None, global_box: Box, shape: Sequence[int],
                dtype: torch.dtype, produce: Callable[[Box], torch.Tensor]) -> None:
        """Store the box of tensor `name` (full shape `shape`); `produce(box)` returns its data.
        Boxes over `chunk_bytes` are cut into row-chunks, each produced on its own."""
        for box in split_rows(global_box, dtype.itemsize, self.chunk_bytes):
            key = store_key(name, slot, box[0], box[1], shape)
            entry = Entry(key, dtype, tuple(box[1]), lambda box=box: produce(box))
            if self.files[-1] and self.sizes[-1] + entry.nbytes > self.file_bytes:
                self.files.append([])
                self.sizes.append(0)
            self.files[-1].append(entry)
            self.sizes[-1] += entry.nbytes

    def file_names(self) -> list[str]:
        if self.world == 1 and len(self.files) == 1:
            return [f"{self.kind}.safetensors"]
        return [f"{self.kind}-{self.rank:05d}-{i:03d}.safetensors" for i in range(len(self.files))]

    def write(self, on_bytes=None) -> list[str]:
        names = self.file_names()
        if not any(self.files):
            return []
        for name, entries in zip(names, self.files):
            self.digests[name] = {}
            write_safetensors(self.folder / name, entries, {"format": "pt", "moetron": FORMAT}, on_bytes,
                              digest=self.digests[name])
        return names


def write_local_boxes(writer: RankWriter, lt: LocalTensor, slot: str | None = None,
                      source: torch.Tensor | None = None) -> None:
    """Queue all of local tensor `lt` (or `source`, laid out like it) as its global boxes."""
    data = lt.tensor if source is None else source
    for lo, go, sizes in lt.placement.pieces:
        def produce(box, lo=lo, go=go):
            sl = tuple(slice(o - g + l, o - g + l + s) for o, s, g, l in zip(box[0], box[1], go, lo))
            return data.detach()[sl]
        writer.add_box(lt.name, slot, (go, sizes), lt.placement.global_shape, data.dtype, produce)


def write_flat_range(writer: RankWriter, lt: LocalTensor, slot: str, flat: torch.Tensor, flat_lo: int,
                     lo: int, hi: int) -> None:
    """Queue elements [lo, hi) of the flattened local tensor, given as `flat` starting at `flat_lo`."""
    shape = tuple(lt.tensor.shape)
    for start, box in flat_range_boxes(shape, lo, hi):
        view = flat[start - flat_lo:start - flat_lo + numel(box[1])].view(box[1])
        for part, gbox in lt.placement.to_global(box):
            data = view[relative(part, box[0])]

            def produce(sub, data=data, gbox=gbox):
                return data[relative(sub, gbox[0])]
            writer.add_box(lt.name, slot, gbox, lt.placement.global_shape, flat.dtype, produce)


# ---- reading ---------------------------------------------------------------------------------


class StoreReader:
    """The tensors of a store folder, indexed by (name, slot); reads any box of any tensor."""

    def __init__(self, folder: str | os.PathLike, meta: dict, kinds: Sequence[str] = ("model", "optimizer")):
        self.folder = Path(folder)
        self.meta = meta
        self.finite_only = False  # True: a read box holding a NaN or inf is an error naming the tensor
        self.shapes = {n: tuple(t["shape"]) for n, t in meta.get("tensors", {}).items()}
        self.dtypes = {n: DTYPES[t["dtype"]] for n, t in meta.get("tensors", {}).items()}
        # (name, slot) -> stored boxes: (global offsets, sizes, file, key)
        self.index: dict[tuple[str, str | None], list[tuple[tuple, tuple, SafetensorsFile, str]]] = {}
        self.files: list[SafetensorsFile] = []
        files = meta.get("files", {})
        for kind in kinds:
            for fname in files.get(kind, []):
                path = self.folder / fname
                if not path.exists():
                    raise FileNotFoundError(f"{self.folder}: checkpoint is incomplete, {fname} is missing")
                f = SafetensorsFile(path)
                self.files.append(f)
                for key in f.keys():
                    name, slot, offsets = parse_key(key, kind)
                    shape = self.shapes.get(name)
                    if shape is None:
                        raise CheckpointError(f"{path}: key {key!r} names tensor {name!r}, which {META} does not list")
                    sizes = f.info(key).shape
                    offsets = offsets if offsets is not None else (0,) * len(shape)
                    if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                            o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
                        raise CheckpointError(f"{path}: key {key!r} of shape {list(sizes)} does not fit "
                                              f"{name!r} of shape {list(shape)}")
                    self.index.setdefault((name, slot), []).append((tuple(offsets), tuple(sizes), f, key))
        for (name, slot), boxes in self.index.items():
            stored = sum(numel(s) for _, s, _, _ in boxes)
            if stored != numel(self.shapes[name]):
                where = sorted({b[2].path.name for b in boxes})
                raise CheckpointError(f"{self.folder}: {name!r}{'' if slot is None else ' ' + slot} is stored in "
                                      f"pieces of {stored} elements in total, the tensor has "
                                      f"{numel(self.shapes[name])} (files {where[:4]}): incomplete or corrupt")

    def names(self) -> set[str]:
        return {n for n, s in self.index if s is None}

    def slots(self, name: str) -> list[str]:
        return sorted(s for n, s in self.index if n == name and s is not None)

    def has(self, name: str, slot: str | None = None) -> bool:
        return (name, slot) in self.index

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, offsets: Sequence[int], sizes: Sequence[int], slot: str | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """The box of `name` (or of its optimizer `slot`), assembled from whatever pieces hold it."""
        boxes = self.index.get((name, slot))
        if boxes is None:
            what = name if slot is None else f"{name} {slot}"
            raise CheckpointError(f"{self.folder}: no {what!r} in the checkpoint")
        want = (tuple(offsets), tuple(sizes))
        if dtype is None:
            dtype = boxes[0][2].info(boxes[0][3]).torch_dtype
        out = torch.empty(want[1], dtype=dtype)
        got = 0
        for o, s, f, key in boxes:
            part = intersect(want, (o, s))
            if part is None:
                continue
            data = f.read(key, tuple(p - b for p, b in zip(part[0], o)), part[1])
            out[relative(part, want[0])] = data.to(out.dtype)
            got += numel(part[1])
        if got != numel(want[1]):
            raise CheckpointError(f"{self.folder}: {name!r} region {want} is covered by {got} of "
                                  f"{numel(want[1])} elements")
        if self.finite_only and out.is_floating_point() and not bool(torch.isfinite(out.float()).all()):
            raise CheckpointError(f"{self.folder}: tensor {name!r}{'' if slot is None else ' ' + slot} holds "
                                  "NaN or inf values; refusing to export it (resume an earlier checkpoint)")
        return out

    def close(self) -> None:
        for f in self.files:
            f.close()


def read_local(source, lt: LocalTensor, slot: str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """All of local tensor `lt` from `source` (anything with `read(name, offsets, sizes, slot, dtype)`)."""
    out = torch.empty(lt.tensor.shape, dtype=dtype or lt.tensor.dtype)
    for lo, go, sizes in lt.placement.pieces:
        out[relative((lo, sizes), (0,) * out.dim())] = source.read(lt.name, go, sizes, slot=slot, dtype=out.dtype)
    return out


def read_local_flat(source, lt: LocalTensor, lo: int, hi: int, slot: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Elements [lo, hi) of the flattened local tensor `lt` from `source`, as a 1-D tensor."""
    out = torch.empty(hi - lo, dtype=dtype)
    for start, box in flat_range_boxes(tuple(lt.tensor.shape), lo, hi):
        view = out[start - lo:start - lo + numel(box[1])].view(box[1])
        for part, gbox in lt.placement.to_global(box):
            view[relative(part, box[0])] = source.read(lt.name, gbox[0], gbox[1], slot=slot, dtype=dtype)
    return out
