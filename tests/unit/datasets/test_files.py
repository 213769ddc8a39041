from __future__ import annotations

from pathlib import Path

from qwen35_fs2.datasets.files import (
    describe_mixed_splits,
    find_repeated_file,
    find_shared_files,
    find_splits,
)


class TestFindSplits:
    def test_reads_the_split_keywords_of_the_path_below_the_root(self) -> None:
        # The root's own name does not count, nor does a keyword inside a
        # word; digits separate words, as in `val2017`.
        root = Path("/data/test_sets")

        names = [
            "main/train-00000-of-00001.parquet",
            "main/TEST-00000-of-00001.parquet",
            "val2017/shard.jsonl",
            "dev.jsonl",
            "evaluation/a.parquet",
            "contest.jsonl",
            "trainer_notes/x.jsonl",
            "README.parquet",
        ]

        splits = find_splits(root, [root / name for name in names])

        assert splits == {
            "train": [root / names[0]],
            "test": [root / names[1], root / names[4]],
            "validation": [root / names[2], root / names[3]],
        }

    def test_a_file_naming_two_splits_is_in_both(self) -> None:
        root = Path("/d")

        assert find_splits(root, [root / "train" / "test.jsonl"]) == {
            "test": [root / "train" / "test.jsonl"],
            "train": [root / "train" / "test.jsonl"],
        }


class TestDescribeMixedSplits:
    def test_none_for_one_split_and_files_without_one(self) -> None:
        root = Path("/d")

        assert describe_mixed_splits(root, [root / "train-0.parquet", root / "train-1.parquet", root / "extra.jsonl"]) is None

    def test_names_each_split_by_its_first_file(self) -> None:
        root = Path("/d")

        files = [root / "train" / "b.jsonl", root / "train" / "a.jsonl", root / "test.jsonl"]

        assert describe_mixed_splits(root, files) == "test (test.jsonl), train (train/a.jsonl and 1 more)"


class TestFindRepeatedFile:
    def test_finds_a_file_named_by_two_paths(self, tmp_path: Path) -> None:
        a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"

        a.write_text("")
        b.write_text("")

        link = tmp_path / "link.jsonl"

        link.symlink_to(a)

        assert find_repeated_file([a, b]) is None
        assert find_repeated_file([a, b, tmp_path / "x" / ".." / "b.jsonl"]) == tmp_path / "x" / ".." / "b.jsonl"
        assert find_repeated_file([link, b, a]) == a

    def test_find_shared_files_keeps_the_order_of_the_first(self, tmp_path: Path) -> None:
        a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")

        for file in (a, b, c):
            file.write_text("")

        assert find_shared_files([c, a, b], [a, tmp_path / "." / "c.jsonl"]) == [c, a]
        assert find_shared_files([b], [a, c]) == []
