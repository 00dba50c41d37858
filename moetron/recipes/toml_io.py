"""Recipes as TOML files: `load_recipe(path)` reads one (standard-library `tomllib`), `dump_recipe`
writes one. A file has `name`, `description` and the sections `[model]`, `[train]`, `[parallel]`,
one key per field of ModelConfig / TrainConfig / ParallelConfig; a field left out keeps its default.
TOML has no null: an unset optional field is simply absent (`dump_recipe(full=True)` shows it as a
comment). Errors name the file, the key and its line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from pathlib import Path

from moetron.config import ModelConfig, Recipe, TrainConfig
from moetron.parallel.config import ParallelConfig

SECTIONS = {"model": ModelConfig, "train": TrainConfig, "parallel": ParallelConfig}

__all__ = ["RecipeFileError", "dump_recipe", "load_recipe"]


class RecipeFileError(ValueError):
    """A recipe file that cannot be read: the message names the file, key and line."""


def _line_of(text: str, section: str | None, key: str) -> int | None:
    """The line of `key = ...` (inside `[section]` when given), for error messages."""
    current = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = re.fullmatch(r"\[\s*([\w.-]+)\s*\]", stripped)
        if header:
            current = header.group(1)
            if section is None and current == key:
                return number
        elif current == section and re.match(rf"{re.escape(key)}\s*=", stripped):
            return number
    return None


def _where(path: Path, text: str, section: str | None, key: str) -> str:
    line = _line_of(text, section, key)
    name = f"{section}.{key}" if section else key
    return f"{path}:{line}: {name}" if line else f"{path}: {name}"


def _check_type(value, default, field: dataclasses.Field):
    """TOML values against the field's type (its default's type, or its annotation when the
    default is None). Integers are accepted for floats; lists for tuples."""
    expected = type(default) if default is not None else None
    if expected is None:
        hint = str(field.type)
        kinds = {"int": int, "float": (int, float), "str": str, "bool": bool, "dict": dict, "list": list}
        allowed = tuple(t for name, t in kinds.items() if re.search(rf"\b{name}\b", hint))
        allowed = tuple(x for t in allowed for x in (t if isinstance(t, tuple) else (t,)))
        if allowed and not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"expected {hint.replace(' | None', '')}, got {type(value).__name__} {value!r}"
        return None
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected in (tuple, list):
        ok = isinstance(value, list)
    else:
        ok = isinstance(value, expected)
    return None if ok else f"expected {expected.__name__}, got {type(value).__name__} {value!r}"


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read a recipe file; every field is type-checked and each section validated as it is built."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecipeFileError(f"{path}: cannot read the recipe file ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeFileError(f"{path}: not valid TOML: {exc}") from None
    unknown = [k for k in data if k not in ("name", "description", *SECTIONS)]
    if unknown:
        raise RecipeFileError(f"{_where(path, text, None, unknown[0])}: unknown key; a recipe file has name, "
                              f"description and the sections [model], [train], [parallel]")
    if "model" not in data:
        raise RecipeFileError(f"{path}: no [model] section (family, vocab_size, hidden_size, ... are required)")
    for section, cls in SECTIONS.items():  # every key and type first, then build
        values = data.get(section, {})
        if not isinstance(values, dict):
            raise RecipeFileError(f"{_where(path, text, None, section)}: must be a [{section}] table")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        defaults = _defaults(cls)
        for key, value in values.items():
            if key not in fields:
                raise RecipeFileError(f"{_where(path, text, section, key)}: {cls.__name__} has no field {key!r}; "
                                      f"fields: {', '.join(sorted(fields))}")
            problem = _check_type(value, defaults.get(key), fields[key])
            if problem:
                raise RecipeFileError(f"{_where(path, text, section, key)}: {problem}")
    built = {}
    for section, cls in SECTIONS.items():
        values = dict(data.get(section, {}))
        defaults = _defaults(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in defaults and f.name not in values]
        if missing:
            raise RecipeFileError(f"{path}: [{section}] needs {', '.join(missing)}")
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        try:
            built[section] = cls(**values)
        except ValueError as exc:
            key = re.search(r"\.(\w+)=", str(exc))
            where = _where(path, text, section, key.group(1)) if key else f"{path}: [{section}]"
            raise RecipeFileError(f"{where}: {exc}") from None
    name = data.get("name", path.stem)
    return Recipe(str(name), str(data.get("description", "")), built["model"], built["train"], built["parallel"])


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")


def dump_recipe(recipe: Recipe, full: bool = False) -> str:
    """The recipe as TOML. `full=False` writes only fields that differ from their defaults (what
    the shipped files hold); `full=True` writes every field, unset ones as comments."""
    lines = [f"name = {_toml_value(recipe.name)}", f"description = {_toml_value(recipe.description)}"]
    for section, cls in SECTIONS.items():
        obj = getattr(recipe, section)
        defaults = _defaults(cls)
        lines += ["", f"[{section}]"]
        for f in dataclasses.fields(cls):
            value = getattr(obj, f.name)
            if not full and (f.name in defaults and value == defaults[f.name]
                             or section == "parallel" and f.name == "etp" and value == obj.tp):
                continue  # etp defaults to tp
            lines.append(f"# {f.name} = (unset)" if value is None else f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
