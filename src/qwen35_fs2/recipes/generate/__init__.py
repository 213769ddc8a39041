"""``lm generate``: chat responses to the prompts of a file.

Its names are imported when first used (:mod:`qwen35_fs2._exports`): ``python
-m`` imports the package before its ``__main__``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen35_fs2._exports import lazy_exports

if TYPE_CHECKING:
    from qwen35_fs2.recipes.generate.config import GenerateConfig as GenerateConfig
    from qwen35_fs2.recipes.generate.recipe import GenerateRecipe as GenerateRecipe
    from qwen35_fs2.recipes.generate.recipe import GenerateUnit as GenerateUnit

__getattr__ = lazy_exports(
    __name__,
    {
        "GenerateConfig": "qwen35_fs2.recipes.generate.config",
        "GenerateRecipe": "qwen35_fs2.recipes.generate.recipe",
        "GenerateUnit": "qwen35_fs2.recipes.generate.recipe",
    },
)
