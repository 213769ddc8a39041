"""Continued pretraining data: parquet text shards (FineWeb-Edu
``sample-10BT`` by default), tokenized, packed and sharded across
data-parallel ranks, with exactly resumable reading.

The pieces, for a recipe:

- :class:`PretrainingDatasetConfig` is the ``dataset.config_overrides`` of a
  recipe; register the family with ``register_dataset_family(container,
  PRETRAINING_DATASET, PretrainingDataset, PretrainingDatasetConfig,
  opener=open_pretraining_dataset)``.
- :meth:`PretrainingDataset.create_reader` returns a :class:`PretrainingReader`,
  a fairseq2 ``DataReader[SequenceBatch]`` to hand to ``create_trainer``.

Semantics of the reader:

- **Batches** are packed 1-D ``SequenceBatch`` objects of ``max_num_tokens + 1``
  tokens with a ``target_mask``; see :mod:`qwen35_fs2.datasets.packing` for
  segments, splits and which targets count. Each document is encoded with
  ``tokenizer.create_encoder(mode="default")``, which appends the tokenizer's
  EOS: configure the Qwen3.5 tokenizer with ``eos_token: <|endoftext|>`` for
  pretraining. Empty and whitespace-only texts are skipped, with a logged
  count; a null text is an error naming its file and row. A text that holds
  the EOS token's string is encoded with the token inside it, as
  transformers' tokenizers do, and counted in a warning.
- **Sharding.** The unit of work is a parquet row group. Each epoch, the row
  groups are shuffled (``seed`` and the epoch number) and dealt to the ranks
  of ``gangs.dp``, each to the rank with the fewest text bytes so far, so
  ranks read disjoint data of similar size. Rows are shuffled within a row
  group. With ``shuffle=False`` the order is file order. Fewer row groups
  than ranks is an error. Tensor-parallel peers share a DP rank and so get
  the same batches.
- **Steps and epochs.** Each call returns ``num_accumulate`` batches. Ranks
  agree on every call (one all-gather of two integers over ``gangs.dp``) on
  the number of batches: when one rank runs out, all stop the epoch together
  (the rest of the others' epoch is dropped, as in fairseq2's
  ``SyncMode.UNTIL_FIRST``), and when one rank fails to read, all raise.
  For validation, ``SyncMode.UNTIL_LAST`` lets every rank read all of its
  batches: a rank that has run out gets empty lists (the recipes hand it
  idle batches) until the others have too.
  An epoch without a single batch on some rank is an error (the dataset is
  too small), not an endless series of empty epochs. Packing does not cross
  epochs: the last partial batch of an epoch is dropped or, with
  ``drop_remainder=False``, returned as it is, shorter than the others (not
  padded). :meth:`PretrainingReader.reset` starts the
  next epoch: the same row groups again, in a new order (the same order with
  ``shuffle=False``), and logs it. fairseq2's trainer calls it at the end of
  each epoch, its validator after each validation (a reset before the first
  batch of an epoch does nothing). With ``max_num_batches``
  an epoch ends after that many batches; with ``shuffle=False`` every epoch
  then reads the same first batches (bounded validation).
- **Resumption.** The state is the epoch, the number of batches the epoch
  has returned, and the position (row group, row, token) where the next batch
  starts; a batch always starts empty, so no tokens are saved. After
  ``load_state_dict`` the reader re-reads that row group and produces bitwise
  the batches an uninterrupted reader would have. The state records the
  dataset, seed, rank and packing parameters; loading it into a reader that
  differs in any of them is an error.
- **Throughput.** Reading, tokenization and packing run in a background
  thread, ``prefetch`` batches ahead; batches are in pinned memory when
  ``gangs.dp`` is on CUDA.

``BatchLayout.compiled_max_seq_len`` is left unset: no compiled code of this
package reads a layout's ``max_seq_len`` (fairseq2's flash attention does,
which then recompiles for a new longest document, correctly).
"""

from __future__ import annotations

import hashlib
import heapq
import queue
import random
import threading
import weakref
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Generic, Self, TypeAlias, TypeVar, final

import torch
from fairseq2.data.tokenizers import TokenEncoder, Tokenizer
from fairseq2.datasets import DataReader, DataReadError, SequenceBatch, SyncMode
from fairseq2.gang import Gangs
from fairseq2.logging import log
from typing_extensions import override

from qwen35_fs2.datasets.packing import DocumentPacker
from qwen35_fs2.datasets.parquet import (
    HG_URI_PREFIX,
    ParquetRowGroup,
    index_parquet_row_groups,
    read_parquet_texts,
    resolve_parquet_files,
)

PRETRAINING_DATASET: Final = "qwen35_pretraining"
"""The name of the pretraining dataset family."""

FINEWEB_EDU_URI: Final = "hg://HuggingFaceFW/fineweb-edu"

FINEWEB_EDU_SAMPLE_10BT: Final = ("sample/10BT/*.parquet",)
"""The files of the ``sample-10BT`` config of FineWeb-Edu (14 shards)."""

_STATE_VERSION: Final = 1


@dataclass(kw_only=True)
class PretrainingDatasetConfig:
    paths: list[str] = field(default_factory=lambda: [FINEWEB_EDU_URI])
    """
    Parquet files, directories (searched recursively for ``*.parquet``) and
    ``hg://org/dataset`` Hugging Face Hub dataset repositories.
    """

    hf_allow_patterns: list[str] = field(
        default_factory=lambda: list(FINEWEB_EDU_SAMPLE_10BT)
    )
    """The files of ``hg://`` repositories to download and read."""

    text_column: str = "text"
    """The string column holding the documents."""


@final
class PretrainingDataset:
    """A corpus of parquet text shards. Files are resolved, and ``hg://``
    repositories downloaded, when a reader is created, since that needs the
    gangs."""

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        hf_allow_patterns: Sequence[str] = FINEWEB_EDU_SAMPLE_10BT,
        text_column: str = "text",
    ) -> None:
        if not paths:
            raise ValueError("`paths` must contain at least one path or URI, but is empty instead.")  # fmt: skip

        self._paths = list(paths)
        self._hf_allow_patterns = list(hf_allow_patterns)
        self._text_column = text_column

    def create_reader(
        self,
        tokenizer: Tokenizer,
        gangs: Gangs,
        *,
        max_seq_len: int,
        max_num_tokens: int,
        num_accumulate: int = 1,
        seed: int = 2,
        shuffle: bool = True,
        drop_remainder: bool = True,
        max_num_batches: int | None = None,
        prefetch: int = 4,
        sync_mode: SyncMode = SyncMode.UNTIL_FIRST,
    ) -> PretrainingReader:
        """
        :param max_seq_len: The maximum length of a packed segment; longer
            documents are split.
        :param max_num_tokens: The number of input tokens of a batch; batches
            hold ``max_num_tokens + 1`` tokens.
        :param num_accumulate: The number of batches returned per call, for
            gradient accumulation.
        :param seed: The seed of the shuffling, the same on every rank.
        :param shuffle: If ``False``, row groups and rows are read in file
            order (for validation).
        :param drop_remainder: If ``False``, the last partial batch of an epoch
            is returned, shorter than the others, instead of dropped.
        :param max_num_batches: If not ``None``, each epoch ends after this
            many batches on every rank (for bounded validation).
        :param prefetch: The number of batches prepared ahead in a background
            thread; 0 prepares them in the calling thread.
        :param sync_mode: ``UNTIL_FIRST`` (training): an epoch ends on every
            rank when one rank runs out. ``UNTIL_LAST`` (validation): every
            rank reads all of its batches, a rank that has run out gets empty
            lists until the others have too.
        """
        files = _resolve_files_on_gangs(self._paths, self._hf_allow_patterns, gangs)

        row_groups = index_parquet_row_groups(files, text_column=self._text_column)

        _check_same_row_groups_on_ranks(files, row_groups, gangs)

        log.info("Reading {} parquet file(s): {} row group(s), {} document(s).", len(files), len(row_groups), sum(rg.num_rows for rg in row_groups))  # fmt: skip

        vocab_info = tokenizer.vocab_info

        encoder = tokenizer.create_encoder(mode="default")

        suffix = encoder.suffix_indices
        if vocab_info.eos_idx is None or suffix is None or suffix.tolist() != [vocab_info.eos_idx]:  # fmt: skip
            raise ValueError(
                f"The tokenizer's default mode must end each document with its EOS token, but appends {None if suffix is None else suffix.tolist()} instead (EOS index: {vocab_info.eos_idx})."
            )

        return PretrainingReader(
            row_groups,
            encoder,
            gangs,
            text_column=self._text_column,
            max_seq_len=max_seq_len,
            max_num_tokens=max_num_tokens,
            num_accumulate=num_accumulate,
            seed=seed,
            shuffle=shuffle,
            drop_remainder=drop_remainder,
            max_num_batches=max_num_batches,
            prefetch=prefetch,
            sync_mode=sync_mode,
            pin_memory=gangs.dp.device.type == "cuda",
            tokenizer_id=f"vocab_size={vocab_info.size},eos_idx={vocab_info.eos_idx}",
        )


def open_pretraining_dataset(config: PretrainingDatasetConfig) -> PretrainingDataset:
    """The opener of the :data:`PRETRAINING_DATASET` family."""
    return PretrainingDataset(
        config.paths,
        hf_allow_patterns=config.hf_allow_patterns,
        text_column=config.text_column,
    )


def _resolve_files_on_gangs(
    paths: Sequence[str | Path], hf_allow_patterns: Sequence[str], gangs: Gangs
) -> list[Path]:
    # Without a remote source every rank resolves on its own.
    if gangs.root.size == 1 or not any(str(p).startswith(HG_URI_PREFIX) for p in paths):  # fmt: skip
        return resolve_parquet_files(paths, hf_allow_patterns=hf_allow_patterns)

    # Rank 0 downloads first, so that the others find the files in a shared
    # cache instead of all querying the Hub. Its outcome is broadcast, so that
    # a failed download fails every rank instead of leaving them waiting.
    outcome: list[object] = [None]

    files: list[Path] = []

    if gangs.root.rank == 0:
        log.info("Rank 0 resolves {} (files {}) in the Hugging Face cache, downloading what it lacks, while the other ranks wait for up to `gang.timeout`; download large datasets beforehand (docs/slurm.md, \"The first run on a cold Hugging Face cache\").", ", ".join(map(str, paths)), list(hf_allow_patterns))  # fmt: skip

        try:
            files = resolve_parquet_files(paths, hf_allow_patterns=hf_allow_patterns)
        except Exception as ex:
            outcome[0] = f"{type(ex).__name__}: {ex}"

            gangs.root.broadcast_objects(outcome)

            raise

    gangs.root.broadcast_objects(outcome)

    if outcome[0] is not None:
        raise DataReadError(f"Rank 0 failed to download the dataset: {outcome[0]}")

    if gangs.root.rank != 0:
        try:
            files = resolve_parquet_files(
                paths, hf_allow_patterns=hf_allow_patterns, local_files_only=True
            )
        except (FileNotFoundError, OSError):
            # No cache shared with rank 0 (e.g. on another node).
            files = resolve_parquet_files(paths, hf_allow_patterns=hf_allow_patterns)

    return files


def row_groups_digest(row_groups: Sequence[ParquetRowGroup]) -> bytes:
    """Returns the SHA-256 of the files' names, indices and row counts of
    ``row_groups``, in order: what identifies a dataset's layout across
    ranks and runs without reading its contents."""
    digest = hashlib.sha256()

    for rg in row_groups:
        digest.update(f"{rg.file.name}:{rg.index}:{rg.num_rows}\n".encode())

    return digest.digest()


def _check_same_row_groups_on_ranks(
    files: Sequence[Path], row_groups: Sequence[ParquetRowGroup], gangs: Gangs
) -> None:
    """Raises an error on every rank if some rank found other parquet row
    groups than rank 0.

    The ranks deal out the row groups of the list each of them resolved, so
    lists that differ make them read some row groups twice and others never.
    A ``hg://`` source resolves from each node's Hugging Face cache, which
    ``huggingface_hub`` does not check for completeness: a node-local cache
    left by an interrupted or narrower download yields fewer files, as can
    a local directory that differs between nodes.
    """
    if gangs.root.size == 1:
        return

    digest = row_groups_digest(row_groups)

    # The counts, for the message, and the digest as four int64 values.
    words = [len(files), len(row_groups)] + [
        int.from_bytes(digest[idx : idx + 8], "little", signed=True) for idx in range(0, len(digest), 8)  # fmt: skip
    ]

    local = torch.tensor(words, dtype=torch.int64, device=gangs.root.device)

    gathered = [torch.empty_like(local) for _ in range(gangs.root.size)]

    gangs.root.all_gather_to_list(gathered, local)

    reference = gathered[0]

    differing = [rank for rank, words in enumerate(gathered) if not torch.equal(words, reference)]

    if differing:
        found = "; ".join(
            f"rank {rank}: {int(gathered[rank][0])} file(s), {int(gathered[rank][1])} row group(s)"
            for rank in [0] + differing
        )

        raise DataReadError(
            f"Every rank must read the same parquet row groups, but rank(s) {differing} found other ones than rank 0 ({found}). A Hugging Face cache holding part of a download (a node-local cache, an interrupted download) or local files that differ between nodes cause this; complete the cache (`hf download --repo-type dataset REPO --include PATTERN`) or point all nodes at one shared cache (`HF_HOME`)."
        )


@final
@dataclass(frozen=True)
class _Cursor:
    """Where the next batch of an epoch starts: the row group (an index into
    this rank's plan), the row (an index into the row group's row order) and
    the token of that row's document."""

    unit: int
    row: int
    token: int


@final
@dataclass(frozen=True)
class _Unit:
    """A row group as one rank reads it in one epoch."""

    row_group: ParquetRowGroup

    row_seed: int | None
    """The seed of the order of the rows, or ``None`` for file order."""


_BatchAndCursor = tuple[SequenceBatch, _Cursor]


@final
class PretrainingReader(DataReader[SequenceBatch]):
    """Reads packed batches from parquet row groups; see the module docstring
    for the sharding, epoch and resumption semantics."""

    def __init__(
        self,
        row_groups: Sequence[ParquetRowGroup],
        encoder: TokenEncoder,
        gangs: Gangs,
        *,
        text_column: str,
        max_seq_len: int,
        max_num_tokens: int,
        num_accumulate: int = 1,
        seed: int = 2,
        shuffle: bool = True,
        drop_remainder: bool = True,
        max_num_batches: int | None = None,
        prefetch: int = 4,
        sync_mode: SyncMode = SyncMode.UNTIL_FIRST,
        pin_memory: bool = False,
        tokenizer_id: str = "",
    ) -> None:
        """
        :param row_groups: The row groups of the whole dataset, the same on
            every rank (see :func:`index_parquet_row_groups`).
        :param encoder: Encodes a document, ending it with EOS.
        :param tokenizer_id: Identifies the tokenizer in the state, so that a
            state is not loaded with another tokenizer.

        See :meth:`PretrainingDataset.create_reader` for the other parameters.
        """
        dp_size = gangs.dp.size

        if len(row_groups) < dp_size:
            raise ValueError(
                f"The dataset must have at least as many non-empty parquet row groups as data-parallel ranks ({dp_size}), but has {len(row_groups)} instead. Use more or smaller row groups, or fewer ranks."
            )

        if max_num_tokens < 1:
            raise ValueError(f"`max_num_tokens` must be greater than or equal to 1, but is {max_num_tokens} instead.")  # fmt: skip

        if max_seq_len < 2:
            raise ValueError(f"`max_seq_len` must be greater than or equal to 2, but is {max_seq_len} instead.")  # fmt: skip

        if num_accumulate < 1:
            raise ValueError(f"`num_accumulate` must be greater than or equal to 1, but is {num_accumulate} instead.")  # fmt: skip

        if max_num_batches is not None and max_num_batches < 1:
            raise ValueError(f"`max_num_batches` must be greater than or equal to 1, but is {max_num_batches} instead.")  # fmt: skip

        if prefetch < 0:
            raise ValueError(f"`prefetch` must be greater than or equal to 0, but is {prefetch} instead.")  # fmt: skip

        self._row_groups = list(row_groups)
        self._files = sorted({row_group.file.absolute() for row_group in self._row_groups})
        self._encoder = encoder
        self._gangs = gangs
        self._text_column = text_column
        self._max_seq_len = max_seq_len
        self._batch_width = max_num_tokens + 1
        self._num_accumulate = num_accumulate
        self._seed = seed
        self._shuffle = shuffle
        self._drop_remainder = drop_remainder
        self._max_num_batches = max_num_batches
        self._prefetch = prefetch
        self._sync_mode = sync_mode
        self._pin_memory = pin_memory

        # Everything the batch stream depends on, except the file contents.
        self._fingerprint: dict[str, object] = {
            "row_groups": row_groups_digest(self._row_groups).hex(),
            "tokenizer": tokenizer_id,
            "text_column": text_column,
            "dp_rank": gangs.dp.rank,
            "dp_size": dp_size,
            "seed": seed,
            "shuffle": shuffle,
            "max_seq_len": max_seq_len,
            "max_num_tokens": max_num_tokens,
            "drop_remainder": drop_remainder,
            "max_num_batches": max_num_batches,
        }

        self._epoch = 0
        self._cursor = _Cursor(0, 0, 0)
        self._num_batches = 0
        self._epoch_started = False
        self._eod = False
        self._source: _BatchSource | None = None
        self._source_finalizer: weakref.finalize[[], PretrainingReader] | None = None

    @property
    def files(self) -> list[Path]:
        """The parquet files the reader reads, as absolute paths (not
        resolved: a Hugging Face cache links equal files to one blob), in
        order."""
        return self._files

    @override
    def __iter__(self) -> Self:
        return self

    @override
    def __next__(self) -> list[SequenceBatch]:
        if self._eod:
            raise StopIteration()

        num_wanted = self._num_accumulate

        if self._max_num_batches is not None:
            num_wanted = min(num_wanted, self._max_num_batches - self._num_batches)

            # Until the first, every rank reaches the cap at the same call (the
            # ranks agree on the number of batches of every call); until the
            # last, a rank at its cap takes part in the others' calls.
            if num_wanted == 0 and self._sync_mode == SyncMode.UNTIL_FIRST:
                self._eod = True

                raise StopIteration()

        if self._source is None:
            self._source = self._open_source()

        batches: list[SequenceBatch] = []
        cursors: list[_Cursor] = []

        error: Exception | None = None

        for _ in range(num_wanted):
            try:
                batch, cursor = next(self._source)
            except StopIteration:
                break
            except Exception as ex:  # Reported to the other ranks first.
                error = ex

                # The next call starts over from the last returned batch.
                self._close_source()

                break

            batches.append(batch)
            cursors.append(cursor)

        counts = self._sync(len(batches), error)

        if self._sync_mode == SyncMode.UNTIL_FIRST:
            num_batches = min(counts)

            epoch_ends = num_batches == 0
        else:
            num_batches = len(batches)

            epoch_ends = max(counts) == 0

        if epoch_ends:
            # Every rank decides alike: until the first, all ranks have read
            # the same batches; until the last, all know if any rank has.
            if not self._epoch_started:
                raise DataReadError(self._empty_epoch_message())

            self._eod = True

            raise StopIteration()

        self._epoch_started = True

        if num_batches > 0:
            self._cursor = cursors[num_batches - 1]

        self._num_batches += num_batches

        return batches[:num_batches]

    def _empty_epoch_message(self) -> str:
        message = f"Epoch {self._epoch} must have at least one batch on every data-parallel rank, but has none on at least one of the {self._gangs.dp.size} rank(s): the dataset is too small for batches of {self._batch_width} tokens."  # fmt: skip

        if self._drop_remainder:
            message += " Use smaller batches, fewer ranks, or `drop_remainder=False` to keep the last, partial batch of each epoch."  # fmt: skip

        return message

    def _sync(self, num_batches: int, error: Exception | None) -> list[int]:
        """Returns the number of batches each data-parallel rank read in
        this call, or raises if one of them failed to read."""
        gang = self._gangs.dp

        if gang.size == 1:
            if error is not None:
                raise error

            return [num_batches]

        local = torch.tensor(
            [num_batches, error is not None], dtype=torch.int64, device=gang.device
        )

        # A list, not a stacked tensor: Gloo gathers only into lists or flat
        # tensors, and fairseq2's `FakeGang` only into lists or stacks.
        gathered = [torch.zeros_like(local) for _ in range(gang.size)]

        gang.all_gather_to_list(gathered, local)

        if error is not None:
            raise error

        failed_ranks = [rank for rank, t in enumerate(gathered) if t[1] != 0]
        if failed_ranks:
            raise DataReadError(
                f"Data-parallel rank(s) {failed_ranks} failed to read the dataset; see their logs."
            )

        return [int(t[0]) for t in gathered]

    def _open_source(self) -> _BatchSource:
        packer = DocumentPacker(
            self._batch_width,
            self._max_seq_len,
            pin_memory=self._pin_memory,
        )

        batches = _produce_batches(
            self._plan_epoch(self._epoch),
            self._cursor,
            self._encoder,
            packer,
            text_column=self._text_column,
            drop_remainder=self._drop_remainder,
        )

        source: _BatchSource

        if self._prefetch == 0:
            source = batches
        else:
            source = _BackgroundIterator(batches, self._prefetch)

        # Stops the background thread if the reader is dropped mid-epoch; the
        # producer holds no reference to the reader.
        self._source_finalizer = weakref.finalize(self, source.close)

        return source

    def _plan_epoch(self, epoch: int) -> list[_Unit]:
        """Returns this rank's row groups for ``epoch``, in reading order."""
        order = list(range(len(self._row_groups)))

        if self._shuffle:
            random.Random(_seed_of(self._seed, epoch)).shuffle(order)

        # Greedy balancing by text bytes; ties go to the lowest rank, so the
        # first row groups go to distinct ranks.
        loads = [(0, rank) for rank in range(self._gangs.dp.size)]

        plan: list[_Unit] = []

        for rg_idx in order:
            load, rank = heapq.heappop(loads)

            if rank == self._gangs.dp.rank:
                row_seed = (
                    _seed_of(self._seed, epoch, rg_idx) if self._shuffle else None
                )

                plan.append(_Unit(self._row_groups[rg_idx], row_seed))

            num_bytes = max(self._row_groups[rg_idx].num_bytes, 1)

            heapq.heappush(loads, (load + num_bytes, rank))

        return plan

    def _close_source(self) -> None:
        if self._source_finalizer is not None:
            self._source_finalizer()

        self._source = None
        self._source_finalizer = None

    @override
    def reset(self) -> None:
        """Starts the next epoch, unless the current one has not started:
        fairseq2's validator resets a reader when it runs out and again after
        the validation, which must start one epoch, not two."""
        if not self._eod and self._num_batches == 0 and self._cursor == _Cursor(0, 0, 0):
            return

        self._close_source()

        order = "in a new order" if self._shuffle else "in the same order"

        # Epochs counted from 1 in the log, as fairseq2's trainer counts them.
        log.info("Data epoch {} ended after {} batch(es) on this rank; epoch {} reads the same {} row group(s) again, {}.", self._epoch + 1, self._num_batches, self._epoch + 2, len(self._row_groups), order)  # fmt: skip

        self._epoch += 1
        self._cursor = _Cursor(0, 0, 0)
        self._num_batches = 0
        self._epoch_started = False
        self._eod = False

    @override
    def state_dict(self) -> dict[str, object]:
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "unit": self._cursor.unit,
            "row": self._cursor.row,
            "token": self._cursor.token,
            "num_batches": self._num_batches,
            "fingerprint": dict(self._fingerprint),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        version = state_dict.get("version")
        if version != _STATE_VERSION:
            raise ValueError(f"The version of the reader state must be {_STATE_VERSION}, but is {version} instead.")  # fmt: skip

        fingerprint = state_dict.get("fingerprint")
        if not isinstance(fingerprint, dict):
            raise ValueError(f"The reader state must have a `fingerprint` dictionary, but has {fingerprint!r} instead.")  # fmt: skip

        for key, value in self._fingerprint.items():
            if fingerprint.get(key) != value:
                raise ValueError(
                    f"The reader state must be loaded into a reader of the same dataset and settings, but its `{key}` is {fingerprint.get(key)!r} where the reader's is {value!r}."
                )

        position: list[int] = []

        # States saved before `max_num_batches` existed have no `num_batches`;
        # their readers had no cap, which is the only use of it.
        state_dict = {"num_batches": 0, **state_dict}

        for key in ("epoch", "unit", "row", "token", "num_batches"):
            value = state_dict.get(key)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"`{key}` of the reader state must be a non-negative integer, but is {value!r} instead.")  # fmt: skip

            position.append(value)

        self._close_source()

        self._epoch = position[0]
        self._cursor = _Cursor(*position[1:4])
        self._num_batches = position[4]
        self._epoch_started = self._num_batches > 0 or self._cursor != _Cursor(0, 0, 0)
        self._eod = False

    @property
    @override
    def num_accumulate(self) -> int:
        return self._num_accumulate

    @property
    def epoch(self) -> int:
        """The current epoch, counted from 0."""
        return self._epoch


def _seed_of(*keys: int) -> int:
    """Returns a seed derived from ``keys``, the same in every process (unlike
    one derived with ``hash``)."""
    digest = hashlib.sha256(repr(keys).encode()).digest()

    return int.from_bytes(digest[:8], "little")


def _produce_batches(
    plan: Sequence[_Unit],
    start: _Cursor,
    encoder: TokenEncoder,
    packer: DocumentPacker,
    *,
    text_column: str,
    drop_remainder: bool,
) -> Generator[_BatchAndCursor, None, None]:
    """Yields the batches of an epoch from ``start`` on, each with the cursor
    of the batch after it."""
    # The EOS the encoder appends (checked when the reader was made).
    suffix = encoder.suffix_indices

    eos_idx = None if suffix is None else int(suffix[-1])

    for unit_idx in range(start.unit, len(plan)):
        unit = plan[unit_idx]

        texts = read_parquet_texts(unit.row_group, text_column=text_column)

        order = list(range(len(texts)))

        if unit.row_seed is not None:
            random.Random(unit.row_seed).shuffle(order)

        num_skipped = num_inner_eos = 0

        for row in range(start.row if unit_idx == start.unit else 0, len(order)):
            text = texts[order[row]]

            if not text.strip():
                num_skipped += 1

                continue

            tokens = encoder(text)

            if eos_idx is not None and bool((tokens[:-1] == eos_idx).any()):
                num_inner_eos += 1

            offset: int | None = 0
            if unit_idx == start.unit and row == start.row:
                offset = start.token

            while offset is not None:
                offset = packer.append(tokens, offset)

                if packer.is_full:
                    if offset is not None:
                        cursor = _Cursor(unit_idx, row, offset)
                    elif row + 1 < len(order):
                        cursor = _Cursor(unit_idx, row + 1, 0)
                    else:
                        cursor = _Cursor(unit_idx + 1, 0, 0)

                    yield packer.take(), cursor

        if num_skipped > 0:
            log.warning("Skipped {} empty or whitespace-only document(s) in row group {} of {}.", num_skipped, unit.row_group.index, unit.row_group.file)  # fmt: skip

        if num_inner_eos > 0:
            log.warning("{} document(s) in row group {} of {} hold the end-of-document token {} inside their text (e.g. a page quoting `<|endoftext|>`), which the tokenizer encodes as the token itself, as transformers' does: the model is trained to go on writing after it within the document. Filter such documents out of the data if that is not wanted.", num_inner_eos, unit.row_group.index, unit.row_group.file, eos_idx)  # fmt: skip

    if not drop_remainder and not packer.is_empty:
        yield packer.take(), _Cursor(len(plan), 0, 0)


T = TypeVar("T")


@final
class _BackgroundIterator(Generic[T]):
    """Runs a generator in a daemon thread, at most ``capacity`` items
    ahead of the consumer."""

    _END: Final = object()

    def __init__(self, generator: Generator[T, None, None], capacity: int) -> None:
        self._generator = generator
        self._queue: queue.Queue[tuple[object, BaseException | None]] = queue.Queue(capacity)  # fmt: skip
        self._stop = threading.Event()
        self._done = False

        self._thread = threading.Thread(
            target=self._run, name="qwen35-data-reader", daemon=True
        )

        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._generator:
                if not self._put((item, None)):
                    return

            self._put((self._END, None))
        except BaseException as ex:
            self._put((None, ex))
        finally:
            self._generator.close()

    def _put(self, entry: tuple[object, BaseException | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
            except queue.Full:
                continue

            return True

        return False

    def __next__(self) -> T:
        if self._done:
            raise StopIteration()

        item, error = self._queue.get()

        if error is not None:
            self._done = True

            raise error

        if item is self._END:
            self._done = True

            raise StopIteration()

        return item  # type: ignore[return-value]

    def close(self) -> None:
        self._stop.set()

        self._thread.join()


# The batches of the current epoch, with a way to abandon them.
_BatchSource: TypeAlias = (
    Generator[_BatchAndCursor, None, None] | _BackgroundIterator[_BatchAndCursor]
)
