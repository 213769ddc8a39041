from __future__ import annotations

import pytest
import torch

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

    def test_raises_error_when_the_split_has_fewer_examples_than_ranks(self, tokenizer: Qwen35Tokenizer) -> None:
        batching = SFTBatching(max_seq_len=512, max_num_tokens=1024, batch_size=1)

        with pytest.raises(InstructionDataError, match=r"The train split must have at least as many examples as data-parallel ranks \(4\), but has 3\."):
            _read_all(tokenizer, _examples(3), batching, gangs=_gangs(0, 4))

    @pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
    def test_resumes_exactly_from_a_state_dict(self, tokenizer: Qwen35Tokenizer, packing: bool) -> None:
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
                prefetch=2,
            )

        reader = create_reader()

        for _ in range(3):
            next(reader)

        state = reader.state_dict()

        expected = [b for batches in reader for b in batches]

        # A second epoch is shuffled differently.
        reader.reset()

        second_epoch = [b for batches in reader for b in batches]

        assert _ids(second_epoch) != _ids(expected)

        resumed_reader = create_reader()

        resumed_reader.load_state_dict(state)

        actual = [b for batches in resumed_reader for b in batches]

        assert _ids(actual) == _ids(expected)

        for a, e in zip(actual, expected):
            torch.testing.assert_close(a.seqs, e.seqs, rtol=0, atol=0)
