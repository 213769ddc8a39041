"""``IdleBatchReader``: a rank that has read all of its validation batches
gets idle batches while the others read theirs. The recipe-level check, an
expert-parallel validation on two processes with 2 and 1 batches, is in
``tests/integration/moe/test_moe_sft.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from typing_extensions import Self, override

from fairseq2.datasets import DataReader, SequenceBatch

from qwen35_fs2.recipes.idle_batches import IdleBatchReader, is_idle_batch

PAD_IDX = 7


class _ListReader(DataReader[SequenceBatch]):
    """What ``DataPipelineReader`` with ``SyncMode.UNTIL_LAST`` gives a rank
    with one batch while another rank has three: its batch, then empty lists
    until every rank is done."""

    def __init__(self, steps: list[list[SequenceBatch]]) -> None:
        self._steps = steps
        self._iter: Iterator[list[SequenceBatch]] = iter(steps)
        self.num_resets = 0

    @override
    def __iter__(self) -> Self:
        return self

    @override
    def __next__(self) -> list[SequenceBatch]:
        return next(self._iter)

    @override
    def reset(self) -> None:
        self._iter = iter(self._steps)

        self.num_resets += 1

    @override
    def state_dict(self) -> dict[str, object]:
        return {"position": 1}

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        assert state_dict == {"position": 1}

    @property
    @override
    def num_accumulate(self) -> int:
        return 3


def _batch() -> SequenceBatch:
    return SequenceBatch(torch.tensor([[1, 2, 3]]), [3], target_mask=torch.tensor([[False, True, True]]))


def test_a_rank_out_of_batches_gets_idle_batches_until_every_rank_is_done() -> None:
    batch = _batch()

    reader = IdleBatchReader(_ListReader([[batch], [], []]), PAD_IDX)

    steps = list(reader)

    assert len(steps) == 3

    assert steps[0] == [batch] and not is_idle_batch(batch)

    for step in steps[1:]:
        (idle,) = step

        assert is_idle_batch(idle)

        # Two pad tokens, nothing to predict: no target after the shift.
        assert idle.seqs.tolist() == [[PAD_IDX, PAD_IDX]]

        _, targets = idle.as_auto_regressive()

        assert targets.num_target_elements == 0

    # A batch of its own each time: the validator moves batches in place.
    assert steps[1][0] is not steps[2][0]

    with pytest.raises(StopIteration):
        next(reader)


def test_reset_state_and_accumulation_are_the_readers() -> None:
    inner = _ListReader([[_batch()]])

    reader = IdleBatchReader(inner, PAD_IDX)

    assert len(list(reader)) == 1

    reader.reset()

    assert inner.num_resets == 1

    assert len(list(reader)) == 1

    assert reader.state_dict() == {"position": 1}

    reader.load_state_dict({"position": 1})

    assert reader.num_accumulate == 3
