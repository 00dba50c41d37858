"""Training checkpoints: model, optimizer, step and RNG, saved atomically, resumed exactly.

Layout of `DIR/step-000100/`: `model.safetensors` (parameters and persistent buffers by
name), `optimizer.safetensors` (AdamW moments by parameter name), and `meta.json`
(step, learning-rate schedule position, optimizer hyper-parameters, RNG state, the
recipe). Tensors are keyed by parameter name, not position, so a later layout can
re-shard them. Nothing is pickled. A checkpoint is written to a temporary folder and
renamed when complete, and `latest` is updated last, so a crash never leaves a
half-written checkpoint that looks complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moetron.bridge.safetensors_io import atomic_folder

LATEST = "latest"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, recipe=None) -> Path:
    """Write the state after `step` completed optimizer steps; returns the checkpoint folder."""
    root = Path(root)
    names = {id(p): n for n, p in model.named_parameters()}
    optim_tensors, optim_scalars = {}, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                name = f"{names[id(p)]}.{key}"
                if torch.is_tensor(value):
                    optim_tensors[name] = value.detach().contiguous()
                else:
                    optim_scalars[name] = value
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    meta = {"step": step, "param_groups": groups, "optimizer_scalars": optim_scalars,
            "rng": {"torch": torch.get_rng_state().tolist()},
            "recipe": _recipe_json(recipe)}
    target = _step_dir(root, step)
    with atomic_folder(target, overwrite=True) as tmp:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        save_file(optim_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    tmp_latest = root / f".{LATEST}.tmp"
    tmp_latest.write_text(target.name)
    os.replace(tmp_latest, root / LATEST)
    return target


def _recipe_json(recipe) -> dict | None:
    if recipe is None:
        return None
    return json.loads(json.dumps(dataclasses.asdict(recipe), default=str))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    marker = Path(root) / LATEST
    if not marker.exists():
        return None
    folder = Path(root) / marker.read_text().strip()
    if not (folder / "meta.json").exists():
        raise FileNotFoundError(f"{marker} points at {folder}, which is not a complete checkpoint")
    return folder


def load_checkpoint(folder: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore model, optimizer and RNG from `folder`; returns the number of completed steps."""
    folder = Path(folder)
    for name in ("meta.json", "model.safetensors", "optimizer.safetensors"):
        if not (folder / name).exists():
            raise FileNotFoundError(f"{folder}: checkpoint is incomplete, {name} is missing")
    meta = json.loads((folder / "meta.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}/model.safetensors does not fit this model: missing {missing[:10]}, "
                         f"unexpected {unexpected[:10]}")
    if optimizer is not None:
        params = dict(model.named_parameters())
        tensors = load_file(str(folder / "optimizer.safetensors"))
        if len(meta["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"{folder}: saved {len(meta['param_groups'])} optimizer groups, "
                             f"this optimizer has {len(optimizer.param_groups)}")
        for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
            group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k != "params"})
        optimizer.state.clear()
        for key, value in list(tensors.items()) + list(meta["optimizer_scalars"].items()):
            name, _, slot = key.rpartition(".")
            if name not in params:
                raise ValueError(f"{folder}/optimizer.safetensors: {key!r} names no parameter of this model")
            optimizer.state.setdefault(params[name], {})[slot] = value
    torch.set_rng_state(torch.tensor(meta["rng"]["torch"], dtype=torch.uint8))
    return int(meta["step"])
