"""Shared fixtures of the data-layer tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from qwen35_datasets_testing import ByteTokenizer


@pytest.fixture
def byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="session")
def fineweb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic FineWeb-Edu corpus: 3 shards of 40 documents in row
    groups of 8 (15 row groups)."""
    from qwen35_fs2.datasets.synthetic import write_synthetic_fineweb

    out_dir = tmp_path_factory.mktemp("fineweb")

    write_synthetic_fineweb(out_dir, 3, 40, seed=7, rows_per_row_group=8)

    return out_dir
