"""``lm train``: continued pretraining on parquet text shards."""

from __future__ import annotations

from qwen35_fs2.recipes.train.config import ParquetTextSource as ParquetTextSource
from qwen35_fs2.recipes.train.config import PretrainConfig as PretrainConfig
from qwen35_fs2.recipes.train.config import (
    PretrainDatasetSection as PretrainDatasetSection,
)
from qwen35_fs2.recipes.train.recipe import PretrainRecipe as PretrainRecipe
