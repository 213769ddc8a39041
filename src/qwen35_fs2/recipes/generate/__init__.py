"""``lm generate``: chat responses to the prompts of a file."""

from __future__ import annotations

from qwen35_fs2.recipes.generate.config import GenerateConfig as GenerateConfig
from qwen35_fs2.recipes.generate.recipe import GenerateRecipe as GenerateRecipe
from qwen35_fs2.recipes.generate.recipe import GenerateUnit as GenerateUnit
