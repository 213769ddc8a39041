"""``lm instruction_finetune``: supervised fine-tuning in the Qwen3.5 chat
format."""

from __future__ import annotations

from qwen35_fs2.recipes.sft.config import (
    InstructionFinetuneConfig as InstructionFinetuneConfig,
)
from qwen35_fs2.recipes.sft.config import SFTDatasetSection as SFTDatasetSection
from qwen35_fs2.recipes.sft.recipe import (
    InstructionFinetuneRecipe as InstructionFinetuneRecipe,
)
