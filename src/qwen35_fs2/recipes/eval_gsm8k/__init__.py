"""``lm eval_gsm8k``: exact-match accuracy of greedy GSM8K answers."""

from __future__ import annotations

from qwen35_fs2.recipes.eval_gsm8k.config import EvalGsm8kConfig as EvalGsm8kConfig
from qwen35_fs2.recipes.eval_gsm8k.recipe import EvalGsm8kRecipe as EvalGsm8kRecipe
from qwen35_fs2.recipes.eval_gsm8k.recipe import Gsm8kEvalUnit as Gsm8kEvalUnit
