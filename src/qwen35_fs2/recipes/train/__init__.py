"""``lm train``: continued pretraining on parquet text shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen35_fs2._exports import lazy_exports

if TYPE_CHECKING:
    from qwen35_fs2.recipes.train.config import ParquetTextSource as ParquetTextSource
    from qwen35_fs2.recipes.train.config import PretrainConfig as PretrainConfig
    from qwen35_fs2.recipes.train.config import PretrainDatasetSection as PretrainDatasetSection
    from qwen35_fs2.recipes.train.recipe import PretrainRecipe as PretrainRecipe

# Imported when first used: `python -m` imports the package before its `__main__`.
__getattr__ = lazy_exports(
    __name__,
    {"config": ("ParquetTextSource", "PretrainConfig", "PretrainDatasetSection"), "recipe": ("PretrainRecipe",)},
)
