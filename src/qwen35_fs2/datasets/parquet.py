"""Parquet text shards: finding the files, indexing their row groups and
reading one row group's texts at a time.

Readers stream a corpus by row group, so memory holds one row group's text
column, never a whole shard. FineWeb-Edu shards are written by datatrove in
row groups of 1,000 documents (a few MB of text each).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from fairseq2.datasets import DataReadError

from qwen35_fs2.datasets.files import describe_mixed_splits, find_repeated_file

HG_URI_PREFIX: Final = "hg://"
"""The prefix of Hugging Face Hub dataset URIs (``hg://org/dataset``)."""


class ParquetTextError(DataReadError):
    """Raised when a parquet shard cannot serve as a source of texts."""


@final
@dataclass(frozen=True)
class ParquetRowGroup:
    """A non-empty row group of a parquet shard: the unit by which corpora are
    sharded across ranks, shuffled and streamed."""

    file: Path
    """The parquet file."""

    index: int
    """The index of the row group in ``file``."""

    first_row: int
    """The index in ``file`` of the first row of the row group."""

    num_rows: int
    """The number of rows."""

    num_bytes: int
    """The uncompressed size of the text column chunk, used to balance ranks."""


def resolve_parquet_files(
    sources: Sequence[str | Path],
    *,
    hf_allow_patterns: Sequence[str] = (),
    local_files_only: bool = False,
) -> list[Path]:
    """Returns the parquet files of ``sources``, in order.

    :param sources: Parquet files, directories (searched recursively for
        ``*.parquet``, sorted by path; their paths may name one split at
        most, see :mod:`qwen35_fs2.datasets.files`) and ``hg://org/dataset``
        URIs of Hugging Face Hub dataset repositories.
    :param hf_allow_patterns: The files of ``hg://`` repositories to download
        and read, as ``fnmatch`` patterns relative to the repository root, such
        as ``sample/10BT/*.parquet``. Required with ``hg://`` sources, so that
        a whole repository (1.3T tokens for FineWeb-Edu) is never downloaded
        by accident.
    :param local_files_only: If ``True``, ``hg://`` repositories are taken from
        the local Hugging Face cache and never downloaded.
    """
    if not sources:
        raise ValueError("`sources` must contain at least one path or URI, but is empty instead.")  # fmt: skip

    files: list[Path] = []

    for source in sources:
        source_str = str(source)

        if source_str.startswith(HG_URI_PREFIX):
            files.extend(
                _download_hg_files(source_str, hf_allow_patterns, local_files_only)
            )

            continue

        path = Path(source_str).expanduser()

        if path.is_dir():
            dir_files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
            if not dir_files:
                raise FileNotFoundError(
                    f"{path} must contain at least one *.parquet file, but contains none."
                )

            mixed_splits = describe_mixed_splits(path, dir_files)
            if mixed_splits is not None:
                raise ValueError(
                    f"A directory source must hold the files of one split, but {path} holds {mixed_splits} instead. Name the split's directory or files."
                )

            files.extend(dir_files)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(
                f"Each source must be a parquet file, a directory or a hg:// URI, but {path} does not exist."
            )

    repeated = find_repeated_file(files)
    if repeated is not None:
        raise ValueError(
            f"Each parquet file must be listed once, but {repeated} is listed more than once."
        )

    return files


def _download_hg_files(
    uri: str, allow_patterns: Sequence[str], local_files_only: bool
) -> list[Path]:
    repo_id = uri[len(HG_URI_PREFIX) :].strip("/")

    if repo_id.count("/") != 1:
        raise ValueError(
            f"A Hugging Face URI must have the form hg://org/dataset, but is {uri} instead."
        )

    if not allow_patterns:
        raise ValueError(
            f"`hf_allow_patterns` must name the files to read from {uri}, but is empty instead."
        )

    from huggingface_hub import snapshot_download

    local_dir = Path(
        snapshot_download(
            repo_id,
            repo_type="dataset",
            allow_patterns=list(allow_patterns),
            local_files_only=local_files_only,
        )
    )

    # The snapshot may hold files of earlier downloads with other patterns.
    files = sorted(
        p
        for p in local_dir.rglob("*.parquet")
        if any(
            fnmatch.fnmatch(p.relative_to(local_dir).as_posix(), pattern)
            for pattern in allow_patterns
        )
    )

    if not files:
        raise FileNotFoundError(
            f"{uri} must have parquet files matching {list(allow_patterns)}, but has none."
        )

    return files


def index_parquet_row_groups(
    files: Sequence[Path], *, text_column: str = "text"
) -> list[ParquetRowGroup]:
    """Returns the non-empty row groups of ``files``, in file order.

    Only the footers are read. Every file must have a string ``text_column`` and
    at least one row, so that a broken shard fails before training starts.
    """
    row_groups: list[ParquetRowGroup] = []

    for file in files:
        metadata = _read_metadata(file)

        schema = metadata.schema.to_arrow_schema()

        field_idx = schema.get_field_index(text_column)
        if field_idx < 0:
            raise ParquetTextError(
                f"{file} must have a `{text_column}` column, but has only {schema.names} instead."
            )

        field_type = schema.field(field_idx).type
        if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)):  # fmt: skip
            raise ParquetTextError(
                f"The `{text_column}` column of {file} must be of type string, but is of type {field_type} instead."
            )

        if metadata.num_rows == 0:
            raise ParquetTextError(f"{file} must have at least one row, but is empty.")

        # The physical column of a top-level string field is found by path.
        column_idx = next(
            idx
            for idx in range(metadata.num_columns)
            if metadata.schema.column(idx).path == text_column
        )

        first_row = 0

        for rg_idx in range(metadata.num_row_groups):
            rg_metadata = metadata.row_group(rg_idx)

            num_rows = rg_metadata.num_rows
            if num_rows > 0:
                num_bytes = rg_metadata.column(column_idx).total_uncompressed_size

                row_groups.append(
                    ParquetRowGroup(file, rg_idx, first_row, num_rows, num_bytes)
                )

            first_row += num_rows

    return row_groups


def read_parquet_texts(row_group: ParquetRowGroup, *, text_column: str = "text") -> list[str]:  # fmt: skip
    """Reads the texts of ``row_group``, only that row group and only its text
    column.

    :raises ParquetTextError: if a text is null, naming its file and row.
    """
    file = row_group.file

    try:
        parquet_file = pq.ParquetFile(file)

        table = parquet_file.read_row_group(
            row_group.index, columns=[text_column], use_threads=False
        )
    except (OSError, pa.ArrowException) as ex:
        raise ParquetTextError(
            f"Row group {row_group.index} of {file} cannot be read."
        ) from ex

    try:
        texts: list[str] = table.column(0).to_pylist()
    except UnicodeDecodeError as ex:
        raise ParquetTextError(
            f"Row {row_group.first_row + _first_invalid_utf8_row(table.column(0))} of {file} (row group {row_group.index}) must have a UTF-8 `{text_column}`, but does not: {ex}."
        ) from ex

    if len(texts) != row_group.num_rows:
        raise ParquetTextError(
            f"Row group {row_group.index} of {file} must have {row_group.num_rows} rows as when the dataset was indexed, but has {len(texts)} instead. Was the file modified?"
        )

    for idx, text in enumerate(texts):
        if not isinstance(text, str):
            raise ParquetTextError(
                f"Row {row_group.first_row + idx} of {file} (row group {row_group.index}) must have a string `{text_column}`, but has {text!r} instead."
            )

    return texts


def _first_invalid_utf8_row(column: pa.ChunkedArray) -> int:
    """Returns the index of the first value of the string ``column`` that is
    not valid UTF-8 (parquet files written without validation can hold
    such values, which pyarrow reads as strings)."""
    for idx, value in enumerate(column.cast(pa.binary()).to_pylist()):
        if value is None:
            continue

        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return idx

    raise ValueError("`column` must hold a value that is not valid UTF-8, but holds none.")


def _read_metadata(file: Path) -> pq.FileMetaData:
    try:
        return pq.read_metadata(file)
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as ex:
        raise ParquetTextError(f"{file} must be a parquet file, but is not.") from ex
