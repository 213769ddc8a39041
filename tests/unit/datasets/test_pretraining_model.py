"""The contract between the reader's packed batches and their consumer, the
Qwen3.5 model: segments are independent sequences, and the target mask keeps
exactly the predictions inside them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fairseq2.nn import BatchLayout
from qwen35_datasets_testing import ByteTokenizer, fake_gangs

from qwen35_fs2.datasets import PretrainingDataset
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.models.qwen35.factory import create_qwen35_model


@pytest.mark.parametrize("which", ["full", "partial"])
def test_masked_packed_loss_equals_the_mean_loss_of_segments_read_alone(
    fineweb_dir: Path, which: str
) -> None:
    torch.manual_seed(0)

    config = tiny_qwen35_config()

    # Pretraining has no pad token (EOS is `<|endoftext|>`).
    config.pad_idx = None

    model = create_qwen35_model(config).eval()

    reader = PretrainingDataset([fineweb_dir]).create_reader(
        ByteTokenizer(), fake_gangs(0, 1), max_seq_len=96, max_num_tokens=255, shuffle=False, drop_remainder=False  # fmt: skip
    )

    batches = [batch for batches in reader for batch in batches]

    batch = batches[0] if which == "full" else batches[-1]

    assert len(batch.seq_lens) > 1
    assert batch.padding == 0
    assert (batch.seqs.size(0) < 256) == (which == "partial")

    inputs, targets = batch.as_auto_regressive()

    seqs, layout = inputs.as_input()

    with torch.no_grad():
        packed_loss = model(
            seqs, layout, targets=targets.seqs, target_mask=targets.target_mask, reduction="mean"  # fmt: skip
        )

        # Each segment alone, with its own next tokens as targets and no mask.
        total, count, pos = 0.0, 0, 0

        for seq_len in batch.seq_lens:
            segment = batch.seqs[pos : pos + seq_len].unsqueeze(0)

            pos += seq_len

            if seq_len < 2:
                continue

            loss = model(
                segment[:, :-1],
                BatchLayout.of(segment[:, :-1]),
                targets=segment[:, 1:],
                reduction="sum",
            )

            total += float(loss)
            count += seq_len - 1

    assert count == targets.num_target_elements

    torch.testing.assert_close(float(packed_loss), total / count, rtol=1e-5, atol=1e-5)
