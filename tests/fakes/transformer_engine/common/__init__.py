"""transformer_engine.common (fake): the recipe module only."""

from transformer_engine.common import recipe  # noqa: F401
