"""Checks on the files that data sources list, so that no example is read
twice and a directory read whole never mixes a test split into training
unnoticed.

Hugging Face dataset repositories name a file's split in its path
(``main/train-00000-of-00001.parquet``, ``data/test.jsonl``,
``validation/shard_0.parquet``) with the keywords of the ``datasets``
library's convention. ``openai/gsm8k`` read without a pattern would otherwise
train on its test split, the one ``lm eval_gsm8k`` scores.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

SPLIT_KEYWORDS: Final[Mapping[str, tuple[str, ...]]] = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
"""The words that name each split in a path, as the ``datasets`` library
reads them."""

# What separates the words of a path: the `datasets` library's non-word
# characters (digits among them, as in `val2017`) and the directory separator.
_WORD_SEPARATORS: Final = re.compile(r"[-._ 0-9/]+")

_SPLIT_OF_KEYWORD: Final = {
    keyword: split for split, keywords in SPLIT_KEYWORDS.items() for keyword in keywords
}


def find_splits(root: Path, files: Iterable[Path]) -> dict[str, list[Path]]:
    """Returns the files of ``files`` whose path relative to ``root`` names a
    split, by split; files that name none are left out, and a file that names
    two splits is in both."""
    splits: dict[str, list[Path]] = {}

    for file in files:
        words = _WORD_SEPARATORS.split(file.relative_to(root).as_posix().lower())

        for split in sorted({_SPLIT_OF_KEYWORD[w] for w in words if w in _SPLIT_OF_KEYWORD}):
            splits.setdefault(split, []).append(file)

    return splits


def describe_mixed_splits(root: Path, files: Iterable[Path]) -> str | None:
    """Returns, if the paths of ``files`` relative to ``root`` name more than
    one split, a description of them for an error message, such as ``test
    (main/test-00000-of-00001.parquet), train
    (main/train-00000-of-00001.parquet)``; otherwise ``None``."""
    splits = find_splits(root, files)

    if len(splits) < 2:
        return None

    def describe(split: str) -> str:
        split_files = sorted(splits[split])

        more = f" and {len(split_files) - 1} more" if len(split_files) > 1 else ""

        return f"{split} ({split_files[0].relative_to(root).as_posix()}{more})"

    return ", ".join(describe(split) for split in sorted(splits))


def find_repeated_file(files: Sequence[Path]) -> Path | None:
    """Returns the first of ``files`` that an earlier one names too, or
    ``None`` if each is named once.

    Paths are compared resolved, links followed: a Hugging Face cache links
    files of equal content to one blob, and those count as one file.
    """
    seen: set[Path] = set()

    for file in files:
        resolved = file.resolve()

        if resolved in seen:
            return file

        seen.add(resolved)

    return None


def find_shared_files(files: Sequence[Path], other_files: Sequence[Path]) -> list[Path]:
    """Returns the files of ``files`` that ``other_files`` names too, in
    order, comparing paths as :func:`find_repeated_file` does."""
    others = {file.resolve() for file in other_files}

    return [file for file in files if file.resolve() in others]
