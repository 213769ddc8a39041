from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from fairseq2.datasets import SequenceBatch

from qwen35_fs2.datasets.packing import DocumentPacker


def _unique_documents(lengths: list[int]) -> list[torch.Tensor]:
    # Every token is unique, so a token tells its document and position.
    return [torch.arange(d * 10_000, d * 10_000 + n) for d, n in enumerate(lengths)]


def _pack_all(
    packer: DocumentPacker, documents: list[torch.Tensor]
) -> list[SequenceBatch]:
    batches = []

    for tokens in documents:
        offset: int | None = 0

        while offset is not None:
            offset = packer.append(tokens, offset)

            if packer.is_full:
                batches.append(packer.take())

    if not packer.is_empty:
        batches.append(packer.take())

    return batches


class TestDocumentPacker:
    def test_append_splits_documents_repeating_the_last_token(self) -> None:
        packer = DocumentPacker(5, 4)

        tokens = torch.arange(7)

        assert packer.append(tokens) == 3  # segment [0, 1, 2, 3], max_seq_len
        assert packer.append(tokens, 3) == 3  # segment [3], fills the batch
        assert packer.is_full

        batch = packer.take()

        assert batch.seqs.tolist() == [0, 1, 2, 3, 3]
        assert batch.seq_lens == [4, 1]
        assert batch.packed
        assert batch.target_mask is not None
        assert batch.target_mask.tolist() == [False, True, True, True, False]

        assert packer.is_empty
        assert packer.append(tokens, 3) is None  # segment [3, 4, 5, 6]

        assert packer.take().seq_lens == [4]

    @pytest.mark.parametrize(
        "batch_width,max_seq_len", [(16, 16), (16, 5), (33, 64), (7, 2), (64, 9)]
    )
    def test_packing_preserves_every_token_and_document(
        self, batch_width: int, max_seq_len: int
    ) -> None:
        rng = random.Random(batch_width * 100 + max_seq_len)

        documents = _unique_documents([rng.randint(1, 50) for _ in range(40)])

        batches = _pack_all(DocumentPacker(batch_width, max_seq_len), documents)

        rebuilt: list[list[int]] = []

        for idx, batch in enumerate(batches):
            assert batch.seqs.shape == (sum(batch.seq_lens),)

            if idx < len(batches) - 1:
                assert sum(batch.seq_lens) == batch_width

            assert max(batch.seq_lens) <= max_seq_len

            seqs = batch.seqs.tolist()

            pos = 0

            for seq_len in batch.seq_lens:
                segment = seqs[pos : pos + seq_len]

                pos += seq_len

                doc_idx = segment[0] // 10_000

                # A segment never mixes documents.
                assert all(t // 10_000 == doc_idx for t in segment)

                if doc_idx == len(rebuilt) - 1:  # continues the last document
                    assert segment[0] == rebuilt[-1][-1]

                    rebuilt[-1].extend(segment[1:])
                else:
                    assert segment[0] == doc_idx * 10_000
                    assert doc_idx == len(rebuilt)

                    rebuilt.append(segment)

        assert rebuilt == [d.tolist() for d in documents]

    @pytest.mark.parametrize("batch_width,max_seq_len", [(16, 5), (7, 2), (40, 40)])
    def test_target_mask_keeps_each_in_document_prediction_exactly_once(
        self, batch_width: int, max_seq_len: int
    ) -> None:
        rng = random.Random(batch_width)

        documents = _unique_documents([rng.randint(1, 30) for _ in range(30)])

        batches = _pack_all(DocumentPacker(batch_width, max_seq_len), documents)

        pairs: Counter[tuple[int, int]] = Counter()

        for batch in batches:
            inputs, targets = batch.as_auto_regressive()

            assert targets.target_mask is not None

            for pos in targets.target_mask.nonzero().squeeze(-1).tolist():
                pairs[(int(inputs.seqs[pos]), int(targets.seqs[pos]))] += 1

        expected = Counter(
            (int(d[i]), int(d[i + 1])) for d in documents for i in range(len(d) - 1)
        )

        assert pairs == expected

    def test_take_returns_a_partial_batch_unpadded(self) -> None:
        # fairseq2's flash attention takes no padded batch.
        packer = DocumentPacker(8, 8)

        packer.append(torch.tensor([1, 2, 3]))
        packer.append(torch.tensor([4, 5]))

        batch = packer.take()

        assert batch.seqs.tolist() == [1, 2, 3, 4, 5]
        assert batch.seq_lens == [3, 2]
        assert batch.padding == 0
        assert batch.target_mask is not None
        assert batch.target_mask.tolist() == [False, True, True, False, True]

        seqs, layout = batch.as_input()

        assert layout.packed and not layout.padded

        assert layout.position_indices.tolist() == [0, 1, 2, 0, 1]

    def test_append_raises_error_when_batch_is_full(self) -> None:
        packer = DocumentPacker(2, 2)

        packer.append(torch.tensor([1, 2, 3]))

        with pytest.raises(ValueError, match="must be taken"):
            packer.append(torch.tensor([4]))

    def test_append_raises_error_when_offset_is_out_of_range(self) -> None:
        packer = DocumentPacker(8, 8)

        with pytest.raises(ValueError, match=r"`offset` must be a position in `tokens` \(0 to 2\), but is 3 instead"):  # fmt: skip
            packer.append(torch.tensor([1, 2, 3]), 3)

    def test_take_raises_error_when_batch_is_empty(self) -> None:
        with pytest.raises(ValueError, match="must have at least one segment"):
            DocumentPacker(8, 8).take()

    @pytest.mark.parametrize("batch_width,max_seq_len", [(1, 8), (8, 1)])
    def test_init_raises_error_when_sizes_are_too_small(
        self, batch_width: int, max_seq_len: int
    ) -> None:
        with pytest.raises(ValueError, match="must be greater than or equal to 2"):
            DocumentPacker(batch_width, max_seq_len)
