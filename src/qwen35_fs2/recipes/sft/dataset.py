"""Batches of chat-encoded instruction examples for SFT, padded or packed.

A padded batch is a ``(N, S)`` :class:`SequenceBatch` right-padded with the
pad token; a packed batch lays its examples end to end in one 1-D
``SequenceBatch(packed=True)`` whose ``seq_lens`` keep them apart, so
attention and Gated DeltaNet never mix two examples. Both carry a
``target_mask`` that is ``True`` on the response tokens only, so a packed
batch and a padded batch of the same examples have the same per-example
losses. After :meth:`SequenceBatch.as_auto_regressive` the last position of
a packed example predicts the first token of the next one, a prompt token,
which the mask excludes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, final

import torch
from typing_extensions import override

from fairseq2.data import CollateOptionsOverride, Collater, create_bucket_sizes
from fairseq2.data.data_pipeline import DataPipeline, DataPipelineBuilder, read_sequence
from fairseq2.datasets import DataPipelineReader, DataReader, SequenceBatch, SyncMode
from fairseq2.gang import Gangs
from fairseq2.logging import log

from qwen35_fs2.datasets.delegating import DelegatingReader
from qwen35_fs2.recipes.instruction import (
    ChatEncoder,
    InstructionDataError,
    InstructionExample,
)

EncodedExample = dict[str, Any]
"""A chat-encoded example: ``id``, ``indices`` and ``target_mask``."""


@final
@dataclass(frozen=True, kw_only=True)
class SFTBatching:
    """How examples are grouped into batches. The values are validated with
    the recipe's configuration."""

    max_seq_len: int
    """Longer examples are skipped, with a warning."""

    max_num_tokens: int
    """
    The maximum number of tokens of a batch, padding included; a multiple of
    ``max_seq_len`` for padded batches. Ignored if ``batch_size`` is set.
    """

    batch_size: int | None = None
    """If not ``None``, every padded batch has this many examples (the last
    one may have fewer)."""

    packing: bool = False
    """If ``True``, batches are packed instead of padded."""


def create_sft_reader(
    examples: Sequence[InstructionExample],
    encoder: ChatEncoder,
    gangs: Gangs,
    batching: SFTBatching,
    *,
    pad_idx: int,
    split_name: str,
    shuffle_window: int | None,
    seed: int,
    num_accumulate: int = 1,
    prefetch: int = 4,
    sync_mode: SyncMode = SyncMode.UNTIL_FIRST,
) -> DataReader[SequenceBatch]:
    """Returns a reader of this rank's share of ``examples``.

    With ``shuffle_window`` 0, examples are shuffled (the same way on every
    rank), then dealt to the data-parallel ranks in turn, so that each epoch
    deals the ranks other shares. With a window, they are dealt in turn in
    their order, and each rank shuffles its share within the window, a share
    that stays the rank's for every epoch. A windowed shuffle before the
    dealing would draw its random numbers as a rank reads, and ranks read
    different numbers of examples in an epoch (the ranks stop with the first
    one to run out, after reading ahead by a number of batches that depends
    on timing): from the second epoch on, the ranks would shuffle
    differently and deal themselves overlapping shares, training on some
    examples twice and never on others.

    The reader's state (position, shuffle and bucket buffers) is
    checkpointed by the trainer, so a resumed run reads exactly the batches
    an uninterrupted one would have; it holds a fingerprint of the examples
    and settings too, and loading it into a reader of others is an error.

    :param shuffle_window: The size of the shuffle buffer, 0 to shuffle all
        examples, ``None`` to keep the file order.
    """
    dp_size = gangs.dp.size

    if len(examples) < dp_size:
        raise InstructionDataError(
            f"The {split_name} split must have at least as many examples as data-parallel ranks ({dp_size}), but has {len(examples)}."
        )

    builder = read_sequence(list(examples))

    if shuffle_window == 0:
        builder.shuffle(0, seed=seed)

    builder.shard(gangs.dp.rank, dp_size, allow_uneven=True)

    if shuffle_window is not None and shuffle_window > 0:
        builder.shuffle(shuffle_window, seed=seed)

    builder.map(encoder)

    builder.filter(_LengthFilter(batching.max_seq_len, split_name))

    if batching.packing:
        _pack(builder, batching.max_num_tokens)
    else:
        _pad(builder, batching, pad_idx)

    builder.prefetch(prefetch)

    pipeline = builder.map(_to_batch).and_return()

    reader = DataPipelineReader[SequenceBatch](
        pipeline, gangs, num_accumulate=num_accumulate, sync=True, sync_mode=sync_mode
    )

    fingerprint = {
        "examples": _hash_examples(examples),
        "dp_rank": gangs.dp.rank,
        "dp_size": dp_size,
        "shuffle_window": shuffle_window,
        "seed": seed,
        **asdict(batching),
    }

    return _FingerprintedReader(reader, fingerprint)


def _hash_examples(examples: Sequence[InstructionExample]) -> str:
    """Returns the SHA-256 of ``examples``, in their order."""
    digest = hashlib.sha256()

    for example in examples:
        digest.update(json.dumps(example, sort_keys=True).encode())

        digest.update(b"\n")

    return digest.hexdigest()


@final
class _FingerprintedReader(DelegatingReader[SequenceBatch]):
    """``reader``, whose state also holds a fingerprint of its examples and
    settings, checked when the state is loaded.

    The state of a pipeline reader is its position and its shuffle and
    bucket buffers, which hold examples: loaded into a reader of other
    examples (a changed dataset, ``num_held_out_examples``,
    ``max_num_valid_examples``), another seed, other batching or another
    data-parallel rank or size, fairseq2 takes it without a word and the
    run goes on training on examples of the old split (held-out ones
    included) or skips others.
    """

    def __init__(self, reader: DataReader[SequenceBatch], fingerprint: dict[str, object]) -> None:
        super().__init__(reader)

        self._fingerprint = fingerprint

    @override
    def state_dict(self) -> dict[str, object]:
        return {"pipeline": self._reader.state_dict(), "fingerprint": dict(self._fingerprint)}

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        # The pipeline state alone, as earlier versions saved it.
        if "fingerprint" not in state_dict and "pipeline" not in state_dict:
            log.warning("The SFT reader state of the checkpoint has no fingerprint (an earlier version saved it): whether it belongs to the same examples and settings cannot be checked.")  # fmt: skip

            self._reader.load_state_dict(state_dict)

            return

        fingerprint = state_dict.get("fingerprint")

        if not isinstance(fingerprint, dict) or "pipeline" not in state_dict:
            raise ValueError("The reader state must have the `pipeline` state and the `fingerprint` of an SFT reader, but does not.")

        for key, value in self._fingerprint.items():
            if fingerprint.get(key) != value:
                what = "the examples" if key == "examples" else f"`{key}` {fingerprint.get(key)!r} where the reader's is {value!r}"

                raise ValueError(
                    f"The reader state must be loaded into a reader of the same examples and settings, but differs in {what}. "
                    "A resumed run must read the same data with the same settings on as many data-parallel ranks; start a new run in another output directory otherwise."
                )

        self._reader.load_state_dict(state_dict["pipeline"])  # type: ignore[arg-type]


@final
class _LengthFilter:
    def __init__(self, max_seq_len: int, split_name: str) -> None:
        self._max_seq_len = max_seq_len
        self._split_name = split_name
        self._num_skipped = 0

    def __call__(self, example: EncodedExample) -> bool:
        seq_len = len(example["indices"])

        if seq_len <= self._max_seq_len:
            return True

        self._num_skipped += 1

        log.warning("Skipped example {} of the {} split: its {} tokens exceed `max_seq_len` ({}); {} example(s) skipped on this rank so far.", example["id"], self._split_name, seq_len, self._max_seq_len, self._num_skipped)  # fmt: skip

        return False


def _pad(builder: DataPipelineBuilder, batching: SFTBatching, pad_idx: int) -> None:
    if batching.batch_size is not None:
        builder.bucket(batching.batch_size)
    else:
        bucket_sizes = create_bucket_sizes(
            max_num_elements=batching.max_num_tokens, max_seq_len=batching.max_seq_len
        )

        builder.bucket_by_length(bucket_sizes, selector="indices")

    collater = Collater(
        pad_value=pad_idx, overrides=[CollateOptionsOverride("target_mask", pad_value=False)]
    )

    builder.map(collater)


def _pack(builder: DataPipelineBuilder, max_num_tokens: int) -> None:
    split = _PackSplitter(max_num_tokens)

    builder.dynamic_bucket(
        max_num_tokens, _get_num_tokens, bucket_creation_fn=split.split_keeping_remainder
    )

    # `dynamic_bucket` returns runs of whole packs, and at the end of the data
    # its remainder as is, which may exceed `max_num_tokens`.
    builder.yield_from(split.split_all)

    builder.map(_collate_packed)


def _get_num_tokens(example: EncodedExample) -> float:
    return float(len(example["indices"]))


@final
class _PackSplitter:
    """Splits a run of examples, in order, into packs of at most
    ``max_num_tokens`` tokens.

    A pack is filled greedily: it takes the next example while the example
    fits. Greedy packing started at a pack boundary does not depend on how the
    examples are cut into runs, so :meth:`split_all` splits the examples of
    :meth:`split_keeping_remainder`'s bucket into the very packs that that
    method found.

    fairseq2n 0.8.1's ``dynamic_bucket`` returns the first of the buckets of
    its ``bucket_creation_fn`` at once and queues the others, but leaves that
    queue out of its state: a reader resumed from a state taken while a
    bucket waits there skips the bucket's examples. The ops before a
    ``prefetch`` read ahead by a number of batches that depends on timing, so
    whether a checkpoint falls on such a state is a matter of luck. Returning
    every complete pack in one bucket keeps the queue empty; ``yield_from``
    records how far it has read the packs of its bucket.
    """

    def __init__(self, max_num_tokens: int) -> None:
        self._max_num_tokens = max_num_tokens

    def _split(self, examples: Sequence[EncodedExample]) -> list[list[EncodedExample]]:
        packs: list[list[EncodedExample]] = [[]]

        num_tokens = 0

        for example in examples:
            seq_len = len(example["indices"])

            if packs[-1] and num_tokens + seq_len > self._max_num_tokens:
                packs.append([])

                num_tokens = 0

            packs[-1].append(example)

            num_tokens += seq_len

        return packs

    def split_keeping_remainder(
        self, examples: Sequence[EncodedExample]
    ) -> tuple[list[list[EncodedExample]], list[EncodedExample]]:
        """Returns the examples of the complete packs of ``examples`` as one
        bucket, and the examples of the last, partial pack.

        ``dynamic_bucket`` calls this once its examples reach
        ``max_num_tokens``, so at least one pack is complete: there are two
        or more packs, or one full pack, which no example can join. The bucket
        must not be empty: fairseq2n 0.8.1 takes its first pack unchecked,
        and the process aborts.
        """
        packs = self._split(examples)

        if sum(len(e["indices"]) for e in packs[-1]) < self._max_num_tokens:
            remainder = packs.pop()
        else:
            remainder = []

        return [[e for pack in packs for e in pack]], remainder

    def split_all(self, examples: Sequence[EncodedExample]) -> DataPipeline:
        return read_sequence(self._split(examples)).and_return()


def _collate_packed(examples: Sequence[EncodedExample]) -> dict[str, Any]:
    return {
        "id": [e["id"] for e in examples],
        "indices": torch.cat([e["indices"] for e in examples]),
        "target_mask": torch.cat([e["target_mask"] for e in examples]),
        "seq_lens": [len(e["indices"]) for e in examples],
    }


def _to_batch(data: dict[str, Any]) -> SequenceBatch:
    if "seq_lens" in data:
        return SequenceBatch(
            data["indices"],
            data["seq_lens"],
            packed=True,
            target_mask=data["target_mask"],
            example={"id": data["id"]},
        )

    indices, target_mask = data["indices"], data["target_mask"]

    return SequenceBatch(
        indices["seqs"],
        indices["seq_lens"],
        target_mask=target_mask["seqs"],
        example={"id": data["id"]},
    )


