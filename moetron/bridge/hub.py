"""Reading a Hugging Face hub folder region by region: `HubFolder` (files, keys, positional reads)
and `HFSource` (moetron tensor names mapped onto boxes of hub keys, FP8 dequantized on the fly,
every key accounted for). Used by bridge/convert.py."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.bridge.hf import SCALE_SUFFIX, _read_config
from moetron.bridge.hf_config import config_from_hf
from moetron.bridge.keys import build_key_map, mtp_shared_copies
from moetron.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointError
from moetron.checkpoint.slices import (FLOAT_DTYPES, FP8_DTYPES, Box, SafetensorsFile, intersect, numel,
                                   relative, view_box)
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.precision.blockwise import expected_scale_shape
log = logging.getLogger(__name__)
DTYPE_CHOICES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16}


# ---- the hub folder ------------------------------------------------------------------------------


class HubFolder:
    """A hub folder's files, every header parsed and validated, keys mapped to their files."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index, single = self.folder / INDEX_NAME, self.folder / SINGLE_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map")
            except (json.JSONDecodeError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a valid index ({exc})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            names = sorted(set(weight_map.values()))
        elif single.exists():
            weight_map, names = None, [SINGLE_NAME]
        else:
            raise CheckpointError(f"{self.folder}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        self.files: dict[str, SafetensorsFile] = {}
        self.file_of: dict[str, SafetensorsFile] = {}
        for name in names:
            path = self.folder / name
            if not path.exists():
                key = next(k for k, v in weight_map.items() if v == name)
                raise CheckpointError(f"{index}: key {key!r} points at missing shard {name}")
            f = self.files[name] = SafetensorsFile(path)
            for key in f.keys():
                if key in self.file_of:
                    raise CheckpointError(f"{path}: key {key!r} is also stored in {self.file_of[key].path.name}")
                self.file_of[key] = f
        if weight_map:
            for key, name in weight_map.items():
                if key not in self.file_of or self.file_of[key].path.name != name:
                    raise CheckpointError(f"{index}: key {key!r} is listed in {name} but not stored there")

    def keys(self) -> set[str]:
        return set(self.file_of)

    def where(self, key: str) -> str:
        return str(self.file_of[key].path)

    def info(self, key: str):
        return self.file_of[key].info(key)

    def read(self, key: str, offsets=None, sizes=None) -> torch.Tensor:
        return self.file_of[key].read(key, offsets, sizes)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


# ---- moetron tensors as boxes of hub keys ----------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """Hub key `key` (shape `hub_shape`) holds box `box` of a moetron tensor (leading dims of size 1
    of the box are absent from the hub tensor)."""

    key: str
    box: Box
    hub_shape: tuple[int, ...]

    def hub_region(self, region: Box) -> Box:
        """`region` (inside self.box, moetron coordinates) in the hub key's coordinates."""
        k = len(self.box[0]) - len(self.hub_shape)
        return (tuple(r - b for r, b in zip(region[0][k:], self.box[0][k:])), tuple(region[1][k:]))


def tensor_parts(mapping, shape: tuple[int, ...]) -> list[Part] | None:
    """The box of the moetron tensor each hub key of `mapping` is, or None if a key is not a plain
    box of it (then the whole tensor is assembled with the mapping's own functions)."""
    base = torch.empty(shape, device="meta")
    parts = []
    for key, view in zip(mapping.sources, mapping.to_hf(base)):
        box = view_box(base, view)
        if box is None:
            return None
        parts.append(Part(key, box, tuple(view.shape)))
    if sum(numel(p.box[1]) for p in parts) != numel(shape):
        return None
    return parts


def meta_model(cfg: ModelConfig) -> MoETransformer:
    with torch.device("meta"):
        return MoETransformer(cfg)


def _fused_layout(keys) -> bool:
    return any(k.endswith("mlp.experts.gate_up_proj") for k in keys)


class HFSource:
    """The moetron tensors of a hub folder, by name: any region of any tensor, FP8 dequantized.

    Construction validates everything that can be checked from the headers and raises one
    CheckpointError listing every problem. `dtype`: "keep" (each tensor in its hub dtype, FP8
    dequantized to bf16), "fp32" or "bf16"; the expert bias stays fp32.
    """

    def __init__(self, folder: str | os.PathLike, *, dtype: str = "keep", mtp: str = "auto", **config_overrides):
        if mtp not in ("auto", "require"):
            raise ValueError(f"mtp={mtp!r}: choose 'auto' or 'require'")
        if dtype != "keep" and dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype={dtype!r}: choose keep, fp32 or bf16")
        self.folder = Path(folder)
        self.hf_config = _read_config(self.folder)
        cfg = config_from_hf(self.hf_config, str(self.folder / "config.json"), **config_overrides)
        self.hub = HubFolder(self.folder)
        available = self.hub.keys()
        if cfg.num_mtp_layers and mtp == "auto" and not any(k.startswith(f"model.layers.{cfg.num_layers}.")
                                                            for k in available):
            log.warning("%s: config asks for %d MTP layer(s) but the checkpoint has none; building without MTP",
                        self.folder, cfg.num_mtp_layers)
            cfg = cfg.replace(num_mtp_layers=0)
        self.cfg = cfg
        quant = self.hf_config.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size") or (128, 128))
        self.dtype_option = dtype
        state = meta_model(cfg).state_dict()
        self.order = list(state)
        self.shapes = {n: tuple(t.shape) for n, t in state.items()}
        self.mappings = {m.target: m for m in build_key_map(cfg, self.order, _fused_layout(available))}
        self.parts: dict[str, list[Part] | None] = {}
        self.copies: dict[str, list[str]] = {}
        self.dequantized: set[str] = set()  # FP8 keys read so far
        self._validate(available)

    # -- validation from headers ---------------------------------------------------------------
    def _validate(self, available: set[str]) -> None:
        consumed: set[str] = set()
        missing, misshaped, wrong = [], [], []

        def check_dtype(key: str, expected_shape) -> None:
            info = self.hub.info(key)
            where = self.hub.where(key)
            if info.dtype not in FLOAT_DTYPES:
                wrong.append(f"{where}: {key!r} is {info.dtype}, expected a floating-point tensor")
            elif info.dtype in FP8_DTYPES:
                scale = key + SCALE_SUFFIX
                if len(info.shape) != 2:
                    wrong.append(f"{where}: FP8 key {key!r} has shape {list(info.shape)}; only 2-D FP8 weights "
                                 f"are read")
                elif scale not in available:
                    wrong.append(f"{where}: FP8 key {key!r} has no {scale!r}")
                else:
                    consumed.add(scale)
                    s = self.hub.info(scale)
                    want = expected_scale_shape(info.shape, self.block)
                    if s.dtype not in ("F32", "BF16", "F16"):
                        wrong.append(f"{self.hub.where(scale)}: {scale!r} is {s.dtype}, expected F32 scales")
                    elif tuple(s.shape) != want:
                        wrong.append(f"{self.hub.where(scale)}: {scale!r} has shape {list(s.shape)}, expected "
                                     f"{list(want)} for {key!r} {list(info.shape)} in "
                                     f"{self.block[0]}x{self.block[1]} blocks")

        for name in self.order:
            m = self.mappings[name]
            absent = [s for s in m.sources if s not in available]
            if absent:
                missing += absent
                consumed.update(s for s in m.sources if s in available)
                continue
            consumed.update(m.sources)
            expected = [tuple(t.shape) for t in m.to_hf(torch.empty(self.shapes[name], device="meta"))]
            bad = [f"{s}: checkpoint {list(self.hub.info(s).shape)}, model {list(e)}"
                   for s, e in zip(m.sources, expected) if tuple(self.hub.info(s).shape) != e]
            if bad:
                misshaped += bad
                continue
            for s, e in zip(m.sources, expected):
                check_dtype(s, e)
            self.parts[name] = tensor_parts(m, self.shapes[name])
        for hub_key, own in mtp_shared_copies(self.cfg):
            if hub_key in available and own in self.shapes:
                consumed.add(hub_key)
                if tuple(self.hub.info(hub_key).shape) != self.shapes[own]:
                    misshaped.append(f"{hub_key}: checkpoint {list(self.hub.info(hub_key).shape)}, model "
                                     f"{list(self.shapes[own])} (a copy of {own})")
                else:
                    check_dtype(hub_key, self.shapes[own])
                    self.copies.setdefault(own, []).append(hub_key)
        unexpected = sorted(available - consumed)
        if missing or unexpected or misshaped or wrong:
            lines = [f"{self.folder}: checkpoint does not match the {self.cfg.family} model built from config.json"]
            for title, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped),
                                ("wrong-dtype", wrong)):
                if keys:
                    more = " ..." if len(keys) > 20 else ""
                    lines.append(f"  {len(keys)} {title} key(s): " + ", ".join(keys[:20]) + more)
            raise CheckpointError("\n".join(lines))

    # -- the TensorSource interface (names, shape, read) -----------------------------------------------
    def names(self) -> set[str]:
        return set(self.order)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def dtype_of(self, name: str) -> torch.dtype:
        if name.endswith("expert_bias"):
            return torch.float32
        if self.dtype_option != "keep":
            return DTYPE_CHOICES[self.dtype_option]
        info = self.hub.info(self.mappings[name].sources[0])
        return torch.bfloat16 if info.dtype in FP8_DTYPES else info.torch_dtype

    def read(self, name: str, offsets, sizes, slot: str | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Region `[offsets : offsets + sizes]` of moetron tensor `name`."""
        if slot is not None:
            raise CheckpointError(f"{self.folder}: a Hugging Face checkpoint holds no optimizer state ({name} {slot})")
        want = (tuple(offsets), tuple(sizes))
        dtype = dtype or self.dtype_of(name)
        parts = self.parts.get(name)
        if parts is None:  # not a plain set of boxes: assemble the whole tensor
            m = self.mappings[name]
            full = m.to_moetron([self._hub(s, None) for s in m.sources])
            out = full[relative(want, (0,) * len(want[0]))].to(dtype)
        else:
            out = torch.empty(want[1], dtype=dtype)
            for p in parts:
                region = intersect(want, p.box)
                if region is None:
                    continue
                data = self._hub(p.key, p.hub_region(region))
                out[relative(region, want[0])] = data.reshape(region[1]).to(dtype)
        for copy in self.copies.get(name, []):
            if not torch.equal(self._hub(copy, want).to(dtype), out):
                raise CheckpointError(f"{self.hub.where(copy)}: {copy!r} differs from {name}, which moetron "
                                      f"shares with MTP")
        return out

    def _hub(self, key: str, region: Box | None) -> torch.Tensor:
        info = self.hub.info(key)
        if region is None:
            region = ((0,) * len(info.shape), info.shape)
        q = self.hub.read(key, *region)
        if info.dtype not in FP8_DTYPES:
            return q
        self.dequantized.add(key)
        (r0, c0), (nr, nc) = region
        br, bc = self.block
        scale_key = key + SCALE_SUFFIX
        srows = ((r0 + nr - 1) // br - r0 // br + 1) if nr else 0
        scols = ((c0 + nc - 1) // bc - c0 // bc + 1) if nc else 0
        scale = self.hub.read(scale_key, (r0 // br, c0 // bc), (srows, scols)).float()
        rows = torch.arange(r0, r0 + nr) // br - r0 // br
        cols = torch.arange(c0, c0 + nc) // bc - c0 // bc
        return q.float() * scale[rows][:, cols]

    def close(self) -> None:
        self.hub.close()
