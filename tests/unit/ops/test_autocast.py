"""Every custom autograd function of the package under ``torch.autocast``
(CPU, bf16), forward and backward, against the fp32 path.

The inputs of both paths hold the same values: the autocast path gets them in
the dtypes the model produces under autocast (bf16 activations, fp32 log
decays), the fp32 path the same values upcast. The outputs may then differ
only by the rounding of the bf16 outputs and gradients, a relative RMS error
of about 2^-9; errors of a broken dtype policy are of order 1, or crash.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from fairseq2.nn import Linear

from qwen35_fs2.recipes.loss import chunked_cross_entropy
from qwen35_fs2.nn.moe.experts import ExpertDispatch, RoutedExperts
from qwen35_fs2.ops import causal_conv1d, chunk_gated_delta_rule
from qwen35_fs2.ops.autocast import autocast_dtype

from .helpers import assert_close, cu_seqlens_of, make_delta_rule_inputs

BF16 = torch.bfloat16

# Relative RMS error of bf16-rounded outputs and gradients.
BF16_RATIO = 1e-2


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=BF16)


def _leaves(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: t.detach().clone().requires_grad_() for name, t in tensors.items()}


def _run(
    fn: Callable[..., Tensor | tuple[Tensor | None, ...]],
    inputs: dict[str, Tensor],
    cotangents: list[Tensor],
    *,
    autocast: bool,
    backward_under_autocast: bool = False,
) -> dict[str, Tensor]:
    """Runs ``fn(**leaves)``, backpropagates ``cotangents`` through its
    tensor outputs, and returns the outputs and the gradients of every input."""
    leaves = _leaves(inputs)

    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        outputs = fn(**leaves)

    if isinstance(outputs, Tensor):
        outputs = (outputs,)

    pairs = [(out, cot) for out, cot in zip(outputs, cotangents) if out is not None]

    # On CPU the backward pass runs in the calling thread, so a backward
    # called inside the autocast context runs under autocast.
    with torch.autocast("cpu", dtype=BF16, enabled=backward_under_autocast):
        torch.autograd.backward([o for o, _ in pairs], [c.to(o.dtype) for o, c in pairs])

    results = {f"out{idx}": out.detach() for idx, (out, _) in enumerate(pairs)}

    for name, leaf in leaves.items():
        assert leaf.grad is not None, f"d{name}: no gradient"

        assert leaf.grad.dtype == leaf.dtype, f"d{name}: {leaf.grad.dtype} != {leaf.dtype}"

        results[f"d{name}"] = leaf.grad

    return results


def _assert_matches_fp32_path(
    fn: Callable[..., Tensor | tuple[Tensor | None, ...]],
    inputs: dict[str, Tensor],
    cotangents: list[Tensor],
    ratios: dict[str, float] | None = None,
) -> dict[str, Tensor]:
    """``inputs`` are in the dtypes of the autocast path; the fp32 path gets
    the same values in fp32."""
    fp32_inputs = {name: t.float() for name, t in inputs.items()}

    expected = _run(fn, fp32_inputs, cotangents, autocast=False)

    for backward_under_autocast in (False, True):
        actual = _run(fn, inputs, cotangents, autocast=True, backward_under_autocast=backward_under_autocast)

        assert actual.keys() == expected.keys()

        for name, value in expected.items():
            ratio = (ratios or {}).get(name, BF16_RATIO)

            assert_close(name, value, actual[name], ratio)

    return actual


class TestAutocastDtype:
    def test_is_the_autocast_dtype_inside_autocast_only(self) -> None:
        x = torch.zeros(2)

        assert autocast_dtype(x) == torch.float32

        with _autocast():
            assert autocast_dtype(x) == BF16


class TestChunkGatedDeltaRuleUnderAutocast:
    @pytest.mark.parametrize("lengths", [None, [1, 63, 64, 65, 7]], ids=["B2-T130", "packed"])
    def test_outputs_and_gradients_match_fp32_path(self, lengths: list[int] | None) -> None:
        batch_size, seq_len = (2, 130) if lengths is None else (1, sum(lengths))

        num_seqs = batch_size if lengths is None else len(lengths)

        delta = make_delta_rule_inputs(batch_size, seq_len, 2, 4, 16, 16, max_decay=16.0, seed=3)

        gen = torch.Generator().manual_seed(4)

        # As the model makes them under autocast: q, k, v and beta come out
        # of bf16 GEMMs, the log decay is formed in fp32.
        inputs = {
            "q": delta.q.to(BF16),
            "k": delta.k.to(BF16),
            "v": delta.v.to(BF16),
            "g": delta.g,
            "beta": delta.beta.to(BF16),
            "initial_state": torch.randn(num_seqs, 4, 16, 16, generator=gen),
        }

        cotangents = [torch.randn(batch_size, seq_len, 4, 16, generator=gen), torch.randn(num_seqs, 4, 16, 16, generator=gen)]

        cu_seqlens = None if lengths is None else cu_seqlens_of(lengths)

        def fn(**kwargs: Tensor) -> tuple[Tensor, Tensor | None]:
            return chunk_gated_delta_rule(**kwargs, output_final_state=True, cu_seqlens=cu_seqlens)  # type: ignore[arg-type]

        actual = _assert_matches_fp32_path(fn, inputs, cotangents)

        # The output in the dtype of `v`, the state in fp32.
        assert actual["out0"].dtype == BF16
        assert actual["out1"].dtype == torch.float32


class TestCausalConv1dUnderAutocast:
    @pytest.mark.parametrize("lengths", [None, [1, 3, 40, 2]], ids=["B2-T46", "packed"])
    def test_outputs_and_gradients_match_fp32_path(self, lengths: list[int] | None) -> None:
        batch_size, seq_len = (2, 46) if lengths is None else (1, sum(lengths))

        num_seqs = batch_size if lengths is None else len(lengths)

        gen = torch.Generator().manual_seed(5)

        inputs = {
            "x": torch.randn(batch_size, seq_len, 24, generator=gen).to(BF16),
            "weight": torch.randn(24, 4, generator=gen).to(BF16).float(),
            "initial_state": torch.randn(num_seqs, 24, 3, generator=gen).to(BF16),
        }

        cotangents = [torch.randn(batch_size, seq_len, 24, generator=gen), torch.randn(num_seqs, 24, 3, generator=gen)]

        cu_seqlens = None if lengths is None else cu_seqlens_of(lengths)

        def fn(**kwargs: Tensor) -> tuple[Tensor, Tensor | None]:
            return causal_conv1d(**kwargs, output_final_state=True, cu_seqlens=cu_seqlens)  # type: ignore[arg-type]

        actual = _assert_matches_fp32_path(fn, inputs, cotangents)

        assert actual["out0"].dtype == BF16


class TestFusedLinearCrossEntropyUnderAutocast:
    def test_loss_and_gradients_match_fp32_path(self) -> None:
        gen = torch.Generator().manual_seed(6)

        targets = torch.randint(0, 101, (3, 20), generator=gen)

        # In bf16-representable values, as autocast casts them.
        inputs = {
            "decoder_output": torch.randn(3, 20, 32, generator=gen).to(BF16).float(),
            "weight": torch.randn(101, 32, generator=gen).to(BF16).float(),
        }

        def fn(decoder_output: Tensor, weight: Tensor) -> Tensor:
            proj = Linear(32, 101, bias=False)

            # The leaf itself as the weight, so that its gradient is checked.
            del proj.weight

            proj.weight = weight  # type: ignore[assignment]

            return chunked_cross_entropy(decoder_output, proj, targets, pad_idx=None, reduction="sum", chunk_size=16)

        _assert_matches_fp32_path(fn, inputs, [torch.tensor(0.7)])


class TestRoutedExpertsUnderAutocast:
    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    def test_outputs_and_gradients_match_fp32_path(self, dispatch: ExpertDispatch) -> None:
        gen = torch.Generator().manual_seed(7)

        experts = RoutedExperts(4, 16, 8, dispatch=dispatch)

        tokens_per_expert = torch.tensor([5, 0, 9, 2])

        inputs = {
            "seqs": torch.randn(16, 16, generator=gen).to(BF16).float(),
            "gate_inner_proj": (0.3 * torch.randn(4, 16, 16, generator=gen)).to(BF16).float(),
            "output_proj": (0.3 * torch.randn(4, 16, 8, generator=gen)).to(BF16).float(),
        }

        def fn(seqs: Tensor, gate_inner_proj: Tensor, output_proj: Tensor) -> Tensor:
            del experts.gate_inner_proj, experts.output_proj

            experts.gate_inner_proj = gate_inner_proj  # type: ignore[assignment]
            experts.output_proj = output_proj  # type: ignore[assignment]

            return experts(seqs, tokens_per_expert)  # type: ignore[no-any-return]

        # Two bf16 GEMMs (autocast's choice for them) round twice.
        _assert_matches_fp32_path(fn, inputs, [torch.randn(16, 16, generator=gen)], {"out0": 2e-2, "dseqs": 2e-2, "dgate_inner_proj": 2e-2, "doutput_proj": 2e-2})
