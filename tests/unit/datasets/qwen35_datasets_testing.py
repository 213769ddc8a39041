"""Helpers of the data-layer tests, importable by spawned worker processes
(hence not in ``conftest.py``).

Most tests use :class:`ByteTokenizer`: the reader's packing, sharding and
resumption do not depend on the vocabulary, and with one token per UTF-8 byte
the expected token streams are computed independently of the code under test.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Final, final

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import torch
from fairseq2.data.tokenizers import (
    TokenDecoder,
    TokenEncoder,
    Tokenizer,
    VocabularyInfo,
)
from fairseq2.datasets import SequenceBatch, SyncMode
from fairseq2.device import CPU, Device
from fairseq2.gang import FakeGang, Gangs, ProcessGroupGang, create_parallel_gangs
from torch import Tensor
from typing_extensions import override

BYTE_EOS: Final = 256


@final
class ByteEncoder(TokenEncoder):
    def __init__(self, suffix: list[int]) -> None:
        self._suffix = suffix

    @override
    def __call__(self, text: str) -> Tensor:
        return torch.tensor(list(text.encode()) + self._suffix, dtype=torch.int64)

    @override
    def encode_as_tokens(self, text: str) -> list[str]:
        return [str(idx) for idx in self(text).tolist()]

    @property
    @override
    def prefix_indices(self) -> Tensor | None:
        return None

    @property
    @override
    def suffix_indices(self) -> Tensor | None:
        return torch.tensor(self._suffix) if self._suffix else None


@final
class ByteDecoder(TokenDecoder):
    @override
    def __call__(self, token_indices: Tensor) -> str:
        return bytes(i for i in token_indices.tolist() if i < 256).decode()

    @override
    def decode_from_tokens(self, tokens: Sequence[str]) -> str:
        return self(torch.tensor([int(t) for t in tokens]))


@final
class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte; EOS is 256, appended in ``default`` mode
    unless ``eos_in_default_mode`` is ``False``."""

    def __init__(self, *, eos_in_default_mode: bool = True) -> None:
        self._eos_in_default_mode = eos_in_default_mode

    @override
    def create_encoder(
        self,
        *,
        task: str | None = None,
        lang: str | None = None,
        mode: str | None = None,
        device: Device | None = None,
        pin_memory: bool = False,
    ) -> TokenEncoder:
        if mode in (None, "default") and self._eos_in_default_mode:
            return ByteEncoder([BYTE_EOS])

        return ByteEncoder([])

    @override
    def create_raw_encoder(
        self, *, device: Device | None = None, pin_memory: bool = False
    ) -> TokenEncoder:
        return ByteEncoder([])

    @override
    def create_decoder(self, *, skip_special_tokens: bool = False) -> TokenDecoder:
        return ByteDecoder()

    @property
    @override
    def vocab_info(self) -> VocabularyInfo:
        return VocabularyInfo(
            size=257, unk_idx=None, bos_idx=None, eos_idx=BYTE_EOS, pad_idx=None
        )


def byte_tokens(text: str) -> list[int]:
    """The tokens of a document as :class:`ByteTokenizer` encodes it."""
    return list(text.encode()) + [BYTE_EOS]


def fake_gangs(rank: int, size: int) -> Gangs:
    """Gangs of one process playing data-parallel ``rank`` of ``size``."""
    gang = FakeGang(CPU, rank=rank, size=size)

    single = FakeGang(CPU)

    return Gangs(root=gang, dp=gang, rdp=gang, sdp=single, tp=single, pp=single)


_LOCATION: Final = re.compile(r"^<(\d+)\.(\d+)\.(\d+)>")

_WORDS: Final = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")


def write_text_shards(
    out_dir: Path,
    row_group_sizes: Sequence[Sequence[int]],
    *,
    seed: int,
    max_words: int = 60,
) -> list[list[list[str]]]:
    """Writes one parquet file per entry of ``row_group_sizes``, with row
    groups of the given numbers of rows, as ``out_dir/shard_<f>.parquet``.
    Each text starts with its location ``<file.row_group.row>``, so a decoded
    document tells where it was read from.

    :returns: The texts, indexed by file, row group and row.
    """
    rng = random.Random(seed)

    out_dir.mkdir(parents=True, exist_ok=True)

    texts: list[list[list[str]]] = []

    for file_idx, sizes in enumerate(row_group_sizes):
        file_texts = []

        path = out_dir.joinpath(f"shard_{file_idx}.parquet")

        schema = pa.schema([("text", pa.string()), ("id", pa.string())])

        with pq.ParquetWriter(path, schema) as writer:
            for rg_idx, num_rows in enumerate(sizes):
                rg_texts = []

                for row in range(num_rows):
                    words = rng.choices(_WORDS, k=rng.randint(0, max_words))

                    rg_texts.append(f"<{file_idx}.{rg_idx}.{row}> " + " ".join(words))

                writer.write_table(
                    pa.table({"text": rg_texts, "id": [str(i) for i in range(num_rows)]}, schema=schema)  # fmt: skip
                )

                file_texts.append(rg_texts)

        texts.append(file_texts)

    return texts


def location_of(document: Sequence[int]) -> tuple[int, int, int]:
    """Returns the location of a document of :func:`write_text_shards`."""
    text = bytes(t for t in document if t < 256).decode()

    match = _LOCATION.match(text)
    if match is None:
        raise AssertionError(f"Document {text[:40]!r} has no location prefix.")

    return int(match[1]), int(match[2]), int(match[3])


def flatten(batch_lists: Iterable[list[SequenceBatch]]) -> list[SequenceBatch]:
    return [batch for batches in batch_lists for batch in batches]


def unpack_documents(batches: Iterable[SequenceBatch], eos: int) -> list[list[int]]:
    """Reassembles the documents of packed batches, checking the packing
    contract on the way: segments fill batches from the start, and a segment
    after one that does not end with ``eos`` continues its document and starts
    with that segment's last token. Documents must hold ``eos`` only at their
    end."""
    documents: list[list[int]] = []

    current: list[int] | None = None

    for batch in batches:
        assert batch.packed

        seqs = batch.seqs.tolist()

        pos = 0

        for seq_len in batch.seq_lens:
            segment = seqs[pos : pos + seq_len]

            pos += seq_len

            if current is None:
                current = segment
            else:
                assert segment[0] == current[-1], "A continuation segment must repeat the last token of the one before it."  # fmt: skip

                current.extend(segment[1:])

            if current[-1] == eos:
                documents.append(current)

                current = None

    assert current is None, "The last document must be complete."

    return documents


def batch_key(batch: SequenceBatch) -> tuple[object, ...]:
    """Everything a batch holds, for bitwise comparisons."""
    target_mask = batch.target_mask

    return (
        tuple(batch.seqs.tolist()),
        tuple(batch.seq_lens),
        None if target_mask is None else tuple(target_mask.tolist()),
        batch.seqs.dtype,
    )


def run_two_rank_worker(rank: int, world_size: int, port: int, data_dir: str, result_dir: str) -> None:  # fmt: skip
    """The body of each process of the two-process reader test: reads a
    balanced and then a broken dataset over a real gloo gang and records what
    happened in ``result_dir/rank_<rank>.json``."""
    from qwen35_fs2.datasets import PretrainingDataset

    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size)}  # fmt: skip
    )

    root = ProcessGroupGang.create_default_process_group(CPU, timeout=timedelta(seconds=60))  # fmt: skip

    gangs = create_parallel_gangs(root)

    result: dict[str, object] = {}

    dataset = PretrainingDataset([Path(data_dir, "uneven")])

    reader = dataset.create_reader(
        ByteTokenizer(), gangs, max_seq_len=64, max_num_tokens=63, num_accumulate=2, prefetch=2  # fmt: skip
    )

    steps = []

    for batches in reader:
        steps.append([location_of(doc) for doc in unpack_documents_lenient(batches)])

    result["steps"] = steps

    # Validation: every rank reads all of its batches, twice (fairseq2's
    # validator resets the reader after each validation), and with a cap.
    for name, cap in (("until_last", None), ("until_last_capped", 2)):
        reader = dataset.create_reader(
            ByteTokenizer(), gangs, max_seq_len=64, max_num_tokens=63, shuffle=False, drop_remainder=False, max_num_batches=cap, sync_mode=SyncMode.UNTIL_LAST  # fmt: skip
        )

        validations = []

        for _ in range(2):
            validations.append([[location_of(doc) for doc in unpack_documents_lenient(batches)] if batches else None for batches in reader])  # fmt: skip

            reader.reset()

        result[name] = validations

    broken = PretrainingDataset([Path(data_dir, "broken")])

    reader = broken.create_reader(ByteTokenizer(), gangs, max_seq_len=64, max_num_tokens=63, shuffle=False)  # fmt: skip

    try:
        for _ in reader:
            pass
    except Exception as ex:
        result["error"] = f"{type(ex).__name__}: {ex}"

    Path(result_dir, f"rank_{rank}.json").write_text(json.dumps(result))

    root.close()


def unpack_documents_lenient(batches: Iterable[SequenceBatch]) -> list[list[int]]:
    """The documents that start in ``batches``, possibly cut at the end (for
    telling where batches come from)."""
    documents = []

    for batch in batches:
        seqs = batch.seqs.tolist()

        pos = 0

        for seq_len in batch.seq_lens:
            segment = seqs[pos : pos + seq_len]

            if pos == 0 or seqs[pos - 1] == BYTE_EOS:
                if _LOCATION.match(bytes(t for t in segment if t < 256).decode(errors="ignore")):  # fmt: skip
                    documents.append(segment)

            pos += seq_len

    return documents
