from __future__ import annotations

import io
import logging
import re

import pytest
import torch

from fairseq2.data.data_pipeline import DataPipeline, read_sequence
from fairseq2.datasets import SequenceBatch
from fairseq2.gang import FakeGang, Gangs, create_fake_gangs

from qwen35_fs2.datasets.synthetic import generate_synthetic_gsm8k
from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX
from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer
from qwen35_fs2.recipes.instruction import ChatEncoder, InstructionDataError, InstructionExample
from qwen35_fs2.recipes.sft.dataset import SFTBatching, create_sft_reader

CPU = torch.device("cpu")


def _examples(num_examples: int) -> list[InstructionExample]:
    return [
        {"id": str(idx), "prompt": e.question, "response": e.answer}
        for idx, e in enumerate(generate_synthetic_gsm8k(num_examples, seed=1))
    ]


def _gangs(rank: int, size: int) -> Gangs:
    gang = FakeGang(CPU, rank=rank, size=size)

    return Gangs(root=gang, dp=gang, rdp=gang, sdp=gang, tp=FakeGang(CPU), pp=FakeGang(CPU))


def _read_all(tokenizer: Qwen35Tokenizer, examples: list[InstructionExample], batching: SFTBatching, **kwargs: object) -> list[SequenceBatch]:
    options: dict[str, object] = {"split_name": "train", "shuffle_window": None, "seed": 3, "prefetch": 0}

    options.update(kwargs)

    gangs = options.pop("gangs", create_fake_gangs(CPU))

    reader = create_sft_reader(
        examples, ChatEncoder(tokenizer), gangs, batching, pad_idx=tokenizer.vocab_info.pad_idx, **options  # type: ignore[arg-type]
    )

    return [batch for batches in reader for batch in batches]


def _ids(batches: list[SequenceBatch]) -> list[str]:
    return [i for batch in batches for i in batch.example["id"]]  # type: ignore[index]


class TestCreateSFTReader:
    def test_padded_batches_target_only_response_tokens(self, tokenizer: Qwen35Tokenizer) -> None:
        examples = _examples(5)

        batches = _read_all(tokenizer, examples, SFTBatching(max_seq_len=512, max_num_tokens=1024, batch_size=2))

        assert _ids(batches) == [e["id"] for e in examples]

        encoder = ChatEncoder(tokenizer)

        batch = batches[0]

        assert batch.seqs.shape[0] == 2 and not batch.packed

        for row, example in enumerate(examples[:2]):
            encoded = encoder(example)

            seq_len = len(encoded["indices"])

            assert batch.seq_lens[row] == seq_len

            torch.testing.assert_close(batch.seqs[row, :seq_len], encoded["indices"])

            assert batch.target_mask is not None

            torch.testing.assert_close(batch.target_mask[row, :seq_len], encoded["target_mask"])

            # Padding is never a target.
            assert not batch.target_mask[row, seq_len:].any()

            assert batch.seqs[row, seq_len:].eq(ENDOFTEXT_IDX).all()

    def test_packed_batches_hold_whole_examples_within_max_num_tokens(self, tokenizer: Qwen35Tokenizer) -> None:
        examples = _examples(23)

        max_num_tokens = 400

        batches = _read_all(tokenizer, examples, SFTBatching(max_seq_len=200, max_num_tokens=max_num_tokens, packing=True))

        # Every example once, in order, across several batches.
        assert _ids(batches) == [e["id"] for e in examples]

        assert len(batches) > 3

        encoder = ChatEncoder(tokenizer)

        position = 0

        for batch in batches:
            assert batch.packed

            assert batch.seqs.ndim == 1 and batch.seqs.size(0) == sum(batch.seq_lens) <= max_num_tokens

            encoded = [encoder(e) for e in examples[position : position + len(batch.seq_lens)]]

            position += len(batch.seq_lens)

            assert batch.seq_lens == [len(e["indices"]) for e in encoded]

            torch.testing.assert_close(batch.seqs, torch.cat([e["indices"] for e in encoded]))

            assert batch.target_mask is not None

            torch.testing.assert_close(batch.target_mask, torch.cat([e["target_mask"] for e in encoded]))

    def test_skips_examples_longer_than_max_seq_len_with_a_warning(self, tokenizer: Qwen35Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
        examples = _examples(4)

        examples[2]["response"] = "long " * 600

        batches = _read_all(tokenizer, examples, SFTBatching(max_seq_len=256, max_num_tokens=1024, batch_size=8))

        assert _ids(batches) == ["0", "1", "3"]

        assert "Skipped example 2 of the train split" in caplog.text

    def test_shards_examples_across_ranks(self, tokenizer: Qwen35Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
        # Fake gangs cannot agree on the number of batches; let each rank read
        # its whole shard.
        monkeypatch.setattr("fairseq2.datasets.data_reader._min_num_batches", lambda num_batches, gang: num_batches)

        examples = _examples(7)

        batching = SFTBatching(max_seq_len=512, max_num_tokens=1024, batch_size=1)

        ids = [
            _ids(_read_all(tokenizer, examples, batching, gangs=_gangs(rank, 2), shuffle_window=0))
            for rank in range(2)
        ]

        assert sorted(ids[0] + ids[1], key=int) == [e["id"] for e in examples]

        assert not set(ids[0]) & set(ids[1])

    @pytest.mark.parametrize("shuffle_window", [0, 8])
    def test_ranks_shares_stay_apart_in_an_epoch_after_one_they_read_unevenly(
        self, tokenizer: Qwen35Tokenizer, monkeypatch: pytest.MonkeyPatch, shuffle_window: int
    ) -> None:
        monkeypatch.setattr("fairseq2.datasets.data_reader._min_num_batches", lambda num_batches, gang: num_batches)

        examples = _examples(40)

        batching = SFTBatching(max_seq_len=512, max_num_tokens=1024, batch_size=1)

        readers = [
            create_sft_reader(
                examples, ChatEncoder(tokenizer), _gangs(rank, 2), batching, pad_idx=tokenizer.vocab_info.pad_idx,  # type: ignore[arg-type]
                split_name="train", shuffle_window=shuffle_window, seed=7, prefetch=0,
            )  # fmt: skip
            for rank in range(2)
        ]

        # The first epoch: rank 0 reads its 20 examples, rank 1 stops 5
        # short, as a rank does when another runs out first or when it has
        # read ahead less.
        assert len(list(readers[0])) == 20

        for _ in range(15):
            next(readers[1])

        for reader in readers:
            reader.reset()

        shares = [_ids([batch for batches in reader for batch in batches]) for reader in readers]

        assert not set(shares[0]) & set(shares[1])

        assert sorted(shares[0] + shares[1], key=int) == [e["id"] for e in examples]

    def test_raises_error_when_the_split_has_fewer_examples_than_ranks(self, tokenizer: Qwen35Tokenizer) -> None:
        batching = SFTBatching(max_seq_len=512, max_num_tokens=1024, batch_size=1)

        with pytest.raises(InstructionDataError, match=r"The train split must have at least as many examples as data-parallel ranks \(4\), but has 3\."):
            _read_all(tokenizer, _examples(3), batching, gangs=_gangs(0, 4))

    def test_packs_examples_that_fill_max_num_tokens_exactly(self, tokenizer: Qwen35Tokenizer) -> None:
        examples = _examples(6)

        encoder = ChatEncoder(tokenizer)

        seq_lens = [len(encoder(e)["indices"]) for e in examples]

        # The first two examples make a full pack, and the only one of the
        # first bucket.
        max_num_tokens = seq_lens[0] + seq_lens[1]

        batching = SFTBatching(max_seq_len=max(seq_lens), max_num_tokens=max_num_tokens, packing=True)

        batches = _read_all(tokenizer, examples, batching)

        assert _ids(batches) == [e["id"] for e in examples]

        assert batches[0].seq_lens == seq_lens[:2]

        assert all(sum(batch.seq_lens) <= max_num_tokens for batch in batches)

    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
    def test_resumes_exactly_from_the_state_dict_after_any_batch(self, tokenizer: Qwen35Tokenizer, packing: bool, prefetch: int) -> None:
        # With `prefetch=0`, the state after batch `i` is the state of every
        # op right after its share of batch `i`, so all the positions of every
        # op are checked. With `prefetch > 0`, the ops before the prefetch
        # have read a number of batches ahead that depends on timing.
        examples = _examples(40)

        batching = SFTBatching(max_seq_len=300, max_num_tokens=600, packing=packing)

        def create_reader():  # type: ignore[no-untyped-def]
            return create_sft_reader(
                examples,
                ChatEncoder(tokenizer),
                create_fake_gangs(CPU),
                batching,
                pad_idx=tokenizer.vocab_info.pad_idx,  # type: ignore[arg-type]
                split_name="train",
                shuffle_window=8,
                seed=5,
                prefetch=prefetch,
            )

        reader = create_reader()

        # `states[i]` is the state after `i` batches.
        states = [reader.state_dict()]

        expected: list[SequenceBatch] = []

        for batches in reader:
            expected.extend(batches)

            states.append(reader.state_dict())

        assert len(expected) > 5

        # A second epoch is shuffled differently.
        reader.reset()

        second_epoch = [b for batches in reader for b in batches]

        assert _ids(second_epoch) != _ids(expected)

        for num_read, state in enumerate(states):
            # Through a file, as the trainer's checkpoints do.
            buffer = io.BytesIO()

            torch.save(state, buffer)

            buffer.seek(0)

            resumed_reader = create_reader()

            resumed_reader.load_state_dict(torch.load(buffer, weights_only=True))

            actual = [b for batches in resumed_reader for b in batches]

            assert _ids(actual) == _ids(expected[num_read:]), f"Resumed after {num_read} batch(es)."

            for a, e in zip(actual, expected[num_read:]):
                torch.testing.assert_close(a.seqs, e.seqs, rtol=0, atol=0)


    @pytest.mark.parametrize(
        ("change", "named"),
        [
            ({"examples": _examples(41)[1:]}, "the examples"),
            ({"seed": 6}, "`seed` 5 where the reader's is 6"),
            ({"shuffle_window": 0}, "`shuffle_window` 8 where the reader's is 0"),
            ({"batching": SFTBatching(max_seq_len=300, max_num_tokens=900)}, "`max_num_tokens` 600 where the reader's is 900"),
            ({"gangs": _gangs(0, 2)}, "`dp_size` 1 where the reader's is 2"),
        ],
        ids=["examples", "seed", "shuffle-window", "batching", "dp-size"],
    )
    def test_refuses_the_state_of_a_reader_of_other_examples_or_settings(self, tokenizer: Qwen35Tokenizer, change: dict[str, object], named: str) -> None:
        def create_reader(examples: list[InstructionExample] = _examples(40), seed: int = 5, shuffle_window: int = 8, batching: SFTBatching = SFTBatching(max_seq_len=300, max_num_tokens=600), gangs: Gangs = create_fake_gangs(CPU)):  # type: ignore[no-untyped-def]
            return create_sft_reader(
                examples, ChatEncoder(tokenizer), gangs, batching, pad_idx=tokenizer.vocab_info.pad_idx, split_name="train", shuffle_window=shuffle_window, seed=seed, prefetch=0  # type: ignore[arg-type]
            )

        reader = create_reader()

        next(reader)

        state = reader.state_dict()

        # Raises if the state were not that of a reader of the same data.
        create_reader().load_state_dict(state)

        with pytest.raises(ValueError, match=rf"^The reader state must be loaded into a reader of the same examples and settings, but differs in {re.escape(named)}\."):
            create_reader(**change).load_state_dict(state)  # type: ignore[arg-type]


    def test_loads_the_state_of_an_earlier_version_without_fingerprint_with_a_warning(self, tokenizer: Qwen35Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
        def create_reader():  # type: ignore[no-untyped-def]
            return create_sft_reader(
                _examples(20), ChatEncoder(tokenizer), create_fake_gangs(CPU), SFTBatching(max_seq_len=300, max_num_tokens=600), pad_idx=tokenizer.vocab_info.pad_idx, split_name="train", shuffle_window=None, seed=5, prefetch=0  # type: ignore[arg-type]
            )

        reader = create_reader()

        next(reader)

        # The pipeline's state alone, as earlier versions saved it.
        state = reader.state_dict()["pipeline"]

        expected = _ids([b for batches in reader for b in batches])

        resumed = create_reader()

        with caplog.at_level(logging.WARNING):
            resumed.load_state_dict(state)

        assert "has no fingerprint (an earlier version saved it)" in caplog.text

        assert _ids([b for batches in resumed for b in batches]) == expected


class TestFairseq2nDynamicBucket:
    """Pins the fairseq2n 0.8.1 behaviour that ``_PackSplitter`` works around:
    if this fails, fairseq2n keeps the pending buckets in its state, and
    ``split_keeping_remainder`` could return one bucket per pack again."""

    def test_state_lacks_the_buckets_it_has_not_yet_returned(self) -> None:
        def split(examples: list[int]) -> tuple[list[list[int]], list[int]]:
            return [[e] for e in examples[:-1]], examples[-1:]

        def create_pipeline() -> DataPipeline:
            # The first bucket, of examples 0 to 2, is split into [0], [1]
            # (queued) and 2 (kept for the next bucket).
            builder = read_sequence(list(range(6)))

            builder.dynamic_bucket(3, lambda example: 1.0, bucket_creation_fn=split)

            return builder.and_return()

        pipeline = create_pipeline()

        it = iter(pipeline)

        assert next(it) == [0]

        state = pipeline.state_dict()

        assert list(it) == [[1], [2], [3], [4], [5]]

        resumed_pipeline = create_pipeline()

        resumed_pipeline.load_state_dict(state)

        # [1] waited in the queue and is skipped.
        assert list(resumed_pipeline) == [[2], [3], [4], [5]]
