"""Recipes: named Python functions that return a complete, validated training setup.

    moetron recipes                      # list them
    moetron train --recipe qwen3-moe-tiny --set train.steps=20
"""

from __future__ import annotations

from moetron.recipes.catalog import RECIPES, get_recipe
from moetron.recipes.recipe import Recipe, apply_overrides

__all__ = ["RECIPES", "Recipe", "apply_overrides", "get_recipe"]
