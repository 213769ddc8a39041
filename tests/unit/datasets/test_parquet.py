from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from qwen35_fs2.datasets.parquet import (
    ParquetRowGroup,
    ParquetTextError,
    index_parquet_row_groups,
    read_parquet_texts,
    resolve_parquet_files,
)


def _write(path: Path, table: pa.Table, **kwargs: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)

    pq.write_table(table, path, **kwargs)

    return path


class TestResolveParquetFiles:
    def test_directories_are_searched_recursively_in_path_order(
        self, tmp_path: Path
    ) -> None:
        table = pa.table({"text": ["a"]})

        b = _write(tmp_path.joinpath("sample", "10BT", "001_00000.parquet"), table)
        a = _write(tmp_path.joinpath("sample", "10BT", "000_00000.parquet"), table)
        c = _write(tmp_path.joinpath("z", "000.parquet"), table)

        tmp_path.joinpath("sample", "README.md").write_text("not a shard")

        assert resolve_parquet_files([tmp_path]) == [a, b, c]

    def test_files_and_directories_keep_the_given_order(self, tmp_path: Path) -> None:
        table = pa.table({"text": ["a"]})

        a = _write(tmp_path.joinpath("d", "a.parquet"), table)
        b = _write(tmp_path.joinpath("b.parquet"), table)

        assert resolve_parquet_files([str(b), tmp_path.joinpath("d")]) == [b, a]

    def test_missing_path_raises_error(self, tmp_path: Path) -> None:
        missing = tmp_path.joinpath("missing")

        with pytest.raises(FileNotFoundError, match=rf"but {missing} does not exist"):  # fmt: skip
            resolve_parquet_files([missing])

    def test_directory_without_parquet_files_raises_error(self, tmp_path: Path) -> None:
        tmp_path.joinpath("a.jsonl").write_text("{}")

        with pytest.raises(FileNotFoundError, match="must contain at least one \\*.parquet file"):  # fmt: skip
            resolve_parquet_files([tmp_path])

    def test_directory_of_two_splits_raises_error(self, tmp_path: Path) -> None:
        table = pa.table({"text": ["a"]})

        _write(tmp_path.joinpath("train", "000.parquet"), table)
        _write(tmp_path.joinpath("test", "000.parquet"), table)

        message = rf"A directory source must hold the files of one split, but {tmp_path} holds test \(test/000.parquet\), train \(train/000.parquet\) instead\. Name the split's directory or files\."

        with pytest.raises(ValueError, match=message):
            resolve_parquet_files([tmp_path])

        assert resolve_parquet_files([tmp_path.joinpath("train")]) == [tmp_path.joinpath("train", "000.parquet")]

    def test_file_listed_twice_raises_error(self, tmp_path: Path) -> None:
        a = _write(tmp_path.joinpath("a.parquet"), pa.table({"text": ["a"]}))

        with pytest.raises(ValueError, match="is listed more than once"):
            resolve_parquet_files([a, tmp_path])

    def test_empty_sources_raise_error(self) -> None:
        with pytest.raises(ValueError, match="`sources` must contain at least one"):
            resolve_parquet_files([])

    def test_hg_uri_downloads_the_allowed_files_of_the_dataset_repository(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        snapshot = tmp_path.joinpath("snapshot")

        table = pa.table({"text": ["a"]})

        shard = _write(snapshot.joinpath("sample", "10BT", "000_00000.parquet"), table)

        # An earlier download of another config is in the same snapshot.
        _write(snapshot.joinpath("sample", "100BT", "000_00000.parquet"), table)

        calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

        def snapshot_download(*args: object, **kwargs: object) -> str:
            calls.append((args, kwargs))

            return str(snapshot)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

        files = resolve_parquet_files(
            ["hg://HuggingFaceFW/fineweb-edu"],
            hf_allow_patterns=["sample/10BT/*.parquet"],
        )

        assert files == [shard]

        assert calls == [
            (
                ("HuggingFaceFW/fineweb-edu",),
                {"repo_type": "dataset", "allow_patterns": ["sample/10BT/*.parquet"], "local_files_only": False},  # fmt: skip
            )
        ]

    def test_hg_uri_without_matching_files_raises_error(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(tmp_path))  # fmt: skip

        with pytest.raises(FileNotFoundError, match=r"hg://org/data must have parquet files matching \['x/\*.parquet'\]"):  # fmt: skip
            resolve_parquet_files(["hg://org/data"], hf_allow_patterns=["x/*.parquet"])

    def test_hg_uri_without_allow_patterns_raises_error(self) -> None:
        with pytest.raises(ValueError, match="`hf_allow_patterns` must name the files to read from hg://HuggingFaceFW/fineweb-edu, but is empty instead"):  # fmt: skip
            resolve_parquet_files(["hg://HuggingFaceFW/fineweb-edu"])

    def test_malformed_hg_uri_raises_error(self) -> None:
        with pytest.raises(ValueError, match="must have the form hg://org/dataset"):
            resolve_parquet_files(["hg://fineweb-edu"])


class TestIndexParquetRowGroups:
    def test_index_lists_non_empty_row_groups_with_their_first_rows(
        self, tmp_path: Path
    ) -> None:
        a = _write(tmp_path.joinpath("a.parquet"), pa.table({"text": ["x"] * 5, "n": list(range(5))}), row_group_size=2)  # fmt: skip
        b = _write(tmp_path.joinpath("b.parquet"), pa.table({"n": [1, 2, 3], "text": ["yy", "z", ""]}))  # fmt: skip

        row_groups = index_parquet_row_groups([a, b])

        assert [
            (rg.file, rg.index, rg.first_row, rg.num_rows) for rg in row_groups
        ] == [
            (a, 0, 0, 2),
            (a, 1, 2, 2),
            (a, 2, 4, 1),
            (b, 0, 0, 3),
        ]

        assert all(rg.num_bytes > 0 for rg in row_groups)

    def test_empty_shard_raises_error(self, tmp_path: Path) -> None:
        empty = _write(tmp_path.joinpath("empty.parquet"), pa.table({"text": pa.array([], pa.string())}))  # fmt: skip

        with pytest.raises(ParquetTextError, match=rf"{empty} must have at least one row, but is empty"):  # fmt: skip
            index_parquet_row_groups([empty])

    def test_missing_text_column_raises_error_naming_the_file(self, tmp_path: Path) -> None:  # fmt: skip
        file = _write(tmp_path.joinpath("a.parquet"), pa.table({"content": ["a"], "id": ["1"]}))  # fmt: skip

        with pytest.raises(ParquetTextError, match=rf"{file} must have a `text` column, but has only \['content', 'id'\] instead"):  # fmt: skip
            index_parquet_row_groups([file])

    def test_non_string_text_column_raises_error(self, tmp_path: Path) -> None:
        file = _write(tmp_path.joinpath("a.parquet"), pa.table({"text": [1, 2]}))

        with pytest.raises(ParquetTextError, match=rf"The `text` column of {file} must be of type string, but is of type int64 instead"):  # fmt: skip
            index_parquet_row_groups([file])

    def test_other_text_column_can_be_named(self, tmp_path: Path) -> None:
        file = _write(tmp_path.joinpath("a.parquet"), pa.table({"content": ["a", "b"]}))  # fmt: skip

        row_groups = index_parquet_row_groups([file], text_column="content")

        assert read_parquet_texts(row_groups[0], text_column="content") == ["a", "b"]

    def test_non_parquet_file_raises_error(self, tmp_path: Path) -> None:
        file = tmp_path.joinpath("a.parquet")

        file.write_text("not parquet")

        with pytest.raises(ParquetTextError, match=rf"{file} must be a parquet file, but is not"):  # fmt: skip
            index_parquet_row_groups([file])


class TestReadParquetTexts:
    def test_reads_only_the_given_row_group(self, tmp_path: Path) -> None:
        file = _write(tmp_path.joinpath("a.parquet"), pa.table({"text": ["a", "b", "c", "d", "e"]}), row_group_size=2)  # fmt: skip

        row_groups = index_parquet_row_groups([file])

        assert [read_parquet_texts(rg) for rg in row_groups] == [["a", "b"], ["c", "d"], ["e"]]  # fmt: skip

    def test_null_text_raises_error_naming_file_and_row(self, tmp_path: Path) -> None:
        file = _write(tmp_path.joinpath("a.parquet"), pa.table({"text": ["a", "b", "c", None]}), row_group_size=2)  # fmt: skip

        row_group = index_parquet_row_groups([file])[1]

        with pytest.raises(ParquetTextError, match=rf"Row 3 of {file} \(row group 1\) must have a string `text`, but has None instead"):  # fmt: skip
            read_parquet_texts(row_group)

    def test_modified_file_raises_error(self, tmp_path: Path) -> None:
        file = _write(tmp_path.joinpath("a.parquet"), pa.table({"text": ["a", "b"]}))

        stale = ParquetRowGroup(file, 0, 0, 3, 10)

        with pytest.raises(ParquetTextError, match="must have 3 rows as when the dataset was indexed, but has 2 instead"):  # fmt: skip
            read_parquet_texts(stale)

    def test_missing_file_raises_error(self, tmp_path: Path) -> None:
        missing = ParquetRowGroup(tmp_path.joinpath("gone.parquet"), 0, 0, 1, 1)

        with pytest.raises(ParquetTextError, match="Row group 0 of .*gone.parquet cannot be read"):  # fmt: skip
            read_parquet_texts(missing)
