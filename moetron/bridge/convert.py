"""Hugging Face <-> moetron checkpoints at scale: sharded, streaming, FP8-aware.

    moetron convert hf-to-moetron SRC DST [--tp N --ep N --pp N ...]   # also under torchrun
    moetron convert moetron-to-hf SRC DST [--dtype keep|fp32|bf16|fp8]

    hf_to_moetron(src, dst, parallel=ParallelConfig(ep=2, pp=2))       # collective under torchrun
    moetron_to_hf(src, dst, dtype="fp8")                                # one process, streaming
    load_hf_weights(src, model, optimizer, parallel_state=ps, modules=stages)   # train.init_hf

Import (`HFSource`). Every rank validates the source from the headers alone (config, index,
every file's header, every key's shape and dtype, FP8 scales) and then reads only the regions
of its own shards: the model is built on the `meta` device and parallelised exactly as the
trainer does (`layout_tensors`), which yields this rank's tensors (its TP slice, its local
experts, its pipeline stages' layers, MTP on the stage that runs it) and where each sits in the
full tensor. A moetron tensor made of several hub keys (per-expert weights) is described as the
box each key fills (`tensor_parts`, found by running the key map on a meta tensor), so reading a
region reads exactly the overlapping parts of those keys, from disk with positional reads.
FP8 keys are dequantized on the fly, block by block (`w = q * scale_inv[i//128, j//128]`).
`hf_to_moetron` writes the result as a moetron checkpoint folder (`DST/step-00000000`, `DST/latest`,
no optimizer state) that `moetron train --set train.save_dir=DST --set train.resume=true` starts
from under any layout; `train.init_hf=SRC` loads the same regions straight into the run.

Export. A moetron checkpoint stores full-name boxes, so "gather from the PP owner, then over TP,
then over EP" is a read of those boxes from the files the owners wrote: one process streams the
hub tensors one at a time (one expert matrix, or row-chunks of a big tensor) into shards whose
headers are planned in advance, so peak memory is about one tensor chunk, not a shard or the model.
`dtype="fp8"` re-quantizes 2-D projections to E4M3 with 128x128 blocks (`weight_scale_inv`,
`quantization_config`), the rest in bf16 (the expert bias always fp32).

Strict accounting and errors (all `CheckpointError`, a `ValueError`, naming the file and key):
- one error lists every missing, unexpected and mis-shaped key and every key of a wrong dtype
  (non-float weights, FP8 without `*_scale_inv` or with a scale of the wrong shape or dtype);
- a truncated file, a header that lies about sizes or offsets, overlapping tensors: the file and
  the key; an index pointing at a missing shard: the index, the shard and a key in it;
- an existing DST: FileExistsError unless overwrite.
Output goes to a temporary folder beside DST, renamed only when complete; a failure removes it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moetron.bridge.hf import SCALE_SUFFIX, _quantizable, _read_config
from moetron.bridge.hf_config import config_from_hf, config_to_hf
from moetron.bridge.keys import build_key_map, mtp_shared_copies
from moetron.bridge.safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointError, atomic_folder
from moetron.bridge.slices import (DTYPES, FLOAT_DTYPES, FP8_DTYPES, Box, Entry, SafetensorsFile, intersect, numel,
                                   relative, split_rows, view_box, write_safetensors)
from moetron.config import ModelConfig
from moetron.model.model import MoETransformer
from moetron.precision.blockwise import expected_scale_shape, quantize_blockwise

log = logging.getLogger(__name__)
DTYPE_CHOICES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16}
CHUNK_BYTES = 256 * 1024**2


# ---- progress and summary ----------------------------------------------------------------------


class Progress:
    """`label: 1.20/4.50 GB 27% | 310/1200 tensors | 850 MB/s | 120 tensors/s` on stderr."""

    def __init__(self, label: str, total_bytes: int, total_tensors: int, enabled: bool = True, stream=None):
        self.label, self.total_bytes, self.total_tensors = label, total_bytes, total_tensors
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bytes = self.tensors = 0
        self.start = self.last = time.perf_counter()

    def __call__(self, nbytes: int, tensor_done: bool) -> None:
        self.bytes += nbytes
        self.tensors += tensor_done
        now = time.perf_counter()
        if self.enabled and now - self.last >= (0.2 if self.tty else 10.0):
            self.last = now
            self._show("\r" if self.tty else "", "" if self.tty else "\n")

    def _show(self, head: str, tail: str) -> None:
        dt = max(time.perf_counter() - self.start, 1e-9)
        pct = 100.0 * self.bytes / max(self.total_bytes, 1)
        self.stream.write(f"{head}{self.label}: {self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB {pct:3.0f}% | "
                          f"{self.tensors}/{self.total_tensors} tensors | {self.bytes / dt / 1e6:.0f} MB/s | "
                          f"{self.tensors / dt:.0f} tensors/s{tail}")
        self.stream.flush()

    def close(self) -> float:
        if self.enabled:
            self._show("\r" if self.tty else "", "\n")
        return time.perf_counter() - self.start


def format_summary(s: dict) -> str:
    seconds = max(s["seconds"], 1e-9)
    lines = [f"{s['direction']}: {s['tensors']} tensors, {s['bytes'] / 1e9:.3f} GB in {len(s['files'])} file(s) "
             f"-> {s['dst']} in {s['seconds']:.1f}s ({s['bytes'] / seconds / 1e6:.0f} MB/s, "
             f"{s['tensors'] / seconds:.0f} tensors/s)"]
    details = [f"{k} {s[k]}" for k in ("source_keys", "dequantized", "quantized", "ranks") if s.get(k)]
    if s.get("layout"):
        details.append("layout " + " ".join(f"{k}{v}" for k, v in s["layout"].items() if k != "world_size"))
    if details:
        lines.append("  " + ", ".join(details))
    return "\n".join(lines)


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


def _meta_model(cfg: ModelConfig) -> MoETransformer:
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
        state = _meta_model(cfg).state_dict()
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


# ---- this rank's tensors under a layout, without building the model ---------------------------


def layout_tensors(cfg: ModelConfig, parallel=None, parallel_state=None) -> dict:
    """This rank's LocalTensors (on the meta device) under `parallel` (a ParallelConfig): the same
    sharding and pipeline cut as `moetron.train.setup.build_run`, without allocating a weight."""
    from moetron.train.sharded_checkpoint import local_tensors

    ps = parallel_state
    model = _meta_model(cfg)
    if ps is None or ps.world_size == 1:
        return local_tensors([model], ps)
    from moetron.parallel.parallelize import expert_parallelize, tensor_parallelize

    p = parallel
    with torch.device("meta"):
        if ps.tp.size > 1:
            tensor_parallelize(model, ps, moe_dispatcher=p.dispatcher, flex_backend=p.flex_backend)
        else:
            expert_parallelize(model, ps, p.dispatcher, flex_backend=p.flex_backend)
    modules = [model]
    if ps.pp.size > 1:
        from moetron.pipeline import build_schedule, parse_layout
        from moetron.pipeline.stage import build_stage_modules, even_layout

        vpp = p.vpp if p.schedule == "interleaved" else None
        schedule = build_schedule(p.schedule, pp=p.pp, microbatches=4 * p.pp, vpp=vpp)
        text = p.layout or even_layout(cfg.num_layers, schedule.num_stages, cfg.num_mtp_layers)
        layout = parse_layout(text, num_layers=cfg.num_layers, mtp_layers=cfg.num_mtp_layers, pp=p.pp,
                              vpp=schedule.num_stages // p.pp)
        modules = build_stage_modules(model, layout, schedule, ps.pp.rank)
    return local_tensors(modules, ps)


# ---- HF -> moetron -------------------------------------------------------------------------------------


def hf_to_moetron(src: str | os.PathLike, dst: str | os.PathLike, *, parallel=None, dtype: str = "keep",
                  overwrite: bool = False, progress: bool = True, file_bytes: int | None = None,
                  chunk_bytes: int = CHUNK_BYTES, parallel_state=None) -> dict:
    """Convert hub folder `src` into a moetron checkpoint folder `dst` (`dst/step-00000000`,
    `dst/latest`). Under torch.distributed every rank converts its own shards of `parallel`'s
    layout (collective); in one process `parallel` is only validated and every tensor is written
    whole. Returns a summary (see `format_summary`)."""
    from moetron.parallel import ParallelState
    from moetron.parallel.config import ParallelConfig, validate_for_model
    from moetron.train import sharded_checkpoint as store

    start = time.perf_counter()
    rank, world = store._world()
    source = HFSource(src, dtype=dtype)
    cfg = source.cfg
    parallel = parallel or ParallelConfig()
    if world == 1:  # one process: validate the layout on the smallest world it fits
        p = parallel
        sizes = parallel.resolve(math.lcm(p.tp * p.cp * p.pp, p.etp * p.ep * p.pp))
    else:
        sizes = parallel.resolve(world)
    validate_for_model(parallel, num_attention_heads=cfg.num_attention_heads,
                       num_kv_heads=cfg.num_kv_heads if cfg.attention_type == "gqa" else None,
                       num_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                       ffn_hidden_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                       custom_pipeline_layout=True)
    ps = parallel_state if parallel_state is not None else (ParallelState.build(parallel) if world > 1 else None)
    local = layout_tensors(cfg, parallel, ps)
    plan = store.plan_writes(local, None)
    for name, info in plan.tensors.items():
        info["dtype"] = store.DTYPE_NAMES[source.dtype_of(name)]
    step_name = "step-00000000"
    total = sum(numel(local[n].tensor.shape) * source.dtype_of(n).itemsize for n in plan.model)
    bar = Progress(f"hf-to-moetron rank {rank}" if world > 1 else "hf-to-moetron", total, len(plan.model),
                   enabled=progress and rank == 0)

    def write(tmp: Path) -> dict:
        folder = tmp / step_name
        folder.mkdir(exist_ok=True)
        kw = {} if file_bytes is None else {"file_bytes": file_bytes}
        writer = store.RankWriter(folder, "model", rank, world, chunk_bytes=chunk_bytes, **kw)
        for name in plan.model:
            lt, out_dtype = local[name], source.dtype_of(name)
            for lo, go, box_sizes in lt.placement.pieces:
                writer.add_box(name, None, (go, box_sizes), lt.placement.global_shape, out_dtype,
                               lambda box, name=name, d=out_dtype: source.read(name, box[0], box[1], dtype=d))
        bar.total_tensors = sum(len(f) for f in writer.files)
        files = writer.write(bar)
        return {"files": files, "bytes": bar.bytes, "tensors": sum(len(f) for f in writer.files),
                "dequantized": sorted(source.dequantized)}

    def finish(tmp: Path, reports: list[dict]) -> None:
        layout = {"world_size": world, **{k: getattr(sizes, k) for k in ("tp", "cp", "dp", "pp", "ep", "etp")
                                          if hasattr(sizes, k)}}
        meta = {"format": store.FORMAT, "version": store.VERSION, "step": 0,
                "files": {"model": [f for r in reports for f in r["files"]], "optimizer": []},
                "tensors": plan.tensors, "optimizer": None, "layout": layout,
                "model_config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
                "hf_config": source.hf_config, "source": str(Path(src).resolve())}
        (tmp / step_name / store.META).write_text(json.dumps(meta, indent=1))
        (tmp / "latest").write_text(step_name)

    try:
        reports = store.commit_folder(dst, write, finish, overwrite=overwrite)
    finally:
        source.close()
    seconds = bar.close()
    return {"direction": "hf-to-moetron", "dst": str(dst), "tensors": sum(r["tensors"] for r in reports),
            "bytes": sum(r["bytes"] for r in reports), "files": [f for r in reports for f in r["files"]],
            "rank_bytes": [r["bytes"] for r in reports], "rank_tensors": [r["tensors"] for r in reports],
            "seconds": max(seconds, time.perf_counter() - start), "source_keys": len(source.hub.keys()),
            "dequantized": len(set().union(*(r["dequantized"] for r in reports))), "ranks": world,
            "layout": {k: getattr(sizes, k) for k in ("tp", "ep", "etp", "pp", "dp") if hasattr(sizes, k)}}


def load_hf_weights(src: str | os.PathLike, model, optimizer=None, *, parallel_state=None, modules=None) -> None:
    """Load a hub folder into a (possibly parallel) run's shards: `train.init_hf`. Each rank reads
    only its regions; the optimizer restarts (ZeRO-1 master weights follow the new parameters)."""
    from moetron.train.checkpoint import _adapter, load_model_tensors
    from moetron.train.sharded_checkpoint import local_tensors

    source = HFSource(src, mtp="auto")
    try:
        local = local_tensors(modules or [model], parallel_state)
        load_model_tensors(source, local, str(src))
        opt = _adapter(optimizer, local)
        if opt is not None:
            opt.load(None, None)
    finally:
        source.close()


# ---- moetron -> HF -------------------------------------------------------------------------------


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder (with meta.json), or a save_dir whose `latest` names one."""
    from moetron.train.checkpoint import latest_checkpoint
    from moetron.train.sharded_checkpoint import META

    path = Path(path)
    if (path / META).exists():
        return path
    if (path / "latest").exists():
        return latest_checkpoint(path)
    raise FileNotFoundError(f"{path}: not a moetron checkpoint (no {META}) nor a save_dir (no latest)")


def _model_config(meta: dict, where: Path) -> ModelConfig:
    cfg = meta.get("model_config") or (meta.get("recipe") or {}).get("model")
    if not cfg:
        raise CheckpointError(f"{where}/meta.json: no model_config (and no recipe) to build the model from")
    try:
        return ModelConfig(**cfg)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}/meta.json: model_config is not valid: {exc}") from None


def moetron_to_hf(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "keep",
                  max_shard_bytes: int = 5 * 1024**3, fused_experts: bool = False, overwrite: bool = False,
                  progress: bool = True, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Write a moetron checkpoint (saved under any layout) as a hub folder, streaming one tensor
    (chunk) at a time. `dtype`: keep, fp32, bf16, or fp8 (128x128 block-scaled projections,
    the rest bf16). Returns a summary."""
    from moetron.train.sharded_checkpoint import StoreReader, read_meta

    if dtype not in ("keep", "fp8") and dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r}: choose keep, fp32, bf16 or fp8")
    start = time.perf_counter()
    if Path(dst).exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; choose another path or allow overwriting (--overwrite)")
    folder = resolve_checkpoint(src)
    meta = read_meta(folder)
    cfg = _model_config(meta, folder)
    reader = StoreReader(folder, meta, ("model",))
    try:
        state = _meta_model(cfg).state_dict()
        shapes = {n: tuple(t.shape) for n, t in state.items()}
        missing = [n for n in shapes if n not in reader.names()]
        unexpected = sorted(reader.names() - set(shapes))
        misshaped = [f"{n}: checkpoint {list(reader.shape(n))}, model {list(s)}" for n, s in shapes.items()
                     if n in reader.names() and reader.shape(n) != s]
        if missing or unexpected or misshaped:
            lines = [f"{folder}: checkpoint does not match the {cfg.family} model of its meta.json"]
            for title, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
                if keys:
                    lines.append(f"  {len(keys)} {title} tensor(s): " + ", ".join(keys[:20]))
            raise CheckpointError("\n".join(lines))
        units = _export_units(cfg, list(shapes), shapes, reader, dtype, fused_experts, chunk_bytes)
        shards: list[list[Entry]] = [[]]
        size = 0
        for unit in units:
            nbytes = sum(e.nbytes for e in unit)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].extend(unit)
            size += nbytes
        total = sum(e.nbytes for s in shards for e in s)
        bar = Progress("moetron-to-hf", total, sum(len(s) for s in shards), enabled=progress)
        names = [SINGLE_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                         for i in range(len(shards))]
        with atomic_folder(dst, overwrite) as tmp:
            for name, entries in zip(names, shards):
                write_safetensors(tmp / name, entries, {"format": "pt"}, bar)
            if len(shards) > 1:
                index = {"metadata": {"total_size": total},
                         "weight_map": {e.key: name for name, entries in zip(names, shards) for e in entries}}
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
            (tmp / "config.json").write_text(json.dumps(_hf_config(cfg, meta, dtype, shards), indent=2))
        seconds = bar.close()
    finally:
        reader.close()
    quantized = sum(1 for s in shards for e in s if e.key.endswith(SCALE_SUFFIX))
    return {"direction": "moetron-to-hf", "dst": str(dst), "tensors": sum(len(s) for s in shards), "bytes": total,
            "files": names, "seconds": max(seconds, time.perf_counter() - start), "quantized": quantized,
            "source_keys": len(reader.names())}


def _export_units(cfg, order, shapes, reader, dtype: str, fused: bool, chunk_bytes: int) -> list[list[Entry]]:
    """Entries of the hub folder in groups that stay in one shard (an FP8 weight and its scale)."""
    units = []

    def out_dtype(name: str) -> torch.dtype:
        stored = DTYPES[reader.meta["tensors"][name]["dtype"]]
        if name.endswith("expert_bias"):
            return torch.float32 if dtype != "keep" else stored
        if dtype == "keep":
            return stored
        return torch.bfloat16 if dtype == "fp8" else DTYPE_CHOICES[dtype]

    def add(hub_key: str, name: str, box: Box, hub_shape: tuple[int, ...]) -> None:
        odt = out_dtype(name)
        if dtype == "fp8" and _quantizable(hub_key, torch.empty(hub_shape, device="meta")):
            units.append(_fp8_entries(hub_key, name, box, hub_shape, reader, chunk_bytes))
            return

        def produce(name=name, box=box, odt=odt):
            for sub in split_rows(box, odt.itemsize, chunk_bytes):
                yield reader.read(name, sub[0], sub[1], dtype=odt)
        units.append([Entry(hub_key, odt, hub_shape, produce)])

    for m in build_key_map(cfg, order, fused):
        parts = tensor_parts(m, shapes[m.target])
        if parts is None:  # assemble the tensor, split with the mapping's own function
            shape, odt = shapes[m.target], out_dtype(m.target)
            for i, (key, view) in enumerate(zip(m.sources, m.to_hf(torch.empty(shape, device="meta")))):
                def whole(m=m, i=i, shape=shape, odt=odt):
                    return m.to_hf(reader.read(m.target, (0,) * len(shape), shape, dtype=odt))[i].contiguous()
                units.append([Entry(key, odt, tuple(view.shape), whole)])
            continue
        for p in parts:
            add(p.key, m.target, p.box, p.hub_shape)
    for hub_key, own in mtp_shared_copies(cfg):
        add(hub_key, own, ((0,) * len(shapes[own]), shapes[own]), shapes[own])
    return units


def _fp8_entries(hub_key: str, name: str, box: Box, hub_shape, reader, chunk_bytes: int) -> list[Entry]:
    rows, cols = hub_shape
    block = 128
    per_chunk = max(block, (chunk_bytes // max(cols * 4, 1)) // block * block)
    k = len(box[0]) - 2
    scales: list[torch.Tensor] = []

    def produce_q():
        scales.clear()
        for r in range(0, rows, per_chunk):
            n = min(per_chunk, rows - r)
            offs = box[0][:k] + (box[0][k] + r, box[0][k + 1])
            sizes = (1,) * k + (n, cols)
            w = reader.read(name, offs, sizes, dtype=torch.float32).reshape(n, cols)
            q, s = quantize_blockwise(w)
            scales.append(s)
            yield q

    def produce_scale():  # right after produce_q; nothing is kept afterwards (a long-lived small
        out = torch.cat(scales) if scales else torch.empty(0, expected_scale_shape(hub_shape)[1])
        scales.clear()  # tensor between big ones would pin the malloc heap and grow the RSS)
        return out

    return [Entry(hub_key, torch.float8_e4m3fn, tuple(hub_shape), produce_q),
            Entry(hub_key + SCALE_SUFFIX, torch.float32, expected_scale_shape(hub_shape), produce_scale)]


def _hf_config(cfg: ModelConfig, meta: dict, dtype: str, shards) -> dict:
    base = dict(meta.get("hf_config") or {})
    base.update(config_to_hf(cfg))
    base.pop("quantization_config", None)
    if dtype == "fp8":
        base["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]}
        base["torch_dtype"] = "bfloat16"
    elif dtype == "keep":
        first = next((e for s in shards for e in s if len(e.shape) == 2), None)
        base["torch_dtype"] = str(first.dtype).removeprefix("torch.") if first else "float32"
    else:
        base["torch_dtype"] = str(DTYPE_CHOICES[dtype]).removeprefix("torch.")
    return base
