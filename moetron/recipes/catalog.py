"""The recipes moetron ships, one TOML file each in `moetron/recipes/files/` (the repository's
top-level `recipes/` folder links to it): full-size DeepSeek-V3 and Qwen3-MoE, and tiny CPU
proxies. They are package data, so the names work after a plain `pip install`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from moetron.config import Recipe
from moetron.recipes.toml_io import load_recipe

FILES = Path(__file__).resolve().parent / "files"
ORDER = ("qwen3-moe-tiny", "deepseek-v3-tiny", "qwen3-moe-30b-a3b", "qwen3-moe-235b-a22b", "deepseek-v3-671b")
DEFAULT_RECIPE = "qwen3-moe-tiny"


def recipe_file(name: str) -> Path:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)} (see `moetron recipes`), "
                         f"or pass a file with --config FILE.toml")
    return FILES / f"{name}.toml"


def _shipped() -> dict[str, Callable[[], Recipe]]:
    names = sorted((p.stem for p in FILES.glob("*.toml")), key=lambda n: (ORDER.index(n) if n in ORDER else 99, n))
    return {n: functools.partial(load_recipe, FILES / f"{n}.toml") for n in names}


RECIPES: dict[str, Callable[[], Recipe]] = _shipped()


def get_recipe(name: str) -> Recipe:
    return load_recipe(recipe_file(name))
