"""Data for training Qwen3.5 with fairseq2: the continued-pretraining reader
over parquet text shards (FineWeb-Edu), GSM8K files and synthetic corpora."""

from __future__ import annotations

from qwen35_fs2.datasets.gsm8k import GSM8K_PROMPT_TEMPLATE as GSM8K_PROMPT_TEMPLATE
from qwen35_fs2.datasets.gsm8k import Gsm8kExample as Gsm8kExample
from qwen35_fs2.datasets.gsm8k import (
    convert_gsm8k_to_sft_jsonl as convert_gsm8k_to_sft_jsonl,
)
from qwen35_fs2.datasets.gsm8k import extract_gsm8k_answer as extract_gsm8k_answer
from qwen35_fs2.datasets.gsm8k import gsm8k_split_path as gsm8k_split_path
from qwen35_fs2.datasets.gsm8k import read_gsm8k_parquet as read_gsm8k_parquet
from qwen35_fs2.datasets.gsm8k import write_gsm8k_parquet as write_gsm8k_parquet
from qwen35_fs2.datasets.gsm8k import write_sft_jsonl as write_sft_jsonl
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
from qwen35_fs2.datasets.synthetic import (
    generate_synthetic_gsm8k as generate_synthetic_gsm8k,
)
from qwen35_fs2.datasets.synthetic import (
    write_synthetic_fineweb as write_synthetic_fineweb,
)
from qwen35_fs2.datasets.synthetic import (
    write_synthetic_gsm8k as write_synthetic_gsm8k,
)
