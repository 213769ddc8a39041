from __future__ import annotations

import gc
import io
import json
import logging
import multiprocessing
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import huggingface_hub
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
import torch
from fairseq2.datasets import DataReadError, SequenceBatch
from huggingface_hub.errors import LocalEntryNotFoundError
from qwen35_datasets_testing import (
    BYTE_EOS,
    ByteTokenizer,
    batch_key,
    byte_tokens,
    fake_gangs,
    flatten,
    location_of,
    run_two_rank_worker,
    unpack_documents,
    unpack_documents_lenient,
    write_text_shards,
)

from qwen35_fs2.datasets import (
    PretrainingDataset,
    PretrainingDatasetConfig,
    PretrainingReader,
    open_pretraining_dataset,
    pretraining,
)
from qwen35_fs2.datasets.parquet import (
    ParquetRowGroup,
    ParquetTextError,
    read_parquet_texts,
)


def _read_all(reader: PretrainingReader) -> list[list[SequenceBatch]]:
    return list(reader)


def _file_order_texts(files: list[Path]) -> list[str]:
    texts: list[str] = []

    for file in files:
        texts.extend(pq.read_table(file, columns=["text"]).column(0).to_pylist())

    return texts


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[list[str]]]]:  # fmt: skip
    """4 files of 3 row groups of uneven sizes; texts of up to ~500 bytes."""
    out_dir = tmp_path_factory.mktemp("shards")

    sizes = [[7, 3, 9], [5, 5, 5], [12, 1, 4], [6, 8, 2]]

    return out_dir, write_text_shards(out_dir, sizes, seed=3)


class TestPretrainingReader:
    def test_reader_yields_every_document_in_file_order_without_shuffle(
        self, fineweb_dir: Path, byte_tokenizer: ByteTokenizer
    ) -> None:
        reader = PretrainingDataset([fineweb_dir]).create_reader(
            byte_tokenizer, fake_gangs(0, 1), max_seq_len=300, max_num_tokens=511, shuffle=False, drop_remainder=False  # fmt: skip
        )

        batches = flatten(_read_all(reader))

        for batch in batches[:-1]:
            assert batch.seqs.shape == (512,)
            assert batch.padding == 0
            assert max(batch.seq_lens) <= 300

        assert batches[-1].seqs.shape == (sum(batches[-1].seq_lens),)

        files = sorted(fineweb_dir.rglob("*.parquet"))

        expected = [byte_tokens(text) for text in _file_order_texts(files)]

        assert unpack_documents(batches, BYTE_EOS) == expected

    def test_reader_drops_the_last_partial_batch_by_default(
        self, fineweb_dir: Path, byte_tokenizer: ByteTokenizer
    ) -> None:
        def create(drop_remainder: bool) -> PretrainingReader:
            return PretrainingDataset([fineweb_dir]).create_reader(
                byte_tokenizer, fake_gangs(0, 1), max_seq_len=300, max_num_tokens=511, drop_remainder=drop_remainder  # fmt: skip
            )

        kept = flatten(_read_all(create(False)))
        dropped = flatten(_read_all(create(True)))

        # The last one shorter than the others, not padded.
        assert kept[-1].seqs.size(0) < 512 and all(batch.seqs.size(0) == 512 for batch in kept[:-1])
        assert all(batch.padding == 0 for batch in kept + dropped)
        assert [batch_key(b) for b in dropped] == [batch_key(b) for b in kept[:-1]]

    def test_reader_shuffles_the_same_documents_deterministically(
        self, fineweb_dir: Path, byte_tokenizer: ByteTokenizer
    ) -> None:
        def read(seed: int) -> list[SequenceBatch]:
            reader = PretrainingDataset([fineweb_dir]).create_reader(
                byte_tokenizer, fake_gangs(0, 1), max_seq_len=300, max_num_tokens=511, seed=seed, drop_remainder=False  # fmt: skip
            )

            return flatten(_read_all(reader))

        first, again, other = read(1), read(1), read(2)

        assert [batch_key(b) for b in first] == [batch_key(b) for b in again]
        assert [batch_key(b) for b in first] != [batch_key(b) for b in other]

        files = sorted(fineweb_dir.rglob("*.parquet"))

        in_file_order = [byte_tokens(text) for text in _file_order_texts(files)]

        documents = unpack_documents(first, BYTE_EOS)

        assert documents != in_file_order

        def as_counter(docs: list[list[int]]) -> Counter[tuple[int, ...]]:
            return Counter(tuple(d) for d in docs)

        assert as_counter(documents) == as_counter(in_file_order)
        assert as_counter(unpack_documents(other, BYTE_EOS)) == as_counter(
            in_file_order
        )

    def test_reset_starts_an_epoch_with_another_order_of_the_same_documents(
        self, shards: tuple[Path, list[list[list[str]]]]
    ) -> None:
        data_dir, _ = shards

        reader = PretrainingDataset([data_dir]).create_reader(
            ByteTokenizer(), fake_gangs(0, 1), max_seq_len=48, max_num_tokens=100, drop_remainder=False  # fmt: skip
        )

        epoch0 = flatten(_read_all(reader))

        # Exhausted until reset.
        with pytest.raises(StopIteration):
            next(reader)

        reader.reset()

        assert reader.epoch == 1

        epoch1 = flatten(_read_all(reader))

        locations0 = [location_of(d) for d in unpack_documents(epoch0, BYTE_EOS)]
        locations1 = [location_of(d) for d in unpack_documents(epoch1, BYTE_EOS)]

        assert sorted(locations0) == sorted(locations1)

        # Both the row groups and the rows within them are reordered.
        def row_groups(locations: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
            return list(dict.fromkeys((f, g) for f, g, _ in locations))

        assert row_groups(locations0) != row_groups(locations1)

        def rows(locations: list[tuple[int, int, int]]) -> dict[tuple[int, int], list[int]]:  # fmt: skip
            return {rg: [r for f, g, r in locations if (f, g) == rg] for rg in row_groups(locations)}  # fmt: skip

        assert rows(locations0) != rows(locations1)

    @pytest.mark.parametrize("prefetch", [0, 3])
    def test_resumed_reader_continues_bitwise_like_an_uninterrupted_one(
        self, shards: tuple[Path, list[list[list[str]]]], prefetch: int
    ) -> None:
        data_dir, _ = shards

        def create() -> PretrainingReader:
            return PretrainingDataset([data_dir]).create_reader(
                ByteTokenizer(), fake_gangs(0, 1), max_seq_len=48, max_num_tokens=100, num_accumulate=2, prefetch=prefetch, drop_remainder=False  # fmt: skip
            )

        # Two epochs, uninterrupted.
        reference = create()

        # `states[i]` is the state after `i` steps.
        steps: list[list[tuple[object, ...]]] = []
        states: list[dict[str, object]] = [reference.state_dict()]

        for batches in reference:
            steps.append([batch_key(b) for b in batches])

            states.append(reference.state_dict())

        num_epoch0_steps = len(steps)

        reference.reset()

        for batches in reference:
            steps.append([batch_key(b) for b in batches])

            states.append(reference.state_dict())

        # Some states must fall inside a document, the hardest case.
        assert any(state["token"] != 0 for state in states)

        checked_steps = sorted({0, 1, 2, 5, num_epoch0_steps - 1, num_epoch0_steps, num_epoch0_steps + 3, len(steps) - 1})  # fmt: skip

        for step in checked_steps:
            # Through a file, as the trainer's checkpoints do.
            buffer = io.BytesIO()

            torch.save(states[step], buffer)

            buffer.seek(0)

            resumed = create()

            resumed.load_state_dict(torch.load(buffer, weights_only=True))

            resumed_steps = []

            for _ in range(2):
                for batches in resumed:
                    resumed_steps.append([batch_key(b) for b in batches])

                if resumed.epoch == 1:
                    break

                resumed.reset()

            assert resumed_steps == steps[step:], f"Resuming after step {step} differs."

    def test_max_num_batches_ends_every_epoch_after_the_same_first_batches(
        self, fineweb_dir: Path, byte_tokenizer: ByteTokenizer
    ) -> None:
        def create(max_num_batches: int | None) -> PretrainingReader:
            return PretrainingDataset([fineweb_dir]).create_reader(
                byte_tokenizer, fake_gangs(0, 1), max_seq_len=300, max_num_tokens=511, num_accumulate=2, shuffle=False, drop_remainder=False, max_num_batches=max_num_batches  # fmt: skip
            )

        # All batches in file order (as the first test of this class checks).
        everything = flatten(_read_all(create(None)))

        assert len(everything) > 5

        capped = create(5)

        for epoch in range(3):
            calls = _read_all(capped)

            # Two calls of two batches, then one of the last batch.
            assert [len(batches) for batches in calls] == [2, 2, 1], epoch

            assert [batch_key(b) for b in flatten(calls)] == [batch_key(b) for b in everything[:5]], epoch  # fmt: skip

            capped.reset()

    def test_capped_reader_resumes_with_the_batches_left_in_its_epoch(
        self, fineweb_dir: Path, byte_tokenizer: ByteTokenizer
    ) -> None:
        def create() -> PretrainingReader:
            return PretrainingDataset([fineweb_dir]).create_reader(
                byte_tokenizer, fake_gangs(0, 1), max_seq_len=300, max_num_tokens=511, shuffle=False, max_num_batches=3  # fmt: skip
            )

        reader = create()

        first = [batch_key(b) for b in flatten([next(reader), next(reader)])]

        resumed = create()

        resumed.load_state_dict(reader.state_dict())

        rest = [batch_key(b) for b in flatten(_read_all(resumed))]

        assert len(rest) == 1

        assert first + rest == [batch_key(b) for b in flatten(_read_all(create()))]

    def test_reset_logs_the_end_of_the_epoch_and_starts_only_one(
        self, fineweb_dir: Path, byte_tokenizer: ByteTokenizer, caplog: pytest.LogCaptureFixture
    ) -> None:
        reader = PretrainingDataset([fineweb_dir]).create_reader(
            byte_tokenizer, fake_gangs(0, 1), max_seq_len=300, max_num_tokens=511, max_num_batches=4  # fmt: skip
        )

        _read_all(reader)

        with caplog.at_level(logging.INFO, logger="fairseq2"):
            reader.reset()

            # As fairseq2's validator does after a validation: the epoch has
            # not started, and goes on.
            reader.reset()

        assert reader.epoch == 1

        # `fineweb_dir` holds 15 row groups.
        assert [r.getMessage() for r in caplog.records if "Data epoch" in r.getMessage()] == [
            "Data epoch 1 ended after 4 batch(es) on this rank; epoch 2 reads the same 15 row group(s) again, in a new order."
        ]  # fmt: skip

    def test_load_state_dict_raises_error_when_reader_settings_differ(
        self, shards: tuple[Path, list[list[list[str]]]]
    ) -> None:
        data_dir, _ = shards

        def create(seed: int) -> PretrainingReader:
            return PretrainingDataset([data_dir]).create_reader(
                ByteTokenizer(), fake_gangs(0, 1), max_seq_len=48, max_num_tokens=100, seed=seed  # fmt: skip
            )

        state = create(1).state_dict()

        with pytest.raises(
            ValueError, match=r"its `seed` is 1 where the reader's is 2"
        ):
            create(2).load_state_dict(state)

    def test_ranks_read_disjoint_row_groups_and_together_everything(
        self,
        shards: tuple[Path, list[list[list[str]]]],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        data_dir, texts = shards

        read_row_groups: list[tuple[str, int]] = []

        def recording_read_parquet_texts(row_group: ParquetRowGroup, **kwargs: str) -> list[str]:  # fmt: skip
            read_row_groups.append((row_group.file.name, row_group.index))

            return read_parquet_texts(row_group, **kwargs)

        monkeypatch.setattr(pretraining, "read_parquet_texts", recording_read_parquet_texts)  # fmt: skip

        row_groups_of_rank = []
        documents_of_rank = []

        for rank in range(2):
            read_row_groups.clear()

            reader = PretrainingDataset([data_dir]).create_reader(
                ByteTokenizer(), fake_gangs(rank, 2), max_seq_len=48, max_num_tokens=100, drop_remainder=False  # fmt: skip
            )

            batches = flatten(_read_all(reader))

            locations = [
                location_of(doc) for doc in unpack_documents(batches, BYTE_EOS)
            ]

            row_groups_of_rank.append({(f, g) for f, g, _ in locations})

            documents_of_rank.append(locations)

            # Each row group is read once, by one rank.
            assert len(read_row_groups) == len(set(read_row_groups))
            assert len(read_row_groups) == len(row_groups_of_rank[-1])

        assert not row_groups_of_rank[0] & row_groups_of_rank[1]

        all_locations = sorted(
            (f, g, r)
            for f, file_texts in enumerate(texts)
            for g, rg_texts in enumerate(file_texts)
            for r in range(len(rg_texts))
        )

        assert sorted(documents_of_rank[0] + documents_of_rank[1]) == all_locations

        # Whole row groups: a rank reads every row of the row groups it reads.
        for rank in range(2):
            for f, g in row_groups_of_rank[rank]:
                rows = {
                    r for f2, g2, r in documents_of_rank[rank] if (f2, g2) == (f, g)
                }

                assert rows == set(range(len(texts[f][g])))

        # The ranks stay within one row group of each other (the rule itself:
        # test_row_groups_go_to_the_rank_with_the_fewest_text_bytes_so_far).
        sizes = [
            sum(len(texts[f][g][r].encode()) for f, g, r in documents_of_rank[rank])
            for rank in range(2)
        ]

        largest_row_group = max(
            sum(len(t.encode()) for t in rg_texts) for file_texts in texts for rg_texts in file_texts  # fmt: skip
        )

        assert abs(sizes[0] - sizes[1]) <= largest_row_group

    def test_row_groups_go_to_the_rank_with_the_fewest_text_bytes_so_far(self, tmp_path: Path) -> None:
        # One large row group, then small ones, in file order (no shuffle):
        # the rank of the large one takes no other, where dealing them in
        # turn would give each rank three.
        texts = ["a large document " * 60, "one", "two", "three", "four", "five"]

        pq.write_table(pa.table({"text": texts}), tmp_path.joinpath("a.parquet"), row_group_size=1)

        documents = []

        for rank in range(2):
            reader = PretrainingDataset([tmp_path]).create_reader(
                ByteTokenizer(), fake_gangs(rank, 2), max_seq_len=2048, max_num_tokens=2047, shuffle=False, drop_remainder=False  # fmt: skip
            )

            batches = flatten(_read_all(reader))

            documents.append([bytes(d[:-1]).decode() for d in unpack_documents(batches, BYTE_EOS)])

        assert documents == [texts[:1], texts[1:]]

    def test_create_reader_raises_error_when_ranks_outnumber_row_groups(
        self, tmp_path: Path
    ) -> None:
        write_text_shards(tmp_path, [[4, 4], [3]], seed=0)

        with pytest.raises(ValueError, match=r"at least as many non-empty parquet row groups as data-parallel ranks \(4\), but has 3 instead"):  # fmt: skip
            PretrainingDataset([tmp_path]).create_reader(
                ByteTokenizer(), fake_gangs(0, 4), max_seq_len=48, max_num_tokens=100
            )

    @pytest.mark.parametrize("prefetch", [0, 8])
    def test_reader_reads_row_groups_incrementally(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefetch: int
    ) -> None:
        # 60 row groups of 4 documents of at least 100 bytes each, so that a
        # row group holds more than a batch of 256 tokens.
        texts = write_text_shards(tmp_path, [[4] * 60], seed=1, max_words=80)

        assert all(sum(len(t.encode()) + 1 for t in rg) >= 256 for rg in texts[0])

        num_reads = 0

        original = pq.ParquetFile.read_row_group

        def counting_read_row_group(self: pq.ParquetFile, *args: object, **kwargs: object) -> pa.Table:  # fmt: skip
            nonlocal num_reads

            num_reads += 1

            return original(self, *args, **kwargs)

        monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting_read_row_group)

        def create_reader(prefetch: int) -> PretrainingReader:
            return PretrainingDataset([tmp_path]).create_reader(
                ByteTokenizer(), fake_gangs(0, 1), max_seq_len=256, max_num_tokens=255, prefetch=prefetch  # fmt: skip
            )

        if prefetch == 0:
            expected_reads = 1
        else:
            # The background thread stops after the batch returned, the
            # `prefetch` queued and one it holds while it waits for room: as
            # many row groups as `prefetch + 2` batches read in the
            # foreground.
            foreground = create_reader(0)

            for _ in range(prefetch + 2):
                next(foreground)

            expected_reads, num_reads = num_reads, 0

            assert expected_reads > 1

        reader = create_reader(prefetch)

        assert num_reads == 0

        next(reader)

        # Give the background thread time to read ahead, and to read too much.
        deadline = time.monotonic() + 10.0

        while num_reads < expected_reads and time.monotonic() < deadline:
            time.sleep(0.01)

        if prefetch > 0:
            time.sleep(0.5)

        assert num_reads == expected_reads

        for _ in reader:
            pass

        assert num_reads == 60

    def test_epoch_without_a_batch_raises_error(self, tmp_path: Path) -> None:
        write_text_shards(tmp_path, [[2], [2]], seed=0, max_words=3)

        reader = PretrainingDataset([tmp_path]).create_reader(
            ByteTokenizer(), fake_gangs(0, 1), max_seq_len=512, max_num_tokens=511
        )

        with pytest.raises(DataReadError, match=r"Epoch 0 must have at least one batch on every data-parallel rank, but has none .* Use smaller batches, fewer ranks, or `drop_remainder=False`"):  # fmt: skip
            next(reader)

    def test_dropping_a_reader_mid_epoch_stops_its_thread(
        self, shards: tuple[Path, list[list[list[str]]]]
    ) -> None:
        data_dir, _ = shards

        def reader_threads() -> list[threading.Thread]:
            return [t for t in threading.enumerate() if t.name == "qwen35-data-reader"]

        before = reader_threads()

        reader = PretrainingDataset([data_dir]).create_reader(
            ByteTokenizer(), fake_gangs(0, 1), max_seq_len=48, max_num_tokens=100, prefetch=2  # fmt: skip
        )

        next(reader)

        (thread,) = [t for t in reader_threads() if t not in before]

        del reader

        gc.collect()

        thread.join(timeout=10)

        assert not thread.is_alive()

    def test_empty_texts_are_skipped_and_counted(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        texts = ["first document", "", "   \n ", "second document"]

        pq.write_table(pa.table({"text": texts}), tmp_path.joinpath("a.parquet"))

        reader = PretrainingDataset([tmp_path]).create_reader(
            ByteTokenizer(), fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63, shuffle=False, drop_remainder=False  # fmt: skip
        )

        with caplog.at_level(logging.WARNING, logger="fairseq2"):
            batches = flatten(_read_all(reader))

        assert unpack_documents(batches, BYTE_EOS) == [
            byte_tokens("first document"),
            byte_tokens("second document"),
        ]

        assert "Skipped 2 empty or whitespace-only document(s) in row group 0" in caplog.text  # fmt: skip

    def test_null_text_raises_error_naming_file_and_row(self, tmp_path: Path) -> None:
        file = tmp_path.joinpath("nulls.parquet")

        pq.write_table(
            pa.table({"text": ["a", "b", "c", None, "e"]}), file, row_group_size=2
        )

        reader = PretrainingDataset([file]).create_reader(
            ByteTokenizer(), fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63, shuffle=False  # fmt: skip
        )

        with pytest.raises(ParquetTextError, match=rf"Row 3 of {file} \(row group 1\) must have a string `text`, but has None instead"):  # fmt: skip
            next(reader)

    def test_text_that_is_not_utf8_raises_error_naming_file_and_row(self, tmp_path: Path) -> None:  # fmt: skip
        file = tmp_path.joinpath("latin1.parquet")

        # A writer that did not validate its strings (pyarrow reads them as
        # strings all the same).
        values = pa.array([b"a", b"b", b"c", b"caf\xe9", b"e"], type=pa.binary())

        texts = pa.Array.from_buffers(pa.string(), len(values), values.buffers())

        pq.write_table(pa.table({"text": texts}), file, row_group_size=2)

        reader = PretrainingDataset([file]).create_reader(
            ByteTokenizer(), fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63, shuffle=False  # fmt: skip
        )

        with pytest.raises(ParquetTextError, match=rf"Row 3 of {file} \(row group 1\) must have a UTF-8 `text`, but does not"):  # fmt: skip
            next(reader)

    def test_create_reader_raises_error_when_tokenizer_does_not_append_eos(
        self, fineweb_dir: Path
    ) -> None:
        with pytest.raises(ValueError, match=r"must end each document with its EOS token, but appends None instead"):  # fmt: skip
            PretrainingDataset([fineweb_dir]).create_reader(
                ByteTokenizer(eos_in_default_mode=False), fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63  # fmt: skip
            )

    @pytest.mark.parametrize(
        "kwargs,match",
        [
            ({"max_num_tokens": 0}, "`max_num_tokens` must be greater than or equal to 1, but is 0 instead"),  # fmt: skip
            ({"max_seq_len": 1}, "`max_seq_len` must be greater than or equal to 2, but is 1 instead"),  # fmt: skip
            ({"num_accumulate": 0}, "`num_accumulate` must be greater than or equal to 1, but is 0 instead"),  # fmt: skip
            ({"prefetch": -1}, "`prefetch` must be greater than or equal to 0, but is -1 instead"),  # fmt: skip
            ({"max_num_batches": 0}, "`max_num_batches` must be greater than or equal to 1, but is 0 instead"),  # fmt: skip
        ],
    )
    def test_create_reader_raises_error_when_settings_are_invalid(
        self, fineweb_dir: Path, kwargs: dict[str, int], match: str
    ) -> None:
        settings = {"max_seq_len": 64, "max_num_tokens": 63} | kwargs

        with pytest.raises(ValueError, match=match):
            PretrainingDataset([fineweb_dir]).create_reader(
                ByteTokenizer(), fake_gangs(0, 1), **settings  # type: ignore[arg-type]
            )

    @pytest.mark.slow
    def test_two_processes_take_the_same_steps_and_fail_together(
        self, tmp_path: Path
    ) -> None:
        # One large and one small row group: the rank of the small one runs
        # out first, and both must stop at the same step.
        write_text_shards(tmp_path.joinpath("uneven"), [[40], [6]], seed=5)

        broken_dir = tmp_path.joinpath("broken")
        broken_dir.mkdir()

        pq.write_table(pa.table({"text": ["fine"] * 3}), broken_dir.joinpath("a.parquet"))  # fmt: skip
        pq.write_table(pa.table({"text": ["fine", None, "x"]}), broken_dir.joinpath("b.parquet"))  # fmt: skip

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))

            port = sock.getsockname()[1]

        context = multiprocessing.get_context("spawn")

        processes = [
            context.Process(
                target=run_two_rank_worker,
                args=(rank, 2, port, str(tmp_path), str(tmp_path)),
            )
            for rank in range(2)
        ]

        for process in processes:
            process.start()

        for process in processes:
            process.join(timeout=180)

        for process in processes:
            if process.is_alive():
                process.kill()

                pytest.fail("A reader process hung.")

            assert process.exitcode == 0

        results = [
            json.loads(tmp_path.joinpath(f"rank_{rank}.json").read_text())
            for rank in range(2)
        ]

        steps = [result["steps"] for result in results]

        assert len(steps[0]) == len(steps[1]) >= 1

        # Every step has batches from this rank's row group only.
        files_of_rank = [
            {f for step in rank_steps for f, _, _ in step} for rank_steps in steps
        ]

        assert len(files_of_rank[0]) == len(files_of_rank[1]) == 1
        assert files_of_rank[0] != files_of_rank[1]

        # The rank of the large row group stopped before its end.
        large_rank = 0 if files_of_rank[0] == {0} else 1

        rows_read = {r for step in steps[large_rank] for _, _, r in step}

        assert len(rows_read) < 40

        # Until the last (validation), the rank of the large row group reads
        # all of it while the other gets empty lists, in every validation.
        validations = [result["until_last"] for result in results]

        assert validations[0][0] == validations[0][1] and validations[1][0] == validations[1][1]

        large, small = validations[large_rank][0], validations[1 - large_rank][0]

        assert len(large) == len(small)

        assert None not in large and small[-1] is None

        # Each rank's batches are those of its row group read alone.
        for rank, calls in ((large_rank, large), (1 - large_rank, small)):
            (file_idx,) = files_of_rank[rank]

            alone = PretrainingDataset([tmp_path.joinpath("uneven", f"shard_{file_idx}.parquet")])

            reader = alone.create_reader(ByteTokenizer(), fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63, shuffle=False, drop_remainder=False)  # fmt: skip

            expected = [[location_of(doc) for doc in unpack_documents_lenient(batches)] for batches in reader]

            assert [call for call in calls if call is not None] == [[list(loc) for loc in call] for call in expected]

        # With a cap, every rank reads up to its cap, and the calls end together.
        capped = [result["until_last_capped"][0] for result in results]

        assert len(capped[0]) == len(capped[1]) == 2
        assert capped[large_rank] == large[:2]

        # The rank holding shard b fails on its null text; the other one is
        # told so instead of waiting.
        errors = sorted(result["error"] for result in results)

        assert errors[0].startswith("DataReadError: Data-parallel rank(s) [1] failed to read the dataset")  # fmt: skip
        assert errors[1].startswith("ParquetTextError: Row 1 of")

    @pytest.mark.slow
    def test_reader_ends_qwen35_documents_with_endoftext(self, fineweb_dir: Path) -> None:  # fmt: skip
        from qwen35_fs2.models.qwen35.tokenizer import (
            Qwen35TokenizerConfig,
            get_qwen35_tokenizer_dir,
            load_qwen35_tokenizer,
        )

        tokenizer = load_qwen35_tokenizer(
            get_qwen35_tokenizer_dir(), Qwen35TokenizerConfig(eos_token="<|endoftext|>")
        )

        # The id of `<|endoftext|>` in the released Qwen3.5 vocabulary.
        endoftext = 248044

        reader = PretrainingDataset([fineweb_dir]).create_reader(
            tokenizer, fake_gangs(0, 1), max_seq_len=512, max_num_tokens=2047, shuffle=False, drop_remainder=False  # fmt: skip
        )

        batches = flatten(_read_all(reader))

        assert all(batch.seqs.dtype == torch.int64 for batch in batches)

        documents = unpack_documents(batches, endoftext)

        decoder = tokenizer.create_decoder()

        files = sorted(fineweb_dir.rglob("*.parquet"))

        assert [decoder(torch.tensor(d[:-1])) for d in documents] == _file_order_texts(files)  # fmt: skip


    @pytest.mark.slow
    def test_documents_holding_the_end_of_document_token_are_counted_in_a_warning(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
        from qwen35_fs2.models.qwen35.tokenizer import (
            Qwen35TokenizerConfig,
            get_qwen35_tokenizer_dir,
            load_qwen35_tokenizer,
        )

        tokenizer = load_qwen35_tokenizer(
            get_qwen35_tokenizer_dir(), Qwen35TokenizerConfig(eos_token="<|endoftext|>")
        )

        # Web pages about language models quote the token.
        texts = ["GPT-2 separates documents with <|endoftext|> in its data.", "A plain page.", "<|endoftext|>"]

        pq.write_table(pa.table({"text": texts}), tmp_path.joinpath("a.parquet"))

        reader = PretrainingDataset([tmp_path]).create_reader(
            tokenizer, fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63, shuffle=False, drop_remainder=False  # fmt: skip
        )

        with caplog.at_level(logging.WARNING, logger="fairseq2"):
            [[batch]] = _read_all(reader)

        # Encoded as transformers encodes them: the token inside the first.
        assert (batch.seqs[: batch.seq_lens[0] - 1] == 248044).sum() == 1

        # The first and the last.
        assert f"2 document(s) in row group 0 of {tmp_path.joinpath('a.parquet')} hold the end-of-document token 248044 inside their text" in caplog.text  # fmt: skip


class TestHubDownloadAcrossRanks:
    """``hg://`` sources: rank 0 downloads, then the others read the cache."""

    @pytest.fixture
    def snapshot(self, tmp_path: Path) -> Path:
        snapshot = tmp_path.joinpath("snapshot")

        snapshot.joinpath("data").mkdir(parents=True)

        table = pa.table({"text": ["one", "two", "three", "four"]})

        pq.write_table(table, snapshot.joinpath("data", "a.parquet"), row_group_size=2)

        return snapshot

    def _create_reader(
        self, rank: int, monkeypatch: pytest.MonkeyPatch, rank0_outcome: str | None
    ) -> PretrainingReader:
        gangs = fake_gangs(rank, 2)

        # What rank 0 broadcasts, as a real gang would deliver it.
        def broadcast_objects(objects: list[object], source_rank: int = 0) -> None:
            objects[0] = rank0_outcome

        monkeypatch.setattr(gangs.root, "broadcast_objects", broadcast_objects)

        dataset = PretrainingDataset(["hg://org/data"], hf_allow_patterns=["data/*.parquet"])  # fmt: skip

        return dataset.create_reader(
            ByteTokenizer(), gangs, max_seq_len=64, max_num_tokens=63, shuffle=False, drop_remainder=False  # fmt: skip
        )

    def test_rank_0_downloads_and_other_ranks_read_the_cache(
        self, snapshot: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        local_files_only: list[object] = []

        def snapshot_download(repo_id: str, **kwargs: object) -> str:
            local_files_only.append(kwargs["local_files_only"])

            return str(snapshot)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

        texts_of_rank = []

        for rank in range(2):
            local_files_only.clear()

            reader = self._create_reader(rank, monkeypatch, rank0_outcome=None)

            assert local_files_only == [rank != 0]

            batches = flatten(_read_all(reader))

            texts_of_rank.append(
                [bytes(d[:-1]).decode() for d in unpack_documents(batches, BYTE_EOS)]
            )

        assert texts_of_rank == [["one", "two"], ["three", "four"]]

    def test_other_ranks_download_when_the_cache_is_not_shared(
        self, snapshot: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        local_files_only: list[object] = []

        def snapshot_download(repo_id: str, **kwargs: object) -> str:
            local_files_only.append(kwargs["local_files_only"])

            if kwargs["local_files_only"]:
                raise LocalEntryNotFoundError("Not in the local cache.")

            return str(snapshot)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

        self._create_reader(1, monkeypatch, rank0_outcome=None)

        assert local_files_only == [True, False]

    def test_other_ranks_fail_when_rank_0_fails_to_download(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def snapshot_download(repo_id: str, **kwargs: object) -> str:
            raise AssertionError("Rank 1 must not download after rank 0 failed.")

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

        with pytest.raises(DataReadError, match="Rank 0 failed to download the dataset: OSError: offline"):  # fmt: skip
            self._create_reader(1, monkeypatch, rank0_outcome="OSError: offline")


    def test_ranks_fail_together_when_a_cache_holds_part_of_the_download(
        self, snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Rank 1's node-local cache kept one file of an interrupted download:
        # huggingface_hub returns the snapshot as it is.
        snapshot.joinpath("data", "b.parquet").write_bytes(snapshot.joinpath("data", "a.parquet").read_bytes())  # fmt: skip

        partial = tmp_path.joinpath("partial")

        partial.joinpath("data").mkdir(parents=True)

        partial.joinpath("data", "a.parquet").write_bytes(snapshot.joinpath("data", "a.parquet").read_bytes())  # fmt: skip

        def snapshot_download(repo_id: str, **kwargs: object) -> str:
            return str(partial if kwargs["local_files_only"] else snapshot)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

        # What each rank contributes to the all-gather, as a real gang would
        # deliver it once both have sent theirs.
        sent: dict[int, torch.Tensor] = {}

        def create_reader(rank: int) -> PretrainingReader:
            gangs = fake_gangs(rank, 2)

            monkeypatch.setattr(gangs.root, "broadcast_objects", lambda objects, source_rank=0: None)  # fmt: skip

            def all_gather_to_list(outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
                sent[rank] = tensor.clone()

                for idx, output in enumerate(outputs):
                    output.copy_(sent.get(idx, tensor))

            monkeypatch.setattr(gangs.root, "all_gather_to_list", all_gather_to_list)

            dataset = PretrainingDataset(["hg://org/data"], hf_allow_patterns=["data/*.parquet"])  # fmt: skip

            return dataset.create_reader(
                ByteTokenizer(), gangs, max_seq_len=64, max_num_tokens=63, shuffle=False, drop_remainder=False  # fmt: skip
            )

        # Rank 1 first, alone (its own words only): nothing to compare yet.
        create_reader(1)

        # Both ranks then see both ranks' words, and both stop.
        for rank in (0, 1):
            with pytest.raises(DataReadError, match=r"rank\(s\) \[1\] found other ones than rank 0 \(rank 0: 2 file\(s\), 4 row group\(s\); rank 1: 1 file\(s\), 2 row group\(s\)\)"):  # fmt: skip
                create_reader(rank)

        # With the whole download in its cache, rank 1 reads.
        partial.joinpath("data", "b.parquet").write_bytes(snapshot.joinpath("data", "b.parquet").read_bytes())  # fmt: skip

        assert len(create_reader(1).files) == 2


class TestPretrainingDatasetConfig:
    def test_defaults_read_fineweb_edu_sample_10bt(self) -> None:
        config = PretrainingDatasetConfig()

        assert config.paths == ["hg://HuggingFaceFW/fineweb-edu"]
        assert config.hf_allow_patterns == ["sample/10BT/*.parquet"]

    def test_open_pretraining_dataset_reads_configured_paths(
        self, fineweb_dir: Path
    ) -> None:
        dataset = open_pretraining_dataset(
            PretrainingDatasetConfig(paths=[str(fineweb_dir)])
        )

        reader = dataset.create_reader(
            ByteTokenizer(), fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63
        )

        assert len(next(reader)) == 1

    def test_dataset_raises_error_when_paths_are_missing(self, tmp_path: Path) -> None:
        dataset = PretrainingDataset([tmp_path.joinpath("missing")])

        with pytest.raises(FileNotFoundError, match="does not exist"):
            dataset.create_reader(
                ByteTokenizer(), fake_gangs(0, 1), max_seq_len=64, max_num_tokens=63
            )
