from __future__ import annotations

import math
import re
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from qwen35_fs2.datasets.synthetic import write_synthetic_fineweb

# The schema of `HuggingFaceFW/fineweb-edu` shards, written out here on purpose.
FINEWEB_EDU_COLUMNS = [
    ("text", pa.string()),
    ("id", pa.string()),
    ("dump", pa.string()),
    ("url", pa.string()),
    ("file_path", pa.string()),
    ("language", pa.string()),
    ("language_score", pa.float64()),
    ("token_count", pa.int64()),
    ("score", pa.float64()),
    ("int_score", pa.int64()),
]


class TestWriteSyntheticFineweb:
    def test_shards_have_the_fineweb_edu_layout_and_schema(self, tmp_path: Path) -> None:  # fmt: skip
        files = write_synthetic_fineweb(tmp_path, num_shards=3, docs_per_shard=50, seed=0, rows_per_row_group=16)  # fmt: skip

        assert files == [
            tmp_path.joinpath("sample", "10BT", f"{idx:03d}_00000.parquet") for idx in range(3)  # fmt: skip
        ]

        for file in files:
            parquet_file = pq.ParquetFile(file)

            assert parquet_file.schema_arrow == pa.schema(FINEWEB_EDU_COLUMNS)
            assert parquet_file.metadata.num_rows == 50
            assert parquet_file.metadata.num_row_groups == math.ceil(50 / 16)

    def test_rows_look_like_fineweb_edu_documents(self, tmp_path: Path) -> None:
        files = write_synthetic_fineweb(tmp_path, num_shards=2, docs_per_shard=200, seed=4)  # fmt: skip

        rows = [row for file in files for row in pq.read_table(file).to_pylist()]

        texts = [row["text"] for row in rows]

        assert all(isinstance(t, str) and t.strip() for t in texts)

        # Varied lengths: one-liners up to long articles.
        lengths = sorted(len(t) for t in texts)

        assert lengths[0] < 300
        assert lengths[-1] > 5000
        assert len(set(texts)) > 0.9 * len(texts)

        # English-like prose: sentences of lower-case words.
        words = re.findall(r"[A-Za-z]+", " ".join(texts))

        assert len(set(w.lower() for w in words)) > 100

        assert len({row["id"] for row in rows}) == len(rows)

        for row in rows:
            assert re.fullmatch(r"<urn:uuid:[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}>", row["id"])  # fmt: skip
            assert re.fullmatch(r"CC-MAIN-\d{4}-\d{2}", row["dump"])
            assert row["url"].startswith("https://")
            assert row["file_path"].startswith("s3://commoncrawl/crawl-data/" + row["dump"])  # fmt: skip
            assert row["language"] == "en"
            assert 0.0 <= row["language_score"] <= 1.0
            assert 2.5 <= row["score"] <= 5.0
            assert row["int_score"] == round(row["score"])
            assert row["token_count"] >= len(row["text"].split())

    def test_shards_are_deterministic_in_their_seed(self, tmp_path: Path) -> None:
        def texts(out_dir: Path, seed: int) -> list[str]:
            files = write_synthetic_fineweb(out_dir, num_shards=1, docs_per_shard=20, seed=seed)  # fmt: skip

            column: list[str] = pq.read_table(files[0]).column("text").to_pylist()

            return column

        assert texts(tmp_path.joinpath("a"), 1) == texts(tmp_path.joinpath("b"), 1)
        assert texts(tmp_path.joinpath("a"), 1) != texts(tmp_path.joinpath("c"), 2)

    @pytest.mark.parametrize(
        "kwargs", [{"num_shards": 0}, {"docs_per_shard": 0}, {"rows_per_row_group": 0}]
    )
    def test_sizes_must_be_positive(self, tmp_path: Path, kwargs: dict[str, int]) -> None:  # fmt: skip
        arguments = {"num_shards": 1, "docs_per_shard": 1, "seed": 0, "rows_per_row_group": 1} | kwargs  # fmt: skip

        with pytest.raises(ValueError, match="must be greater than or equal to 1, but is 0 instead"):  # fmt: skip
            write_synthetic_fineweb(tmp_path, **arguments)
