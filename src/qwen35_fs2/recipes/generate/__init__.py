"""``lm generate``: chat responses to the prompts of a file."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen35_fs2._exports import lazy_exports

if TYPE_CHECKING:
    from qwen35_fs2.recipes.generate.config import GenerateConfig as GenerateConfig
    from qwen35_fs2.recipes.generate.recipe import GenerateRecipe as GenerateRecipe
    from qwen35_fs2.recipes.generate.recipe import GenerateUnit as GenerateUnit

# Imported when first used: `python -m` imports the package before its `__main__`.
__getattr__ = lazy_exports(
    __name__,
    {"config": ("GenerateConfig",), "recipe": ("GenerateRecipe", "GenerateUnit")},
)
