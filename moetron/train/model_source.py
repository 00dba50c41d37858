"""The checkpoint's config is the model: when a run starts from weights (`train.init_hf=DIR`, or
`train.resume` from a checkpoint, converted or trained), its model section comes from the
checkpoint, never from the recipe. `--set model.*` may change only training-time options (aux
loss, capacity, recompute...); a setting that would change what the weights mean (a shape, the
routing, RoPE) is a one-line error naming both values. The Hugging Face config.json the weights
came from is carried in every checkpoint, so that the export writes it back unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from moetron.bridge.hf_config import TRAINING_FIELDS, meaning_differences
from moetron.bridge.hub import HFSource
from moetron.checkpoint.sharded import read_meta
from moetron.checkpoint.training import latest_checkpoint
from moetron.config import ModelConfig, Recipe, apply_overrides

__all__ = ["ModelSource", "checkpoint_source", "resolve_model", "check_model_matches"]


@dataclass
class ModelSource:
    where: str  # the file the model was read from
    config: ModelConfig  # the model the weights were saved as
    hf_config: dict | None = None  # the Hugging Face config.json they came from, if any
    hf_model_config: ModelConfig | None = None  # `hf_config` as read (the base of the export's diff)

    def extra_meta(self) -> dict:
        """What a checkpoint of this run carries so that its export reproduces `hf_config`."""
        if self.hf_config is None:
            return {}
        base = self.hf_model_config or self.config
        return {"hf_config": self.hf_config, "hf_model_config": _plain(base)}


def _plain(cfg: ModelConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


def _config(data: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: model_config is not valid: {exc}") from None


def _resumed_folder(t) -> Path | None:
    """The checkpoint a resume would load (`train.resume_from`, or the newest in save_dir), if any;
    which one is verified by the trainer, here only its model section is read."""
    resume_from = getattr(t, "resume_from", None)
    if not t.save_dir or not (t.resume or resume_from):
        return None
    root = Path(t.save_dir)
    if resume_from:
        folder = root / resume_from
        return folder if (folder / "meta.json").exists() else None
    try:
        folder = latest_checkpoint(root)
    except FileNotFoundError:
        folder = None
    if folder is None and root.is_dir():  # no `latest`: the newest complete step folder
        steps = sorted(p for p in root.glob("step-*") if (p / "meta.json").exists())
        folder = steps[-1] if steps else None
    return folder


def checkpoint_source(recipe: Recipe) -> ModelSource | None:
    """Where the run's weights come from: the checkpoint `train.resume` continues (when one exists),
    else `train.init_hf`; None for a run from random weights."""
    t = recipe.train
    folder = _resumed_folder(t)
    if folder is not None:
        meta = read_meta(folder)
        where = str(Path(folder) / "meta.json")
        data = meta.get("model_config") or (meta.get("recipe") or {}).get("model")
        if not data:
            return None
        hf_model = meta.get("hf_model_config") or (data if meta.get("hf_config") else None)
        return ModelSource(where, _config(data, where), meta.get("hf_config"),
                           _config(hf_model, where) if hf_model else None)
    if t.init_hf:
        source = HFSource(t.init_hf, mtp="auto")  # checks every key and shape against config.json
        try:
            return ModelSource(str(Path(t.init_hf) / "config.json"), source.cfg, source.hf_config, source.cfg)
        finally:
            source.close()
    return None


def resolve_model(recipe: Recipe, model_sets: list[str]) -> Recipe:
    """`recipe` with its model section taken from the checkpoint it starts from (if any), and the
    `model.*` overrides applied on top; an override that changes the weights' meaning is an error."""
    source = checkpoint_source(recipe)
    if source is None:
        return apply_overrides(recipe, model_sets)
    base = dataclasses.replace(recipe, model=source.config)
    for item in model_sets:  # one at a time, so that the error names the --set at fault
        alone = apply_overrides(base, [item]).model
        diffs = meaning_differences(alone, source.config)
        field = item.split("=", 1)[0].strip().removeprefix("model.")
        if diffs and field not in TRAINING_FIELDS:
            key, theirs, ours = diffs[0]
            raise ValueError(f"--set {item.strip()} conflicts with the checkpoint: {source.where} has "
                             f"{key}={theirs!r} (this --set makes it {ours!r}), and {field} changes what the "
                             "weights mean; drop the --set (only training-time options such as "
                             "model.aux_loss_coeff, model.capacity_factor or model.recompute_modules may differ)")
    return apply_overrides(base, model_sets)


def check_model_matches(recipe: Recipe, source: ModelSource) -> None:
    """The API's check (train(recipe) called directly): the recipe's model must mean the same
    weights as the checkpoint's."""
    diffs = meaning_differences(recipe.model, source.config)
    if diffs:
        shown = ", ".join(f"{k}: checkpoint {theirs!r}, recipe {ours!r}" for k, theirs, ours in diffs[:4])
        more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
        raise ValueError(f"the recipe's model section differs from {source.where} in what the weights mean: "
                         f"{shown}{more}; take the model from the checkpoint (`moetron train --hf DIR`, or "
                         "moetron.train.model_source.resolve_model(recipe, []))")
