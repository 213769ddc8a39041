"""Helpers of the SFT tests: batches read the way the SFT recipe reads them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fairseq2.datasets import SequenceBatch
from fairseq2.gang import create_fake_gangs

from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX
from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer
from qwen35_fs2.recipes.instruction import ChatEncoder, InstructionExample
from qwen35_fs2.recipes.sft.dataset import SFTBatching, create_sft_reader


def read_one_sft_batch(
    tokenizer: Qwen35Tokenizer, examples: Sequence[InstructionExample], batching: SFTBatching
) -> SequenceBatch:
    """Returns the batch of all ``examples``, in order, chat-encoded, padded or
    packed by the SFT reader; fails if they do not fit in one batch."""
    reader = create_sft_reader(
        examples,
        ChatEncoder(tokenizer),
        create_fake_gangs(torch.device("cpu")),
        batching,
        pad_idx=ENDOFTEXT_IDX,
        split_name="train",
        shuffle_window=None,
        seed=0,
        prefetch=0,
    )

    batches = next(reader)

    assert len(batches) == 1 and batches[0].num_examples == len(examples)

    return batches[0]
