"""Hugging Face checkpoints in and out, in one process.

    model = from_hf("path/to/Qwen3-30B-A3B")      # config.json + safetensors
    to_hf(model, "out/")                            # loadable by transformers

Every key is accounted for: a missing, unexpected or mis-shaped key is reported,
all of them in one error. Output is written to a temporary folder and renamed
only when complete.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from moetron.bridge.hf_config import config_from_hf, config_to_hf
from moetron.bridge.keys import build_key_map, mtp_shared_copies
from moetron.checkpoint.safetensors_io import CheckpointError, CheckpointReader, ShardWriter, atomic_folder
from moetron.model.model import MoETransformer
from moetron.precision.blockwise import dequantize_blockwise, quantize_blockwise

SCALE_SUFFIX = "_scale_inv"
log = logging.getLogger(__name__)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def _fp8_block(hf: dict) -> tuple[int, int]:
    quant = hf.get("quantization_config") or {}
    return tuple(quant.get("weight_block_size") or (128, 128))


def _fused_layout(reader: CheckpointReader) -> bool:
    return any(k.endswith("mlp.experts.gate_up_proj") for k in reader.keys())


def _has_mtp_weights(reader: CheckpointReader, num_layers: int) -> bool:
    return any(k.startswith(f"model.layers.{num_layers}.") for k in reader.keys())


def from_hf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, mtp: str = "auto",
            **config_overrides) -> MoETransformer:
    """Build a model from a hub folder; per-expert or fused experts; FP8 weights dequantized.

    `mtp`: "auto" loads the MTP layers when the checkpoint has them and builds the
    model without MTP (with a warning) when it has none, as transformers saves
    DeepSeek-V3; "require" makes their absence an error.
    """
    if mtp not in ("auto", "require"):
        raise ValueError(f"mtp={mtp!r}: choose 'auto' or 'require'")
    folder = Path(path)
    hf = _read_config(folder)
    cfg = config_from_hf(hf, str(folder / "config.json"), **config_overrides)
    reader = CheckpointReader(folder)
    if cfg.num_mtp_layers and mtp == "auto" and not _has_mtp_weights(reader, cfg.num_layers):
        log.warning("%s: config asks for %d MTP layer(s) but the checkpoint has none; building without MTP",
                    folder, cfg.num_mtp_layers)
        cfg = cfg.replace(num_mtp_layers=0)
    model = MoETransformer(cfg)
    state = model.state_dict()
    mappings = build_key_map(cfg, list(state), _fused_layout(reader))
    block = _fp8_block(hf)
    available = reader.keys()
    consumed: set[str] = set()
    missing, misshaped = [], []

    def load(key: str) -> torch.Tensor:
        tensor = reader.get(key)
        consumed.add(key)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_key = key + SCALE_SUFFIX
            if scale_key not in available:
                raise CheckpointError(f"{reader.file_of[key]}: FP8 key {key!r} has no {scale_key!r}")
            consumed.add(scale_key)
            try:
                tensor = dequantize_blockwise(tensor, reader.get(scale_key), block)
            except ValueError as exc:
                raise CheckpointError(f"{reader.file_of[scale_key]}: {scale_key!r}: {exc}") from None
        return tensor

    new_state = {}
    for m in mappings:
        absent = [s for s in m.sources if s not in available]
        if absent:
            missing += absent
            consumed.update(s for s in m.sources if s in available)
            continue
        expected = [tuple(t.shape) for t in m.to_hf(torch.empty(state[m.target].shape, device="meta"))]
        wrong = [f"{s}: checkpoint {tuple(reader.shape(s))}, model {e}" for s, e in zip(m.sources, expected)
                 if tuple(reader.shape(s)) != e]
        if wrong:
            misshaped += wrong
            consumed.update(m.sources)
            continue
        tensor = m.to_moetron([load(s) for s in m.sources])
        if tuple(tensor.shape) != tuple(state[m.target].shape):
            misshaped.append(f"{m.target} (from {m.sources[0]}...): checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(state[m.target].shape)}")
            continue
        new_state[m.target] = tensor
    for hub_key, own_key in mtp_shared_copies(cfg):
        if hub_key in available and own_key in new_state:
            if not torch.equal(load(hub_key).to(dtype), new_state[own_key]):
                misshaped.append(f"{hub_key}: differs from {own_key}, which moetron shares with MTP")
    unexpected = sorted(available - consumed)
    if missing or unexpected or misshaped:
        lines = [f"{folder}: checkpoint does not match the {cfg.family} model built from config.json"]
        for title, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if keys:
                lines.append(f"  {len(keys)} {title} key(s): " + ", ".join(keys[:20]) + (" ..." if len(keys) > 20 else ""))
        raise CheckpointError("\n".join(lines))
    model.load_state_dict(new_state, strict=True)
    return model.to(dtype)  # the router keeps its expert bias in fp32


def to_hf(model: MoETransformer, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
          fp8: bool = False, max_shard_bytes: int = 2 * 1024**3, fused_experts: bool = False,
          overwrite: bool = False) -> Path:
    """Write `config.json` and hub-layout safetensors (sharded with an index when large).

    `fp8=True` re-quantizes 2-D projection weights to E4M3 with 128×128 block scales
    (norms, router, embeddings and the output head stay in `dtype`).
    """
    cfg = model.config
    state = model.state_dict()
    hf_config = config_to_hf(cfg)
    if dtype is not None:
        hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if fp8:
        hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}
    with atomic_folder(path, overwrite) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for m in build_key_map(cfg, list(state), fused_experts):
            tensor = state[m.target]
            if dtype is not None and not m.target.endswith("expert_bias"):
                tensor = tensor.to(dtype)
            for hub_key, part in zip(m.sources, m.to_hf(tensor)):
                if fp8 and _quantizable(hub_key, part):
                    q, scale = quantize_blockwise(part)
                    writer.add(hub_key, q)
                    writer.add(hub_key + SCALE_SUFFIX, scale)
                else:
                    writer.add(hub_key, part)
        for hub_key, own_key in mtp_shared_copies(cfg):
            writer.add(hub_key, (state[own_key] if dtype is None else state[own_key].to(dtype)).clone())
        writer.close()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    return Path(path)


def _quantizable(key: str, t: torch.Tensor) -> bool:
    skip = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.weight")
    return t.dim() == 2 and not any(s in key for s in skip)
