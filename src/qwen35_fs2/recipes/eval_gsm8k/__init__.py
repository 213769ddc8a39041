"""``lm eval_gsm8k``: exact-match accuracy of greedy GSM8K answers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen35_fs2._exports import lazy_exports

if TYPE_CHECKING:
    from qwen35_fs2.recipes.eval_gsm8k.config import EvalGsm8kConfig as EvalGsm8kConfig
    from qwen35_fs2.recipes.eval_gsm8k.recipe import EvalGsm8kRecipe as EvalGsm8kRecipe
    from qwen35_fs2.recipes.eval_gsm8k.recipe import Gsm8kEvalUnit as Gsm8kEvalUnit

# Imported when first used: `python -m` imports the package before its `__main__`.
__getattr__ = lazy_exports(
    __name__,
    {"config": ("EvalGsm8kConfig",), "recipe": ("EvalGsm8kRecipe", "Gsm8kEvalUnit")},
)
