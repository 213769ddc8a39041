"""Packing of tokenized documents into fixed-width 1-D batches.

A packed batch is fairseq2's ``SequenceBatch(seqs, seq_lens, packed=True)``:
``seqs`` is 1-D of ``max_num_tokens + 1`` tokens (the extra token is the
target of the last input after ``as_auto_regressive()``), fewer in the last,
partial batch of an epoch, which is not padded (fairseq2's flash attention
takes no padded batch, and pads would cost compute); each entry
of ``seq_lens`` is a *segment*, which attention and Gated DeltaNet treat as an
independent sequence. Documents are laid end to end; a document longer than
``max_seq_len``, or than the space left in a batch, is split, and, as in
fairseq2's ``DataPipelineBuilder.pack``, the continuation segment starts with
the last token of the segment before it, so that the prediction of every
token from its predecessor survives the split.

Targets: ``target_mask`` is ``False`` at the first position of every
segment. A segment's first token is either the first token of
a document, which nothing in its own document predicts, or the repeated last
token of a split. The masked loss thus trains each next-token prediction
inside a document exactly once, and never one across documents. Pass
``target_batch.target_mask`` to the model's loss.
"""

from __future__ import annotations

from typing import final

import torch
from fairseq2.datasets import SequenceBatch
from torch import Tensor


@final
class DocumentPacker:
    """Fills one packed batch at a time from documents given segment by
    segment, so that the caller knows where each batch ends in its input and
    can resume there."""

    def __init__(
        self,
        batch_width: int,
        max_seq_len: int,
        *,
        pin_memory: bool = False,
    ) -> None:
        """
        :param batch_width: The number of tokens of a full batch,
            ``max_num_tokens + 1``.
        :param max_seq_len: The maximum length of a segment.
        :param pin_memory: If ``True``, batches are in pinned memory (only
            useful, and only possible, with CUDA).
        """
        if batch_width < 2:
            raise ValueError(f"`batch_width` must be greater than or equal to 2, but is {batch_width} instead.")  # fmt: skip

        if max_seq_len < 2:
            raise ValueError(f"`max_seq_len` must be greater than or equal to 2, but is {max_seq_len} instead.")  # fmt: skip

        self._batch_width = batch_width
        self._max_seq_len = max_seq_len
        self._pin_memory = pin_memory

        self._segments: list[Tensor] = []
        self._num_tokens = 0

    def append(self, tokens: Tensor, offset: int = 0) -> int | None:
        """Appends one segment of the document ``tokens``, starting at
        ``offset``, to the current batch.

        :returns: The offset at which the rest of the document starts (the last
            token of the appended segment), or ``None`` if the document is
            fully packed.
        """
        if self.is_full:
            raise ValueError("The current batch must be taken before appending to it, but is full.")  # fmt: skip

        if tokens.ndim != 1:
            raise ValueError(f"`tokens` must be one-dimensional, but has {tokens.ndim} dimension(s) instead.")  # fmt: skip

        num_tokens = tokens.size(0)

        if offset < 0 or offset >= num_tokens:
            raise ValueError(f"`offset` must be a position in `tokens` (0 to {num_tokens - 1}), but is {offset} instead.")  # fmt: skip

        space = self._batch_width - self._num_tokens

        seg_len = min(num_tokens - offset, self._max_seq_len, space)

        self._segments.append(tokens[offset : offset + seg_len])

        self._num_tokens += seg_len

        end = offset + seg_len
        if end == num_tokens:
            return None

        return end - 1

    def take(self) -> SequenceBatch:
        """Returns the current batch, of fewer tokens than the batch width if
        it is not full, and starts a new one."""
        if not self._segments:
            raise ValueError("The current batch must have at least one segment, but is empty.")  # fmt: skip

        seq_lens = [int(segment.size(0)) for segment in self._segments]

        seqs = torch.cat(self._segments)

        target_mask = torch.ones(self._num_tokens, dtype=torch.bool)

        seg_begin = 0

        for seq_len in seq_lens:
            target_mask[seg_begin] = False

            seg_begin += seq_len

        if self._pin_memory:
            seqs = seqs.pin_memory()

            target_mask = target_mask.pin_memory()

        self._segments = []
        self._num_tokens = 0

        return SequenceBatch(seqs, seq_lens, packed=True, target_mask=target_mask)

    @property
    def is_full(self) -> bool:
        return self._num_tokens == self._batch_width

    @property
    def is_empty(self) -> bool:
        return self._num_tokens == 0
