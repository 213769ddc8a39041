"""``lm eval_gsm8k``: exact-match accuracy of greedy GSM8K answers.

Its names are imported when first used (:mod:`qwen35_fs2._exports`): ``python
-m`` imports the package before its ``__main__``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen35_fs2._exports import lazy_exports

if TYPE_CHECKING:
    from qwen35_fs2.recipes.eval_gsm8k.config import EvalGsm8kConfig as EvalGsm8kConfig
    from qwen35_fs2.recipes.eval_gsm8k.recipe import EvalGsm8kRecipe as EvalGsm8kRecipe
    from qwen35_fs2.recipes.eval_gsm8k.recipe import Gsm8kEvalUnit as Gsm8kEvalUnit

__getattr__ = lazy_exports(
    __name__,
    {
        "EvalGsm8kConfig": "qwen35_fs2.recipes.eval_gsm8k.config",
        "EvalGsm8kRecipe": "qwen35_fs2.recipes.eval_gsm8k.recipe",
        "Gsm8kEvalUnit": "qwen35_fs2.recipes.eval_gsm8k.recipe",
    },
)
