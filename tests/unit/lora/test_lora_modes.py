"""A model with LoRA adapters on every target trains under activation
checkpointing, in bf16, on packed batches and on the fla Gated DeltaNet
kernels as it does without them (FSDP2 and tensor parallelism:
tests/integration/lora/).

The adapters' ``B`` is random, not zero as in a new adapter, so that every
adapter changes its projection's output and has gradients of its own."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout

from fla_interpreter import fla_test_device
from qwen35_fs2.lora import LoraConfig, apply_lora
from qwen35_fs2.models.qwen35 import create_qwen35_model, tiny_qwen35_config
from qwen35_fs2.models.qwen35.config import LayerType
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.nn.lora import LoraAdapter
from qwen35_fs2.ops.backend import GdnBackendRequest, fla_unavailable_reason
from qwen35_fs2.parallel import apply_ac_to_qwen35

# Two documents and (but on the fla kernels, to keep them quick) a padded
# tail, a document of its own, in one packed row.
_LENGTHS = [7, 11]

_NUM_PADS = 2

_VOCAB_SIZE = 1024


def _lora_model(
    *,
    moe: bool = False,
    gdn_backend: GdnBackendRequest = "torch",
    confident: bool = False,
    layer_types: list[LayerType] | None = None,
) -> TransformerLM:
    """The tiny model (``moe``: its MoE sibling, whose adapters include the
    shared experts') with rank-4 adapters on every target, ``B`` random.

    ``confident``: ten times larger logits (the final norm's scale, which is
    ``1 + weight``, times ten). A model whose predictions are close to
    uniform has a loss that hardly depends on its logits, and so on their
    rounding in bf16."""
    torch.manual_seed(0)

    config = tiny_qwen35_moe_config() if moe else tiny_qwen35_config()

    config.gdn_backend = gdn_backend

    if layer_types is not None:
        config.num_layers, config.layer_types = len(layer_types), layer_types

    model = create_qwen35_moe_model(config) if moe else create_qwen35_model(config)  # type: ignore[arg-type]

    adapters = apply_lora(model, LoraConfig(r=4, alpha=8.0), config)

    with torch.no_grad():
        for adapter in adapters.values():
            adapter.b_proj.weight.normal_(std=0.02)

        if confident:
            model.decoder.layer_norm.weight.add_(9.0)

    return model.train()  # type: ignore[return-value]


def _packed_batch(num_pads: int = _NUM_PADS, device: torch.device | None = None) -> tuple[Tensor, Tensor, BatchLayout]:
    generator = torch.Generator().manual_seed(1)

    width = sum(_LENGTHS) + num_pads

    seqs = torch.randint(1, _VOCAB_SIZE, (width,), generator=generator)

    targets = torch.randint(1, _VOCAB_SIZE, (width,), generator=generator)

    return seqs.to(device), targets.to(device), BatchLayout((width,), _LENGTHS, packed=True, device=device)


def _adapter_gradients(model: TransformerLM) -> dict[str, Tensor]:
    # Activation checkpointing inserts its wrapper into the names.
    gradients = {
        name.replace("_checkpoint_wrapped_module.", ""): param.grad
        for name, param in model.named_parameters()
        if param.requires_grad
    }

    assert gradients and all(".lora." in name for name in gradients), list(gradients)

    missing = [name for name, grad in gradients.items() if grad is None]

    assert not missing, missing

    return gradients  # type: ignore[return-value]


def _step(model: TransformerLM) -> tuple[Tensor, dict[str, Tensor]]:
    """The summed next-token loss of the packed batch, and the gradient of
    every adapter parameter after its backward pass."""
    seqs, targets, layout = _packed_batch()

    loss = model(seqs, layout, targets, reduction="sum")

    loss.backward()

    return loss.detach(), _adapter_gradients(model)


def _relative_rms_error(actual: Tensor, expected: Tensor) -> float:
    expected = expected.float()

    return float((actual.float() - expected).norm() / expected.norm())


class TestLoraUnderActivationCheckpointing:
    @pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
    def test_gives_the_loss_and_adapter_gradients_of_the_model_without_it(self, moe: bool) -> None:
        expected_loss, expected_gradients = _step(_lora_model(moe=moe))

        # As the recipes: adapters first (`setup_model`), then fairseq2's
        # layerwise checkpointing through the family's applier.
        model = apply_ac_to_qwen35(_lora_model(moe=moe), every_nth_layer=1)

        assert all(isinstance(layer, CheckpointWrapper) for layer in model.decoder.layers)

        # Every adapter must run again when its layer is recomputed in the
        # backward pass; one skipped there would have no activations to
        # differentiate through, or others than those of the forward pass.
        # Counted as it starts: the recomputation stops as soon as it has the
        # last activation that the backward pass needs, which may lie inside
        # an adapter (that of `ffn.output_proj`). The layers' input requires
        # no gradient (the embeddings are frozen): fairseq2's non-reentrant
        # checkpointing differentiates the adapters inside all the same,
        # where a reentrant one would not (the loss would have no gradient).
        runs: Counter[str] = Counter()

        for name, module in model.named_modules():
            if isinstance(module, LoraAdapter):
                module.register_forward_pre_hook(lambda m, args, name=name: runs.update([name]))

        loss, gradients = _step(model)  # type: ignore[arg-type]

        assert runs and set(runs.values()) == {2}, runs

        # The same operations on the same values: bit for bit.
        assert torch.equal(loss, expected_loss), (loss, expected_loss)

        assert gradients.keys() == expected_gradients.keys()

        unequal = [name for name, grad in gradients.items() if not torch.equal(grad, expected_gradients[name])]

        assert not unequal, unequal


# bf16 keeps 8 bits of mantissa: one rounding is off by up to 2^-8 (0.39%)
# of the value. Nothing is trained, so the loss differs from fp32 by the
# roundings of one forward pass and stays within one rounding of the loss
# itself (measured: 2.8e-4 relative under autocast, 1.1e-4 with bf16
# weights). An adapter's gradient sums products of a forward and a backward
# pass, each rounded a few times: measured, all but one (below) are within
# 3.1% (autocast) and 3.8% (bf16 weights) of fp32 (RMS, relative to the
# norm). 7%, as for the MTP head (tests/unit/recipes/test_mtp_loss.py),
# leaves twice that; a wrong computation is off by its whole size (a missing
# or doubled term; measured: every adapter's update 10% too large in bf16
# moves the loss by 0.47% and the gradients by up to 20%).
_BF16_LOSS_RTOL = 2**-8

_BF16_GRAD_RTOL = 0.07


class TestLoraInBf16:
    @pytest.mark.parametrize("precision", ["autocast", "bf16_weights"])
    def test_stays_within_bf16_rounding_of_fp32(self, precision: str) -> None:
        expected_loss, expected_gradients = _step(_lora_model(confident=True))

        if precision == "autocast":
            # How one process trains with `mixed_precision.mode` `static` or
            # `auto`: fp32 weights (the adapters' too), bf16 GEMMs.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, gradients = _step(_lora_model(confident=True))
        else:
            # A bf16 base, as a model loaded with `model.dtype: bfloat16`
            # (or FSDP2's `static` mixed precision); the adapters are bf16 too.
            loss, gradients = _step(_lora_model(confident=True).to(torch.bfloat16))

        torch.testing.assert_close(loss.float(), expected_loss, rtol=_BF16_LOSS_RTOL, atol=0)

        nonfinite = [name for name, grad in gradients.items() if not grad.isfinite().all()]

        assert not nonfinite, nonfinite

        errors = {name: _relative_rms_error(grad, expected_gradients[name]) for name, grad in gradients.items()}

        # `B` of an `in_proj_a` adapter gets the gradient of the Gated
        # DeltaNet's decay input `a`, token by token (`a + dt_bias` enters
        # the decay), summed over the tokens: the sum of terms of both signs
        # that the gradient of `dt_bias` is. Its precision is the trunk's
        # (tests/integration/models/test_bf16_parity.py), not the adapter's:
        # measured in layer 0, `dt_bias`'s gradient is 12% (autocast) and 7%
        # (bf16 weights) off, that `B`'s 24% and 32%.
        large = {
            name: error
            for name, error in errors.items()
            if error > _BF16_GRAD_RTOL and ".in_proj_a.lora.b_proj." not in name
        }

        assert not large, large


def _split_documents(x: Tensor) -> list[Tensor]:
    return list(x[: sum(_LENGTHS)].split(_LENGTHS))


class TestLoraOnPackedBatches:
    @pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
    def test_gives_every_document_its_logits_alone(self, moe: bool) -> None:
        model = _lora_model(moe=moe)

        seqs, _, layout = _packed_batch()

        with torch.no_grad():
            packed_logits = _split_documents(model(seqs, layout))

            # Every document alone, a batch of one unpacked sequence.
            expected = [model(doc.unsqueeze(0), BatchLayout((1, doc.numel()), None)).squeeze(0) for doc in _split_documents(seqs)]

        # Both Gated DeltaNet and attention layers see the document
        # boundaries: any state, convolution window or attention score
        # carried into the second document changes its logits by far more
        # than the fp32 rounding of the other batch shape (measured: 3.6e-7
        # at most, on logits of size 1; a Gated DeltaNet state carried over
        # moves the second document's by 0.58, attention across the boundary
        # by 0.37).
        for idx, (logits, doc_logits) in enumerate(zip(packed_logits, expected)):
            torch.testing.assert_close(logits, doc_logits, rtol=1e-5, atol=1e-5, msg=lambda m, idx=idx: f"document {idx}: {m}")

        # The adapters matter: without them, the logits are others.
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, LoraAdapter):
                    module.b_proj.weight.zero_()

            base_logits = _split_documents(model(seqs, layout))

        for logits, doc_base_logits in zip(packed_logits, base_logits):
            assert _relative_rms_error(logits, doc_base_logits) > 0.1


_FLA_DEVICE = fla_test_device()

# The RMS error relative to the RMS of the torch kernels', the tolerance of
# tests/unit/nn/test_gated_deltanet_fla.py in fp32 (measured: the logits and
# every adapter gradient within 6e-7, except those of `in_proj_a`, the
# decay's input, within 2.8e-5: fla sums a chunk's log decays in fp32, we in
# fp64; measured against an fp64 run, ours are within 2.5e-6, fla's 2.9e-5).
_FLA_RTOL = 1e-4


def _fla_step(gdn_backend: GdnBackendRequest) -> dict[str, Tensor]:
    """The logits of the packed batch and the gradient of every adapter
    parameter, on ``_FLA_DEVICE``, of a model of one Gated DeltaNet and one
    attention layer: the interpreter runs a Gated DeltaNet layer's forward
    and backward pass in seconds, per document and head."""
    model = _lora_model(gdn_backend=gdn_backend, layer_types=["linear_attention", "full_attention"]).to(_FLA_DEVICE)

    seqs, targets, layout = _packed_batch(num_pads=0, device=_FLA_DEVICE)

    loss, logits = model(seqs, layout, targets, reduction="sum", return_logits=True)

    loss.backward()

    return {"logits": logits.detach(), **_adapter_gradients(model)}


@pytest.mark.skipif(_FLA_DEVICE is None, reason="the fla kernels need a CUDA device or Triton's interpreter")
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # The interpreter evaluates masked-out lanes too.
class TestLoraOnFlaKernels:
    def test_gives_the_logits_and_adapter_gradients_of_the_torch_kernels(self) -> None:
        reason = fla_unavailable_reason()

        if reason is not None:
            pytest.skip(f"the fla backend is unavailable: {reason}")

        expected = _fla_step("torch")

        # fp32 (the interpreter runs nothing else correctly), on the packed
        # batch: fla's variable-length kernels.
        actual = _fla_step("fla")

        assert actual.keys() == expected.keys()

        errors = {name: _relative_rms_error(value, expected[name]) for name, value in actual.items()}

        large = {name: error for name, error in errors.items() if error > _FLA_RTOL}

        assert not large, large
