"""``lm instruction_finetune``: supervised fine-tuning in the Qwen3.5 chat
format."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen35_fs2._exports import lazy_exports

if TYPE_CHECKING:
    from qwen35_fs2.recipes.sft.config import InstructionFinetuneConfig as InstructionFinetuneConfig
    from qwen35_fs2.recipes.sft.config import SFTDatasetSection as SFTDatasetSection
    from qwen35_fs2.recipes.sft.recipe import InstructionFinetuneRecipe as InstructionFinetuneRecipe

# Imported when first used: `python -m` imports the package before its `__main__`.
__getattr__ = lazy_exports(
    __name__,
    {"config": ("InstructionFinetuneConfig", "SFTDatasetSection"), "recipe": ("InstructionFinetuneRecipe",)},
)
