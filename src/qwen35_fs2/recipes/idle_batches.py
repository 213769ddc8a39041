"""Evaluation on data-parallel ranks that hold different numbers of batches.

With ``SyncMode.UNTIL_LAST``, fairseq2 lets every rank evaluate all of its
examples: a rank that has run out gets an empty list of batches while the
others go on, and fairseq2's validator then runs no forward pass on it. That
is right only when a forward pass needs no other rank. Under expert
parallelism every MoE layer exchanges tokens among the ranks, and a rank
that skips its forward pass leaves the others waiting in the exchange:
measured on two CPU processes (an SFT validation of 3 examples, 2 on one
rank and 1 on the other), gloo failed with "Connection closed by peer";
NCCL waits until its timeout. FSDP alone does not need this: fairseq2
validates with the full parameters summoned on every rank.

:class:`IdleBatchReader` hands such a rank an *idle batch* instead of nothing:
two pad tokens and no target. The evaluation unit runs the model on it, so
that the rank takes part in every exchange of the step, and records none of
its metrics (:func:`is_idle_batch`).
"""

from __future__ import annotations

from typing import Final, final

import torch
from typing_extensions import override

from fairseq2.datasets import DataReader, SequenceBatch

from qwen35_fs2.datasets.delegating import DelegatingReader


@final
class _IdleExample:
    """The ``example`` of every idle batch, by which it is told apart."""


_IDLE_EXAMPLE: Final = _IdleExample()


def is_idle_batch(batch: SequenceBatch) -> bool:
    """Returns ``True`` if ``batch`` is an idle batch of an
    :class:`IdleBatchReader`, whose forward pass must run and whose metrics
    must not count."""
    return batch.example is _IDLE_EXAMPLE


@final
class IdleBatchReader(DelegatingReader[SequenceBatch]):
    """Reads ``reader`` (with ``SyncMode.UNTIL_LAST``), and gives a rank that
    has read all of its batches, while other ranks have not, one idle batch
    per step instead of none."""

    def __init__(self, reader: DataReader[SequenceBatch], pad_idx: int) -> None:
        super().__init__(reader)

        self._pad_idx = pad_idx

    @override
    def __next__(self) -> list[SequenceBatch]:
        # Raises `StopIteration` once every rank has read all of its batches.
        batches = next(self._reader)

        if batches:
            return batches

        # A new batch each time: the validator moves it to the device.
        seqs = torch.full((1, 2), self._pad_idx, dtype=torch.int64)

        target_mask = torch.zeros((1, 2), dtype=torch.bool)

        return [SequenceBatch(seqs, [2], target_mask=target_mask, example=_IDLE_EXAMPLE)]
