"""The loss of the MTP head (cross entropy on the token after next) against
an independent computation that walks the documents of the batch one by
one: packed batches with document boundaries, padded batches, target masks,
the chunked loss, and its place in the recipes' loss; under activation
checkpointing and in bf16, against the same model's fp32 step without it
(tensor parallelism: tests/integration/sharding/_tp_worker.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from fairseq2.datasets import SequenceBatch
from fairseq2.device import CPU
from fairseq2.metrics import Mean, MetricBag
from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.models.qwen35 import create_qwen35_model
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.nn.mtp import MtpLoss
from qwen35_fs2.parallel import apply_ac_to_qwen35
from qwen35_fs2.recipes.common import (
    LMLossComputer,
    LMLossSection,
    create_aux_loss_fn,
    get_batch_target_mask,
    setup_lm_loss,
)
from qwen35_fs2.recipes.loss import install_chunked_lm_loss

_PAD_IDX = 0

# Three documents of a packed batch, padded at the end; and a mask of the
# targets that count (a response of each document, as in SFT). The last
# document holds the pad token itself (as SFT data may, spelled out in a
# response), a target that the loss ignores as the LM loss does.
_DOCS = [[5, 17, 23, 8, 99, 41], [7, 12, 300, 14], [9, 2, 88, 61, _PAD_IDX, 1000, 6]]

_DOC_MASKS = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1, 0, 1]]

_NUM_PADS = 2


def _model(seed: int = 0, *, pad_idx: int | None = _PAD_IDX) -> TransformerLM:
    torch.manual_seed(seed)

    config = tiny_qwen35_config()

    config.mtp_num_layers = 1

    config.pad_idx = pad_idx

    model = create_qwen35_model(config)

    _perturb_mtp_norms(model)

    return model


def _moe_model(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)

    config = tiny_qwen35_moe_config()

    config.mtp_num_layers = 1

    config.pad_idx = _PAD_IDX

    model = create_qwen35_moe_model(config)

    _perturb_mtp_norms(model)

    return model


def _perturb_mtp_norms(model: TransformerLM) -> None:
    """Moves the head's norms off their initial (zero-centered) identity."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("mtp.") and param.dim() == 1:
                param.normal_(std=0.2)


def _packed_batch(masked: bool, filler: int = _PAD_IDX) -> SequenceBatch:
    seqs = torch.tensor([t for d in _DOCS for t in d] + [filler] * _NUM_PADS)

    target_mask = torch.tensor([m for d in _DOC_MASKS for m in d] + [0] * _NUM_PADS, dtype=torch.bool)

    return SequenceBatch(seqs, [len(d) for d in _DOCS], packed=True, target_mask=target_mask if masked else None)


def _padded_batch(masked: bool, filler: int = _PAD_IDX) -> SequenceBatch:
    width = max(len(d) for d in _DOCS)

    seqs = torch.tensor([d + [filler] * (width - len(d)) for d in _DOCS])

    target_mask = torch.tensor([m + [0] * (width - len(m)) for m in _DOC_MASKS], dtype=torch.bool)

    return SequenceBatch(seqs, [len(d) for d in _DOCS], target_mask=target_mask if masked else None)


def _model_mtp_loss(model: TransformerLM, batch: SequenceBatch, chunk_size: int = 1024, *, batch_mask: bool = True) -> MtpLoss:
    install_chunked_lm_loss(model, chunk_size=chunk_size, mtp_loss="train")

    input_batch, target_batch = batch.as_auto_regressive()

    seqs, seqs_layout = input_batch.as_input()

    target_mask = get_batch_target_mask(target_batch) if batch_mask else None

    model(seqs, seqs_layout, targets=target_batch.seqs, target_mask=target_mask, reduction="sum")

    loss = model.mtp.pop_loss()

    assert loss is not None

    return loss


def _expected_mtp_loss(model: TransformerLM, batch: SequenceBatch, masked: bool) -> tuple[Tensor, int]:
    """Walks each document ``d``: at its position ``i`` the head takes the
    trunk's output and the embedding of ``d[i + 1]`` and predicts
    ``d[i + 2]``; nothing past the document's end counts, nor a target that
    is the model's pad token."""
    input_batch, _ = batch.as_auto_regressive()

    seqs, seqs_layout = input_batch.as_input()

    embeds, _ = model.decoder_frontend(seqs, seqs_layout)

    hidden = model.decoder(embeds, seqs_layout)

    # The token after each position within its document, in the input's
    # shape; positions without one get any token, which nothing counted
    # sees (the head attends causally within documents).
    next_seqs = torch.zeros_like(seqs)

    # (row or None, start) of each document in the input.
    starts = []

    offset = 0

    for doc_idx, doc in enumerate(_DOCS):
        if batch.packed:
            starts.append((None, offset))

            offset += len(doc)
        else:
            starts.append((doc_idx, 0))

    def at(row: int | None, idx: int) -> tuple[int, ...]:
        return (idx,) if row is None else (row, idx)

    for (row, start), doc in zip(starts, _DOCS):
        for i in range(len(doc) - 1):
            if start + i < seqs.size(-1):
                next_seqs[at(row, start + i)] = doc[i + 1]

    logits = model.final_proj(model.mtp(hidden, model.decoder_frontend.embed(next_seqs), seqs_layout))

    log_probs = torch.log_softmax(logits.float(), dim=-1)

    nll = torch.zeros(())

    num_targets = 0

    for (row, start), doc, doc_mask in zip(starts, _DOCS, _DOC_MASKS):
        for i in range(len(doc) - 2):
            if (masked and not doc_mask[i + 2]) or doc[i + 2] == model.pad_idx:
                continue

            nll = nll - log_probs[at(row, start + i) + (doc[i + 2],)]

            num_targets += 1

    return nll, num_targets


class TestMtpLoss:
    @pytest.mark.parametrize("masked", [False, True], ids=["all-targets", "target-mask"])
    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
    def test_equals_the_loss_of_the_token_after_next_within_each_document(self, packed: bool, masked: bool) -> None:
        model = _model()

        batch = _packed_batch(masked) if packed else _padded_batch(masked)

        with torch.no_grad():
            loss = _model_mtp_loss(model, batch)

            expected, num_targets = _expected_mtp_loss(model, batch, masked)

        assert int(loss.num_targets) == num_targets

        torch.testing.assert_close(loss.nll_loss, expected, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
    def test_never_predicts_into_padding_from_the_layout_alone(self, packed: bool) -> None:
        # Pretraining models predict their pad token (`pad_idx` None), and
        # padding here is an ordinary token outside any target mask: only
        # the batch layout tells it apart.
        model = _model(pad_idx=None)

        batch = _packed_batch(False, filler=7) if packed else _padded_batch(False, filler=7)

        with torch.no_grad():
            loss = _model_mtp_loss(model, batch, batch_mask=False)

            expected, num_targets = _expected_mtp_loss(model, batch, masked=False)

        assert int(loss.num_targets) == num_targets

        torch.testing.assert_close(loss.nll_loss, expected, rtol=1e-5, atol=1e-5)

    def test_equals_the_independent_loss_with_the_chunked_loss_and_trains_the_head(self) -> None:
        model = _model()

        batch = _packed_batch(masked=False)

        # Chunked in the gradient path, with a chunk smaller than the batch.
        loss = _model_mtp_loss(model, batch, chunk_size=3)

        with torch.no_grad():
            expected, _ = _expected_mtp_loss(model, batch, masked=False)

        torch.testing.assert_close(loss.nll_loss.detach(), expected, rtol=1e-5, atol=1e-5)

        loss.nll_loss.backward()

        assert model.mtp.fc.weight.grad is not None and model.mtp.fc.weight.grad.abs().sum() > 0

    def test_leaves_the_next_token_loss_unchanged(self) -> None:
        model = _model()

        batch = _packed_batch(masked=True)

        input_batch, target_batch = batch.as_auto_regressive()

        seqs, seqs_layout = input_batch.as_input()

        kwargs = dict(targets=target_batch.seqs, target_mask=get_batch_target_mask(target_batch), reduction="sum")

        with torch.no_grad():
            plain = install_chunked_lm_loss(_model(), mtp_loss="off")(seqs, seqs_layout, **kwargs)

            with_mtp = install_chunked_lm_loss(model, mtp_loss="train")(seqs, seqs_layout, **kwargs)

        torch.testing.assert_close(with_mtp, plain, rtol=0, atol=0)


class TestMtpLossInRecipes:
    def test_adds_the_weighted_mtp_loss_per_target_and_reports_its_mean(self) -> None:
        model = _model()

        setup_lm_loss(model, LMLossSection(mtp_loss_weight=0.25))

        batch = _packed_batch(masked=True)

        metric_bag = MetricBag(CPU)

        computer = LMLossComputer(model, mtp_loss_weight=0.25)

        computer.prepare_metric_bag(metric_bag)

        loss, num_targets = computer(batch, metric_bag)

        with torch.no_grad():
            mtp_nll, num_mtp_targets = _expected_mtp_loss(model, batch, masked=True)

        nll = metric_bag.get("nll_loss", Mean).compute() * num_targets

        mean_mtp = mtp_nll / num_mtp_targets

        # Both summed over their targets, normalized together by the trainer.
        assert loss.item() == pytest.approx(float(nll) + 0.25 * mtp_nll.item(), rel=1e-5)

        assert metric_bag.get("mtp_loss", Mean).compute() == pytest.approx(mean_mtp.item(), rel=1e-5)

    def test_a_step_split_into_micro_batches_trains_what_one_batch_trains(self) -> None:
        # Micro-batches of one and of two documents, whose ratios of MTP to
        # next-token targets differ (a document has one MTP target fewer);
        # the trainer sums their losses and divides by the step's next-token
        # targets.
        model = _model()

        setup_lm_loss(model, LMLossSection(mtp_loss_weight=0.5))

        computer = LMLossComputer(model, mtp_loss_weight=0.5)

        # Their target masks leave out each document's first token, the
        # target of the last token of the document before in a packed row.
        def loss_of(docs: list[list[int]], masks: list[list[int]]) -> tuple[Tensor, int]:
            metric_bag = MetricBag(CPU)

            computer.prepare_metric_bag(metric_bag)

            target_mask = torch.tensor([m for mask in masks for m in mask], dtype=torch.bool)

            batch = SequenceBatch(torch.tensor([t for d in docs for t in d]), [len(d) for d in docs], packed=True, target_mask=target_mask)

            loss, num_targets = computer(batch, metric_bag)

            return loss, int(num_targets)

        whole, num_whole = loss_of(_DOCS, _DOC_MASKS)

        (first, num_first), (rest, num_rest) = loss_of(_DOCS[:1], _DOC_MASKS[:1]), loss_of(_DOCS[1:], _DOC_MASKS[1:])

        assert num_first + num_rest == num_whole

        torch.testing.assert_close((first + rest) / num_whole, whole / num_whole, rtol=1e-5, atol=0)

    def test_warns_of_a_weight_on_a_frozen_head(self, caplog: pytest.LogCaptureFixture) -> None:
        model = _model()

        # As LoRA leaves it.
        model.mtp.requires_grad_(False)

        with caplog.at_level(logging.WARNING):
            setup_lm_loss(model, LMLossSection(mtp_loss_weight=0.1))

        assert "The MTP head of the model is frozen, but `loss.mtp_loss_weight` is 0.1" in caplog.text

        caplog.clear()

        with caplog.at_level(logging.WARNING):
            setup_lm_loss(_model(), LMLossSection(mtp_loss_weight=0.1))

        assert "frozen" not in caplog.text

    def test_freezes_the_head_without_a_weight(self) -> None:
        model = _model()

        setup_lm_loss(model, LMLossSection(mtp_loss_weight=0.0))

        assert not any(p.requires_grad for p in model.mtp.parameters())

        assert any(p.requires_grad for p in model.decoder.parameters())

        metric_bag = MetricBag(CPU)

        computer = LMLossComputer(model, mtp_loss_weight=0.0)

        computer.prepare_metric_bag(metric_bag)

        computer(_packed_batch(masked=True), metric_bag)

        assert model.mtp.pop_loss() is None

    def test_measures_a_frozen_head_in_evaluation_without_adding_its_loss(self) -> None:
        model = _model().eval()

        setup_lm_loss(model, LMLossSection(mtp_loss_weight=0.0))

        metric_bag = MetricBag(CPU)

        computer = LMLossComputer(model, mtp_loss_weight=0.0)

        computer.prepare_metric_bag(metric_bag, evaluation=True)

        with torch.no_grad():
            loss, num_targets = computer(_packed_batch(masked=True), metric_bag)

            expected, num_mtp_targets = _expected_mtp_loss(model, _packed_batch(masked=True), masked=True)

        assert loss.item() == pytest.approx(float(metric_bag.get("nll_loss", Mean).compute()) * num_targets, rel=1e-5)

        assert metric_bag.get("mtp_loss", Mean).compute() == pytest.approx(expected.item() / num_mtp_targets, rel=1e-5)

        assert 0.0 <= float(metric_bag.get("mtp_acceptance", Mean).compute()) <= 1.0

    def test_rejects_a_negative_weight(self) -> None:
        result = LMLossSection(mtp_loss_weight=-0.1).validate()

        assert "`mtp_loss_weight` must be greater than or equal to 0, but is -0.1 instead." in str(result)


class TestMtpAcceptance:
    def test_counts_the_drafts_the_trunks_next_greedy_token_accepts_in_evaluation(self) -> None:
        model = _model().eval()

        # Two tokens dominate the (tied) output projection, so that drafts
        # and the trunk's tokens agree at some positions and not at others.
        with torch.no_grad():
            embed = model.decoder_frontend.embed.weight

            embed.mul_(0.01)

            embed[1:3] = torch.randn(2, embed.size(1), generator=torch.Generator().manual_seed(1))

        batch = _packed_batch(masked=True)

        metric_bag = MetricBag(CPU)

        computer = LMLossComputer(model, mtp_loss_weight=0.1)

        setup_lm_loss(model, LMLossSection(mtp_loss_weight=0.1))

        computer.prepare_metric_bag(metric_bag, evaluation=True)

        with torch.no_grad():
            # Small chunks: the greedy tokens are taken chunk by chunk.
            install_chunked_lm_loss(model, chunk_size=4, mtp_loss="train")

            computer(batch, metric_bag)

            # Independently: per document, the head's draft at i (from the
            # trunk at i and d[i + 1]) against the trunk's greedy token at
            # i + 1, where d[i + 2] is a target (not the pad token).
            input_batch, _ = batch.as_auto_regressive()

            seqs, seqs_layout = input_batch.as_input()

            lm_greedy = model(seqs, seqs_layout).argmax(-1)

            embeds, _ = model.decoder_frontend(seqs, seqs_layout)

            hidden = model.decoder(embeds, seqs_layout)

            next_seqs = torch.cat([seqs[1:], seqs[:1]])

            drafts = model.final_proj(model.mtp(hidden, model.decoder_frontend.embed(next_seqs), seqs_layout)).argmax(-1)

        accepted, counted, start = 0, 0, 0

        for doc, doc_mask in zip(_DOCS, _DOC_MASKS):
            for i in range(len(doc) - 2):
                if doc_mask[i + 2] and doc[i + 2] != _PAD_IDX:
                    counted += 1

                    accepted += int(drafts[start + i] == lm_greedy[start + i + 1])

            start += len(doc)

        assert counted > 0

        assert 0 < accepted < counted, (accepted, counted)

        assert metric_bag.get("mtp_acceptance", Mean).compute() == pytest.approx(accepted / counted)

    def test_is_not_measured_in_training(self) -> None:
        model = _model()

        with torch.no_grad():
            loss = _model_mtp_loss(model, _packed_batch(masked=True))

        assert loss.num_accepted is None


class TestMtpLossOfMoeModels:
    def test_trains_the_head_beside_the_load_balancing_loss_of_the_trunk(self) -> None:
        model = _moe_model()

        setup_lm_loss(model, LMLossSection(mtp_loss_weight=0.1))

        metric_bag = MetricBag(CPU)

        # The head's MoE block records no routing statistics: the trunk's
        # layers alone make the load-balancing loss.
        computer = LMLossComputer(model, create_aux_loss_fn(model), 0.01, mtp_loss_weight=0.1)

        computer.prepare_metric_bag(metric_bag)

        loss, _ = computer(_packed_batch(masked=True), metric_bag)

        loss.backward()

        assert model.mtp.layers[0].ffn.experts.gate_inner_proj.grad is not None

        assert metric_bag.get("mtp_loss", Mean).compute() > 0.0


def _recipe_step(model: TransformerLM, batch: SequenceBatch, *, mtp_loss_weight: float = 0.5) -> tuple[Tensor, float, dict[str, Tensor]]:
    """One training step's loss as the recipes compute it (next-token plus
    weighted MTP loss, and the load-balancing loss of MoE models), after its
    backward pass: ``(loss, mean MTP loss, the gradient of every
    parameter)``."""
    setup_lm_loss(model, LMLossSection(mtp_loss_weight=mtp_loss_weight))

    metric_bag = MetricBag(CPU)

    computer = LMLossComputer(model, create_aux_loss_fn(model), 0.01, mtp_loss_weight=mtp_loss_weight)

    computer.prepare_metric_bag(metric_bag)

    model.zero_grad()

    loss, _ = computer(batch, metric_bag)

    loss.backward()

    mtp_loss = float(metric_bag.get("mtp_loss", Mean).compute())

    # Wrappers (activation checkpointing) insert themselves into the names.
    gradients = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}

    assert all(grad is not None for grad in gradients.values()), [n for n, g in gradients.items() if g is None]

    return loss.detach(), mtp_loss, gradients  # type: ignore[return-value]


class TestMtpLossUnderActivationCheckpointing:
    @pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
    def test_gives_the_loss_and_gradients_of_the_model_without_it(self, moe: bool) -> None:
        create_model = _moe_model if moe else _model

        batch = _packed_batch(masked=True)

        expected_loss, expected_mtp_loss, expected_gradients = _recipe_step(create_model(), batch)

        # As the recipes apply it (the family's layerwise applier): every
        # trunk layer is recomputed in the backward pass, after the model's
        # pre-hook handed the head its layout.
        model = apply_ac_to_qwen35(create_model(), every_nth_layer=1)

        assert all(isinstance(layer, CheckpointWrapper) for layer in model.decoder.layers)

        loss, mtp_loss, gradients = _recipe_step(model, batch)

        # The same operations on the same values: bit for bit.
        torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)

        assert mtp_loss == expected_mtp_loss

        assert gradients.keys() == expected_gradients.keys()

        unequal = [name for name, grad in gradients.items() if not torch.equal(grad, expected_gradients[name])]

        assert not unequal, unequal


# bf16 keeps 8 bits of mantissa: one rounding is off by up to 2^-8 (0.39%)
# of the value. Nothing is trained here, so the losses differ from fp32 by
# the roundings of one forward pass (measured: at most 7.3e-4 relative,
# with bf16 weights) and stay within one rounding of the loss itself. A
# gradient sums products of a forward and a backward pass, each rounded a
# few times: measured, every gradient of the dense model's head is within
# 2.3% (RMS, relative to its norm) of fp32, the trunk's within 3.2% except
# the Gated DeltaNet decay's (below). 7% leaves twice that; a wrong
# computation is off by its whole size (a missing or doubled term). It is no
# test of precision finer than that: the head's `fc` output rounded to 3
# bits of mantissa passes it.
_BF16_LOSS_RTOL = 2**-8

_BF16_GRAD_RTOL = 0.07


def _relative_rms_error(actual: Tensor, expected: Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm())


def _confident_model(moe: bool) -> TransformerLM:
    """:func:`_model` (:func:`_moe_model`) with ten times larger logits, from
    the trunk and from the head: a model whose predictions are close to
    uniform has a loss that hardly depends on its logits, and so on their
    rounding."""
    model = _moe_model() if moe else _model()

    with torch.no_grad():
        # Zero-centered: the scale is `1 + weight`.
        for norm in (model.decoder.layer_norm, model.mtp.layer_norm):
            norm.weight.add_(9.0)

    return model


class TestMtpLossInBf16:
    @pytest.mark.parametrize("precision", ["autocast", "bf16_weights"])
    @pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
    def test_stays_within_bf16_rounding_of_fp32(self, moe: bool, precision: str) -> None:
        batch = _packed_batch(masked=True)

        expected_loss, expected_mtp_loss, expected_gradients = _recipe_step(_confident_model(moe), batch)

        if precision == "autocast":
            # How one process trains with `mixed_precision.mode` `static` or
            # `auto`: fp32 weights, bf16 GEMMs.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, mtp_loss, gradients = _recipe_step(_confident_model(moe), batch)
        else:
            # FSDP2's `static` mixed precision: the weights themselves are
            # bf16 in the forward and backward passes.
            loss, mtp_loss, gradients = _recipe_step(_confident_model(moe).to(torch.bfloat16), batch)

        assert math.isfinite(mtp_loss)

        torch.testing.assert_close(loss.float(), expected_loss, rtol=_BF16_LOSS_RTOL, atol=0)

        assert mtp_loss == pytest.approx(expected_mtp_loss, rel=_BF16_LOSS_RTOL)

        nonfinite = [name for name, grad in gradients.items() if not grad.isfinite().all()]

        assert not nonfinite, nonfinite

        if moe:
            # A router's near tie goes either way in bf16 and moves a
            # token's whole gradient to another expert (measured with bf16
            # weights: one of the 18 tokens of the head's MoE layer, 48% of
            # its experts' gradient); the gradients are continuous in the
            # dense model only.
            return

        errors = {name: _relative_rms_error(grad, expected_gradients[name]) for name, grad in gradients.items()}

        # The gradients of `A_log` and `dt_bias` are small sums of terms of
        # both signs (measured under autocast: 9% off in one layer); their
        # precision is the trunk's (tests/integration/models/test_bf16_parity.py).
        large = {name: error for name, error in errors.items() if error > _BF16_GRAD_RTOL and ".decay." not in name}

        assert not large, large
