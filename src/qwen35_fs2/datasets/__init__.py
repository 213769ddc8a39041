"""Data for training Qwen3.5 with fairseq2: the continued-pretraining reader
over parquet text shards (FineWeb-Edu), GSM8K files and synthetic corpora."""

from __future__ import annotations

from qwen35_fs2.datasets.packing import DocumentPacker as DocumentPacker
from qwen35_fs2.datasets.parquet import ParquetRowGroup as ParquetRowGroup
from qwen35_fs2.datasets.parquet import ParquetTextError as ParquetTextError
from qwen35_fs2.datasets.parquet import (
    index_parquet_row_groups as index_parquet_row_groups,
)
from qwen35_fs2.datasets.parquet import read_parquet_texts as read_parquet_texts
from qwen35_fs2.datasets.parquet import (
    resolve_parquet_files as resolve_parquet_files,
)
from qwen35_fs2.datasets.pretraining import PRETRAINING_DATASET as PRETRAINING_DATASET
from qwen35_fs2.datasets.pretraining import PretrainingDataset as PretrainingDataset
from qwen35_fs2.datasets.pretraining import (
    PretrainingDatasetConfig as PretrainingDatasetConfig,
)
from qwen35_fs2.datasets.pretraining import PretrainingReader as PretrainingReader
from qwen35_fs2.datasets.pretraining import (
    open_pretraining_dataset as open_pretraining_dataset,
)
