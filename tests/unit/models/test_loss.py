from __future__ import annotations

from typing import Literal

import pytest
import torch
from torch import Tensor

from fairseq2.nn import BatchLayout, Linear, Projection
from fairseq2.nn.functional import cross_entropy

from qwen35_fs2.models import create_qwen35_model
from qwen35_fs2.models.config import tiny_qwen35_config
from qwen35_fs2.models.loss import chunked_cross_entropy, install_chunked_lm_loss

VOCAB_SIZE = 37
MODEL_DIM = 8


def _make_inputs(
    shape: tuple[int, ...], seed: int = 0
) -> tuple[Tensor, Linear, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)

    decoder_output = torch.randn(*shape, MODEL_DIM, generator=generator, dtype=torch.float32)

    proj = Linear(MODEL_DIM, VOCAB_SIZE, bias=True, dtype=torch.float32)

    with torch.no_grad():
        proj.weight.copy_(torch.randn(VOCAB_SIZE, MODEL_DIM, generator=generator))
        assert proj.bias is not None
        proj.bias.copy_(torch.randn(VOCAB_SIZE, generator=generator))

    targets = torch.randint(0, VOCAB_SIZE, shape, generator=generator)

    # Make sure that some targets hit the pad index used below.
    targets.view(-1)[::5] = 3

    target_mask = torch.rand(shape, generator=generator) > 0.3

    return decoder_output.requires_grad_(), proj, targets, target_mask


class _WrappedProjection(Projection):
    def __init__(self, proj: Linear) -> None:
        super().__init__(proj.input_dim, proj.output_dim)

        self.proj = proj

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class TestChunkedCrossEntropy:
    @pytest.mark.parametrize("shape", [(3, 11), (29,)], ids=["padded", "packed"])
    @pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
    @pytest.mark.parametrize("pad_idx", [None, 3])
    @pytest.mark.parametrize("use_mask", [False, True], ids=["no_mask", "mask"])
    @pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
    @pytest.mark.parametrize("chunk_size", [3, 1000], ids=["chunk3", "one_chunk"])
    @pytest.mark.parametrize("wrap", [False, True], ids=["fused", "checkpointed"])
    def test_matches_fairseq2_cross_entropy_and_its_gradients(
        self,
        shape: tuple[int, ...],
        reduction: Literal["sum", "mean", "none"],
        pad_idx: int | None,
        use_mask: bool,
        label_smoothing: float,
        chunk_size: int,
        wrap: bool,
    ) -> None:
        decoder_output, proj, targets, target_mask = _make_inputs(shape)

        # A plain projection takes the fused path for summed and mean losses
        # with gradients; any other, the checkpointed path.
        final_proj = _WrappedProjection(proj) if wrap else proj

        mask = target_mask if use_mask else None

        expected = cross_entropy(
            proj(decoder_output),
            targets,
            pad_idx,
            label_smoothing=label_smoothing,
            target_mask=mask,
            reduction=reduction,
        )

        actual = chunked_cross_entropy(
            decoder_output,
            final_proj,
            targets,
            pad_idx,
            label_smoothing=label_smoothing,
            target_mask=mask,
            reduction=reduction,
            chunk_size=chunk_size,
        )

        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)

        # A weighted sum makes every element of a 'none' reduction count.
        weights = torch.rand(expected.shape, dtype=torch.float32)

        assert proj.bias is not None

        params = [decoder_output, proj.weight, proj.bias]

        expected_grads = torch.autograd.grad((expected * weights).sum(), params)
        actual_grads = torch.autograd.grad((actual * weights).sum(), params)

        for name, a, e in zip(["decoder_output", "weight", "bias"], actual_grads, expected_grads):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    @pytest.mark.parametrize("path", ["fused", "checkpointed"])
    def test_keeps_no_logits_for_the_backward_pass(self, path: str) -> None:
        decoder_output, proj, targets, target_mask = _make_inputs((64,))

        # Projections other than plain ones take the checkpointed path.
        final_proj = proj if path == "fused" else _WrappedProjection(proj)

        saved_shapes: list[tuple[int, ...]] = []

        def pack(tensor: Tensor) -> Tensor:
            saved_shapes.append(tuple(tensor.shape))

            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = chunked_cross_entropy(
                decoder_output, final_proj, targets, None, target_mask=target_mask, chunk_size=8
            )

        logit_shapes = [s for s in saved_shapes if len(s) == 2 and s[-1] == VOCAB_SIZE]

        assert logit_shapes == [], f"Saved logits of shapes {logit_shapes} for the backward pass."

        loss.backward()

        assert decoder_output.grad is not None

        expected = cross_entropy(proj(decoder_output), targets, None, target_mask=target_mask)

        expected_grad, = torch.autograd.grad(expected, decoder_output)

        torch.testing.assert_close(decoder_output.grad, expected_grad, rtol=1e-5, atol=1e-6)

    def test_mean_of_no_target_is_nan_as_in_fairseq2(self) -> None:
        decoder_output, proj, targets, _ = _make_inputs((6,))

        no_target = torch.zeros_like(targets, dtype=torch.bool)

        loss = chunked_cross_entropy(decoder_output, proj, targets, None, target_mask=no_target, reduction="mean")

        assert torch.isnan(loss)

        assert torch.isnan(cross_entropy(proj(decoder_output), targets, None, target_mask=no_target, reduction="mean"))

    def test_raises_error_when_chunk_size_is_not_positive(self) -> None:
        decoder_output, proj, targets, _ = _make_inputs((4,))

        with pytest.raises(ValueError, match=r"`chunk_size` must be greater than or equal to 1, but is 0 instead\."):
            chunked_cross_entropy(decoder_output, proj, targets, None, chunk_size=0)

    def test_raises_error_when_target_mask_is_not_boolean(self) -> None:
        decoder_output, proj, targets, target_mask = _make_inputs((4,))

        with pytest.raises(TypeError, match=r"`target_mask` must be a boolean tensor"):
            chunked_cross_entropy(decoder_output, proj, targets, None, target_mask=target_mask.float())

    def test_raises_error_when_shapes_do_not_match(self) -> None:
        decoder_output, proj, targets, _ = _make_inputs((2, 5))

        with pytest.raises(ValueError, match=r"`decoder_output` must be of shape"):
            chunked_cross_entropy(decoder_output[:, :4], proj, targets, None)


class TestInstallChunkedLMLoss:
    @pytest.mark.parametrize("pad_idx", [None, 0])
    def test_model_loss_matches_unchunked_loss(self, pad_idx: int | None) -> None:
        config = tiny_qwen35_config()

        config.pad_idx = pad_idx

        torch.manual_seed(1)

        # The factory installs the chunked loss with its default chunk size;
        # a small one makes this batch span several chunks.
        model = install_chunked_lm_loss(create_qwen35_model(config), chunk_size=5)

        seqs = torch.randint(0, config.vocab_size, (2, 9))
        seqs[0, 3] = 0

        target_mask = torch.ones_like(seqs, dtype=torch.bool)
        target_mask[1, :4] = False

        layout = BatchLayout.of(seqs[:, :-1])

        targets, mask = seqs[:, 1:], target_mask[:, 1:]

        # `return_logits=True` takes fairseq2's unchunked `compute_loss` path.
        expected, _ = model(seqs[:, :-1], layout, targets, target_mask=mask, label_smoothing=0.1, return_logits=True)

        expected.backward()

        expected_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]

        model.zero_grad()

        actual = model(seqs[:, :-1], layout, targets, target_mask=mask, label_smoothing=0.1)

        actual.backward()

        actual_grads = [p.grad for p in model.parameters() if p.grad is not None]

        torch.testing.assert_close(actual, expected)

        assert len(actual_grads) == len(expected_grads)

        for a, e in zip(actual_grads, expected_grads):
            torch.testing.assert_close(a, e)

    def test_factory_installs_the_chunked_loss(self) -> None:
        model = create_qwen35_model(tiny_qwen35_config())

        loss_fn = model.compute_fused_loss.__func__.func  # type: ignore[attr-defined]

        assert loss_fn.__name__ == "_compute_chunked_fused_loss"
