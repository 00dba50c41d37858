"""Recipe: model + training + parallel layout, and `--set a.b=value` overrides."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from moetron.config import ModelConfig
from moetron.parallel.config import ParallelConfig
from moetron.train.config import TrainConfig


@dataclass
class Recipe:
    name: str
    description: str
    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def _coerce(text: str, current, path: str):
    """Parse `text` into the type of the field's current value (JSON for lists, dicts, None)."""
    if isinstance(current, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"--set {path}={text}: expected true or false")
    if isinstance(current, str):  # "none" is a valid string value (aux_loss_type=none); null unsets
        return None if text.lower() == "null" else text
    if text.lower() in ("none", "null"):
        return None
    if current is None:  # unset optional field: a JSON value if it parses, else the text itself
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    try:
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, str):
            return text
        return json.loads(text)
    except (ValueError, json.JSONDecodeError):
        kind = type(current).__name__ if current is not None else "JSON"
        raise ValueError(f"--set {path}={text}: expected a value of type {kind}") from None


ALIASES = {"init.hf": "train.init_hf", "export.hf": "train.export_hf"}  # spellings the docs use


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply `section.field=value` overrides; every section is re-validated afterwards."""
    sections = {"model": recipe.model, "train": recipe.train, "parallel": recipe.parallel}
    changes: dict[str, dict] = {name: {} for name in sections}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected section.field=value, e.g. train.steps=20")
        path, text = item.split("=", 1)
        path = ALIASES.get(path.strip(), path)
        section, _, name = path.strip().partition(".")
        if section not in sections:
            raise ValueError(f"--set {path}: unknown section {section!r}; use one of {sorted(sections)}")
        obj = sections[section]
        known = {f.name for f in dataclasses.fields(obj)}
        if name not in known:
            raise ValueError(f"--set {path}: {type(obj).__name__} has no field {name!r}; "
                             f"fields: {', '.join(sorted(known))}")
        changes[section][name] = _coerce(text.strip(), getattr(obj, name), path)
    return dataclasses.replace(recipe, **{s: dataclasses.replace(sections[s], **c) for s, c in changes.items()})
