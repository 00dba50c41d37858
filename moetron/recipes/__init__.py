"""Recipes: the shipped runs, as editable TOML files (recipes/*.toml).

    moetron recipes                      # list them
    moetron train --recipe qwen3-moe-tiny --set train.steps=20
"""

from __future__ import annotations

from moetron.config import Recipe, apply_overrides
from moetron.recipes.catalog import RECIPES, get_recipe

__all__ = ["RECIPES", "Recipe", "apply_overrides", "get_recipe"]
