from __future__ import annotations

import torch
from torch import Tensor

from fairseq2.datasets import SequenceBatch
from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.datasets.synthetic import generate_synthetic_gsm8k
from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, tiny_qwen35_config
from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer
from qwen35_fs2.recipes.sft.dataset import SFTBatching

from qwen35_sft_testing import read_one_sft_batch


def _read_one_batch(tokenizer: Qwen35Tokenizer, batching: SFTBatching) -> SequenceBatch:
    examples = [
        {"id": str(idx), "prompt": e.question, "response": e.answer}
        for idx, e in enumerate(generate_synthetic_gsm8k(5, seed=4))
    ]

    return read_one_sft_batch(tokenizer, examples, batching)


def _per_example_losses(model: TransformerLM, batch: SequenceBatch) -> Tensor:
    """Returns the mean NLL of the targets of each example of ``batch``."""
    input_batch, target_batch = batch.as_auto_regressive()

    seqs, seqs_layout = input_batch.as_input()

    target_mask = target_batch.target_mask

    assert target_mask is not None

    losses = model(seqs, seqs_layout, targets=target_batch.seqs, target_mask=target_mask, reduction="none")  # type: ignore[call-overload]

    if not batch.packed:
        return losses.sum(dim=1) / target_mask.sum(dim=1)

    # Segments of the packed row; the last one lost its last token to the
    # auto-regressive shift.
    seq_lens = list(batch.seq_lens)

    seq_lens[-1] -= 1

    return torch.stack(
        [l.sum() / m.sum() for l, m in zip(losses.split(seq_lens), target_mask.split(seq_lens))]
    )


class TestPackedSFT:
    def test_packed_and_padded_batches_give_the_same_per_example_losses(self, tokenizer: Qwen35Tokenizer) -> None:
        config = tiny_qwen35_config()

        config.vocab_size = 248_320
        config.pad_idx = ENDOFTEXT_IDX

        torch.manual_seed(2)

        model = create_qwen35_model(config).eval()

        padded = _read_one_batch(tokenizer, SFTBatching(max_seq_len=256, max_num_tokens=2048, batch_size=8))

        packed = _read_one_batch(tokenizer, SFTBatching(max_seq_len=256, max_num_tokens=2048, packing=True))

        assert packed.packed and not padded.packed

        assert padded.padding > 0

        with torch.no_grad():
            padded_losses = _per_example_losses(model, padded)

            packed_losses = _per_example_losses(model, packed)

        # If the Gated DeltaNet state or attention crossed example boundaries,
        # every example but the first would differ.
        torch.testing.assert_close(packed_losses, padded_losses, rtol=0, atol=1e-5)

        # The losses differ between examples, so a mix-up would show.
        assert padded_losses.std() > 1e-3
