"""Hugging Face <-> moetron checkpoints at scale: sharded, streaming, FP8-aware.

    moetron convert hf-to-moetron SRC DST [--tp N --ep N --pp N ...]   # also under torchrun
    moetron convert moetron-to-hf SRC DST [--dtype keep|fp32|bf16|fp8]

    hf_to_moetron(src, dst, parallel=ParallelConfig(ep=2, pp=2))       # collective under torchrun
    moetron_to_hf(src, dst, dtype="fp8")                                # one process, streaming
    load_hf_weights(src, model, optimizer, parallel_state=ps, modules=stages)   # train.init_hf

Every rank reads only the regions of its own shards (the hub side: bridge/hub.py); export
streams one tensor chunk at a time; errors name the file and key; output appears only when
complete. How it works: docs/conversion.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from moetron.bridge.hub import DTYPE_CHOICES, HFSource, meta_model, tensor_parts
from moetron.bridge.hf import SCALE_SUFFIX, _quantizable
from moetron.bridge.hf_config import config_to_hf, export_config, set_dtype
from moetron.bridge.keys import build_key_map, mtp_shared_copies
from moetron.checkpoint.safetensors_io import INDEX_NAME, SINGLE_NAME, CheckpointError, atomic_folder
from moetron.checkpoint.slices import (DTYPES, Box, Entry, numel,
                                   split_rows, write_safetensors)
from moetron.checkpoint import sharded as store
from moetron.checkpoint.sharded import META, StoreReader, local_tensors
from moetron.checkpoint.training import _adapter, latest_checkpoint, load_model_tensors
from moetron.checkpoint.commit import write_durably
from moetron.checkpoint.verify import finite_or_raise, seal_meta, verify_checkpoint
from moetron.config import ModelConfig
from moetron.model.parallelize import parallelize
from moetron.parallel import ParallelState
from moetron.parallel.config import ParallelConfig, validate_for_model
from moetron.pipeline.stage import pipeline_stages
from moetron.progress import ProgressBar
from moetron.precision.blockwise import expected_scale_shape, quantize_blockwise

log = logging.getLogger(__name__)
CHUNK_BYTES = 256 * 1024**2


# ---- progress and summary ----------------------------------------------------------------------


class _Transfer:
    """Bytes and tensors moved, drawn on the shared progress bar (a plain line every 10 s off a TTY)."""

    def __init__(self, label: str, total_bytes: int, total_tensors: int, enabled: bool):
        self.bar = ProgressBar(total_bytes, unit="GB", scale=1e9, label=label, enabled=enabled, plain_every=10.0)
        self.bytes = self.tensors = 0
        self.total_tensors = total_tensors
        self.start = time.perf_counter()

    def __call__(self, nbytes: int, tensor_done: bool) -> None:
        self.bytes += nbytes
        self.tensors += tensor_done
        rate = self.tensors / max(time.perf_counter() - self.start, 1e-9)
        self.bar.update(self.bytes, postfix=f"{self.tensors}/{self.total_tensors} tensors  {rate:.0f} tensors/s")

    def close(self) -> float:
        return self.bar.close()


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
    if s.get("config_changes"):
        lines.append("  config.json differs from the source's in: " + "; ".join(s["config_changes"]))
    return "\n".join(lines)


# ---- this rank's tensors under a layout, without building the model ---------------------------


def layout_tensors(cfg: ModelConfig, parallel=None, parallel_state=None, seq_len: int = 4096) -> dict:
    """This rank's LocalTensors (on the meta device) under `parallel` (a ParallelConfig): the same
    `parallelize` and `pipeline_stages` as the trainer, without allocating a weight. `seq_len`
    only steers the default pipeline layout (the checkpoint itself is layout-independent)."""
    ps = parallel_state
    model = meta_model(cfg)
    if ps is None or ps.world_size == 1:
        return local_tensors([model], ps)
    with torch.device("meta"):
        parallelize(model, ps, parallel)
    modules = [model]
    if ps.pp.size > 1:
        _, _, modules = pipeline_stages(model, ps, parallel, microbatches=4 * parallel.pp, seq_len=seq_len)
    return local_tensors(modules, ps)


# ---- HF -> moetron -------------------------------------------------------------------------------------


def hf_to_moetron(src: str | os.PathLike, dst: str | os.PathLike, *, parallel=None, dtype: str = "keep",
                  overwrite: bool = False, progress: bool = True, file_bytes: int | None = None,
                  chunk_bytes: int = CHUNK_BYTES, parallel_state=None, allow_nonfinite: bool = False) -> dict:
    """Convert hub folder `src` into a moetron checkpoint folder `dst` (`dst/step-00000000`,
    `dst/latest`). Under torch.distributed every rank converts its own shards of `parallel`'s
    layout (collective); in one process `parallel` is only validated and every tensor is written
    whole. A NaN/inf weight is refused unless `allow_nonfinite`. Returns a summary (see `format_summary`)."""

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
    bar = _Transfer(f"hf-to-moetron rank {rank}" if world > 1 else "hf-to-moetron", total, len(plan.model),
                    progress and rank == 0)

    def write(tmp: Path) -> dict:
        folder = tmp / step_name
        folder.mkdir(exist_ok=True)
        kw = {} if file_bytes is None else {"file_bytes": file_bytes}
        writer = store.RankWriter(folder, "model", rank, world, chunk_bytes=chunk_bytes, **kw)
        for name in plan.model:
            lt, out_dtype = local[name], source.dtype_of(name)
            for lo, go, box_sizes in lt.placement.pieces:
                writer.add_box(name, None, (go, box_sizes), lt.placement.global_shape, out_dtype,
                               lambda box, name=name, d=out_dtype: finite_or_raise(
                                   source.read(name, box[0], box[1], dtype=d), name, src, allow_nonfinite))
        bar.total_tensors = sum(len(f) for f in writer.files)
        files = writer.write(bar)
        return {"files": files, "bytes": bar.bytes, "tensors": sum(len(f) for f in writer.files),
                "dequantized": sorted(source.dequantized), "checksums": writer.digests}

    def finish(tmp: Path, reports: list[dict]) -> None:
        layout = {"world_size": world, **{k: getattr(sizes, k) for k in ("tp", "cp", "dp", "pp", "ep", "etp")
                                          if hasattr(sizes, k)}}
        meta = {"format": store.FORMAT, "version": store.VERSION, "step": 0,
                "files": {"model": [f for r in reports for f in r["files"]], "optimizer": []},
                "tensors": plan.tensors, "optimizer": None, "layout": layout,
                "model_config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
                "hf_config": source.hf_config, "source": str(Path(src).resolve()),
                "checksums": {n: d for r in reports for n, d in r["checksums"].items()}}
        write_durably(tmp / step_name / store.META, seal_meta(meta))
        write_durably(tmp / "latest", step_name)

    try:
        reports = store.commit_folder(dst, write, finish, overwrite=overwrite, what=f"converting {src}")
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

    if dtype not in ("keep", "fp8") and dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r}: choose keep, fp32, bf16 or fp8")
    start = time.perf_counter()
    if Path(dst).exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; choose another path or allow overwriting (--overwrite)")
    folder = resolve_checkpoint(src)
    meta = verify_checkpoint(folder, collective=False)  # checksums; NaN/inf tensors are refused while read
    cfg = _model_config(meta, folder)
    reader = StoreReader(folder, meta, ("model",))
    reader.finite_only = True
    try:
        state = meta_model(cfg).state_dict()
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
        bar = _Transfer("moetron-to-hf", total, sum(len(s) for s in shards), progress)
        names = [SINGLE_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                         for i in range(len(shards))]
        with atomic_folder(dst, overwrite) as tmp:
            for name, entries in zip(names, shards):
                write_safetensors(tmp / name, entries, {"format": "pt"}, bar)
            if len(shards) > 1:
                index = {"metadata": {"total_size": total},
                         "weight_map": {e.key: name for name, entries in zip(names, shards) for e in entries}}
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
            config_changes: list[str] = []
            hf_config = _hf_config(cfg, meta, dtype, shards, config_changes)
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        seconds = bar.close()
    finally:
        reader.close()
    quantized = sum(1 for s in shards for e in s if e.key.endswith(SCALE_SUFFIX))
    return {"direction": "moetron-to-hf", "dst": str(dst), "tensors": sum(len(s) for s in shards), "bytes": total,
            "files": names, "seconds": max(seconds, time.perf_counter() - start), "quantized": quantized,
            "source_keys": len(reader.names()), "config_changes": config_changes}


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


def _hf_config(cfg: ModelConfig, meta: dict, dtype: str, shards, changes: list[str] | None = None) -> dict:
    """The source's config.json when the checkpoint came from one (meta `hf_config`), with only what
    training changed on purpose updated (listed in `changes`); else one made from `cfg`."""
    changes = [] if changes is None else changes
    source = meta.get("hf_config")
    if source:
        loaded = _model_config({"model_config": meta.get("hf_model_config") or meta.get("model_config")}, "")
        base, found = export_config(source, loaded, cfg)
        changes += found
    else:
        base = config_to_hf(cfg)
    if base.pop("quantization_config", None) is not None and dtype != "fp8":
        changes.append("quantization_config: removed (the weights are written dequantized)")
    if dtype == "fp8":
        base["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]}
        name = "bfloat16"
    elif dtype == "keep":
        first = next((e for s in shards for e in s if len(e.shape) == 2), None)
        name = str(first.dtype).removeprefix("torch.") if first else "float32"
    else:
        name = str(DTYPE_CHOICES[dtype]).removeprefix("torch.")
    set_dtype(base, name, changes)
    return base
