"""The tensors of the comparisons with the reference: those of a Hugging Face
model directory, and random padded batches in its input format."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor


def read_safetensors_dir(model_dir: Path) -> dict[str, Tensor]:
    """Returns every tensor of the ``*.safetensors`` files of ``model_dir``."""
    tensors = {}

    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as reader:
            for key in reader.keys():
                tensors[key] = reader.get_tensor(key)

    return tensors


def random_padded_batch(vocab_size: int, seq_lens: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Returns token ids drawn uniformly (seed 0) for sequences of
    ``seq_lens`` tokens, right-padded with 0, and their attention mask, as
    transformers takes them."""
    generator = torch.Generator().manual_seed(0)

    seqs = torch.zeros((len(seq_lens), max(seq_lens)), dtype=torch.int64)
    mask = torch.zeros_like(seqs)

    for idx, n in enumerate(seq_lens):
        seqs[idx, :n] = torch.randint(0, vocab_size, (n,), generator=generator)
        mask[idx, :n] = 1

    return seqs, mask
