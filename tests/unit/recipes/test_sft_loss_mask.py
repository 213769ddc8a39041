"""The SFT loss where the trainer computes it: batches read by the SFT reader
go through :class:`LMTrainUnit` (so through ``get_batch_target_mask`` and
:class:`LMLossComputer`, with the chunked loss of the recipes), and the loss
must be the mean NLL of the response tokens, computed here from the logits of
each example run alone.

Packed batches are never padded, and neither are padded batches whose
examples all have the same length: for both, the response-only mask of the
batch is the only thing that keeps the prompt tokens out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from fairseq2.datasets import SequenceBatch
from fairseq2.metrics import Mean, MetricBag
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, tiny_qwen35_config
from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer
from qwen35_fs2.recipes.common import LMLossComputer, LMLossSection, LMTrainUnit, setup_lm_loss
from qwen35_fs2.recipes.instruction import InstructionExample
from qwen35_fs2.recipes.sft.dataset import SFTBatching

from qwen35_sft_testing import read_one_sft_batch

CPU = torch.device("cpu")

IM_END_IDX = 248_046

NEWLINE_IDX = 198

# Three lengths.
UNEQUAL_EXAMPLES: list[InstructionExample] = [
    {"id": "0", "prompt": "What is 2 + 3?", "response": "2 + 3 = 5"},
    {"id": "1", "prompt": "Hi", "response": "Hello! How can I help you today?"},
    {"id": "2", "prompt": "Add 2 and 3, then double it.", "response": "10"},
]

# The same number of tokens in both examples, so the padded batch has no
# padding.
EQUAL_EXAMPLES: list[InstructionExample] = [
    {"id": "0", "prompt": "What is 2 + 3?", "response": "2 + 3 = 5"},
    {"id": "1", "prompt": "What is 4 + 1?", "response": "4 + 1 = 5"},
]


def _model() -> TransformerLM:
    config = tiny_qwen35_config()

    config.vocab_size = 248_320
    config.pad_idx = ENDOFTEXT_IDX

    torch.manual_seed(3)

    model = create_qwen35_model(config)

    # As the recipe sets it up; 8-token chunks split every example.
    setup_lm_loss(model, LMLossSection(chunk_size=8))

    return model


def _response_spans(
    tokenizer: Qwen35Tokenizer, batch: SequenceBatch, examples: Sequence[InstructionExample]
) -> list[tuple[Tensor, int]]:
    """Returns, for each example of ``batch``, its tokens and the number of
    its response tokens: those of the response text and the ``<|im_end|>``
    that ends the turn, right before the turn's final newline."""
    if batch.packed:
        rows = batch.seqs.split(batch.seq_lens)
    else:
        rows = [row[:seq_len] for row, seq_len in zip(batch.seqs, batch.seq_lens)]

    encoder = tokenizer.create_raw_encoder()

    spans = []

    for row, example in zip(rows, examples):
        response = encoder(example["response"]).tolist() + [IM_END_IDX]

        assert row[-len(response) - 1 :].tolist() == response + [NEWLINE_IDX]

        spans.append((row, len(response)))

    return spans


def _expected_mean_nll(model: TransformerLM, spans: Sequence[tuple[Tensor, int]]) -> tuple[Tensor, int]:
    """Returns the mean NLL of the response tokens of the examples, each run
    alone through the model, and their number."""
    total = torch.zeros(())

    num_targets = 0

    with torch.no_grad():
        for seqs, num_response_tokens in spans:
            logits = model(seqs[None, :-1], BatchLayout.of(seqs[None, :-1]))[0]

            nll = -torch.log_softmax(logits.float(), dim=-1).gather(-1, seqs[1:, None]).squeeze(-1)

            # Target `j` is predicted at position `j - 1`; the last target is
            # the final newline.
            total += nll[-num_response_tokens - 1 : -1].sum()

            num_targets += num_response_tokens

    return total / num_targets, num_targets


def _expected_target_positions(batch: SequenceBatch, spans: Sequence[tuple[Tensor, int]]) -> Tensor:
    """Returns where the inputs of ``batch``, once shifted for next-token
    prediction, predict a response token."""
    input_batch, _ = batch.as_auto_regressive()

    mask = torch.zeros(input_batch.seqs.shape, dtype=torch.bool)

    offset = 0

    for idx, (seqs, num_response_tokens) in enumerate(spans):
        seq_len = len(seqs)

        # Positions `seq_len - 2 - num_response_tokens` to `seq_len - 3`
        # predict the response; `seq_len - 2` predicts the final newline.
        begin, end = seq_len - 2 - num_response_tokens, seq_len - 2

        if batch.packed:
            mask[offset + begin : offset + end] = True
        else:
            mask[idx, begin:end] = True

        offset += seq_len

    return mask


@pytest.mark.parametrize(
    ("batching", "examples", "has_padding"),
    [
        (SFTBatching(max_seq_len=64, max_num_tokens=512, packing=True), UNEQUAL_EXAMPLES, False),
        (SFTBatching(max_seq_len=64, max_num_tokens=512, batch_size=2), EQUAL_EXAMPLES, False),
        (SFTBatching(max_seq_len=64, max_num_tokens=512, batch_size=3), UNEQUAL_EXAMPLES, True),
    ],
    ids=["packed", "padded-equal-lengths", "padded-unequal-lengths"],
)
class TestSFTLossMask:
    def test_loss_is_the_mean_nll_of_the_response_tokens(
        self,
        tokenizer: Qwen35Tokenizer,
        batching: SFTBatching,
        examples: list[InstructionExample],
        has_padding: bool,
    ) -> None:
        batch = read_one_sft_batch(tokenizer, examples, batching)

        assert batch.packed == batching.packing

        assert (batch.padding > 0) == has_padding

        model = _model()

        expected_mean, expected_num_targets = _expected_mean_nll(model, _response_spans(tokenizer, batch, examples))

        unit = LMTrainUnit(LMLossComputer(model))

        metric_bag = MetricBag(CPU)

        unit.prepare_metric_bag(metric_bag)

        loss, num_targets = unit.process_batch(batch, metric_bag)

        # The trainer divides the summed loss by the number of targets.
        assert num_targets == expected_num_targets

        torch.testing.assert_close(loss.detach() / num_targets, expected_mean, rtol=1e-5, atol=1e-5)

        assert metric_bag.get("nll_loss", Mean).compute().item() == pytest.approx(expected_mean.item(), rel=1e-5)

    def test_only_positions_predicting_the_response_get_a_gradient(
        self,
        tokenizer: Qwen35Tokenizer,
        batching: SFTBatching,
        examples: list[InstructionExample],
        has_padding: bool,
    ) -> None:
        batch = read_one_sft_batch(tokenizer, examples, batching)

        model = _model()

        # The chunked loss never holds the logits; the decoder output of a
        # position feeds only the logits of that position, so it gets a
        # gradient where, and only where, they do.
        decoder_outputs: list[Tensor] = []

        def retain_output(module: torch.nn.Module, args: object, output: Tensor) -> None:
            output.retain_grad()

            decoder_outputs.append(output)

        model.decoder.register_forward_hook(retain_output)

        unit = LMTrainUnit(LMLossComputer(model))

        metric_bag = MetricBag(CPU)

        unit.prepare_metric_bag(metric_bag)

        loss, _ = unit.process_batch(batch, metric_bag)

        loss.backward()

        grad = decoder_outputs[0].grad

        assert grad is not None

        expected = _expected_target_positions(batch, _response_spans(tokenizer, batch, examples))

        has_grad = grad.ne(0.0).any(dim=-1)

        # Prompt tokens (and the final newline and the padding) are never
        # trained on; every response token is.
        torch.testing.assert_close(has_grad, expected, msg=lambda msg: f"Positions with a gradient differ from those predicting a response token:\n{msg}")  # fmt: skip
