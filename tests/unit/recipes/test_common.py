from __future__ import annotations

import pytest
import torch

from fairseq2.datasets import SequenceBatch
from fairseq2.metrics import Max, Mean, MetricBag, Min, Sum
from fairseq2.nn import BatchLayout
from fairseq2.recipe.error import RecipeError

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, tiny_qwen35_config
from qwen35_fs2.nn.moe.statistics import MoeStatistics
from qwen35_fs2.models.qwen35.tokenizer import (
    Qwen35Tokenizer,
    Qwen35TokenizerConfig,
    get_qwen35_tokenizer_dir,
    load_qwen35_tokenizer,
)
from qwen35_fs2.recipes.common import (
    LMLossComputer,
    LMTrainUnit,
    NonFiniteLossError,
    check_pretraining_vocabulary,
    check_sft_vocabulary,
    get_batch_target_mask,
)

CPU = torch.device("cpu")


def _model(pad_idx: int | None = 0) -> torch.nn.Module:
    config = tiny_qwen35_config()

    config.pad_idx = pad_idx

    torch.manual_seed(0)

    return create_qwen35_model(config)


def _padded_batch() -> SequenceBatch:
    seqs = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])

    target_mask = torch.tensor([[False, False, True, True, True], [False, True, True, False, False]])

    return SequenceBatch(seqs, [5, 3], target_mask=target_mask)


class TestGetBatchTargetMask:
    def test_returns_the_target_mask_of_the_batch(self) -> None:
        batch = _padded_batch()

        assert get_batch_target_mask(batch) is batch.target_mask

    # Neither batch below has padding: their target mask is all that keeps
    # the prompts of SFT examples out of the loss.
    def test_returns_the_target_mask_of_a_padded_batch_of_equal_lengths(self) -> None:
        target_mask = torch.tensor([[False, False, True, True], [False, True, True, True]])

        batch = SequenceBatch(torch.ones(2, 4, dtype=torch.int64), [4, 4], target_mask=target_mask)

        assert batch.padding == 0

        assert get_batch_target_mask(batch) is target_mask

    def test_returns_the_target_mask_of_a_packed_batch(self) -> None:
        target_mask = torch.tensor([False, True, True, False, False, True])

        batch = SequenceBatch(torch.ones(6, dtype=torch.int64), [3, 3], packed=True, target_mask=target_mask)

        assert batch.padding == 0

        assert get_batch_target_mask(batch) is target_mask

    def test_masks_the_padding_of_a_padded_batch(self) -> None:
        batch = SequenceBatch(torch.zeros(2, 4, dtype=torch.int64), [4, 2])

        expected = torch.tensor([[True, True, True, True], [True, True, False, False]])

        torch.testing.assert_close(get_batch_target_mask(batch), expected)

    def test_masks_the_padded_tail_of_a_packed_batch(self) -> None:
        batch = SequenceBatch(torch.zeros(6, dtype=torch.int64), [2, 2], packed=True)

        expected = torch.tensor([True, True, True, True, False, False])

        torch.testing.assert_close(get_batch_target_mask(batch), expected)

    def test_returns_none_for_a_full_batch_without_mask(self) -> None:
        assert get_batch_target_mask(SequenceBatch(torch.zeros(2, 4, dtype=torch.int64), None)) is None


class TestLMLossComputer:
    def test_returns_the_summed_loss_of_the_targets_and_their_number(self) -> None:
        model = _model()

        batch = _padded_batch()

        metric_bag = MetricBag(CPU)

        computer = LMLossComputer(model)

        computer.prepare_metric_bag(metric_bag)

        loss, num_targets = computer(batch, metric_bag)

        # The targets are the masked positions after the shift: 3 + 2.
        assert num_targets == 5

        seqs = batch.seqs

        logits = model(seqs[:, :-1], BatchLayout.of(seqs[:, :-1], [4, 2]))

        nll = -torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, 1:, None]).squeeze(-1)

        expected = (nll * batch.target_mask[:, 1:]).sum().detach()  # type: ignore[index]

        torch.testing.assert_close(loss, expected)

        assert metric_bag.get("nll_loss", Mean).compute() == pytest.approx(expected.item() / 5, rel=1e-5)

    def test_adds_the_weighted_auxiliary_loss_per_target(self) -> None:
        model = _model()

        batch = _padded_batch()

        aux_loss = torch.tensor(0.75, requires_grad=True)

        # Two layers of three experts; 4 tokens, each routed to 2 experts.
        tokens_per_expert = torch.tensor([[3.0, 4.0, 1.0], [2.0, 2.0, 4.0]])

        def aux_loss_fn() -> MoeStatistics:
            # Two EP ranks: the busiest computed 10 of 16 rows in layer 1.
            rows_per_ep_rank = torch.tensor([[8, 8], [6, 10]])

            return MoeStatistics(aux_loss, tokens_per_expert, torch.tensor(4.0), top_k=2, rows_per_ep_rank=rows_per_ep_rank)

        metric_bag = MetricBag(CPU)

        computer = LMLossComputer(model, aux_loss_fn, aux_loss_weight=0.01)

        computer.prepare_metric_bag(metric_bag)

        loss, num_targets = computer(batch, metric_bag)

        plain_bag = MetricBag(CPU)

        plain = LMLossComputer(model)

        plain.prepare_metric_bag(plain_bag)

        nll, _ = plain(batch, plain_bag)

        # Normalized by the number of targets, the step loss is NLL + 0.01 aux.
        torch.testing.assert_close(loss, nll + 0.01 * 0.75 * num_targets)

        assert metric_bag.get("aux_loss", Mean).compute() == pytest.approx(0.75)

        assert metric_bag.get("moe_max_tokens_per_expert", Max).compute() == 4
        assert metric_bag.get("moe_min_tokens_per_expert", Min).compute() == 1
        assert metric_bag.get("moe_dropped_tokens", Sum).compute() == 0
        assert metric_bag.get("moe_ep_imbalance", Max).compute() == pytest.approx(1.25)

        loss.backward()

        assert aux_loss.grad == pytest.approx(0.01 * num_targets)

        # A second micro-batch of one target at another value: the metric
        # weighs each micro-batch's loss as the step's loss does, by targets.
        aux_loss = torch.tensor(0.25, requires_grad=True)

        one_target = SequenceBatch(torch.tensor([[5, 6, 7]]), [3], target_mask=torch.tensor([[False, False, True]]))

        computer(one_target, metric_bag)

        assert metric_bag.get("aux_loss", Mean).compute() == pytest.approx((0.75 * float(num_targets) + 0.25) / (float(num_targets) + 1))


class TestLMTrainUnit:
    def test_raises_error_for_a_nan_loss(self) -> None:
        model = _model()

        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))

        unit = LMTrainUnit(LMLossComputer(model))

        metric_bag = MetricBag(CPU)

        unit.prepare_metric_bag(metric_bag)

        unit.set_step_nr(17)

        with pytest.raises(NonFiniteLossError, match=r"The loss of a training batch is nan at step 17 \(2 examples, 5 target tokens\)\."):
            unit.process_batch(_padded_batch(), metric_bag)


class TestVocabularyChecks:
    def test_sft_check_accepts_the_released_pad_token(self, tokenizer: Qwen35Tokenizer) -> None:
        config = tiny_qwen35_config()

        config.vocab_size = 248_320
        config.pad_idx = ENDOFTEXT_IDX

        with torch.device("meta"):
            model = create_qwen35_model(config)

        check_sft_vocabulary(model, tokenizer)

        config.pad_idx = None

        with torch.device("meta"):
            model = create_qwen35_model(config)

        with pytest.raises(RecipeError, match=r"The pad index of the model \(None\) must match the pad token of the tokenizer \(248044\)\."):
            check_sft_vocabulary(model, tokenizer)

    def test_checks_reject_a_vocabulary_larger_than_the_model(self, tokenizer: Qwen35Tokenizer) -> None:
        with torch.device("meta"):
            model = create_qwen35_model(tiny_qwen35_config())

        with pytest.raises(RecipeError, match=r"must have at least as many embeddings as the tokenizer has tokens \(248077\), but has 1024\."):
            check_sft_vocabulary(model, tokenizer)

    def test_pretraining_check_rejects_a_pad_index_that_hides_document_ends(self) -> None:
        tokenizer = load_qwen35_tokenizer(get_qwen35_tokenizer_dir(), Qwen35TokenizerConfig(eos_token="<|endoftext|>"))

        config = tiny_qwen35_config()

        config.vocab_size = 248_320
        config.pad_idx = ENDOFTEXT_IDX

        with torch.device("meta"):
            model = create_qwen35_model(config)

        with pytest.raises(RecipeError, match=r"must not be the end-of-document token, or the loss ignores every document end\. Set `model.config_overrides.pad_idx: null`\."):
            check_pretraining_vocabulary(model, tokenizer)

        config.pad_idx = None

        with torch.device("meta"):
            model = create_qwen35_model(config)

        check_pretraining_vocabulary(model, tokenizer)
